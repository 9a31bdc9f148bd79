"""PPO with OPPO's pipeline overlap (Algorithm 1, Eq. 1-4). Paper: Yan et al., "OPPO: Accelerating
PPO-based RLHF via Pipeline Overlap", arXiv:2509.25762.

PPO: the actor (the vLLM sampler) generates; the critic (a value head on the policy architecture),
the frozen reference and the reward (the task's verifier, or a reward model) score; GAE (Eq. 1)
on per-token rewards with the KL penalty to the reference folded in; clipped surrogate (Eq. 2)
and clipped value loss over PPO epochs x minibatches. As in TRL's PPOTrainer, which OPPO builds on.

OPPO adds two overlaps, each with a switch for the paper's ablation (both off = plain PPO):
- intra-step (--no-intra turns it off): the sampler streams every response in chunks of C tokens;
  while it decodes the next chunk, the learner prefills the new chunk into every downstream model
  (critic, reference, reward model) on top of that sequence's cached prefix (one KV cache per
  sequence and model). When a sequence ends only its last chunk is left to score. Streaming
  changes no number: chunked prefill equals one full forward (tested). Every --chunk-tune-every
  iterations the --chunk-candidates are tried on successive iterations and the fastest is kept.
- inter-step (--no-inter): over-commit B + Delta prompts; the first B sequences to finish form the
  PPO batch; the others keep their partial generation (the sampler holds them, paused, during the
  update) and continue with the new weights in the next iteration. Delta adapts to the reward
  trend every W iterations (Algorithm 1 lines 22-27, Eq. 4; see --delta-rule).

Numerics: the sampler returns the logprobs of the distribution it sampled (after temperature and
top-p); the learner's actor and reference logprobs, chunked or not, apply the same processing
(common.sampling_logits), so the ratios and the KL compare like with like (charts/logprob_diff).
The trained models are fp32 whatever the checkpoint's dtype (--dtype). When the sampler's precision
differs from the learner's (a bf16 sampler on a GPU), PPO's old logprobs and the KL-in-reward's policy
term are the learner's own recomputation and truncated importance weights correct the mismatch (--tis). A NaN/inf loss or gradient skips its optimizer
step (charts/nonfinite_skipped). The RM score is read where transformers reads it (rm_position).

Terms: an *iteration* is one PPO iteration (the paper's "training step": generate, score, update);
an optimizer *step* is one optimizer.step() (epochs x minibatches per iteration); the policy
*version* counts optimizer steps, so a token's lag is in optimizer steps; a carried-over sequence's
*age* is the number of iterations since its prompt was admitted.

Several learner processes (`torchrun --nproc-per-node N`, distributed.py): actor, critic, reference
and reward model are sharded with FSDP2. Rank 0 alone runs the sampler, the OPPO buffer (Stages 1-2,
inter-step overlap included), evaluation, the log and checkpoints, and broadcasts each iteration's
batch; every rank scores its share of it and trains on its share of each minibatch's micro-batches,
gradients summed, so every optimizer step is the single-process step on the same batch (GAE and
whitening see the whole batch; a non-finite loss on any rank skips the step on all of them).
--intra is refused there: it prefills the streamed chunks while rank 0 polls the sampler, and a
forward of a sharded model needs every rank, so the other ranks would have to follow rank 0's
polling loop step by step (or rank 0 keep unsharded copies of critic, reference and RM, which is what
sharding avoids); without it the scoring is split over the ranks instead of hidden behind generation.

    python ppo_oppo.py --model tiny
    python ppo_oppo.py --model tiny --no-intra --no-inter     # plain synchronous PPO
    torchrun --nproc-per-node 2 ppo_oppo.py --model tiny --no-intra   # data-parallel learner (FSDP2)
    python ppo_oppo.py --model Qwen/Qwen2.5-3B-Instruct --chat-template --top-p 0.95
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, DynamicCache

import common
from fastrl import distributed
import tasks
from fastrl import vllm_sampler


@dataclass
class Args:
    exp_name: str = "ppo_oppo"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU) or an HF model directory / Hub id: the actor, and the init of critic and reference"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), countdown-hub (TinyZero's
    data), gsm8k, tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object
    a line) or hf:DATASET[:CONFIG] (README "Your own data and reward")"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem) -> float, instead of the task's own
    reward; what counts as correct (accuracy, pass@k) stays the task's"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    reward_model: str | None = None
    """HF sequence-classification reward model (num_labels=1) with the policy's tokenizer; default: the task's verifier"""
    critic_model: str | None = None
    """the critic's initial weights (a sequence-classification head on top) [default: --reward-model when one is given, as TRL's
    PPOTrainer (which OPPO builds on) and OpenRLHF start the value model; otherwise --model]"""
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays in --dtype either way (the difference is the training-inference mismatch: charts/logprob_diff, --tis)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (README "Scaling out")"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained models (actor, critic) and the reference, whatever the checkpoint's (often bf16):
    in bf16 an Adam step of lr 3e-6 rounds away on most weights. The reward model keeps its checkpoint's dtype"""
    chat_template: bool = False
    """wrap each prompt as a user turn in the tokenizer's chat template (instruct models)"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""

    # PPO
    num_iterations: int | None = None
    """PPO iterations [tiny 60; otherwise 1000]"""
    batch_size: int | None = None
    """B: sequences per PPO iteration, one per prompt [tiny 64; otherwise 112, the paper's]"""
    num_ppo_epochs: int | None = None
    """passes over each batch [tiny 2; otherwise 4, TRL's]"""
    num_minibatches: int = 1
    """minibatches per epoch: optimizer steps per iteration = epochs x minibatches"""
    micro_batch_size: int = 16
    """at most this many sequences per forward/backward, grouped by length (memory and padding only); the downstream
    models' prefill takes this many sequences at a time"""
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward of the update (actor and critic) and of TIS's forward: sequences sorted by
    length are packed into micro-batches of at most this many padded tokens (rows x longest row; a longer sequence goes
    alone) and at most --micro-batch-size rows; the gradients accumulate to exactly the minibatch's"""
    autocast_bf16: bool | None = None
    """run the learner's forwards (actor, critic, reference, reward model) under bf16 autocast; weights, gradients and Adam stay in --dtype. The logprobs are then
    bf16-accurate (see charts/logprob_diff, --tis) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    gradient_checkpointing: bool | None = None
    """actor and critic recompute each decoder layer in the backward pass instead of keeping its activations (less memory, ~1/3 more
    compute) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization) [default: 0.3 on the learner's GPU, 0.85 on its own]"""
    learning_rate: float | None = None
    """Adam learning rate for actor and critic [tiny 1e-4; otherwise 3e-6, TRL's]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (actor and critic together)"""
    clip_coef: float = 0.2
    """epsilon of the clipped surrogate (Eq. 2)"""
    vf_clip: float = 0.2
    """value predictions are clipped to this distance from the rollout's values"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    gamma: float = 1.0
    """GAE discount (Eq. 1)"""
    lam: float = 0.95
    """GAE lambda (Eq. 1)"""
    kl_coef: float | None = None
    """per-token KL penalty to the reference folded into the reward [tiny 0.01; otherwise 0.05, TRL's]"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of a response that ends without EOS (off under --long-tail, which forces lengths)"""
    temperature: float | None = None
    """sampling temperature [tiny 1.0; otherwise 0.7, TRL's]"""
    top_p: float = 1.0
    """nucleus sampling; the learner's logprobs use the same truncated distribution (the logprob contract)
    [1.0: TRL's PPOTrainer, which the paper builds on, samples without a nucleus; the paper states none]"""
    tis: Literal["auto", "on", "off"] = "auto"
    """training-inference mismatch correction (truncated importance sampling, verl, open-instruct): auto = on whenever
    the sampler's numbers differ from the learner's (a sampler not in fp32, the GPU default; a bf16 learner). On: PPO's
    old logprobs and the KL-in-reward's policy term are the learner's own, recomputed at the start of the iteration,
    and each token's policy loss is weighted by min(pi_old_learner / pi_sampler, --tis-cap), which also corrects the
    staleness of carried-over sequences (one more forward per iteration). Off: the sampler's logprobs are PPO's old
    logprobs (exact when both sides run fp32: charts/logprob_diff ~1e-6)"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold 2.0; TRL 1.16 uses 3.0)"""
    request_seeds: bool = False
    """seed every request (from --seed, its data position and its request id), so that its tokens do not depend
    on the other requests in the engine. Off: vLLM's own generator, seeded by --seed, is used; still reproducible
    when the engine sees the same batches (OPPO at Delta 0 = plain PPO, tested), and faster: seeded requests
    are sampled one by one (and on GPU without FlashInfer's sampler)"""
    max_new_tokens: int | None = None
    """response length cap [tiny 32; otherwise 1024]"""

    # OPPO
    intra: bool = True
    """intra-step overlap: stream C-token chunks into the downstream models' prefill (--no-intra: score after generation;
    needed under torchrun)"""
    inter: bool = True
    """inter-step overlap: over-commit Delta prompts and carry unfinished ones over (--no-inter: wait for all B)"""
    chunk_size: int | None = None
    """C: tokens per streamed chunk at the start [max-new-tokens / 4]"""
    chunk_candidates: tuple[int, ...] | None = None
    """chunk sizes tried every --chunk-tune-every iterations [max-new-tokens / 8, / 4, / 2: 128 256 512 at 1024, the paper's]"""
    chunk_tune_every: int | None = None
    """iterations between chunk-size trials (0: keep --chunk-size) [tiny 20; otherwise 50, the paper's]"""
    delta: int = 8
    """Delta: over-committed prompts at the start (0: none, and the controller leaves it at 0)"""
    delta_min: int = 0
    """lower bound of Delta"""
    delta_max: int = 16
    """upper bound of Delta"""
    delta_window: int | None = None
    """W: Delta moves when 2W iteration rewards are in, comparing the last W with the W before [tiny 5; otherwise 10]"""
    delta_rule: Literal["eq4", "alg1"] = "eq4"
    """eq4: Delta grows while the reward improves and shrinks otherwise (Eq. 4 and the paper's text);
    alg1: Delta - sign(d) * change, as Algorithm 1 line 25 is printed (the opposite direction)"""
    long_tail: float = 0.0
    """benchmark workload: if > 0, each response is forced (ignore_eos) to a length drawn from a Pareto
    distribution with this shape (smaller = heavier tail), scale --long-tail-scale, capped at --max-new-tokens"""
    long_tail_scale: int = 8
    """minimum forced length of the long-tailed workload"""

    # evaluation, logging, checkpoints
    eval_problems: int = 200
    """held-out problems for the start/end evaluation"""
    eval_samples: int = 4
    """samples per held-out problem (accuracy = pass@1 over them)"""
    save_every: int = 0
    """checkpoint every N iterations (0: only at the end)"""
    keep_checkpoints: int = 1
    """keep the latest N checkpoints (<run>/checkpoints/<step>.pt beside <run>/checkpoint.pt, the latest); 1: only the latest"""
    snapshot_every: int = 0
    """keep the policy's weights every N iterations in <run>/snapshots/, with the wall time, from iteration 0
    (benchmarks/learning_speed.py evaluates them after the run; 0: never)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from, with the flags it was started with (its args.json)"""
    resume_changes: bool = False
    """on --resume, accept flags whose values differ from the saved run's (without it they are refused; the run's
    length may always be extended)"""


TINY = dict(num_iterations=60, batch_size=64, num_ppo_epochs=2, learning_rate=1e-4, kl_coef=0.01, temperature=1.0,
            max_new_tokens=32, chunk_tune_every=20, delta_window=5)
PAPER = dict(num_iterations=1000, batch_size=112, num_ppo_epochs=4, learning_rate=3e-6, kl_coef=0.05, temperature=0.7,
             max_new_tokens=1024, chunk_tune_every=50, delta_window=10)


# --------------------------------------------------------------------------------------
# PPO pieces
# --------------------------------------------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Eq. 1 over right-padded [batch, T] response tensors (zeros after each response's end, so
    the value after the last token is 0 and padding adds nothing)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros(rewards.shape[0])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) * mask) ** 2).sum() / mask.sum()
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def ppo_losses(logp, old_logp, advantages, values_pred, old_values, returns, mask, clip_coef: float, vf_clip: float,
               tis_weights: torch.Tensor | None = None):
    """Clipped surrogate (Eq. 2) and clipped value loss, token means over the mask. `tis_weights`
    (see tis_weights) multiply each token's policy loss, as in verl and open-instruct; the value
    loss is a regression onto the returns and stays unweighted."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef))
    if tis_weights is not None:
        pg = pg * tis_weights
    clipped_values = old_values + (values_pred - old_values).clamp(-vf_clip, vf_clip)
    vf = 0.5 * torch.max((values_pred - returns) ** 2, (clipped_values - returns) ** 2)
    n = mask.sum()
    stats = dict(clipfrac=(((ratio - 1).abs() > clip_coef).float() * mask).sum() / n,
                 approx_kl=(0.5 * (logp - old_logp) ** 2 * mask).sum() / n,
                 ratio_deviation=((ratio.detach() - 1).abs() * mask).sum() / n)
    return (pg * mask).sum() / n, (vf * mask).sum() / n, stats


def tis_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float):
    """Truncated importance weights min(pi_old / pi_behaviour, C) per token: pi_old is the learner
    at the start of the iteration, pi_behaviour the sampler that drew the token (a bf16 engine, or
    an older policy version for a carried-over sequence). Truncation bounds the variance. Returns
    the weights (zero off the mask) and their stats over the mask: the largest raw ratio and the
    fraction of tokens truncated."""
    ratio = torch.exp(old_logp - behaviour_logp) * mask
    on = mask.bool()
    stats = dict(max_ratio=ratio[on].max().item() if on.any() else float("nan"),
                 truncated_fraction=(ratio[on] > cap).float().mean().item() if on.any() else float("nan"))
    return ratio.clamp(max=cap) * mask, stats


def guarded_step(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor], max_grad_norm: float,
                 loss_is_finite: bool) -> tuple[bool, torch.Tensor]:
    """Clip and step, unless the loss or the gradient norm is NaN/inf: then drop the gradients and
    take no step. One non-finite gradient in Adam's moments would make every later step (and every
    checkpoint) NaN. Under torchrun the norm is the global one (the same on every rank) and
    `loss_is_finite` must already be every rank's verdict, so that all ranks step or none does.
    Returns whether it stepped, and the gradient norm before clipping."""
    grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    if not loss_is_finite or not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    return True, grad_norm


def next_delta(delta: int, rewards: list[float], window: int, delta_min: int, delta_max: int, rule: str) -> tuple[int, list[float]]:
    """Algorithm 1 lines 22-27: once 2W iteration rewards are in, d = mean(last W) - mean(W before),
    change = max(1, floor(Delta / 4)), clip to [Delta_min, Delta_max] and keep the last W rewards.
    Direction: `eq4` grows Delta while the reward improves (d > 0) and shrinks it otherwise, as Eq. 4
    and the text say ("as training converges Delta decays toward Delta_min"); `alg1` is line 25 as
    printed, Delta - sign(d) * change, which moves the other way."""
    if len(rewards) < 2 * window:
        return delta, rewards
    d = np.mean(rewards[-window:]) - np.mean(rewards[-2 * window:-window])
    change = max(1, delta // 4)
    direction = (1 if d > 0 else -1) if rule == "eq4" else -int(np.sign(d))
    return int(np.clip(delta + direction * change, delta_min, delta_max)), rewards[-window:]


def chunk_for_iteration(iteration: int, current: int, candidates: tuple[int, ...], tune_every: int,
                        trial_seconds: dict[int, float]) -> int:
    """Dynamic chunk size: the first len(candidates) iterations of every tune_every-long window try
    one candidate each; the next iteration switches to the one whose rollout (generate + score) was
    fastest, kept until the next window."""
    if not tune_every or not candidates:
        return current
    phase = iteration % tune_every
    if phase < len(candidates):
        return candidates[phase]
    if phase == len(candidates) and trial_seconds:
        return min(trial_seconds, key=trial_seconds.get)
    return current


# --------------------------------------------------------------------------------------
# Intra-step overlap: incremental prefill of the downstream models, a KV cache per sequence
# --------------------------------------------------------------------------------------


@dataclass
class Prefix:
    """One downstream model's state for one sequence: the KV cache over its first `length` tokens
    (prompt + response), what the model has produced for them, and the last hidden state."""

    length: int = 0
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: [heads, length, head_dim]
    per_token: list[torch.Tensor] = field(default_factory=list)  # critic: V per position; ref: log p(token | prefix)
    last_hidden: torch.Tensor | None = None


@dataclass
class Rollout:
    """One sequence of the OPPO buffer."""

    request_id: str
    key: int  # index of its problem in the train split
    problem: tasks.Problem
    prompt: list[int]
    admitted: int  # the iteration its prompt was submitted in
    response: list[int] = field(default_factory=list)  # tokens streamed so far; all of them once finished
    final: vllm_sampler.Completion | None = None
    prefix: dict[str, Prefix] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    @property
    def num_tokens(self) -> int:  # checked on every pass of the generation loop: no list built
        return len(self.prompt) + len(self.response)


def extend_prefix(body, prefixes: list[Prefix], new_tokens: list[list[int]]):
    """Run a decoder (input ids -> hidden states) on each sequence's new tokens on top of its cached
    prefix, in one batch: cached prefixes left-padded to a common length P, new tokens right-padded,
    explicit position ids. Returns each sequence's hidden states for its new tokens and its KV cache
    extended by them."""
    device = next(body.parameters()).device
    b, P, N = len(prefixes), max(p.length for p in prefixes), max(len(t) for t in new_tokens)
    ids = torch.zeros((b, N), dtype=torch.long)
    attention = torch.zeros((b, P + N), dtype=torch.long)
    positions = torch.zeros((b, N), dtype=torch.long)
    for i, (p, t) in enumerate(zip(prefixes, new_tokens)):
        ids[i, :len(t)] = torch.tensor(t)
        attention[i, P - p.length: P + len(t)] = 1
        positions[i] = torch.arange(p.length, p.length + N)
    cache = DynamicCache()
    if P:
        layers = []
        for layer in range(len(next(p.kv for p in prefixes if p.kv))):
            k0, v0 = next(p.kv for p in prefixes if p.kv)[layer]
            keys = k0.new_zeros((b, k0.shape[0], P, k0.shape[2]))
            values = v0.new_zeros((b, v0.shape[0], P, v0.shape[2]))
            for i, p in enumerate(prefixes):
                if p.length:
                    keys[i, :, P - p.length:], values[i, :, P - p.length:] = p.kv[layer]
            layers.append((keys, values))
        cache = DynamicCache(layers)
    out = body(input_ids=ids.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
               past_key_values=cache, use_cache=True)
    hidden, kv = [], []
    for i, (p, t) in enumerate(zip(prefixes, new_tokens)):
        rows = torch.cat([torch.arange(P - p.length, P), torch.arange(P, P + len(t))]).to(device)
        kv.append([(layer.keys[i][:, rows], layer.values[i][:, rows]) for layer in out.past_key_values.layers])
        hidden.append(out.last_hidden_state[i, :len(t)])
    return hidden, kv


@torch.no_grad()
def prefill(name: str, model, rollouts: list[Rollout], temperature: float, micro_batch_size: int, top_p: float = 1.0) -> None:
    """Prefill every rollout's tokens that `model` has not seen yet, on top of their cached prefix,
    and keep what the method needs per position: the critic's value, the reference's logprob of
    the token (under the sampler's temperature and top-p, as common.token_logprobs), the reward
    model's score (read off at one position once the sequence is complete: see rm_position)."""
    todo = sorted((r for r in rollouts if r.num_tokens > r.prefix[name].length),
                  key=lambda r: (r.num_tokens - r.prefix[name].length, r.prefix[name].length))
    for start in range(0, len(todo), micro_batch_size):
        group = todo[start: start + micro_batch_size]
        prefixes = [r.prefix[name] for r in group]
        new_tokens = [r.tokens[p.length:] for r, p in zip(group, prefixes)]
        hidden, kv = extend_prefix(model.base_model, prefixes, new_tokens)
        for p, h, t, cache in zip(prefixes, hidden, new_tokens, kv):
            if name in ("critic", "rm"):
                p.per_token.append(model.score(h).float())  # [new tokens, labels]
            elif name == "ref":
                # token j's logprob comes from the hidden state at j - 1: the previous chunk's last one
                before = h if p.last_hidden is None else torch.cat([p.last_hidden[None], h])
                targets = torch.tensor(t[1:] if p.last_hidden is None else t, device=h.device)
                per_chunk = max(1, common.LOGIT_CHUNK_BYTES // (4 * model.lm_head.weight.shape[0]))  # no [tokens, V] fp32 copy
                chosen = torch.cat([
                    torch.log_softmax(common.sampling_logits(model.lm_head(before[j: j + per_chunk]).float(), targets[j: j + per_chunk],
                                                             temperature, top_p), dim=-1).gather(-1, targets[j: j + per_chunk, None]).squeeze(-1)
                    for j in range(0, len(targets), per_chunk)])
                p.per_token.append(torch.cat([chosen.new_zeros(1), chosen]) if p.last_hidden is None else chosen)
            p.last_hidden, p.kv, p.length = h[-1], cache, p.length + len(t)


def rm_position(tokens: list[int], pad_token_id: int | None) -> int:
    """Where a transformers sequence classifier reads its score (GenericForSequenceClassification):
    the rightmost token that is not config.pad_token_id, whatever the attention mask says. With
    pad == eos (Qwen2.5) a response ending in EOS is scored at the token before its EOS. No pad id:
    the last token; nothing but pads: position 0 (transformers' argmax of zeros)."""
    if pad_token_id is None:
        return len(tokens) - 1
    return next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i] != pad_token_id), 0)


def scored(r: Rollout, name: str, model) -> torch.Tensor:
    """What the downstream model `name` gives for the rollout's response: critic values V(s_t) for
    every response token's state, reference logprobs of every response token, or the RM score
    (= transformers' model(prompt + response).logits)."""
    p = r.prefix[name]
    outputs = torch.cat(p.per_token)
    if name == "rm":
        return outputs[rm_position(r.tokens, model.config.get_text_config().pad_token_id)].squeeze()
    plen, T = len(r.prompt), len(r.response)
    return outputs[plen - 1: plen - 1 + T].squeeze(-1) if name == "critic" else outputs[plen: plen + T]




def critic_values(critic, input_ids, attention_mask, completion_mask):
    """V(s_t) for every completion token's state, laid out like common.token_logprobs' output."""
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return critic.score(hidden[:, :-1]).squeeze(-1).float() * completion_mask[:, 1:]


@torch.no_grad()
def learner_logprobs(policy, batch: list[Rollout], pad_token_id: int, micro_batch_size: int, max_tokens: int | None = None,
                     bf16: bool = False, d: distributed.Dist | None = None, **processing) -> list[torch.Tensor]:
    """The learner's logprob of every response token under `processing` (the sampler's temperature
    and top-p), one no-grad forward in micro-batches of similar length (at most micro_batch_size rows
    and max_tokens padded tokens; bf16: under bf16 autocast): TIS's pi_old. Under torchrun only this
    rank's micro-batches (distributed.my_micro_batches); the other rows stay empty (length 0)."""
    out: list[torch.Tensor] = [torch.zeros(0)] * len(batch)
    device = next(policy.parameters()).device
    plan = common.micro_batches([r.num_tokens for r in batch], max_tokens or 2**62, max_rows=micro_batch_size)
    for rows, weight in distributed.my_micro_batches(plan, d):
        ids, attn, cmask = common.pad_prompt_completions([batch[i].prompt for i in rows], [batch[i].response for i in rows], pad_token_id)
        with common.autocast(device, bf16):
            logp = common.token_logprobs(policy, ids.to(device), attn.to(device), cmask.to(device), **processing).cpu()
        if not weight:  # a stand-in: its forward only keeps the ranks' collectives in step
            continue
        for row, i in enumerate(rows):
            plen = len(batch[i].prompt)
            out[i] = logp[row, plen - 1: plen - 1 + len(batch[i].response)]
    return out


def ppo_backward(policy, critic, batch: list[Rollout], minibatch, data: dict[str, torch.Tensor], args: Args, pad_token_id: int,
                 diff: bool = False, d: distributed.Dist | None = None) -> dict[str, float]:
    """The PPO loss (Eq. 2 + vf_coef x the clipped value loss, token means over the minibatch) and its
    gradient for the minibatch `minibatch` (indices into batch), accumulated over micro-batches of
    similar length (--micro-batch-tokens, --micro-batch-size): each micro-batch's token-mean losses are
    weighted by its share of the minibatch's response tokens, so the accumulated gradient is exactly the
    minibatch's. data: [B, T] response-aligned tensors old_logp, advantages, values, returns, and
    weights (TIS), sampler_logp and fresh (1 on tokens the current weights sampled) when used.
    Returns token-weighted sums over the micro-batches (divide by `tokens` for means) of pg, vf,
    clipfrac, approx_kl, ratio_deviation (|ratio - 1|) and entropy, whether every loss was finite, and with `diff` the sum of
    |learner - sampler| logprobs over the fresh tokens and their count.
    Under torchrun: this rank's micro-batches of the minibatch (distributed.my_micro_batches; the
    shares stay those of the whole minibatch, so the summed gradient is the single-process one) and
    its sums; all_sum them, and combine loss_is_finite over ranks (a stand-in's NaN counts too)."""
    device = next(policy.parameters()).device
    lengths = [len(r.response) for r in batch]
    minibatch_tokens = sum(lengths[i] for i in minibatch)
    out = dict(pg=0.0, vf=0.0, clipfrac=0.0, approx_kl=0.0, ratio_deviation=0.0, entropy=0.0, tokens=0.0, loss_is_finite=True,
               diff_sum=0.0, diff_count=0.0)
    # micro-batches of similar length: long-tailed responses would pad everything to the longest
    plan = common.micro_batches([batch[i].num_tokens for i in minibatch], args.micro_batch_tokens, max_rows=args.micro_batch_size)
    for micro, weight in distributed.my_micro_batches(plan, d):  # weight 0: a stand-in that must change nothing
        rows = [minibatch[j] for j in micro]
        ids, attn, cmask = common.pad_prompt_completions([batch[i].prompt for i in rows], [batch[i].response for i in rows], pad_token_id)
        ids, attn, cmask = ids.to(device), attn.to(device), cmask.to(device)
        starts, width = [len(batch[i].prompt) - 1 for i in rows], ids.shape[1] - 1
        put = lambda x: layout([x[i, :lengths[i]] for i in rows], starts, width).to(device)  # noqa: E731
        mask = cmask[:, 1:].float()
        with common.autocast(device, args.autocast_bf16):
            logp, entropy = common.token_logprobs(policy, ids, attn, cmask, with_entropy=True, temperature=args.temperature,
                                                  top_p=args.top_p)
            # the entropy is only logged: detached at once, or the backward's recomputation of every logit chunk would keep
            # the entropy's own saved tensors alive (~2 x a chunk of fp32 logits per chunk) until the micro-batch ends
            entropy = entropy.detach()
            values_pred = critic_values(critic, ids, attn, cmask)
        pg, vf, extra = ppo_losses(logp, put(data["old_logp"]), put(data["advantages"]), values_pred, put(data["values"]),
                                   put(data["returns"]), mask, args.clip_coef, args.vf_clip,
                                   tis_weights=put(data["weights"]) if data.get("weights") is not None else None)
        tokens = mask.sum()
        loss = (pg + args.vf_coef * vf) * tokens / minibatch_tokens * weight
        out["loss_is_finite"] = out["loss_is_finite"] and bool(torch.isfinite(loss))
        loss.backward()
        n = tokens.item() * weight
        for k, v in (("pg", pg), ("vf", vf), ("clipfrac", extra["clipfrac"]), ("approx_kl", extra["approx_kl"]),
                     ("ratio_deviation", extra["ratio_deviation"]), ("entropy", entropy.sum() / tokens)):
            out[k] += v.item() * n
        out["tokens"] += n
        if diff and weight:
            on = put(data["fresh"]) * mask
            out["diff_sum"] += ((logp.detach() - put(data["sampler_logp"])).abs() * on).sum().item()
            out["diff_count"] += on.sum().item()
    return out


def load_models(model_path: str, device, dtype: torch.dtype, reward_model: str | None = None, critic_model: str | None = None):
    """Actor, critic (from `critic_model`, else the reward model, else the policy's checkpoint with a
    fresh 1-output score head) and frozen reference, all in `dtype` whatever the checkpoint's
    (from_pretrained would keep a bf16 checkpoint in bf16); the reward model, frozen, in its
    checkpoint's dtype."""
    policy = common.load_policy(model_path, device, dtype=dtype)
    critic_path = critic_model or reward_model or model_path  # a reward model already reads whole responses into one score
    critic = common.load_hf(AutoModelForSequenceClassification, critic_path, quiet=critic_path == model_path, num_labels=1,
                            flag="--critic-model" if critic_model else "--reward-model" if reward_model else "--model", dtype=dtype).to(device)
    ref_policy = common.load_policy(model_path, device, dtype=dtype).eval().requires_grad_(False)
    rm = None
    if reward_model:
        rm = common.load_hf(AutoModelForSequenceClassification, reward_model, flag="--reward-model", num_labels=1, dtype="auto")
        rm = rm.to(device).eval().requires_grad_(False)
    return policy, critic, ref_policy, rm


def layout(rows: list[torch.Tensor], starts: list[int], width: int) -> torch.Tensor:
    """Place per-response rows at their prompt offsets in a [batch, width] tensor (zeros elsewhere)."""
    out = torch.zeros((len(rows), width))
    for i, (row, start) in enumerate(zip(rows, starts)):
        out[i, start: start + len(row)] = row
    return out


def main():
    args = common.parse_args(Args)  # on --resume: the saved run's flags
    vllm_sampler.quiet_libraries(args.verbose)
    tiny = args.model == common.TINY
    for name, value in (TINY if tiny else PAPER).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    common.memory_defaults(args)
    common.check_args(args.sampler_gpu_memory is None or 0 < args.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)")
    args.chunk_size = args.chunk_size or max(1, args.max_new_tokens // 4)
    args.chunk_candidates = args.chunk_candidates or tuple(max(1, args.max_new_tokens // d) for d in (8, 4, 2))
    B = args.batch_size
    common.check_args(B >= 1 and args.num_iterations >= 1 and args.num_ppo_epochs >= 1, "--batch-size/--num-iterations/--num-ppo-epochs",
                      "must be >= 1")
    common.check_args(1 <= args.num_minibatches <= B, "--num-minibatches", f"must be between 1 and --batch-size ({B})")
    common.check_args(0 <= args.delta_min <= args.delta <= args.delta_max, "--delta", "needs 0 <= --delta-min <= --delta <= --delta-max")
    common.check_args(args.chunk_size >= 1 and all(c >= 1 for c in args.chunk_candidates), "--chunk-size/--chunk-candidates", "must be >= 1")
    common.check_sampler_urls(args.sampler_url)
    common.check_run_flags(args)
    common.check_args(args.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {args.keep_checkpoints}")
    common.check_args(not (args.sampler_url and args.intra), "--sampler-url",
                      "OPPO's intra-step overlap streams chunks, which the vLLM server path does not offer here: add --no-intra")
    common.check_args(args.delta_window >= 1 and args.chunk_tune_every >= 0, "--delta-window/--chunk-tune-every", "need W >= 1, tune-every >= 0")
    common.check_args(args.temperature > 0, "--temperature", "must be > 0 (the logprobs are of the tempered distribution)")
    common.check_args(0 < args.top_p <= 1, "--top-p", "must be in (0, 1]")
    common.check_args(args.tis_cap > 0, "--tis-cap", f"must be > 0, got {args.tis_cap}")
    # old logprobs at the learner's precision whenever the sampler's differs; the sampler's enter only the correction
    tis_on = common.mismatch_correction(args.tis, args.sampler_dtype, args.placement, args.autocast_bf16 or args.dtype == "bfloat16")
    common.check_args(args.micro_batch_size >= 1 and args.micro_batch_tokens >= 1, "--micro-batch-size/--micro-batch-tokens", "must be >= 1")
    common.check_args(args.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {args.snapshot_every}")
    if args.chunk_tune_every:
        common.check_args(args.chunk_tune_every > len(args.chunk_candidates), "--chunk-tune-every",
                          f"must exceed the number of candidates ({len(args.chunk_candidates)})")
    delta = args.delta if args.inter else 0
    max_delta = args.delta_max if args.inter else 0
    eos_penalty = 0.0 if args.long_tail else args.missing_eos_penalty
    args.max_prompt_tokens = 32 if tiny else 512  # the tiny model's context is 128: room for 96-token responses
    run_name = common.run_name(args.exp_name, args.seed, args.resume)

    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, OPPO buffer, logger, checkpoints)
    # intra streams chunks into the critic, reference and RM on rank 0 while it generates; under torchrun those
    # models are sharded and every forward needs every rank: refused (one line from rank 0, every rank stops)
    distributed.from_main(lambda: common.check_args(not (args.intra and dist.enabled), "--intra",
                                                    "the intra-step overlap runs on one process only; under torchrun add --no-intra"), dist)
    distributed.check_world_size(B // args.num_minibatches, "sequences per minibatch", dist)
    common.set_seed(args.seed)
    common.limit_cpu_threads()
    device = dist.device
    model_path = common.resolve_model(args.model, args.task)
    common.check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    args.sampler_gpu_memory = common.memory_plan(args, model_path, "ppo")  # GPU only: the plan line, or a refusal naming flags
    tokenizer = common.load_tokenizer(model_path)
    for flag, path in (("--reward-model", args.reward_model), ("--critic-model", args.critic_model)):  # before any model loads
        common.check_args(path is None or common.load_tokenizer(path, flag).get_vocab() == tokenizer.get_vocab(), flag,
                          "must share the policy's tokenizer: it reads the actor's token ids as they stream")
    common.check_chat_template(tokenizer, args.chat_template)
    policy, critic, ref_policy, reward_model = load_models(model_path, device, getattr(torch, args.dtype), args.reward_model,
                                                           args.critic_model)
    if args.gradient_checkpointing:  # active in train mode only: the update's; the critic's prefill keeps its KV cache in eval
        policy.gradient_checkpointing_enable()
        critic.gradient_checkpointing_enable()
    # what the sampler's weight sync reads: the policy itself, or under torchrun rank 0's full copy
    push_model = distributed.push_copy(policy, dist)
    policy, critic, ref_policy = (distributed.shard(m, dist) for m in (policy, critic, ref_policy))
    if reward_model is not None:
        reward_model = distributed.shard(reward_model, dist)
    downstream = dict(critic=critic, ref=ref_policy)
    if reward_model is not None:
        downstream["rm"] = reward_model
    processing = dict(temperature=args.temperature, top_p=args.top_p)  # the logprob contract: the sampler's distribution, everywhere
    learner = torch.nn.ModuleDict(dict(policy=policy, critic=critic))  # what is trained and checkpointed
    optimizer = torch.optim.Adam(learner.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    # taken now: under torchrun a no-grad forward leaves a model's root gathered, and parameters() would then name the
    # gathered copies instead of the shards the optimizer holds
    parameters = list(learner.parameters())
    task = tasks.make_task(args.task, args.seed, tiny_prompts=tiny, reward=args.reward, prompt_field=args.prompt_field,
                           answer_field=args.answer_field,
                           system_prompt=args.system_prompt)
    common.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    logger = common.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
    print(f"run directory: {logger.dir}")
    rng = np.random.default_rng(args.seed)

    iteration, version, data_position, carried_keys = 0, 0, 0, []
    chunk, trial_seconds, reward_history = args.chunk_size, {}, []
    totals = dict(wall=0.0, samples=0, tokens=0, skipped_prompts=0, nonfinite_skipped=0)
    warned: list[float] = []  # the logprob_diff warning, once
    sampler_rng = None  # without the inter-step overlap: the sampler's generators between iterations, for an exact resume
    if args.resume:  # (every rank; the file is the same whether one process or several wrote it)
        state = distributed.load_checkpoint(args.resume, learner, optimizer, dist,
                                            required=("iteration", "totals", "delta", "chunk", "reward_history", "carried_keys"))
        distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
        iteration, version, data_position = state["iteration"], state["step"], state["data_position"]
        totals.update(state["totals"])
        delta, chunk, reward_history, carried_keys = state["delta"], state["chunk"], state["reward_history"], state["carried_keys"]
        sampler_rng = state.get("sampler_rng")
        print(f"resumed from {args.resume}: iteration {iteration}, {len(carried_keys)} unfinished prompts resubmitted")

    sampler = common.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                         gpu_memory_utilization=args.sampler_gpu_memory,
                                         max_model_len=args.max_prompt_tokens + args.max_new_tokens, max_num_seqs=B + max_delta,
                                         urls=args.sampler_url, weights=push_model, version=version,
                                         verbose=args.verbose) if dist.is_main else None
    pushed_version = version  # what the sampler holds
    try:
        buffer: dict[str, Rollout] = {}  # the over-committed batch, in admission order
        finished: list[Rollout] = []  # finished and not yet trained on, in finishing order

        def admit(keys: list[int]) -> int:
            """Submit these problems' prompts, one sample each, streamed in chunks when intra is on;
            prompts longer than the context are counted in the log, not sent. Returns how many went."""
            candidates = [task.problem("train", k) for k in keys]
            problems, prompts, skipped = common.encode_prompts(tokenizer, candidates, args.max_prompt_tokens, chat_template=args.chat_template)
            totals["skipped_prompts"] += skipped
            kept = {id(p) for p in problems}
            keys = [k for k, p in zip(keys, candidates) if id(p) in kept]
            per_prompt = [{} for _ in prompts]
            if args.long_tail:  # ignore_eos, not min_tokens: min_tokens would distort the sampled distribution's logprobs
                lengths = np.minimum(args.max_new_tokens, args.long_tail_scale * (1 + rng.pareto(args.long_tail, len(prompts)))).astype(int)
                for extra, n in zip(per_prompt, lengths):
                    extra.update(ignore_eos=True, max_tokens=int(n))
            if args.request_seeds:  # Sampler.submit adds the request id
                for extra, k in zip(per_prompt, keys):
                    extra["seed"] = (args.seed * 1_000_003 + k) % 2**31
            if not prompts:
                return 0
            ids = sampler.submit(prompts, tags=keys, stream_every=chunk if args.intra else 0, per_prompt=per_prompt,
                                 max_tokens=args.max_new_tokens, **processing)
            for rid, key, problem, prompt in zip(ids, keys, problems, prompts):
                buffer[rid] = Rollout(rid, key, problem, prompt, iteration, prefix={name: Prefix() for name in downstream})
            return len(ids)

        def receive(timeout: float) -> None:
            for c in sampler.poll(timeout=timeout):
                r = buffer[c.request_id]
                if c.finished:
                    assert c.token_ids[:len(r.response)] == r.response, "streamed chunks disagree with the final response"
                    r.response, r.final = c.token_ids, c
                    finished.append(r)
                else:
                    r.response = r.response + c.token_ids

        def score(rollouts: list[Rollout]) -> None:
            for name, model in downstream.items():
                with common.autocast(device, args.autocast_bf16):
                    prefill(name, model, rollouts, args.temperature, args.micro_batch_size, top_p=args.top_p)

        def score_my_share(batch: list[Rollout]) -> set[int]:
            """Under torchrun (no intra: nothing is prefilled yet) every rank scores its share of the batch: groups of
            --micro-batch-size sequences of similar length, the same number of groups on every rank (each forward of a
            sharded model is collective); a stand-in group is scored on a copy and dropped. Returns the rows scored."""
            plan = common.micro_batches([r.num_tokens for r in batch], 2**62, max_rows=args.micro_batch_size)
            mine = set()
            for rows, weight in distributed.my_micro_batches(plan, dist):
                score([batch[i] for i in rows] if weight else [replace(batch[rows[0]], prefix={name: Prefix() for name in downstream})])
                if weight:
                    mine.update(rows)
            return mine

        eval_start = common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                     chat_template=args.chat_template, max_tokens=args.max_new_tokens, **processing) if dist.is_main else {}
        logger.log(version, eval_start)
        if dist.is_main and args.snapshot_every and iteration == 0:
            logger.snapshot(version, push_model)  # time 0 of the learning curve
        if dist.is_main and sampler_rng is not None and hasattr(sampler, "set_rng_state"):
            sampler.set_rng_state(sampler_rng)  # after the start's evaluation, which drew from them
        if dist.is_main:
            admit(carried_keys)  # a resumed run continues the prompts that were in flight
        loop_start = time.time() - totals["wall"]
        progress = common.Progress(args.num_iterations, "train", unit="iteration", initial=iteration, show=dist.is_main)
        while iteration < args.num_iterations:
            iteration_start = time.time()
            batch, unfinished, generate_seconds, hidden_score = None, 0, 0.0, 0.0
            if dist.is_main:  # under torchrun rank 0 alone samples (Stages 1-2); the other ranks wait for its batch
                if args.intra:
                    chunk_before, chunk = chunk, chunk_for_iteration(iteration, chunk, args.chunk_candidates, args.chunk_tune_every, trial_seconds)
                    if chunk != chunk_before:
                        sampler.set_stream_every(chunk)
                    if args.chunk_tune_every and iteration % args.chunk_tune_every == 0:
                        trial_seconds = {}
                # ---- Stage 1: fill the buffer to B + Delta prompts ----
                while len(buffer) < B + delta:
                    if totals["skipped_prompts"] > 1000 and not totals["samples"]:
                        raise SystemExit(f"error: every prompt so far is longer than {args.max_prompt_tokens} tokens")
                    wanted = B + delta - len(buffer)
                    admit(list(range(data_position, data_position + wanted)))
                    data_position += wanted
                # the critic changed in the last update: carried sequences re-prefill it (reference and
                # reward model are frozen, their caches stay valid)
                for r in buffer.values():
                    r.prefix["critic"] = Prefix()
                # ---- Stage 2: generate until B sequences have finished; intra: score chunks meanwhile ----
                common.learner_threads(sampler)  # one thread: the sampler generates (intra scores alongside it)
                while len(finished) < B:
                    receive(timeout=0.0 if args.intra else 0.05)
                    if args.intra:
                        score_start = time.time()
                        score(list(buffer.values()))
                        hidden_score += time.time() - score_start
                        if len(finished) < B:
                            receive(timeout=0.01)
                generate_seconds = time.time() - iteration_start
                unfinished = len(buffer) - len(finished)
                if unfinished:
                    sampler.pause()  # the carried sequences wait, KV cache kept, until the new weights are in
                batch, finished = finished[:B], finished[B:]
                # admission order, not finishing order: the same sequences train the same way however they finished
                batch.sort(key=lambda r: int(r.request_id))
                for r in batch:
                    del buffer[r.request_id]
            batch = distributed.broadcast(batch, dist)  # every rank trains on the batch
            # ---- Stage 3: score what is left (intra: the last chunks; otherwise all), then PPO ----
            common.learner_threads(sampler)  # every core: the sampler is paused (carried sequences) or done
            score_start = time.time()
            if dist.enabled:
                mine = score_my_share(batch)
            else:
                score(batch)
                mine = set(range(B))
            exposed_score = time.time() - score_start
            train_start = time.time()
            if "rm" in downstream:  # (under torchrun each rank has its rows' scores: summed, every rank has all)
                scores = distributed.all_sum(torch.tensor([scored(r, "rm", downstream["rm"]).item() if i in mine else 0.0
                                                           for i, r in enumerate(batch)]), dist)
            else:
                scores = torch.tensor([task.reward(r.final.text, r.problem) for r in batch])
            no_eos = torch.tensor([r.final.finish_reason != "stop" for r in batch], dtype=torch.float32)
            scores = scores - eos_penalty * no_eos
            lengths = [len(r.response) for r in batch]
            T = max(lengths)
            resp_mask = torch.zeros((B, T))
            sampler_logp, ref_logp, values, fresh = (torch.zeros((B, T)) for _ in range(4))
            token_versions = [[v for v, s, e in r.final.versions for _ in range(e - s)] for r in batch]
            for i, r in enumerate(batch):
                n = lengths[i]
                resp_mask[i, :n] = 1
                sampler_logp[i, :n] = torch.tensor(r.final.logprobs)  # the policy that sampled each token
                if i in mine:
                    ref_logp[i, :n] = scored(r, "ref", ref_policy).cpu()
                    values[i, :n] = scored(r, "critic", critic).cpu()
                fresh[i, :n] = torch.tensor([float(v == version) for v in token_versions[i]])  # sampled by the current weights
                r.prefix.clear()  # what the downstream models gave is read: free the batch's KV caches before the update
            ref_logp, values = distributed.all_sum((ref_logp, values), dist)  # every rank's rows: GAE and whitening see the batch
            if not args.inter:  # plain PPO and intra alone: every token by the weights the learner holds
                common.check_sampler_version([r.final for r in batch], version)
            lags = [version - v for versions in token_versions for v in versions]  # before this iteration's updates
            tis = {}
            if not tis_on:
                old_logp, weights = sampler_logp, None  # same precision on both sides: the sampler's logprobs are the learner's
            else:  # TIS: PPO's old policy is the learner now; the sampler's own numerics and staleness go into a weight
                policy.eval()
                old_logp = torch.zeros((B, T))
                for i, row in enumerate(learner_logprobs(policy, batch, tokenizer.pad_token_id, args.micro_batch_size, args.micro_batch_tokens,
                                                         args.autocast_bf16, dist, **processing)):
                    old_logp[i, :len(row)] = row  # (under torchrun another rank's rows are empty here)
                old_logp = distributed.all_sum(old_logp, dist)
                weights, tis = tis_weights(old_logp, sampler_logp, resp_mask, args.tis_cap)
                diff_sum, diff_count = ((old_logp - sampler_logp).abs() * fresh).sum().item(), fresh.sum().item()
            kl = (old_logp - ref_logp) * resp_mask
            rewards = -args.kl_coef * kl
            rewards[torch.arange(B), torch.tensor(lengths) - 1] += scores
            advantages = gae(rewards, values, args.gamma, args.lam)
            returns = advantages + values
            advantages = whiten(advantages, resp_mask)

            learner.train()  # (the critic goes back to eval for the next prefill: gradient checkpointing drops KV caches)
            stats: dict[str, list[float]] = {k: [] for k in ("pg", "vf", "clipfrac", "approx_kl", "entropy")}
            total_tokens = sum(lengths)
            data = dict(old_logp=old_logp, advantages=advantages, values=values, returns=returns, weights=weights,
                        sampler_logp=sampler_logp, fresh=fresh)
            for epoch in range(args.num_ppo_epochs):
                # rank 0's draw (its RNG is the one a checkpoint restores), the same minibatches on every rank
                order = distributed.broadcast(np.random.permutation(B) if dist.is_main else None, dist)
                for m, minibatch in enumerate(np.array_split(order, args.num_minibatches)):
                    optimizer.zero_grad()
                    # no step yet: the learner's logprobs at the sampler's weights (without TIS: with it, measured above)
                    first = not tis_on and epoch == 0 and m == 0
                    out = ppo_backward(policy, critic, batch, minibatch.tolist(), data, args, tokenizer.pad_token_id, diff=first, d=dist)
                    # every rank's verdict: one rank's NaN skips the step on all of them (a rank stepping alone would diverge)
                    loss_is_finite = distributed.all_max(0.0 if out.pop("loss_is_finite") else 1.0, dist) == 0.0
                    out = distributed.all_sum(out, dist)  # this rank's micro-batches' sums -> the minibatch's
                    for k in stats:
                        stats[k].append(out[k] / total_tokens)
                    if first:
                        diff_sum, diff_count = out["diff_sum"], out["diff_count"]
                    if epoch == 0 and m == 0:  # no step yet: how far pi_old is from the learner (0 when pi_old is the learner's)
                        first_ratio_deviation = out["ratio_deviation"] / max(out["tokens"], 1e-9)
                    stepped, grad_norm = guarded_step(optimizer, parameters, args.max_grad_norm, loss_is_finite)
                    if stepped:
                        version += 1
                    else:  # NaN/inf loss or gradient: this step is dropped, the weights and Adam's moments stay finite
                        totals["nonfinite_skipped"] += 1
            critic.eval()
            train_seconds = time.time() - train_start
            # carried sequences continue exactly under the new policy; no push if every step was skipped
            push_seconds = 0.0
            if version != pushed_version:
                distributed.gather_into(policy, push_model, dist)  # under torchrun: every rank takes part, rank 0 pushes
                push_seconds = sampler.push_weights(version, recompute_kv=True) if dist.is_main else 0.0
                pushed_version = version
            if unfinished:  # (rank 0's count: 0 on the other ranks)
                sampler.resume()
            iteration += 1

            # ---- controllers: Delta (Algorithm 1 lines 22-27) and the chunk size ----
            reward_history.append(scores.mean().item())
            if args.inter and args.delta > 0:  # --delta 0 pins it: no over-commitment at all
                delta, reward_history = next_delta(delta, reward_history, args.delta_window, args.delta_min, args.delta_max, args.delta_rule)
            if args.intra and args.chunk_tune_every and (iteration - 1) % args.chunk_tune_every < len(args.chunk_candidates):
                trial_seconds[chunk] = generate_seconds + exposed_score

            iteration_seconds = time.time() - iteration_start
            totals["samples"] += B
            totals["tokens"] += total_tokens
            totals["wall"] = time.time() - loop_start
            ages = [iteration - 1 - r.admitted for r in batch]
            valid = resp_mask.bool()
            explained_variance = 1 - torch.var(returns[valid] - values[valid]) / torch.var(returns[valid])
            accuracy = float(np.mean([task.is_correct(r.final.text, r.problem) for r in batch]))
            metrics = {
                "charts/reward": scores.mean().item(), "charts/accuracy": accuracy, "charts/kl": (kl.sum(1)).mean().item(),
                "charts/response_length": float(np.mean(lengths)), "charts/no_eos_fraction": no_eos.mean().item(),
                "charts/delta": delta, "charts/chunk_size": chunk if args.intra else 0,
                "charts/carried_over": len(buffer), "charts/batch_age_max": max(ages), "charts/batch_age_mean": float(np.mean(ages)),
                "charts/carried_in_batch": sum(a > 0 for a in ages),
                # generated across a weight update, its partial tokens kept: the carried-over sequences that resumed
                "charts/resumed_in_batch": sum(len({v for v, _, _ in r.final.versions}) > 1 for r in batch),
                "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags), "charts/explained_variance": explained_variance.item(),
                # mean |sampler - learner| logprob over the tokens the current weights sampled: the numerical mismatch
                "charts/logprob_diff": diff_sum / diff_count if diff_count else float("nan"),
                "charts/nonfinite_skipped": totals["nonfinite_skipped"],
                # mean |pi / pi_old - 1| over the first minibatch's tokens, before any step: the precision split's imprint on
                # PPO's ratio when pi_old is the sampler's; 0 when it is the learner's (--tis) and nothing is carried over
                "charts/first_ratio_deviation": first_ratio_deviation,
                "charts/episodes": totals["samples"], "charts/episodes_per_second": totals["samples"] / totals["wall"],
                "charts/tokens_per_second": totals["tokens"] / totals["wall"],
                "charts/skipped_long_prompts": totals["skipped_prompts"],
                "losses/policy": sum(stats["pg"]) / args.num_ppo_epochs, "losses/value": sum(stats["vf"]) / args.num_ppo_epochs,
                "losses/clipfrac": sum(stats["clipfrac"]) / args.num_ppo_epochs, "losses/approx_kl": sum(stats["approx_kl"]) / args.num_ppo_epochs,
                "losses/entropy": sum(stats["entropy"]) / args.num_ppo_epochs, "losses/grad_norm": grad_norm.item(),
                "time/iteration_seconds": iteration_seconds, "time/generate_seconds": generate_seconds,
                "time/score_hidden_seconds": hidden_score, "time/score_exposed_seconds": exposed_score,
                "time/train_seconds": train_seconds, "time/push_seconds": push_seconds,
            }
            if tis_on:
                metrics.update({"charts/tis_max_ratio": tis["max_ratio"], "charts/tis_truncated_fraction": tis["truncated_fraction"]})
            common.warn_logprob_diff(metrics["charts/logprob_diff"], tis_on, warned)
            logger.log(version, metrics, echo=False)
            progress.update(1, reward=metrics["charts/reward"], acc=float(accuracy), kl=metrics["charts/kl"], delta=delta)
            if iteration == 1:  # what the model really sees (chat template, special tokens) and writes
                print(f"sample: {tokenizer.decode(batch[0].tokens)!r}")
            if iteration % 10 == 0 or iteration == args.num_iterations or iteration == 1:
                progress.write(f"iteration {iteration}/{args.num_iterations}: reward {metrics['charts/reward']:.3f} acc {accuracy:.3f} "
                               f"kl {metrics['charts/kl']:.3f} vf {metrics['losses/value']:.4f} clipfrac {metrics['losses/clipfrac']:.3f} "
                               f"delta {delta} chunk {metrics['charts/chunk_size']} carried {len(buffer)} "
                               f"time gen/score/train {generate_seconds:.2f}/{exposed_score:.2f}/{train_seconds:.2f} s (score hidden {hidden_score:.2f} s)")
            if dist.is_main and args.snapshot_every and iteration % args.snapshot_every == 0:
                logger.snapshot(version, push_model)
            if iteration == args.num_iterations or (args.save_every and iteration % args.save_every == 0):  # (every rank; rank 0 writes)
                common.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, learner, optimizer, version,
                                            data_position, dist=dist, hf_model=push_model, tokenizer=tokenizer, iteration=iteration,
                                            totals=totals, delta=delta, chunk=chunk, reward_history=reward_history,
                                            carried_keys=[r.key for r in buffer.values()], keep=args.keep_checkpoints,
                                            # nothing in flight without inter: what the next iteration draws from
                                            sampler_rng=sampler.rng_state() if not args.inter and dist.is_main
                                            and hasattr(sampler, "rng_state") else None)
        progress.close()
        eval_end = {}
        if dist.is_main:
            sampler.abort(list(sampler.pending))
            eval_end = common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                       chat_template=args.chat_template, max_tokens=args.max_new_tokens, **processing)
        logger.log(version, eval_end)
        memory = common.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)

    if not dist.is_main:  # rank 0 writes the report
        return

    label = {(True, True): "OPPO", (True, False): "intra only", (False, True): "inter only", (False, False): "plain PPO"}[(args.intra, args.inter)]
    rows = [r for r in common.read_metrics(logger.dir) if "time/iteration_seconds" in r]
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    logger.report(version, f"{label}: {args.num_iterations} iterations of {B} sequences, {args.num_ppo_epochs} epochs x "
                  f"{args.num_minibatches} minibatches (seconds per iteration)",
                  {"method": label, "wall (s)": totals["wall"], "iteration": mean("time/iteration_seconds"),
                   "generate": mean("time/generate_seconds"), "score exposed": mean("time/score_exposed_seconds"),
                   "score hidden": mean("time/score_hidden_seconds"), "train": mean("time/train_seconds"),
                   "push": mean("time/push_seconds"), "reward (last 10)": float(np.mean([r["charts/reward"] for r in rows[-10:]]))},
                  eval_start, eval_end, memory)
    logger.close()


if __name__ == "__main__":
    main()
