"""A weight-transfer backend for vLLM on CPU: "gloo". vLLM's own backends (`nccl`, `ipc`) need
CUDA; this one follows their shape (vllm/distributed/weight_transfer/base.py): a worker-side
engine that receives and loads, a trainer-side engine that drives start -> update (concurrent
with its broadcast) -> finish through the client, and init/update info dataclasses.

Importing this module imports vLLM (seconds), so vllm_sampler imports it only when a sampler
starts; `register()` makes vLLM's factories know "gloo" (in the learner and in the sampler).
"""

from __future__ import annotations

import math
import os
import socket
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

GROUP_TIMEOUT = timedelta(seconds=float(os.environ.get("FASTRL_WEIGHT_TIMEOUT", "60")))
PACK_BYTES = 256 * 2**20


class TransferError(RuntimeError):
    """The rendezvous or a transfer failed (vllm_sampler turns it into a SamplerError)."""


def pack_plan(dtypes: list[torch.dtype], shapes: list) -> list[list[int]]:
    """Group parameter indices into flat broadcast buffers of one dtype and at most PACK_BYTES:
    one broadcast per chunk instead of one per tensor (85 -> 39 ms per push for the tiny model).
    Learner and sampler compute the same plan from the same metadata."""
    chunks: list[list[int]] = []
    size = 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        nbytes = math.prod(shape) * dtype.itemsize
        if not chunks or dtypes[chunks[-1][0]] != dtype or size + nbytes > PACK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nbytes
    return chunks


def gloo_group(host: str, port: int, rank: int, world_size: int, timeout: timedelta, listen_socket=None):
    """A gloo process group outside torch.distributed's global state (vLLM's
    stateless_init_torch_distributed_process_group, with the gloo device bound to `host`: vLLM's
    binds to whatever the machine's hostname resolves to, which may be a public interface).
    Rank 0 passes a socket it already bound and listens on (`listen_socket`): no port is chosen,
    closed and bound again, so no other process can take it in between."""
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    from vllm.distributed.utils import create_tcp_store

    store = create_tcp_store(host, port, listen_socket=listen_socket, world_size=world_size, is_master=rank == 0,
                             timeout=timeout, wait_for_workers=False)
    prefix_store = PrefixStore(f"tcp://{host}:{port}", store)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    backend = ProcessGroupGloo(prefix_store, rank, world_size, options)
    group = ProcessGroup(prefix_store, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port, bound by the learner itself
    world_size: int = 2


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receive broadcasts from the learner (rank 0) and load them.

    The CPU backend packs each linear layer's weight for oneDNN and, by default, frees the
    checkpoint-format weight, so a plain load has nothing to load into; vLLM's layerwise reload
    rebuilds every layer and repacks it, mostly Python. Our sampler keeps those weights
    (keep_cpu_linear_weights, below), so an update loads them in place and repacks only the
    linear layers: a whole push of the tiny model takes ~18 ms instead of ~35 ms (at 54M parameters
    ~150 ms over loopback, ~57 ms of it the repack; the local sampler uses shm_transfer.py instead,
    ~90 ms). Where they were not kept (a quantized model, a vLLM that packs elsewhere) it falls back
    to the layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def init_transfer_engine(self, init_info):
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = gloo_group(init_info.master_address, init_info.master_port, rank,
                                init_info.world_size, GROUP_TIMEOUT)
        if self.device.type == "cpu":
            self.reuse_freed_memory()

    @staticmethod
    def reuse_freed_memory() -> None:
        """Make this (sampler) process's malloc keep freed memory for reuse. Every repack allocates a
        new oneDNN-packed copy of each linear weight and frees the old one; glibc returns big blocks
        to the OS (mmap above its threshold, heap trimming) and faults every page in again on the next
        push: at 54M parameters that was ~30 of ~92 ms of the repack (1.5 us per 4 KiB page here).
        With these settings the same blocks are reused. The sampler's memory stays at its high-water
        mark instead of shrinking (its peak is unchanged). No-op where malloc is not glibc's (a
        preloaded tcmalloc ignores mallopt)."""
        import ctypes

        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        # 1 GiB covers a 151k x 896 fp32 lm_head (Qwen2.5-0.5B); older glibc caps the threshold at 32 MiB
        if not mallopt(M_MMAP_THRESHOLD, 1 << 30):
            mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)

    def kept_linears(self) -> list | None:
        """The linear layers to repack after an in-place load, or None if their weights were not
        kept (then only the layerwise reload can load them)."""
        if not hasattr(self, "_kept_linears"):
            from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

            # The CPU backend packs every VocabParallelEmbedding for the GEMM (vocab_parallel_embedding.py,
            # UnquantizedEmbeddingMethod.process_weights_after_loading), the input embedding too: only
            # the one that computes logits uses it. With a separate lm_head, repacking embed_tokens was a
            # wasted head-sized repack per push, and the tied-head re-dispatch in finish another one
            # (~84 of ~173 ms of repacking at 54M parameters with a 32k vocab).
            head = getattr(self.model, "lm_head", None)
            layers = [m for m in self.model.modules()
                      if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
                      and not getattr(m, "_cpu_skip_gemm_dispatch", False)
                      and not (isinstance(m, VocabParallelEmbedding) and isinstance(head, torch.nn.Module)
                               and m is not head)]
            # a freed weight is an empty 1-D tensor
            kept = (self.model_config.quantization is None
                    and all(m.weight.dim() == 2 and m.weight.numel() > 0 for m in layers))
            self._kept_linears = layers if kept else None
        return self._kept_linears

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._loaded: set[str] = set()  # the model's parameters this update loaded (in place; see params_not_loaded)
        if self.kept_linears() is None:
            initialize_layerwise_reload(self.model)

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load (checkpoint name, tensor) pairs into the model and remember which of its parameters they
        filled (vLLM's load_weights returns their names: vllm/model_executor/models/utils.py
        AutoWeightsLoader.load_weights). A tensor vLLM rejects (a wrong shape, a name it does not know) is
        an error naming that tensor: vLLM's own assertion names neither (weight_utils.py:1485-1488). In
        place, a failed chunk is loaded again tensor by tensor to find it (a copy again is harmless); vLLM's
        layerwise reload cannot take a tensor twice (a failed call leaves its layer half set up), so there
        each tensor is its own call (the fallback path: ~50 calls for the tiny model)."""
        in_place = self.kept_linears() is not None
        for batch in [weights] if in_place else [[pair] for pair in weights]:
            try:
                loaded = self.model.load_weights(batch)
            except Exception as error:
                failure = error  # the chunk's error, or the first tensor's that fails alone
                for name, tensor in batch if in_place else []:
                    try:
                        self.model.load_weights([(name, tensor)])
                    except Exception as single:
                        failure = single
                        batch = [(name, tensor)]
                        break
                if len(batch) == 1:
                    name, tensor = batch[0]
                    raise TransferError(f"the sampler could not load {name!r} (shape {list(tensor.shape)}, "
                                        f"{str(tensor.dtype).split('.')[-1]}): {failure}") from failure
                raise TransferError(
                    f"the sampler could not load a chunk of {len(batch)} tensors: {failure}") from failure
            self._loaded.update(loaded or ())

    def params_not_loaded(self) -> list[str]:
        """After an in-place update (kept_linears), before finish: the model's parameters that no pushed
        tensor filled; each keeps its old weights. named_parameters() lists a tied lm_head once, under
        the embedding's name, so it is never reported."""
        return sorted({name for name, _ in self.model.named_parameters()} - self._loaded)

    def update_weights(self, update_info):
        self.receive_weights(self.parse_update_info(update_info))  # no accelerator sync on CPU

    def receive_weights(self, update_info):
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        for chunk in pack_plan(dtypes, update_info.shapes):
            flat = torch.empty(sum(math.prod(update_info.shapes[i]) for i in chunk), dtype=dtypes[chunk[0]])
            self.group.broadcast(flat, 0).wait()
            views, offset = [], 0
            for i in chunk:
                numel = math.prod(update_info.shapes[i])
                views.append((update_info.names[i], flat[offset: offset + numel].view(update_info.shapes[i])))
                offset += numel
            self.load(views)

    def finish_weight_update(self):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        repacked = self.kept_linears()
        if repacked is None:
            finalize_layerwise_reload(self.model, self.model_config)
            repacked = []
        else:  # the weights were loaded in place: repack them for the CPU GEMM (lm_head among them)
            for layer in repacked:
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        # With tied embeddings the CPU backend's packed lm_head copy stays stale after a reload:
        # re-dispatch it from the freshly loaded embedding (logprobs were off by up to 0.29), unless
        # it was just repacked above.
        head = getattr(self.model, "lm_head", None)
        if (head is not None and hasattr(head, "weight") and self.device.type == "cpu"
                and not any(head is m for m in repacked)):
            dispatch_cpu_unquantized_gemm(head, remove_weight=False)

    def shutdown(self):
        self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Learner side, the same shape as vLLM's NCCL trainer engine: drive start -> update
    (concurrently with our broadcast) -> finish through the client."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """Both sides must join at once: ours in one thread, the sampler's in another; the first
        error from either side (the sampler's own traceback included) is raised at once, and the
        whole rendezvous has a deadline."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        # the learner binds the port itself (0: any free one) and keeps it: no race for it
        listen = socket.create_server((init_info.master_address, init_info.master_port))
        port = listen.getsockname()[1]
        worker_info = dict(master_address=init_info.master_address, master_port=port, rank_offset=1,
                           world_size=init_info.world_size)
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            theirs = pool.submit(client.init_weight_transfer_engine, worker_info)
            ours = pool.submit(gloo_group, init_info.master_address, port, 0, init_info.world_size,
                               GROUP_TIMEOUT, listen)
            done, _ = wait([theirs, ours], timeout=GROUP_TIMEOUT.total_seconds(), return_when=FIRST_EXCEPTION)
            for future in (theirs, ours):
                if future in done and future.exception() is not None:
                    raise future.exception()
            if len(done) < 2:
                raise TransferError(f"the weight-sync rendezvous on {init_info.master_address}:{port} did not complete "
                                    f"within {GROUP_TIMEOUT.total_seconds():.0f}s")
            engine.group = ours.result()
        finally:
            pool.shutdown(wait=False)  # never join a thread stuck on a dead peer
        return engine

    def send_weights(self):
        meta = self.source.metadata()
        update_info = dict(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                           shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, update_info)
            tensors = [t for _, t in self.source]
            for chunk, flat in zip(pack_plan([m.dtype for m in meta], [m.shape for m in meta]),
                                   self.flat_buffers(meta)):
                torch.cat([tensors[i].detach().reshape(-1).to("cpu") for i in chunk], out=flat)
                self.group.broadcast(flat, 0).wait()
            future.result()
        finally:
            pool.shutdown(wait=False)  # never join a thread stuck on a dead peer
        self.client.finish_weight_update()

    def flat_buffers(self, meta) -> list[torch.Tensor]:
        """The packed broadcast buffers, allocated at the first push and reused: a fresh one per push
        had every page faulted in again (torch.cat took ~84 ms for 207 MiB, a copy ~13 ms). Holds one
        copy of the weights while the engine lives."""
        plan = pack_plan([m.dtype for m in meta], [m.shape for m in meta])
        wanted = [(sum(math.prod(meta[i].shape) for i in chunk), meta[chunk[0]].dtype) for chunk in plan]
        if [(f.numel(), f.dtype) for f in getattr(self, "_flat_buffers", [])] != wanted:
            self._flat_buffers = []  # free the old ones first
            self._flat_buffers = [torch.empty(numel, dtype=dtype) for numel, dtype in wanted]
        return self._flat_buffers

    def shutdown(self):
        self.group = None
        self._flat_buffers = []


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU backend keep each linear layer's weight next to its packed oneDNN copy
    (it frees it by default), so that a weight update can load in place and repack, instead of
    rebuilding every layer (see GlooWeightTransferEngine). Costs one more copy of the linear
    weights in the sampler's memory. vLLM looks the function up when it loads the model, so
    this must run in the sampler process before the engine is built."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    dispatch = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def dispatch_keeping_weight(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    dispatch_keeping_weight.keeps_weights = True
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def time_local_load(worker, model_dir: str) -> float:
    """(Run in the sampler's worker; benchmarks/foundation.py's floor for a push.) Seconds to load the
    model directory's own weights, read into this process's memory first (not timed), into the running
    engine the way a push loads (start -> vLLM's load_weights -> finish: the copy and the repack for the
    CPU GEMM): what any load into this engine pays, with no transfer at all."""
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    weights = [pair for file in sorted(Path(model_dir).glob("*.safetensors")) for pair in load_file(str(file)).items()]
    engine = worker.weight_transfer_engine
    start = time.perf_counter()
    engine.start_weight_update()
    engine.load(weights)
    engine.finish_weight_update()
    return time.perf_counter() - start


def weight_load_path(worker) -> str:
    """(Run in the sampler's worker.) How a push is loaded: in place, or through vLLM's layerwise reload."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not hasattr(engine, "kept_linears"):
        return "not the gloo engine"
    return "in place" if engine.kept_linears() is not None else "layerwise"


def layerwise_layers_not_loaded(model: torch.nn.Module) -> list[str]:
    """During vLLM's layerwise reload, before finalize_layerwise_reload: the layers that received no
    weights. vLLM's finalize puts such a layer's old weights back and only logs "<class>: Failed to load
    weights" (vllm/model_executor/model_loader/reload/layerwise.py:255-267, the `load_numel <= 0` branch),
    and then resets the counts this reads (:277 info.reset()). A layer fully loaded was processed and
    reset already (:400, so `can_load()` is False). Two such layers are expected and not reported, the ones
    vLLM logs harmlessly at every push:
    - a tensor that is a non-persistent buffer is never in a checkpoint (the rotary embedding's
      cos_sin_cache, vllm/model_executor/layers/rotary_embedding/base.py:63, persistent=False);
    - a tensor shared with another layer that did load (a tied lm_head holds embed_tokens' weight,
      vllm/model_executor/layers/vocab_parallel_embedding.py:88-92 tie_weights, models/qwen2.py:486-487).
    A layer loaded in part (fewer elements than it holds) is left to vLLM: padding (a padded vocabulary)
    does that normally (layerwise.py:269-275, "Delayed processing")."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    holders: dict[int, list[tuple[torch.nn.Module, bool]]] = {}  # id(tensor) -> (module, whether it loaded)
    for _, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        pending = info is not None and info.can_load()
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        if pending and info.kernel_tensors is not None:  # its original tensors, while it sits on the meta device
            tensors += list(info.kernel_tensors[0].values()) + list(info.kernel_tensors[1].values())
        loaded = not pending or info.load_numel > 0
        for tensor in tensors:
            if tensor is not None:
                holders.setdefault(id(tensor), []).append((module, loaded))
    failed = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or is_deferred_attention_layer(layer) or info.load_numel > 0 \
                or not info.load_numel_total:
            continue
        kernel_params, kernel_buffers = info.kernel_tensors or ({}, {})
        kernel = {**kernel_params, **kernel_buffers}
        stale = [tensor_name for tensor_name in kernel if tensor_name not in SKIP_LOAD_TENSORS
                 and tensor_name not in info.kernel_non_persistent_buffers
                 and not any(module is not layer and loaded for module,
                             loaded in holders.get(id(kernel[tensor_name]), []))]
        if stale:
            failed.append(f"{name} ({type(layer).__name__}: {', '.join(stale)})")
    return failed


def weights_not_loaded(worker) -> list[str]:
    """(Run in the sampler's worker, between update_weights and finish_weight_update.) What this update
    left with its old weights: parameters (an in-place update of ours) or layers (vLLM's layerwise reload,
    which its nccl and ipc engines and ours without kept weights use). Empty when every weight arrived."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if hasattr(engine, "kept_linears") and engine.kept_linears() is not None:
        return engine.params_not_loaded()
    model = engine.model if engine is not None else worker.model_runner.get_model()
    return layerwise_layers_not_loaded(model)
