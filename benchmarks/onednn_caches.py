"""The learner's resident memory under bf16 autocast on a CPU, with oneDNN's kernel caches at their defaults and as
the learner bounds them (cpu_memory.ONEDNN_CACHE_ENV, set by release_freed_memory after torch is imported, as Run
does): SmolLM2's forward and backward on micro-batches of a new shape each step, as a run's are.

    .venv/bin/python benchmarks/onednn_caches.py                # 24 shapes, arms A B B A: ~5 minutes on 2 cores

Each arm is a fresh process; printed: resident MiB after the first and the last step, its peak, and the seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
ARM = r"""
import json, os, random, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from fastrl import cpu_memory
cpu_memory.release_freed_memory()  # as Run where memory is tight: after torch's import, before the weights load
from transformers import AutoModelForCausalLM
import common
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(common.resolve_model("smollm2"), dtype=torch.float32)
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
random.seed(0)
after, start = [], time.perf_counter()
for _ in range(int(sys.argv[2])):
    rows = random.randint(4, 9)
    ids = torch.randint(0, model.config.vocab_size, (rows, random.randint(40, 512 // rows)))  # <= 512 tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    del logits
    model.zero_grad(set_to_none=False)
    after.append(rss())
print(json.dumps(dict(after=after, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      seconds=time.perf_counter() - start, capacity=os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])))
"""


@dataclass
class Args:
    shapes: int = 24
    """micro-batches, each of a new shape (rows x tokens, <= 512 tokens)"""


def arm(name: str, shapes: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    if name == "defaults":  # oneDNN's and ideep's own capacity, 1,024 each (a value set here is kept by the learner)
        env.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    done = subprocess.run([sys.executable, "-c", ARM, str(ROOT), str(shapes)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    results: dict[str, list] = {"defaults": [], "learner": []}
    for name in ("defaults", "learner", "learner", "defaults"):  # A B B A: this machine drifts in minutes
        r = arm(name, args.shapes)
        results[name].append(r)
        print(f"{name} (capacity {r['capacity']}): {r['after'][0]} -> {r['after'][-1]} MiB after {args.shapes} "
              f"shapes (+{r['after'][-1] - r['after'][0]}), peak {r['peak']} MiB, {r['seconds']:.1f} s", flush=True)
    for name, rs in results.items():
        growth = [r["after"][-1] - r["after"][0] for r in rs]
        print(f"{name}: growth {growth} MiB, peak {[r['peak'] for r in rs]} MiB, seconds "
              f"{[round(r['seconds'], 1) for r in rs]}")
    speed = sum(r["seconds"] for r in results["learner"]) / sum(r["seconds"] for r in results["defaults"])
    print(f"learner's caches / defaults: time {speed:.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))
