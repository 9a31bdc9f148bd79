"""What glibc's handling of freed memory costs the CPU learner, in time and in peak memory: RLOO's SmolLM2 round
(8 prompts x 8 responses, prompts of 48 tokens, responses at 64, the preset's micro-batches) for two learner steps
(the second with Adam's moments alive), in a fresh process an arm, arms alternated (A B C C B A ...), 2 threads each.

    .venv/bin/python benchmarks/malloc_modes.py --repeats 2

Arms (how the learner process treats memory it frees):
- threshold: mallopt(M_MMAP_THRESHOLD, 128 KiB): every block above it mapped on its own and unmapped when freed
  (what cpu_memory.release_freed_memory did until this benchmark);
- default: glibc's own (the threshold rises up to 32 MiB; freed blocks stay in its arenas);
- trim: glibc's own, and malloc_trim(0) after each optimizer step (what is free between steps returns)."""

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]

STEP = r"""
import ctypes, ctypes.util, json, resource, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
mode = sys.argv[2]
from fastrl import cpu_memory
import torch
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if mode == "threshold":
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (malloc.h)
import os
os.environ.update(cpu_memory.ONEDNN_CACHE_ENV)
if mode == "trim":
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(lambda *a: libc.malloc_trim(0))
import common, memory
from transformers import AutoConfig
torch.set_num_threads(2)
config = AutoConfig.from_pretrained(common.resolve_model("smollm2"))
start = time.perf_counter()
info = memory.rloo_step(config, model="smollm2", prompts=8, group=8, prompt=48, response=64, steps=2)
seconds = time.perf_counter() - start
print(json.dumps(dict(info, seconds=seconds, peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


@dataclass
class Args:
    repeats: int = 2
    """alternated passes over the arms (A B C, then C B A, ...)"""
    arms: tuple[str, ...] = ("threshold", "default", "trim")
    """the arms (module docstring)"""


def main(args: Args) -> None:
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for r in range(args.repeats):
        for arm in (args.arms if r % 2 == 0 else args.arms[::-1]):
            done = subprocess.run([sys.executable, "-c", STEP, str(ROOT), arm], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-2000:])
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[arm].append(result)
            print(f"{arm}: two steps {result['seconds']:.1f} s, peak {result['peak_mib']:.0f} MiB", flush=True)
    base = statistics.median(r["seconds"] for r in results[args.arms[0]])
    print(f"\n| arm | two learner steps (median, s) | runs | peak resident (MiB) | time / {args.arms[0]} |")
    print("|---|---|---|---|---|")
    for arm, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peaks = ", ".join(f"{r['peak_mib']:.0f}" for r in runs)
        times = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        print(f"| {arm} | {seconds:.1f} | {times} | {peaks} | {seconds / base:.2f}x |")
    print(f"\n{resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} s of children's CPU; {time.ctime()}")


if __name__ == "__main__":
    main(tyro.cli(Args))
