"""The OPPO ablation (the paper's Figure 6): plain PPO vs intra only vs inter only vs OPPO on the
same config and the same number of rounds, with a long-tailed response-length workload
(tiny model), in one run.

    .venv/bin/python benchmarks/ppo_oppo_ablation.py

Workload (--workload, passed to all four runs): every response is forced (vLLM ignore_eos with
max_tokens = L) to a length L = min(96, 4 * (1 + Pareto(0.8))) tokens (ppo_oppo.py --long-tail 0.8
--long-tail-scale 4 --max-new-tokens 96): median 9 tokens, 1 in 5 above 30, 1 in 13 at the 96-token
cap, so plain PPO waits ~96 decode steps every round for a handful of stragglers. Reports the
mean round time split into generate / score / train, its ratio to plain PPO, and the training
reward per round (mean over all rounds and over the last 10), and writes reward-vs-step
and reward-vs-wall-clock plots (docs/)."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fastrl import runlog  # noqa: E402

# the papers' regime: rounds of 4 responses with a longer forced tail (scale 8: median 18 tokens), so that a round
# waits on its longest answer while scoring and training stay small: generation measured 71-73% of a plain PPO round
# on 2 cores (batch 32 at scale 4: 49%; 16 at scale 8: 54%; 8 at scale 8: 64-65%); docs/results.md
REGIME = ("--long-tail 0.8 --long-tail-scale 8 --max-new-tokens 96", "--batch-size 4 --num-ppo-epochs 1")
VARIANTS = {"plain PPO": ["--no-intra", "--no-inter"], "intra only": ["--no-inter"], "inter only": ["--no-intra"],
            "OPPO": []}


@dataclass
class Args:
    num_rounds: int = 40
    """PPO rounds per variant"""
    seed: int = 1
    workload: str = "--long-tail 0.8 --long-tail-scale 4 --max-new-tokens 96"
    """flags that define the workload, passed to every variant"""
    config: str = "--batch-size 32 --num-ppo-epochs 1"
    """PPO flags shared by every variant"""
    regime: bool = False
    """the papers' regime instead of --workload/--config: REGIME (generation as much of a plain round as this machine
    allows)"""
    plot: str = "docs/ppo_oppo_ablation.png"
    """where to write the reward curves (empty: no plot)"""


def run(label: str, args: Args) -> dict:
    flags = ["--num-rounds", str(args.num_rounds), "--seed", str(args.seed), "--eval-problems", "50",
             "--exp-name", "oppo_bench_" + label.replace(" ", "_"), *args.config.split(), *args.workload.split(),
             *VARIANTS[label]]
    print(f"running {label}: ppo_oppo.py {' '.join(flags)}", flush=True)
    out = subprocess.run([sys.executable, str(ROOT / "ppo_oppo.py"), *flags], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    run_dir = ROOT / out.stdout.split("run directory: ")[1].split()[0]
    rows = [r for r in runlog.read_metrics(run_dir) if "time/round_seconds" in r]
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    return dict(label=label, dir=run_dir, round=mean("time/round_seconds"), generate=mean("time/generate_seconds"),
                exposed=mean("time/score_exposed_seconds"), hidden=mean("time/score_hidden_seconds"),
                train=mean("time/train_seconds"), push=mean("time/push_seconds"), reward=mean("charts/reward"),
                reward_last=float(np.mean([r["charts/reward"] for r in rows[-10:]])),
                delta=mean("charts/delta"), carried=mean("charts/carried_in_batch"), lag=mean("charts/lag_mean"))


def main():
    args = tyro.cli(Args)
    if args.regime:
        args.workload, args.config = REGIME
    results = [run(label, args) for label in VARIANTS]
    plain = results[0]
    print(f"\nOPPO ablation, tiny model, {args.num_rounds} rounds, config: {args.config}, workload: {args.workload}\n")
    print("| variant | round (s) | speed-up vs plain | generate | score exposed | score hidden | train | push | "
          "mean Delta | carried in batch | token lag | reward (all) | reward (last 10) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['label']} | {r['round']:.3f} | {plain['round'] / r['round']:.2f}x | {r['generate']:.3f} | "
              f"{r['exposed']:.3f} | {r['hidden']:.3f} | {r['train']:.3f} | {r['push']:.3f} | {r['delta']:.1f} | "
              f"{r['carried']:.1f} | {r['lag']:.2f} | {r['reward']:.3f} | {r['reward_last']:.3f} |")
    oppo = results[-1]
    print(f"\nOPPO round time = 1/{plain['round'] / oppo['round']:.2f} of plain PPO's (target: at most 1/1.5)")
    print(f"generation is {100 * plain['generate'] / plain['round']:.0f}% of a plain PPO round")
    if args.plot:
        import plot_runs

        dirs, labels = [r["dir"] for r in results], [r["label"] for r in results]
        out = Path(args.plot)
        plot_runs.plot(dirs, ["charts/reward"], x="step", out=ROOT / out.with_name(out.stem + "_steps.png"),
                       labels=labels, smooth=5)
        plot_runs.plot(dirs, ["charts/reward"], x="wall", out=ROOT / out, labels=labels, smooth=5)
        print(f"reward curves: {out} (wall-clock), {out.with_name(out.stem + '_steps.png')} (optimizer steps)")
    # last: against the best baseline, plain PPO, whose sampler and learner each use every core in turn
    # (launch.sampler_threads); the ideal hides all generation behind the rest of the round, or the rest behind
    # generation
    rest = plain["round"] - plain["generate"]
    print(f"speed-up against the best baseline at equal hardware (plain PPO, every core in turn): OPPO "
          f"{plain['round'] / oppo['round']:.2f}x per round "
          f"(ideal {plain['round'] / max(plain['generate'], rest):.2f}x: "
          f"perfect overlap, from plain PPO's phase times)")


if __name__ == "__main__":
    main()
