"""How much do two busy processes slow each other down on this machine? The same single-thread
work (forward + backward of the tiny model on a 64 x 40 batch, 30 times) timed alone and as two
processes at once. With two independent cores the ratio is ~1.0; every pipelined method here
(async DPO, PipelineRL, RLOO --overlap) runs a learner and a sampler at once and pays it.

    .venv/bin/python benchmarks/cpu_contention.py"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = f"""
import os, sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
torch.set_num_threads(1)
import common
from fastrl import tiny_model
model = common.load_policy(str(common.tiny_model_path()), "cpu")
ids = torch.randint(4, 90, (64, 40))
for _ in range(3):
    model(ids).logits.mean().backward()
start = time.perf_counter()
for _ in range(30):
    model(ids).logits.mean().backward()
print(time.perf_counter() - start)
"""


def timed(copies: int) -> list[float]:
    procs = [subprocess.Popen([sys.executable, "-c", WORK], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(copies)]
    return [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


if __name__ == "__main__":
    alone = timed(1)[0]
    together = timed(2)
    again = timed(1)[0]
    base = (alone + again) / 2
    print(f"alone: {alone:.2f}s and {again:.2f}s; two at once: {together[0]:.2f}s and {together[1]:.2f}s "
          f"-> each {sum(together) / 2 / base:.2f}x slower when both cores are busy")
