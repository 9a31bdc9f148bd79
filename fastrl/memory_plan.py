"""The memory plan: before any weight loads, what one GPU must hold for a run, from the model's
config alone (issue 28, item 1).

    memory plan: learner ~X GB + sampler Y GB + transfer Z GB + headroom H GB (CUDA contexts C + the sampler's push
                 clones P + fragmentation F) of N GB

- learner: the peak of one learner step, in tensor bytes (what torch.cuda.max_memory_allocated
  counts): the trained models' weights, gradients and Adam moments in --dtype (policy; PPO's
  critic too), the frozen models (reference, reward model), bf16 autocast's weight copies, one
  micro-batch's activations (the worst case: every sequence at max_prompt_tokens + max_new_tokens,
  as many per micro-batch as --micro-batch-tokens / --micro-batch-size allow), the chunked
  logprob's logits (common.token_logprobs' chunk) and PPO's per-sequence KV caches of the
  downstream models. The activation sizes per token and layer are those benchmarks/memory.py
  measures on fake tensors for a Llama/Qwen2-style decoder (tests/test_memory.py holds the estimate
  to its measurement within 15% for every script and memory setting):
    fp32                    4 x (4 I + 10 h) bytes, and SDPA's math kernel keeps heads x T x T fp32
                            probabilities per layer (CUDA picks it for fp32 at these shapes);
    bf16 autocast           8 I + 36 h bytes (a fused attention kernel: no T x T matrix);
    gradient checkpointing  the layer's input only (h in the weights' dtype), plus one layer
                            recomputed in full during the backward pass.
  Gradients are counted whole, although a single micro-batch's step peaks before they all exist:
  the estimate leans high there (RLOO), never low.
- sampler: vLLM's share of the GPU, gpu_memory_utilization x total (--sampler-gpu-memory). Left
  unset, the plan sizes it (sampler_share): what the learner, the transfer and the headroom leave, at
  most MAX_SHARE, at least what the sampler needs (sampler_need_bytes: its weights, a KV cache for
  the batch it decodes, SAMPLER_OVERHEAD for vLLM's profiled activations and CUDA graphs).
- transfer: what a push allocates on the learner's GPU (weight_sync): the packed staging buffer
  (weight_sync.packed_buffer_bytes, two of them for NCCL), the largest tensor cast to the sampler's
  dtype, and PipelineRL's background push keeps a snapshot of the whole model in that dtype.
- headroom (headroom), each part a budget of its own, printed in the line (issue 40, item 8):
    CUDA contexts   CUDA_CONTEXT per process on the GPU: the learner's, and a colocated sampler's, which
                    vLLM's share does not include: vLLM sets its device and initialises its distributed
                    environment (vllm/v1/worker/gpu_worker.py:501, :509) before the snapshot it budgets
                    from (:534), and requests gpu_memory_utilization x total on top of what the snapshot
                    saw in use (vllm/v1/worker/utils.py:724-726; its KV cache is that less what the
                    profile consumed since the snapshot, gpu_worker.py:740, vllm/utils/mem_utils.py:312-321);
    push clones     what each push allocates in the sampler, after its KV cache has taken its share
                    (sampler_push_bytes): over IPC a clone of the chunk (packed_tensor.py:492, called by
                    ipc_engine.py:206) and the layer being loaded, materialised whole in the engine's dtype
                    by vLLM's layerwise reload (model_loader/reload/layerwise.py:185, :354); over NCCL (the
                    sampler on its own GPU) two receive buffers (packed_tensor.py:231, :253) and the layer;
    fragmentation   FRAGMENTATION of the learner's and the transfer's tensor bytes, calibrated to the one
                    GPU measurement there is (docs/memory.md): RLOO's learner step (bf16 autocast +
                    checkpointing, Qwen2.5-0.5B, 4 x 2, 256 + 512 tokens) read 12.0 GB in
                    torch.cuda.max_memory_allocated on an H100 where learner_bytes estimates 11.6 GB: the
                    estimate 3.4% low, rounded up to 5%, and the caching allocator's reserve beyond its
                    allocations (not measured) 5% more.

When the sum does not fit, the run stops in one line naming the flags that would make it fit
(refusal). Everything here is a pure function of numbers (the line, the sizing, the refusal), so it
is tested on CPU with hand-made cards; checks.memory_plan is the one call a script makes, on a GPU
only. Not modelled: several learner ranks (torchrun: the plan is skipped), a remote sampler's GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

GB = 1e9
# a CUDA context per process: the driver's state and the kernels loaded (lazily, since CUDA 11.7): a bare PyTorch
# context
# took 287 MB (pytorch/pytorch#86509), ~400 MB (pytorch/pytorch#109888); the kernels a learner's step loads later are
# FRAGMENTATION's
CUDA_CONTEXT = 0.5 * GB
FRAGMENTATION = 0.10  # of the learner's and the transfer's tensor bytes: the estimate's error (RLOO on an H100: 12.0 GB
# measured, 11.6 estimated, +3.4%, taken as 5%) and the caching allocator's reserve beyond its allocations (5%)
SAMPLER_OVERHEAD = 1.5 * GB  # vLLM beyond weights and KV cache, within its share: its profiled activations, CUDA graphs
MAX_SHARE = 0.9  # vLLM's own default utilization is 0.9
MIN_SHARE = 0.05
LOGIT_CHUNK_BYTES = 256 * 2**20  # common.LOGIT_CHUNK_BYTES: fp32 logits per chunk of positions
# logit-chunk-sized tensors alive at the head's peak (measured on fake tensors): in the forward (logits, log-softmax;
# top-p adds its sort's values and int64 indices, its cumsum and masks) and in the backward (the chunk recomputed, its
# grads).
# top-p's are the worst case, kept on purpose: a chunk whose every nucleus reaches past the 4,096 candidates (a flat
# distribution, e.g. a fresh model at T 1) is sorted whole (common._nucleus_excluded); a peaked one needs about the
# plain's
HEAD_CHUNKS = {"forward": 4, "forward top-p": 8, "backward": 7, "backward top-p": 10}
# common.SAVED_LOGPROB_BYTES / SAVED_CHUNK_BYTES: up to that much fp32 log-probabilities the chunks are kept, not
# recomputed, and HEAD_CHUNKS_KEPT of one chunk's temporaries sit beside them
SAVED_LOGPROB_BYTES, SAVED_CHUNK_BYTES = 512 * 2**20, 32 * 2**20
HEAD_CHUNKS_KEPT = {"forward": 6, "backward": 4}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the flags a copy may drop (it must keep Workload.needed()): planned as the scripts run without them (no reference
# model, no nucleus, no micro-batch cap, no over-commit, the learner in fp32 without autocast or checkpointing, the
# sampler placed by `auto`)
OPTIONAL = dict(placement="auto", sampler_dtype="auto", sampler_gpu_memory=None, sampler_url=None, dtype="float32",
                autocast_bf16=False, gradient_checkpointing=False, micro_batch_tokens=8192, top_p=1.0, kl_coef=0.0,
                micro_batch_size=None, gen_batch_size=None, mode="pipeline", steps_per_rl_step=1, background_push=False,
                inter=False, delta=0, delta_max=0, num_minibatches=1)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the plan reads from a model's config."""
    params: int  # the causal LM's parameters
    critic_params: int  # the same backbone with a 1-output score head instead of the LM head (PPO's critic)
    largest: int  # elements of its largest tensor (the embedding, for these models)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int  # key/value heads x head dim
    vocab: int


def shape_of(config) -> Shape:
    """A transformers config -> Shape. Parameter counts come from the model built on the meta device
    (no memory, no weights): exact for any architecture transformers knows."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
        critic_config = copy.deepcopy(config)
        critic_config.num_labels = 1
        critic = AutoModelForSequenceClassification.from_config(critic_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return Shape(params=sum(p.numel() for p in lm.parameters()),
                 critic_params=sum(p.numel() for p in critic.parameters()),
                 largest=max(p.numel() for p in lm.parameters()), layers=text.num_hidden_layers,
                 hidden=text.hidden_size,
                 intermediate=text.intermediate_size, heads=text.num_attention_heads,
                 kv_dim=(getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * head_dim,
                 vocab=text.vocab_size)


# --------------------------------------------------------------------------------------
# The learner's step
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One learner step's shape: the worst-case micro-batch (rows x seq_len padded tokens) and the models."""
    rows: int  # sequences in the largest micro-batch
    seq_len: int  # prompt + response, the longest
    trained: tuple[int, ...]  # parameter counts of the models Adam trains (policy; PPO: + critic)
    frozen: tuple[int, ...] = ()  # parameter counts of the frozen models in the learner's dtype (reference)
    frozen_bytes: int = 0  # frozen models in another dtype (a reward model), in bytes
    kv_cache_bytes: int = 0  # PPO: the downstream models' per-sequence KV caches while they prefill
    kv_carried_bytes: int = 0  # PPO: those of the carried-over sequences, kept through the update
    backward_models: int = 1  # models run forward and backward on each micro-batch (PPO: policy and critic)
    micro_batches: int = 1  # how many the step runs (from the second on, the gradients are alive throughout)
    top_p: float = 1.0  # the learner's nucleus (common.sampling_logits sorts the vocabulary when < 1)
    # the longest response: the vocabulary part runs on its positions only (None: seq_len)
    completion_len: int | None = None


def layer_bytes(s: Shape, rows: int, seq_len: int, weight_bytes: int, autocast: bool) -> int:
    """One decoder layer's activations kept for the backward pass, for one micro-batch (the module's table)."""
    tokens = rows * seq_len
    if autocast:
        return tokens * (8 * s.intermediate + 36 * s.hidden)
    if weight_bytes == 4:
        return tokens * 4 * (4 * s.intermediate + 10 * s.hidden) + 4 * rows * s.heads * seq_len ** 2
    # bf16 weights: a fused kernel, fp32 norms
    return tokens * (2 * (4 * s.intermediate + 10 * s.hidden) + 8 * s.hidden)


def head_bytes(s: Shape, rows: int, seq_len: int, phase: str, top_p: float = 1.0,
               completion_len: int | None = None) -> int:
    """common.token_logprobs' vocabulary projection, on the completion's positions (rows x completion_len)
    a chunk at a time: HEAD_CHUNKS of the chunk's fp32 logits alive at once in the `phase` ("forward" or
    "backward"), and the backbone's last hidden state (every position) with its gradient."""
    positions = rows * (completion_len or seq_len)
    whole = 4 * positions * s.vocab
    hidden = 2 * 4 * rows * seq_len * s.hidden
    if whole <= SAVED_LOGPROB_BYTES:  # every chunk's log-probabilities kept, the chunks' temporaries small
        return whole + HEAD_CHUNKS_KEPT[phase] * min(SAVED_CHUNK_BYTES, whole) + hidden
    chunk = max(min(LOGIT_CHUNK_BYTES, whole), 4 * s.vocab)  # at least one position
    return HEAD_CHUNKS[phase + (" top-p" if top_p < 1 else "")] * chunk + hidden


def learner_bytes(s: Shape, step: Step, dtype: str = "float32", autocast: bool = False,
                  checkpointing: bool = False) -> int:
    """The peak of one learner step: the models (weights and Adam moments of each trained model, the frozen
    models, KV caches), then the larger of two moments of a micro-batch's pass:
    - the head: every layer's kept activations (with checkpointing, each layer's input) and the logits
      (head_bytes), in the forward with autocast's bf16 weight copies (freed when the forward's autocast
      ends), or in the backward; the gradients exist here only from the second micro-batch on;
    - with checkpointing, the backward through the first layer: every gradient, that layer recomputed in full."""
    w = DTYPE_BYTES[dtype]
    trained = sum(step.trained)
    models = 3 * trained * w + sum(step.frozen) * w + step.frozen_bytes
    grads = trained * w
    layer = layer_bytes(s, step.rows, step.seq_len, w, autocast)
    kept = (s.layers * step.rows * step.seq_len * s.hidden * (4 if autocast else w) if checkpointing
            else s.layers * layer)
    kept *= step.backward_models
    cast_copies = 2 * trained if autocast and w == 4 else 0
    head = max(cast_copies + head_bytes(s, step.rows, step.seq_len, "forward", step.top_p, step.completion_len),
               head_bytes(s, step.rows, step.seq_len, "backward", step.top_p, step.completion_len))
    at_head = kept + head + (grads if step.micro_batches > 1 else 0)
    at_first_layer = grads + layer if checkpointing else 0
    prefill = step.kv_cache_bytes  # PPO's downstream prefill, before the update (no gradients, no activations kept)
    return int(models + max(prefill, step.kv_carried_bytes + max(at_head, at_first_layer)))


def rows_per_micro_batch(n: int, seq_len: int, max_tokens: int, rows_per_item: int = 1,
                         max_rows: int | None = None) -> int:
    """common.micro_batches on n items of one length: items per micro-batch x rows_per_item."""
    items = max(1, max_tokens // (rows_per_item * seq_len))
    items = min(items, max_rows or items, math.ceil(n / rows_per_item) if rows_per_item > 1 else n)
    return items * rows_per_item


def _groups_step(w: Workload, args, s: Shape, reward_model_bytes: int = 0) -> tuple[Step, int]:
    """P prompts x G samples, every sequence in one optimizer step (the reference with --kl-coef)."""
    T, n = args.max_prompt_tokens + args.max_new_tokens, getattr(args, w.batch) * getattr(args, w.group)
    rows = rows_per_micro_batch(n, T, args.micro_batch_tokens)
    return Step(rows, T, (s.params,), (s.params,) if args.kl_coef else (), micro_batches=math.ceil(n / rows),
                top_p=args.top_p, completion_len=args.max_new_tokens), n


def _pairs_step(w: Workload, args, s: Shape, reward_model_bytes: int = 0) -> tuple[Step, int]:
    """A round of --num-minibatches x P prompts x G samples; a step: one pair (2 rows together) per prompt of its
    minibatch, against the reference (and a reward model)."""
    T, pairs = args.max_prompt_tokens + args.max_new_tokens, getattr(args, w.batch)
    n = pairs * getattr(args, "num_minibatches", 1) * getattr(args, w.group)
    rows = rows_per_micro_batch(2 * pairs, T, args.micro_batch_tokens, rows_per_item=2)
    return Step(rows, T, (s.params,), (s.params,), reward_model_bytes, micro_batches=math.ceil(2 * pairs / rows),
                top_p=args.top_p, completion_len=args.max_new_tokens), n


def _stream_step(w: Workload, args, s: Shape, reward_model_bytes: int = 0) -> tuple[Step, int]:
    """B sequences a step, H in flight (--gen-batch-size; B, or B x G in conventional mode)."""
    T, n = args.max_prompt_tokens + args.max_new_tokens, getattr(args, w.batch)
    rows = rows_per_micro_batch(n, T, args.micro_batch_tokens, max_rows=args.micro_batch_size)
    in_flight = args.gen_batch_size or (n if args.mode == "pipeline" else n * args.steps_per_rl_step)
    return Step(rows, T, (s.params,), (s.params,) if args.kl_coef else (), micro_batches=math.ceil(n / rows),
                top_p=args.top_p, completion_len=args.max_new_tokens), in_flight


def _actor_critic_step(w: Workload, args, s: Shape, reward_model_bytes: int = 0) -> tuple[Step, int]:
    """B + Delta sequences over-committed (Delta at its bound), a minibatch a step; actor and critic trained, the
    critic and the reference (and a reward model) each keeping a KV cache per sequence while they prefill the
    streamed chunks, in the forward's dtype (bf16 under autocast)."""
    T, batch = args.max_prompt_tokens + args.max_new_tokens, getattr(args, w.batch)
    n = batch + (max(args.delta, args.delta_max) if args.inter else 0)
    minibatch = batch // args.num_minibatches
    rows = rows_per_micro_batch(minibatch, T, args.micro_batch_tokens, max_rows=args.micro_batch_size)
    kv_bytes = 2 if args.autocast_bf16 else DTYPE_BYTES[args.dtype]
    per_sequence = (2 + (1 if reward_model_bytes else 0)) * T * s.layers * 2 * s.kv_dim * kv_bytes
    return Step(rows, T, (s.params, s.critic_params), (s.params,), reward_model_bytes, n * per_sequence,
                (n - batch) * per_sequence, backward_models=2, micro_batches=math.ceil(minibatch / rows),
                top_p=args.top_p, completion_len=args.max_new_tokens), n


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the plan reads of a script, as shapes and the names of its flags, never which script it is: its learner
    step at given flags (`step_at`: (workload, args, Shape, reward model bytes) -> (Step, the sequences its sampler
    decodes at once)), the flag that is its batch (the one a refusal halves) and the one that is its group. A copy
    that renames its batch flag passes dataclasses.replace(memory_plan.GROUPS, batch="its_name")."""

    step_at: Callable
    batch: str
    group: str | None = None
    whole_groups: bool = False  # the batch counts sequences in whole groups (a refusal halves it to a multiple)
    background: Callable = lambda args: False  # whether a push keeps a snapshot of the weights (from a thread)

    def step(self, args, s: Shape, reward_model_bytes: int = 0) -> tuple[Step, int]:
        """The learner's step at these flags (worst case: every sequence at full length) and the number of sequences
        the sampler decodes at once (for the KV cache)."""
        return self.step_at(self, args, s, reward_model_bytes)

    def needed(self) -> tuple[str, ...]:
        """The Args fields the plan cannot do without: the sequence length and the batch (and group)."""
        return ("max_prompt_tokens", "max_new_tokens", self.batch, *([self.group] if self.group else []))


# the scripts' workloads: RLOO's (and examples/reinforce.py's), online DPO's, PipelineRL's, PPO's
GROUPS = Workload(_groups_step, batch="num_prompts", group="group_size")
PAIRS = Workload(_pairs_step, batch="num_prompts", group="group_size")
STREAM = Workload(_stream_step, batch="train_batch_size", whole_groups=True,
                  background=lambda args: args.mode == "pipeline" and bool(args.background_push))
ACTOR_CRITIC = Workload(_actor_critic_step, batch="batch_size")


# --------------------------------------------------------------------------------------
# The push and the sampler
# --------------------------------------------------------------------------------------


def transfer_bytes(s: Shape, sampler_dtype: str, placement: str, background: bool,
                   learner_dtype: str = "float32") -> int:
    """What a push allocates on the learner's GPU: vLLM's packed staging buffer (weight_sync.packed_buffer_bytes;
    NCCL keeps two), the tensor being cast to the sampler's dtype, a background push's snapshot."""
    from fastrl import weight_sync

    b = DTYPE_BYTES[sampler_dtype]
    rest = (s.params - s.largest) * b  # the other tensors, none larger than the largest: the same maximum and sum
    pieces = [s.largest * b] + [min(s.largest * b, rest - i) for i in range(0, rest, s.largest * b)]
    packed = weight_sync.packed_buffer_bytes(pieces)  # the largest tensor, at least 64 MiB
    buffers = 2 if placement in ("separate", "remote") else 1
    cast = s.largest * b if sampler_dtype != learner_dtype else 0
    snapshot = s.params * b if background else 0
    return buffers * packed + cast + snapshot


def sampler_push_bytes(s: Shape, sampler_dtype: str, placement: str) -> int:
    """What a push allocates in the sampler, beyond its share: over IPC (colocated) a clone of the chunk, at most
    the packed buffer (vllm/distributed/weight_transfer/packed_tensor.py:492, from ipc_engine.py:206), and the layer
    being loaded materialised in the engine's dtype (model_loader/reload/layerwise.py:185 buffers the chunk's
    tensors until their layer is whole, :354 materialises it); over NCCL two receive buffers (packed_tensor.py:231,
    :253), each the packed size and the tensor that overflowed it, and the layer. Qwen2.5-0.5B in bf16, colocated:
    its embedding's clone and its materialised embedding, 2 x 272 MB."""
    from fastrl import weight_sync

    b = DTYPE_BYTES[sampler_dtype]
    rest = (s.params - s.largest) * b
    pieces = [s.largest * b] + [min(s.largest * b, rest - i) for i in range(0, rest, s.largest * b)]
    packed = weight_sync.packed_buffer_bytes(pieces)
    chunks = 2 * (packed + s.largest * b) if placement in ("separate", "remote") else packed
    return chunks + s.largest * b


def sampler_need_bytes(s: Shape, sequences: int, seq_len: int, sampler_dtype: str) -> int:
    """What vLLM needs at the least within its share: its weights, a KV cache for the batch it decodes,
    SAMPLER_OVERHEAD."""
    b = DTYPE_BYTES[sampler_dtype]
    return int(s.params * b + sequences * seq_len * s.layers * 2 * s.kv_dim * b + SAMPLER_OVERHEAD)


@dataclasses.dataclass(frozen=True)
class Headroom:
    """What a GPU holds beyond the learner's tensors, the transfer and the sampler's share (the module's table)."""
    contexts: int  # CUDA contexts on the GPU (the learner's; colocated, the sampler's too)
    push_clones: float  # colocated: what each push allocates in the sampler (sampler_push_bytes)
    fragmentation: float  # FRAGMENTATION of the learner's and the transfer's bytes

    @property
    def bytes(self) -> float:
        return self.contexts * CUDA_CONTEXT + self.push_clones + self.fragmentation

    def text(self) -> str:
        """`headroom H GB (CUDA contexts C + the sampler's push clones P + fragmentation F)`: what the plan assumed."""
        parts = [f"CUDA context{'s' if self.contexts > 1 else ''} {self.contexts * CUDA_CONTEXT / GB:.1f}"]
        if self.push_clones:
            parts.append(f"the sampler's push clones {self.push_clones / GB:.1f}")
        parts.append(f"fragmentation {self.fragmentation / GB:.1f}")
        return f"headroom {self.bytes / GB:.1f} GB ({' + '.join(parts)})"


def headroom(s: Shape, learner: float, transfer: float, sampler_dtype: str, placement: str) -> Headroom:
    """The headroom on the learner's GPU at a placement: colocated, two CUDA contexts and the sampler's push clones."""
    colocated = placement == "colocate"
    return Headroom(2 if colocated else 1, sampler_push_bytes(s, sampler_dtype, placement) if colocated else 0,
                    FRAGMENTATION * (learner + transfer))


def sampler_share(total: float, learner: float, transfer: float, need: float, room: float) -> float | None:
    """The sampler's gpu_memory_utilization on a shared GPU: what the learner, the transfer and the headroom
    (`room` bytes) leave, rounded down to 0.01 and at most MAX_SHARE; None when that is less than it needs."""
    share = min(MAX_SHARE, math.floor((total - learner - transfer - room) / total * 100) / 100)
    return share if share * total >= need and share >= MIN_SHARE else None


def plan_line(learner: float, sampler: float, transfer: float, total: float, room: Headroom,
              sampler_total: float | None = None, sampler_room: float = 0.0) -> str:
    """The one line a run prints, with the headroom it assumed. sampler_total: the sampler's own GPU (--placement
    separate), which holds its share, its CUDA context and its push buffers (`sampler_room` bytes)."""
    if sampler_total is None:
        return (f"memory plan: learner ~{learner / GB:.1f} GB + sampler {sampler / GB:.1f} GB + transfer "
                f"{transfer / GB:.1f} GB + {room.text()} of {total / GB:.0f} GB")
    return (f"memory plan: learner ~{learner / GB:.1f} GB + transfer {transfer / GB:.1f} GB + {room.text()} of "
            f"{total / GB:.0f} GB; sampler {sampler / GB:.1f} GB + its CUDA context and push buffers "
            f"{sampler_room / GB:.1f} GB (the sampler's on its own GPU of {sampler_total / GB:.0f} GB)")


def refusal(learner: float, sampler: float, transfer: float, total: float, fixes: list[str], room: Headroom) -> str:
    """The line a run stops with when the plan does not fit: what is needed, and the flags that make it fit."""
    need = learner + sampler + transfer + room.bytes
    fix = "; or ".join(fixes) if fixes else "a smaller model or a larger GPU"
    return (f"error: memory plan: learner ~{learner / GB:.1f} GB + sampler {sampler / GB:.1f} GB + transfer "
            f"{transfer / GB:.1f} GB + {room.text()} = {need / GB:.1f} GB does not fit the GPU's {total / GB:.0f} GB; "
            f"to fit: {fix}")


# --------------------------------------------------------------------------------------
# The plan for a script's flags
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    learner: float
    sampler: float
    transfer: float
    total: float
    share: float | None  # the sampler's gpu_memory_utilization (None: no local sampler on a GPU)
    line: str  # the plan line, or the refusal when it does not fit
    fits: bool
    headroom: Headroom | None = None  # what the plan assumed beyond the three (contexts, push clones, fragmentation)


def with_defaults(w: Workload, args):
    """A copy of `args` with every field the plan reads: a script copied and stripped of a flag it does not use is
    planned without it (OPTIONAL), rather than failing with AttributeError on its first GPU start; a field it cannot do
    without (Workload.needed) missing stops the run in one line. `defaulted` names those filled in (fixes never names
    them)."""
    import copy

    missing = [name for name in w.needed() if not hasattr(args, name)]
    if missing:
        raise SystemExit(f"error: {', '.join('--' + n.replace('_', '-') for n in missing)}: the script's Args has no "
                         "such field, which the memory plan needs (renamed: name it in Run's workload, "
                         "dataclasses.replace(workload, batch=...); docs/methods.md: what a copy must keep)")
    args = copy.copy(args)
    args.defaulted = tuple(name for name in OPTIONAL if not hasattr(args, name))
    for name in args.defaulted:
        setattr(args, name, OPTIONAL[name])
    return args


def plan(w: Workload, args, s: Shape, total: float, gpus: int = 1, reward_model_bytes: int = 0) -> Plan:
    """The plan for a script's parsed flags on GPUs of `total` bytes each. args: the script's Args with its
    defaults filled (placement, sampler_dtype, sampler_gpu_memory, dtype, autocast_bf16, gradient_checkpointing,
    micro_batch_tokens, the batch flags); placement "auto" is resolved from `gpus` as vllm_sampler does. The
    sampler's share is args.sampler_gpu_memory when given, else sized here (sampler_share). When it does not
    fit, `line` is the refusal, naming flag changes that would fit (fixes). A field the plan reads that args lacks
    (a stripped copy of a script): with_defaults."""
    args = with_defaults(w, args)
    placement = args.placement if args.placement != "auto" else ("separate" if gpus >= 2 else "colocate")
    if getattr(args, "sampler_url", None):
        placement = "remote"
    learner, sampler, transfer, share, fits, room, sampler_room = _place(w, args, s, total, placement,
                                                                         reward_model_bytes)
    if not fits:
        found = fixes(w, args, s, total, placement, reward_model_bytes, gpus)
        found = found or [no_fix(w, args, s, total, placement, reward_model_bytes)]
        line = refusal(learner, sampler, transfer, total, found, room)
        return Plan(learner, sampler, transfer, total, share, line, False, room)
    if placement == "colocate":
        line = plan_line(learner, sampler, transfer, total, room)
    elif placement == "separate":
        line = plan_line(learner, sampler, transfer, total, room, sampler_total=total, sampler_room=sampler_room)
    else:
        where = "on another machine" if placement == "remote" else "on the CPU"
        line = (f"memory plan: learner ~{learner / GB:.1f} GB + transfer {transfer / GB:.1f} GB + {room.text()} of "
                f"{total / GB:.0f} GB (the sampler is {where})")
    return Plan(learner, sampler, transfer, total, share, line, True, room)


def _place(w: Workload, args, s: Shape, total: float, placement: str, reward_model_bytes: int):
    """(learner, sampler, transfer bytes, the sampler's share, whether it fits, the learner GPU's Headroom, what the
    sampler's own GPU holds beyond its share) for the flags at a placement."""
    sampler_dtype = (args.sampler_dtype if args.sampler_dtype != "auto"
                     else ("float32" if placement == "cpu" else "bfloat16"))
    dtype = getattr(args, "dtype", "float32")
    background = w.background(args)
    step, sequences = w.step(args, s, reward_model_bytes)
    learner = learner_bytes(s, step, dtype, bool(args.autocast_bf16), bool(args.gradient_checkpointing))
    need = sampler_need_bytes(s, sequences, step.seq_len, sampler_dtype)
    transfer = transfer_bytes(s, sampler_dtype, placement, background, dtype)
    room = headroom(s, learner, transfer, sampler_dtype, placement)
    learner_fits = learner + transfer + room.bytes <= total
    if placement in ("remote", "cpu"):  # no sampler on a GPU of ours
        return learner, 0.0, transfer, None, learner_fits, room, 0.0
    given = args.sampler_gpu_memory
    # the sampler alone on the next GPU (assumed of the same size), beside its context and push buffers
    if placement == "separate":
        share = given if given is not None else 0.85  # vllm_sampler.engine_settings' default there
        sampler_room = CUDA_CONTEXT + sampler_push_bytes(s, sampler_dtype, placement)
        return (learner, share * total, transfer, share,
                learner_fits and share * total >= need and share * total + sampler_room <= total,
                room, sampler_room)
    share = given if given is not None else sampler_share(total, learner, transfer, need, room.bytes)
    if share is None:
        return learner, need, transfer, None, False, room, 0.0
    return (learner, share * total, transfer, share,
            learner_fits and share * total >= need and learner + transfer + share * total + room.bytes <= total,
            room, 0.0)


def _flag(name, value) -> str:
    """A change as the command line takes it: booleans as --flag / --no-flag, the one style every script parses
    (tyro's)."""
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')} {value}"


def _has(args, name: str) -> bool:
    """Whether the script has the flag (a copy's refusal names only flags it has: with_defaults)."""
    return name not in getattr(args, "defaulted", ())


def _candidates(w: Workload, args) -> list[dict]:
    """The flag changes fixes tries, in order: the memory settings (checkpointing, then bf16 autocast), then with a
    halved --micro-batch-tokens (down to 1024); then, with the last of those, a smaller batch (halved, down to one
    prompt or PipelineRL's group), shorter responses (--max-new-tokens halved, down to 32), and both. The last is the
    smallest run the plan tries."""
    memory = {name: True for name in ("gradient_checkpointing", "autocast_bf16")
              if _has(args, name) and not getattr(args, name)}
    budgets = [args.micro_batch_tokens // 2**i for i in range(1, 8)
               if _has(args, "micro_batch_tokens") and args.micro_batch_tokens // 2**i >= 1024]
    candidates = [dict(list(memory.items())[:i]) for i in range(1, len(memory) + 1)]
    candidates += [memory | {"micro_batch_tokens": b} for b in budgets]
    batch, size = w.batch, getattr(args, w.batch)
    group = getattr(args, "group_size", 1) if w.whole_groups else 1  # (PipelineRL's B is whole groups)
    batches = sorted({b for b in [size // 2**i for i in range(1, 6)] + [group] if group <= b < size and b % group == 0},
                     reverse=True)
    lengths = [t for t in (args.max_new_tokens // 2**i for i in range(1, 6)) if t >= 32]
    smallest = candidates[-1] if candidates else {}
    candidates += [smallest | {batch: b} for b in batches] + [smallest | {"max_new_tokens": t} for t in lengths]
    return candidates + [smallest | {batch: b, "max_new_tokens": t} for t in lengths for b in batches]


def _place_with(w: Workload, args, changes: dict, s: Shape, total: float, placement: str, reward_model_bytes: int):
    """_place for the flags with `changes` made."""
    import copy

    a = copy.copy(args)
    for name, value in changes.items():
        setattr(a, name, value)
    return _place(w, a, s, total, placement, reward_model_bytes)


def fixes(w: Workload, args, s: Shape, total: float, placement: str, reward_model_bytes: int = 0,
          gpus: int = 1) -> list[str]:
    """Flag changes that make the plan fit, each alternative in one string: a sampler share the plan sizes itself
    instead of the one given, the first of _candidates that fits and trains the same run, a sampler on a second GPU
    when there is one (`gpus`); only when none of those fits, the first candidate with a smaller batch or shorter
    responses that fits, naming what it gives up. Each is tried through the plan: none is named that does not fit.
    Never --dtype bfloat16: Adam steps at the papers' learning rates (1e-6 to 3e-6) round away on most bf16 weights."""
    def fits(changes: dict, where: str = placement) -> bool:
        return _place_with(w, args, changes, s, total, where, reward_model_bytes)[4]

    found = []
    if (placement == "colocate" and _has(args, "sampler_gpu_memory") and args.sampler_gpu_memory is not None
            and fits({"sampler_gpu_memory": None})):
        found.append("leave --sampler-gpu-memory out (the plan sizes it)")
    candidates = _candidates(w, args)
    given_up = lambda changes: [what for name, what in ((w.batch, "a smaller batch"),  # noqa: E731
                                                        ("max_new_tokens", "shorter responses")) if name in changes]
    same_run = next((c for c in candidates if c and not given_up(c) and fits(c)), None)
    if same_run:
        found.append(" ".join(_flag(name, value) for name, value in same_run.items()))
    if (placement == "colocate" and gpus >= 2 and _has(args, "placement")
            and fits({"sampler_gpu_memory": None}, "separate")):
        found.append("--placement separate (the sampler on a second GPU)")
    smaller = None if found else next((c for c in candidates if given_up(c) and fits(c)), None)  # a run of less
    if smaller:
        changes = " ".join(_flag(name, value) for name, value in smaller.items())
        found.append(f"{changes} ({' and '.join(given_up(smaller))})")
    return found


def no_fix(w: Workload, args, s: Shape, total: float, placement: str, reward_model_bytes: int = 0) -> str:
    """The refusal's advice when no flag change fits: a smaller model or a larger GPU, with what the smallest run tried
    (_candidates' last) needs on the learner's GPU and what the models alone hold there at any batch: the trained
    models' weights, gradients and Adam moments, the frozen models (and a colocated sampler's weights)."""
    candidates = _candidates(w, args)
    smallest = candidates[-1] if candidates else {}
    learner, sampler, transfer, _, _, room, _ = _place_with(w, args, smallest, s, total, placement,
                                                            reward_model_bytes)
    colocated = placement == "colocate"
    step, _ = w.step(args, s, reward_model_bytes)
    weight = DTYPE_BYTES[getattr(args, "dtype", "float32")]
    models = 4 * sum(step.trained) * weight + sum(step.frozen) * weight + step.frozen_bytes
    if colocated:  # ("auto": bf16 on a GPU)
        models += s.params * DTYPE_BYTES.get(args.sampler_dtype, 2)
    run = " ".join(_flag(name, value) for name, value in smallest.items())
    need = learner + transfer + room.bytes + (sampler if colocated else 0)
    held = "weights, gradients and Adam moments" + ("; the sampler's weights" if colocated else "")
    return (f"a smaller model or a larger GPU (even {run} needs ~{need / GB:.1f} GB; the models alone ({held}) "
            f"~{models / GB:.1f} GB)")


def reward_model_bytes(config) -> int:
    """A reward model's weights as loaded (dtype="auto": its checkpoint's dtype)."""
    import copy

    import torch
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    config.num_labels = 1
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForSequenceClassification.from_config(config).parameters())
    dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
                or "float32").replace("torch.", "")
    return params * DTYPE_BYTES.get(dtype, 4)
