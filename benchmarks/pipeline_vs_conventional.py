"""PipelineRL vs Conventional RL (G=4) on the same config with a long-tailed response-length
workload (tiny model), in one run.

    .venv/bin/python benchmarks/pipeline_vs_conventional.py

Workload: each prompt's responses are forced to a length L = min(64, 2 * (1 + Pareto(0.8)))
tokens (vLLM ignore_eos with max_tokens = L; pipeline_rl.py --long-tail 0.8 --long-tail-scale 2):
median 4 tokens, 1 in 10 above 35, about 1 in 16 at the 64-token cap, so a Conventional RL
round waits for its longest sequences while the engine's batch drains. H = 128 in flight. Reports samples/s, the ratio, mean
ESS, mean token lag, and the training reward each run had reached at the same wall-clock time."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402


@dataclass
class Args:
    num_steps: int = 120
    seed: int = 1
    g: int = 4
    """G of Conventional RL"""
    workload: str = "--long-tail 0.8 --long-tail-scale 2 --max-new-tokens 64 --gen-batch-size 128"
    """flags that define the workload, passed to both runs"""


def run(mode: str, args: Args) -> dict:
    flags = ["--mode", mode, "--g", str(args.g), "--num-steps", str(args.num_steps), "--seed", str(args.seed),
             "--exp-name", f"prl_bench_{mode}", "--eval-problems", "50", *args.workload.split()]
    out = subprocess.run([sys.executable, str(ROOT / "pipeline_rl.py"), *flags], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    run_dir = ROOT / out.stdout.split("run directory: ")[1].split()[0]
    rows = [r for r in common.read_metrics(run_dir) if "charts/ess" in r]
    return dict(mode=mode, rows=rows, sps=rows[-1]["charts/samples_per_second"], tps=rows[-1]["charts/tokens_per_second"],
                ess=np.mean([r["charts/ess"] for r in rows]), lag=np.mean([r["charts/lag_mean"] for r in rows]),
                start=rows[0]["wall"])


def reward_at(result: dict, seconds: float) -> float:
    """Mean training reward over the last 10 steps taken within `seconds` of the first step."""
    rows = [r for r in result["rows"] if r["wall"] - result["start"] <= seconds]
    return float(np.mean([r["charts/reward"] for r in rows[-10:]]))


def main():
    args = tyro.cli(Args)
    pipe, conv = run("pipeline", args), run("conventional", args)
    common_time = min(r["rows"][-1]["wall"] - r["start"] for r in (pipe, conv))
    print(f"\nPipelineRL vs Conventional RL (G={args.g}), tiny model, {args.num_steps} steps of 64 sequences, "
          f"workload: {args.workload}\n")
    print("| method | samples/s | tokens/s | mean ESS | mean token lag | reward at {:.0f} s |".format(common_time))
    print("|---|---|---|---|---|---|")
    for r in (pipe, conv):
        label = "PipelineRL" if r["mode"] == "pipeline" else f"Conventional RL (G={args.g})"
        print(f"| {label} | {r['sps']:.1f} | {r['tps']:.0f} | {r['ess']:.3f} | {r['lag']:.2f} | {reward_at(r, common_time):.3f} |")
    print(f"\nsamples/s ratio PipelineRL / Conventional: {pipe['sps'] / conv['sps']:.2f}x (target >= 1.5x); "
          f"PipelineRL mean ESS {pipe['ess']:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
