"""Plot the metrics.jsonl curves of one or more runs: one subplot per metric, one line per run.

    python plot_runs.py runs/dpo_bench_sync__1__* runs/dpo_bench_async__1__* --x wall
    python plot_runs.py runs/ksweep_k1__* runs/ksweep_k4__* --x samples --metrics charts/reward eval/pass@1 --smooth 5

Each run directory holds the metrics.jsonl that runlog.RunLogger writes: one JSON object per
log call with "step", "wall" and the metrics of that call. Training rows and eval rows are
separate rows, so a metric's curve uses only the rows that have a finite value for it.

The x axis (--x):
  wall     seconds since the run's logger started (the row's "wall"; it includes model loading and
           the first evaluation). A resumed run's clock goes on from its checkpoint's (the time between
           the crash and the resume left out), and it replaces the rows logged after the checkpoint;
           in older runs the wall restarted: wherever it goes back, the rest is shifted to continue.
  step     the learner's optimizer step (the row's "step").
  samples  cumulative training samples (completions) behind the row: the "charts/episodes" counter
           that every script logs (a run without it is an error). A row without the counter (an
           eval row) takes the last counter value before it, 0 before the first training row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fastrl import runlog

COUNTER = "charts/episodes"  # the cumulative sample counter every script logs
X_LABELS = dict(wall="wall-clock seconds since run start", step="learner step", samples="training samples (cumulative)")


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[list[str]]
    """run directories (runs/<exp_name>__<seed>__<time>), each with a metrics.jsonl"""
    metrics: list[str] = field(default_factory=lambda: ["charts/reward"])
    """metrics to plot, one subplot each, e.g. charts/reward charts/accuracy eval/pass@1"""
    x: Literal["wall", "step", "samples"] = "wall"
    """x axis: wall (seconds), step (learner step) or samples (cumulative training samples; rule in the module
    docstring)"""
    labels: list[str] | None = None
    """legend labels, one per run directory in the same order (None: the directory names)"""
    smooth: int = 1
    """moving-average window in logged points, trailing (1 = no smoothing; the raw curve stays drawn faintly behind)"""
    out: str = "plot.png"
    """path of the PNG to write"""




def wall_axis(rows: list[dict]) -> list[float]:
    """The rows' "wall", with each resumed segment (wall going back) shifted to follow the previous one."""
    xs, offset, previous = [], 0.0, None
    for row in rows:
        wall = float(row["wall"])
        if previous is not None and wall + offset < previous:
            offset = previous - wall
        previous = wall + offset
        xs.append(previous)
    return xs


def samples_axis(rows: list[dict], run_dir: str | Path = "run") -> list[float]:
    """Cumulative training samples behind each row (the rule is in the module docstring)."""
    if not any(COUNTER in row for row in rows):
        raise SystemExit(f"error: {run_dir}: --x samples needs the {COUNTER} counter in metrics.jsonl")
    xs, last = [], 0.0
    for row in rows:
        last = float(row.get(COUNTER, last))
        xs.append(last)
    return xs


def x_axis(rows: list[dict], x: str, run_dir: str | Path = "run") -> list[float]:
    """The x value of every row, for x in wall / step / samples."""
    if x == "wall":
        return wall_axis(rows)
    if x == "step":
        return [float(row["step"]) for row in rows]
    if x == "samples":
        return samples_axis(rows, run_dir)
    raise SystemExit(f"error: --x: must be wall, step or samples, got {x!r}")


def series(rows: list[dict], xs: list[float], metric: str) -> tuple[list[float], list[float]]:
    """(x, y) of the rows that have a finite number for metric; other rows are skipped."""
    points = [(x, float(row[metric])) for x, row in zip(xs, rows)
              if isinstance(row.get(metric), (int, float)) and math.isfinite(row[metric])]
    return [x for x, _ in points], [y for _, y in points]


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing moving average; the first points average over what exists so far."""
    sums = [0.0]
    for y in ys:
        sums.append(sums[-1] + y)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(ys))]


def plot(run_dirs, metrics, x="wall", out="plot.png", labels=None, smooth=1) -> Path:
    """Draw each metric of each run against x into a PNG at out; returns its path."""
    if not run_dirs:
        raise SystemExit("error: no run directories given")
    if labels is not None and len(labels) != len(run_dirs):
        raise SystemExit(f"error: --labels: {len(labels)} labels for {len(run_dirs)} run directories")
    if smooth < 1:
        raise SystemExit(f"error: --smooth: must be >= 1, got {smooth}")
    labels = labels or [Path(d).resolve().name for d in run_dirs]

    # ---- read every run; then every (metric, run) series ----
    runs = []
    for run_dir in run_dirs:
        rows = runlog.read_metrics(run_dir)
        runs.append((rows, x_axis(rows, x, run_dir)))
    data = {metric: [(label, *series(rows, xs, metric)) for label, (rows, xs) in zip(labels, runs)]
            for metric in metrics}
    for metric, lines in data.items():
        if not any(ys for _, _, ys in lines):
            raise SystemExit(f"error: metric {metric!r} is in none of the runs ({', '.join(labels)})")

    # ---- one subplot per metric, one line per run ----
    ncols = min(len(metrics), 2)
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(6.4 * ncols, 4.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, (metric, lines) in zip(axes, data.items()):
        for label, xs, ys in lines:
            if not ys:
                continue
            marker = "o" if len(ys) <= 30 else None  # eval metrics: a few points
            window = smooth if len(ys) >= 3 * smooth else 1  # averaging a handful of points would only blur them
            line, = ax.plot(xs, moving_average(ys, window), label=label, marker=marker, markersize=3)
            if window > 1:  # the raw values stay visible behind the average
                ax.plot(xs, ys, color=line.get_color(), alpha=0.25, linewidth=1)
        ax.set_title(metric)
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(f"{len(run_dirs)} run{'s' if len(run_dirs) > 1 else ''}, x = {x}"
                 + (f", moving average over {smooth} points" if smooth > 1 else ""))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main():
    args = tyro.cli(Args)
    out = plot(args.run_dirs, args.metrics, args.x, args.out, labels=args.labels, smooth=args.smooth)
    print(out)


if __name__ == "__main__":
    main()
