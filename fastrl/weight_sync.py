"""Pushing the learner's weights into a sampler, shared by vllm_sampler.Sampler (a local sampler
process) and remote_sampler.RemoteSampler (running vLLM servers): which of vLLM's weight-transfer
engines a placement uses, the learner-side init info of each, and `WeightPusher` (push_weights,
background pushes from a snapshot, wait_for_push). The engines: vLLM's "nccl" (GPU to GPU, a
server on another GPU or node) and "ipc" (the learner's own GPU), and ours, registered with vLLM:
"shm" (shm_transfer.py: CPU, a sampler on this host) and "gloo" (gloo_transfer.py: CPU, a server
anywhere).
"""

from __future__ import annotations

import math
import os
import threading
import time

import torch


class SamplerError(RuntimeError):
    """The sampler process failed, died or stopped answering."""


def weight_backend(placement: str) -> str:
    """The weight-transfer engine for a placement. "cpu": the sampler runs on the learner's host, so
    through shared memory (shm_transfer.py: ~90 ms a push at 54M parameters, gloo over loopback
    ~150 ms); gloo (gloo_transfer.py) is what a server on another host needs (remote_sampler),
    and FASTRL_CPU_WEIGHT_BACKEND=gloo picks it for the local sampler too (comparisons, tests). Read
    by the learner and by the sampler process, which inherits the environment."""
    cpu = os.environ.get("FASTRL_CPU_WEIGHT_BACKEND", "shm")
    if cpu not in ("shm", "gloo"):
        raise ValueError(f"FASTRL_CPU_WEIGHT_BACKEND={cpu!r}: expected shm or gloo")
    return {"cpu": cpu, "colocate": "ipc", "separate": "nccl"}[placement]


def wait_for_learner_kernels(device: torch.device | str, cuda=torch.cuda) -> bool:
    """Before a push reads the learner's weights, wait for the kernels the learner has queued on its stream
    (optimizer.step() returns while they run). vLLM's trainer engines do not: the NCCL producer packs on
    streams of its own that never wait for the learner's (vllm/distributed/weight_transfer/packed_tensor.py:168-181,
    `_get_streams`, then `with torch.cuda.stream(streams[i])`), so a push straight after a step could send
    half-updated weights. A host wait on the learner's current stream, not the device (another stream, a
    background push's, need not finish). `cuda`: the torch.cuda module (a fake in the unit tests). Returns
    whether it waited (only for a CUDA device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    cuda.current_stream(device).synchronize()
    return True


MIN_PACKED_BYTES = 64 * 2**20


def packed_buffer_bytes(tensor_bytes: list[int]) -> int:
    """The packed staging buffer of vLLM's nccl and ipc pushes, in bytes: vLLM's default is a fixed 1 GiB
    (vllm/distributed/weight_transfer/packed_tensor.py:15), two of them on each side for NCCL (:16), allocated
    per push for IPC (:342). It must hold the largest tensor (ipc: :356-361 raises; nccl: :110-116 warns and
    overflows the chunk), and beyond that a bigger one only means fewer chunks. So: the largest tensor, at least
    MIN_PACKED_BYTES (fewer, larger chunks for models of many small tensors), never more than the whole push.
    Qwen2.5-0.5B in bf16: its 272 MB embedding instead of 1 GiB."""
    if not tensor_bytes:
        return MIN_PACKED_BYTES
    return max(max(tensor_bytes), min(sum(tensor_bytes), MIN_PACKED_BYTES))


PUSH_ROUNDINGS = ("nearest", "stochastic", "error-feedback")
SCRATCH_WORDS = 1 << 20  # stochastic_round_bf16's sums, a chunk at a time (4 MiB: in cache)
POOL_WORDS = 1 << 20  # NoisePool's draws, shared by a push's tensors (4 MiB)
PROBE_STRIDE = 61  # UpdateProbe reads every 61st block of 64 weights (prime: no alignment with rows)


def rounding_seed(seed: int, version: int) -> int:
    """The generator seed of a stochastic rounding at policy version (or step) `version` of a run seeded `seed`."""
    return seed * 1_000_003 + version


def stochastic_round_bf16(tensor: torch.Tensor, generator: torch.Generator | None, tile: int = 1 << 16,
                          scratch: torch.Tensor | None = None, noise: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """`tensor` (fp32) rounded to bf16 up or down with the probabilities that make the result's mean the input: the
    16 bits a bf16 drops, plus a uniform draw from [0, 2^16), carry into the kept bits exactly that often. One draw
    of `tile` numbers serves each tile of the tensor: every weight still rounds up with probability equal to its
    dropped fraction, push after push, as each push draws anew. The sums are made a chunk at a time in `scratch`
    (int32, SCRATCH_WORDS of them if not given; kept in cache), their dropped bits cleared, and converted as floats:
    exactly representable in bf16, so the vectorized conversion (round to nearest) keeps them as they are. `noise`:
    the tile's draws (NoisePool.take's), instead of `tile` drawn here from `generator`. `out`: where to write them
    (contiguous, bf16 or fp32: the same values; a push's transfer buffer), instead of a new bf16 tensor. Finite
    inputs only (a step with a non-finite gradient is skipped before it reaches the weights)."""
    bits = tensor.detach().reshape(-1).float().view(torch.int32)
    n = bits.numel()
    if n == 0:
        return tensor.to(torch.bfloat16) if out is None else out
    if noise is None:
        noise = torch.randint(0, 1 << 16, (min(n, tile),), dtype=torch.int32, generator=generator, device=bits.device)
    tile = noise.numel()
    if scratch is None or scratch.numel() < tile or scratch.device != bits.device:
        scratch = torch.empty(max(tile, min(n, SCRATCH_WORDS)), dtype=torch.int32, device=bits.device)
    result = torch.empty(n, dtype=torch.bfloat16, device=bits.device) if out is None else out
    out = result.view(-1)
    body, chunk = n - n % tile, scratch.numel() - scratch.numel() % tile
    for begin in range(0, n, chunk):  # (sign and magnitude: a carry into the magnitude rounds |x| up or down alike)
        end, sums = min(begin + chunk, body), scratch[: min(chunk, n - begin)]
        if end > begin:
            torch.add(bits[begin:end].view(-1, tile), noise, out=sums[: end - begin].view(-1, tile))
        if end < min(begin + chunk, n):  # the tail shorter than a tile
            torch.add(bits[body:], noise[: n - body], out=sums[end - begin:])
        out[begin:begin + sums.numel()] = sums.bitwise_and_(-1 << 16).view(torch.float32)  # the top 16 bits kept
    return result.view(tensor.shape)


def cast_stream(device: torch.device) -> tuple:
    """(device, the CUDA stream a cast's kernels go to now; None on CPU): what a push's scratch and draws are kept
    per. vLLM's NCCL producer pulls each chunk's tensors on the next of its streams, without a wait between them
    (vllm/distributed/weight_transfer/packed_tensor.py:168-189): one scratch on two streams would race."""
    return device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


class NoisePool:
    """The uniform draws of one push's (or one save's) stochastic rounding: POOL_WORDS + a tile of numbers in
    [0, 2^16) drawn once on `device`, each tensor's tile a window of them at an offset drawn on the CPU (no device
    sync). One draw, not one a tensor: SmolLM2's 272 tensors cast in half the time. Each weight still rounds up with
    probability equal to its dropped fraction; two that share a draw (~16 a draw over SmolLM2, as a tile's repeats
    within a tensor) round up together more often. Both generators are seeded from `seed` (rounding_seed)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu", tile: int = 1 << 16):
        self.offsets, self.tile = torch.Generator().manual_seed(seed ^ 0x5DEECE66D), tile  # (not the draws' stream)
        draws = torch.Generator(device=device).manual_seed(seed)
        self.noise = torch.randint(0, 1 << 16, (POOL_WORDS + tile,), dtype=torch.int32, generator=draws, device=device)

    def take(self, n: int) -> torch.Tensor:
        """The draws for a tensor of `n` elements: a window of min(n, tile) of them, at a random offset."""
        size = min(n, self.tile)
        start = int(torch.randint(0, self.noise.numel() - size + 1, (1,), generator=self.offsets))
        return self.noise[start:start + size]


class UpdateProbe:
    """What the sampler's copy of the weights kept of the learner's update since the start, read on a fixed sample of
    the weights (every PROBE_STRIDE-th of each tensor: 1/61 of them, ~2M of SmolLM2's 135M, so the figures below are
    exact to ~1e-3). Built from the starting weights; `observe(name, learner, sampler)` at each push, then `metrics()`:
    - charts/push_changed_fraction: the fraction of weights whose sampler value differs from its start;
    - charts/push_update_ratio: |sampler's update| / |learner's update| (update: now minus start);
    - charts/push_update_cosine: the cosine between the two updates;
    - charts/push_update_kept: the sampler's update projected on the learner's, over its length (1: the whole
      update on average; a round-to-nearest bf16 cast of small updates keeps a fraction of it).
    The sampler's starting copy is the start cast to `dtype` by rounding to nearest, as vLLM loads a checkpoint. From
    starting weights not exact in `dtype` (an fp32 checkpoint), a stochastic push moves weights the learner barely
    did (each to the other neighbour): the figures count that too; from a bf16 checkpoint (SmolLM2's) they do not.
    The updates sit in one flat buffer a side (each tensor's a slice of it): observe writes a tensor's slice, and
    metrics() reduces once, not a dozen small operations for each of a model's hundreds of tensors."""

    def __init__(self, model: torch.nn.Module):
        samples = {name: self.sample(p) for name, p in model.named_parameters() if p.dtype.is_floating_point}
        self.slices, offset = {}, 0
        for name, sample in samples.items():
            self.slices[name], offset = slice(offset, offset + sample.numel()), offset + sample.numel()
        device = next(iter(samples.values())).device if samples else torch.device("cpu")
        self.start = torch.cat([s.reshape(-1).float().to(device) for s in samples.values()]) if samples \
            else torch.zeros(0)
        self.learned, self.sampled = torch.zeros_like(self.start), torch.zeros_like(self.start)  # the updates
        self.set_dtype(None)

    @staticmethod
    def sample(tensor: torch.Tensor) -> torch.Tensor:
        """Every PROBE_STRIDE-th weight, read as every PROBE_STRIDE-th block of 64 where the tensor divides into them
        (a read of 1/61 of its memory instead of every cache line): a view, (blocks, 64) or flat."""
        flat = tensor.detach().reshape(-1)
        if PROBE_STRIDE > 1 and flat.numel() % 64 == 0 and flat.numel() >= 64 * PROBE_STRIDE:
            return flat.view(-1, 64)[::PROBE_STRIDE]
        return flat[::PROBE_STRIDE]

    def set_dtype(self, dtype: torch.dtype | None) -> None:
        self.sampler_start = self.start.to(dtype) if dtype is not None else self.start  # (exact in `dtype`)
        self.reset()

    def reset(self) -> None:
        """Before a push: nothing observed (a tensor not observed adds nothing to the figures)."""
        self.learned.zero_()
        self.sampled.zero_()
        self.observed: set[str] = set()

    @property
    def count(self) -> int:
        """The samples observed since reset()."""
        return sum(self.slices[name].stop - self.slices[name].start for name in self.observed)

    def observe(self, name: str, learner: torch.Tensor, sampler: torch.Tensor) -> None:
        if name not in self.slices:
            return
        span = self.slices[name]
        for update, start, now in ((self.learned, self.start, learner), (self.sampled, self.sampler_start, sampler)):
            now = self.sample(now)  # (copy_ converts dtype and device: a GPU learner's shm buffer is on the CPU)
            update[span].view(now.shape).copy_(now).sub_(start[span].view(now.shape))
        self.observed.add(name)

    def cast_metrics(self, model: torch.nn.Module, dtype: torch.dtype, copy: dict | None = None) -> dict[str, float]:
        """metrics() of `model`'s weights cast to `dtype` by rounding to nearest (a server loading them in `dtype`), or
        of `copy` (a name -> tensor cast of them: bf16_copy's), against the start in `dtype`; this probe's own figures
        are left as they are."""
        probe = UpdateProbe.__new__(UpdateProbe)
        probe.slices, probe.start = self.slices, self.start
        probe.learned, probe.sampled = torch.zeros_like(self.start), torch.zeros_like(self.start)
        probe.set_dtype(dtype)
        for name, p in model.named_parameters():
            probe.observe(name, p, p.detach().to(dtype) if copy is None else copy[name])
        return probe.metrics()

    def metrics(self) -> dict[str, float]:
        sampled, learned = self.sampled, self.learned  # (fp32 sums over ~2M samples: ~1e-5 relative error)
        changed, dot, sampled, learned = torch.stack([torch.count_nonzero(sampled).double(), sampled.dot(learned),
                                                      sampled.dot(sampled), learned.dot(learned)]).tolist()
        count, nan = self.count, float("nan")
        return {"charts/push_changed_fraction": changed / count if count else nan,
                "charts/push_update_ratio": (sampled / learned) ** 0.5 if learned else nan,
                "charts/push_update_cosine": dot / (sampled * learned) ** 0.5 if learned and sampled else nan,
                "charts/push_update_kept": dot / learned if learned else nan}


def bf16_copy(model: torch.nn.Module, seed: int, step: int) -> dict[str, torch.Tensor]:
    """`model`'s state dict with its float32 tensors stochastically rounded to bf16 (stochastic_round_bf16, its draws
    seeded by (`seed`, `step`) as a push's are; tied tensors rounded once): what <run>/model-bf16/ holds (Run.save).
    Each weight is one of its two bf16 neighbours, the nearer more often: on average the learner's weights. Rounded
    on the CPU, a tensor at a time: the same draws whatever the learner's device, and no GPU memory."""
    pool = NoisePool(rounding_seed(seed, step))
    scratch = torch.empty(SCRATCH_WORDS, dtype=torch.int32)
    rounded: dict = {}  # (storage, shape): its copy, so that tied weights stay one tensor
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.dtype != torch.float32:
            out[name] = tensor.cpu()
            continue
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape))
        if key not in rounded:
            rounded[key] = stochastic_round_bf16(tensor.cpu(), None, scratch=scratch, noise=pool.take(tensor.numel()))
        out[name] = rounded[key]
    return out


def bf16_server_note(probe: UpdateProbe | None, model: torch.nn.Module, copy: dict | None = None) -> str:
    """For the summary, where the saved model is float32: what a bf16 server loading it keeps of the run's update.
    vLLM's `auto` dtype downcasts a float32 checkpoint to the platform's first dtype (vllm/config/model.py:2422-2424,
    "Downcast for float32 models"; bf16 on an Ampere or later GPU, vllm/platforms/cuda.py:256-258), rounding to
    nearest, which hid much of DPO's SmolLM2 gain (docs/results.md); `copy` (bf16_copy's, in model-bf16/): what it
    keeps instead. "" without a probe or for weights not float32."""
    if probe is None or next(model.parameters()).dtype != torch.float32:
        return ""
    m = probe.cast_metrics(model, torch.bfloat16)
    kept, moved = m["charts/push_update_kept"], m["charts/push_changed_fraction"]
    if not math.isfinite(kept):
        return ""
    note = (f"model/ holds float32 weights; a bf16 server (vLLM's `auto` dtype for them) rounds them to nearest, "
            f"which keeps {kept:.2f} of the run's update ({moved:.1%} of the weights move)")
    if copy is None:
        return note + (": serve them in float32 (`--dtype float32`), or score the cast first "
                       "(benchmarks/score_weights.py)" if kept < 0.9 else "")  # (0.9: a tenth lost is worth a line)
    c = probe.cast_metrics(model, torch.bfloat16, copy)
    return (note + f"; model-bf16/ holds them stochastically rounded, which keeps {c['charts/push_update_kept']:.2f} "
            f"({c['charts/push_changed_fraction']:.1%} move)"
            + (": serve model-bf16/ in bf16, or model/ in float32 (`--dtype float32`)" if kept < 0.9 else ""))


class PushCast:
    """How a push turns the learner's weights into the sampler's `dtype` (None: sent as they are), by `rounding`:
    - "nearest": round to nearest even, what `Tensor.to` and vLLM's loaders do (a weight moves only once its change
      since the last representable value passes half a spacing, |w|/256 in bf16: small RL steps vanish);
    - "stochastic": stochastic_round_bf16, its draws a NoisePool seeded by (`seed`, the push's version), so a seeded
      run and a resumed one round alike; the sampler's copy equals the learner's weights on average, push by push;
    - "error-feedback": each cast's residual (in bf16, one more half-size copy of the weights) is added to the next
      push's weights before rounding to nearest, so the sampler's copy averages to the learner's over pushes
      (sigma-delta); the residual starts at zero on --resume.
    `probe` (an UpdateProbe, optional) sees every pushed tensor. Between begin(version) and end() a call rounds
    and is observed; outside (an engine's set-up copy) it rounds to nearest and changes nothing. A call given `out`
    (the transfer's buffer, in the sampler's dtype) writes the result there, without a cast copy of its own."""

    def __init__(self, dtype: torch.dtype | None, rounding: str = "nearest", seed: int = 0,
                 probe: UpdateProbe | None = None, round_to: torch.dtype | None = None):
        round_to = round_to or dtype
        if rounding not in PUSH_ROUNDINGS:
            raise ValueError(f"push rounding {rounding!r}: expected one of {PUSH_ROUNDINGS}")
        if rounding != "nearest" and round_to not in (None, torch.bfloat16):
            raise ValueError(f"--push-rounding {rounding} rounds to bfloat16 only, not {round_to}")
        self.dtype, self.round_to, self.rounding, self.seed, self.probe = dtype, round_to, rounding, seed, probe
        self.residual: dict[str, torch.Tensor] = {}
        self.pushing, self.last_metrics, self.version = False, {}, 0
        self._pools: dict = {}  # the push's NoisePool per device and stream (cast_stream)
        self._scratch: dict = {}  # stochastic_round_bf16's buffer per device and stream, reused push after push
        if probe is not None:
            probe.set_dtype(round_to)

    def casts(self, tensor: torch.Tensor) -> bool:
        """Whether a push changes `tensor`'s values or dtype (else it is sent as it is)."""
        return tensor.dtype.is_floating_point and any(d is not None and d != tensor.dtype
                                                      for d in (self.dtype, self.round_to))

    def begin(self, version: int) -> None:
        self._pools.clear()  # (each push draws anew)
        self.version, self.pushing = version, True
        if self.probe is not None:
            self.probe.reset()

    def end(self) -> dict:
        self.pushing = False
        self.last_metrics = self.probe.metrics() if self.probe is not None else {}
        return self.last_metrics

    def __call__(self, name: str, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = tensor.detach()
        into = out if out is not None and out.device == tensor.device else None  # (else: cast there, then copied)
        if not self.casts(tensor) or self.round_to == tensor.dtype:
            sent = tensor
        elif (not self.pushing or self.rounding == "nearest") and into is not None and into.dtype == self.round_to:
            sent = into.copy_(tensor)  # (the conversion within the copy: Tensor.to's rounding, no copy in between)
        elif not self.pushing or self.rounding == "nearest":
            sent = tensor.to(self.round_to)
        elif self.rounding == "stochastic":
            where = cast_stream(tensor.device)
            if where not in self._scratch:
                self._scratch[where] = torch.empty(SCRATCH_WORDS, dtype=torch.int32, device=tensor.device)
            if where not in self._pools:  # (a stream's own draws: seeded apart from the others')
                seed = rounding_seed(self.seed, self.version) ^ len(self._pools) << 48
                self._pools[where] = NoisePool(seed, tensor.device)
            sent = stochastic_round_bf16(tensor, None, scratch=self._scratch[where], out=into,
                                         noise=self._pools[where].take(tensor.numel()))
        elif self.rounding == "error-feedback":
            # (a new tensor either way: the learner's weights are never written)
            target = tensor.float() + self.residual[name] if name in self.residual else tensor.float().clone()
            sent = target.to(self.round_to)
            self.residual[name] = target.sub_(sent).to(self.round_to)
        else:  # (rounding is an attribute: set after __init__'s check, as benchmarks/push_precision.py does)
            raise ValueError(f"push rounding {self.rounding!r}: expected one of {PUSH_ROUNDINGS}")
        if self.dtype is not None and tensor.dtype.is_floating_point:
            sent = sent.to(self.dtype)  # (--push-round-to bfloat16 into an fp32 sampler: back to fp32, exactly)
        if out is not None and sent.data_ptr() != out.data_ptr():
            sent = out.copy_(sent)
        if self.pushing and self.probe is not None:
            self.probe.observe(name, tensor, sent)
        return sent


def sampler_source(module: torch.nn.Module, dtype: torch.dtype | None, cast: PushCast | None = None):
    """vLLM's ModuleSource over `module` (vllm/distributed/weight_transfer/base.py:244-265), its floating-point
    parameters sent in the sampler's `dtype`: a bf16 sampler receives half the bytes, and no load-time cast
    warns (vllm/model_executor/models/utils.py:324-340 warns at every push for each fp32 tensor loaded into a
    bf16 parameter that way). `cast` (a PushCast for `dtype`) rounds them; without one they round as vLLM's loaders
    would: `param.data.copy_(loaded_weight)` (vllm/model_executor/model_loader/weight_utils.py:1490; the linear
    layers' loaders also copy_) converts as `Tensor.to` does, round to nearest even. None, or a dtype the parameters
    already have: vLLM's ModuleSource itself, which sends the parameters as they are (fp32 CPU runs unchanged, bit for
    bit)."""
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta

    cast = cast or PushCast(dtype)
    if not any(cast.casts(p) for p in module.parameters()):
        return ModuleSource(module)

    def wire(d: torch.dtype) -> torch.dtype:
        return dtype if d.is_floating_point else d

    class CastSource(ModuleSource):
        def metadata(self):
            return [ParamMeta(m.name, wire(m.dtype), m.shape) for m in super().metadata()]

        def __iter__(self):
            for name, tensor in super().__iter__():
                yield name, cast(name, tensor)

        def uncast(self):  # (the shm transfer's pushes: the parameters as they are, each cast by cast_into)
            return super().__iter__()

        def cast_into(self, name: str, tensor: torch.Tensor, out: torch.Tensor) -> None:
            """`tensor` cast as __iter__ would, written straight into `out` (its place in a transfer buffer)."""
            cast(name, tensor, out=out)

    return CastSource(module)


def resolve_push_rounding(rounding: str, dtype: torch.dtype | None, model: torch.nn.Module) -> str:
    """--push-rounding's "auto": "stochastic" where a push rounds fp32 weights to a bf16 sampler (the GPU's default
    split; docs/results.md, "The push's precision": round to nearest loses most of a small-step update), else
    "nearest" (a cast that keeps every bit, or none)."""
    if rounding != "auto":
        return rounding
    fp32 = any(p.dtype == torch.float32 for p in model.parameters())
    return "stochastic" if dtype == torch.bfloat16 and fp32 else "nearest"


def trainer_init_info(backend: str, master_address: str = "127.0.0.1", world_size: int = 2,
                      packed_bytes: int | None = None):
    """The learner's (rank 0) init info for vLLM's WeightTransferTrainerFactory.trainer_init.
    `master_address`: where the learner listens (loopback for a local sampler); `world_size`: 1 +
    the sampler workers; `packed_bytes`: the nccl and ipc engines' staging buffer (packed_buffer_bytes;
    None: vLLM's default, 1 GiB)."""
    packed = {} if packed_bytes is None else {"packed_buffer_size_bytes": packed_bytes}
    if backend == "shm":
        from fastrl import shm_transfer

        return shm_transfer.ShmTrainerInitInfo(rank=0)  # shared memory: the sampler is on this host
    if backend == "gloo":
        from fastrl import gloo_transfer

        return gloo_transfer.GlooTrainerInitInfo(rank=0, master_address=master_address, master_port=0,
                                                 world_size=world_size)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_open_port

        # vLLM's NCCL trainer takes a port, not a bound socket: a free one, bound again by its store;
        # the trainer passes the buffer size on to the workers (nccl_engine.py:294-302), so both sides agree
        return NCCLTrainerInitInfo(rank=0, master_address=master_address, master_port=get_open_port(),
                                   world_size=world_size,
                                   **packed)
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=0, packed=True, **packed)  # one handle for a packed buffer, not one per tensor


class WeightPusher:
    """The learner's side of weight sync, shared by vllm_sampler.Sampler and
    remote_sampler.RemoteSampler. A subclass is vLLM's weight-sync client (init_weight_transfer_engine,
    start_weight_update, update_weights, finish_weight_update) and provides
    `_send_weights(version, recompute_kv, when_idle)` (one whole transfer, watched with `_watched`, which
    sets `version`) and `_push_deadline()`."""

    _weight_engine = None
    _model = None

    def _watched(self, transfer, check, poll: float) -> None:
        """Run `transfer` in a thread and watch the sampler meanwhile: every `poll` seconds `check()`
        raises a SamplerError for a dead or failed sampler, and the push deadline is kept. A collective
        to a dead peer may never return and cannot be interrupted (NCCL has no timeout): the stuck thread
        is left behind, the run is over anyway. The transfer's own error is raised as it is."""
        error: list[BaseException] = []

        def run():
            try:
                transfer()
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=run, name="weight-transfer", daemon=True)
        thread.start()
        deadline = time.monotonic() + self._push_deadline()
        while True:
            thread.join(poll)
            if not thread.is_alive():
                break
            check()
            if time.monotonic() > deadline:
                raise SamplerError(f"a weight push did not finish within {self._push_deadline():.0f}s")
        if error:
            raise error[0]

    def _start_weight_engine(self, backend: str, model: torch.nn.Module, background: bool,
                             master_address: str = "127.0.0.1",
                             world_size: int = 2, dtype: torch.dtype | None = None, rounding: str = "nearest",
                             seed: int = 0, probe: UpdateProbe | None = None,
                             round_to: torch.dtype | None = None) -> None:
        """Start vLLM's trainer engine for `backend` with this client, reading `model`, or with
        `background` a snapshot copy of it (training goes on while a thread sends the snapshot).
        `dtype`: the sampler's weight dtype, which pushes are cast to on the learner (sampler_source; the
        snapshot is kept in it, half the memory for a bf16 sampler), by `rounding` (PushCast, "auto": stochastic
        where fp32 weights go to a bf16 sampler, else nearest; `seed` seeds it) to `round_to` (None: `dtype`);
        `probe` (UpdateProbe) measures every push (push_metrics). A failure is a SamplerError."""
        import copy
        import math

        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        register_engines()
        rounding = resolve_push_rounding(rounding, round_to or dtype, model)
        self._cast = PushCast(dtype, rounding, seed, probe, round_to)
        self._model, self._snapshot = model, None
        self._device = next(iter(model.parameters()), torch.empty(0)).device
        if background:
            self._snapshot = model = copy.deepcopy(model).requires_grad_(False)
            if dtype is not None:
                for p in model.parameters():  # the snapshot's copy_ then rounds as the cast would
                    if p.dtype.is_floating_point:
                        p.data = p.data.to(dtype)
        try:
            source = sampler_source(model, dtype, self._cast)
            packed_bytes = packed_buffer_bytes([math.prod(m.shape) * m.dtype.itemsize for m in source.metadata()])
            info = trainer_init_info(backend, master_address, world_size, packed_bytes)
            self._weight_engine = WeightTransferTrainerFactory.trainer_init(info, client=self, source=source)
        except SamplerError:
            raise
        except Exception as e:
            raise SamplerError(f"weight sync could not start: {e!r}") from e

    def push_weights(self, version: int, recompute_kv: bool = False, when_idle: bool = False,
                     background: bool = False) -> float:
        """Send the learner's current weights and label them `version`. The sampler applies them
        between two decode steps: running sequences continue with the new weights on top of
        their old KV cache, or re-prefill with them when recompute_kv. With when_idle the sampler
        first finishes every running request with the old weights (the call returns once the
        update is in: requests submitted afterwards are generated by `version` only). With
        background (needs init_weight_sync(model, background=True)) the weights are copied into
        the snapshot and sent from a thread: the call returns at once and training goes on; one
        push is in flight at most (the next one, or wait_for_push(), waits for it). Returns the
        seconds this call took."""
        if self._weight_engine is None:
            raise RuntimeError("call init_weight_sync(model) before push_weights")
        if background and self._snapshot is None:
            raise RuntimeError("push_weights(background=True) needs init_weight_sync(model, background=True)")
        start = time.perf_counter()
        self.wait_for_push()
        cast = self._cast = self._cast or PushCast(None)  # (an engine started without one: the weights as they are)
        cast.begin(version)
        if self._snapshot is not None:  # the engine sends from the snapshot: bring it up to date
            with torch.no_grad():  # on the learner's stream: after the step's kernels that wrote the weights
                for (name, mine), theirs in zip(self._snapshot.named_parameters(), self._model.parameters()):
                    mine.copy_(cast(name, theirs))
            cast.end()
        elif self._model is not None and not any(cast.casts(p) for p in self._model.parameters()):  # sent as they are
            with torch.no_grad():
                for name, p in self._model.named_parameters():
                    cast(name, p)
            cast.end()
        # the learner's queued kernels (the step, the copy) are done before anything reads the weights
        wait_for_learner_kernels(self._device, self._cuda)
        self._in_background = background
        if background and self._device.type == "cuda" and self._push_stream is None:
            self._push_stream = self._cuda.Stream(device=self._device)
        if not background:
            self._send_weights(version, recompute_kv, when_idle)
            if cast.pushing:
                cast.end()
            return time.perf_counter() - start

        def push():
            try:
                self._send_weights(version, recompute_kv, when_idle)
            except BaseException as e:  # re-raised in the learner's thread by the next call
                self._push_error = e

        self._push_thread = threading.Thread(target=push, name="weight-push", daemon=True)
        self._push_thread.start()
        return time.perf_counter() - start

    def weights_described(self) -> str:
        """Which weights the sampler holds, for a report's pass@k: "the sampler's bfloat16 copy (stochastic rounding)
        of policy version 12, which kept 1.00 of the learner's update since the start (15.4% of its weights moved)",
        the last measured push's UpdateProbe figures; or "the learner's weights of policy version 12, as they are"."""
        cast, version = self._cast, getattr(self, "version", None)
        of_version = f" of policy version {version}" if version is not None else ""
        if cast is None or cast.round_to in (None, torch.float32):
            return f"the learner's weights{of_version}, as they are"
        kept, moved = (cast.last_metrics.get(k, math.nan) for k in ("charts/push_update_kept",
                                                                    "charts/push_changed_fraction"))
        return f"the sampler's {str(cast.round_to).split('.')[-1]} copy ({cast.rounding} rounding){of_version}" + (
            f", which kept {kept:.2f} of the learner's update since the start ({moved:.1%} of its weights moved)"
            if math.isfinite(kept) and math.isfinite(moved) else "")

    def push_metrics(self) -> dict[str, float]:
        """UpdateProbe's metrics at the last push that was measured (init_weight_sync's `probe`; {} without one)."""
        return dict(self._cast.last_metrics) if self._cast is not None else {}

    _cast: PushCast | None = None
    _push_thread: threading.Thread | None = None
    _push_error: BaseException | None = None
    _snapshot = None
    _cuda = torch.cuda  # the CUDA module (a fake in the unit tests)
    _device = torch.device("cpu")  # the learner's weights'
    _push_stream = None  # background pushes' CUDA stream
    _in_background = False

    def _on_push_stream(self, transfer):
        """`transfer` (a push's whole send, run in whichever thread does it), on the background pushes' own
        CUDA stream when this push is a background one. vLLM's IPC producer waits for the thread's current
        stream after each chunk (vllm/distributed/weight_transfer/packed_tensor.py:365 and :386,
        `torch.cuda.current_stream().synchronize()`); on the default stream that is the learner's, where
        the next training step is queued by then, so the sampler's pause (start to finish) would last that
        step. On a stream of its own it waits only for the push's copies. The snapshot it reads was
        finished before (push_weights). Foreground pushes keep the default stream: the learner waits anyway."""
        stream = self._push_stream if self._in_background else None
        if stream is None:
            return transfer

        def on_stream():
            with self._cuda.stream(stream):
                transfer()

        return on_stream

    def _close_weight_sync(self) -> None:
        """On close, free what a CPU weight engine holds (the shared buffer, packed copies). A GPU
        engine's group is left to end with the process: destroying a NCCL group whose peer died
        may block. A background push still in flight (an error path; the sampler is gone by now, so it
        fails within its poll) is waited for: no thread of ours may free torch objects while Python
        shuts down (see vllm_sampler.Sampler.close)."""
        if self._push_thread is not None:
            self._push_thread.join(5)
            self._push_thread = None
        self._model = self._snapshot = None
        engine, self._weight_engine = self._weight_engine, None
        if engine is not None and not torch.cuda.is_available():
            engine.shutdown()

    def wait_for_push(self) -> None:
        """Wait until a background push has landed; raise its error if it failed."""
        if self._push_thread is not None:
            # every wait inside the push has its own deadline; this one bounds them all
            self._push_thread.join(timeout=self._push_deadline())
            if self._push_thread.is_alive():
                raise SamplerError(f"a background weight push did not finish within {self._push_deadline():.0f}s")
            self._push_thread = None
        if self._push_error is not None:
            error, self._push_error = self._push_error, None
            raise error


def register_engines() -> None:
    """Make vLLM's worker and trainer factories know "gloo" and "shm" (shm_transfer.py; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from fastrl import gloo_transfer, shm_transfer

    for name, worker, trainer in (("gloo", gloo_transfer.GlooWeightTransferEngine,
                                   gloo_transfer.GlooTrainerWeightTransferEngine),
                                  ("shm", shm_transfer.ShmWeightTransferEngine,
                                   shm_transfer.ShmTrainerWeightTransferEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, worker)
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, trainer)


def server_plugin() -> None:
    """vLLM general plugin (pyproject.toml, entry point group "vllm.general_plugins"): a vLLM server
    started on its own (remote_sampler.py) loads it in each of its processes
    (vllm/plugins/__init__.py load_general_plugins, called by the engine core, vllm/v1/engine/core.py,
    and by each worker before it loads the model, vllm/v1/worker/worker_base.py), so that the
    server knows the "gloo" engine. With FASTRL_IN_PLACE_UPDATES=1 (remote_sampler.start_server
    sets it) a CPU server also keeps its linear weights for in-place loads; without it pushes take
    vLLM's layerwise reload (correct, slower)."""
    register_engines()
    if os.environ.get("FASTRL_IN_PLACE_UPDATES") == "1":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from fastrl import gloo_transfer

            gloo_transfer.keep_cpu_linear_weights()
