"""Asynchronous off-policy online DPO (Algorithm 1). Paper: Noukhovitch et al., "Asynchronous RLHF:
Faster and More Efficient Off-Policy RL for Language Models", arXiv:2410.18252.

Each round, the sampler draws a group of completions per prompt (`--group-size`); the best and
worst by reward form a preference pair (ties are dropped and counted) and the learner takes N DPO
steps against the frozen initial policy. Asynchronous (default, Cleanba-style, `--staleness 1`):
while the learner trains on the round generated with theta_{t-1}, the sampler already generates
the next round with theta_t, so the learner is exactly one round ahead of its data. `--sync`
(= `--staleness 0`, the same loop with the next round submitted only after the push) is the
on-policy baseline: generate, then train, alternating.

    python online_dpo_async.py --model tiny           # async, the built-in model, CPU
    python online_dpo_async.py --model tiny --sync    # the synchronous baseline
    python online_dpo_async.py --task gsm8k --model realtreetune/rho-1b-sft-GSM8K   # §A.3: Table 10's defaults
    torchrun --nproc-per-node 2 online_dpo_async.py   # the learner data-parallel (FSDP2, distributed.py)
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

import common
from fastrl import distributed
import tasks
from fastrl import vllm_sampler


@dataclass
class Args:
    exp_name: str = "online_dpo_async"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment (and of the sampler's engine)"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU) or an HF model directory / Hub id"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), countdown-hub (TinyZero's
    data), gsm8k, tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object
    a line) or hf:DATASET[:CONFIG] (README "Your own data and reward"); scored by the task's reward unless --reward-model or --reward"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem) -> float, instead of the task's own
    reward; what counts as correct (accuracy, pass@k) stays the task's"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    reward_model: str | None = None
    """an HF sequence-classification reward model (num_labels=1) to score completions instead"""
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays in --dtype either way (the difference, the training-inference mismatch, is charts/logprob_diff; DPO's loss uses only
    the learner's own logprobs of policy and reference, so it has nothing to correct)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (README "Scaling out")"""

    # the method
    sync: bool = False
    """synchronous on-policy baseline: generate, then train (shorthand for --staleness 0)"""
    staleness: Literal[0, 1] | None = None
    """rounds the sampler generates ahead of the learner [1: asynchronous, Algorithm 1; --sync: 0]"""
    group_size: int | None = None
    """samples per prompt; chosen = best reward, rejected = worst [paper 2, gsm8k 4; tiny 4]"""
    num_prompts: int | None = None
    """prompts per minibatch [paper 64; gsm8k with a real model 252 (Table 10's batch size: the authors' online DPO counts it
    in prompts, 6 x 14 gradient accumulation x 3 GPUs); tiny 32]"""
    num_minibatches: int = 1
    """N: minibatches generated per round and N optimizer steps on them (the paper's off-policyness knob)"""
    num_rounds: int | None = None
    """sampling rounds [paper ~ 512k episodes / batch; gsm8k with a real model 512 (Table 10: 129024 prompts seen / 252;
    Table 11's 218 min at §A.3's 25.5 s a step); tiny 60]"""
    loss_type: Literal["dpo", "ipo"] = "dpo"
    """dpo (sigmoid) or ipo"""
    loss_average: Literal["kept", "all"] = "kept"
    """kept: a minibatch's loss is the mean over its kept pairs (tied groups dropped), which scales the effective learning
    rate by 1/(kept fraction) against all (half the prompts tied: twice the gradient per pair; under Adam a constant factor
    mostly cancels, what stays is that rounds with many ties weigh more than rounds with few, and --max-grad-norm sees the
    larger norm); all: the kept pairs' summed loss over the minibatch's prompts, a tied prompt contributing 0 (the authors'
    released code: a tied group gives chosen = rejected, zero gradient, averaged with the rest). The paper does not say:
    kept is this script's rule from before #27"""
    beta: float | None = None
    """DPO beta [0.1; gsm8k 0.05]"""
    learning_rate: float | None = None
    """Adam learning rate, constant [paper 3e-6; tiny 1e-4]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    temperature: float | None = None
    """sampling temperature, applied to every logprob too (policy, reference, KL) [paper 0.7; tiny 1.0]"""
    top_p: float = 1.0
    """nucleus sampling (the paper samples the full distribution: 1.0); the learner applies the same nucleus"""
    max_new_tokens: int | None = None
    """response length cap [paper 512; tiny 32]"""
    missing_eos_penalty: float = 1.0
    """penalty for a completion that ends without EOS (cut at --max-new-tokens); see --eos-penalty-mode"""
    eos_penalty_mode: Literal["replace", "subtract", "off"] | None = None
    """replace: such a completion scores -penalty (Table 4 / the paper's code: 'penalty reward value' -1); subtract:
    score - penalty; off: no penalty [gsm8k off (the authors' released GSM8K configs: non_eos_penalty False, so a correct
    answer cut at --max-new-tokens is not made the rejected side); replace]"""
    gsm8k_match: Literal["strict", "loose"] = "strict"
    """--task gsm8k's reward and evaluation: strict: only a '#### n' answer counts (§5.2: 1 if the answer string matches;
    the authors' grader reads '#### n' only); loose: else the completion's last number (this script's rule before #27)"""
    shuffle_train: bool = True
    """a fixed dataset's train split (gsm8k, countdown-hub) read in a new order every epoch, drawn from --seed and the epoch
    (the authors' code: DataLoader(shuffle=True) seeded by the seed); --no-shuffle-train: the split's own order, epoch after
    epoch (before #27). The countdown generators have no epochs: every position is a new problem"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template (instruct models)"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""

    # learner memory: how the numbers are computed, not what they are
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward: pairs (and, for the reference, sequences) sorted by length are packed into
    micro-batches of at most this many padded tokens (rows x longest row; a longer pair goes alone); the gradients
    accumulate to exactly the minibatch's"""
    autocast_bf16: bool | None = None
    """run the learner's forwards (policy and reference) under bf16 autocast; weights, gradients and Adam stay in --dtype.
    The logprobs are then bf16-accurate (see charts/logprob_diff) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    gradient_checkpointing: bool | None = None
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, ~1/3 more
    compute) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights (policy, reference) whatever the checkpoint's: in bf16 an Adam step of lr 3e-6 rounds away
    on most weights"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization) [default: 0.3 on the learner's GPU, 0.85 on its own]"""

    # evaluation, logging, checkpoints
    eval_decoding: Literal["greedy", "sample"] | None = None
    """greedy: one greedy completion per problem (the paper's GSM8K pass@1); sample: as in training [gsm8k greedy; sample]"""
    eval_problems: int | None = None
    """held-out problems; 0 = the whole test split of a fixed dataset (gsm8k, countdown-hub) [gsm8k 0; paper 50; tiny 200]"""
    eval_samples: int | None = None
    """completions per held-out problem, accuracy = pass@1 over them [greedy 1; sample 4]"""
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


PAPER = dict(group_size=2, num_prompts=64, num_rounds=2000, learning_rate=3e-6, temperature=0.7,
             max_new_tokens=512, eval_problems=50)
TINY = dict(group_size=4, num_prompts=32, num_rounds=60, learning_rate=1e-4, temperature=1.0,
            max_new_tokens=32, eval_problems=200)
# Table 10 (Appendix A.3) and §A.3's evaluation: greedy pass@1 on the whole GSM8K test set; the authors' GSM8K configs:
# no missing-EOS penalty
GSM8K = dict(group_size=4, beta=0.05, eval_decoding="greedy", eval_problems=0, eos_penalty_mode="off")
# Table 10's batch and length, for a real model only (the tiny model keeps its own): 252 prompts a step, 129024 prompts
# (516096 episodes, 4 a prompt) = 512 steps; one minibatch a round (num_mini_batches 1), so one round = one step
GSM8K_PAPER = dict(num_prompts=252, num_rounds=512)
FIXED_TEST_SPLIT = ("gsm8k", "countdown-hub")  # tasks whose test split is a fixed list (--eval-problems 0 = all of it)


def parse_args(argv: list[str] | None = None) -> Args:
    """The command line, with every None default filled in (an explicit flag wins, then the task's
    defaults, then the model's: paper or tiny) and every value checked before anything starts."""
    args = common.parse_args(Args, argv)  # on --resume: the saved run's flags
    tiny = args.model == common.TINY
    task_defaults = (GSM8K | ({} if tiny else GSM8K_PAPER)) if args.task == "gsm8k" else {}
    model_defaults = TINY if tiny else PAPER
    for defaults in (task_defaults, model_defaults):
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.beta is None:
        args.beta = 0.1
    if args.eos_penalty_mode is None:
        args.eos_penalty_mode = "replace"
    if args.eval_decoding is None:
        args.eval_decoding = "sample"
    if args.eval_samples is None:
        args.eval_samples = 1 if args.eval_decoding == "greedy" else 4
    common.check_args(not (args.sync and args.staleness == 1), "--sync", "is --staleness 0; drop one of them")
    if args.staleness is None:
        args.staleness = 0 if args.sync else 1
    args.sync = args.staleness == 0

    common.check_args(args.group_size >= 2, "--group-size", f"a pair needs at least 2 samples per prompt, got {args.group_size}")
    common.check_args(args.num_minibatches >= 1, "--num-minibatches", f"must be >= 1, got {args.num_minibatches}")
    common.check_args(args.num_prompts >= 1 and args.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1")
    common.check_args(args.beta > 0 and args.learning_rate > 0, "--beta/--learning-rate", "must be > 0")
    common.check_args(args.temperature > 0, "--temperature",
                      f"must be > 0, got {args.temperature} (0 is greedy: every pair would tie and no logprob is defined)")
    common.check_args(0 < args.top_p <= 1, "--top-p", f"must be in (0, 1], got {args.top_p}")
    common.check_args(args.max_new_tokens >= 1, "--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    common.check_sampler_urls(args.sampler_url)
    common.check_run_flags(args)
    common.check_args(args.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {args.keep_checkpoints}")
    common.memory_defaults(args)
    common.check_args(args.sampler_gpu_memory is None or 0 < args.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)")
    common.check_args(args.missing_eos_penalty >= 0, "--missing-eos-penalty",
                      f"must be >= 0 (replace gives the score -penalty), got {args.missing_eos_penalty}")
    common.check_args(args.eval_samples >= 1, "--eval-samples", f"must be >= 1, got {args.eval_samples}")
    common.check_args(args.eval_decoding == "sample" or args.eval_samples == 1, "--eval-samples",
                      "greedy decoding gives one completion per problem; use 1 or --eval-decoding sample")
    common.check_args(args.eval_problems >= 1 or (args.eval_problems == 0 and args.task in FIXED_TEST_SPLIT), "--eval-problems",
                      f"must be >= 1, or 0 (the whole test split) for {' or '.join(FIXED_TEST_SPLIT)}; got {args.eval_problems}")
    common.check_args(args.save_every >= 0, "--save-every", f"must be >= 0, got {args.save_every}")
    common.check_args(args.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {args.snapshot_every}")
    common.check_args(args.micro_batch_tokens >= 1, "--micro-batch-tokens", f"must be >= 1, got {args.micro_batch_tokens}")
    return args


def select_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each prompt's group of rewards [P, group size]: chosen = index of the best, rejected =
    index of the worst (the first in case of equal values). Returns (chosen, rejected, keep) where
    keep is False for prompts whose rewards all tie (no preference to learn)."""
    chosen, rejected = rewards.argmax(1), rewards.argmin(1)
    keep = rewards.max(1).values > rewards.min(1).values
    return chosen, rejected, keep


def penalize_missing_eos(scores: torch.Tensor, ended_with_eos: torch.Tensor, penalty: float, mode: str) -> torch.Tensor:
    """Scores with the completions that ended without EOS penalised. replace: their score becomes
    -penalty whatever the verifier or reward model said (the paper's code: a truncated completion
    is never preferred to one that finished); subtract: penalty is subtracted from their score
    (TRL's missing_eos_penalty); off: the scores as they are (the authors' GSM8K runs: a correct
    answer cut before EOS still scores 1). scores: [n] float; ended_with_eos: [n] bool."""
    if mode == "off":
        return scores
    if mode == "replace":
        return torch.where(ended_with_eos, scores, torch.full_like(scores, -penalty))
    return scores - penalty * (~ended_with_eos).to(scores.dtype)


def minibatch_pairs(keep: torch.Tensor, num_minibatches: int, average: str) -> list[tuple[np.ndarray, int]]:
    """The round's N minibatches: for each, the kept pairs it trains on (indices into the kept
    pairs, in prompt order) and the count its summed loss is divided by. keep: [prompts] bool
    (select_pairs). kept: the kept pairs split evenly, each minibatch's loss the mean over its pairs,
    so the step scales by 1/(kept fraction); all: the prompts split evenly, a minibatch's kept pairs
    summed and divided by its number of prompts, a tied prompt counting 0 (the authors' code)."""
    keep = keep.cpu().numpy()
    if average == "kept":
        return [(mb, len(mb)) for mb in np.array_split(np.arange(int(keep.sum())), num_minibatches)]
    pair_of_prompt = np.cumsum(keep) - 1  # a kept prompt's index among the kept pairs
    return [(pair_of_prompt[prompts][keep[prompts]], len(prompts)) for prompts in np.array_split(np.arange(len(keep)), num_minibatches)]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def train_index(position: int, split_size: int | None, seed: int, shuffle: bool) -> int:
    """The train problem read at data position `position` (positions run on across epochs): epoch
    position // split_size reads the split in a permutation drawn from (seed, epoch), a pure
    function, so a resumed run reads what the uninterrupted one would have (--shuffle-train).
    split_size None (a generator: no epochs) or shuffle off: the position itself (a list task wraps it)."""
    if split_size is None or not shuffle:
        return position
    epoch, offset = divmod(position, split_size)
    return int(_epoch_order(seed, epoch, split_size)[offset])


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss_type: str = "dpo"):
    """Per-pair loss from sequence log-probs. h = log pi(y+)/pi_ref(y+) - log pi(y-)/pi_ref(y-).
    DPO: -log sigmoid(beta h). IPO: (h - 1/(2 beta))^2. Returns (loss [pairs], beta h [pairs]).
    What a step averages these over is minibatch_pairs' choice (--loss-average): the mean over the
    kept pairs (default) scales the effective learning rate by 1/(kept fraction) against the mean
    over all prompts, since tied groups are dropped, not counted as zeros (under Adam a constant
    factor mostly cancels; a kept fraction that varies from round to round does not)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "dpo":
        return -F.logsigmoid(beta * h), beta * h
    return (h - 1 / (2 * beta)) ** 2, beta * h




@torch.no_grad()
def sequence_logprobs(model, ids, attn, cmask, lengths: list[int], args: Args, d: distributed.Dist | None = None) -> torch.Tensor:
    """log pi(y | x) of every row of the right-padded batch (the sum over its completion tokens), in
    token-budget micro-batches, each cut to its longest row: the reference's forward. lengths: each
    row's prompt + completion length. Under torchrun each rank runs its micro-batches
    (distributed.my_micro_batches) and every rank gets every row. Returns [rows]."""
    out = torch.zeros(len(lengths), device=ids.device)
    for rows, weight in distributed.my_micro_batches(common.micro_batches(lengths, args.micro_batch_tokens), d):
        width = lengths[rows[-1]]
        with common.autocast(ids.device, args.autocast_bf16):
            logp = common.token_logprobs(model, ids[rows, :width], attn[rows, :width], cmask[rows, :width],
                                         temperature=args.temperature, top_p=args.top_p).sum(1)
        if weight:  # (weight 0: a stand-in that only keeps the ranks' collectives in step)
            out[rows] = logp
    return distributed.all_sum(out, d)  # each row was filled by one rank


def dpo_backward(policy, ids, attn, cmask, lengths: list[int], chosen_rows, rejected_rows, ref_seq, args: Args, sampler_logp=None,
                 d: distributed.Dist | None = None, divisor: int | None = None):
    """The DPO loss of one minibatch of pairs (its summed per-pair loss / divisor: the number of pairs
    by default, the mean, or minibatch_pairs' count) and its gradient, accumulated over micro-batches
    of whole pairs within --micro-batch-tokens: each micro-batch's summed per-pair loss is divided by
    the same divisor, so the accumulated gradient is exactly the minibatch loss's. chosen_rows,
    rejected_rows: [pairs] rows of the right-padded batch; ref_seq: [rows] the reference's sequence
    logprobs. Returns (the minibatch loss, beta h [pairs], and, with sampler_logp, the sum of
    |learner - sampler| token logprobs over the pairs' completion tokens and their count). Under
    torchrun each rank runs its micro-batches of the minibatch's plan (distributed.my_micro_batches):
    the gradients are summed over ranks (distributed.shard), so they are the single-process mean's,
    and the returned values are the whole minibatch's on every rank."""
    n, device = len(chosen_rows), ids.device
    divisor = divisor or n
    chosen_rows, rejected_rows = chosen_rows.to(device), rejected_rows.to(device)
    pair_lengths = [max(lengths[c], lengths[r]) for c, r in zip(chosen_rows.tolist(), rejected_rows.tolist())]
    losses, margins = torch.zeros(n, device=device), torch.zeros(n, device=device)
    diff_sum = diff_tokens = 0.0
    plan = common.micro_batches(pair_lengths, args.micro_batch_tokens, rows_per_item=2)
    for pairs, weight in distributed.my_micro_batches(plan, d):  # weight 0: a stand-in that must change nothing
        k, width = len(pairs), pair_lengths[pairs[-1]]
        rows = torch.cat([chosen_rows[pairs], rejected_rows[pairs]])  # the chosen k, then their rejected k
        with common.autocast(device, args.autocast_bf16):
            token_logp = common.token_logprobs(policy, ids[rows, :width], attn[rows, :width], cmask[rows, :width],
                                               temperature=args.temperature, top_p=args.top_p)
        logp, ref = token_logp.sum(1), ref_seq[rows]
        loss, margin = dpo_loss(logp[:k], logp[k:], ref[:k], ref[k:], args.beta, args.loss_type)
        (loss.sum() / divisor * weight).backward()
        if not weight:
            continue
        losses[pairs], margins[pairs] = loss.detach(), margin.detach()
        if sampler_logp is not None:
            mask = cmask[rows, 1:width].float()
            diff_sum += ((token_logp.detach() - sampler_logp[rows, :width - 1]).abs() * mask).sum().item()
            diff_tokens += mask.sum().item()
    losses, margins, diff = distributed.all_sum((losses, margins, (diff_sum, diff_tokens)), d)  # every rank's pairs
    return losses.sum() / divisor, margins, diff


def main():
    args = parse_args()
    vllm_sampler.quiet_libraries(args.verbose)
    args.prompts_per_round = args.num_prompts * args.num_minibatches
    args.max_prompt_tokens = 64 if args.model == common.TINY else 512
    run_name = common.run_name(args.exp_name, args.seed, args.resume)

    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, scores, logger, checkpoints)
    common.set_seed(args.seed)
    common.limit_cpu_threads()
    device = dist.device
    model_path = common.resolve_model(args.model, args.task)
    common.check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    args.sampler_gpu_memory = common.memory_plan(args, model_path, "dpo")  # GPU only: the plan line, or a refusal naming flags
    tokenizer = common.load_tokenizer(model_path)
    common.check_chat_template(tokenizer, args.chat_template)
    policy = common.load_policy(model_path, device, dtype=getattr(torch, args.dtype))
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: the numbers do not change)
    ref_policy = common.load_policy(model_path, device, dtype=getattr(torch, args.dtype)).eval().requires_grad_(False)
    # what the sampler's weight sync reads (and snapshots, the HF directory): the policy itself, or under torchrun rank 0's full copy
    push_model = distributed.push_copy(policy, dist)
    policy, ref_policy = distributed.shard(policy, dist), distributed.shard(ref_policy, dist)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    task = tasks.make_task(args.task, args.seed, tiny_prompts=args.model == common.TINY, gsm8k_match=args.gsm8k_match,
                           reward=args.reward, prompt_field=args.prompt_field, answer_field=args.answer_field,
                           system_prompt=args.system_prompt)
    train_size = len(task.train) if isinstance(task, tasks.ListTask) else None  # a fixed train split has epochs (--shuffle-train)
    common.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    # rank 0 scores and hands every rank the rewards (the pairs must be the same on every rank): only it needs the reward model
    reward_model = common.RewardModel(args.reward_model, device=str(device)) if args.reward_model and dist.is_main else None
    logger = common.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
    print(f"run directory: {logger.dir}")

    start_round, data_position, step = 0, 0, 0
    warned: list[float] = []  # the logprob_diff warning, once
    mismatch_expected = common.mismatch_correction("auto", args.sampler_dtype, args.placement, args.autocast_bf16 or args.dtype == "bfloat16")
    totals = dict(generate=0.0, train=0.0, wall=0.0, episodes=0, nonfinite_skipped=0)
    # --sync: the sampler's generators before the round a resume starts with, so that it samples as an uninterrupted run
    sampler_rng = None
    if args.resume:  # (every rank; the file is the same whether one process or several wrote it)
        state = common.load_checkpoint(args.resume, policy, optimizer, dist=dist, required=("round", "totals"))
        start_round, data_position, step = state["round"], state["data_position"], state["step"]
        totals |= state["totals"]
        sampler_rng = state.get("sampler_rng")
        distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
        print(f"resumed from {args.resume}: round {start_round}, step {step}")

    sampler = common.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                         gpu_memory_utilization=args.sampler_gpu_memory,
                                         max_model_len=args.max_prompt_tokens + args.max_new_tokens, urls=args.sampler_url,
                                         weights=push_model, version=step, verbose=args.verbose) if dist.is_main else None
    try:
        # No per-request seed: vLLM's CPU runner fails on a seeded request whose prompt's prefill it splits
        # ("CPU Generator does not use offset"). The sampler's engine seed (--seed) already makes the tokens
        # reproducible for the same schedule of requests (the sync / --staleness 0 parity test).
        sampling = dict(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens)
        # the logprob contract: every learner logprob (policy, reference) is of the distribution the sampler sampled,
        # args.temperature and args.top_p (sequence_logprobs, dpo_backward)
        eval_sampling = dict(temperature=0.0, max_tokens=args.max_new_tokens) if args.eval_decoding == "greedy" else sampling
        pending: deque[dict] = deque()  # rounds submitted to the sampler and not yet trained on, oldest first
        next_round = start_round

        def submit_round():
            """Queue the next round's prompts; the sampler generates them with its current weights."""
            nonlocal data_position, next_round, sampler_rng
            position = data_position
            if args.sync and hasattr(sampler, "rng_state"):
                sampler_rng = sampler.rng_state()  # nothing generating: what this round draws from
            indices = [train_index(position + i, train_size, args.seed, args.shuffle_train) for i in range(args.prompts_per_round)]
            problems, prompts, skipped = common.encode_prompts(
                tokenizer, [task.problem("train", i) for i in indices], args.max_prompt_tokens, args.chat_template)
            data_position += args.prompts_per_round
            next_round += 1
            ids = sampler.submit(prompts, n=args.group_size, **sampling)
            pending.append(dict(problems=problems, ids=ids, skipped=skipped, position=position, submitted=time.time()))

        def collect():
            """The oldest submitted round, once generated."""
            batch = pending.popleft()
            samples = sampler.wait_for(batch["ids"])
            return batch | dict(samples=samples, finished=max(s.finished_at for s in samples))

        def score(problems, samples):
            texts = [s.text for s in samples]
            if reward_model is not None:
                scores = reward_model.score(reward_model.conversations([problems[i // args.group_size] for i in range(len(samples))], texts))
            else:
                scores = [task.reward(t, problems[i // args.group_size]) for i, t in enumerate(texts)]
            ended_with_eos = torch.tensor([s.finish_reason == "stop" for s in samples])
            return penalize_missing_eos(torch.tensor(scores, dtype=torch.float32), ended_with_eos, args.missing_eos_penalty,
                                        args.eos_penalty_mode)

        def evaluate():
            result = common.evaluate(sampler, task, tokenizer, args.eval_problems or None, args.eval_samples, args.max_prompt_tokens,
                                     args.chat_template, **eval_sampling)
            return {"eval/pass@1": result["eval/pass@1"], "eval/problems": result["eval/problems"]}

        eval_start = evaluate() if dist.is_main else {}
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and start_round == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        if dist.is_main and sampler_rng is not None and hasattr(sampler, "set_rng_state"):
            sampler.set_rng_state(sampler_rng)  # after the start's evaluation, which drew from them
        if dist.is_main:
            submit_round()
        # Algorithm 1: a first batch y_0 ~ pi_theta_0(x_0); under torchrun rank 0 samples and every rank gets the round
        batch = distributed.broadcast(collect() if dist.is_main else None, dist)
        if dist.is_main and args.staleness and next_round < args.num_rounds:
            submit_round()  # async: GENERATE with theta_t while we TRAIN on theta_{t-1}'s samples
        loop_start = time.time() - totals["wall"]
        progress = common.Progress(args.num_rounds, "train", unit="round", initial=start_round, show=dist.is_main)
        for round_index in range(start_round, args.num_rounds):
            last = round_index + 1 == args.num_rounds
            round_start = time.time()
            if round_index == start_round:  # what the sampler really sees (e.g. the chat template) and answers
                first = batch["samples"][0]
                print(f"example: {tokenizer.decode(first.prompt_token_ids)!r} -> {first.text!r}")

            # ---- pairs: best and worst of each prompt's group ----
            train_start = time.time()
            common.learner_threads(sampler)  # every core with --sync; one while the next batch generates
            samples, problems = batch["samples"], batch["problems"]
            rewards = distributed.broadcast(score(problems, samples) if dist.is_main else None, dist).view(-1, args.group_size)
            chosen, rejected, keep = select_pairs(rewards)
            pair_rows = torch.arange(len(rewards))[keep]
            if args.sync:
                common.check_sampler_version(samples, step)  # on-policy: generated by the weights the learner holds
            lags = [step - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]  # per token
            # does the learner still hold the weights that generated this batch (sync: every round; async: only the
            # first one, or after a round without a step)? Then its logprobs must equal the sampler's: charts/logprob_diff
            fresh = all(s.version_min == s.version_max == step for s in samples)
            # row i of the padded batch is sample i; KL(pi_sampler || pi_init) is estimated on all of them
            ids, attn, cmask = common.pad_prompt_completions([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                                                             tokenizer.pad_token_id)
            ids, attn, cmask = ids.to(device), attn.to(device), cmask.to(device)
            mask = cmask[:, 1:].float()
            prompt_lens = [len(s.prompt_token_ids) for s in samples]
            lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
            sampler_logp = common.sampler_logprob_tensor(samples, prompt_lens, mask.shape[1]).to(device)
            ref_seq = sequence_logprobs(ref_policy, ids, attn, cmask, lengths, args, dist)  # (every row, on every rank)
            kl = ((sampler_logp * mask).sum(1) - ref_seq).mean().item()  # k1: both logprobs of the sampled distribution
            chosen_rows = pair_rows * args.group_size + chosen[keep]
            rejected_rows = pair_rows * args.group_size + rejected[keep]

            # ---- N DPO steps, one per minibatch of pairs ----
            losses, accuracies, margins, grad_norms, diff_sum, diff_tokens = [], [], [], [], 0.0, 0.0
            num_pairs = len(pair_rows)
            for mb, divisor in minibatch_pairs(keep, args.num_minibatches, args.loss_average):
                if len(mb) == 0:  # every prompt tied: nothing to learn from this minibatch
                    continue
                optimizer.zero_grad()
                # micro-batches of whole pairs within --micro-batch-tokens; the gradient accumulates to the minibatch mean's
                # (under torchrun each rank takes its share and the results are the minibatch's on every rank)
                loss, logits, (mb_diff, mb_tokens) = dpo_backward(policy, ids, attn, cmask, lengths, chosen_rows[mb], rejected_rows[mb],
                                                                  ref_seq, args, sampler_logp if fresh else None, dist, divisor)
                # fresh: no step on this batch yet, the sampling weights (~1e-6 in fp32); free, on the pairs' tokens
                diff_sum, diff_tokens = diff_sum + mb_diff, diff_tokens + mb_tokens
                grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
                if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                    # a NaN/inf never reaches the weights (nor the sampler, nor a checkpoint): skip, count, go on
                    optimizer.zero_grad()
                    totals["nonfinite_skipped"] += 1
                    continue
                optimizer.step()
                step += 1
                fresh = False
                losses.append(loss.item())
                grad_norms.append(grad_norm.item())
                accuracies.append((logits > 0).float().mean().item())
                margins.append(logits.mean().item())
            train_seconds = time.time() - train_start
            distributed.gather_into(policy, push_model, dist)  # under torchrun: every rank takes part, rank 0 holds the full weights
            if dist.is_main and args.snapshot_every and (round_index + 1) % args.snapshot_every == 0:
                logger.snapshot(step, push_model)

            # ---- the new weights go to the sampler; then the next round's data ----
            wait_start = time.time()
            push_seconds = generate_seconds = sampler_idle = float("nan")
            if not last:
                newest = None
                if dist.is_main:
                    # applied once the round in flight (async) has finished with the old weights: no batch mixes versions
                    push_seconds = sampler.push_weights(step, when_idle=True)
                    if next_round < args.num_rounds:
                        submit_round()  # generated by the weights just pushed: the next round (sync) or the one after it (async)
                        newest = pending[-1]
                following = distributed.broadcast(collect() if dist.is_main else None, dist)
                generate_seconds = following["finished"] - following["submitted"]
                if newest is not None:  # the sampler sat idle from the end of the round before `newest` (sync: the train step)
                    sampler_idle = newest["submitted"] - (batch if args.staleness == 0 else following)["finished"]
            learner_wait = time.time() - wait_start
            totals["wall"] = time.time() - loop_start
            totals["episodes"] += len(samples)
            totals["train"] += train_seconds
            totals["generate"] += 0.0 if last else generate_seconds

            chosen_r = rewards[pair_rows, chosen[keep]] if num_pairs else torch.zeros(1)
            rejected_r = rewards[pair_rows, rejected[keep]] if num_pairs else torch.zeros(1)
            mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731
            metrics = {
                "charts/reward": rewards.mean().item(),
                "charts/accuracy": float(np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)])),
                "charts/rewards_chosen": chosen_r.mean().item(), "charts/rewards_rejected": rejected_r.mean().item(),
                "charts/rewards_margin": (chosen_r - rejected_r).mean().item(),
                "charts/response_length": mask.sum(1).mean().item(),
                "charts/pairs": num_pairs, "charts/ties_dropped": int((~keep).sum()), "charts/skipped_long_prompts": batch["skipped"],
                "charts/kl": kl, "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags),
                "charts/nonfinite_skipped": totals["nonfinite_skipped"],
                "charts/episodes": totals["episodes"], "charts/episodes_per_second": totals["episodes"] / max(totals["wall"], 1e-9),
                "losses/loss": mean(losses), "losses/dpo_accuracy": mean(accuracies), "losses/logits_margin": mean(margins),
                "losses/grad_norm": mean(grad_norms),
                "time/train_seconds": train_seconds, "time/generate_seconds": generate_seconds,
                "time/step_seconds": time.time() - round_start, "time/learner_wait_seconds": learner_wait,
                "time/sampler_wait_seconds": sampler_idle, "time/push_seconds": push_seconds,
            }
            if diff_tokens:
                metrics["charts/logprob_diff"] = diff_sum / diff_tokens
                common.warn_logprob_diff(metrics["charts/logprob_diff"], mismatch_expected, warned)
            logger.log(step, metrics, echo=False)
            progress.update(1, step=step, reward=metrics["charts/reward"], acc=metrics["charts/accuracy"], dpo_acc=metrics["losses/dpo_accuracy"])
            progress.write(f"round {round_index + 1}/{args.num_rounds} step {step}: reward {metrics['charts/reward']:.3f} "
                           f"acc {metrics['charts/accuracy']:.3f} pairs {num_pairs} ties {metrics['charts/ties_dropped']} "
                           f"dpo_acc {metrics['losses/dpo_accuracy']:.2f} kl {kl:.2f} lag {min(lags)}-{max(lags)} "
                           f"gen {generate_seconds:.2f}s train {train_seconds:.2f}s step {metrics['time/step_seconds']:.2f}s")
            if not last:
                batch = following
            if last or (args.save_every and (round_index + 1) % args.save_every == 0):
                # the data position of the first round not trained on yet: a round in flight is generated again on resume
                # (every rank; rank 0 writes the single-process file)
                common.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, policy, optimizer, step,
                                            data_position if last else batch["position"], dist=dist, hf_model=push_model,
                                            tokenizer=tokenizer, round=round_index + 1, totals=totals,
                                            keep=args.keep_checkpoints, sampler_rng=(sampler.rng_state() if last and args.sync and dist.is_main
                                                                                     and hasattr(sampler, "rng_state") else sampler_rng))
        if dist.is_main and step:
            sampler.push_weights(step)  # (push_model was gathered after the last round's steps)
        progress.close()
        eval_end = evaluate() if dist.is_main else {}
        logger.log(step, eval_end)
        memory = common.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)

    mode = "sync" if args.sync else "async"
    logger.report(step, f"online DPO ({mode}, N={args.num_minibatches}): {args.num_rounds} rounds of {args.prompts_per_round} prompts "
                  f"x {args.group_size} samples",
                  {"mode": mode, "wall (s)": totals["wall"], "generate (s)": totals["generate"], "train (s)": totals["train"],
                   "episodes/s": totals["episodes"] / totals["wall"]}, eval_start, eval_end, memory)
    logger.close()


if __name__ == "__main__":
    main()
