"""A weight-transfer backend for a vLLM sampler on the learner's own host: "shm", the CPU analogue
of vLLM's CUDA IPC engine (vllm/distributed/weight_transfer/ipc_engine.py): the learner shares
memory with the sampler instead of sending bytes through a socket.

- At `trainer_init` the learner creates one anonymous shared-memory file (`memfd_create`: it has
  no name under /dev/shm, so nothing can be left behind there, whichever side crashes), sized for
  every parameter at a 64-byte aligned offset, and maps it. The sampler's worker opens the same
  file through /proc/<learner pid>/fd/<fd> and maps it too; then the learner closes its descriptor.
  The memory lives exactly as long as one of the two mappings (freed when both processes are gone,
  however they end; in the learner the mapping is held by the engine and by the parameters in it).
- The learner's parameters move into the buffer (share_parameters: the learner trains in it), so a
  push copies nothing on the learner's side; where they cannot (a cast to the sampler's dtype), a
  push first copies them in (done before `start_weight_update`, so the sampler keeps decoding
  meanwhile). Then it drives start -> update -> finish through the client. The worker's update
  loads views of the buffer into the weights it kept (`model.load_weights`: one more copy, no
  allocation); finish repacks the linear layers for the CPU GEMM
  (gloo_transfer.GlooWeightTransferEngine, whose start/finish this engine shares).
- Nothing waits on a lock, semaphore or socket of its own: every wait is an RPC through the client
  (vllm_sampler.Sampler: deadlines, a dead sampler is a SamplerError).

Measured at 54M parameters (207 MiB fp32, tied 32k embedding; benchmarks/push_bandwidth.py, 2 cores),
before the parameters moved into the buffer: a push ~90 ms (gloo over loopback ~150 ms), a memcpy of the same bytes ~12
ms. Of the push: the learner's copy ~13 ms, the worker's load ~17 ms, the repack ~57 ms (linears 43, tied lm_head 14),
the three RPCs ~1.5 ms. The repack is the floor: vLLM's CPU GEMM reads oneDNN-packed weights, and
dispatch_cpu_unquantized_gemm builds a new packed copy each time (vllm/model_executor/layers/
utils.py:587, ops.create_onednn_mm; the handler reorders into memory it allocates, vLLM's
csrc/cpu/dnnl_helper.cpp prepack_weight), a reorder ~5x slower than a memcpy; without the packing
the GEMMs ran ~2.4x slower at 8-256 rows. Costs one more copy of the weights in (shared) memory,
for as long as the trainer engine lives.

Only for a sampler on the same host (placement "cpu"); a server on another host needs gloo.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from fastrl.gloo_transfer import GlooWeightTransferEngine, TransferError

ALIGN = 64  # bytes: each tensor starts on a cache line


def layout(dtypes: list[torch.dtype], shapes: list) -> tuple[list[int], int]:
    """Byte offset of each tensor in the shared buffer, and the buffer's size."""
    offsets, size = [], 0
    for dtype, shape in zip(dtypes, shapes):
        offsets.append(size)
        size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, max(size, ALIGN)


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """Map the shared-memory file at `path` (read-write, shared) as a flat uint8 tensor of exactly
    `nbytes`, checking its size first (torch's from_file would grow a smaller file)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise TransferError(f"the shared weight buffer {path} has {size} bytes, expected {nbytes}")
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def views(buffer: torch.Tensor, dtypes: list[torch.dtype], shapes: list, offsets: list[int]) -> list[torch.Tensor]:
    out = []
    for dtype, shape, offset in zip(dtypes, shapes, offsets):
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + nbytes > buffer.numel():
            raise TransferError(f"a tensor at bytes [{offset}, {offset + nbytes}) lies outside the shared buffer "
                                f"({buffer.numel()} bytes)")
        out.append(buffer[offset: offset + nbytes].view(dtype).view(shape))
    return out


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    pid: int  # the learner, which holds the buffer's descriptor until the worker has mapped it
    fd: int
    nbytes: int


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]  # bytes into the shared buffer


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "shm"


class ShmWeightTransferEngine(GlooWeightTransferEngine):
    """Worker side: map the learner's buffer once; each update loads views of it in place. Start
    and finish (in-place load of the kept linear weights and their repacking, or vLLM's layerwise
    reload where they were not kept; the tied lm_head) are the gloo engine's."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    buffer: torch.Tensor | None = None

    def init_transfer_engine(self, init_info):
        if self.parallel_config.world_size != 1:
            raise TransferError("the shm weight transfer serves a single-process sampler (no tensor/pipeline "
                                "parallelism)")
        self.buffer = map_shared(f"/proc/{init_info.pid}/fd/{init_info.fd}", init_info.nbytes)
        if self.device.type == "cpu":
            self.reuse_freed_memory()  # for the repack's allocations (gloo_transfer.GlooWeightTransferEngine)

    def receive_weights(self, update_info):
        if self.buffer is None:
            raise TransferError("init_weight_transfer_engine was not called")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        tensors = views(self.buffer, dtypes, update_info.shapes, update_info.offsets)
        self.load(list(zip(update_info.names, tensors)))  # the gloo engine's: records what loaded, names a bad tensor

    def shutdown(self):
        self.buffer = None  # unmapped once the last view is gone


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Learner side: create and map the shared buffer; per push copy the parameters into it, then
    drive start -> update -> finish through the client (plain sequential RPCs: no transfer runs
    beside them, so nothing here can wait on a dead peer)."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("the shm weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        meta = source.metadata()
        engine.names = [m.name for m in meta]
        engine.dtypes = [m.dtype for m in meta]
        engine.shapes = [list(m.shape) for m in meta]
        engine.offsets, nbytes = layout(engine.dtypes, engine.shapes)
        fd = os.memfd_create("fastrl-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            engine.buffer = map_shared(f"/proc/self/fd/{fd}", nbytes)
            engine.views = views(engine.buffer, engine.dtypes, engine.shapes, engine.offsets)
            engine.copy_weights()  # not loaded yet; this faults the buffer's pages in now, not at the first push
            engine.share_parameters()
            client.init_weight_transfer_engine(dict(pid=os.getpid(), fd=fd, nbytes=nbytes))
        finally:
            os.close(fd)  # from here on only the two mappings hold the memory
        engine.update_info = dict(names=engine.names, dtype_names=[str(d).split(".")[-1] for d in engine.dtypes],
                                  shapes=engine.shapes, offsets=engine.offsets)
        return engine

    def share_parameters(self) -> None:
        """Where the source sends a module's parameters as they are (vLLM's ModuleSource: no cast, no
        gather), move each parameter's data into its place in the shared buffer (`param.data` = the view;
        the Parameter objects, and so the optimizer's hold on them, stay the same): the learner then trains
        in the buffer, a push copies nothing on the learner's side and costs the sampler's load alone (the
        floor, benchmarks/foundation.py push_vs_floor), and the learner's own copy of the weights is freed.
        The sampler reads the buffer only during an update, which the learner waits for (send_weights)."""
        if type(self.source) is not ModuleSource:
            return  # a cast (weight_sync.sampler_source's CastSource) or other source: pushes copy
        params = dict(self.source._module.named_parameters())
        with torch.no_grad():
            for name, view in zip(self.names, self.views):
                param = params.get(name)
                if type(param) is torch.nn.Parameter and param.device.type == "cpu" and param.is_contiguous() \
                        and param.dtype == view.dtype and param.shape == view.shape:
                    param.data = view  # (copy_weights put its values there)

    def copy_weights(self) -> None:
        """Every parameter into its view of the buffer; a source that casts (weight_sync's CastSource: cast_into)
        casts straight into it, one pass over the weights and no cast copy made."""
        i, cast_into = -1, getattr(self.source, "cast_into", None)
        with torch.no_grad():
            for i, (name, tensor) in enumerate(self.source.uncast() if cast_into else self.source):
                if i >= len(self.names) or name != self.names[i] or list(tensor.shape) != self.shapes[i] \
                        or (tensor.dtype != self.dtypes[i] and not cast_into):
                    raise TransferError(f"the model's parameters changed since init_weight_sync (at {name!r}): "
                                        "call init_weight_sync again")
                if cast_into:
                    cast_into(name, tensor, self.views[i])
                elif tensor.data_ptr() != self.views[i].data_ptr():  # (a shared parameter is already there)
                    self.views[i].copy_(tensor.detach())
        if i + 1 != len(self.names):
            raise TransferError(f"the model has {i + 1} parameters, {len(self.names)} at init_weight_sync: "
                                "call it again")

    def send_weights(self):
        # The previous push has been loaded (its update RPC returned): the buffer is ours to write,
        # while the sampler keeps decoding.
        self.copy_weights()
        self.client.start_weight_update()
        self.client.update_weights(self.update_info)
        self.client.finish_weight_update()

    def shutdown(self):
        self.views = []
        self.buffer = None
