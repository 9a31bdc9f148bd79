"""Asynchronous off-policy online DPO (Algorithm 1). Paper: Noukhovitch et al., "Asynchronous RLHF: Faster and More
Efficient Off-Policy RL for Language Models", arXiv:2410.18252.

What it adds to examples/reinforce.py: preference pairs (the best and worst of each prompt's group by reward; ties
dropped, counted), N DPO steps against the frozen initial policy, and the one-step-off overlap (default, Cleanba-style):
while the learner trains on the round generated with theta_{t-1}, the sampler generates the next with theta_t.
`--sync` (the next round submitted only after the push) is the on-policy baseline.

    python online_dpo_async.py --model tiny           # async, the built-in model, CPU
    python online_dpo_async.py --model tiny --sync    # the synchronous baseline
    python online_dpo_async.py --task gsm8k --model realtreetune/rho-1b-sft-GSM8K   # §A.3: Table 10's defaults
    torchrun --nproc-per-node 2 online_dpo_async.py   # the learner data-parallel (FSDP2, fastrl/distributed.py)
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F

import common
import tasks
from common import Run  # (Run: every script's setup)
from fastrl import checks, memory_plan
from fastrl.run import RunArgs

FIXED_TEST_SPLIT = ("gsm8k", "countdown-hub")  # tasks whose test split is a fixed list (--eval-problems 0 = all of it)
GPU = torch.cuda.is_available()


@dataclass
class Args(RunArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    eval_problems: int = 200
    """held-out problems; 0: a fixed dataset's whole test split (gsm8k, countdown-hub) [gsm8k 0; paper 50; tiny 200]"""
    eval_samples: Annotated[int | None, checks.help_default("1 under greedy decoding, 4 when sampling")] = None
    """completions per held-out problem: pass@k for k = 1, 2, 4, ... up to it (tasks.eval_ks)"""
    eval_decoding: Literal["greedy", "sample"] = "sample"
    """greedy: one greedy completion per problem (the paper's GSM8K pass@1); sample: as in training [gsm8k greedy]"""
    reward_model: str | None = None
    """an HF sequence-classification reward model (num_labels=1) to score completions instead of the task's reward"""

    # the method
    sync: bool = False
    """synchronous on-policy baseline: generate, then train (shorthand for --staleness 0)"""
    staleness: Annotated[Literal[0, 1] | None, checks.help_default("1; 0 under --sync")] = None
    """rounds the sampler generates ahead of the learner: 1 asynchronous (Algorithm 1), 0 synchronous"""
    group_size: int = 4
    """samples per prompt; chosen = best reward, rejected = worst [paper 2, gsm8k 4; tiny 4]"""
    num_prompts: int = 32
    """prompts per minibatch [a real model 64 (one GPU's; TL;DR's is 512, Sec. 4); gsm8k 252 (Table 10); tiny 32]"""
    num_minibatches: int = 1
    """N: minibatches generated per round and N optimizer steps on them (the paper's off-policyness knob)"""
    num_rounds: int = 60
    """sampling rounds [a real model 2000 (TL;DR's 256 steps of 512, Sec. 4); gsm8k 512 (Table 10); tiny 60]"""
    loss_type: Literal["dpo", "ipo"] = "dpo"
    """dpo (sigmoid) or ipo"""
    loss_average: Literal["kept", "all"] = "all"
    """all: the kept pairs' summed loss over the minibatch's prompts, a tie's 0 (the authors' code; the paper does not
    say); kept: the mean over the kept pairs, the gradient x 1/(kept fraction): a round with many ties weighs more"""
    beta: float = 0.1
    """DPO beta [0.1; gsm8k 0.05]"""
    eos_logprob: Literal["include", "exclude"] = "include"
    """whether a completion's ending EOS counts in its sequence logprob: include (the authors' TL;DR runs; TRL 1.16);
    exclude: the tokens before it (their GSM8K runs: pad = eos masks it) [gsm8k exclude; include]"""
    learning_rate: float = 1e-4
    """Adam learning rate (the start of --lr-schedule) [paper 3e-6; tiny 1e-4]"""
    lr_schedule: Literal["linear", "constant"] = "constant"
    """linear: from --learning-rate to 0 over --num-rounds, one value a round (Table 4); constant (Table 10, GSM8K). A
    run extended on --resume takes the new length's rate at its round (higher) [paper linear; gsm8k, tiny constant]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    temperature: float = 1.0
    """sampling temperature, applied to every logprob too (policy, reference, KL) [paper 0.7; tiny 1.0]"""
    top_p: float = 1.0
    """nucleus sampling (the paper samples the full distribution: 1.0); the learner applies the same nucleus"""
    max_new_tokens: int = 32
    """response length cap [paper 512; tiny 32]"""
    max_prompt_tokens: int = 64
    """prompt budget: longer prompts are skipped (charts/skipped_long_prompts) [paper 512; tiny 64]"""
    missing_eos_penalty: float = 1.0
    """penalty for a completion without EOS (cut at --max-new-tokens: charts/truncated_fraction); --eos-penalty-mode"""
    eos_penalty_mode: Literal["replace", "subtract", "off"] = "replace"
    """replace: such a completion scores -penalty whatever its reward (Table 4, the paper's code); subtract: score -
    penalty; off: no penalty [gsm8k off (the authors' GSM8K configs: a correct answer cut short is not rejected)]"""
    gsm8k_match: Literal["strict", "loose"] = "strict"
    """--task gsm8k's reward: strict: only a '#### n' answer counts (§5.2, the authors'); loose: the last number"""
    shuffle_train: bool = True
    """a fixed train split (gsm8k, countdown-hub) read in a new order every epoch from --seed (the authors' shuffle)"""

    @property
    def prompts_per_round(self) -> int:  # N minibatches of --num-prompts each (memory_plan reads it too)
        return self.num_prompts * self.num_minibatches

    def __post_init__(self):  # the method's flags first (one line naming a bad one), then the run's (RunArgs)
        for ok, flag, message in (
            (not (self.sync and self.staleness == 1), "--sync", "is --staleness 0; drop one of them"),
            (self.group_size >= 2, "--group-size", f"a pair needs 2 or more samples, got {self.group_size}"),
            (self.num_minibatches >= 1, "--num-minibatches", f"must be >= 1, got {self.num_minibatches}"),
            (self.num_prompts >= 1 and self.beta > 0, "--num-prompts/--beta", "must be >= 1 and > 0"),
            (self.temperature > 0, "--temperature", f"must be > 0 (0: every pair ties), got {self.temperature}"),
            (0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}"),
            (self.missing_eos_penalty >= 0, "--missing-eos-penalty", f"must be >= 0, got {self.missing_eos_penalty}"),
            (self.eval_samples is None or self.eval_samples == 1 or (self.eval_samples > 1 and self.eval_decoding ==
             "sample"), "--eval-samples", f"must be >= 1, and 1 under --eval-decoding greedy; got {self.eval_samples}"),
            (self.eval_problems >= 1 or (self.eval_problems == 0 and self.task in FIXED_TEST_SPLIT), "--eval-problems",
             f"must be >= 1, or 0 (the whole test split) for {'/'.join(FIXED_TEST_SPLIT)}, got {self.eval_problems}"),
            (self.save_every >= 0, "--save-every", f"must be >= 0, got {self.save_every}"),
        ):
            if not ok:  # one line naming the flag, before any process starts
                raise SystemExit(f"error: {flag}: {message}")
        super().__post_init__()


@dataclass
class GSM8KArgs(Args):
    """--task gsm8k's defaults, for any model: Table 10, §A.3's greedy pass@1 on the test set, the authors' code."""

    task: str = "gsm8k"
    group_size: int = 4
    beta: float = 0.05
    eos_logprob: Literal["include", "exclude"] = "exclude"
    lr_schedule: Literal["linear", "constant"] = "constant"
    eos_penalty_mode: Literal["replace", "subtract", "off"] = "off"
    eval_decoding: Literal["greedy", "sample"] = "greedy"
    eval_problems: int = 0


# a real model's defaults (unless --model tiny); on a GPU bf16 autocast and checkpointing, beside a colocated sampler
PAPER = dict(group_size=2, num_prompts=64, num_rounds=2000, learning_rate=3e-6, lr_schedule="linear", temperature=0.7,
             max_new_tokens=512, max_prompt_tokens=512, eval_problems=50, autocast_bf16=GPU, gradient_checkpointing=GPU)
# --task gsm8k with a real model: Table 10's batch, 252 prompts a step; 129024 prompts = 512 steps, one a round
GSM8K_PAPER = dict(num_prompts=252, num_rounds=512)
# --model smollm2 (on a CPU): arithmetic, 16 prompts x 4 a round, a constant rate (linear would halve its mean step)
SMOLLM2 = PAPER | dict(task="arithmetic", group_size=4, num_prompts=16, num_rounds=20, learning_rate=1e-5,
                       lr_schedule="constant", max_new_tokens=64, max_prompt_tokens=128, eval_problems=100,
                       autocast_bf16=False, gradient_checkpointing=False, micro_batch_tokens=384)  # cpu_memory.py


def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over the model's and the task's defaults (GSM8KArgs); then the values that follow others."""
    argv = sys.argv[1:] if argv is None else argv
    gsm8k = "gsm8k" in ([a.split("=", 1)[1] for a in argv if a.startswith("--task=")]
                        + [v for a, v in zip(argv, argv[1:]) if a == "--task"])
    paper = ({k: v for k, v in PAPER.items() if k not in GSM8KArgs.__annotations__} | GSM8K_PAPER) if gsm8k else PAPER
    args = checks.parse_args(GSM8KArgs if gsm8k else Args, argv, paper=paper, smollm2=SMOLLM2)
    args.staleness = (0 if args.sync else 1) if args.staleness is None else args.staleness
    args.sync = args.staleness == 0
    args.eval_samples = args.eval_samples or (1 if args.eval_decoding == "greedy" else 4)
    return args


# ALGO LOGIC: the method's math, each piece checked by hand in tests/test_online_dpo_async.py
def select_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each prompt's group of rewards [P, group size]: chosen = index of the best, rejected = of the worst (the
    first of equal values). Returns (chosen, rejected, keep), keep False where the rewards all tie (no preference)."""
    chosen, rejected = rewards.argmax(1), rewards.argmin(1)
    keep = rewards.max(1).values > rewards.min(1).values
    return chosen, rejected, keep


def penalize_missing_eos(scores: torch.Tensor, ended_with_eos: torch.Tensor, penalty: float, mode: str) -> torch.Tensor:
    """Scores [n] with the completions that ended without EOS penalised. replace: -penalty whatever the score (the
    paper's code: a cut one loses to a finished one scoring above -penalty); subtract: score - penalty (TRL's
    missing_eos_penalty); off: as they are (the authors' GSM8K runs: a correct answer cut before EOS still scores 1)."""
    if mode == "off":
        return scores
    if mode == "replace":
        return torch.where(ended_with_eos, scores, torch.full_like(scores, -penalty))
    return scores - penalty * (~ended_with_eos).to(scores.dtype)


def minibatch_pairs(keep: torch.Tensor, num_minibatches: int, average: str) -> list[tuple[np.ndarray, int]]:
    """The round's N minibatches: each one's kept pairs (indices into the kept pairs, in prompt order) and the count
    its summed loss is divided by. keep: [prompts] bool. kept: the kept pairs split evenly, the mean over them; all:
    the prompts split evenly, a minibatch's kept pairs summed and divided by its number of prompts (a tie counts 0)."""
    keep = keep.cpu().numpy()
    if average == "kept":
        return [(pairs, len(pairs)) for pairs in np.array_split(np.arange(int(keep.sum())), num_minibatches)]
    pair_of_prompt = np.cumsum(keep) - 1  # a kept prompt's index among the kept pairs
    return [(pair_of_prompt[prompts][keep[prompts]], len(prompts))
            for prompts in np.array_split(np.arange(len(keep)), num_minibatches)]


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float, loss_type: str = "dpo"):
    """Per-pair loss from sequence log-probs. h = log pi(y+)/pi_ref(y+) - log pi(y-)/pi_ref(y-). DPO: -log sigmoid(beta
    h). IPO: (h - 1/(2 beta))^2. Returns (loss [pairs], beta h [pairs]); minibatch_pairs says what a step averages."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "dpo":
        return -F.logsigmoid(beta * h), beta * h
    return (h - 1 / (2 * beta)) ** 2, beta * h


# ALGO LOGIC: one DPO step's loss on a micro-batch of whole pairs (main() adds them up to the minibatch's gradient)
@dataclass
class Batch(common.Batch):
    """One round on the learner (common.Batch), with `logp_mask` [N, T - 1], the tokens a sequence's logprob sums (the
    margins: `mask` less an ending EOS under --eos-logprob exclude), and the reference's sequence logprobs [N]."""

    logp_mask: torch.Tensor | None = None
    ref_seq: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, samples, pad_token_id: int, device, eos_logprob: str = "include") -> Batch:
        """eos_logprob exclude: a completion that ended on EOS (finish reason stop: its last token) sums the others."""
        batch = super().from_samples(samples, pad_token_id, device)
        batch.logp_mask = batch.mask.clone() if eos_logprob == "exclude" else batch.mask
        if eos_logprob == "exclude":
            ended = [row for row, s in enumerate(samples) if s.finish_reason == "stop" and s.token_ids]
            batch.logp_mask[ended, [batch.lengths[row] - 2 for row in ended]] = 0  # the last token's column
        return batch


def pair_lengths(lengths: list[int], chosen_rows, rejected_rows) -> list[int]:
    """Each pair's length (its longer row): what its micro-batch's padded width is cut to."""
    return [max(lengths[c], lengths[r]) for c, r in zip(chosen_rows.tolist(), rejected_rows.tolist())]


def dpo_micro_batch(policy, batch: Batch, mb, chosen_rows, rejected_rows, args: Args,
                    logprob_diff: bool = False):
    """The DPO loss of one micro-batch of whole pairs (mb.items index chosen_rows / rejected_rows, rows of the batch),
    cut to its width. Returns (its pairs' mean loss, its number of pairs, outputs): "margins" = beta h [its pairs] and,
    with `logprob_diff`, "diff_sum" and "diff_tokens": the summed |learner - sampler| on its tokens, and their count."""
    k, width = len(mb.items), mb.width
    rows = torch.cat([chosen_rows[mb.items], rejected_rows[mb.items]])  # the chosen k, then their rejected k
    with torch.autocast(batch.input_ids.device.type, torch.bfloat16, enabled=args.autocast_bf16):  # Adam: --dtype
        token_logp = common.token_logprobs(policy, batch.input_ids[rows, :width], batch.attention_mask[rows, :width],
                                           batch.completion_mask[rows, :width], temperature=args.temperature,
                                           top_p=args.top_p)
    token_logp = token_logp * batch.logp_mask[rows, :width - 1]
    logp, ref = token_logp.sum(1), batch.ref_seq[rows]
    loss, margins = dpo_loss(logp[:k], logp[k:], ref[:k], ref[k:], beta=args.beta, loss_type=args.loss_type)
    outputs, mask = {"margins": margins}, batch.logp_mask[rows, :width - 1]  # (the tokens token_logp holds)
    if logprob_diff:
        outputs["diff_sum"] = ((token_logp.detach() - batch.sampler_logp[rows, :width - 1]).abs() * mask).sum().item()
        outputs["diff_tokens"] = mask.sum().item()
    return loss.mean(), k, outputs


def penalized_rewards(samples, problems, task, reward_model, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's scores (--reward-model's, --reward's or the task's: charts/reward) and the rewards the pairs are
    chosen by, the scores penalised without EOS, each [prompts, group size] (rank 0's)."""
    texts, problem_of = [s.text for s in samples], [problems[i // args.group_size] for i in range(len(samples))]
    scores = torch.tensor(reward_model.score(reward_model.conversations(problem_of, texts)) if reward_model is not None
                          else [task.reward(t, p) for t, p in zip(texts, problem_of)], dtype=torch.float32)
    ended_with_eos = torch.tensor([s.finish_reason == "stop" for s in samples])
    rewards = penalize_missing_eos(scores, ended_with_eos, args.missing_eos_penalty, args.eos_penalty_mode)
    return scores.view(-1, args.group_size), rewards.view(-1, args.group_size)


# TRY NOT TO MODIFY: loading
def load_models(args: Args, run: Run, model_path: str):
    """The policy (the sampler's), the reference (the frozen initial policy), Adam and on rank 0 the reward model."""
    dtype = getattr(torch, args.dtype)
    policy = run.learner_model(common.load_policy(model_path, run.device, dtype=dtype))
    ref_policy = run.learner_model(common.load_policy(model_path, run.device, dtype=dtype).eval().requires_grad_(False),
                                   pushed=False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all
    reward_model = tasks.RewardModel(args.reward_model, str(run.device)) if args.reward_model and run.is_main else None
    return policy, ref_policy, optimizer, reward_model


def main():
    args = parse_args()  # on --resume: the saved run's flags
    run = Run(args, memory_plan.PAIRS, overlapped=args.staleness > 0)
    if args.reward and args.eos_penalty_mode != "off":  # a student's own reward, rewritten where a completion is cut
        print(f"note: --eos-penalty-mode {args.eos_penalty_mode} changes --reward's score of a completion without EOS "
              f"(to {'-' if args.eos_penalty_mode == 'replace' else 'score - '}{args.missing_eos_penalty:g}; "
              "charts/eos_penalized_fraction, charts/reward_penalized); --eos-penalty-mode off keeps it")
    with run:  # the sampler closes however this ends
        tokenizer, task, evaluate = tasks.load(args, run.model_path, run.sampler.engine,
                                               greedy_eval=args.eval_decoding == "greedy")
        policy, ref_policy, optimizer, reward_model = load_models(args, run, run.model_path)
        sampler = run.sampler
        start = run.resume(policy, optimizer)  # the run directory; a checkpoint's weights, Adam, RNGs and counters
        eval_start = start.eval_start or run.log(start.step, evaluate())  # pass@k at the run's start
        step, totals = start.step, start.totals
        if args.snapshot_every and start.round == 0:
            run.snapshot(step)  # time 0 of the learning curve
        train_problems = tasks.ShuffledTrainProblems(task, tokenizer, args, start.data_position)

        def sample_round():  # the next prompts, G responses each, sampled as batch.logprobs(..., args) assumes
            first, (problems, prompts, skipped) = train_problems.position, train_problems.take(args.prompts_per_round)
            return problems, skipped, sampler.generate(prompts, n=args.group_size, temperature=args.temperature,
                                                       top_p=args.top_p, max_tokens=args.max_new_tokens), first
        # `pending`: the rounds in flight, oldest first (Algorithm 1's y_0 ~ pi_theta_0(x_0) sent in the first round)
        pending, clock = deque(), time.perf_counter() - totals["wall_seconds"]
        for round_index in range(start.round, args.num_rounds):
            # ---- sampling round: the oldest in flight (sync: by the weights just pushed; async: by theta_{t-1}) ----
            if not pending:  # sync: sent here, after the evaluation and checkpoint before (a resume samples it again)
                pending.append(sample_round())
            wait_start, (problems, skipped, request, _) = time.perf_counter(), pending.popleft()
            samples, generate_seconds = sampler.wait(request)  # (sent to finished, however late we collect them)
            learner_wait, finished_at = time.perf_counter() - wait_start, max(s.finished_at for s in samples)
            if round_index == start.round:  # what the sampler really sees (e.g. the chat template) and answers
                print(f"example: {tokenizer.decode(samples[0].prompt_token_ids)!r} -> {samples[0].text!r}")
            lags = sampler.check_version(samples, step, max_lag=args.staleness * args.num_minibatches)  # async: behind
            more, sampler_wait = round_index + 1 < args.num_rounds, math.nan
            if args.staleness and more:  # async: GENERATE with theta_t while we TRAIN on theta_{t-1}'s samples
                sampler_wait = time.time() - finished_at  # the sampler idled since it finished this round
                pending.append(sample_round())
            train_start = time.perf_counter()  # (on CPU: the learner has every core, or one beside the next round)
            fresh = all(s.version_min == s.version_max == step for s in samples)  # the learner holds their weights

            # ALGO LOGIC: rewards (a completion cut at --max-new-tokens penalised), pairs, pi_ref's sequence logprobs
            # (scores: the reward as given, charts/reward; rewards: EOS-penalized, what picks the pairs)
            scores, rewards = run.from_main(penalized_rewards, samples, problems, task, reward_model, args)  # [P, G]
            correct = np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])
            chosen, rejected, keep = select_pairs(rewards)  # the best and the worst of each prompt's group
            run.warn_no_learning(keep, "every prompt's rewards tie: no preference pair")
            pair_rows = torch.arange(len(rewards))[keep]
            chosen_rows = pair_rows * args.group_size + chosen[keep]  # rows of the batch
            rejected_rows = pair_rows * args.group_size + rejected[keep]
            batch = Batch.from_samples(samples, tokenizer.pad_token_id, run.device, args.eos_logprob)
            ref_logp = batch.logprobs(ref_policy, args)
            batch.ref_seq = (ref_logp * batch.logp_mask).sum(1)  # --eos-logprob: with or without an ending EOS

            # ALGO LOGIC: N DPO steps, one per minibatch of pairs, at this round's learning rate (--lr-schedule)
            losses, accuracies, margins, grad_norms, diff_sum, diff_tokens = [], [], [], [], 0, 0
            learning_rate = args.learning_rate * (max(0.0, 1 - round_index / args.num_rounds)  # HF's linear, stepped
                                                  if args.lr_schedule == "linear" else 1.0)  # once a round, to 0
            for group in optimizer.param_groups:  # from the round alone, not Adam's saved lr: a resume continues it
                group["lr"] = learning_rate
            for pairs, total in minibatch_pairs(keep, args.num_minibatches, args.loss_average):
                if len(pairs) == 0:  # no kept pair here (ties; or fewer kept pairs than minibatches): no step
                    continue
                # micro-batches of whole pairs, each backpropagated with its share (its pairs' summed loss / `total`)
                loss, out, lengths = 0.0, {}, pair_lengths(batch.lengths, chosen_rows[pairs], rejected_rows[pairs])
                for mb in common.micro_batch_plan(lengths, args.micro_batch_tokens, rows_per_item=2):
                    mb_loss, size, mb_out = dpo_micro_batch(policy, batch, mb, chosen_rows[pairs], rejected_rows[pairs],
                                                            args, logprob_diff=fresh)
                    share = mb.weight * size / total  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, mb, mb_out, len(pairs))
                loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
                optimizer.zero_grad()
                if fresh:  # no step on this round yet: |learner - sampler| on the sampling weights
                    diff_sum, diff_tokens = diff_sum + out["diff_sum"], diff_tokens + out["diff_tokens"]
                if not stepped:  # a NaN/inf never reaches the weights, Adam, the sampler nor a checkpoint
                    totals["nonfinite_skipped"] += 1
                    continue
                step, fresh = step + 1, False
                losses.append(loss.item())
                grad_norms.append(grad_norm.item())
                accuracies.append((out["margins"] > 0).float().mean().item())
                margins.append(out["margins"].mean().item())
            train_seconds = time.perf_counter() - train_start

            # ---- push: applied once the round in flight (async) is done with the old weights, so none mixes two ----
            pushed = sampler.push(policy, step, when_idle=True)
            learner_wait += pushed.pop("time/idle_wait_seconds")  # (async: the wait for the round in flight)
            if not args.staleness and more:  # sync: the sampler's idle time until these weights could sample the next
                sampler_wait = time.time() - finished_at  # round (sent at the loop's top, after the lines below)
            totals["episodes"] += len(samples)
            totals["skipped_prompts"] += skipped
            totals["generate_seconds"] += generate_seconds
            totals["learner_wait_seconds"] += learner_wait
            totals["train_seconds"] += train_seconds
            totals["wall_seconds"] = time.perf_counter() - clock
            chosen_r, rejected_r = rewards[pair_rows, chosen[keep]], rewards[pair_rows, rejected[keep]]  # none: NaN
            logprob_diff = diff_sum / diff_tokens if diff_tokens else math.nan
            metrics = {
                "charts/reward": scores.mean().item(), "charts/reward_penalized": rewards.mean().item(),
                "charts/eos_penalized_fraction": (scores != rewards).float().mean().item(), "charts/accuracy": correct,
                "charts/rewards_chosen": chosen_r.mean().item(), "charts/rewards_rejected": rejected_r.mean().item(),
                "charts/rewards_margin": (chosen_r - rejected_r).mean().item(),
                "charts/response_length": batch.mask.sum(1).mean().item(),
                "charts/truncated_fraction": float(np.mean([s.finish_reason == "length" for s in samples])),
                "charts/pairs": len(pair_rows), "charts/ties_dropped": int((~keep).sum()), **lags,
                "charts/kl": common.sampled_kl(batch.sampler_logp, ref_logp, batch.mask).mean().item(),  # k3 to pi_0
                "charts/learning_rate": learning_rate, "losses/loss": float(np.mean(losses or [math.nan])),
                "losses/dpo_accuracy": float(np.mean(accuracies or [math.nan])),
                "losses/logits_margin": float(np.mean(margins or [math.nan])),
                "losses/grad_norm": float(np.mean(grad_norms or [math.nan])),
                "losses/grad_clipped_fraction": np.mean([g > args.max_grad_norm for g in grad_norms] or [math.nan]),
                "time/generate_seconds": generate_seconds, "time/train_seconds": train_seconds,
                "time/learner_wait_seconds": learner_wait, "time/sampler_wait_seconds": sampler_wait,
                "time/step_seconds": time.perf_counter() - wait_start, **pushed, **common.throughput(totals, step),
                **({"charts/logprob_diff": logprob_diff} if math.isfinite(logprob_diff) else {}),
            }
            run.log(step, metrics, round=round_index + 1, show=("charts/pairs", "losses/dpo_accuracy"))

            # ---- after the round: the curve's weights, pass@k, the checkpoint ----
            rounds_done, last = round_index + 1, round_index + 1 == args.num_rounds
            if args.snapshot_every and rounds_done % args.snapshot_every == 0:
                run.snapshot(step)
            if args.eval_every and rounds_done % args.eval_every == 0 and not last:
                run.log(step, evaluate())
            if last or (args.save_every and rounds_done % args.save_every == 0):
                # the data position of the first round not trained on: a round in flight is generated again on resume
                run.save(step, rounds_done, pending[0][3] if pending else train_problems.position, totals, tokenizer,
                         eval_start)
        eval_end = run.log(step, evaluate())  # pass@k at the end
    run.report("Online DPO: the paper's synchronous vs asynchronous comparison for this run; held-out pass@k",
               {"mode": "sync" if args.sync else "async", "N": str(args.num_minibatches),
                "episodes/s": totals["episodes"] / max(totals["wall_seconds"], 1e-9)},
               totals, step, eval_start, eval_end)


if __name__ == "__main__":
    main()
