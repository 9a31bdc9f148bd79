"""What the vLLM-server path (`--sampler-url`, remote_sampler.py) costs against the sampler process
of our own (vllm_sampler.start_sampler), for the same work: rounds of generation (token ids in,
logprobs out; every sample exactly --max-tokens long, ignore_eos, so both arms do the same work)
each followed by a weight push, on the tiny model on this machine. One server and one local
sampler are started once and both stay up (each idle while the other is timed); trials are
alternated A B B A ... so drift in the machine's load hits both arms alike.

    .venv/bin/python benchmarks/server_vs_local.py             # ~2 min on 2 cores

Prints seconds per trial for each arm, the median ratio server / local, the command and how long
the benchmark took. The local arm pushes through shared memory (its default on CPU), the server
through gloo over loopback (what a server needs): each arm as a user gets it."""

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
from fastrl import launch, util
from fastrl import remote_sampler  # noqa: E402
import tasks  # noqa: E402


@dataclass
class Args:
    rounds: int = 6
    """rounds per trial (generate, then push)"""
    prompts: int = 16
    """prompts per round"""
    group_size: int = 4
    """samples per prompt"""
    max_tokens: int = 64
    """new tokens per sample (exactly: ignore_eos)"""
    pairs: int = 2
    """alternated pairs of trials: 2 gives local, server, server, local"""


def trial(sampler, model, prompts, args, version: int) -> tuple[float, float]:
    """`rounds` rounds of: generate the round, then push changed weights (a synchronous RL round).
    Returns (total seconds, of which pushing)."""
    start, pushing = time.perf_counter(), 0.0
    for r in range(args.rounds):
        out = sampler.generate(prompts, n=args.group_size, temperature=0.8, top_p=0.95, max_tokens=args.max_tokens,
                               ignore_eos=True)
        assert sum(len(c.token_ids) for c in out) == len(prompts) * args.group_size * args.max_tokens
        with torch.no_grad():
            next(model.parameters()).add_(1e-4)  # the weights change every round, as in training
        pushing += sampler.push_weights(version + r + 1)
    return time.perf_counter() - start, pushing


def main():
    args = tyro.cli(Args)
    began = time.time()
    torch.set_num_threads(1)
    path = str(common.tiny_model_path())
    tokenizer = util.load_tokenizer(path)
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    prompts = [tokenizer(task.problem("train", i).prompt)["input_ids"] for i in range(args.prompts)]
    model = common.load_policy(path, "cpu")
    from vllm.utils.network_utils import get_open_port

    port = get_open_port()
    server = remote_sampler.start_server(path, port, max_model_len=128, seed=0)  # prints its command line
    url = f"http://127.0.0.1:{port}"
    local = remote = None
    try:
        remote_sampler.wait_ready(url, process=server)
        local = launch.start_sampler(path, placement="cpu", seed=0, max_model_len=128, weights=model)
        remote = launch.start_sampler(path, urls=[url], weights=model)
        arms = {"local": local, "server": remote}
        times: dict[str, list[float]] = {"local": [], "server": []}
        pushes: dict[str, list[float]] = {"local": [], "server": []}
        version = 0
        for name, sampler in arms.items():  # warm-up, untimed
            trial(sampler, model, prompts, args, version)
            version += args.rounds
        for pair in range(args.pairs):
            order = ["local", "server"] if pair % 2 == 0 else ["server", "local"]
            for name in order:
                total, pushing = trial(arms[name], model, prompts, args, version)
                times[name].append(total)
                pushes[name].append(pushing / args.rounds)
                version += args.rounds
    finally:
        for sampler in (local, remote):
            if sampler is not None:
                sampler.close()
        remote_sampler.stop_server(server)
    median = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.rounds * args.prompts * args.group_size * args.max_tokens
    print(f"\n{args.rounds} rounds of {args.prompts} prompts x {args.group_size} samples x {args.max_tokens} tokens "
          f"({tokens} tokens), each followed by a push; {args.pairs} alternated pairs (A B B A ...)\n")
    print("| arm | seconds per trial (median) | trials | tokens/s (median) | seconds per push (median) "
          "|\n|---|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {median[name]:.2f} | {', '.join(f'{v:.2f}' for v in values)} | {tokens / median[name]:.0f} "
              f"| {statistics.median(pushes[name]):.3f} |")
    print(f"\nserver_vs_local={median['server'] / median['local']:.2f} (seconds per trial, server / local)")
    print(f"command: .venv/bin/python benchmarks/server_vs_local.py --rounds {args.rounds} --prompts {args.prompts} "
          f"--group-size {args.group_size} --max-tokens {args.max_tokens} --pairs {args.pairs}; took "
          f"{time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
