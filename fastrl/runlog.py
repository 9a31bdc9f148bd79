"""Run logging and checkpoints: the run's directory and name (run_name), RunLogger (console.log, args.json,
metrics.jsonl, TensorBoard, wandb; the end-of-run report), read_metrics, and checkpoints that --resume
loads (save_checkpoint, load_checkpoint, save_hf_model). Never imports common, tasks or a script."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastrl import distributed
from fastrl.checks import changed_flags, run_dir_of
from fastrl.util import _Tee, machine_line, replace_atomically


def run_name(exp_name: str, seed: int, resume: str | None = None) -> str:
    """runs/<exp_name>__<seed>__<unix time> (RunLogger adds -1, -2, ... if that exists already); a
    resumed run keeps the directory it resumes from, after checking its checkpoint (so that a bad
    --resume is one line, before anything starts or any directory is made)."""
    if resume:
        checkpoint_state(resume)
        return run_dir_of(resume).name
    return f"{exp_name}__{seed}__{int(time.time())}"


class RunLogger:
    """runs/<run_name>/: console.log (a copy of stdout), args.json, metrics.jsonl (every logged
    metric), TensorBoard event files, and wandb when `track`."""

    def __init__(self, run_name: str, args: Any, track: bool = False, wandb_project: str = "fast-rl-llm",
                 root: str = "runs"):
        if getattr(args, "resume", None):  # the run goes on in its own directory, wherever that is
            self.dir = run_dir_of(args.resume)
            self.dir.mkdir(parents=True, exist_ok=True)
        else:  # a new run gets a directory of its own, even when another run starts in the same second
            Path(root).mkdir(parents=True, exist_ok=True)
            for attempt in range(10_000):
                self.dir = Path(root) / (run_name if attempt == 0 else f"{run_name}-{attempt}")
                with contextlib.suppress(FileExistsError):
                    self.dir.mkdir()  # atomic: exactly one process creates it
                    break
        self.args = args
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        (self.dir / "args.json").write_text(json.dumps(config, indent=1, default=str))
        self._console = open(self.dir / "console.log", "a")
        self._stdout = sys.stdout
        sys.stdout = _Tee(self._stdout, self._console)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")
        self.start = time.time()
        if track:  # before the writer: wandb mirrors TensorBoard's scalars (sync_tensorboard)
            import wandb

            id_file = self.dir / "wandb_id"  # a resumed run continues its W&B run
            run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
            id_file.write_text(run_id)
            wandb.init(project=wandb_project, name=self.dir.name, id=run_id, resume="allow", config=config,
                       dir=str(self.dir),
                       sync_tensorboard=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir))
            self.writer.add_text("hyperparameters",
                                 "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
        except ImportError:
            self.writer = None
        self.track = track
        self.last: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
        self.last.update(metrics)  # the latest value of each metric, for the report
        clean = {k: (float(v) if isinstance(v, (int, float, np.floating, np.integer)) or torch.is_tensor(v) else v)
                 for k, v in metrics.items()}
        record = {"step": step, "wall": round(time.time() - self.start, 3), **clean}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.writer is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if echo:
            shown = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in clean.items() if isinstance(v, float))
            print(f"[{record['wall']:7.1f}s] step {step}: {shown}")

    def position(self) -> dict:
        """Where the log stands, for a checkpoint: the seconds the run has run and metrics.jsonl's length in bytes."""
        self._jsonl.flush()
        return dict(wall=time.time() - self.start, log_bytes=(self.dir / "metrics.jsonl").stat().st_size)

    def resume_at(self, step: int, wall: float, log_bytes: int | None = None) -> None:
        """A resumed run's log goes on from its checkpoint (position()'s): the wall clock from the `wall` seconds it
        had run, and metrics.jsonl as it was then (its first `log_bytes` bytes; from a checkpoint without them, the
        rows up to its `step`). What a run logged after it (it went on, then stopped) moves to metrics.replaced.jsonl,
        and the resumed run logs those steps anew. (TensorBoard and W&B keep theirs: they show a step's latest.)"""
        self.start = time.time() - wall
        self._jsonl.close()
        path = self.dir / "metrics.jsonl"
        data, cut = path.read_bytes(), log_bytes
        if cut is None:  # the rows up to the first logged past `step`, or one that does not read as a row
            cut = 0
            for line in data.splitlines(keepends=True):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    if json.loads(line)["step"] <= step:
                        cut += len(line)
                        continue
                break
        if rows := data[cut:].count(b"\n"):
            with open(self.dir / "metrics.replaced.jsonl", "ab") as f:
                f.write(data[cut:])
            print(f"metrics.jsonl: {rows} rows logged after the checkpoint moved to metrics.replaced.jsonl")
        replace_atomically(lambda tmp: Path(tmp).write_bytes(data[:cut]), path)
        self._jsonl = open(path, "a")

    def report(self, step: int, title: str, row: dict[str, Any], eval_start: dict, eval_end: dict, memory: dict,
               scored: str = "", saved: str = "") -> str:
        """The end-of-run report, the same shape in every script: this run's line of its paper's
        table (`row`: column -> value), held-out pass@k at the start and the end (`scored`: which weights the end's
        sampled, e.g. a bf16 sampler's copy), peak memory, the machine and `saved` (what a bf16 server keeps of model/).
        Printed, written to <run>/summary.md, and the gain and memory logged as metrics."""
        cell = lambda v: (v if isinstance(v, str) else f"{v:.0f}" if abs(v) >= 100  # noqa: E731
                          else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}")
        keys = sorted((k for k in eval_end if "@" in k), key=lambda k: int(k.split("@")[1]))
        measured = (f": {eval_end['eval/problems']:.0f} problems x {eval_end['eval/samples']:.0f} samples each, "
                    f"{', '.join(k.split('/')[1] for k in keys)} (unbiased, Chen et al. 2021)"
                    if "eval/samples" in eval_end else "") + (f"; the end scored {scored}" if scored else "")
        command = changed_flags(self.args) if dataclasses.is_dataclass(self.args) else ""
        lines = [f"## {title}" + (f" | {command}" if command else ""), "", "| " + " | ".join(row) + " |",
                 "|" + "---|" * len(row),
                 "| " + " | ".join(cell(v) for v in row.values()) + " |",
                 "", "held-out" + measured, "", "| model | " + " | ".join(k.split("/")[1] for k in keys) + " |",
                 "|---|" + "---|" * len(keys),
                 "| start | " + " | ".join(f"{eval_start[k]:.3f}" for k in keys) + " |",
                 "| end | " + " | ".join(f"{eval_end[k]:.3f}" for k in keys) + " |",
                 "", "peak memory: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items()),
                 f"machine: {machine_line()}",  # beside every time the run reports
                 *([f"saved: {saved}"] if saved else []),
                 "", *what_happened(eval_start, eval_end, self.last.get("charts/kl"))]
        text = "\n".join(lines) + "\n"
        print("\n" + text, end="")
        (self.dir / "summary.md").write_text(text)
        self.log(step, {"eval/pass@1_gain": eval_end["eval/pass@1"] - eval_start["eval/pass@1"],
                        **{f"memory/{name}_peak_mib": mib for name, mib in memory.items()}}, echo=False)
        return text

    def snapshot(self, step: int, model: torch.nn.Module) -> None:
        """<run>/snapshots/<step>.pt: the weights and the run's wall time at this step (--snapshot-every),
        for benchmarks/learning_speed.py to evaluate after the run, so that no evaluation pauses it."""
        (self.dir / "snapshots").mkdir(exist_ok=True)
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        snapshot = {"step": step, "wall": time.time() - self.start, "model": state}
        replace_atomically(lambda tmp: torch.save(snapshot, tmp), self.dir / "snapshots" / f"{step}.pt")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.track:
            import wandb

            wandb.finish()
        self._jsonl.close()
        sys.stdout = self._stdout
        self._console.close()


def what_happened(eval_start: dict, eval_end: dict, kl: float | None) -> list[str]:
    """Two lines for a reader of the end-of-run report: did held-out pass@1 move beyond the evaluation's
    noise (two binomial standard errors over its problems), and what the largest k's pass@k and the KL
    to the reference say (pass@k for large k falling while pass@1 rises: the policy sharpened onto
    answers it could already find, as RL does, and paid that KL for it)."""
    p0, p1, n = eval_start.get("eval/pass@1"), eval_end.get("eval/pass@1"), eval_end.get("eval/problems")
    if p0 is None or p1 is None:
        return []
    noise = 2 * math.sqrt(max(p0 * (1 - p0), 1e-4) / n) if n else 0.0
    moved = "within the evaluation's noise" if abs(p1 - p0) <= noise else ("up" if p1 > p0 else "down")
    first = f"what happened: held-out pass@1 {p0:.3f} -> {p1:.3f}, {moved}" + (
        f" (+-{noise:.3f} is two standard errors over {n:.0f} problems)" if n else "")
    ks = sorted((k for k in eval_end if "@" in k), key=lambda k: int(k.split("@")[1]))
    top = ks[-1] if ks else None
    kl_text = f"; KL to the reference {kl:.3f} nats" if kl is not None and math.isfinite(kl) else ""
    if top is None or top == "eval/pass@1":
        return [first, f"(one sample per problem: pass@1 only; --eval-samples n gives pass@k up to k = n){kl_text}"]
    q0, q1 = eval_start[top], eval_end[top]
    if q1 < q0 - 1e-9 and p1 >= p0:
        second = (f"{top.split('/')[1]} {q0:.3f} -> {q1:.3f}: the policy sharpened (it puts more mass on answers it "
                  f"already found, fewer distinct tries succeed), as RL does{kl_text}")
    else:
        second = f"{top.split('/')[1]} {q0:.3f} -> {q1:.3f}{kl_text}"
    return [first, second]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl, as RunLogger wrote them. A partly written last line (a
    run still logging) is ignored; any other bad line is an error naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {run_dir}: no metrics.jsonl (not a run directory?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i + 1 < len(lines):
                raise SystemExit(f"error: {path}: line {i + 1} is not JSON") from None
    return rows


CHECKPOINT_KEYS = ("model", "optimizer", "step", "data_position", "rng")


def save_checkpoint(path: str | Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_position: int, hf_model=None, tokenizer=None, keep: int = 1, dist=None,
                    bf16_state: dict | None = None, **extra) -> None:
    """Model, optimizer, step, RNG states and data position, written atomically; only tensors and
    plain data, so that --resume loads it with weights_only=True (no code runs on load). With
    `hf_model` (and its tokenizer), also <dir>/model/: a Hugging Face model directory
    (safetensors) that transformers and vLLM load as is. `path` is always the latest; with `keep` > 1
    (--keep-checkpoints) the latest `keep` are also kept as <dir>/checkpoints/<step>.pt (hard links:
    no copy), older ones deleted; any of them resumes a run. Under torchrun (`dist`) every rank calls
    it and rank 0 writes the file one process writes (`path` and `hf_model`, rank 0's unsharded copy,
    are read on rank 0 only). `bf16_state` (weight_sync.bf16_copy's): also <dir>/model-bf16/, hf_model with it."""
    if dist is not None and dist.enabled:
        write = lambda m, o: save_checkpoint(path, m, o, step, data_position, hf_model, tokenizer, keep,  # noqa: E731
                                             bf16_state=bf16_state, **extra)
        return distributed.save_sharded(model, optimizer, write, dist)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    rng = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "data_position": data_position,
             "rng": rng, **extra}
    replace_atomically(lambda tmp: torch.save(state, tmp), path)
    if keep > 1:
        kept = path.parent / "checkpoints"
        kept.mkdir(exist_ok=True)
        (kept / f"{step}.pt").unlink(missing_ok=True)
        os.link(path, kept / f"{step}.pt")
        for old in sorted(kept.glob("*.pt"), key=lambda p: int(p.stem))[:-keep]:
            old.unlink()
    if hf_model is not None:
        save_hf_model(path.parent / "model", hf_model, tokenizer)
    if hf_model is not None and bf16_state is not None:
        save_hf_model(path.parent / "model-bf16", hf_model, tokenizer, state_dict=bf16_state)
    elif hf_model is not None:  # (none this time: an older one would not be these weights)
        shutil.rmtree(path.parent / "model-bf16", ignore_errors=True)


def save_hf_model(out_dir: str | Path, model, tokenizer=None, state_dict: dict | None = None) -> None:
    """`save_pretrained` (safetensors, tokenizer included) into out_dir, replacing it whole; with `state_dict` (bf16
    tensors), those instead of the model's, its config's dtype bfloat16."""
    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        # (a copy of the dict: save_pretrained pops what it writes from the one it is given)
        model.save_pretrained(tmp, safe_serialization=True, state_dict=None if state_dict is None else dict(state_dict))
        if state_dict is not None:  # (the config is the live model's: its dtype said in the file only)
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():  # a directory cannot be replaced by rename: move the old one aside first
            old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            shutil.rmtree(old, ignore_errors=True)

    replace_atomically(write, out_dir)


def checkpoint_state(path: str | Path) -> dict:
    """Load a checkpoint with weights_only=True (tensors and plain data only: a crafted file
    cannot run code) or stop with one line naming --resume."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise SystemExit(f"error: --resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, empty, foreign or unsafe: the message is all the user needs
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: --resume: {path} is not a checkpoint this project wrote ({reason})") from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise SystemExit(f"error: --resume: {path} is not a checkpoint this project wrote (missing "
                         f"{', '.join(missing)})")
    return state


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, required: tuple = (),
                    dist=None) -> dict:
    """Restore what save_checkpoint wrote; returns the whole state (step, data_position, extras).
    `required`: the extra keys the caller reads, checked before anything is restored. Under torchrun
    (`dist`) every rank calls it: rank 0 reads the file and restores its RNG, every rank gets its
    shards and the state's scalars (distributed.load_sharded)."""
    if dist is not None and dist.enabled:
        return distributed.load_sharded(path, model, optimizer, lambda m,
                                        o: load_checkpoint(path, m, o, required), dist)
    state = checkpoint_state(path)
    missing = [k for k in required if k not in state]
    if missing:
        raise SystemExit(f"error: --resume: {path} was written by another script (missing {', '.join(missing)})")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise SystemExit(f"error: --resume: {path} does not fit this model ({str(e).splitlines()[0][:200]})") from None
    random.setstate(state["rng"]["python"])
    numpy_state = state["rng"]["numpy"]
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state
