"""What the vLLM-server path (`--sampler-url`, remote_sampler.py) costs against the sampler process
of our own, for the same work: rounds of generation (token ids in, logprobs out) each followed by
a weight push, on the tiny model on this machine. Arms alternated A B B A ...; one server and one
local sampler are started once and both stay up (each idle while the other is timed).

    .venv/bin/python benchmarks/server_vs_local.py             # ~2 min on 2 cores

Prints seconds per round for each arm (median), the ratio server / local, and how long it took."""

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import tyro  # noqa: E402

import common  # noqa: E402
import remote_sampler  # noqa: E402
import tasks  # noqa: E402
import tiny_model  # noqa: E402
import vllm_sampler  # noqa: E402


@dataclass
class Args:
    rounds: int = 4
    """rounds per timed trial (generate, then push)"""
    prompts: int = 32
    """prompts per round"""
    group_size: int = 8
    """samples per prompt"""
    max_tokens: int = 32
    """completion length cap (the tiny model's default)"""
    pairs: int = 3
    """alternated pairs of trials (A B B A ...)"""


def trial(sampler, model, prompts, args, version: int) -> float:
    """Seconds per round: generate the round, then push new weights (as a synchronous RL round)."""
    start = time.perf_counter()
    for r in range(args.rounds):
        sampler.generate(prompts, n=args.group_size, temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
        sampler.push_weights(version + r + 1)
    return (time.perf_counter() - start) / args.rounds


def main():
    args = tyro.cli(Args)
    began = time.time()
    torch.set_num_threads(1)
    path = str(tiny_model.tiny_model_path())
    tokenizer = common.load_tokenizer(path)
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    prompts = [tokenizer(task.problem("train", i).prompt)["input_ids"] for i in range(args.prompts)]
    model = common.load_policy(path, "cpu")
    from vllm.utils.network_utils import get_open_port

    port = get_open_port()
    server = remote_sampler.start_server(path, port, max_model_len=128, seed=0)
    url = f"http://127.0.0.1:{port}"
    try:
        remote_sampler.wait_ready(url, process=server)
        local = vllm_sampler.start_sampler(path, placement="cpu", seed=0, max_model_len=128, weights=model)
        remote = vllm_sampler.start_sampler(path, urls=[url], weights=model)
        arms = {"local": local, "server": remote}
        times: dict[str, list[float]] = {"local": [], "server": []}
        for name, sampler in arms.items():  # warm-up
            trial(sampler, model, prompts, args, 0)
        version = 100
        for pair in range(args.pairs):
            order = ["local", "server"] if pair % 2 == 0 else ["server", "local"]
            for name in order:
                times[name].append(trial(arms[name], model, prompts, args, version))
                version += args.rounds
        local.close()
        remote.close()
    finally:
        server.terminate()
        server.wait(30)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{args.rounds} rounds of {args.prompts} prompts x {args.group_size} samples x <= {args.max_tokens} tokens, "
          f"then a push; {args.pairs} alternated pairs\n")
    print("| arm | seconds per round (median) | trials |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {median[name]:.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    print(f"\nserver_vs_local={median['server'] / median['local']:.2f} (seconds per round, server / local)")
    print(f"command: .venv/bin/python benchmarks/server_vs_local.py --rounds {args.rounds} --prompts {args.prompts} "
          f"--group-size {args.group_size} --pairs {args.pairs}; took {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
