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

import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import common
from fastrl import distributed
import tasks
from fastrl import vllm_sampler


@dataclass
class Args:
    exp_name: str = "rloo_kreuse"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU) or an HF model directory / Hub id, e.g. Qwen/Qwen2.5-0.5B"""
    task: str | None = None
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), countdown-hub (TinyZero's
    data), gsm8k, tldr (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object
    a line) or hf:DATASET[:CONFIG] (README "Your own data and reward") [paper countdown-hub, the report's Sec. 4.1; tiny countdown]"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem) -> float, instead of the task's own
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
    """sample from these running vLLM servers instead of a sampler process of our own (README "Scaling out")"""

    # the method
    k: int = 1
    """K: gradient steps per sampling round (1 = on-policy RLOO; the paper sweeps 1/2/4/8)"""
    group_size: int | None = None
    """group size G: responses per prompt for the leave-one-out baseline [paper 2; tiny 8]"""
    num_prompts: int | None = None
    """prompts per sampling round [paper 4; tiny 32]"""
    num_rounds: int | None = None
    """sampling rounds (the paper's 'training steps') [paper 250; tiny 80]"""
    learning_rate: float | None = None
    """Adam learning rate, constant [paper 1e-6; tiny 1e-4]"""
    beta_kl: float = 0.01
    """KL penalty coefficient (the paper's beta_KL, Eq. 4); 0 loads no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """how the KL penalty enters (see kl_penalty): k1 folded into the reward (the gradient of the report's sequence-level
    KL(pi || pi_ref), Eq. 4), or as a loss term k2 (the per-token KLs' gradient only) or k3 (GRPO's; neither)"""
    beta_ent: float | None = None
    """entropy bonus coefficient [paper 0.05; tiny 0.01]"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    temperature: float = 0.8
    """sampling temperature"""
    top_p: float = 0.95
    """nucleus sampling (the paper's 0.95); the learner applies the same nucleus (the logprob contract)"""
    max_new_tokens: int | None = None
    """response length cap [paper setup 512; tiny 32]"""
    max_prompt_tokens: int | None = None
    """prompt budget: longer prompts are skipped and counted [tiny 64; otherwise 256]"""
    iw_level: Literal["sequence", "token"] = "sequence"
    """importance weights per `sequence` (the paper) or per `token`"""
    iw_clip: float | None = None
    """rho-bar: clip importance weights at this value (off by default; the paper's next step)"""
    ppo_clip: float | None = None
    """epsilon: use the PPO-style clipped ratio instead (Proximal RLOO, async-RLHF paper App. B)"""
    recompute_old_logprobs: bool = False
    """recompute log pi_theta0 with the learner on the sampling weights even when --tis is off (it is
    recomputed whenever --tis is on; costs one extra forward per round)"""
    tis: Literal["auto", "on", "off"] = "auto"
    """training-inference mismatch correction (truncated importance sampling): auto = on whenever the sampler's
    numbers differ from the learner's (a sampler not in fp32, the GPU default; --autocast-bf16), as TRL
    (vllm_importance_sampling_correction) and verl do. On: log pi_theta0 is the learner's own recomputation, the
    sampler's logprobs enter only the weight min(pi_learner / pi_sampler, --tis-cap) at --iw-level, kept apart from
    K-reuse's own weights. Not with --overlap (the learner no longer holds the sampling weights)"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold 2.0; TRL 1.16 uses 3.0)"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template (instruct models)"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own ("" for none)"""
    overlap: bool = False
    """generate round r+1 while the learner does the K steps of round r (one round off-policy)"""

    # evaluation, logging, checkpoints
    eval_samples: int = 16
    """samples per held-out problem for pass@k (the paper's Table 4 uses 16)"""
    eval_problems: int | None = None
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
    autocast_bf16: bool | None = None
    """run the learner's forwards under bf16 autocast; weights, gradients and Adam stay in --dtype. The logprobs are then
    bf16-accurate (see charts/logprob_diff, --tis) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    gradient_checkpointing: bool | None = None
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, ~1/3 more
    compute) [default: on for a real model on a GPU, off for tiny or on CPU]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights (policy, reference) whatever the checkpoint's: in bf16 an Adam step of lr 1e-6 rounds away
    on most weights"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization) [default: 0.3 on the learner's GPU, 0.85 on its own]"""


PAPER = dict(task="countdown-hub", group_size=2, num_prompts=4, num_rounds=250, learning_rate=1e-6, beta_ent=0.05, max_new_tokens=512, eval_problems=50,
             max_prompt_tokens=256)
TINY = dict(task="countdown", group_size=8, num_prompts=32, num_rounds=80, learning_rate=1e-4, beta_ent=0.01, max_new_tokens=32, eval_problems=200,
            max_prompt_tokens=64)
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a sequence weight beyond it is as good as infinite, and inf * 0 is NaN


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
      is not used as a loss; main() subtracts beta_kl * k1 from the reward instead (RLHF's KL-shaped
      reward), which gives exactly the gradient of the sequence-level KL(pi || pi_ref) of Eq. 4;
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


def rloo_loss(logp, old_logp, ref_logp, entropy, mask, advantages, args, tis=None):
    """The paper's Eq. 4 for one minibatch: -E[w A log pi] - beta_ent H + beta_kl KL(pi||pi_ref).
    logp, old_logp, ref_logp, entropy, mask: [N, T]; advantages: [N]; tis: the truncated
    mismatch weights (--tis-cap) at the level of the method's weights ([N] per sequence, [N, T] per
    token) or None. Returns (loss, stats)."""
    tis = 1.0 if tis is None else tis  # (a [N] tensor of ones broke --iw-level token: [N, T] x [N])
    seq_logp = (logp * mask).sum(1)
    if args.ppo_clip is not None:  # Proximal RLOO: ratio carries the gradient, PPO-clipped
        ratio = importance_weights(logp, old_logp, mask, "sequence")
        clipped = ratio.clamp(1 - args.ppo_clip, 1 + args.ppo_clip)
        pg = -torch.min(ratio * advantages, clipped * advantages) * tis
        w = ratio.detach()
    else:
        w = importance_weights(logp, old_logp, mask, args.iw_level).detach()
        if args.iw_clip is not None:
            w = w.clamp(max=args.iw_clip)
        if args.iw_level == "sequence":
            pg = -w * tis * advantages * seq_logp
        else:
            pg = -(w * tis * logp * mask).sum(1) * advantages
    no_kl_loss = args.kl_estimator == "k1" or ref_logp is None  # (None: --beta-kl 0, no reference model)
    kl = torch.zeros_like(advantages) if no_kl_loss else kl_penalty(logp, ref_logp, mask, args.kl_estimator)
    tokens = mask.sum(1).clamp(min=1)
    mean_entropy = (entropy * mask).sum(1) / tokens
    loss = (pg + args.beta_kl * kl - args.beta_ent * mean_entropy).mean()
    w_seq = w if w.dim() == 1 else (w.sum(1) / tokens)
    return loss, dict(pg=pg.mean(), kl=kl.mean(), entropy=mean_entropy.mean(), w=w_seq)


def truncated_mismatch_weights(learner_logp, sampler_logp, mask, level: str, cap: float):
    """Training-inference mismatch correction (truncated importance sampling, as TRL, verl,
    open-instruct and PipelineRL do it): min(pi_learner / pi_sampler, cap) per sequence or per
    token, for samples the sampler drew while the learner held the same weights. Kept apart from
    K-reuse's own importance weights. Returns (weights, stats)."""
    ratio = importance_weights(learner_logp, sampler_logp, mask, level)
    truncated = ratio > cap
    if level == "token":
        considered = mask.bool()
        stats = dict(max_ratio=ratio[considered].max().item(), truncated_fraction=truncated[considered].float().mean().item())
    else:
        stats = dict(max_ratio=ratio.max().item(), truncated_fraction=truncated.float().mean().item())
    return ratio.clamp(max=cap), stats



def micro_logprobs(model, ids, attn, cmask, lengths: list[int], rows: list[int], args, **kw) -> torch.Tensor:
    """common.token_logprobs of the micro-batch `rows` of the right-padded batch, cut to its longest row
    ([rows, width - 1]), under the sampler's processing (the logprob contract) and --autocast-bf16."""
    width = lengths[rows[-1]]
    with common.autocast(ids.device, args.autocast_bf16):  # weights and Adam stay fp32
        return common.token_logprobs(model, ids[rows, :width], attn[rows, :width], cmask[rows, :width], temperature=args.temperature,
                                     top_p=args.top_p, **kw)


@torch.no_grad()
def batch_logprobs(model, ids, attn, cmask, lengths: list[int], micro: list[tuple[list[int], float]], args) -> torch.Tensor:
    """Token logprobs of the rows of `micro` (this process's (rows, weight) micro-batches; weight 0:
    a stand-in that only keeps the processes in step), laid out like the batch ([N, T - 1], other
    rows 0)."""
    out = torch.zeros(cmask[:, 1:].shape, device=ids.device)
    for rows, weight in micro:
        logp = micro_logprobs(model, ids, attn, cmask, lengths, rows, args)
        if weight:
            out[rows, :logp.shape[1]] = logp
    return out


def rloo_backward(policy, ids, attn, cmask, lengths: list[int], micro: list[tuple[list[int], float]], old_logp, ref_logp, advantages,
                  tis, args, sampler_logp=None):
    """One of the K steps' loss (Eq. 4 over the whole batch) and its gradient, accumulated over the
    micro-batches: each micro-batch's mean loss is weighted by its share of the rows, so the gradient
    is exactly the batch mean's (summed over processes under torchrun). Returns (loss, stats,
    importance weights [N] at their rows (0 for rows of other processes), and with sampler_logp the
    sum of |learner - sampler| token logprobs over the completion tokens), for this process's rows."""
    mask = cmask[:, 1:].float()
    loss, stats, weights, diff_sum = 0.0, {}, torch.zeros(len(lengths), device=ids.device), 0.0
    for rows, part in micro:
        logp, entropy = micro_logprobs(policy, ids, attn, cmask, lengths, rows, args, with_entropy=True)
        cut = lambda x: x[rows, :logp.shape[1]]  # noqa: E731  (the micro-batch's rows and width)
        if sampler_logp is not None:
            diff_sum += part * ((logp.detach() - cut(sampler_logp)).abs() * cut(mask)).sum().item()
        mb_loss, mb_stats = rloo_loss(logp, cut(old_logp), None if ref_logp is None else cut(ref_logp), entropy, cut(mask), advantages[rows], args,
                                      None if tis is None else (tis[rows] if tis.dim() == 1 else cut(tis)))
        share = part * len(rows) / len(lengths)
        (mb_loss * share).backward()  # micro-batch means add up to the batch mean
        loss = loss + mb_loss.detach() * share
        stats = {k: stats.get(k, 0.0) + v.detach() * share for k, v in mb_stats.items() if k != "w"}
        if part:
            weights[rows] = mb_stats["w"]
    return loss, stats, weights, diff_sum


def ess(weights: torch.Tensor) -> float:
    """Normalised effective sample size (sum w)^2 / (N sum w^2), in (0, 1]."""
    return (weights.sum() ** 2 / (len(weights) * (weights ** 2).sum())).item()


def main():
    args = common.parse_args(Args)  # on --resume: the saved run's flags
    vllm_sampler.quiet_libraries(args.verbose)
    defaults = TINY if args.model == common.TINY else PAPER
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    common.memory_defaults(args)
    common.check_args(args.k >= 1, "--k", f"must be >= 1, got {args.k}")
    common.check_args(args.group_size >= 2, "--group-size", f"RLOO needs at least 2 responses per prompt, got {args.group_size}")
    common.check_args(args.num_prompts >= 1 and args.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1")
    common.check_args(args.learning_rate > 0, "--learning-rate", "must be > 0")
    common.check_args(0 < args.top_p <= 1 and args.temperature > 0, "--top-p/--temperature", "need 0 < top_p <= 1, temperature > 0")
    common.check_args(args.iw_clip is None or args.iw_clip > 0, "--iw-clip", "must be > 0")
    common.check_args(args.ppo_clip is None or 0 < args.ppo_clip < 1, "--ppo-clip", "must be in (0, 1)")
    common.check_args(not (args.recompute_old_logprobs and args.overlap), "--recompute-old-logprobs",
                      "cannot be combined with --overlap: the learner no longer holds the sampling weights")
    common.check_args(args.tis_cap >= 1, "--tis-cap", f"must be >= 1, got {args.tis_cap}")
    common.check_args(not (args.tis == "on" and args.overlap), "--tis",
                      "on cannot be combined with --overlap: the learner no longer holds the sampling weights")
    common.check_args(args.max_new_tokens >= 1, "--max-new-tokens", "must be >= 1")
    common.check_sampler_urls(args.sampler_url)
    common.check_run_flags(args)
    common.check_args(args.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {args.keep_checkpoints}")
    common.check_args(args.max_prompt_tokens >= 1, "--max-prompt-tokens", "must be >= 1")
    common.check_args(args.micro_batch_tokens >= 1, "--micro-batch-tokens", "must be >= 1")
    common.check_args(args.sampler_gpu_memory is None or 0 < args.sampler_gpu_memory < 1, "--sampler-gpu-memory", "must be in (0, 1)")
    common.check_args(args.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {args.snapshot_every}")
    common.check_args(args.eval_samples >= 1 and args.eval_problems >= 1, "--eval-samples/--eval-problems", "must be >= 1")
    # pi_theta0 at the learner's precision whenever the sampler's differs; the sampler's logprobs then enter only the correction
    learner_bf16 = args.autocast_bf16 or args.dtype == "bfloat16"
    tis_on = not args.overlap and common.mismatch_correction(args.tis, args.sampler_dtype, args.placement, learner_bf16)
    if args.overlap and args.tis == "auto" and common.mismatch_correction("auto", args.sampler_dtype, args.placement, learner_bf16):
        print("note: --overlap with a sampler whose precision differs from the learner's: log pi_theta0 is the sampler's "
              "(the learner no longer holds the sampling weights), so K-reuse's weights include the mismatch")
    args.recompute_old_logprobs = args.recompute_old_logprobs or tis_on
    args.tis_level = "sequence" if args.ppo_clip is not None else args.iw_level
    args.batch_size = args.num_prompts * args.group_size  # episodes per round
    run_name = common.run_name(args.exp_name, args.seed, args.resume)

    dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, logger, checkpoints)
    common.set_seed(args.seed)
    common.limit_cpu_threads()
    device = dist.device
    model_path = common.resolve_model(args.model, args.task)
    common.check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    args.sampler_gpu_memory = common.memory_plan(args, model_path, "rloo")  # GPU only: the plan line, or a refusal naming flags
    tokenizer = common.load_tokenizer(model_path)
    common.check_chat_template(tokenizer, args.chat_template)
    task = tasks.make_task(args.task, args.seed, tiny_prompts=args.model == common.TINY, reward=args.reward,
                           prompt_field=args.prompt_field, answer_field=args.answer_field,
                           system_prompt=args.system_prompt)
    common.check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    policy = common.load_policy(model_path, device, dtype=getattr(torch, args.dtype))
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        policy.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: the numbers do not change)
    # the reference model only when a term uses it
    ref_policy = common.load_policy(model_path, device, dtype=getattr(torch, args.dtype)).eval().requires_grad_(False) if args.beta_kl else None
    # what the sampler's weight sync reads: the policy itself, or under torchrun rank 0's full copy
    push_model = distributed.push_copy(policy, dist)
    policy = distributed.shard(policy, dist)
    ref_policy = distributed.shard(ref_policy, dist) if ref_policy is not None else None
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    logger = common.RunLogger(run_name, args, track=args.track) if dist.is_main else distributed.NullLogger()
    print(f"run directory: {logger.dir}")

    start_round, data_position, step, nonfinite_skipped = 0, 0, 0, 0
    sampler_rng = None  # the sampler's generators between two rounds: a resumed synchronous run samples as an uninterrupted one
    warned: list[float] = []  # the logprob_diff warning, once
    timing = dict(sample=0.0, update=0.0, wall=0.0)
    if args.resume:  # (every rank; the file is the same whether one process or several wrote it)
        state = common.load_checkpoint(args.resume, policy, optimizer, dist=dist, required=("round", "timing"))
        start_round, data_position, step, timing = state["round"], state["data_position"], state["step"], state["timing"]
        sampler_rng = state.get("sampler_rng")
        distributed.gather_into(policy, push_model, dist)  # the sampler starts from the resumed weights
        print(f"resumed from {args.resume}: round {start_round}, step {step}")

    sampler = common.start_sampler(model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                                         gpu_memory_utilization=args.sampler_gpu_memory,
                                         max_model_len=args.max_prompt_tokens + args.max_new_tokens, urls=args.sampler_url,
                                         weights=push_model, version=step, verbose=args.verbose) if dist.is_main else None
    try:
        sampling = dict(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens)

        def next_prompts():
            nonlocal data_position
            problems, prompts, skipped = common.encode_prompts(
                tokenizer, [task.problem("train", data_position + i) for i in range(args.num_prompts)], args.max_prompt_tokens,
                args.chat_template)
            data_position += args.num_prompts
            return problems, prompts, skipped

        def submit_round():
            problems, prompts, skipped = next_prompts()
            ids = sampler.submit(prompts, n=args.group_size, **sampling)
            return problems, ids, skipped, time.perf_counter()

        def collect_round(pending):
            problems, ids, skipped, submitted = pending
            return problems, sampler.wait_for(ids), skipped, time.perf_counter() - submitted

        def evaluate():  # pass@k on the held-out split, sampling as in training (Table 4 protocol)
            return common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                   args.chat_template, **sampling)

        eval_start = evaluate() if dist.is_main else {}
        logger.log(step, eval_start)
        if dist.is_main and args.snapshot_every and start_round == 0:
            logger.snapshot(step, push_model)  # time 0 of the learning curve
        if sampler_rng is not None and dist.is_main and hasattr(sampler, "set_rng_state"):
            sampler.set_rng_state(sampler_rng)  # after the start's evaluation, which drew from them
        pending = submit_round() if dist.is_main else None
        loop_start, resumed_wall = time.perf_counter() - timing["wall"], timing["wall"]
        progress = common.Progress(args.num_rounds, "train", unit="round", initial=start_round, show=dist.is_main)
        for round_index in range(start_round, args.num_rounds):
            # ---- sampling round: G responses for each prompt, with the sampler's logprobs ----
            wait_start = time.perf_counter()
            # under torchrun rank 0 samples and every rank gets the round
            problems, samples, skipped, generated_in = distributed.broadcast(collect_round(pending) if dist.is_main else None, dist)
            common.check_sampler_version(samples, step, max_lag=args.k if args.overlap else 0)  # on-policy, or one round behind
            if dist.is_main and not args.overlap and hasattr(sampler, "rng_state"):
                sampler_rng = sampler.rng_state()  # nothing generating now: what the next round will draw from
            sample_seconds = time.perf_counter() - wait_start if args.overlap else generated_in
            timing["sample"] += sample_seconds
            if dist.is_main and args.overlap and round_index + 1 < args.num_rounds:
                pending = submit_round()  # generated with the current weights while we update

            update_start = time.perf_counter()
            common.learner_threads(sampler)  # every core in a synchronous round; one while the next round generates
            texts = [s.text for s in samples]
            rewards = torch.tensor([task.reward(t, problems[i // args.group_size]) for i, t in enumerate(texts)])
            correct = np.mean([task.is_correct(t, problems[i // args.group_size]) for i, t in enumerate(texts)])
            input_ids, attention_mask, completion_mask = common.pad_prompt_completions(
                [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], tokenizer.pad_token_id)
            input_ids, attention_mask, completion_mask = input_ids.to(device), attention_mask.to(device), completion_mask.to(device)
            mask = completion_mask[:, 1:].float()
            sampler_logp = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1]).to(device)
            lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
            # each cut to its longest row (rows are right-padded); under torchrun each rank takes its share
            micro = distributed.my_micro_batches(common.micro_batches(lengths, args.micro_batch_tokens), dist)
            # the logprob contract: every learner logprob is of the sampler's distribution (temperature, top-p)
            ref_logp = (distributed.all_sum(batch_logprobs(ref_policy, input_ids, attention_mask, completion_mask, lengths, micro, args), dist)
                        if ref_policy is not None else None)
            # log pi_theta0: the learner's own recomputation (--tis on, --recompute-old-logprobs), or the sampler's logprobs
            old_logp = (distributed.all_sum(batch_logprobs(policy, input_ids, attention_mask, completion_mask, lengths, micro, args), dist)
                        if args.recompute_old_logprobs else sampler_logp)
            tis, mismatch = None, {}
            if tis_on:
                tis, tis_stats = truncated_mismatch_weights(old_logp, sampler_logp, mask, args.tis_level, args.tis_cap)
                mismatch = {"charts/tis_max_ratio": tis_stats["max_ratio"], "charts/tis_truncated_fraction": tis_stats["truncated_fraction"]}
            # k3 of the sampled responses: the KL(pi || pi_ref) we report, whatever the penalty's estimator
            kl_value = kl_penalty(old_logp, ref_logp, mask, "k3").mean().item() if ref_logp is not None else float("nan")
            if args.kl_estimator == "k1" and ref_logp is not None:  # KL-shaped reward: r - beta_kl * sum_t log(pi / pi_ref), before the baseline
                rewards_for_baseline = rewards.to(device) - args.beta_kl * kl_penalty(old_logp, ref_logp, mask, "k1")
            else:
                rewards_for_baseline = rewards.to(device)
            advantages = rloo_advantages(rewards_for_baseline.view(-1, args.group_size)).view(-1)
            fresh = not args.overlap  # at k-step 1 the learner holds the sampling weights
            diff_sum = 0.0

            # ---- K gradient steps on this one batch ----
            iw_means, ess_values, round_start_step = [], [], step
            for k_step in range(args.k):
                optimizer.zero_grad()
                # at k-step 1 with fresh weights, |learner - sampler| logprobs: the first thing to look at when training
                # goes wrong (~1e-6 in fp32)
                loss, stats, weights, diff = rloo_backward(policy, input_ids, attention_mask, completion_mask, lengths, micro, old_logp,
                                                           ref_logp, advantages, tis, args, sampler_logp if k_step == 0 and fresh else None)
                loss, weights, diff = (distributed.all_sum(x, dist) for x in (loss, weights, diff))  # every rank's rows
                stats = {k: distributed.all_sum(v, dist) for k, v in stats.items()}
                diff_sum += diff
                grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))
                if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                    # a NaN/inf never reaches the weights (nor the sampler, nor a checkpoint): skip, count, go on
                    optimizer.zero_grad()
                    nonfinite_skipped += 1
                    continue
                optimizer.step()
                step += 1
                iw_means.append(weights.mean().item())
                ess_values.append(ess(weights))
            logprob_diff = diff_sum / mask.sum().item() if fresh else float("nan")
            update_seconds = time.perf_counter() - update_start
            timing["update"] += update_seconds

            # ---- push the new weights; the next round samples with them ----
            distributed.gather_into(policy, push_model, dist)  # under torchrun: every rank takes part
            push_seconds = sampler.push_weights(step) if dist.is_main else 0.0
            if dist.is_main and not args.overlap and round_index + 1 < args.num_rounds:
                pending = submit_round()
            if dist.is_main and args.snapshot_every and (round_index + 1) % args.snapshot_every == 0:
                logger.snapshot(step, push_model)
            timing["wall"] = time.perf_counter() - loop_start

            # per token: the learner version at the round's first k-step minus the version that sampled the token
            lags = [round_start_step - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]
            metrics = {
                "charts/reward": rewards.mean().item(), "charts/accuracy": correct,
                "charts/response_length": mask.sum(1).mean().item(), "charts/episodes": (round_index + 1) * args.batch_size,
                "charts/skipped_long_prompts": skipped, "charts/ess_min": min(ess_values, default=float("nan")),
                "charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags), "charts/kl": kl_value, "charts/nonfinite_skipped": nonfinite_skipped,
                "losses/loss": loss.item(), "losses/pg": stats["pg"].item(), "losses/kl_penalty": stats["kl"].item(),
                "losses/entropy": stats["entropy"].item(), "losses/grad_norm": grad_norm.item(),
                "time/generate_seconds": sample_seconds, "time/train_seconds": update_seconds, "time/push_seconds": push_seconds,
                "charts/episodes_per_second": (round_index + 1 - start_round) * args.batch_size / max(timing["wall"] - resumed_wall, 1e-9),
                "time/sample_fraction": timing["sample"] / max(timing["wall"], 1e-9),
                "time/grad_steps_per_second": step / max(timing["wall"], 1e-9),
            }
            if math.isfinite(logprob_diff):
                metrics["charts/logprob_diff"] = logprob_diff
                common.warn_logprob_diff(logprob_diff, tis_on, warned)
            metrics |= mismatch
            metrics |= {f"charts/iw_mean_k{j + 1}": w for j, w in enumerate(iw_means)}
            metrics |= {f"charts/ess_k{j + 1}": e for j, e in enumerate(ess_values)}
            logger.log(step, metrics, echo=False)
            progress.update(1, step=step, reward=metrics["charts/reward"], acc=float(correct), kl=kl_value)
            progress.write(f"round {round_index + 1}/{args.num_rounds} step {step}: reward {metrics['charts/reward']:.3f} "
                           f"acc {correct:.3f} kl {kl_value:.3f} ent {metrics['losses/entropy']:.3f} "
                           f"iw {' '.join(f'{w:.2f}' for w in iw_means)} ess {metrics['charts/ess_min']:.2f} "
                           f"sample {sample_seconds:.2f}s update {update_seconds:.2f}s")

            last = round_index + 1 == args.num_rounds
            if dist.is_main and args.eval_every and (round_index + 1) % args.eval_every == 0 and not last:
                logger.log(step, evaluate())
            if last or (args.save_every and (round_index + 1) % args.save_every == 0):  # (every rank; rank 0 writes)
                common.save_checkpoint(logger.dir / "checkpoint.pt" if dist.is_main else None, policy, optimizer, step,
                                            data_position, dist=dist, hf_model=push_model, tokenizer=tokenizer, round=round_index + 1,
                                            timing=timing, sampler_rng=sampler_rng, keep=args.keep_checkpoints)

        progress.close()
        eval_end = evaluate() if dist.is_main else {}
        logger.log(step, eval_end)
        memory = common.peak_memory_mib(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        distributed.close(dist)

    wall, sample, update = timing["wall"], timing["sample"], timing["update"]
    logger.report(step, f"RLOO K={args.k}: {args.num_rounds} rounds of {args.num_prompts}x{args.group_size}, overlap={args.overlap} "
                  f"(the paper's Table 2; held-out: Table 4, {args.eval_samples} samples per problem)",
                  {"K": str(args.k), "wall (s)": wall, "sample (s)": sample, "update (s)": update,
                   "sample %": f"{100 * sample / wall:.0f}%", "grad steps/s": step / wall}, eval_start, eval_end, memory)
    logger.close()


if __name__ == "__main__":
    main()
