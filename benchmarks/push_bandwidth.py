"""Weight-push speed against a plain memory copy (issue 17): a ~54M-parameter tied-embedding Qwen2
(207 MiB fp32, the shape of foundation.py's random model) pushed to the local CPU sampler, through the
engine the sampler uses ("shm", shm_transfer.py) and through gloo over loopback for comparison. Each
push is paired with a copy of the same bytes into a preallocated buffer in this process, the two
alternated (copy, push, push, copy, ...) so that load from other processes hits both alike; medians.

    .venv/bin/python benchmarks/push_bandwidth.py [--repeats 7] [--backends shm gloo]

The last line is `push_vs_memcpy=<memcpy seconds / push seconds>` for the sampler's engine (1.0: a
push as fast as a memory copy). foundation.py can call `push_vs_memcpy(path)`."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

import common  # noqa: E402
from fastrl import launch, util
from fastrl import vllm_sampler  # noqa: E402


def random_54m(directory) -> str:
    """A random ~54M-parameter Qwen2 with tied embeddings and a 32k vocabulary (hidden 512, 12 layers,
    MLP 1536) and the tiny model's tokenizer; foundation.py pushes the same model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True, torch_dtype="float32")
    Qwen2ForCausalLM(config).save_pretrained(directory)
    util.load_tokenizer(str(common.tiny_model_path())).save_pretrained(directory)
    return str(directory)


def measure_push(path: str, backend: str = "shm", repeats: int = 7) -> dict:
    """Median seconds of a full push of the model at `path` to a local CPU sampler through `backend`
    ("shm" or "gloo") and of a copy of the same bytes (every parameter into a preallocated buffer),
    timed in alternated pairs after one warm-up push. Returns the medians, the per-pair times, the
    parameter count and bytes."""
    model = common.load_policy(path, "cpu")
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.empty(nbytes, dtype=torch.uint8)  # preallocated (and touched once below)
    copies, offset = [], 0
    for p in params:
        copies.append(flat[offset: offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape))
        offset += p.numel() * p.element_size()

    def memcpy() -> float:
        start = time.perf_counter()
        for dst, src in zip(copies, params):
            dst.copy_(src)
        return time.perf_counter() - start

    memcpy()
    saved = os.environ.get("FASTRL_CPU_WEIGHT_BACKEND")
    os.environ["FASTRL_CPU_WEIGHT_BACKEND"] = backend  # read by the sampler at start and by init_weight_sync
    try:
        sampler = launch.start_sampler(path, placement="cpu", weights=model)
    finally:
        if saved is None:
            os.environ.pop("FASTRL_CPU_WEIGHT_BACKEND")
        else:
            os.environ["FASTRL_CPU_WEIGHT_BACKEND"] = saved
    pushes, copy_times = [], []
    with sampler:
        sampler.push_weights(1)  # warm-up: first-touch of every buffer
        for i in range(repeats):
            if i % 2 == 0:
                copy_times.append(memcpy())
                pushes.append(sampler.push_weights(2 + i))
            else:
                pushes.append(sampler.push_weights(2 + i))
                copy_times.append(memcpy())
    return dict(backend=backend, params=sum(p.numel() for p in params), bytes=nbytes, push=statistics.median(pushes),
                memcpy=statistics.median(copy_times), pushes=pushes, memcpys=copy_times)


def push_vs_memcpy(path: str | None = None, backend: str | None = None, repeats: int = 7) -> float:
    """memcpy seconds / push seconds (medians of alternated pairs) for the model at `path` (default: a
    random ~54M-parameter model built in a temporary directory) through `backend` (default: the
    local CPU sampler's engine, vllm_sampler.weight_backend("cpu"))."""
    backend = backend or vllm_sampler.weight_backend("cpu")
    if path is None:
        with tempfile.TemporaryDirectory() as tmp:
            result = measure_push(random_54m(tmp), backend, repeats)
    else:
        result = measure_push(path, backend, repeats)
    return result["memcpy"] / result["push"]


@dataclass
class Args:
    repeats: int = 7
    """timed (copy, push) pairs per engine"""
    backends: list[str] = field(default_factory=lambda: ["shm", "gloo"])
    """engines to time; the first is the one `push_vs_memcpy` reports"""
    model: str | None = None
    """model directory (default: a random ~54M-parameter tied-embedding Qwen2, built in a temporary directory)"""


def main() -> None:
    import tyro

    args = tyro.cli(Args)
    started = time.time()
    launch.limit_cpu_threads()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_54m(tmp)
        results = [measure_push(path, backend, args.repeats) for backend in args.backends]
    first = results[0]
    print(f"\nweight push to the local CPU sampler, {first['params'] / 1e6:.1f}M parameters "
          f"({first['bytes'] / 2**20:.0f} MiB), median of {args.repeats} alternated (memory copy, push) pairs\n")
    print("| engine | push | memory copy of the same bytes | push bandwidth | memcpy / push |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['backend']} | {r['push'] * 1e3:.1f} ms | {r['memcpy'] * 1e3:.1f} ms | "
              f"{r['bytes'] / r['push'] / 2**20:.0f} MiB/s | {r['memcpy'] / r['push']:.3f} |")
    for r in results:
        print(f"{r['backend']}: pushes (ms) {' '.join(f'{t * 1e3:.0f}' for t in r['pushes'])}; "
              f"copies (ms) {' '.join(f'{t * 1e3:.1f}' for t in r['memcpys'])}")
    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}\ntook {time.time() - started:.0f} s")
    print(f"push_vs_memcpy={first['memcpy'] / first['push']:.3f}")


if __name__ == "__main__":
    main()
