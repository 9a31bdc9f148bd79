"""What a push's rounding costs on the learner (issue 58): SmolLM2-135M's fp32 weights cast to bf16 the way a push casts
them (weight_sync.PushCast, every tensor in the order the engine sends them), by round to nearest (what vLLM's loaders
and `Tensor.to` do), stochastic rounding and error feedback, each with the UpdateProbe that measures every push
(charts/push_*), and round to nearest without it. Arms alternate A B B A within one process (the machine drifts),
so the ratios are taken in one run; the bytes each sends are counted.

    .venv/bin/python benchmarks/push_precision.py             # 8 repetitions of each arm
    .venv/bin/python benchmarks/push_precision.py --repeats 4

    .venv/bin/python benchmarks/push_precision.py --through-sampler --repeats 4
        # whole pushes into a bf16 sampler holding SmolLM2 (cast, transfer, the sampler's load): round to nearest
        # with a cast copy and no probe (the push before issue 58), the same with the probe, round to nearest and
        # stochastic rounding cast into the transfer buffer, in blocks on one sampler: what the remedy costs a push

A push's time beside these: `time/push_seconds` in a run's metrics (the transfer and the sampler's load)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl import launch, util, weight_sync  # noqa: E402
from fastrl.smollm2 import smollm2_path  # noqa: E402


@dataclasses.dataclass
class Args:
    repeats: int = 8
    """repetitions of each arm (in A B B A order)"""
    threads: int = 2
    """torch threads (the learner's on this machine)"""
    through_sampler: bool = False
    """time whole pushes into a bf16 sampler (SamplerClient.push_weights) instead of the cast alone"""
    block_pushes: int = 3
    """with --through-sampler: the pushes timed in each block of one arm (after one not counted)"""


def main() -> None:
    args = tyro.cli(Args)
    torch.set_num_threads(args.threads)
    launch.limit_cpu_threads()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    probe = weight_sync.UpdateProbe(model)
    with torch.no_grad():  # a learner a few steps in: most weights off their bf16 start by ~1e-5
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-5)
    if args.through_sampler:
        return time_whole_pushes(model, probe, args)
    arms = {"nearest, no probe": weight_sync.PushCast(torch.bfloat16, "nearest"),
            "nearest": weight_sync.PushCast(torch.bfloat16, "nearest", probe=probe),
            "stochastic": weight_sync.PushCast(torch.bfloat16, "stochastic", seed=1, probe=probe),
            "error-feedback": weight_sync.PushCast(torch.bfloat16, "error-feedback", probe=probe)}
    sent_bytes: dict[str, int] = {}

    def cast_all(name: str, version: int) -> None:
        arms[name].begin(version)
        sent_bytes[name] = sum(arms[name](n, p).nbytes for n, p in model.named_parameters())
        arms[name].end()

    seconds = timed_abba(list(arms), args.repeats, cast_all)
    base = statistics.median(seconds["nearest, no probe"])
    print(f"# push_precision: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{args.repeats} repetitions, {util.machine_line()}")
    print("| arm | median s | min s | x nearest without probe | MiB sent |")
    print("|---|---|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | "
              f"{statistics.median(values) / base:.2f} | {sent_bytes[name] / 2**20:.0f} |")


def timed_abba(names: list[str], repeats: int, run_one) -> dict[str, list[float]]:
    """Each name's seconds over `repeats` calls of run_one(name, version), the order reversed every other repetition
    (A B B A: this machine drifts); versions count from 1."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            run_one(name, repeat + 1)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def time_whole_pushes(model: torch.nn.Module, probe: weight_sync.UpdateProbe, args: Args) -> None:
    """Whole pushes (the cast with its probe, the transfer, the sampler's load) into one bf16 sampler holding SmolLM2,
    as `--sampler-dtype bfloat16` runs push: round to nearest as pushes were before issue 58 (a cast copy, then a
    copy into the transfer buffer, no probe) and before cast_into (the same with the probe), round to nearest and
    stochastic rounding cast into the buffer, on the same sampler (the engine's PushCast switched) in blocks of
    --block-pushes, the blocks' order A B C D D C B A, so the ratios are taken in one process; a block's first push
    is not counted."""
    with launch.start_sampler(str(smollm2_path()), placement="cpu", max_model_len=256, dtype="bfloat16",
                              threads=args.threads) as sampler:
        launch.connect_weights(sampler, model, rounding="stochastic", seed=1, probe=probe)
        sampler.push_weights(1)  # warm-up: the transfer's buffers
        versions = itertools.count(2)
        source = sampler._weight_engine.source  # (weight_sync's CastSource: the shm transfer calls its cast_into)

        def push(arm: str) -> float:
            sampler._cast.rounding = arm.split(",")[0]  # (the engine's PushCast: what init_weight_sync built)
            if "cast copy" in arm:  # as pushes were before cast_into: a cast copy, then copied into the buffer
                source.cast_into = None
            sampler._cast.probe = None if arm.endswith("no probe") else probe  # (before issue 58: no probe)
            try:
                start = time.perf_counter()
                sampler.push_weights(next(versions))
                return time.perf_counter() - start
            finally:
                vars(source).pop("cast_into", None)
                sampler._cast.probe = probe

        def block(arm: str, repeat: int) -> None:
            push(arm)  # (the first after a switch)
            seconds[arm] += [push(arm) for _ in range(args.block_pushes)]

        arms = ["nearest, cast copy, no probe", "nearest, cast copy", "nearest", "stochastic"]
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        timed_abba(arms, args.repeats, block)
    base = statistics.median(seconds["nearest, cast copy, no probe"])
    print(f"# push_precision --through-sampler: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
          f"into a bf16 sampler, {args.repeats} blocks of {args.block_pushes} pushes a arm, A B C D D C B A, "
          f"{util.machine_line()}")
    print("| push rounding | median s | min s | max s | x the push before issue 58 |")
    print("|---|---|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | "
              f"{statistics.median(values) / base:.3f} |")

if __name__ == "__main__":
    main()
