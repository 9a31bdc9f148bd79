"""RLOO with off-policy K-reuse. Paper: Bharani, "Systems-Aware Off-Policy RLOO: Amortizing Sampling Cost via
K-Reuse" (Stanford CS224R final report, 2025).

What it adds to examples/reinforce.py: the leave-one-out baseline, and K gradient steps on each sampled batch (G
responses to each of P prompts), each weighted by w = exp(log pi_theta_j(y|x) - log pi_theta_0(y|x)) for the policy's
drift since sampling; K=1 is plain on-policy RLOO. Weights are pushed to the sampler once per round.

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
from common import Run  # (Run: every script's setup)
from fastrl import checks, memory_plan
from fastrl.run import RunArgs

ON_GPU = torch.cuda.is_available()
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a sequence weight beyond it is as good as infinite, and inf * 0 is NaN


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
    """how the KL penalty enters (kl_penalty): k1 folded into the reward (the gradient of Eq. 4's sequence-level KL;
    below top-p 1 see shaped_advantages), or a loss term k2 (the per-token KLs' gradient only) or k3 (GRPO's)"""
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
    """importance weights per `sequence` (the paper) or per `token` (--ppo-clip's ratio is the sequence's at both)"""
    iw_clip: float | None = None
    """rho-bar: clip importance weights at this value (off by default; the paper's next step)"""
    ppo_clip: float | None = None
    """epsilon: use the PPO-style clipped ratio instead (Proximal RLOO, async-RLHF paper App. B)"""
    recompute_old_logprobs: bool = False
    """log pi_theta0 from the learner even without --tis (always with --tis): k-step 1's own forward, or a forward of
    its own when --kl-estimator k1 needs it before (a reference model)"""
    tis: Literal["auto", "on", "off"] = "auto"
    """training-inference mismatch correction (truncated importance sampling): auto = on whenever the sampler's
    numbers differ from the learner's (a sampler not in fp32, the GPU default; a bf16 learner; bf16-rounded pushes),
    as TRL 1.16's GRPOTrainer by default. On: log pi_theta0 is the learner's own recomputation, the sampler's logprobs
    enter only the weight min(pi_learner / pi_sampler, --tis-cap) at --tis-level (docs/defaults.md); --overlap: the
    learner's weights at the round's start (decoupled, as ppo_oppo's: the round's staleness in that weight too)"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold 2.0; TRL 1.16's GRPOTrainer zeroes a
    weight above its vllm_importance_sampling_clip_max 3.0 instead)"""
    tis_level: Literal["token", "sequence"] = "token"
    """the truncated IS weight per `token` (verl's token-TIS preset) or per `sequence` (one min(prod of ratios, C) per
    response; TRL 1.16's GRPOTrainer masks per sequence, "sequence_mask"), whatever --iw-level"""
    overlap: bool = False
    """generate round r+1 while the learner does the K steps of round r (one round off-policy)"""

    def __post_init__(self):
        super().__post_init__()
        for ok, flag, message in [
            (self.k >= 1, "--k", f"must be >= 1, got {self.k}"),
            (self.group_size >= 2, "--group-size", f"RLOO needs 2 or more responses per prompt, got {self.group_size}"),
            (self.num_prompts >= 1, "--num-prompts", "must be >= 1"),
            (self.iw_clip is None or self.iw_clip > 0, "--iw-clip", "must be > 0"),
            (self.ppo_clip is None or 0 < self.ppo_clip < 1, "--ppo-clip", "must be in (0, 1)"),
            (not (self.recompute_old_logprobs and self.overlap), "--recompute-old-logprobs",
             "cannot be combined with --overlap: the learner no longer holds the sampling weights (--tis on: the "
             "round's start, its staleness in the truncated weight)"),
            (self.tis_cap >= 1, "--tis-cap", f"must be >= 1, got {self.tis_cap}"),
        ]:
            if not ok:  # one line naming the flag, before any process starts
                raise SystemExit(f"error: {flag}: {message}")


# a real model's defaults (the paper's v3 setup), where they differ from the tiny model's above
PAPER = dict(task="countdown-hub", group_size=2, num_prompts=4, num_rounds=250, learning_rate=1e-6, ent_coef=0.05,
             max_new_tokens=512, max_prompt_tokens=256, eval_problems=50, autocast_bf16=ON_GPU,
             gradient_checkpointing=ON_GPU)
# --model smollm2 (SmolLM2-135M-Instruct on a CPU, docs/results.md): two-digit arithmetic, which it starts weak at, in
# rounds of 64 episodes at a learning rate that shows the gain within minutes; no KL or entropy term (no reference);
# 512-token micro-batches hold the learner under 4 GB at the speed of 8,192 (docs/results.md)
SMOLLM2 = PAPER | dict(task="arithmetic", group_size=8, num_prompts=8, num_rounds=12, learning_rate=2e-5, kl_coef=0.0,
                       ent_coef=0.0, max_new_tokens=64, max_prompt_tokens=128, eval_problems=100, eval_samples=4,
                       autocast_bf16=False, gradient_checkpointing=False, micro_batch_tokens=512)  # cpu_memory.py


# ALGO LOGIC: the method's math, each piece checked by hand in tests/test_rloo_kreuse.py
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantage A_i = r_i - mean_{j != i} r_j within each group. rewards: [P, G]."""
    group = rewards.shape[1]
    return rewards - (rewards.sum(1, keepdim=True) - rewards) / (group - 1)


def importance_weights(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """w = exp(log pi_theta - log pi_theta0): [N] per sequence, or [N, T] per token (log-ratio capped, never inf)."""
    if level == "sequence":
        return torch.exp((logp - old_logp).mul(mask).sum(1).clamp(max=MAX_LOG_WEIGHT))
    return torch.exp((logp - old_logp).clamp(max=MAX_LOG_WEIGHT)) * mask


def kl_penalty(logp, ref_logp, mask, estimator: str) -> torch.Tensor:
    """Per-sequence KL term of samples from pi ([N]; Schulman's k1/k2/k3, Tang & Munos 2025 for their gradients):
    k1 = log pi - log pi_ref, zero gradient as a loss: main() folds it into the reward (shaped_advantages), the exact
    gradient of Eq. 4's KL; k2 = (log pi - log pi_ref)^2 / 2 per token: each token's KL gradient at its prefix only;
    k3 = r - log r - 1, r = pi_ref / pi: unbiased and non-negative, but as a loss KL(pi_ref || pi)'s gradient."""
    log_ratio = (ref_logp - logp) * mask
    if estimator == "k3":
        return (torch.expm1(log_ratio) - log_ratio).mul(mask).sum(1)
    if estimator == "k2":
        return (0.5 * log_ratio ** 2).sum(1)
    return -log_ratio.sum(1)


def shaped_advantages(rewards, logp, ref_logp, mask, *, kl_coef: float, kl_estimator: str,
                      group_size: int) -> torch.Tensor:
    """Leave-one-out advantages [N] of the reward shaped by k1, r - kl_coef * sum_t log(pi / pi_ref), under the policy
    `logp` is of. Called at every k-step with the current policy's logprobs, w * (r - kl_coef * k1_theta) * grad log
    pi_theta is the exact gradient of E_pi[sum_t log pi - log pi_ref] off-policy too (k1 of pi_theta0 would be stale).
    At top-p 1 that is Eq. 4's KL; below it, the KL of the two nucleus distributions where the reference's nucleus
    holds the policy's, and a finite stand-in elsewhere (docs/defaults.md). rewards: [N]; ref_logp None: no KL."""
    shaped = rewards
    if kl_estimator == "k1" and ref_logp is not None:
        shaped = shaped - kl_coef * kl_penalty(logp, ref_logp, mask, "k1")
    return rloo_advantages(shaped.view(-1, group_size)).view(-1)


def rloo_loss(logp, old_logp, ref_logp, entropy, mask, advantages, *, ppo_clip: float | None, iw_level: str,
              iw_clip: float | None, kl_estimator: str, kl_coef: float, ent_coef: float, tis=None):
    """The paper's Eq. 4 for one minibatch: -E[w A log pi] - ent_coef H + kl_coef KL(pi||pi_ref). logp, old_logp,
    ref_logp, entropy, mask: [N, T]; advantages: [N]; tis: the truncated IS weights per sequence ([N]) or per token
    ([N, T]) or None; every iw_level x tis level x ppo_clip combines (under ppo_clip the ratio is the sequence's).
    Returns (loss, stats): the mean pg, kl and entropy terms and the importance weights w [N]."""
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
class Batch(common.Batch):
    """One sampling round on the learner (common.Batch: padded rows, mask, the sampler's logprobs), with K-reuse's
    log pi_theta0 and log pi_ref, whether --tis weighs it, and the leave-one-out advantages [N]."""

    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    theta0_from_forward: bool = False  # k-step 1's forward writes old_logp as it goes (main())
    tis_on: bool = False  # --tis: the truncated IS weights from old_logp and the sampler's


def micro_batch_loss(policy, batch: Batch, mb, args: Args, logprob_diff: bool = False):
    """rloo_loss (Eq. 4) on a micro-batch's rows cut to their width, processed as the sampler's (the logprob contract).
    Returns (its mean loss, its row count, outputs): the importance weights per row, the loss terms as their share of
    the batch mean, with `logprob_diff` the sum of |learner - sampler| logprobs over its completion tokens."""
    rows, width = mb.items, mb.width
    with torch.autocast(batch.input_ids.device.type, torch.bfloat16, enabled=args.autocast_bf16):  # Adam: --dtype
        logp, entropy = common.token_logprobs(policy, batch.input_ids[rows, :width], batch.attention_mask[rows, :width],
                                              batch.completion_mask[rows, :width], temperature=args.temperature,
                                              top_p=args.top_p, with_entropy=True)
    cut = lambda x: None if x is None else x[rows] if x.dim() == 1 else x[rows, :logp.shape[1]]  # noqa: E731
    if batch.theta0_from_forward and mb.weight:  # k-step 1 at the sampling weights: this forward is log pi_theta0
        batch.old_logp[rows, :logp.shape[1]] = logp.detach()
    old_logp = logp.detach() if batch.theta0_from_forward else cut(batch.old_logp)
    tis = None  # the mismatch correction's weight min(pi_learner / pi_sampler, C), apart from K-reuse's weights
    if batch.tis_on:  # (the same ratio as K-reuse's weights: pi_theta0 over the sampler's policy, truncated at C)
        tis = importance_weights(old_logp, cut(batch.sampler_logp), cut(batch.mask), args.tis_level)
        tis = tis.clamp(max=args.tis_cap)
    loss, stats = rloo_loss(logp, old_logp, cut(batch.ref_logp), entropy, cut(batch.mask),
                            batch.advantages[rows], tis=tis, ppo_clip=args.ppo_clip, iw_level=args.iw_level,
                            iw_clip=args.iw_clip, kl_estimator=args.kl_estimator, kl_coef=args.kl_coef,
                            ent_coef=args.ent_coef)
    share = len(rows) / len(batch.lengths)  # of the batch mean
    outputs = {"w": stats["w"]} | {k: stats[k] * share for k in ("pg", "kl", "entropy")}
    if logprob_diff:
        outputs["logprob_diff"] = ((logp.detach() - cut(batch.sampler_logp)).abs() * cut(batch.mask)).sum().item()
    return loss, len(rows), outputs


# TRY NOT TO MODIFY: loading
def load_models(args: Args, run: Run, model_path: str):
    """The policy (the model the sampler gets), the frozen reference (only when --kl-coef uses it) and Adam."""
    dtype = getattr(torch, args.dtype)
    policy = run.learner_model(common.load_policy(model_path, run.device, dtype=dtype))
    ref_policy = run.learner_model(common.load_policy(model_path, run.device, dtype=dtype).eval().requires_grad_(False)
                                  if args.kl_coef else None, pushed=False)  # (--kl-coef 0: no reference model)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all
    return policy, ref_policy, optimizer


def main():
    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    run = Run(args, memory_plan.GROUPS, overlapped=args.overlap)  # P x G
    tis_on = checks.tis_applies(args, args.tis)  # (--overlap: pi_theta0 is the round's start, a proximal policy)
    recompute_old_logprobs = args.recompute_old_logprobs or tis_on  # pi_theta0 at the learner's precision
    with run:  # the sampler closes however this ends
        tokenizer, task, evaluate = tasks.load(args, run.model_path, run.sampler.engine)  # evaluate: its Table 4
        policy, ref_policy, optimizer = load_models(args, run, run.model_path)
        sampler = run.sampler
        start = run.resume(policy, optimizer)  # the run directory; a checkpoint's weights, Adam, RNGs and counters
        eval_start = start.eval_start or run.log(start.step, evaluate())  # pass@k at the run's start
        step, totals = start.step, start.totals
        if args.snapshot_every and start.round == 0:
            run.snapshot(step)  # time 0 of the learning curve
        train_problems = tasks.TrainProblems(task, tokenizer, args, start.data_position)

        def sample_round():  # the next prompts, G responses each, sampled as batch.logprobs(..., args) assumes
            problems, prompts, skipped = train_problems.take(args.num_prompts)
            return problems, skipped, sampler.generate(prompts, n=args.group_size, temperature=args.temperature,
                                                       top_p=args.top_p, max_tokens=args.max_new_tokens)
        pending, clock = None, time.perf_counter() - totals["wall_seconds"]  # (a resumed run's time too)
        for round_index in range(start.round, args.num_rounds):
            # ---- sampling round: G responses for each prompt, with the sampler's logprobs ----
            # (sent after the last round's evaluation and checkpoint: a resume samples it alike; --overlap: sent before)
            wait_start, (problems, skipped, request) = time.perf_counter(), pending or sample_round()
            samples, generate_seconds = sampler.wait(request)  # (sent to finished, however late we collect them)
            lags = sampler.check_version(samples, step, max_lag=args.k if args.overlap else 0)  # (--overlap: K older)
            learner_wait = time.perf_counter() - wait_start  # (--overlap: mostly in the push's wait, below)
            data_position = train_problems.position  # the first problem not trained on: a checkpoint resumes there
            if args.overlap and round_index + 1 < args.num_rounds:
                pending = sample_round()  # generated while we update

            # ALGO LOGIC: rewards, pi_theta0 and pi_ref of the sampled tokens
            train_start = time.perf_counter()  # (on CPU: the learner has every core, or one beside the next round)
            rewards = torch.tensor([task.reward(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            correct = np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            batch = Batch.from_samples(samples, tokenizer.pad_token_id, run.device)
            batch.ref_logp = None if ref_policy is None else batch.logprobs(ref_policy, args)
            k1_shaped = args.kl_estimator == "k1" and ref_policy is not None  # reward r - kl_coef * sum_t log pi/pi_ref
            # log pi_theta0: the sampler's, or the learner's own (--tis, --recompute-old-logprobs): k-step 1's forward
            # (the sampling weights; --overlap: the round's start) writes it, unless k1's penalty needs it before
            batch.old_logp, batch.tis_on = batch.sampler_logp, tis_on
            if recompute_old_logprobs:
                batch.theta0_from_forward = not k1_shaped
                batch.old_logp = (torch.zeros_like(batch.sampler_logp) if batch.theta0_from_forward
                                  else batch.logprobs(policy, args))

            # ALGO LOGIC: K gradient steps on this one batch, each weighted by pi_theta_j / pi_theta0
            fresh = not args.overlap  # at k-step 1 the learner holds the sampling weights
            iw_means, ess_values, grad_norms, logprob_diff = [], [], [], math.nan
            for k_step in range(args.k):
                # k1 of the current policy (pi_theta0 at k-step 1 on fresh weights): a no-grad forward per later k-step
                reuse = (fresh and k_step == 0) or not k1_shaped
                current_logp = batch.old_logp if reuse else batch.logprobs(policy, args)
                batch.advantages = shaped_advantages(rewards.to(run.device), current_logp, batch.ref_logp, batch.mask,
                                                     kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                                                     group_size=args.group_size)
                if k_step == 0:  # the task rewards' spread in each group: what the advantages have to learn from
                    spread = rewards.view(-1, args.group_size) - rewards.view(-1, args.group_size).mean(1, keepdim=True)
                    run.warn_no_learning(spread, "each prompt's rewards tie (or --group-size 1): no task signal")
                # each micro-batch's loss backpropagated with its share of the batch mean: the gradients accumulate
                # to exactly the whole batch's (memory bounded by --micro-batch-tokens); then one clipped step
                loss, out = 0.0, {}
                for mb in common.micro_batch_plan(batch.lengths, args.micro_batch_tokens):
                    mb_loss, size, mb_out = micro_batch_loss(policy, batch, mb, args, logprob_diff=fresh and not k_step)
                    share = mb.weight * size / len(batch.lengths)  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, mb, mb_out, len(batch.lengths))
                loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches
                if batch.theta0_from_forward:  # pi_theta0 whole: every rank's rows
                    batch.old_logp, batch.theta0_from_forward = run.all_sum(batch.old_logp), False
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:  # a NaN/inf never reaches the weights, Adam, the sampler nor a checkpoint
                    optimizer.step()
                    step += 1
                    grad_norms.append(grad_norm.item())
                optimizer.zero_grad()
                totals["nonfinite_skipped"] += not stepped
                if fresh and k_step == 0:  # |learner - sampler|: the first thing to look at when training goes wrong
                    logprob_diff = out["logprob_diff"] / batch.mask.sum().item()
                w = out["w"] if stepped else torch.full_like(out["w"], math.nan)  # (iw_mean_k{j}, ess_k{j}: k-step j's)
                iw_means.append(w.mean().item())
                ess_values.append((w.sum() ** 2 / (len(w) * w.pow(2).sum())).item())  # ESS / N
            tis_stats = {}  # --tis: pi_theta0 over the sampler's policy, untruncated, and how often C cut it
            if tis_on:
                ratio = importance_weights(batch.old_logp, batch.sampler_logp, batch.mask, args.tis_level)
                ratio = ratio[batch.mask.bool()] if args.tis_level == "token" else ratio  # (per token: the responses')
                tis_stats = {"charts/tis_max_ratio": ratio.max().item(),
                             "charts/tis_truncated_fraction": (ratio > args.tis_cap).float().mean().item()}
            train_seconds = time.perf_counter() - train_start

            # ---- push: the next round samples with the new weights (--overlap: the one after the round in flight)
            pushed = sampler.push(policy, step, when_idle=args.overlap)  # (so that no round mixes two policies)
            learner_wait += pushed.pop("time/idle_wait_seconds", 0.0)  # (--overlap: the wait for the round in flight)
            totals["episodes"] += len(samples)
            totals["skipped_prompts"] += skipped
            totals["generate_seconds"] += generate_seconds
            totals["learner_wait_seconds"] += learner_wait
            totals["train_seconds"] += train_seconds
            totals["wall_seconds"] = time.perf_counter() - clock
            metrics = {
                "charts/reward": rewards.mean().item(), "charts/accuracy": correct,
                "charts/response_length": batch.mask.sum(1).mean().item(),
                "charts/truncated_fraction": float(np.mean([s.finish_reason == "length" for s in samples])),
                **lags, "time/learner_wait_seconds": learner_wait,
                # charts/kl, the same in every script: k3 of the sampled responses, whatever the penalty's estimator
                "charts/kl": (kl_penalty(batch.old_logp, batch.ref_logp, batch.mask, "k3").mean().item()
                              if ref_policy is not None else math.nan),
                "charts/advantage_std": batch.advantages.std().item(),
                "charts/ess": min([e for e in ess_values if math.isfinite(e)], default=math.nan),  # (steps taken)
                "losses/loss": loss.item(), "losses/pg": out["pg"].item(), "losses/kl_penalty": out["kl"].item(),
                "losses/entropy": out["entropy"].item(),
                "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else math.nan,
                "losses/grad_clipped_fraction": np.mean([g > args.max_grad_norm for g in grad_norms] or [math.nan]),
                "time/generate_seconds": generate_seconds, "time/train_seconds": train_seconds, **pushed,
                **({"charts/logprob_diff": logprob_diff} if math.isfinite(logprob_diff) else {}), **tis_stats,
                **{f"charts/iw_mean_k{j + 1}": w for j, w in enumerate(iw_means)},
                **{f"charts/ess_k{j + 1}": e for j, e in enumerate(ess_values)}, **common.throughput(totals, step),
            }
            run.log(step, metrics, round=round_index + 1, show=("charts/ess", f"charts/iw_mean_k{args.k}"))

            # ---- after the round: the curve's weights, pass@k, the checkpoint ----
            rounds_done, last = round_index + 1, round_index + 1 == args.num_rounds
            if args.snapshot_every and rounds_done % args.snapshot_every == 0:
                run.snapshot(step)
            if args.eval_every and rounds_done % args.eval_every == 0 and not last:
                run.log(step, evaluate())
            if last or (args.save_every and rounds_done % args.save_every == 0):
                run.save(step, rounds_done, data_position, totals, tokenizer, eval_start)
        eval_end = run.log(step, evaluate())  # pass@k at the end
    run.report("RLOO with K-reuse: the paper's Table 2 for this run; held-out pass@k, its Table 4", {"K": str(args.k)},
               totals, step, eval_start, eval_end)


if __name__ == "__main__":
    main()
