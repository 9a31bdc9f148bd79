"""RLOO with off-policy K-reuse. Paper: Bharani, "Systems-Aware Off-Policy RLOO: Amortizing Sampling Cost via
K-Reuse" (Stanford CS224R final report, 2025).

Each sampling round draws G responses for each of P prompts from the vLLM sampler, then takes K gradient steps on
that one batch, correcting for the policy drift with importance weights w = exp(log pi_theta_j(y|x) - log
pi_theta_0(y|x)). K=1 is plain on-policy RLOO. Weights are pushed to the sampler once per round.

    python rloo_kreuse.py --model tiny --k 4               # the built-in model, CPU
    python rloo_kreuse.py --k 8 --model Qwen/Qwen2.5-0.5B  # the paper's v3 setup (GPU)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import common
import tasks
from common import MAX_LOG_WEIGHT, ess, truncated_is_weights  # (shared with pipeline_rl, ppo_oppo)
from fastrl import checks
from fastrl.run import Run, RunArgs

ON_GPU = torch.cuda.is_available()


@dataclass
class Args(RunArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    eval_samples: int = 16
    """samples per held-out problem for pass@k (the paper's Table 4 uses 16)"""

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
    """how the KL penalty enters (see kl_penalty): k1 folded into the reward (the gradient of the report's
    sequence-level KL(pi || pi_ref), Eq. 4; below top-p 1 see shaped_advantages), or as a loss term k2 (the
    per-token KLs' gradient only) or k3 (GRPO's; neither)"""
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
    overlap: bool = False
    """generate round r+1 while the learner does the K steps of round r (one round off-policy)"""

    def __post_init__(self):
        super().__post_init__()
        for ok, flag, message in [
            (self.k >= 1, "--k", f"must be >= 1, got {self.k}"),
            (self.group_size >= 2, "--group-size", f"RLOO needs 2 or more responses per prompt, got {self.group_size}"),
            (self.num_prompts >= 1 and self.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1"),
            (self.learning_rate > 0, "--learning-rate", "must be > 0"),
            (0 < self.top_p <= 1 and self.temperature > 0, "--top-p/--temperature",
             "need 0 < top_p <= 1, temperature > 0"),
            (self.iw_clip is None or self.iw_clip > 0, "--iw-clip", "must be > 0"),
            (self.ppo_clip is None or 0 < self.ppo_clip < 1, "--ppo-clip", "must be in (0, 1)"),
            (not (self.recompute_old_logprobs and self.overlap), "--recompute-old-logprobs",
             "cannot be combined with --overlap: the learner no longer holds the sampling weights"),
            (self.tis_cap >= 1, "--tis-cap", f"must be >= 1, got {self.tis_cap}"),
            (not (self.tis == "on" and self.overlap), "--tis",
             "on cannot be combined with --overlap: the learner no longer holds the sampling weights"),
            (self.max_new_tokens >= 1, "--max-new-tokens", "must be >= 1"),
            (self.max_prompt_tokens >= 1, "--max-prompt-tokens", "must be >= 1"),
        ]:
            checks.check_args(ok, flag, message)


# a real model's defaults (the paper's v3 setup), where they differ from the tiny model's above
PAPER = dict(task="countdown-hub", group_size=2, num_prompts=4, num_rounds=250, learning_rate=1e-6, ent_coef=0.05,
             max_new_tokens=512, max_prompt_tokens=256, eval_problems=50, autocast_bf16=ON_GPU,
             gradient_checkpointing=ON_GPU)
# --model smollm2 (SmolLM2-135M-Instruct on a CPU, docs/results.md): two-digit arithmetic, which it starts weak at, in
# rounds of 64 episodes at a learning rate that shows the gain within minutes; no KL or entropy term (no reference)
SMOLLM2 = PAPER | dict(task="arithmetic", group_size=8, num_prompts=8, num_rounds=12, learning_rate=2e-5, kl_coef=0.0,
                       ent_coef=0.0, max_new_tokens=64, max_prompt_tokens=128, eval_problems=50, eval_samples=4,
                       autocast_bf16=False, gradient_checkpointing=False)



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

    def logprobs(self, model, args: Args, dist=None) -> torch.Tensor:
        """No-grad token logprobs of every row under `model`, processed as the sampler's (temperature, top-p: the
        logprob contract), within --micro-batch-tokens; whole on every rank."""
        return common.batch_logprobs(model, self.input_ids, self.attention_mask, self.completion_mask, self.lengths,
                                     args.micro_batch_tokens, dist, bf16=args.autocast_bf16,
                                     temperature=args.temperature, top_p=args.top_p)


def learner_batch(samples, pad_token_id: int, device) -> Batch:
    """The round's completions as padded rows, with the sampler's per-token logprobs."""
    input_ids, attention_mask, completion_mask = (t.to(device) for t in common.pad_prompt_completions(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_token_id))
    mask = completion_mask[:, 1:].float()
    sampler_logp = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1]).to(device)
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    return Batch(input_ids, attention_mask, completion_mask, lengths, mask, sampler_logp)


def micro_batch_loss(policy, batch: Batch, mb: common.MicroBatch, args: Args, logprob_diff: bool = False):
    """One micro-batch's loss for one of the K steps: rloo_loss (Eq. 4) on the micro-batch's rows cut to their
    width, under the sampler's processing (the logprob contract). Returns (its mean loss, its rows, outputs): the importance
    weights per row, the loss terms as their share of the batch mean, and with `logprob_diff` the sum of
    |learner - sampler| logprobs over its completion tokens."""
    rows = mb.items
    with common.autocast(batch.input_ids.device, args.autocast_bf16):  # weights and Adam stay in --dtype
        logp, entropy = common.token_logprobs(policy, batch.input_ids[rows, :mb.width], batch.attention_mask[rows, :mb.width],
                                              batch.completion_mask[rows, :mb.width], temperature=args.temperature,
                                              top_p=args.top_p, with_entropy=True)
    cut = lambda x: None if x is None else x[rows] if x.dim() == 1 else x[rows, :logp.shape[1]]  # noqa: E731
    loss, stats = rloo_loss(logp, cut(batch.old_logp), cut(batch.ref_logp), entropy, cut(batch.mask), batch.advantages[rows],
                            tis=cut(batch.tis), ppo_clip=args.ppo_clip, iw_level=args.iw_level, iw_clip=args.iw_clip,
                            kl_estimator=args.kl_estimator, kl_coef=args.kl_coef, ent_coef=args.ent_coef)
    share = len(rows) / len(batch.lengths)  # of the batch mean
    outputs = {"w": stats["w"]} | {k: stats[k] * share for k in ("pg", "kl", "entropy")}
    if logprob_diff:
        outputs["logprob_diff"] = ((logp.detach() - cut(batch.sampler_logp)).abs() * cut(batch.mask)).sum().item()
    return loss, len(rows), outputs


# TRY NOT TO MODIFY: the round's problems, loading
class Rounds:
    """Sampling rounds (rank 0; no-ops elsewhere): the next --num-prompts problems, --group-size samples each."""

    def __init__(self, sampler, problems: tasks.TrainProblems, args: Args):
        self.sampler, self.problems, self.args = sampler, problems, args

    def submit(self):
        """Send the next round; returns what collect() waits for."""
        if self.sampler is None:
            return None
        problems, prompts, skipped = self.problems.take(self.args.num_prompts)
        a = self.args
        ids = self.sampler.submit(prompts, n=a.group_size, temperature=a.temperature, top_p=a.top_p,
                                  max_tokens=a.max_new_tokens)
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
        print("note: --overlap with a sampler whose precision differs from the learner's: log pi_theta0 is the "
              "sampler's (the learner no longer holds the sampling weights), so K-reuse's weights include the mismatch")
    return not args.overlap and checks.mismatch_correction(args.tis, args.sampler_dtype, args.placement, learner_bf16)


def load_models(args: Args, run: Run, model_path: str):
    """The policy (the model the sampler gets), the frozen reference (only when --kl-coef uses it) and Adam."""
    dtype = getattr(torch, args.dtype)
    policy = common.load_policy(model_path, run.device, dtype=dtype)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: the numbers do not change)
    ref_policy = None
    if args.kl_coef:
        ref_policy = run.frozen_model(common.load_policy(model_path, run.device, dtype=dtype).eval().requires_grad_(False))
    policy = run.learner_model(policy)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all
    return policy, ref_policy, optimizer


def main():
    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    tis_on = mismatch_correction_on(args)
    recompute_old_logprobs = args.recompute_old_logprobs or tis_on  # pi_theta0 at the learner's precision
    run = Run(args, "rloo", tasks.HUB_TASKS, common.resolve_model, overlapped=args.overlap)  # flags, sampler's start
    with run:  # the sampler closes however this ends
        tokenizer, task = tasks.load(args, run.model_path)
        policy, ref_policy, optimizer = load_models(args, run, run.model_path)
        # pass@k on the held-out split, sampling as in training (the paper's Table 4)
        evaluate = lambda: tasks.evaluate(run.sampler, task, tokenizer, args.eval_problems, args.eval_samples,  # noqa: E731
                                          args.max_prompt_tokens, args.chat_template, temperature=args.temperature,
                                          top_p=args.top_p, max_tokens=args.max_new_tokens)
        start = run.begin(policy, optimizer, evaluate)  # resume, weight sync, pass@k at the start
        step, sampler_rng = start.step, start.sampler_rng
        rounds = Rounds(run.sampler, tasks.TrainProblems(task, tokenizer, args, start.data_position), args)
        pending = rounds.submit()
        for round_index in range(start.round, args.num_rounds):
            # ---- sampling round: G responses for each prompt, with the sampler's logprobs ----
            wait_start = time.perf_counter()
            problems, samples, skipped, generated_in = run.from_main(rounds.collect, pending)
            run.check_version(samples, step, max_lag=args.k if args.overlap else 0)  # on-policy, or a round behind
            if not args.overlap:
                sampler_rng = run.sampler_rng()  # nothing generating now: what the next round will draw from
            generate_seconds = time.perf_counter() - wait_start if args.overlap else generated_in
            if args.overlap and round_index + 1 < args.num_rounds:
                pending = rounds.submit()  # generated with the current weights while we update

            # ALGO LOGIC: rewards, pi_theta0 and pi_ref of the sampled tokens
            train_start = time.perf_counter()
            run.learner_threads()  # every core in a synchronous round; one while the next round generates
            rewards = torch.tensor([task.reward(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            correct = np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            batch = learner_batch(samples, tokenizer.pad_token_id, run.device)
            batch.ref_logp = None if ref_policy is None else batch.logprobs(ref_policy, args, run.dist)
            # log pi_theta0: the learner's own recomputation (--tis, --recompute-old-logprobs), or the sampler's
            batch.old_logp = batch.logprobs(policy, args, run.dist) if recompute_old_logprobs else batch.sampler_logp
            tis_stats = {}
            if tis_on:  # the mismatch correction: min(pi_learner / pi_sampler, C), apart from K-reuse's weights
                batch.tis, tis_stats = truncated_is_weights(batch.old_logp, batch.sampler_logp, batch.mask,
                                                            args.tis_level, args.tis_cap)
            k1_shaped = args.kl_estimator == "k1" and ref_policy is not None  # reward r - kl_coef * sum_t log pi/pi_ref

            # ALGO LOGIC: K gradient steps on this one batch, each weighted by pi_theta_j / pi_theta0
            fresh = not args.overlap  # at k-step 1 the learner holds the sampling weights
            iw_means, ess_values, grad_norms, clipped, round_start_step, logprob_diff = [], [], [], [], step, math.nan
            for k_step in range(args.k):
                # k1 of the current policy (pi_theta0 at k-step 1 on fresh weights): a no-grad forward per later k-step
                reuse = (fresh and k_step == 0) or not k1_shaped
                current_logp = batch.old_logp if reuse else batch.logprobs(policy, args, run.dist)
                batch.advantages = shaped_advantages(rewards.to(run.device), current_logp, batch.ref_logp, batch.mask,
                                                     kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                                                     group_size=args.group_size)
                if k_step == 0:
                    run.warn_no_learning(batch.advantages, "every advantage is 0 or not finite (each prompt's rewards "
                                         "tie, or --group-size 1)")
                # each micro-batch's loss backpropagated with its share of the batch mean: the gradients accumulate
                # to exactly the whole batch's (memory bounded by --micro-batch-tokens); then one clipped step
                loss, out = 0.0, {}
                for mb in common.micro_batch_plan(batch.lengths, args.micro_batch_tokens, dist=run.dist):
                    mb_loss, size, mb_out = micro_batch_loss(policy, batch, mb, args, logprob_diff=fresh and k_step == 0)
                    share = mb.weight * size / len(batch.lengths)  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, mb, mb_out, len(batch.lengths))
                loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches
                grad_norm = run.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
                optimizer.zero_grad()
                if fresh and k_step == 0:  # |learner - sampler|: the first thing to look at when training goes wrong
                    logprob_diff = out["logprob_diff"] / batch.mask.sum().item()
                if not stepped:  # a NaN/inf never reaches the weights, Adam, the sampler nor a checkpoint
                    run.totals["nonfinite_skipped"] += 1
                    continue
                step += 1
                grad_norms.append(grad_norm.item())
                clipped.append(grad_norm.item() > args.max_grad_norm)
                iw_means.append(out["w"].mean().item())
                ess_values.append(ess(out["w"]))
            train_seconds = time.perf_counter() - train_start

            # ---- push the new weights; the next round samples with them ----
            push_seconds = run.push(step)
            if not args.overlap and round_index + 1 < args.num_rounds:
                pending = rounds.submit()
            run.count(episodes=len(samples), generate_seconds=generate_seconds, train_seconds=train_seconds)
            metrics = {
                "charts/reward": rewards.mean().item(), "charts/accuracy": correct,
                "charts/response_length": batch.mask.sum(1).mean().item(),
                "charts/truncated_fraction": float(np.mean([s.finish_reason == "length" for s in samples])),
                "charts/skipped_long_prompts": skipped, **run.lags(samples, round_start_step),
                # charts/kl, the same in every script: k3 of the sampled responses, whatever the penalty's estimator
                "charts/kl": (common.sampled_kl(batch.old_logp, batch.ref_logp, batch.mask).mean().item()
                              if ref_policy is not None else math.nan),
                "charts/advantage_std": batch.advantages.std().item(),
                "charts/ess": min(ess_values, default=math.nan),
                "losses/loss": loss.item(), "losses/pg": out["pg"].item(), "losses/kl_penalty": out["kl"].item(),
                "losses/entropy": out["entropy"].item(),
                "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else math.nan,
                "losses/grad_clipped_fraction": float(np.mean(clipped)) if clipped else math.nan,
                "time/generate_seconds": generate_seconds, "time/train_seconds": train_seconds,
                "time/push_seconds": push_seconds,
                **({"charts/logprob_diff": logprob_diff} if math.isfinite(logprob_diff) else {}),
                **{f"charts/tis_{k}": v for k, v in tis_stats.items()},  # tis_max_ratio, tis_truncated_fraction
                **{f"charts/iw_mean_k{j + 1}": w for j, w in enumerate(iw_means)},
                **{f"charts/ess_k{j + 1}": e for j, e in enumerate(ess_values)},
            } | run.throughput(step)
            run.warn_logprob_diff(logprob_diff, tis_on)  # (a NaN: not measured this round)
            run.log(round_index + 1, step, metrics, show=("charts/ess", f"charts/iw_mean_k{args.k}"))
            run.end_round(round_index + 1, step, rounds.problems.position, sampler_rng, tokenizer)
        run.finish(step)  # pass@k at the end, peak memory
    run.report("RLOO with K-reuse: the paper's Table 2 for this run; held-out pass@k, its Table 4", {"K": str(args.k)})

if __name__ == "__main__":
    main()
