"""The papers' claims are about learning speed: each paper's comparison as held-out pass@1 against
training wall-clock, over seeds, and the time until pass@1 first reaches a target every run reaches.

    .venv/bin/python benchmarks/learning_speed.py rloo --target 0.45   # K = 1, 2, 4, 8 (~14 min)
    .venv/bin/python benchmarks/learning_speed.py rloo-overlap         # K = 4 with and without --overlap (~7 min)
    .venv/bin/python benchmarks/learning_speed.py dpo        # sync, async, async with 2 minibatches (~10 min)
    .venv/bin/python benchmarks/learning_speed.py pipeline   # Conventional RL G = 1 and 4, PipelineRL (~10 min)
    .venv/bin/python benchmarks/learning_speed.py ppo        # plain PPO, intra, inter, OPPO (all four scripts'
defaults; ~14 min)
    .venv/bin/python benchmarks/learning_speed.py pipeline --workload long-tail   # answers of widely varying length
(~10 min; ppo: ~14 min)

How it measures:
- Every run keeps its weights every few rounds with the run's wall time (the scripts'
  --snapshot-every), and is stopped (SIGINT) after --seconds of training: every arm gets the same
  training time, and no run has to be sized for the slowest arm. Time 0 of a curve is the run's
  first snapshot (its weights before the first round): start-up is left out.
- After all runs, one sampler evaluates every snapshot (it is pushed the snapshot's weights) on the
  same held-out problems with the runs' own sampling settings: evaluation neither pauses nor slows
  a run, and every arm is judged by one protocol.
- Seeds run one after another, the arms in alternated order (A B C, then C B A: this machine
  drifts 10-30% in minutes).
- Workloads: `default` is each script's tiny default (Countdown with 3 numbers, answers of ~12
  tokens); `long-tail` is `--task countdown-steps` (3-7 numbers, few problems with many, answers
  worked step by step: ~20 tokens for 3 numbers, ~70 for 7, and all of it answer), the workload
  PipelineRL's and OPPO's claims are about (generation waits on the longest answers). (The K
  sweep's regime, rloo_k_sweep.REGIME, is a throughput workload: as a learning one, its rounds of
  2 prompts x 4 without the KL term took held-out pass@1 from 0.19 to 0.07 at K=1 and to 0 at K=4
  in 20 s; docs/results.md.)
- Target: unless --target is given, 75% of the way from the mean pass@1 at time 0 to the lowest
  final pass@1 of any run (its last two snapshots' mean), so that every run reaches it. Time to
  target: where the curve first reaches it, linear between the two snapshots around it.

Prints the time-to-target table (mean and sd over seeds per arm, ratio to the first arm), the
pass@1 reached at the end, the command's own duration, writes docs/learning_speed_<paper>.png
(mean pass@1 against seconds of training, a band of one sd over seeds, up to where the arm's shortest run
ends) and its curves as .json beside it, and last each arm's speed-up
over the best baseline arm (BASELINES: the shortest mean time to target) with a 95% bootstrap interval
over seeds, paired (every arm runs every seed, and a seed's prompts and sampling move both arms' times
alike; the unpaired interval is printed beside it): "faster" only where the interval excludes 1, else
"inconclusive".
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from fastrl import checks, launch, util  # noqa: E402
import tasks  # noqa: E402

# script, flags every arm shares, and per arm: (flags, rounds between snapshots ~ every 4-5 s on 2 cores)
PAPERS = {
    "rloo": ("rloo_kreuse.py", ["--num-rounds", "100000", "--eval-problems", "8", "--eval-samples", "1"], {
        "K=1": (["--k", "1"], 4),
        "K=2": (["--k", "2"], 3),
        "K=4": (["--k", "4"], 2),
        "K=8": (["--k", "8"], 1),
    }),
    # its own command (each run costs ~26 s of start-up besides its 30 s: five arms x 3 seeds do not
    # fit 15 minutes), and the controlled pair: the same K, with and without overlap
    "rloo-overlap": ("rloo_kreuse.py", ["--num-rounds", "100000", "--eval-problems", "8", "--eval-samples", "1"], {
        "K=4": (["--k", "4"], 2),
        "K=4 overlap": (["--k", "4", "--overlap"], 2),
    }),
    "dpo": ("online_dpo_async.py", ["--num-rounds", "100000", "--eval-problems", "8", "--eval-samples", "1"], {
        "sync": (["--sync"], 10),
        "async": ([], 10),
        "async, 2 minibatches": (["--num-minibatches", "2"], 10),
    }),
    "pipeline": ("pipeline_rl.py", ["--num-steps", "100000", "--eval-problems", "8", "--eval-samples", "1"], {
        "Conventional G=1": (["--mode", "conventional", "--steps-per-rl-step", "1"], 16),
        "Conventional G=4": (["--mode", "conventional", "--steps-per-rl-step", "4"], 16),
        "PipelineRL": (["--mode", "pipeline"], 16),
    }),
    "ppo": ("ppo_oppo.py", ["--num-rounds", "100000", "--eval-problems", "8", "--eval-samples", "1"], {
        "plain PPO": (["--no-intra", "--no-inter"], 3),
        "intra": (["--no-inter"], 3),
        "inter": (["--no-intra"], 3),
        "OPPO": ([], 3),
    }),
}
# each comparison's baseline arms: the others are compared with the best of them (the shortest mean time to
# target); every arm runs on the same 2 cores, a synchronous one with its sampler and learner each on every core
# in turn (launch.sampler_threads), so no baseline leaves a core idle
BASELINES = {"rloo": ["K=1"], "rloo-overlap": ["K=4"], "dpo": ["sync"],
             "pipeline": ["Conventional G=1", "Conventional G=4"],
             "ppo": ["plain PPO"]}
WORKLOADS = {
    "default": [],
    # the tiny model's context: 128 = prompt + 80 fits
    "long-tail": ["--task", "countdown-steps", "--max-new-tokens", "80"],
}


@dataclass
class Args:
    paper: tyro.conf.Positional[Literal["rloo", "rloo-overlap", "dpo", "pipeline", "ppo"]]
    """which paper's comparison to run"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds, each running every arm"""
    seconds: float = 30.0
    """seconds of training per run (from its first snapshot)"""
    eval_problems: int = 100
    """held-out problems each snapshot is evaluated on"""
    eval_samples: int = 4
    """samples per problem (pass@1 is their mean accuracy)"""
    target: float | None = None
    """pass@1 target (None: see the module docstring)"""
    workload: Literal["default", "long-tail"] = "default"
    """the scripts' tiny default, or the long-tail one (see above)"""
    arms: tuple[str, ...] | None = None
    """a subset of the paper's arms, by name (None: all)"""
    out: str = "docs"
    """directory of the plot"""


def train(script: str, flags: list[str], seconds: float, seed: int, name: str) -> Path:
    """Run the script until it has trained `seconds` past its first snapshot, then stop it (SIGINT:
    the script closes its sampler). Returns the run directory."""
    exp = "lspeed_" + "".join(c if c.isalnum() else "_" for c in name)
    command = [sys.executable, str(ROOT / script), *flags, "--seed", str(seed), "--exp-name", exp]
    log = open(ROOT / "runs" / f"{exp}__{seed}.log", "w")
    # SIGINT's default disposition in the child: a benchmark started in the background of a shell
    # inherits SIGINT ignored, and the run would then train on until the SIGKILL 30 s later
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run_dir, started = None, None
    deadline = time.monotonic() + 600  # start-up and the first snapshot
    while process.poll() is None:
        time.sleep(0.2)
        if run_dir is None:
            text = Path(log.name).read_text()
            if "run directory: " in text:
                run_dir = ROOT / text.split("run directory: ")[1].split()[0]
        if run_dir is not None and started is None and (run_dir / "snapshots" / "0.pt").exists():
            started = time.monotonic()
        if started is not None and time.monotonic() - started > seconds + 1:
            break
        if started is None and time.monotonic() > deadline:
            break
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log.close()
    if run_dir is None or started is None:
        raise SystemExit(f"error: {name} seed {seed} did not start training; see {log.name}")
    return run_dir


def evaluate_snapshots(run_dirs: list[Path], eval_problems: int, eval_samples: int,
                       seconds: float = float("inf")) -> dict[Path, list[tuple[float, float]]]:
    """(seconds of training, held-out pass@1) of every snapshot of every run within `seconds` of
    training (a run stopped late is cut there: every arm is judged on the same training time), by
    one sampler."""
    settings = [json.loads((d / "args.json").read_text()) for d in run_dirs]
    keys = ("model", "task", "temperature", "top_p", "max_new_tokens", "max_prompt_tokens", "chat_template")
    first = {k: settings[0].get(k) for k in keys}
    if any({k: s.get(k) for k in keys} != first for s in settings):
        raise SystemExit("error: the runs differ in model, task or sampling settings; they cannot share one evaluation")
    model_path = common.resolve_model(first["model"], first["task"])
    tokenizer = util.load_tokenizer(model_path)
    # the held-out split is fixed
    task = tasks.make_task(first["task"], seed=0, tiny_prompts=first["model"] == checks.TINY)
    policy = common.load_policy(model_path, "cpu")
    sampling = dict(temperature=first["temperature"], top_p=first["top_p"], max_tokens=first["max_new_tokens"])
    # the prompt budget where the script has it as a flag; else whatever fits the model's context with the response cap
    max_prompt_tokens = first["max_prompt_tokens"] or policy.config.max_position_embeddings - first["max_new_tokens"]
    curves, version = {}, 0
    with launch.start_sampler(model_path, placement="cpu", seed=0, weights=policy,
                                    max_model_len=max_prompt_tokens + first["max_new_tokens"]) as sampler:
        for run_dir in run_dirs:
            snapshots = sorted((torch.load(p, weights_only=True) for p in (run_dir / "snapshots").glob("*.pt")),
                               key=lambda s: s["step"])
            snapshots = [s for s in snapshots if s["wall"] - snapshots[0]["wall"] <= seconds]
            curve = []
            for snap in snapshots:
                policy.load_state_dict(snap["model"])
                version += 1
                sampler.push_weights(version)
                scores = tasks.evaluate(sampler, task, tokenizer, eval_problems, eval_samples, max_prompt_tokens,
                                         first["chat_template"], **sampling)
                curve.append((snap["wall"] - snapshots[0]["wall"], scores["eval/pass@1"]))
            curves[run_dir] = curve
            print(f"  evaluated {run_dir.name}: {len(curve)} snapshots, "
                  f"pass@1 {curve[0][1]:.3f} -> {curve[-1][1]:.3f}", flush=True)
    return curves


def time_to(curve: list[tuple[float, float]], target: float) -> float:
    """Seconds until the curve first reaches target, linear between snapshots (nan if never)."""
    for (t0, y0), (t1, y1) in zip(curve, curve[1:]):
        if y1 >= target:
            return t0 if y0 >= target else t0 + (t1 - t0) * (target - y0) / (y1 - y0)
    return 0.0 if curve and curve[0][1] >= target else float("nan")


def summarize(times: list[float]) -> tuple[float, float, int]:
    """Mean and sd over the seeds that reached the target (a time of nan: never, within the run's
    training time), and how many did. A given --target may lie above where some runs end."""
    reached = [t for t in times if not math.isnan(t)]
    if not reached:
        return float("nan"), float("nan"), 0
    return float(np.mean(reached)), float(np.std(reached)), len(reached)


def bootstrap_speedup(arm_times: list[float], base_times: list[float], draws: int = 10000, seed: int = 0,
                      paired: bool = False) -> tuple[float, float, float]:
    """Speed-up of an arm over a baseline in time to target, mean(base) / mean(arm), and its 95% interval from a
    bootstrap over seeds: each arm's seeds resampled with replacement, independently, or (paired: the i-th time of
    each comes from the same seed, as here, where every arm runs every seed) the seeds resampled together, so that
    what a seed does to both arms (its prompts' order, its sampling) cancels in the ratio. NaN when a seed of
    either never reached the target or a mean is 0 (no ratio to take)."""
    arm, base = np.asarray(arm_times, float), np.asarray(base_times, float)
    if np.isnan(arm).any() or np.isnan(base).any() or arm.mean() <= 0 or base.mean() <= 0:
        return float("nan"), float("nan"), float("nan")
    if paired and len(arm) != len(base):
        raise ValueError(f"a paired bootstrap needs one time per seed in each arm, got {len(arm)} and {len(base)}")
    rng = np.random.default_rng(seed)
    arm_seeds = rng.integers(0, len(arm), (draws, len(arm)))
    arm_means = arm[arm_seeds].mean(1)
    base_means = base[arm_seeds if paired else rng.integers(0, len(base), (draws, len(base)))].mean(1)
    ratios = base_means / np.maximum(arm_means, 1e-9)
    return float(base.mean() / arm.mean()), float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def verdict(low: float, high: float) -> str:
    """What an interval says: faster or slower only where it excludes 1."""
    if math.isnan(low):
        return "inconclusive (a seed never reached the target)"
    return "faster" if low > 1 else "slower" if high < 1 else "inconclusive (the interval contains 1)"


def plot(by_arm: dict[str, list[list[tuple[float, float]]]], target: float, seconds: float, title: str,
         out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    grid = np.linspace(0, seconds, 61)
    for arm, curves in by_arm.items():
        ys = np.array([np.interp(grid, [t for t, _ in c], [y for _, y in c], right=np.nan) for c in curves])
        kept = ~np.isnan(ys).any(0)  # up to where this arm's shortest run ends: a mean over every seed
        mean, sd = ys[:, kept].mean(0), ys[:, kept].std(0)
        line, = ax.plot(grid[kept], mean, label=f"{arm} ({len(curves)} seeds)")
        ax.fill_between(grid[kept], mean - sd, mean + sd, color=line.get_color(), alpha=0.15)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("held-out pass@1")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main():
    args = tyro.cli(Args)
    script, shared, arms = PAPERS[args.paper]
    if args.arms is not None:
        unknown = [a for a in args.arms if a not in arms]
        checks.check_args(not unknown, "--arms", f"unknown arm(s) {unknown}; this paper's: {list(arms)}")
        arms = {a: arms[a] for a in args.arms}
    checks.check_args(args.seconds > 0 and args.eval_problems >= 1 and args.eval_samples >= 1,
                      "--seconds/--eval-problems/--eval-samples", "must be > 0")
    start = time.perf_counter()
    (ROOT / "runs").mkdir(exist_ok=True)

    runs: dict[str, list[Path]] = {arm: [] for arm in arms}
    for i, seed in enumerate(args.seeds):
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            flags, every = arms[arm]
            print(f"[{time.perf_counter() - start:6.0f}s] {args.paper} {arm} seed {seed}", flush=True)
            workload = WORKLOADS[args.workload]
            if workload and script == "pipeline_rl.py":
                workload = [*workload, "--max-prompt-tokens", "48"]  # (its tiny default of 64 + 80 would not fit)
            runs[arm].append(train(script, [*shared, *workload, *flags, "--snapshot-every", str(every)],
                                   args.seconds, seed, arm))
    print(f"[{time.perf_counter() - start:6.0f}s] evaluating the snapshots", flush=True)
    curves = evaluate_snapshots([d for dirs in runs.values() for d in dirs], args.eval_problems,
                                args.eval_samples, args.seconds)
    by_arm = {arm: [curves[d] for d in dirs] for arm, dirs in runs.items()}

    start_pass = float(np.mean([c[0][1] for cs in by_arm.values() for c in cs]))
    lowest_final = min(np.mean([y for _, y in c[-2:]]) for cs in by_arm.values() for c in cs)
    target = args.target if args.target is not None else start_pass + 0.75 * (lowest_final - start_pass)
    print(f"\n{args.paper}, {args.workload} workload: {len(args.seeds)} seeds x {len(arms)} arms, {args.seconds:.0f} s "
          f"of training each; held-out pass@1 on {args.eval_problems} problems x {args.eval_samples} samples; start "
          f"{start_pass:.3f}, target {target:.3f}"
          + (" (given)" if args.target is not None
             else f" (75% of the way to the lowest final pass@1, {lowest_final:.3f})") + "\n")
    if target <= start_pass + 0.02:  # (~the sd of a pass@1 over 400 samples)
        print("warning: the target is within noise of the start (a run ended near or below where it began): the times "
              "below measure noise; compare the final pass@1, or rerun with --target\n")
    print("| arm | seconds to target, mean | sd | per seed | vs " + list(arms)[0] + " | pass@1 at the end, mean |")
    print("|---|---|---|---|---|---|")
    base = None
    for arm, cs in by_arm.items():
        times = [time_to(c, target) for c in cs]
        mean, sd, reached = summarize(times)
        every_seed = reached == len(times)
        if base is None:
            base = mean if every_seed else float("nan")
        final = np.mean([np.mean([y for _, y in c[-2:]]) for c in cs])
        # a ratio only between arms whose every seed got there (a time of 0: at the target from the start)
        ratio = f"{base / mean:.2f}x" if every_seed and base > 0 and mean > 0 else "n/a"
        shown = (f"{mean:.1f}" if every_seed
                 else (f"{mean:.1f} ({reached} of {len(times)} seeds reached it)" if reached else "not reached"))
        per_seed = " ".join("never" if math.isnan(t) else f"{t:.1f}" for t in times)
        print(f"| {arm} | {shown} | {sd:.1f} | {per_seed} | {ratio} | {final:.3f} |")
    # last: each other arm against the best baseline, with a bootstrap interval over seeds
    times = {arm: [time_to(c, target) for c in cs] for arm, cs in by_arm.items()}
    baselines = [b for b in BASELINES[args.paper] if b in times]
    reached = [b for b in baselines if not any(math.isnan(t) for t in times[b])]
    best = min(reached, key=lambda b: np.mean(times[b])) if reached else None
    lines = []
    for arm in (a for a in times if a not in baselines):
        if best is None:
            lines.append(f"{arm}: inconclusive (no baseline reached the target in every seed)")
            continue
        # paired over seeds (every arm ran every seed); the unpaired interval beside it, for comparison
        ratio, low, high = bootstrap_speedup(times[arm], times[best], paired=True)
        _, low_unpaired, high_unpaired = bootstrap_speedup(times[arm], times[best])
        lines.append(f"{arm} vs {best}: {ratio:.2f}x [95% interval, paired over seeds, {low:.2f}, {high:.2f}; unpaired "
                     f"{low_unpaired:.2f}, {high_unpaired:.2f}]: {verdict(low, high)}"
                     if not math.isnan(ratio) else f"{arm} vs {best}: {verdict(float('nan'), float('nan'))}")
    suffix = "" if args.workload == "default" else "_" + args.workload.replace("-", "_")
    out = plot(by_arm, target, args.seconds, f"{args.paper} ({args.workload}): held-out pass@1, mean and sd over "
                                             f"{len(args.seeds)} seeds",
               Path(args.out) / f"learning_speed_{args.paper}{suffix}.png")
    # the curves themselves, to replot or reanalyse without rerunning: {arm: [per seed: [[seconds, pass@1], ...]]}
    out.with_suffix(".json").write_text(json.dumps({"seeds": list(args.seeds), "target": target, "curves": by_arm}))
    print(f"\nplot: {out} (curves: {out.with_suffix('.json')})\nthis command took {time.perf_counter() - start:.0f} s")
    print(f"\nspeed-up in time to target against the best baseline at equal hardware ({best or 'none reached it'}; "
          f"{len(args.seeds)} seeds, bootstrap):")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
