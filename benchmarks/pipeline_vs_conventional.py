"""PipelineRL vs Conventional RL (G=4) on the same config with a long-tailed response-length
workload (tiny model), in one run.

    .venv/bin/python benchmarks/pipeline_vs_conventional.py

Workload: each prompt's responses are forced to a length L = min(64, 2 * (1 + Pareto(0.8)))
tokens (vLLM ignore_eos with max_tokens = L; pipeline_rl.py --long-tail 0.8 --long-tail-scale 2):
median 4 tokens, 1 in 10 above 35, about 1 in 16 at the 64-token cap, so a Conventional RL
round waits for its longest sequences while the engine's batch drains. PipelineRL keeps H = 128 in
flight (--h); Conventional RL its default, all B*G.

A machine's speed drifts over minutes, so the two methods run in alternation, PipelineRL,
Conventional, Conventional, PipelineRL, ... (--repeats pairs; ABBA cancels a steady drift), and
the ratio is taken between the methods' mean samples/s. Reports samples/s, the
ratio (and each pair's), mean ESS, mean token lag, and the training reward each run had reached
at the same wall-clock time."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fastrl import runlog  # noqa: E402


@dataclass
class Args:
    num_steps: int = 120
    seed: int = 1
    g: int = 4
    """G of Conventional RL"""
    workload: str = "--long-tail 0.8 --long-tail-scale 2 --max-new-tokens 64"
    """flags that define the workload, passed to both runs"""
    h: int = 128
    """PipelineRL's H (--gen-batch-size); Conventional RL keeps its default, all B*G sequences in flight"""
    repeats: int = 2
    """runs of each method, in the order P C C P P C ..."""


def run(mode: str, args: Args) -> dict:
    flags = ["--mode", mode, "--steps-per-rl-step", str(args.g), "--num-steps", str(args.num_steps), "--seed",
             str(args.seed),
             "--exp-name", f"prl_bench_{mode}", "--eval-problems", "50", *args.workload.split()]
    if mode == "pipeline":  # (in conventional mode --gen-batch-size would cap the engine below B*G)
        flags += ["--gen-batch-size", str(args.h)]
    out = subprocess.run([sys.executable, str(ROOT / "pipeline_rl.py"), *flags], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    run_dir = ROOT / out.stdout.split("run directory: ")[1].split()[0]
    metrics = runlog.read_metrics(run_dir)
    # the optimizer steps (a batch the ESS guard skipped logs charts/ess only)
    rows = [r for r in metrics if "losses/loss" in r]
    return dict(mode=mode, rows=rows, sps=rows[-1]["charts/episodes_per_second"],
                tps=rows[-1]["charts/tokens_per_second"],
                wait=np.mean([r["time/learner_wait_seconds"] for r in rows]),
                busy=np.mean([r["time/train_seconds"] + r.get("time/push_seconds", 0.0) for r in rows]),
                ess=np.nanmean([r["charts/ess"] for r in metrics if "charts/ess" in r]),
                lag=np.mean([r["charts/lag_mean"] for r in rows]),
                start=rows[0]["wall"])


def reward_at(result: dict, seconds: float) -> float:
    """Mean training reward over the last 10 steps taken within `seconds` of the first step."""
    rows = [r for r in result["rows"] if r["wall"] - result["start"] <= seconds]
    return float(np.mean([r["charts/reward"] for r in rows[-10:]]))


def main():
    args = tyro.cli(Args)
    runs = {"pipeline": [], "conventional": []}
    for repeat in range(args.repeats):
        for mode in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:  # P C, C P, P C, ...
            runs[mode].append(run(mode, args))
            print(f"pair {repeat + 1}: {mode} {runs[mode][-1]['sps']:.1f} samples/s", flush=True)
    pipes, convs = runs["pipeline"], runs["conventional"]
    common_time = min(r["rows"][-1]["wall"] - r["start"] for r in pipes + convs)
    print(f"\nPipelineRL vs Conventional RL (G={args.g}), tiny model, {args.num_steps} steps of 64 sequences, "
          f"workload: {args.workload}\n")
    print(("| pair | method | samples/s | tokens/s | mean ESS | mean token lag | "
           "reward at {:.0f} s |").format(common_time))
    print("|---|---|---|---|---|---|---|")
    for pair, (pipe, conv) in enumerate(zip(pipes, convs), 1):
        for r in (pipe, conv):
            label = "PipelineRL" if r["mode"] == "pipeline" else f"Conventional RL (G={args.g})"
            print(f"| {pair} | {label} | {r['sps']:.1f} | {r['tps']:.0f} | {r['ess']:.3f} | {r['lag']:.2f} | "
                  f"{reward_at(r, common_time):.3f} |")
    pipe_sps, conv_sps = np.mean([r["sps"] for r in pipes]), np.mean([r["sps"] for r in convs])
    pairs = ", ".join(f"{p['sps'] / c['sps']:.2f}x" for p, c in zip(pipes, convs))
    print(f"\nsamples/s ratio PipelineRL / Conventional: {pipe_sps / conv_sps:.2f}x over the means (pairs: {pairs}; "
          f"target >= 1.5x); PipelineRL mean ESS {np.mean([r['ess'] for r in pipes]):.3f} (target >= 0.9)")
    # Conventional RL's step: waiting for generation (the sampler on every core), then training and the push (the
    # learner on every core)
    wait, busy = np.mean([r["wait"] for r in convs]), np.mean([r["busy"] for r in convs])
    print(f"generation is {100 * wait / (wait + busy):.0f}% of a Conventional RL step")
    print(f"speed-up against the best baseline at equal hardware (Conventional RL G={args.g}, every core in turn): "
          f"PipelineRL {pipe_sps / conv_sps:.2f}x samples/s (ideal {(wait + busy) / max(wait, busy):.2f}x: perfect "
          f"overlap, from Conventional RL's phase times)")


if __name__ == "__main__":
    main()
