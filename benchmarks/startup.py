"""Start-up: the time from the command to a script's first sampled round, and to the end of a
one-round run, for two checkouts of this repository (say, before and after a start-up change), in
alternated pairs (A B B A ...) on the same cores.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/startup.py --before /tmp/before --after . --pairs 3
    .venv/bin/python benchmarks/startup.py --before . --before-env PYTHONPYCACHEPREFIX=/tmp/empty  # no .pyc

Both run with this checkout's .venv (the tiny model is built once beforehand, so no run pays for it).
"The first sampled round" is the moment the run prints its first training round's line."""

import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    before: str
    """checkout A (a directory holding rloo_kreuse.py)"""
    after: str = str(ROOT)
    """checkout B"""
    pairs: int = 3
    """alternated pairs: A B, then B A, ..."""
    command: list[str] = field(default_factory=lambda: ["rloo_kreuse.py", "--model", "tiny", "--k", "4",
                                                        "--num-rounds", "1",
                                                          "--eval-problems", "8", "--eval-samples", "2"])
    """the script and its flags, run in each checkout"""
    before_env: tuple[str, ...] = ()
    """KEY=VALUE pairs set in checkout A's runs only (PYTHONPYCACHEPREFIX=<an empty directory>: A imports every module
    from source, as a process does where no compiled bytecode was saved)"""


ROUND_LINE = re.compile(r"^round 1/")


def time_run(checkout: str, command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the first round's line, seconds to exit) of one run in `checkout`, `env` added to its environment."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, *command, "--exp-name", "startup"], cwd=checkout,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    first_round = float("nan")
    for line in process.stdout:
        if first_round != first_round and ROUND_LINE.match(line):
            first_round = time.perf_counter() - start
    if process.wait() != 0:
        raise SystemExit(f"error: the run in {checkout} failed (exit {process.returncode})")
    return first_round, time.perf_counter() - start


def main(args: Args) -> None:
    if any("=" not in item for item in args.before_env):
        raise SystemExit(f"error: --before-env: KEY=VALUE pairs, got {list(args.before_env)}")
    subprocess.run([sys.executable, "-c", "import common; common.tiny_model_path()"], cwd=ROOT, check=True)
    times = {"before": [], "after": []}
    for pair in range(args.pairs):
        order = ("before", "after") if pair % 2 == 0 else ("after", "before")
        for arm in order:
            env = dict(item.split("=", 1) for item in args.before_env) if arm == "before" else {}
            first, total = time_run(getattr(args, arm), args.command, env)
            times[arm].append((first, total))
            print(f"pair {pair + 1} {arm}: first round {first:.1f} s, one-round run {total:.1f} s", flush=True)
    med = {arm: [statistics.median(t[i] for t in runs) for i in range(2)] for arm, runs in times.items()}
    print(f"median before: first round {med['before'][0]:.1f} s, run {med['before'][1]:.1f} s; "
          f"after: first round {med['after'][0]:.1f} s, run {med['after'][1]:.1f} s")
    print(f"first_round_speedup={med['before'][0] / med['after'][0]:.2f} "
          f"run_speedup={med['before'][1] / med['after'][1]:.2f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
