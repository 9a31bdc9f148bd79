"""Each script's --model smollm2 preset run to its end, over seeds (issue 50): held-out pass@1 at the start and at the
end with two standard errors, minutes of training, peak memory (learner + sampler); one table and one plot.

    .venv/bin/python benchmarks/smollm2_curves.py                     # 4 scripts x seeds 1 2 3, then the table
    .venv/bin/python benchmarks/smollm2_curves.py --report-only       # the table and plot of the runs already there
    .venv/bin/python benchmarks/smollm2_curves.py --tag bf16 \\
        "--extra=--autocast-bf16 --sampler-dtype bfloat16"            # the GPU's precision split (a CPU with bf16)
    .venv/bin/python benchmarks/smollm2_curves.py --report-only --tags fp32 bf16 --plot None   # the two side by side

(--extra takes its value after "=": tyro reads a separate value that starts with "--" as a flag.)

Each run is the script's own command, `python SCRIPT --model smollm2 --seed N --exp-name curve_<script>_<tag>_sN`,
one after another on the whole machine (never two at once: each would take the other's cores). Minutes of training:
the wall time from the end of the first held-out evaluation to the last training row (the model's build and the two
evaluations excluded). pass@1: `eval/pass@1` over `eval/problems` held-out problems x `eval/samples`; a gain's two
standard errors are binomial over the problems at the start's and the end's pass@1 (combined as independent), and
the mean gain over seeds gets two standard errors of the seeds' spread."""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrl import runlog, util  # noqa: E402

SCRIPTS = ("rloo_kreuse.py", "online_dpo_async.py", "pipeline_rl.py", "ppo_oppo.py")


@dataclasses.dataclass
class Args:
    scripts: tuple[str, ...] = SCRIPTS
    seeds: tuple[int, ...] = (1, 2, 3)
    tag: str = "default"
    """part of each run's name: curve_<script>_<tag>_s<seed>"""
    extra: str = ""
    """more flags for every run (e.g. "--no-autocast-bf16 --sampler-dtype auto")"""
    report_only: bool = False
    """run nothing: the table (and plot) of the runs under runs/ that match"""
    tags: tuple[str, ...] = ()
    """with --report-only: the tags to report (default: --tag)"""
    smooth: int = 3
    """the plot's training accuracy: the mean of the last N rounds"""
    plot: str | None = "docs/smollm2_curves.png"
    """the four methods' training accuracy against minutes of training, one line per run (None: no plot)"""


def run_name(script: str, tag: str, seed: int) -> str:
    return f"curve_{Path(script).stem}_{tag}_s{seed}"


def summarize(run_dir: Path) -> dict:
    """One run's numbers: pass@1 start/end with two binomial standard errors, training minutes, peak memory."""
    rows = runlog.read_metrics(run_dir)
    evals = [r for r in rows if "eval/pass@1" in r]
    train = [r for r in rows if "charts/reward" in r]
    start, end = evals[0], evals[-1]
    problems = end.get("eval/problems", 0)

    def two_se(p: float) -> float:
        return 2 * math.sqrt(p * (1 - p) / problems) if problems else float("nan")

    memory = {k: v for r in rows for k, v in r.items() if k.startswith("memory/")}
    return dict(run=run_dir.name, start=start["eval/pass@1"], end=end["eval/pass@1"],
                start_2se=two_se(start["eval/pass@1"]), end_2se=two_se(end["eval/pass@1"]), problems=problems,
                samples=end.get("eval/samples"), minutes=(train[-1]["wall"] - start["wall"]) / 60 if train else 0.0,
                learner_mib=memory.get("memory/learner_peak_mib", float("nan")),
                sampler_mib=memory.get("memory/sampler_peak_mib", float("nan")), rounds=len(train))


def find_runs(script: str, tag: str, seeds) -> list[Path]:
    found = []
    for seed in seeds:
        dirs = sorted((ROOT / "runs").glob(f"{run_name(script, tag, seed)}__*"), key=lambda p: p.stat().st_mtime)
        done = [d for d in dirs if (d / "summary.md").is_file()]
        if done:
            found.append(done[-1])
    return found


def table(args: Args, tags) -> str:
    lines = ["| method | precision | seeds | minutes of training | held-out pass@1 start -> end (+-2 SE of the gain) | "
             "peak memory: learner + sampler |", "|---|---|---|---|---|---|"]
    for tag in tags:
        for script in args.scripts:
            runs = [summarize(d) for d in find_runs(script, tag, args.seeds)]
            if not runs:
                continue
            for r in runs:
                print(f"  {r['run']}: pass@1 {r['start']:.3f} -> {r['end']:.3f} (+-{r['end_2se']:.3f}, "
                      f"{r['problems']:.0f} problems x {r['samples']:.0f}), {r['minutes']:.1f} min, {r['rounds']} "
                      f"rounds, learner {r['learner_mib']:.0f} MiB + sampler {r['sampler_mib']:.0f} MiB")
            gain = [r["end"] - r["start"] for r in runs]
            spread = 2 * statistics.stdev(gain) / math.sqrt(len(gain)) if len(gain) > 1 else float("nan")
            start, end = statistics.mean(r["start"] for r in runs), statistics.mean(r["end"] for r in runs)
            each = ", ".join(f"{r['start']:.3f} -> {r['end']:.3f} (+-{math.hypot(r['start_2se'], r['end_2se']):.3f})"
                             for r in runs)
            minutes = ", ".join(f"{r['minutes']:.1f}" for r in runs)
            peak = max(r["learner_mib"] + r["sampler_mib"] for r in runs)
            learner = max(r["learner_mib"] for r in runs)
            mean = f"mean {start:.3f} -> {end:.3f}" + (f", gain +-{spread:.3f} over seeds" if len(runs) > 1 else "")
            lines.append(f"| `{script}` | {tag} | {len(runs)} | {minutes} | {each}; {mean} | "
                         f"{learner / 1024:.1f} + {(peak - learner) / 1024:.1f} GiB |")
    return "\n".join(lines)


def plot(args: Args, tags, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_reward, ax_eval = fig.subplots(1, 2)
    colors = dict(zip(SCRIPTS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for tag in tags:
        for script in args.scripts:
            for i, d in enumerate(find_runs(script, tag, args.seeds)):
                rows = runlog.read_metrics(d)
                t0 = next(r["wall"] for r in rows if "eval/pass@1" in r)
                train = [r for r in rows if "charts/reward" in r]
                label = f"{Path(script).stem} ({tag})" if i == 0 else None
                accuracy = [r["charts/accuracy"] for r in train]
                smooth = [statistics.mean(accuracy[max(0, j - args.smooth + 1):j + 1]) for j in range(len(accuracy))]
                ax_reward.plot([(r["wall"] - t0) / 60 for r in train], smooth, color=colors.get(script), alpha=0.8,
                               label=label)
                s = summarize(d)
                ax_eval.errorbar([0, s["minutes"]], [s["start"], s["end"]], yerr=[s["start_2se"], s["end_2se"]],
                                 color=colors.get(script), marker="o", capsize=3, alpha=0.8, label=label)
    ax_reward.set(xlabel="minutes of training", ylabel=f"training accuracy (charts/accuracy, mean of {args.smooth})",
                  title="SmolLM2-135M-Instruct, two-digit arithmetic")
    ax_eval.set(xlabel="minutes of training", ylabel="held-out pass@1 (+-2 SE)", title="start -> end of each run")
    ax_reward.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main():
    args = tyro.cli(Args)
    if not args.report_only:
        for seed in args.seeds:
            for script in args.scripts:
                name = run_name(script, args.tag, seed)
                command = [sys.executable, str(ROOT / script), "--model", "smollm2", "--seed", str(seed),
                           "--exp-name", name, *shlex.split(args.extra)]
                print(f"$ {shlex.join(command[1:])}", flush=True)
                t = time.time()
                subprocess.run(command, cwd=ROOT, check=True, env=os.environ)
                print(f"  {name}: {time.time() - t:.0f} s", flush=True)
    tags = args.tags or (args.tag,)
    print(f"machine: {util.machine_line()}")
    print(table(args, tags))
    if args.plot:
        plot(args, tags, ROOT / args.plot)


if __name__ == "__main__":
    main()
