"""REINFORCE with a mean baseline, the script to read first. Each round samples a group of responses to each of a few
prompts, scores them, takes one step on -A * sum_t log pi(y_t | x, y_<t) (A: the reward minus its group's mean) and
pushes the weights to the sampler, which samples the next round with them. Each method script adds its idea to it:
- rloo_kreuse.py: the leave-one-out baseline, K importance-weighted steps per round on one batch, a KL penalty;
- online_dpo_async.py: preference pairs (a group's best and worst) and the one-step-off overlap;
- pipeline_rl.py: in-flight weight pushes after every step, the lag they give, truncated IS and the ESS guard;
- ppo_oppo.py: a critic, and OPPO's two overlaps: the next round's prompts carried over, the chunks streamed.

    python examples/reinforce.py [--model smollm2]  # the built-in tiny model, or SmolLM2-135M-Instruct (CPU)
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py, tasks.py: in the repository's root
import common
import tasks
from common import Run
from fastrl import checks, memory_plan
from fastrl.run import RunArgs


@dataclass
class Args(RunArgs):
    exp_name: str = "reinforce"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    group_size: int = 8
    """responses per prompt; their mean reward is each one's baseline"""
    num_prompts: int = 32
    """prompts per round"""
    num_rounds: int = 40
    """rounds: sample, score, one gradient step, push"""
    learning_rate: float = 1e-4
    """Adam learning rate, constant"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    temperature: float = 0.8
    """sampling temperature; the learner's logprobs use the same (the logprob contract)"""
    top_p: float = 0.95
    """nucleus sampling; the learner's logprobs use the same nucleus"""
    max_new_tokens: int = 32
    """response length cap"""
    max_prompt_tokens: int = 64
    """prompt budget: longer prompts are skipped and counted"""


SMOLLM2 = dict(task="arithmetic", num_prompts=8, num_rounds=12, learning_rate=2e-5, max_new_tokens=64,
               max_prompt_tokens=128, eval_problems=100, micro_batch_tokens=512)  # --model smollm2: rloo_kreuse.py's


def mean_baseline_advantages(rewards: torch.Tensor) -> torch.Tensor:  # ALGO LOGIC (tests/test_reinforce.py)
    """A = r - the mean reward of the responses to the same prompt. rewards: [prompts, group size]."""
    return rewards - rewards.mean(1, keepdim=True)


def main():
    args = checks.parse_args(Args, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    run = Run(args, memory_plan.GROUPS)  # the sampler starts (P x G a round)
    with run:  # the sampler closes however this ends
        tokenizer, task, evaluate = tasks.load(args, run.model_path, run.sampler.engine)
        policy = run.learner_model(common.load_policy(run.model_path, run.device, dtype=getattr(torch, args.dtype)))
        optimizer = torch.optim.Adam(policy.parameters(), lr=args.learning_rate)
        sampler = run.sampler
        start = run.resume(policy, optimizer)  # the run directory; on --resume a checkpoint's weights, Adam, counters
        eval_start = start.eval_start or run.log(start.step, evaluate())  # pass@k at the run's start
        step, totals, clock = start.step, start.totals, time.perf_counter() - start.totals["wall_seconds"]
        train_problems = tasks.TrainProblems(task, tokenizer, args, start.data_position)
        for round_index in range(start.round, args.num_rounds):
            # ---- sample a group of responses to each prompt with the learner's current weights ----
            problems, prompts, skipped = train_problems.take(args.num_prompts)
            request = sampler.generate(prompts, n=args.group_size, temperature=args.temperature, top_p=args.top_p,
                                       max_tokens=args.max_new_tokens)
            samples, generate_seconds = sampler.wait(request)  # prompt by prompt: sample i answers problem i // G
            sampler.check_version(samples, step)  # stop unless the last push's weights sampled every token
            train_start = time.perf_counter()  # (on CPU: the learner has every core while the sampler idles)
            # ALGO LOGIC: rewards, advantages, the loss -A * sum_t log pi(y_t | x, y_<t), one step
            problem_of = [problems[i // args.group_size] for i in range(len(samples))]
            rewards = torch.tensor([task.reward(s.text, p) for s, p in zip(samples, problem_of)])
            correct = sum(task.is_correct(s.text, p) for s, p in zip(samples, problem_of)) / len(samples)
            advantages = mean_baseline_advantages(rewards.view(-1, args.group_size)).view(-1).to(run.device)
            batch = common.Batch.from_samples(samples, tokenizer.pad_token_id, run.device)  # padded rows, masks
            loss = 0.0  # the batch mean, a micro-batch at a time: each one's share backpropagated, the gradients add up
            for mb in common.micro_batch_plan(batch.lengths, args.micro_batch_tokens):
                cut = lambda x: x[mb.items, :mb.width]  # its rows, as wide as its longest
                with torch.autocast(run.device.type, torch.bfloat16, enabled=args.autocast_bf16):  # (--autocast-bf16)
                    logp = common.token_logprobs(policy, cut(batch.input_ids), cut(batch.attention_mask),
                                                 cut(batch.completion_mask), temperature=args.temperature,
                                                 top_p=args.top_p)  # [rows, width - 1], 0 off the response
                mb_loss = -(advantages[mb.items] * (logp * batch.mask[mb.items, :mb.width - 1]).sum(1)).mean()
                share = mb.weight * len(mb.items) / len(samples)  # (weight 0: a rank short of micro-batches)
                (mb_loss * share).backward()
                loss = loss + mb_loss.detach() * share
            loss = run.all_sum(loss)  # under torchrun, every rank's: for the log and the NaN check (FSDP sums grads)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))  # a NaN never reaches the weights
            if stepped:
                optimizer.step()
            optimizer.zero_grad()
            step, totals["nonfinite_skipped"] = step + stepped, totals["nonfinite_skipped"] + (not stepped)
            train_seconds = time.perf_counter() - train_start

            # ---- push the new weights as policy version `step`: the next round samples with them ----
            pushed = sampler.push(policy, step)  # (after a skipped step: the same weights, the same version)
            totals["episodes"] += len(samples)
            totals["skipped_prompts"] += skipped
            totals["generate_seconds"] += generate_seconds
            totals["train_seconds"] += train_seconds
            totals["wall_seconds"] = time.perf_counter() - clock
            metrics = {"charts/reward": rewards.mean().item(), "charts/accuracy": correct, "losses/loss": loss.item(),
                       "losses/grad_norm": grad_norm.item() if stepped else float("nan"),  # (NaN: no step taken)
                       "charts/response_length": batch.mask.sum(1).mean().item(), "time/train_seconds": train_seconds,
                       "time/generate_seconds": generate_seconds, **pushed, **common.throughput(totals, step)}
            run.log(step, metrics, round=round_index + 1)

            # ---- after the round: pass@k, the checkpoint ----
            rounds_done, last = round_index + 1, round_index + 1 == args.num_rounds
            if args.eval_every and rounds_done % args.eval_every == 0 and not last:
                run.log(step, evaluate())
            if last or (args.save_every and rounds_done % args.save_every == 0):
                run.save(step, rounds_done, train_problems.position, totals, tokenizer, eval_start)
        eval_end = run.log(step, evaluate())  # held-out pass@k at the end
    run.report("REINFORCE with a mean baseline", {}, totals, step, eval_start, eval_end)


if __name__ == "__main__":
    main()
