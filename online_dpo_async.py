"""Asynchronous off-policy online DPO (papers/asynchronous-rlhf-online-dpo.txt, Algorithm 1).

Each round, the sampler draws K completions per prompt; the best and worst by reward form a
preference pair (ties are dropped and counted) and the learner takes N DPO steps against the
frozen initial policy. Asynchronous (default, Cleanba-style): while the learner trains on the
round generated with theta_{t-1}, the sampler already generates the next round with theta_t,
so the learner is exactly one step ahead of its data. `--sync` is the on-policy baseline:
generate, then train, alternating.

    python online_dpo_async.py --model tiny           # async, the built-in model, CPU
    python online_dpo_async.py --model tiny --sync    # the synchronous baseline
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import tyro

import common


@dataclass
class Args:
    exp_name: str = "online_dpo_async"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU) or an HF model directory / Hub id"""
    task: str = "countdown"
    """countdown (offline generator), countdown-hub or gsm8k; scored by the verifier unless --reward-model"""
    reward_model: str | None = None
    """an HF sequence-classification reward model (num_labels=1) to score completions instead"""
    placement: str = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""

    # the method
    sync: bool = False
    """synchronous on-policy baseline: generate, then train (default: asynchronous, one step off-policy)"""
    num_completions: int | None = None
    """completions per prompt; chosen = best reward, rejected = worst [paper 2, 4 for GSM8K; tiny 4]"""
    num_prompts: int | None = None
    """prompts per minibatch [paper 64; tiny 32]"""
    num_minibatches: int = 1
    """N: minibatches generated per round and N optimizer steps on them (the paper's off-policyness knob)"""
    num_rounds: int | None = None
    """sampling rounds [paper ~ 512k episodes / batch; tiny 60]"""
    loss_type: str = "dpo"
    """dpo (sigmoid) or ipo"""
    beta: float | None = None
    """DPO beta [0.1; 0.05 for gsm8k]"""
    learning_rate: float | None = None
    """Adam learning rate, constant [paper 3e-6; tiny 1e-4]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    temperature: float | None = None
    """sampling temperature [paper 0.7; tiny 1.0]"""
    max_new_tokens: int | None = None
    """response length cap [paper 512; tiny 32]"""
    missing_eos_penalty: float = 1.0
    """subtracted from the reward of completions that end without EOS"""

    # evaluation, logging, checkpoints
    eval_problems: int | None = None
    """held-out problems [paper 50; tiny 200]"""
    eval_samples: int = 4
    """samples per held-out problem (accuracy = pass@1 over them)"""
    save_every: int = 0
    """checkpoint every N rounds (0: only at the end)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from"""


PAPER = dict(num_completions=2, num_prompts=64, num_rounds=2000, learning_rate=3e-6, temperature=0.7,
             max_new_tokens=512, eval_problems=50)
TINY = dict(num_completions=4, num_prompts=32, num_rounds=60, learning_rate=1e-4, temperature=1.0,
            max_new_tokens=32, eval_problems=200)


def select_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each prompt's K rewards [P, K]: chosen = index of the best, rejected = index of the
    worst (the first in case of equal values). Returns (chosen, rejected, keep) where keep is
    False for prompts whose rewards all tie (no preference to learn)."""
    chosen, rejected = rewards.argmax(1), rewards.argmin(1)
    keep = rewards.max(1).values > rewards.min(1).values
    return chosen, rejected, keep


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss_type: str = "dpo"):
    """Per-pair loss from sequence log-probs. h = log pi(y+)/pi_ref(y+) - log pi(y-)/pi_ref(y-).
    DPO: -log sigmoid(beta h). IPO: (h - 1/(2 beta))^2. Returns (loss [pairs], beta h [pairs])."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "dpo":
        return -F.logsigmoid(beta * h), beta * h
    return (h - 1 / (2 * beta)) ** 2, beta * h


def main():
    args = tyro.cli(Args)
    defaults = TINY if args.model == common.TINY else PAPER
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.beta is None:
        args.beta = 0.05 if args.task == "gsm8k" else 0.1
    common.check_args(args.num_completions >= 2, "--num-completions", f"a pair needs at least 2 completions, got {args.num_completions}")
    common.check_args(args.num_minibatches >= 1, "--num-minibatches", f"must be >= 1, got {args.num_minibatches}")
    common.check_args(args.num_prompts >= 1 and args.num_rounds >= 1, "--num-prompts/--num-rounds", "must be >= 1")
    common.check_args(args.loss_type in ("dpo", "ipo"), "--loss-type", "must be dpo or ipo")
    common.check_args(args.beta > 0 and args.learning_rate > 0, "--beta/--learning-rate", "must be > 0")
    args.prompts_per_round = args.num_prompts * args.num_minibatches
    args.max_prompt_tokens = 64 if args.model == common.TINY else 512
    run_name = common.run_name(args.exp_name, args.seed, args.resume)

    common.set_seed(args.seed)
    common.limit_cpu_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_path = common.resolve_model(args.model)
    common.check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    tokenizer = common.load_tokenizer(model_path)
    policy = common.load_policy(model_path, device)
    ref_policy = common.load_policy(model_path, device).eval().requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel for all tensors
    task = common.make_task(args.task, args.seed, tiny_prompts=args.model == common.TINY)
    reward_model = common.RewardModel(args.reward_model, device=str(device)) if args.reward_model else None
    logger = common.RunLogger(run_name, args, track=args.track)
    print(f"run directory: {logger.dir}")

    start_round, data_position, step, totals = 0, 0, 0, dict(generate=0.0, train=0.0, wall=0.0, episodes=0)
    if args.resume:
        state = common.load_checkpoint(args.resume, policy, optimizer)
        start_round, data_position, step, totals = state["round"], state["data_position"], state["step"], state["totals"]
        print(f"resumed from {args.resume}: round {start_round}, step {step}")

    sampler = common.start_sampler(model_path, placement=args.placement, seed=args.seed,
                                   max_model_len=args.max_prompt_tokens + args.max_new_tokens)
    try:
        sampler.init_weight_sync(policy)
        if step:
            sampler.push_weights(step)
        sampling = dict(temperature=args.temperature, max_tokens=args.max_new_tokens)

        def submit_round():
            """Queue one round of prompts with the sampler's current weights."""
            nonlocal data_position
            problems, prompts, skipped = common.encode_prompts(
                tokenizer, [task.problem("train", data_position + i) for i in range(args.prompts_per_round)], args.max_prompt_tokens)
            data_position += args.prompts_per_round
            ids = sampler.submit(prompts, n=args.num_completions, **sampling)
            return dict(problems=problems, ids=ids, skipped=skipped, submitted=time.time())

        def score(problems, samples):
            texts = [s.text for s in samples]
            if reward_model is not None:
                prompts = [problems[i // args.num_completions].prompt for i in range(len(samples))]
                scores = reward_model.score([p + t for p, t in zip(prompts, texts)])
            else:
                scores = [task.reward(t, problems[i // args.num_completions]) for i, t in enumerate(texts)]
            penalty = [args.missing_eos_penalty * (s.finish_reason != "stop") for s in samples]
            return torch.tensor(scores) - torch.tensor(penalty, dtype=torch.float32)

        def evaluate():
            result = common.evaluate(sampler, task, tokenizer, args.eval_problems, args.eval_samples, args.max_prompt_tokens, **sampling)
            return {"eval/accuracy": result["eval/pass@1"]}

        eval_start = evaluate()
        logger.log(step, eval_start)
        pending = submit_round()
        wait_start = time.time()
        batch = pending | dict(samples=sampler.wait_for(pending["ids"]))
        learner_wait = time.time() - wait_start
        if not args.sync and start_round + 1 < args.num_rounds:
            pending = submit_round()  # GENERATE with theta_t while we TRAIN on theta_{t-1}'s samples
        loop_start = time.time() - totals["wall"]
        for round_index in range(start_round, args.num_rounds):
            last = round_index + 1 == args.num_rounds
            round_start = time.time()

            # ---- pairs: best and worst of the K completions of each prompt ----
            train_start = time.time()
            samples, problems = batch["samples"], batch["problems"]
            rewards = score(problems, samples).view(-1, args.num_completions)
            chosen, rejected, keep = select_pairs(rewards)
            rows = torch.arange(len(rewards))
            pair_rows = rows[keep]
            lags = [step - s.version_min for s in samples]
            # row i of the padded batch is sample i; KL(pi_sampler || pi_init) is estimated on all of them
            ids, attn, cmask = common.pad_prompt_completions([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                                                             tokenizer.pad_token_id)
            ids, attn, cmask = ids.to(device), attn.to(device), cmask.to(device)
            with torch.no_grad():
                ref_seq = common.token_logprobs(ref_policy, ids, attn, cmask, args.temperature).sum(1)
            kl = (torch.tensor([sum(s.logprobs) for s in samples], device=device) - ref_seq).mean().item()
            chosen_rows = pair_rows * args.num_completions + chosen[keep]
            rejected_rows = pair_rows * args.num_completions + rejected[keep]

            # ---- N DPO steps, one per minibatch of pairs ----
            losses, accuracies, margins = [], [], []
            num_pairs = len(pair_rows)
            for mb in np.array_split(np.arange(num_pairs), args.num_minibatches):
                if len(mb) == 0:  # every prompt tied: nothing to learn from this minibatch
                    continue
                rows_mb = torch.cat([chosen_rows[mb], rejected_rows[mb]]).to(device)
                logp = common.token_logprobs(policy, ids[rows_mb], attn[rows_mb], cmask[rows_mb], args.temperature).sum(1)
                ref_mb = ref_seq[rows_mb]
                loss, logits = dpo_loss(logp[: len(mb)], logp[len(mb):], ref_mb[: len(mb)], ref_mb[len(mb):], args.beta, args.loss_type)
                optimizer.zero_grad()
                loss.mean().backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                optimizer.step()
                step += 1
                losses.append(loss.mean().item())
                accuracies.append((logits > 0).float().mean().item())
                margins.append(logits.mean().item())
            train_seconds = time.time() - train_start

            # ---- the new weights go to the sampler; then the next round's data ----
            wait_start = time.time()
            if not last:
                if args.sync:
                    push_seconds = sampler.push_weights(step)
                    pending, following = submit_round(), None  # on-policy: generated by the weights just pushed
                else:
                    # applied as soon as the round in flight has finished (no batch mixes versions); the
                    # round after it is queued at once and generates while we receive this one's results
                    push_seconds = sampler.push_weights(step, when_idle=True)
                    following = submit_round() if round_index + 2 < args.num_rounds else None
                next_samples = sampler.wait_for(pending["ids"])
                round_end = max(s.finished_at for s in next_samples)
                # the sampler's idle time between two rounds (sync: the whole train step)
                if args.sync:
                    sampler_idle = pending["submitted"] - max(s.finished_at for s in batch["samples"])
                else:
                    sampler_idle = (following["submitted"] if following else time.time()) - round_end
            learner_wait = time.time() - wait_start
            generate_seconds = (round_end - pending["submitted"]) if not last else float("nan")
            totals["wall"] = time.time() - loop_start
            totals["episodes"] += len(samples)
            totals["train"] += train_seconds
            totals["generate"] += 0.0 if last else generate_seconds

            chosen_r = rewards[pair_rows, chosen[keep]] if num_pairs else torch.zeros(1)
            rejected_r = rewards[pair_rows, rejected[keep]] if num_pairs else torch.zeros(1)
            metrics = {
                "charts/reward": rewards.mean().item(),
                "charts/accuracy": float(np.mean([task.is_correct(s.text, problems[i // args.num_completions]) for i, s in enumerate(samples)])),
                "charts/rewards_chosen": chosen_r.mean().item(), "charts/rewards_rejected": rejected_r.mean().item(),
                "charts/rewards_margin": (chosen_r - rejected_r).mean().item(),
                "charts/pairs": num_pairs, "charts/ties_dropped": int((~keep).sum()), "charts/skipped_long_prompts": batch["skipped"],
                "charts/kl_to_init": kl, "charts/lag_min": min(lags), "charts/lag_max": max(lags),
                "charts/episodes": totals["episodes"], "charts/episodes_per_second": totals["episodes"] / max(totals["wall"], 1e-9),
                "losses/loss": float(np.mean(losses)) if losses else float("nan"),
                "losses/dpo_accuracy": float(np.mean(accuracies)) if accuracies else float("nan"),
                "losses/logits_margin": float(np.mean(margins)) if margins else float("nan"),
                "time/train_seconds": train_seconds, "time/generate_seconds": generate_seconds,
                "time/step_seconds": time.time() - round_start, "time/learner_wait_seconds": learner_wait,
                "time/sampler_wait_seconds": sampler_idle if not last else float("nan"),
                "time/push_seconds": push_seconds if not last else float("nan"),
            }
            logger.log(step, metrics, echo=False)
            print(f"round {round_index + 1}/{args.num_rounds} step {step}: reward {metrics['charts/reward']:.3f} "
                  f"acc {metrics['charts/accuracy']:.3f} pairs {num_pairs} ties {metrics['charts/ties_dropped']} "
                  f"dpo_acc {metrics['losses/dpo_accuracy']:.2f} kl {kl:.2f} lag {min(lags)}-{max(lags)} "
                  f"gen {generate_seconds:.2f}s train {train_seconds:.2f}s step {metrics['time/step_seconds']:.2f}s")
            if not last:
                batch, pending = pending | dict(samples=next_samples), following
            if last or (args.save_every and (round_index + 1) % args.save_every == 0):
                common.save_checkpoint(logger.dir / "checkpoint.pt", policy, optimizer, step, data_position,
                                       round=round_index + 1, totals=totals)
        if step:
            sampler.push_weights(step)
        eval_end = evaluate()
        logger.log(step, eval_end)
        memory = dict(learner=common.peak_rss_mib(), sampler=sampler.peak_rss_mib())
    finally:
        sampler.close()

    mode = "sync" if args.sync else "async"
    print(f"\nonline DPO ({mode}, N={args.num_minibatches}): {args.num_rounds} rounds of {args.prompts_per_round} prompts x {args.num_completions}")
    print("| mode | wall (s) | generate (s) | train (s) | episodes/s | accuracy start | accuracy end |\n|---|---|---|---|---|---|---|")
    print(f"| {mode} | {totals['wall']:.1f} | {totals['generate']:.1f} | {totals['train']:.1f} | "
          f"{totals['episodes'] / totals['wall']:.1f} | {eval_start['eval/accuracy']:.3f} | {eval_end['eval/accuracy']:.3f} |")
    print(f"\npeak memory: learner {memory['learner']:.0f} MiB, sampler {memory['sampler']:.0f} MiB")
    logger.close()


if __name__ == "__main__":
    main()
