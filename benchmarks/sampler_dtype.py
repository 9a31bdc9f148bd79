"""How fast the sampler generates in each precision on this machine (issue 58: an fp16 sampler is a remedy only where
the hardware computes fp16; this CPU has no AVX512-FP16). One sampler process per dtype, all started first, then
rounds of the same requests (SmolLM2-135M-Instruct: 16 prompts of ~48 tokens, 32 new tokens, temperature 0.8,
top-p 0.95; emulated fp16 and bf16 are slow here, so the round is small) alternated A B C C B A, so the ratios come
from one run. Only one sampler generates at a time; each has every core.

    .venv/bin/python benchmarks/sampler_dtype.py                       # float32, float16, bfloat16; 2 rounds each
    .venv/bin/python benchmarks/sampler_dtype.py --dtypes float32 float16 --rounds 2
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl import launch, util  # noqa: E402
from fastrl.smollm2 import smollm2_path  # noqa: E402


@dataclasses.dataclass
class Args:
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    """the sampler precisions to compare (vLLM's dtype)"""
    rounds: int = 2
    """timed rounds of each (in A B C C B A order), after one warm-up round each"""
    prompts: int = 16
    """prompts a round (one sample each)"""
    max_tokens: int = 32
    """new tokens a sample (ignore_eos: every sample this long)"""


def main() -> None:
    args = tyro.cli(Args)
    path = str(smollm2_path())
    prompts = [[1, 504, 3458, 282] * 12 for _ in range(args.prompts)]  # ~48 tokens each
    sampling = dict(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, ignore_eos=True)
    threads = len(os.sched_getaffinity(0))
    samplers = {}
    try:
        for dtype in args.dtypes:
            print(f"starting the {dtype} sampler ...", flush=True)
            samplers[dtype] = launch.start_sampler(path, placement="cpu", seed=1, dtype=dtype, threads=threads,
                                                   max_model_len=256)
            samplers[dtype].generate(prompts, **sampling)  # warm-up
        seconds: dict[str, list[float]] = {dtype: [] for dtype in args.dtypes}
        order = list(args.dtypes)
        for repeat in range(args.rounds):
            for dtype in (order if repeat % 2 == 0 else order[::-1]):
                start = time.perf_counter()
                done = samplers[dtype].generate(prompts, **sampling)
                seconds[dtype].append(time.perf_counter() - start)
                print(f"round {repeat + 1} {dtype}: {seconds[dtype][-1]:.2f} s", flush=True)
                assert sum(len(c.token_ids) for c in done) == args.prompts * args.max_tokens
    finally:
        for sampler in samplers.values():
            sampler.close()
    base = statistics.median(seconds[args.dtypes[0]])
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "CPU")
    print(f"\n{cpu} (native bf16: {util.cpu_bf16()}, avx512_fp16: {'avx512_fp16' in flags}), {threads} threads; "
          f"{args.prompts} x {args.max_tokens} tokens a round, {args.rounds} rounds each (A B C C B A)")
    print(f"| sampler dtype | median s a round | tokens/s | x {args.dtypes[0]}'s time |\n|---|---|---|---|")
    for dtype in args.dtypes:
        median = statistics.median(seconds[dtype])
        print(f"| {dtype} | {median:.2f} | {args.prompts * args.max_tokens / median:.0f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
