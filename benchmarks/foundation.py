"""Foundation benchmarks (CPU): sampler throughput through our process vs vLLM alone in a process of its own,
weight-push speed for the tiny model and a ~50M-parameter random model against its floor (the same
weights loaded into the same engine from the sampler's own memory: push_vs_floor) and a memory copy.

    .venv/bin/python benchmarks/foundation.py                  # the tiny model; the push on a random 54M model
    .venv/bin/python benchmarks/foundation.py --model smollm2 --num-prompts 32 --max-tokens 32 --repeats 4 --processes 4
        # SmolLM2-135M-Instruct: its arithmetic prompts in its chat template, and the push of its own weights

Everything is measured in one run; ratios are what to compare across machines."""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM alone: its engine in its own process, as in our sampler's
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402
import tyro  # noqa: E402

import common  # noqa: E402
from fastrl import checks, launch, util
import tasks  # noqa: E402
from fastrl import vllm_sampler  # noqa: E402
from push_bandwidth import random_54m  # noqa: E402  (the same random model; the same environment defaults as above)


@dataclass
class Args:
    num_prompts: int = 256
    """prompts per generation call"""
    n: int = 4
    """samples per prompt"""
    max_tokens: int = 48
    """completion length cap (ignore_eos: every completion has exactly this many tokens)"""
    repeats: int = 16
    """timed calls per side and pair of processes, in A B B A order (after one warm-up call each); medians
    reported (consecutive calls on this machine differ by up to 20%: 7 pairs gave medians from 0.90 to 0.99)"""
    processes: int = 1
    """fresh pairs of processes (ours, vLLM alone), one after the other: on SmolLM2 one process ran up to 10%
    faster or slower than the next, the same engine, so its ratio is the median over several pairs"""
    push_repeats: int = 5
    """timed weight pushes per model"""
    model: str = "tiny"
    """tiny (Countdown prompts; the push also on a random 54M model) or smollm2 (arithmetic prompts in the chat
    template, as `--model smollm2` runs; the push of its 135M weights)"""


def sampling(args):
    return dict(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)


def _vllm_alone(conn, settings, prompts, n, sampling_args) -> None:
    """(A spawned process of its own, as our sampler's.) vLLM's `LLM` with `settings`; answers each
    message with the tokens/s of one generate call, until it receives None."""
    from vllm import LLM, SamplingParams

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    llm = LLM(**settings)
    params, requests = SamplingParams(n=n, **sampling_args), [{"prompt_token_ids": p} for p in prompts]
    conn.send("ready")
    while conn.recv() is not None:
        start = time.perf_counter()
        out = llm.generate(requests, params, use_tqdm=False)
        conn.send(sum(len(c.token_ids) for o in out for c in o.outputs) / (time.perf_counter() - start))


def time_throughput(path, prompts, args, max_model_len=None):
    """Our sampler process vs vLLM's `LLM` in a process of its own (exactly our engine's settings,
    the same threads), timed in A B B A order so that drift in the machine's speed hits both sides
    alike; `args.processes` fresh pairs of processes one after the other, since one process's speed
    differs from the next one's by several percent (where its memory lands). Returns the median
    throughputs and the per-pair ratios, pair after pair."""
    import multiprocessing

    ours, direct = [], []
    settings = vllm_sampler.engine_settings(vllm_sampler.SamplerConfig(model=path, placement="cpu",
                                                                       max_model_len=max_model_len,
                                                                      seed=0), "cpu")
    context = multiprocessing.get_context("spawn")
    for _ in range(args.processes):
        conn, child_conn = context.Pipe()
        alone = context.Process(target=_vllm_alone,
                                args=(child_conn, settings, prompts, args.n, sampling(args)), daemon=True)
        alone.start()
        with launch.start_sampler(path, placement="cpu", max_model_len=max_model_len) as sampler:
            assert conn.recv() == "ready"

            def time_ours():
                start = time.perf_counter()
                out = sampler.generate(prompts, n=args.n, **sampling(args))
                return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)

            def time_direct():
                conn.send(True)
                return conn.recv()

            time_ours(), time_direct()  # warm-up both
            for repeat in range(args.repeats):  # A B, then B A: neither side always runs right after the other
                if repeat % 2 == 0:
                    ours.append(time_ours())
                    direct.append(time_direct())
                else:
                    direct.append(time_direct())
                    ours.append(time_ours())
        conn.send(None)
        alone.join(60)
    return statistics.median(ours), statistics.median(direct), [o / d for o, d in zip(ours, direct)]


def time_push(path, args, max_model_len=None):
    """Median seconds of a full push; of its floor, the sampler loading the same weights from its own
    memory the way a push loads them (vLLM's load_weights + the repack for the CPU GEMM, no transfer:
    Sampler.time_local_load); and of a plain memory copy of the same bytes (every parameter into a
    preallocated copy); the three timed in turn, repeat after repeat. Returns (parameters, push s,
    bytes/s, copy s, floor s, per-repeat push/floor ratios)."""
    model = common.load_policy(path, "cpu")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = [torch.empty_like(p) for p in model.parameters()]
    times, copy_times, floor_times = [], [], []
    with launch.start_sampler(path, placement="cpu", max_model_len=max_model_len) as sampler:
        sampler.init_weight_sync(model)
        sampler.push_weights(1)  # warm-up, both
        sampler.time_local_load(path)
        for v in range(2, 2 + args.push_repeats):
            start = time.perf_counter()
            with torch.no_grad():
                for dst, src in zip(copies, model.parameters()):
                    dst.copy_(src)
            copy_times.append(time.perf_counter() - start)
            floor_times.append(sampler.time_local_load(path))
            times.append(sampler.push_weights(v))
    seconds = statistics.median(times)
    return (sum(p.numel() for p in model.parameters()), seconds, size / seconds, statistics.median(copy_times),
            statistics.median(floor_times), [t / f for t, f in zip(times, floor_times)])


def main():
    args = tyro.cli(Args)
    launch.limit_cpu_threads()
    path = str(common.resolve_model(args.model))
    tokenizer = util.load_tokenizer(path)
    if args.model == checks.TINY:
        task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
        prompts = [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(args.num_prompts)]
    else:  # the prompts the scripts send for this model (its default task, in its chat template)
        task = tasks.make_task("arithmetic", seed=0, tiny_prompts=False)
        _, prompts, _ = tasks.encode_prompts(tokenizer, [task.problem("test", i) for i in range(args.num_prompts)],
                                              max_prompt_tokens=1024, chat_template=True)

    context = None if args.model == checks.TINY else 256  # (SmolLM2's own 8,192 would not fit the CPU KV cache)
    ours, direct, ratios = time_throughput(path, prompts, args, context)
    push_tiny = time_push(path, args, context)
    if args.model == checks.TINY:
        with tempfile.TemporaryDirectory() as tmp:
            push_big = time_push(random_54m(tmp), args)
    else:
        push_big = push_tiny

    rows = [
        ("sampler throughput, ours (tok/s)", f"{ours:.0f}"),
        ("sampler throughput, vLLM alone (tok/s)", f"{direct:.0f}"),
        ("ours / vLLM alone (median of per-pair ratios)", f"{statistics.median(ratios):.2f}x (pairs: "
                                                          f"{', '.join(f'{r:.2f}' for r in ratios)})"),
        (f"weight push, {args.model} ({push_tiny[0] / 1e6:.2f}M params)", f"{push_tiny[1] * 1e3:.0f} ms, "
                                                                          f"{push_tiny[2] / 2**20:.0f} MiB/s"),
        *([(f"weight push, random ({push_big[0] / 1e6:.1f}M params)", f"{push_big[1] * 1e3:.0f} ms, "
                                                                      f"{push_big[2] / 2**20:.0f} MiB/s")]
          if push_big is not push_tiny else []),
        ("memory copy of the same bytes", f"{push_big[3] * 1e3:.0f} ms"),
        ("floor: the sampler loading the same weights from its own memory (copy + repack)",
         f"{push_big[4] * 1e3:.0f} ms"),
        ("push / floor, per repeat", ", ".join(f"{r:.2f}" for r in push_big[5])),
    ]
    print(f"\n{args.num_prompts} prompts x {args.n} samples x {args.max_tokens} tokens, A B B A, median of "
          f"{args.repeats} x {args.processes} pairs\n")
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\npush_vs_floor={push_big[1] / push_big[4]:.3f}  (push time / floor time, lower is better; 1 is a push "
          "that costs no more than a load)")
    print(f"push_vs_memcpy={push_big[3] / push_big[1]:.3f}")
    print(f"sampler_vs_vllm={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
