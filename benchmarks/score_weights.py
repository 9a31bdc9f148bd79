"""A run's final weights scored through the sampler casts a bf16 run can give them (issue 58's evaluation): this
separates what training lost from what a bf16 sampler's copy hides at the end. For each run directory, its saved
policy (<run>/model, the learner's weights) is scored by the run's own end-of-run evaluation (its task, held-out
problems, samples, temperature, top-p and response length from <run>/args.json) through one fp32 sampler, holding in
turn:
- "fp32": the learner's weights exactly;
- "nearest": their bf16 round to nearest (what a bf16 sampler loading the checkpoint holds; the arithmetic fp32);
- "stochastic": their stochastic bf16 rounding, drawn as a push at the run's last version draws it (weight_sync.PushCast
  seeded by --seed and the version): the kind of copy a `--push-rounding stochastic` run's end evaluation scored.
With --bf16-sampler, also a bf16 sampler loading the checkpoint (round to nearest and bf16 arithmetic; emulated and
~3.5x slower on a CPU without native bf16). Every cast samples from the same generator state (common random numbers),
so the casts differ by their weights alone.

    .venv/bin/python benchmarks/score_weights.py runs/<run1> runs/<run2> ...
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tasks  # noqa: E402
from fastrl import launch, runlog, weight_sync  # noqa: E402

CASTS = ("fp32", "nearest", "stochastic")


@dataclasses.dataclass
class Args:
    runs: tyro.conf.Positional[list[str]]
    """run directories (each with model/ and args.json)"""
    casts: tuple[str, ...] = CASTS
    """the weights' casts scored through an fp32 sampler"""
    bf16_sampler: bool = False
    """also score through a bf16 sampler that loads the checkpoint (vLLM's round to nearest, bf16 arithmetic)"""
    threads: int = 2
    """the sampler's CPU threads"""
    out: str | None = None
    """append each run's scores to this JSON-lines file"""


def cast_weights(model: torch.nn.Module, cast: str, seed: int, version: int) -> dict[str, torch.Tensor]:
    """The model's floating-point weights in fp32 after `cast` (CASTS), as a push to an fp32 sampler with
    `--push-round-to bfloat16 --push-rounding <cast>` at `version` sends them."""
    if cast == "fp32":
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    pushed = weight_sync.PushCast(torch.float32, cast, seed=seed, round_to=torch.bfloat16)
    pushed.begin(version)
    return {n: pushed(n, p.detach().float()) for n, p in model.named_parameters()}


def end_eval(run_dir: Path) -> dict:
    """The run's own end-of-run evaluation row (eval/pass@k), the last in its metrics."""
    rows = [r for r in runlog.read_metrics(run_dir) if "eval/pass@1" in r]
    return {k: v for k, v in rows[-1].items() if k.startswith("eval/pass@")} if rows else {}


def score(run_dir: Path, args: Args) -> dict:
    from transformers import AutoModelForCausalLM

    saved = SimpleNamespace(**json.loads((run_dir / "args.json").read_text()))
    model_dir = str(run_dir / "model")
    version = torch.load(run_dir / "checkpoint.pt", weights_only=False, map_location="cpu")["step"]
    tokenizer, task, _ = tasks.load(saved, model_dir)
    greedy = getattr(saved, "eval_decoding", "sample") == "greedy"
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    result = dict(run=run_dir.name, step=version, run_end=end_eval(run_dir))
    samplers = [("float32", args.casts)] + ([("bfloat16", ("checkpoint",))] if args.bf16_sampler else [])
    for dtype, casts in samplers:
        sampler = launch.start_sampler(model_dir, seed=saved.seed, dtype=dtype, threads=args.threads,
                                       max_model_len=saved.max_prompt_tokens + saved.max_new_tokens)
        try:
            if dtype == "float32":  # pushes into it are exact: each cast arrives as computed here
                launch.connect_weights(sampler, policy)
            evaluate = tasks.evaluator(sampler, task, tokenizer, saved, greedy=greedy)
            rng = sampler.rng_state()
            for i, cast in enumerate(casts):
                if cast != "checkpoint":
                    with torch.no_grad():
                        values = cast_weights(policy, cast, saved.seed, version)
                        differ = sum((values[n] != p.detach()).sum().item() for n, p in policy.named_parameters())
                        original = {n: p.detach().clone() for n, p in policy.named_parameters()}
                        for n, p in policy.named_parameters():
                            p.copy_(values[n])
                        sampler.push_weights(i + 1)
                        for n, p in policy.named_parameters():
                            p.copy_(original[n])
                    result[f"{cast}/differs_from_fp32"] = differ / sum(p.numel() for p in policy.parameters())
                sampler.set_rng_state(rng)
                start = time.perf_counter()
                scores = evaluate()
                name = cast if dtype == "float32" else "bf16_sampler"
                result[name] = {k: v for k, v in scores.items() if k.startswith("eval/pass@")}
                print(f"{run_dir.name} {name}: {result[name]} ({time.perf_counter() - start:.0f} s)", flush=True)
        finally:
            sampler.close()
    return result


def main() -> None:
    args = tyro.cli(Args)
    unknown = [c for c in args.casts if c not in CASTS]
    if unknown:
        raise SystemExit(f"error: --casts {unknown[0]}: expected one of {CASTS}")
    missing = [r for r in args.runs if not (Path(r) / "model").is_dir() or not (Path(r) / "args.json").exists()]
    if missing:
        raise SystemExit(f"error: {missing[0]}: not a run directory with model/ and args.json")
    launch.limit_cpu_threads()
    for run in args.runs:
        result = score(Path(run), args)
        print(json.dumps(result))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
