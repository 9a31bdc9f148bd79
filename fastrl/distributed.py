"""The learner on several processes: `torchrun --nproc-per-node N <script>.py ...` trains data-parallel
with FSDP2 (`torch.distributed.fsdp.fully_shard`, gloo on CPU, nccl on GPUs); one process (no torchrun)
is exactly the single-process learner: no process group, every helper here a no-op or the identity.

The contract a script follows (every call below is made by EVERY rank, in the same order, unless it
says rank 0; a collective that one rank skips hangs the others):

- `d = init()` once, first. `d.rank`, `d.world_size`, `d.device`; `d.is_main` (rank 0) owns the
  sampler, the logger (others use `NullLogger()`), checkpoints and the console (other ranks' stdout
  goes to /dev/null). `current()` is the same object, for helpers that are not handed `d`. Every
  function below takes `d` last and optionally (default: `current()`).
- Models: load on `d.device`, then (rank 0, before sharding) `push_model = push_copy(policy, d)` if
  the sampler's weight sync reads the policy, then `shard(model, d)` for each model that runs forwards
  (policy, reference, critic). Build the optimizer over the sharded model's parameters AFTER
  `shard` (they are then DTensor shards). `gradient_checkpointing_enable()` may come before or after.
- Data: rank 0 makes the round's samples; `broadcast(obj, d)` hands them to every rank (picklable:
  token ids and floats, not CUDA tensors). Every rank builds the same global batch tensors from them.
- Work: `my_micro_batches(global_plan, d)` gives this rank its (rows, weight) micro-batches of the
  global plan (`common.micro_batches` over ALL rows, identical on every rank): whole micro-batches
  dealt round-robin (the plan is sorted by length, so the token load is balanced), and every rank the
  SAME NUMBER of them, because FSDP gathers each layer collectively in every forward and
  reduce-scatters in every backward. A rank short of work gets ([the shortest row], 0.0): a stand-in
  that runs the same code and must contribute nothing (multiply its loss and its metrics by the
  weight; skip it where rows are written out). `my_share(items, d)` / `share_range(n, d)`: a
  contiguous share of a list, for work that is not micro-batched (empty for high ranks when
  n < world size).
- Loss: each micro-batch's loss is weighted by its share of the GLOBAL batch (rows / N or tokens /
  global tokens: the numbers the single-process script already uses, computed from the global batch),
  and `shard` sets FSDP's gradient reduction to a plain SUM (no division by the world size), so the
  summed gradient is exactly the single-process gradient of the same global batch and every step
  (clipping included: `clip_grad_norm_` sees the global norm) is the single-process step.
- Decisions: whatever decides that ranks do different things must be the same on every rank: the
  non-finite check before optimizer.step() on the global grad norm (`clip_grad_norm_`'s) or an `all_sum`med
  loss, never on a rank's own loss (a rank that steps alone silently diverges: the step itself has
  no collective). A stand-in's loss is scaled by 0, but 0 x NaN is NaN: a non-finite stand-in row
  skips the step on every rank, as the row would in one process.
- Metrics: `all_sum(x, d)` sums numbers, tensors (e.g. an [N, T] logprob tensor where each rank
  filled only its own rows) and dicts/lists of them over ranks; `all_mean` averages;
  `clip_grad_norm_(...)` returns the global gradient norm, a replicated DTensor whose .item() and bool() are
  every rank's same number.
- Push: `gather_into(policy, push_model, d)` on every rank (one parameter at a time), then rank 0
  pushes `push_model` (what `sampler.init_weight_sync` was given). One process: push_model IS the
  policy and gather_into does nothing.
- Checkpoints: `save_checkpoint(path, model, optimizer, step, data_position, d, hf_model=push_model,
  ...)` on every rank; rank 0 writes runlog.save_checkpoint's format with the full (unsharded) model
  and optimizer state, exactly what one process writes (optimizer state keyed by parameter index).
  `state = load_checkpoint(path, model, optimizer, d, required=...)` on every rank: rank 0 reads and
  checks the file, every rank gets its shards, and the returned dict (step, data_position, the
  extras, without model/optimizer/rng) on every rank. So one process resumes a torchrun checkpoint and
  torchrun resumes a one-process one. `state_for_checkpoint` / `load_into` are the underlying steps.
- Errors: `from_main(fn, d)` runs fn on rank 0 and gives every rank its result or its SystemExit
  (rank 0 prints the one line; other ranks exit quietly). `check_world_size(n, what, d)` stops a run
  with more processes than work items.
- End: `close(d)` (in a `finally`).

Not supported: parameters that get a gradient on some ranks and not on others in the same backward
(conditional code paths); HSDP or tensor parallelism; a sampler on a rank other than 0.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    """Where this process stands: rank 0 of 1 without torchrun."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the sampler, the logger, checkpoints, the console."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """More than one process (a process group exists)."""
        return self.world_size > 1


_current = Dist()


def current() -> Dist:
    """The Dist of the last init() (one CPU process before that)."""
    return _current


def _d(d: Dist | None) -> Dist:
    return _current if d is None else d


def world_size() -> int:
    """The number of learner processes torchrun starts (1 without it); readable before init()."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(timeout_s: float = 1800.0) -> Dist:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK). One process: no process group,
    the device as the scripts always chose it (cuda if available, else cpu). Several: one GPU per
    local rank with nccl (plus gloo for CPU tensors), or the CPU with gloo; ranks other than 0 print
    nothing. `timeout_s`: how long a collective waits for a rank that is gone."""
    global _current
    world = world_size()
    cuda = torch.cuda.is_available()
    if world == 1:
        _current = Dist(0, 1, torch.device("cuda" if cuda else "cpu"), 0)
        return _current
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        raise SystemExit(f"error: WORLD_SIZE={world} without RANK/LOCAL_RANK: start several processes with torchrun "
                         "--nproc-per-node N") from None
    if cuda:
        if local >= torch.cuda.device_count():
            raise SystemExit(f"error: torchrun started more processes on this machine than it has GPUs "
                             f"({torch.cuda.device_count()}): use --nproc-per-node {torch.cuda.device_count()} at most")
        device = torch.device(f"cuda:{local}")
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # nccl for the model's collectives, gloo for CPU tensors and objects
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                 **({"device_id": device} if cuda else {}))
    _current = Dist(rank, world, device, local)
    if not _current.is_main:
        sys.stdout = open(os.devnull, "w")
    return _current


def close(d: Dist | None = None) -> None:
    """Destroy the process group (every rank; in a `finally`), then wait for this process's other threads
    to settle (wait_for_quiet_threads). One process: nothing."""
    global _current
    d = _d(d)
    if d.enabled and tdist.is_initialized():
        tdist.destroy_process_group()
        wait_for_quiet_threads()
    _current = Dist(0, 1, d.device, 0)


def wait_for_quiet_threads(timeout_s: float = 5.0) -> bool:
    """Sleep until no other thread of this process is running or runnable, twice in a row (Linux's
    /proc; elsewhere return at once); False if `timeout_s` passed first.

    Why: gloo frees a finished collective's Work on its own worker thread, after wait() has returned
    here (and a barrier keeps earlier Works until it is freed itself). A Work whose tensors Python has
    let go of takes the GIL to free them, and a thread that asks for the GIL once Python is shutting
    down is ended inside a C++ destructor: std::terminate, the process aborts with "terminate called
    without an active exception" (a core from rank 1 of a loaded test run: ProcessGroupGloo::runLoop ->
    ~AsyncBarrierWork -> ~AsyncAllgatherCoalescedWork -> TensorImpl::decref_pyobject -> take_gil ->
    pthread_exit; pytorch/pytorch#38228). Destroying the process group does not stop its threads while
    FSDP's DTensors still hold it. Sleeping hands the GIL to such a thread; a thread waiting for it runs,
    so "nothing runnable" after a sleep means nothing is left to take it."""
    me = threading.get_native_id()
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
        try:
            tids = [t for t in os.listdir("/proc/self/task") if int(t) != me]
        except OSError:
            return True
        states = []
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # it ended meanwhile
                pass
        quiet = quiet + 1 if "R" not in states else 0
    return True


class NullLogger:
    """What ranks other than 0 log through: nothing (rank 0 owns the run directory)."""

    dir = None

    def log(self, *args, **kwargs) -> None:
        pass

    def report(self, *args, **kwargs) -> None:
        pass

    def snapshot(self, *args, **kwargs) -> None:
        pass

    def resume_at(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


def _exit(message, d: Dist):
    """SystemExit with the message on rank 0 and quietly (status 1) elsewhere: one line in all."""
    return SystemExit(message if d.is_main else 1)


def from_main(fn, d: Dist | None = None):
    """fn() on rank 0, its (picklable, small) result on every rank; a SystemExit in fn (the scripts'
    one-line errors) stops every rank instead of leaving the others waiting in a collective."""
    d = _d(d)
    if not d.enabled:
        return fn()
    box = [None]
    if d.is_main:
        try:
            box = [("ok", fn())]
        except SystemExit as e:
            box = [("exit", e.code)]
    tdist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "exit":
        raise _exit(value, d)
    return value


def check_world_size(n: int, what: str, d: Dist | None = None) -> None:
    """Stop (one line, every rank) when there are more processes than `n` work items."""
    d = _d(d)
    if d.enabled and d.world_size > n:
        raise _exit(f"error: torchrun --nproc-per-node {d.world_size}: more processes than {what} ({n}); "
                    f"use at most {n} processes or a larger batch", d)


# --------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: transformers' _no_split_modules classes (Qwen2DecoderLayer, ...), else
    the longest ModuleList of one class, else none (the root alone)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if layers:
        return layers
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


def _root_children(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The root's direct children that hold parameters: the backbone (model.model / base_model) and
    the heads (lm_head, a critic's score)."""
    return [m for m in model.children() if any(True for _ in m.parameters())]


def shard(model: torch.nn.Module, d: Dist | None = None) -> torch.nn.Module:
    """FSDP2 over each decoder layer, then the root (embeddings, final norm, lm_head tied or not, a
    critic's value head): returns the same module, sharded in place. One process: unchanged.

    - Gradients are SUMMED over ranks (gradient divide factor 1, forced SUM reduce-scatter: gloo has
      no PREMUL_SUM): with losses normalised by the global batch that is the single-process gradient.
    - The scripts call the backbone and the head directly (common.token_logprobs: decoder then
      lm_head per chunk; PPO: critic.base_model then critic.score), not the root's forward, which is
      where FSDP gathers the root's parameters. So a pre-forward hook on each of the root's children
      gathers them (`unshard`, a no-op when they already are); as for any FSDP root they stay
      gathered through the backward (FSDP reshards them after it), or, after no-grad forwards only,
      until the next backward, push or checkpoint. The root is initialised at once, so that no layer
      becomes a root of its own when the first forward skips the root's.
    - Call it after moving the model to d.device and before building the optimizer."""
    d = _d(d)
    if not d.enabled:
        return model
    from torch.distributed.fsdp import fully_shard

    units = _decoder_layers(model) + [model]
    for unit in units:
        fully_shard(unit)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # per unit: each holds its own parameter group
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: no division, no PREMUL_SUM
    model._get_fsdp_state()._lazy_init()  # the root is the root, whichever module runs forward first

    def gather_root(_module, _args):
        model.unshard()

    for child in _root_children(model):
        child.register_forward_pre_hook(gather_root)
    return model


def _fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP unit back to its shards: after no-grad forwards the root's parameters are still
    gathered, and named_parameters() would name those copies instead of the shards."""
    for m in _fsdp_modules(model):
        m.reshard()


def push_copy(model: torch.nn.Module, d: Dist | None = None) -> torch.nn.Module | None:
    """What the sampler's weight sync reads (call BEFORE shard): the model itself for one process,
    a full copy on rank 0 under torchrun (kept current by gather_into), None on other ranks."""
    d = _d(d)
    if not d.enabled:
        return model
    return copy.deepcopy(model).requires_grad_(False) if d.is_main else None


@torch.no_grad()
def gather_into(model: torch.nn.Module, full_model: torch.nn.Module | None, d: Dist | None = None) -> None:
    """Every rank: gather the sharded model's parameters one at a time (one full parameter beyond the
    shards in memory); rank 0 copies each into `full_model`, the unsharded model the sampler's weight
    sync reads (None on other ranks). Buffers are not sharded: rank 0 copies its own. One process:
    nothing (full_model is the model)."""
    d = _d(d)
    if not d.enabled or full_model is model:
        return
    if d.is_main and full_model is None:
        raise ValueError("gather_into: rank 0 needs the unsharded copy (push_copy(model) before shard(model))")
    _reshard(model)
    targets = dict(full_model.named_parameters()) if d.is_main else {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if d.is_main:
            targets[name].copy_(full)
    if d.is_main:
        buffers = dict(full_model.named_buffers())
        for name, buf in model.named_buffers():
            if name in buffers:
                buffers[name].copy_(buf)


# --------------------------------------------------------------------------------------
# Data and metrics
# --------------------------------------------------------------------------------------


def broadcast(obj, d: Dist | None = None):
    """Rank 0's picklable object on every rank (others pass anything, e.g. None)."""
    d = _d(d)
    if not d.enabled:
        return obj
    box = [obj if d.is_main else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def share_range(n: int, d: Dist | None = None) -> range:
    """This rank's contiguous share of n items: sizes differ by at most one (the first n % world
    ranks take one more); empty for ranks beyond n."""
    d = _d(d)
    base, extra = divmod(n, d.world_size)
    start = d.rank * base + min(d.rank, extra)
    return range(start, start + base + (d.rank < extra))


def my_share(items, d: Dist | None = None) -> list:
    """This rank's contiguous share of `items` (see share_range)."""
    items = list(items)
    r = share_range(len(items), d)
    return items[r.start:r.stop]


def my_micro_batches(micro: list[list[int]], d: Dist | None = None) -> list[tuple[list[int], float]]:
    """This rank's micro-batches of the global plan `micro` (the same list on every rank), as
    (rows, weight): whole micro-batches dealt round-robin, and every rank the same number of them.
    A rank short of work gets ([shortest row], 0.0): the same forward and backward as a real
    micro-batch (so the ranks' collectives match) that must change nothing: scale its loss and its
    metrics by the weight, and do not write its rows out. One process: every micro-batch, weight 1."""
    d = _d(d)
    if not d.enabled:
        return [(rows, 1.0) for rows in micro]
    mine = micro[d.rank::d.world_size]
    count = -(-len(micro) // d.world_size)
    stand_in = [micro[0][0]] if micro else []
    return [(rows, 1.0) for rows in mine] + [(list(stand_in), 0.0) for _ in range(count - len(mine))]


def _reduce(x, d: Dist, op):
    if isinstance(x, dict):
        return {k: _reduce(v, d, op) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_reduce(v, d, op) for v in x)
    if torch.is_tensor(x):
        t = x.detach().to(d.device, copy=True).contiguous()
        tdist.all_reduce(t, op=op)
        return t.to(x.device)
    t = torch.tensor(float(x), dtype=torch.float64, device=d.device)
    tdist.all_reduce(t, op=op)
    return type(x)(t.item()) if isinstance(x, (int, float)) and not isinstance(x, bool) else t.item()


def all_sum(x, d: Dist | None = None):
    """The sum over ranks of a number, a tensor (a new tensor; e.g. an [N, T] tensor in which each
    rank filled its own rows: every rank gets all rows) or a dict/list/tuple of them. One process: x."""
    d = _d(d)
    return _reduce(x, d, tdist.ReduceOp.SUM) if d.enabled else x


def all_max(x, d: Dist | None = None):
    """The maximum over ranks, like all_sum."""
    d = _d(d)
    return _reduce(x, d, tdist.ReduceOp.MAX) if d.enabled else x


def all_mean(x, d: Dist | None = None):
    """The mean over ranks (per-rank metrics), like all_sum."""
    d = _d(d)
    if not d.enabled:
        return x
    total = all_sum(x, d)

    def div(v):
        if isinstance(v, dict):
            return {k: div(u) for k, u in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(div(u) for u in v)
        return v / d.world_size

    return div(total)


# --------------------------------------------------------------------------------------
# Checkpoints: the single-process format on disk, whatever the number of processes
# --------------------------------------------------------------------------------------


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in the order of optimizer.state_dict()'s
    indices (param_groups in order, each group's params in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not the model's (build it after shard())")
            out.append(names[id(p)])
    return out


def _by_index(named: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's) -> keyed by
    index (optimizer.state_dict()'s)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]}


def _by_name(indexed: dict, names: list[str]) -> dict:
    """optimizer.state_dict()'s format -> keyed by parameter name."""
    return {"state": {names[i]: s for i, s in indexed["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]}


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         d: Dist | None = None) -> dict | None:
    """The optimizer's full (unsharded) state in optimizer.state_dict()'s format (keyed by index), on
    rank 0 (None elsewhere); every rank takes part. One process: optimizer.state_dict()."""
    d = _d(d)
    if not d.enabled:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _reshard(model)
    named = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return _by_index(named, _param_names(model, optimizer)) if d.is_main else None


def state_for_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         d: Dist | None = None) -> dict | None:
    """{"model": model.state_dict(), "optimizer": optimizer.state_dict()} as one process has them,
    full and on the CPU, on rank 0 (None on other ranks); every rank takes part (one tensor at a
    time). One process: the model's and optimizer's own state dicts."""
    d = _d(d)
    if not d.enabled:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    _reshard(model)
    model_state = get_model_state_dict(model, options=_options(cpu_offload=True))
    optimizer_state = full_optimizer_state(model, optimizer, d)
    return {"model": model_state, "optimizer": optimizer_state} if d.is_main else None


def _shapes(model: torch.nn.Module) -> dict[str, tuple]:
    """The model's state dict keys and full shapes (a DTensor shard reports its full shape); every
    rank computes it, so that no FSDP code runs on rank 0 alone."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _fit_problem(expected: dict[str, tuple], model_state: dict) -> str | None:
    """Why a full model state dict does not fit a model of these shapes, or None."""
    missing = [k for k in expected if k not in model_state]
    unexpected = [k for k in model_state if k not in expected]
    wrong = [k for k in expected if k in model_state and tuple(model_state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        return "; ".join(f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                         for what,
                         keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys)
    return None


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict | None,
              d: Dist | None = None) -> None:
    """Load {"model": ..., "optimizer": ...} (state_for_checkpoint's / runlog.save_checkpoint's format:
    full tensors, optimizer keyed by index) given on rank 0 (None elsewhere): every rank takes part
    and gets its shards (broadcast from rank 0 one tensor at a time). One process: load_state_dict."""
    d = _d(d)
    if not d.enabled:
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    _reshard(model)
    expected = _shapes(model)
    problem = from_main(lambda: _fit_problem(expected, state["model"]), d)
    if problem:
        raise _exit(f"error: the checkpoint does not fit this model ({problem})", d)
    set_model_state_dict(model, state["model"] if d.is_main else {}, options=_options(broadcast_from_rank0=True))
    if optimizer is not None:
        named = {}
        if d.is_main:
            indexed = state["optimizer"]
            keyed_by_name = any(isinstance(k, str) for k in indexed.get("state", {}))  # an older torchrun checkpoint
            named = indexed if keyed_by_name else _by_name(indexed, _param_names(model, optimizer))
        set_optimizer_state_dict(model, optimizer, named, options=_options(broadcast_from_rank0=True))
        # the hyperparameters exactly as saved (the broadcast turns tuples such as Adam's betas into lists)
        groups = broadcast([{k: v for k, v in g.items() if k != "params"} for g in named["param_groups"]]
                           if d.is_main else None, d)
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)


class _StateOf:
    """Stands in for a module or optimizer in runlog.save_checkpoint / runlog.load_checkpoint: its
    state_dict() is the given (full) one; load_state_dict keeps what it is given."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, write, d: Dist | None = None) -> None:
    """`write(model, optimizer)` once, on rank 0, with the full (unsharded) state: objects whose
    state_dict() is what one process would have (runlog.save_checkpoint passes its own writer). Every
    rank takes part; the file exists on every rank on return. One process: write(model, optimizer)."""
    d = _d(d)
    if not d.enabled:
        write(model, optimizer)
        return
    state = state_for_checkpoint(model, optimizer, d)
    if d.is_main:
        write(_StateOf(state["model"]), _StateOf(state["optimizer"]))
    tdist.barrier()


def load_sharded(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, read,
                 d: Dist | None = None) -> dict:
    """`read(model, optimizer)` (runlog.load_checkpoint's reader of `path`) on rank 0, into full-state
    holders; a one-line error stops every rank. Every rank then gets its shards of the model and
    optimizer and the returned state (step, data_position, the extras; no model/optimizer/rng).
    Reads checkpoints written by one process or by several alike. One process: read(model, optimizer)."""
    d = _d(d)
    if not d.enabled:
        return read(model, optimizer)
    held = {}
    _reshard(model)
    expected = _shapes(model)

    def read_on_main():
        model_state, optimizer_state = _StateOf(), _StateOf()
        state = read(model_state, optimizer_state)
        problem = _fit_problem(expected, model_state.state)
        if problem:
            raise SystemExit(f"error: --resume: {path} does not fit this model ({problem})")
        held.update(model=model_state.state, optimizer=optimizer_state.state)
        return {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}

    scalars = from_main(read_on_main, d)
    load_into(model, optimizer, held if d.is_main else None, d)
    return scalars
