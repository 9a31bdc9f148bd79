"""plot_runs.py on small runs written in runlog.RunLogger's format (rows copied from real runs)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

import plot_runs

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, name: str, records: list[dict], args: dict) -> Path:
    """A run directory as RunLogger writes it: args.json (indent=1) and one json.dumps line per log call."""
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps(args, indent=1, default=str))
    with open(run_dir / "metrics.jsonl", "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return run_dir


def dpo_run(root: Path, name: str = "dpo_async__1__1795266506", rounds: int = 6, wall0: float = 17.5,
            dt: float = 1.4) -> Path:
    """online_dpo_async.py: eval row, one row per round (cumulative charts/episodes), final eval row."""
    records = [{"step": 0, "wall": wall0, "eval/accuracy": 0.1225}]
    for r in range(rounds):
        records.append({
            "step": r + 1, "wall": round(wall0 + 1.7 + dt * r, 3), "charts/reward": 0.2 + 0.03 * r,
                        "charts/accuracy": 0.13 + 0.02 * r,
            "charts/pairs": 49.0, "charts/ties_dropped": 79.0, "charts/lag_min": 0.0, "charts/lag_max": 1.0,
            "charts/episodes": 512.0 * (r + 1), "charts/episodes_per_second": 324.0 + r,
            "losses/loss": 0.6931471824645996, "time/train_seconds": 0.69, "time/generate_seconds": 0.83,
            # the last round has no next generation nor push: the script logs NaN there
            "time/push_seconds": 0.04 if r + 1 < rounds else float("nan"),
        })
    records.append({"step": rounds, "wall": round(wall0 + 3 + dt * rounds, 3), "eval/accuracy": 0.35625})
    return write_run(root, name, records,
                     {"exp_name": name.split("__")[0], "seed": 1, "num_prompts": 128, "num_completions": 4,
                                           "resume": None})


def pipeline_run(root: Path, name: str = "prl_pipeline__1__1795271179", steps: int = 8) -> Path:
    """pipeline_rl.py: one row per step (charts/episodes grows by train_batch_size); mid-run eval rows are separate."""
    records = [{"step": 0, "wall": 13.387, "eval/pass@1": 0.135, "eval/pass@4": 0.36}]
    for s in range(1, steps + 1):
        records.append({
            "step": s, "wall": round(13.6 + 0.3 * s, 3), "charts/reward": 0.01 * s, "charts/accuracy": 0.0,
                        "charts/ess": 0.99,
            "charts/lag_mean": 0.5 * s, "charts/episodes": 64.0 * s, "charts/episodes_per_second": 252.6,
                        "losses/loss": 0.0, "time/train_seconds": 0.1,
        })
        if s == steps // 2:
            records.append({"step": s, "wall": round(13.7 + 0.3 * s, 3), "eval/pass@1": 0.2, "eval/pass@4": 0.4})
    records.append({"step": steps, "wall": round(14.0 + 0.3 * steps, 3), "eval/pass@1": 0.26, "eval/pass@4": 0.52})
    return write_run(root, name, records,
                     {"exp_name": "prl_pipeline", "seed": 1, "mode": "pipeline", "train_batch_size": 64,
                                           "group_size": 4, "num_steps": steps})


# ---- the x axes ----

@pytest.mark.slow
def test_samples_axis_uses_the_cumulative_episodes_counter(tmp_path):
    rows = plot_runs.runlog.read_metrics(dpo_run(tmp_path, rounds=3))
    # eval row before training: 0; training rows: the counter; the final eval row carries the last value forward
    assert plot_runs.samples_axis(rows) == [0.0, 512.0, 1024.0, 1536.0, 1536.0]


@pytest.mark.slow
def test_samples_axis_carries_the_counter_over_eval_rows(tmp_path):
    rows = plot_runs.runlog.read_metrics(pipeline_run(tmp_path, steps=4))
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3, 4, 4]
    assert plot_runs.samples_axis(rows) == [0.0, 64.0, 128.0, 128.0, 192.0, 256.0, 256.0]
    xs, ys = plot_runs.series(rows, plot_runs.x_axis(rows, "samples"), "eval/pass@1")
    assert (xs, ys) == ([0.0, 128.0, 256.0], [0.135, 0.2, 0.26])


@pytest.mark.slow
def test_samples_axis_without_the_counter_is_an_error(tmp_path):
    run_dir = write_run(tmp_path, "other__1__1", [{"step": 1, "wall": 1.0, "charts/reward": 0.5}],
                        {"exp_name": "other"})
    with pytest.raises(SystemExit, match="needs the charts/episodes counter"):
        plot_runs.samples_axis(plot_runs.runlog.read_metrics(run_dir), run_dir)


@pytest.mark.slow
def test_step_and_wall_axes(tmp_path):
    rows = plot_runs.runlog.read_metrics(dpo_run(tmp_path, rounds=2, wall0=10.0, dt=2.0))
    assert plot_runs.x_axis(rows, "step") == [0.0, 1.0, 2.0, 2.0]
    assert plot_runs.x_axis(rows, "wall") == [10.0, 11.7, 13.7, 17.0]


def test_wall_axis_continues_across_a_resume(tmp_path):
    # a resumed run appends from a new process whose logger clock restarts (runs/pytest_dpo_resume__*)
    walls = [16.1, 16.359, 16.614, 15.523, 15.658, 15.826]
    rows = [{"step": i, "wall": w} for i, w in enumerate(walls)]
    assert plot_runs.wall_axis(rows) == pytest.approx([16.1, 16.359, 16.614, 16.614, 16.749, 16.917])


@pytest.mark.slow
def test_series_skips_rows_without_a_finite_value(tmp_path):
    rows = plot_runs.runlog.read_metrics(dpo_run(tmp_path, rounds=3))
    xs = plot_runs.x_axis(rows, "step")
    assert plot_runs.series(rows, xs, "charts/reward") == ([1.0, 2.0, 3.0], pytest.approx([0.2, 0.23, 0.26]))
    assert plot_runs.series(rows, xs, "eval/accuracy") == ([0.0, 3.0], [0.1225, 0.35625])
    assert math.isnan(rows[3]["time/push_seconds"])  # NaN round-trips through metrics.jsonl ...
    assert plot_runs.series(rows, xs, "time/push_seconds") == ([1.0, 2.0], [0.04, 0.04])  # ... and is left out


def test_moving_average_is_trailing():
    assert plot_runs.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert plot_runs.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert plot_runs.moving_average([3.0, 6.0, 9.0, 0.0], 3) == [3.0, 4.5, 6.0, 5.0]


@pytest.mark.slow
def test_a_partly_written_last_line_is_ignored(tmp_path):
    run_dir = dpo_run(tmp_path, rounds=2)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "wall": 2')
    rows = plot_runs.runlog.read_metrics(run_dir)
    assert len(rows) == 4 and rows[-1] == {"step": 2, "wall": 23.3, "eval/accuracy": 0.35625}


# ---- the PNG ----

def check_png(path: Path) -> np.ndarray:
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000
    image = imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 500
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path):
    runs = [dpo_run(tmp_path, "dpo_sync__1__1"), dpo_run(tmp_path, "dpo_async__1__2", dt=0.9)]
    out = plot_runs.plot(runs, ["charts/reward", "eval/accuracy", "charts/episodes_per_second"], "wall",
                         tmp_path / "sub" / "plot.png", labels=["sync", "async"], smooth=3)
    assert out == tmp_path / "sub" / "plot.png"
    one = check_png(out)
    out2 = plot_runs.plot(runs, ["charts/reward"], "samples", tmp_path / "one.png")
    two = check_png(out2)
    assert one.shape[0] > two.shape[0]  # three subplots on two rows vs one subplot


@pytest.mark.slow
def test_plot_metric_in_only_some_runs(tmp_path):
    # charts/ess is logged by pipeline_rl.py only: the DPO run simply has no line in that subplot
    out = plot_runs.plot([dpo_run(tmp_path), pipeline_run(tmp_path)], ["charts/reward", "charts/ess"], "samples",
                         tmp_path / "mix.png")
    check_png(out)


@pytest.mark.slow
def test_plot_rejects_mismatched_labels(tmp_path):
    with pytest.raises(SystemExit, match="2 labels for 1 run directories"):
        plot_runs.plot([dpo_run(tmp_path)], ["charts/reward"], "step", tmp_path / "x.png", labels=["a", "b"])


# ---- the command line ----

def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "plot_runs.py"), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_cli_writes_the_png_and_prints_its_path(tmp_path):
    runs = [str(dpo_run(tmp_path)), str(pipeline_run(tmp_path))]
    out = tmp_path / "cli.png"
    result = cli(*runs, "--x", "samples", "--metrics", "charts/reward", "charts/accuracy", "--smooth", "2",
                 "--labels", "dpo", "pipeline", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    check_png(out)


@pytest.mark.slow
def test_cli_missing_run_dir_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no_such_run__1__1"
    result = cli(str(dpo_run(tmp_path)), str(missing), "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"error: {missing}: no metrics.jsonl (not a run directory?)"]
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_cli_unknown_metric_is_a_one_line_error(tmp_path):
    run_dir = dpo_run(tmp_path)
    result = cli(str(run_dir), "--metrics", "charts/reward", "charts/no_such_metric", "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["error: metric 'charts/no_such_metric' is in none of the runs "
                                                  f"({run_dir.name})"]
    assert not (tmp_path / "x.png").exists()
