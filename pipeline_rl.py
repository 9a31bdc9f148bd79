"""PipelineRL with in-flight weight updates (papers/pipelinerl-inflight-weight-updates.txt,
Algorithm 2), and Conventional RL (Algorithm 1) in the same script for the paper's comparison.

PipelineRL: the actor (the vLLM sampler) keeps H sequences in flight and never stops; finished
groups go to the trainer's queue as they finish and new prompts take their place. After every
optimizer step the learner pushes its weights in flight: the sampler applies them between two
decode steps and running sequences continue (on their stale KV cache, or re-prefilled with the
new weights with --recompute-kv), so one sequence can hold tokens of several policy versions.
The loss is truncated importance-weighted REINFORCE with a per-prompt mean baseline; when the
batch's ESS falls below --ess-threshold the step is skipped and the trainer waits for data
from the current weights (Algorithm 2, lines 20-23).

Conventional RL (--mode conventional --g G): generate B*G sequences with one policy, then take G
optimizer steps of B sequences, then push the weights; the same loss.

    python pipeline_rl.py --model tiny
    python pipeline_rl.py --model tiny --mode conventional --g 4
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import common


@dataclass
class Args:
    exp_name: str = "pipeline_rl"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU) or an HF model directory / Hub id"""
    task: str = "countdown"
    """countdown (offline generator), countdown-hub or gsm8k"""
    placement: str = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""

    # the method
    mode: str = "pipeline"
    """pipeline (Algorithm 2) or conventional (Algorithm 1)"""
    g: int = 4
    """G: optimizer steps per RL step (conventional mode only)"""
    train_batch_size: int = 64
    """B: sequences per optimizer step (a multiple of --group-size)"""
    gen_batch_size: int = 256
    """H: sequences the actor keeps in flight (pipeline mode)"""
    group_size: int = 4
    """samples per prompt; the per-prompt mean reward is the baseline"""
    num_steps: int | None = None
    """optimizer steps [tiny 120; otherwise 1000]"""
    learning_rate: float | None = None
    """Adam learning rate [tiny 1e-4; otherwise 1e-6]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    micro_batch_size: int = 16
    """sequences per forward/backward, grouped by length (memory and padding only: one optimizer step per B)"""
    is_clip: float = 5.0
    """c: token importance weights pi/mu are truncated at c"""
    ess_threshold: float = 0.5
    """skip a step whose batch ESS is below this and wait for data from the current weights (0: never)"""
    recompute_kv: bool = False
    """after a push, re-prefill running sequences with the new weights (default: keep the stale KV cache, as the paper)"""
    background_push: bool = True
    """pipeline mode: send each push from a thread (a snapshot of the weights) and train on meanwhile"""
    max_lag: int = 0
    """backpressure: stop admitting prompts while the oldest unused data is this many steps old (0: off)"""
    kl_coef: float = 0.0
    """optional KL(pi || pi_ref) penalty (k3 estimator per token)"""
    temperature: float = 1.0
    """sampling temperature"""
    max_new_tokens: int | None = None
    """response length cap [tiny 32; otherwise 1024]"""
    long_tail: float = 0.0
    """benchmark workload: if > 0, each prompt's responses are forced to a length drawn from a
    Pareto distribution with this shape (smaller = heavier tail), scale --long-tail-scale, capped at --max-new-tokens"""
    long_tail_scale: int = 8
    """minimum forced length of the long-tailed workload"""

    # evaluation, logging, checkpoints
    eval_problems: int = 200
    """held-out problems for the start/end evaluation"""
    eval_samples: int = 4
    """samples per held-out problem (accuracy = pass@1 over them)"""
    save_every: int = 0
    """checkpoint every N steps (0: only at the end)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from"""


def per_prompt_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A = r - mean of the prompt's group. rewards: [prompts, group]."""
    return rewards - rewards.mean(1, keepdim=True)


def token_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Untruncated token importance weights pi/mu (zero off the response)."""
    return torch.exp(logp - behaviour_logp) * mask


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalised ESS (sum w)^2 / (N sum w^2) over the batch's response tokens; 1 on-policy."""
    w = weights[mask.bool()]
    return (w.sum() ** 2 / (len(w) * (w ** 2).sum())).item()


def truncated_is_loss(logp, behaviour_logp, ref_logp, mask, advantages, is_clip: float, kl_coef: float):
    """-mean over tokens of min(c, pi/mu) * A * log pi (+ kl_coef * k3 KL to the reference)."""
    w = token_weights(logp.detach(), behaviour_logp, mask).clamp(max=is_clip)
    pg = -(w * advantages[:, None] * logp * mask).sum() / mask.sum()
    log_ratio = (ref_logp - logp) * mask
    kl = ((torch.exp(log_ratio) - log_ratio - 1) * mask).sum() / mask.sum()
    return pg + kl_coef * kl, pg, kl


def token_lags(sample: common.Completion, learner_version: int) -> list[int]:
    """Lag of every response token: the learner's version minus the version that produced it."""
    return [learner_version - v for v, start, end in sample.versions for _ in range(end - start)]


def main():
    args = tyro.cli(Args)
    tiny = args.model == common.TINY
    args.num_steps = args.num_steps or (120 if tiny else 1000)
    args.learning_rate = args.learning_rate or (1e-4 if tiny else 1e-6)
    args.max_new_tokens = args.max_new_tokens or (32 if tiny else 1024)
    common.check_args(args.mode in ("pipeline", "conventional"), "--mode", "must be pipeline or conventional")
    common.check_args(args.group_size >= 2, "--group-size", "the per-prompt baseline needs at least 2 samples per prompt")
    common.check_args(args.train_batch_size % args.group_size == 0, "--train-batch-size",
                      f"must be a multiple of --group-size ({args.train_batch_size} % {args.group_size} != 0)")
    common.check_args(args.gen_batch_size >= args.group_size, "--gen-batch-size", "must hold at least one prompt's group")
    common.check_args(args.g >= 1 and args.num_steps >= 1, "--g/--num-steps", "must be >= 1")
    common.check_args(args.is_clip > 0 and 0 <= args.ess_threshold <= 1, "--is-clip/--ess-threshold", "need c > 0 and 0 <= threshold <= 1")
    args.max_prompt_tokens = 64 if tiny else 512
    run_name = common.run_name(args.exp_name, args.seed, args.resume)

    common.set_seed(args.seed)
    common.limit_cpu_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_path = common.resolve_model(args.model)
    common.check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    tokenizer = common.load_tokenizer(model_path)
    policy = common.load_policy(model_path, device)
    ref_policy = common.load_policy(model_path, device).eval().requires_grad_(False) if args.kl_coef else None
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    task = common.make_task(args.task, args.seed, tiny_prompts=tiny)
    logger = common.RunLogger(run_name, args, track=args.track)
    print(f"run directory: {logger.dir}")
    rng = np.random.default_rng(args.seed)

    step, data_position, totals = 0, 0, dict(samples=0, tokens=0, wait=0.0, wall=0.0, skipped=0, skipped_prompts=0)
    if args.resume:
        state = common.load_checkpoint(args.resume, policy, optimizer)
        step, data_position, totals = state["step"], state["data_position"], state["totals"]
        print(f"resumed from {args.resume}: step {step}")

    sampler = common.start_sampler(model_path, placement=args.placement, seed=args.seed,
                                   max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                                   max_num_seqs=args.gen_batch_size if args.mode == "pipeline" else 256)
    try:
        # pipeline mode pushes from a thread: the trainer goes on with the next batch while the sampler loads
        sampler.init_weight_sync(policy, background=args.mode == "pipeline" and args.background_push)
        if step:
            sampler.push_weights(step)
        problems: dict[int, common.Problem] = {}
        groups: dict[int, list[common.Completion]] = {}
        ready: deque[tuple[common.Problem, list[common.Completion]]] = deque()  # the trainer queue

        def submit_prompts(count: int) -> None:
            """Queue `count` prompts, group_size samples each, with the sampler's current weights."""
            nonlocal data_position
            while count > 0:
                key = data_position
                data_position += 1
                _, prompts, skipped = common.encode_prompts(tokenizer, [task.problem("train", key)], args.max_prompt_tokens)
                if skipped:  # longer than the context: counted in the log, not sent
                    totals["skipped_prompts"] += 1
                    continue
                count -= 1
                problems[key] = task.problem("train", key)
                groups[key] = []
                sampling = dict(temperature=args.temperature, max_tokens=args.max_new_tokens)
                if args.long_tail:
                    length = int(min(args.max_new_tokens, args.long_tail_scale * (1 + rng.pareto(args.long_tail))))
                    # ignore_eos, not min_tokens: min_tokens masks EOS out of the sampled
                    # distribution, so the sampler's logprobs would no longer be the policy's
                    sampling |= dict(ignore_eos=True, max_tokens=length)
                sampler.submit(prompts, n=args.group_size, tags=[key], **sampling)

        def top_up() -> None:
            """Actor: keep H sequences in flight plus one training batch queued in the engine, so it
            never runs dry, counting finished sequences the trainer has not taken yet (a bounded
            trainer queue: a faster actor waits instead of piling up stale data); nothing new while
            the oldest unused data is --max-lag steps old."""
            backpressure = args.max_lag and oldest_ready_lag() >= args.max_lag
            outstanding = len(sampler.pending) + len(ready) * args.group_size
            target = args.gen_batch_size + args.train_batch_size
            if not backpressure and outstanding < target:
                submit_prompts((target - outstanding) // args.group_size)

        def receive(timeout: float) -> None:
            """File finished samples; a prompt's group goes to the trainer queue once all of it is done."""
            for c in sampler.poll(timeout=timeout):
                key, _ = c.tag
                groups[key].append(c)
                if len(groups[key]) == args.group_size:
                    ready.append((problems.pop(key), groups.pop(key)))

        def oldest_ready_lag() -> int:
            return max((step - min(c.version_min for c in g) for _, g in ready), default=0)

        def take_batch():
            """B sequences (whole groups) from the trainer queue, oldest first."""
            batch = [ready.popleft() for _ in range(args.train_batch_size // args.group_size)]
            return [p for p, _ in batch], [c for _, g in batch for c in g]

        def train_step(batch_problems, samples):
            """One optimizer step on B sequences, unless the batch's ESS is below the threshold."""
            nonlocal step
            train_start = time.time()
            rewards = torch.tensor([task.reward(c.text, batch_problems[i // args.group_size]) for i, c in enumerate(samples)])
            advantages = per_prompt_advantages(rewards.view(-1, args.group_size)).view(-1).to(device)
            # micro-batches of similar length: with long-tailed responses one padded batch would cost
            # B x the longest response; gradients of the micro-batches add up to the batch's
            order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_token_ids) + len(samples[i].token_ids))
            total_tokens = sum(len(c.token_ids) for c in samples)
            losses, weights = [], []
            for start in range(0, len(order), args.micro_batch_size):
                rows = order[start: start + args.micro_batch_size]
                micro = [samples[i] for i in rows]
                ids, attn, cmask = common.pad_prompt_completions([c.prompt_token_ids for c in micro], [c.token_ids for c in micro],
                                                                 tokenizer.pad_token_id)
                ids, attn, cmask = ids.to(device), attn.to(device), cmask.to(device)
                mask = cmask[:, 1:].float()
                behaviour = common.sampler_logprob_tensor(micro, [len(c.prompt_token_ids) for c in micro], mask.shape[1]).to(device)
                logp = common.token_logprobs(policy, ids, attn, cmask, args.temperature)
                weights.append(token_weights(logp.detach(), behaviour, mask)[mask.bool()])
                with torch.no_grad():
                    ref_logp = common.token_logprobs(ref_policy, ids, attn, cmask, args.temperature) if ref_policy else logp.detach()
                loss, pg, kl = truncated_is_loss(logp, behaviour, ref_logp, mask, advantages[rows], args.is_clip, args.kl_coef)
                share = mask.sum().item() / total_tokens
                losses.append((loss * share, pg.item() * share, kl.item() * share))
            weights = torch.cat(weights)
            ess = effective_sample_size(weights, torch.ones_like(weights))
            lags = [lag for c in samples for lag in token_lags(c, step)]
            stats = dict(ess=ess, reward=rewards.mean().item(), lag_min=min(lags), lag_mean=float(np.mean(lags)), lag_max=max(lags),
                         tokens=total_tokens)
            if ess < args.ess_threshold:
                return stats | dict(skipped=True)
            loss, pg, kl = sum(l for l, _, _ in losses), sum(p for _, p, _ in losses), sum(k for _, _, k in losses)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            step += 1
            accuracy = float(np.mean([task.is_correct(c.text, batch_problems[i // args.group_size]) for i, c in enumerate(samples)]))
            return stats | dict(skipped=False, loss=loss.item(), pg=pg, kl=kl, grad_norm=grad_norm.item(), accuracy=accuracy,
                                train_seconds=time.time() - train_start)

        def log_step(stats, push_seconds, wait_seconds):
            totals["samples"] += args.train_batch_size
            totals["tokens"] += stats["tokens"]
            totals["wall"] = time.time() - loop_start
            metrics = {
                "charts/reward": stats["reward"], "charts/accuracy": stats["accuracy"], "charts/ess": stats["ess"],
                "charts/lag_min": stats["lag_min"], "charts/lag_mean": stats["lag_mean"], "charts/lag_max": stats["lag_max"],
                "charts/in_flight": len(sampler.pending), "charts/skipped_steps": totals["skipped"],
                "charts/skipped_long_prompts": totals["skipped_prompts"],
                "charts/samples_per_second": totals["samples"] / totals["wall"], "charts/tokens_per_second": totals["tokens"] / totals["wall"],
                "losses/loss": stats["loss"], "losses/pg": stats["pg"], "losses/kl": stats["kl"], "losses/grad_norm": stats["grad_norm"],
                "time/push_seconds": push_seconds, "time/learner_wait_seconds": wait_seconds, "time/train_seconds": stats["train_seconds"],
            }
            logger.log(step, metrics, echo=False)
            if step % 10 == 0 or step == args.num_steps:
                print(f"step {step}/{args.num_steps}: reward {stats['reward']:.3f} acc {stats['accuracy']:.3f} ess {stats['ess']:.3f} "
                      f"lag {stats['lag_min']}/{stats['lag_mean']:.1f}/{stats['lag_max']} in-flight {len(sampler.pending)} "
                      f"samples/s {metrics['charts/samples_per_second']:.1f} skipped {totals['skipped']}")
            if step == args.num_steps or (args.save_every and step % args.save_every == 0):
                common.save_checkpoint(logger.dir / "checkpoint.pt", policy, optimizer, step, data_position, totals=totals)

        eval_start = common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                     temperature=args.temperature, max_tokens=args.max_new_tokens)
        logger.log(step, eval_start)
        loop_start = time.time() - totals["wall"]
        while step < args.num_steps:
            if args.mode == "pipeline":
                wait_start = time.time()
                top_up()
                receive(timeout=0.0)
                while len(ready) * args.group_size < args.train_batch_size:
                    receive(timeout=0.1)
                    top_up()
                wait_seconds = time.time() - wait_start
                totals["wait"] += wait_seconds
                # ---- trainer: one step on the B oldest sequences, then an in-flight weight push ----
                stats = train_step(*take_batch())
                if stats["skipped"]:
                    totals["skipped"] += 1
                    # wait for data from the current weights: drop queued groups that started before them
                    while ready and min(c.version_min for c in ready[0][1]) < step:
                        ready.popleft()
                    continue
                push_seconds = sampler.push_weights(step, recompute_kv=args.recompute_kv, background=args.background_push)
                log_step(stats, push_seconds, wait_seconds)
            else:
                # ---- Conventional RL: B*G sequences from one policy, then G steps, then push ----
                wait_start = time.time()
                submit_prompts(args.train_batch_size * args.g // args.group_size)
                while len(ready) * args.group_size < args.train_batch_size * args.g:
                    receive(timeout=0.5)
                wait_seconds = time.time() - wait_start
                totals["wait"] += wait_seconds
                for _ in range(min(args.g, args.num_steps - step)):
                    stats = train_step(*take_batch())
                    if stats["skipped"]:
                        totals["skipped"] += 1
                        continue
                    log_step(stats, 0.0, wait_seconds)
                ready.clear()
                push_seconds = sampler.push_weights(step)
        sampler.wait_for_push()
        sampler.abort(list(sampler.pending))
        eval_end = common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens,
                                   temperature=args.temperature, max_tokens=args.max_new_tokens)
        logger.log(step, eval_end)
        memory = dict(learner=common.peak_rss_mib(), sampler=sampler.peak_rss_mib())
    finally:
        sampler.close()

    label = "PipelineRL" if args.mode == "pipeline" else f"Conventional RL (G={args.g})"
    rows = [r for r in common.read_metrics(logger.dir) if "charts/ess" in r]
    print(f"\n{label}: {args.num_steps} steps of {args.train_batch_size} sequences")
    print("| method | wall (s) | samples/s | tokens/s | mean ESS | mean token lag | learner wait (s) | skipped | accuracy start -> end |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {label} | {totals['wall']:.1f} | {totals['samples'] / totals['wall']:.1f} | {totals['tokens'] / totals['wall']:.0f} | "
          f"{np.mean([r['charts/ess'] for r in rows]):.3f} | {np.mean([r['charts/lag_mean'] for r in rows]):.2f} | {totals['wait']:.1f} | "
          f"{totals['skipped']} | {eval_start['eval/pass@1']:.3f} -> {eval_end['eval/pass@1']:.3f} |")
    print(f"\npeak memory: learner {memory['learner']:.0f} MiB, sampler {memory['sampler']:.0f} MiB")
    logger.close()


if __name__ == "__main__":
    main()
