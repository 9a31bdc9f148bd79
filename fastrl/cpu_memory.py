"""The learner's memory on a CPU (issue 50, item 1): before any weight loads, the micro-batch token budget that
keeps one learner step within the memory this machine has, from the model's config alone, as memory_plan.py sizes
a GPU run from the card. A machine too small for the run stops it in one line naming the flag that fits.

Contract:
- plan(args, model_path, workload) -> Plan(budget, release, why): the --micro-batch-tokens the run uses when its
  learner is on the CPU, and whether the learner must return freed memory as it goes (release_freed_memory) to fit.
  args: the script's parsed flags (memory_plan.with_defaults fills what a stripped copy lacks); workload: the
  script's memory_plan.Workload (GROUPS, PAIRS, STREAM, ACTOR_CRITIC). args.micro_batch_tokens None (not given):
  planned, the largest budget of CPU_BUDGETS whose learner fits the memory available beside the sampler. Given: kept
  as it is, and checked. Either way a learner that does not fit raises SystemExit with one line:
      error: --micro-batch-tokens 8192: the learner needs ~17.6 GB beside the sampler's ~3.2 GB, this machine has
             12.0 GB available; --micro-batch-tokens 1024 fits
      error: --model smollm2: needs ~6.1 GB (the learner ~2.9 GB at one sequence a micro-batch, the sampler ~3.2 GB),
             this machine has 4.0 GB available
- release_freed_memory(glibc): glibc keeps what the learner frees, oneDNN a compiled kernel for every new shape (see
  below); call it once in the learner process, before the weights load (Run: just after the sampler spawns; a child
  started later, as a colocated sampler, goes through learner_environment_removed). oneDNN's caches are always bounded;
  glibc=True (the plan's release) has resident memory follow the live tensors, at ~1.4x a SmolLM2 step's time.
  learner_environment_removed(): around starting a child that is not the learner (the sampler), so that it keeps
  oneDNN's own cache sizes.
- Never imports common, tasks or a script (fastrl's rule); the model's shape comes from its config.json through
  memory_plan.shape_of (a meta-device model: no weights).

Where the memory goes (SmolLM2-135M, fp32, measured in docs/results.md, "SmolLM2 on a laptop", Memory):
the models (weights, gradients and Adam: 16 bytes a parameter, 2.0 GiB) and the runtime (Python, torch,
transformers: ~0.47 GiB; in a run also vLLM's weight-transfer modules and the tokenizer, ~0.3 GiB) are fixed; one
micro-batch's activations grow with the budget (~1.4 MiB a token for its 30 layers, and the vocabulary part's logits
on the completion's positions). memory_plan.learner_bytes, written for a GPU,
predicts the CPU's live tensor bytes within a few percent, so the plan reuses it: resident = RUNTIME_BYTES + those
bytes. What it does not count is glibc's retention: above a dynamic threshold (up to 32 MiB) malloc serves large
blocks from its arenas and keeps them when freed, so the learner's resident memory grew ~1 GiB above its live tensors
over two steps at 1024 tokens (0.5-1.0 GiB at the presets' budgets: GLIBC_RETAINED). release_freed_memory(glibc=True)
fixes the threshold at MMAP_THRESHOLD, so that every tensor above it is returned to the system when freed; but then
every such allocation faults its pages in anew, and a SmolLM2 step took 1.44x as long (benchmarks/malloc_modes.py), a
tiny model's 2x. So the plan keeps glibc's own malloc wherever its retention fits, and releases only where it must
(one line says so). Under bf16 autocast a second cause: oneDNN, which computes torch's bf16 matrix
products on a CPU, keeps a compiled kernel for every shape it meets (its primitive cache and ideep's LRU cache, 1,024
entries each), and a learner's micro-batches change shape every step: SmolLM2's resident memory grew ~10 MiB a new
shape, ~0.5 GB over a run, the bf16 runs' excess over their plan (docs/results.md); ONEDNN_CACHE_ENV bounds both.

Why the budget is small on a CPU: a CPU's matrix products reach their throughput at a few hundred rows, so a larger
micro-batch buys no speed there, only memory and padding (SmolLM2's fp32 step on an idle machine: 640 tokens 1.01x,
1024 0.95x the time at 8192; docs/results.md); CPU_BUDGETS starts at that knee, and the --model smollm2 presets take
640 (DPO 384 beside its frozen reference, PipelineRL and PPO 512) to hold the learner under 4 GB (PPO's three models
under 8) where it returns what it frees; under glibc's own malloc, on a machine with room, it peaks ~0.5-1 GB higher
(RLOO's step 4.25 GB, PPO's 7.95). On a GPU the budget is the flag's (DEFAULT_GPU_TOKENS when not given).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import NamedTuple

from fastrl import memory_plan

GB = 1e9
DEFAULT_GPU_TOKENS = 8192  # --micro-batch-tokens on a GPU when not given (the scripts' default before the CPU plan)
# the budgets a CPU run may be planned at, the largest first: CPU_BUDGETS[0] is where a CPU's step time stops falling
# with the budget (SmolLM2's fp32 step, 2 idle cores: 1024 tokens 42.9 s, 640 45.8 s, 8192 45.3 s; docs/results.md);
# below it the step runs more, smaller micro-batches, for a machine that has less memory
CPU_BUDGETS = (1024, 768, 640, 512, 384, 256, 192, 128, 96, 64)
# the learner process's resident memory beside its tensors: Python, torch, transformers (SmolLM2 on this machine: 985
# MiB resident once loaded, of which its fp32 weights are 513 MiB), and in a run vLLM's trainer-side weight-transfer
# modules (+250 MiB: 2,600 modules) and the tokenizer (+55 MiB), what a run's peak holds above its step's
RUNTIME_BYTES = 0.8 * GB
# the sampler process on a CPU (vLLM) beyond its weights and KV cache: SmolLM2's peaked at 3,166 MiB resident with
# fp32 weights (513 MiB) and vllm_sampler's 256 MiB KV cache (issue 50)
SAMPLER_RUNTIME_BYTES = 2.5 * GB
SAMPLER_KV_CACHE_BYTES = 256 * 2**20  # vllm_sampler.SamplerConfig.kv_cache_bytes, its CPU default
MMAP_THRESHOLD = 128 * 1024  # glibc's own initial value, kept fixed (mallopt) instead of rising to 32 MiB
# what glibc's own malloc keeps above the plan's live bytes, in one micro-batch's kept activations: the presets' steps
# (tests/test_cpu_memory.py's) peaked 0.99x (RLOO), 1.43x (DPO), 0.85x (PipelineRL) and 0.79x (PPO) of it above the
# released peak (docs/results.md, "The learner's malloc on a CPU"); the largest, rounded up
GLIBC_RETAINED = 1.5
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# oneDNN's cache sizes in the learner, read at its first bf16 product: a round's shapes (by count, ~20 kernels a shape:
# its distinct products, forward and backward) stay cached, the kernels of shapes gone are dropped (SmolLM2, 48 shapes
# under autocast: +106 MiB and flat, against +490 and rising with the defaults, at the same speed; onednn_caches.py)
ONEDNN_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "64"}
_learner_env: dict[str, str] = {}  # what release_freed_memory added to os.environ (a user's own values are kept)


def available_bytes() -> float:
    """Memory this machine can give a new process now: Linux's MemAvailable (free + reclaimable caches); elsewhere the
    physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def learner_resident_bytes(w: memory_plan.Workload, args, shape: memory_plan.Shape, budget: int,
                           reward_model_bytes: int = 0, released: bool = True) -> float:
    """The learner's peak resident memory at --micro-batch-tokens `budget`: RUNTIME_BYTES + memory_plan.learner_bytes
    (the models with gradients and Adam, one micro-batch's activations and logits; worst case: every sequence at
    max_prompt_tokens + max_new_tokens); released=False: under glibc's own malloc, + GLIBC_RETAINED. args: the
    script's flags (what a stripped copy lacks: memory_plan.OPTIONAL)."""
    a = memory_plan.with_defaults(w, args)
    a.micro_batch_tokens = budget
    step, _ = w.step(a, shape, reward_model_bytes)
    dtype, autocast = getattr(a, "dtype", "float32"), bool(a.autocast_bf16)
    kept = shape.layers * memory_plan.layer_bytes(shape, step.rows, step.seq_len, memory_plan.DTYPE_BYTES[dtype],
                                                  autocast) * step.backward_models
    return RUNTIME_BYTES + push_resident_bytes(w, a, shape) + memory_plan.learner_bytes(
        shape, step, dtype, autocast, bool(a.gradient_checkpointing)) + (0 if released else GLIBC_RETAINED * kept)


def push_resident_bytes(w: memory_plan.Workload, args, shape: memory_plan.Shape) -> float:
    """What the weight push keeps in the learner beside its model, in copies of the weights in the sampler's dtype.
    A sampler on this machine (shm_transfer): none while the learner trains in the shared buffer itself (a sampler
    of the learner's dtype, pushes from the caller, nothing rounded), else one: the buffer a cast fills, or PipelineRL's
    --background-push snapshot (SmolLM2 in fp32: 513 MiB, what its run's peak holds above its step's). A server
    (--sampler-url, gloo_transfer): its packed broadcast buffers, one copy, and the snapshot on top. Plus
    --push-rounding error-feedback's residual, two bytes a weight."""
    learner = getattr(args, "dtype", "float32")
    sampler = getattr(args, "sampler_dtype", "auto")
    sampler = "float32" if sampler == "auto" else sampler  # "auto" on a CPU (vllm_sampler.resolve_dtype)
    background = w.background(args)
    rounded = getattr(args, "push_round_to", "sampler") != "sampler"  # a cast into an fp32 sampler: the engine copies
    if getattr(args, "sampler_url", None):
        copies = 1 + background
    else:
        copies = 1 if background or sampler != learner or rounded else 0
    # --push-rounding error-feedback keeps each weight's residual in bf16 (weight_sync.PushCast)
    residual = 2 if getattr(args, "push_rounding", "auto") == "error-feedback" else 0
    return copies * shape.params * memory_plan.DTYPE_BYTES[sampler] + shape.params * residual


def sampler_resident_bytes(args, shape: memory_plan.Shape) -> float:
    """The sampler's resident memory when it runs on this machine (0 beside a remote sampler, --sampler-url)."""
    if getattr(args, "sampler_url", None):
        return 0.0
    dtype = getattr(args, "sampler_dtype", "auto")
    weight_bytes = memory_plan.DTYPE_BYTES.get(dtype, 4)  # "auto" on a CPU: fp32
    return SAMPLER_RUNTIME_BYTES + shape.params * weight_bytes + SAMPLER_KV_CACHE_BYTES


def fitting_budget(w: memory_plan.Workload, args, shape: memory_plan.Shape, room: float,
                   reward_model_bytes: int = 0) -> int | None:
    """The largest of CPU_BUDGETS whose learner fits `room` bytes; None when not even the smallest does."""
    for budget in CPU_BUDGETS:
        if learner_resident_bytes(w, args, shape, budget, reward_model_bytes) <= room:
            return budget
    return None


def budget_for(w: memory_plan.Workload, args, shape: memory_plan.Shape, available: float,
               reward_model_bytes: int = 0) -> int:
    """plan()'s arithmetic on numbers: the budget for `args` (micro_batch_tokens None: planned) on a machine with
    `available` bytes, or SystemExit with the one line (module docstring)."""
    args = memory_plan.with_defaults(w, args)
    given = args.micro_batch_tokens
    sampler = sampler_resident_bytes(args, shape)
    room = available - sampler
    beside = f" beside the sampler's ~{sampler / GB:.1f} GB" if sampler else ""
    if given is not None:
        need = learner_resident_bytes(w, args, shape, given, reward_model_bytes)
        if need <= room:
            return given
        fits = fitting_budget(w, args, shape, room, reward_model_bytes)
        hint = f"; --micro-batch-tokens {fits} fits" if fits else "; no --micro-batch-tokens fits (a smaller --model)"
        raise SystemExit(f"error: --micro-batch-tokens {given}: the learner needs ~{need / GB:.1f} GB{beside}, "
                         f"this machine has {available / GB:.1f} GB available{hint}")
    fits = fitting_budget(w, args, shape, room, reward_model_bytes)
    if fits is not None:
        return fits
    least = learner_resident_bytes(w, args, shape, 1, reward_model_bytes)  # one sequence (a DPO pair) at a time
    parts = f"the learner ~{least / GB:.1f} GB at one sequence a micro-batch"
    parts += f", the sampler ~{sampler / GB:.1f} GB" if sampler else ""
    raise SystemExit(f"error: --model {getattr(args, 'model', '')}: needs ~{(least + sampler) / GB:.1f} GB ({parts}), "
                     f"this machine has {available / GB:.1f} GB available")


class Plan(NamedTuple):
    budget: int  # the run's --micro-batch-tokens
    release: bool  # the learner fits only if it returns freed memory as it goes (release_freed_memory(glibc=True))
    why: str | None  # when release: the line saying so, for the console


def release_needed(w: memory_plan.Workload, args, shape: memory_plan.Shape, budget: int, available: float,
                   reward_model_bytes: int = 0) -> Plan:
    """Plan(budget, release, why) for a budget that fits released: release where glibc's retention would not fit."""
    args = memory_plan.with_defaults(w, args)
    room = available - sampler_resident_bytes(args, shape)
    kept = learner_resident_bytes(w, args, shape, budget, reward_model_bytes, released=False)
    if kept <= room:
        return Plan(budget, False, None)
    smaller = next((b for b in CPU_BUDGETS if b < budget and learner_resident_bytes(
        w, args, shape, b, reward_model_bytes, released=False) <= room), None)
    hint = f"; --micro-batch-tokens {smaller} fits without it" if smaller else ""
    return Plan(budget, True, f"memory: the learner returns what it frees as it goes (1.4-2x a step's time): with "
                              f"malloc's own retention it would need ~{kept / GB:.1f} GB, {room / GB:.1f} GB are left "
                              f"beside the sampler{hint}")


def plan(args, model_path: str, w: memory_plan.Workload, available: float | None = None) -> Plan:
    """The --micro-batch-tokens of a run whose learner is on the CPU, before any weight loads (module docstring):
    args.micro_batch_tokens when given and it fits, else the largest of CPU_BUDGETS that fits; SystemExit with one
    line naming the flag that fits when nothing does; and whether it fits only releasing freed memory (Plan).
    available: bytes (default: available_bytes() now)."""
    from transformers import AutoConfig

    from fastrl.util import load_hf

    shape = memory_plan.shape_of(load_hf(AutoConfig, model_path))
    reward = 0
    if getattr(args, "reward_model", None):
        reward = memory_plan.reward_model_bytes(load_hf(AutoConfig, args.reward_model, flag="--reward-model"))
    available = available_bytes() if available is None else available
    return release_needed(w, args, shape, budget_for(w, args, shape, available, reward), available, reward)


def release_freed_memory(glibc: bool = True) -> bool:
    """Bound oneDNN's kernel caches (ONEDNN_CACHE_ENV, where the environment does not set them already); with `glibc`
    (the plan's release), have glibc return freed tensors to the system (module docstring): fix malloc's mmap
    threshold at MMAP_THRESHOLD, so that every block above it is mapped on its own and unmapped when freed, instead
    of the threshold rising to 32 MiB and such blocks staying in malloc's arenas (slower: each is faulted in anew).
    Numbers are unchanged (where memory comes from, not what is computed). Returns whether glibc's part applied."""
    for name, value in ONEDNN_CACHE_ENV.items():
        if name not in os.environ:
            os.environ[name] = _learner_env[name] = value
    if not glibc:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to set
        return False


@contextlib.contextmanager
def learner_environment_removed():
    """Inside: os.environ without what release_freed_memory added, for starting a child process that is not the
    learner: the vLLM sampler keeps oneDNN's defaults, under which its speed was measured."""
    removed = {name: os.environ.pop(name) for name in _learner_env if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(removed)
