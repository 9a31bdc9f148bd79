"""Plumbing the scripts share that is not the method: loading from the Hub with a one-line error,
the cache directory, atomic file replacement, seeding, and progress a person can read (`Progress`)."""

from __future__ import annotations

import io
import os
import shutil
import sys
import threading
import time
from pathlib import Path


CACHE_DIR = Path(os.environ.get("FASTRL_CACHE", Path.home() / ".cache" / "fastrl"))


def set_seed(seed: int) -> None:
    """transformers.set_seed: the python, numpy, torch and CUDA generators (imported on use: transformers
    takes seconds to import, and the sampler starts before the learner needs it)."""
    from transformers import set_seed as seed_everything

    seed_everything(seed)


def load_hf(cls, path: str, flag: str = "--model", quiet: bool = False, **kwargs):
    """`cls.from_pretrained(path)` that fails with one clear line naming `flag` instead of a Hub
    traceback. `quiet`: no load report (e.g. a value head that is new by design)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    try:
        if quiet:
            hf_logging.set_verbosity_error()
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or not Path(path).exists()
        hint = " Offline or without the Hub? Use --model tiny (the built-in model)." if offline else ""
        raise SystemExit(f"error: {flag}: cannot load {path!r}: {str(e).splitlines()[0]}{hint}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def load_tokenizer(path: str, flag: str = "--model"):
    from transformers import AutoTokenizer

    tokenizer = load_hf(AutoTokenizer, path, flag=flag)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def replace_atomically(write, path: Path) -> None:
    """write(tmp) then rename over `path`: a reader never sees half a file, two runs never share
    a temporary name, and a failed write (disk full) leaves the previous file as it was."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise SystemExit(f"error: could not write {path} ({e.strerror or e}); "
                         "the previous copy, if any, is intact") from None


class _Tee(io.TextIOBase):
    """stdout to the console and to the run's console.log, flushed as written (isatty: False)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)


def on_terminal() -> bool:
    """Whether a person watches this run: stdout (seen through RunLogger's copy to console.log and a
    shown bar's line writer) and stderr, where bars go, are both terminals."""
    out = sys.stdout
    while isinstance(out, (_Tee, _AboveBars)):
        out = out.streams[0]
    return all(getattr(s, "isatty", lambda: False)() for s in (out, sys.stderr))


class _AboveBars(io.TextIOBase):
    """stdout while a bar is shown: each whole line is written above the bars (tqdm.write), so a print
    anywhere (RunLogger.log, a sample) does not tear them."""

    def __init__(self, stream):
        self.streams, self.partial = (stream,), ""

    def write(self, text):
        from tqdm import tqdm

        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        if lines:
            with tqdm.external_write_mode(file=sys.stderr):  # clears the bars (on stderr), draws them again after
                self.streams[0].write("".join(line + "\n" for line in lines))
        return len(text)

    def flush(self):
        self.streams[0].flush()


class Progress:
    """How far a loop of `total` units (rounds, steps, iterations, samples) has got and how long is
    left, for a person to read at a glance. The contract:

    - on a terminal (`on_terminal()`): a tqdm bar on stderr with the rate, the time left and the
      metrics of the last `update(n, **metrics)` in its postfix; printed lines (`write`, or any print
      while it is shown) scroll above it and still reach console.log. `leave=False`: the bar goes
      when closed (an evaluation's); otherwise it stays as the loop's last line.
    - otherwise (CI logs, tests, `> file`): no bar and no control characters; `write(line)` prints
      the line with "(elapsed, ~left)" appended, and `update` prints one plain line of that kind
      when `every` seconds have passed without one, so a quiet stretch (an evaluation, iterations
      between two logged ones) still says how far it got. A printed line keeps its text, so a test
      that greps it still finds it.
    - `show=False` (a rank other than 0): nothing but the lines given to `write`, as they are.
    A context manager; `close()` is idempotent and puts stdout back."""

    def __init__(self, total: int, desc: str, unit: str = "it", initial: int = 0, every: float = 30.0,
                 leave: bool = True, show: bool = True, terminal: bool | None = None):
        self.total, self.desc, self.unit, self.n, self.every, self.show = total, desc, unit, initial, every, show
        self.initial, self.start = initial, time.monotonic()
        self.last_line, self.metrics = self.start, {}
        self.bar = None
        if show and (on_terminal() if terminal is None else terminal):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, leave=leave, dynamic_ncols=True,
                            file=sys.stderr)
            self._writer = None
            if not isinstance(sys.stdout, _AboveBars):  # (an outer bar's writer serves the inner bar too)
                self._writer = sys.stdout = _AboveBars(sys.stdout)

    def timing(self) -> str:
        """"1:02 elapsed, ~3:10 left" (the rate of the units done since the start)."""
        from tqdm import tqdm

        elapsed = time.monotonic() - self.start
        done = self.n - self.initial
        left = tqdm.format_interval((self.total - self.n) * elapsed / done) if done > 0 else "?"
        return f"{tqdm.format_interval(elapsed)} elapsed, ~{left} left"

    def update(self, n: int = 1, **metrics) -> None:
        self.n += n
        self.metrics = metrics
        if self.bar is not None:
            if metrics:
                self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in metrics.items()},
                                     refresh=False)
            self.bar.update(n)
        elif self.show and time.monotonic() - self.last_line >= self.every and self.n < self.total:
            shown = "".join(f" {k} {v:.3g}" if isinstance(v, float) else f" {k} {v}" for k, v in metrics.items())
            self.write(f"{self.desc}: {self.n}/{self.total} {self.unit}s{shown}")

    def write(self, line: str) -> None:
        if self.show and self.bar is None:
            line, self.last_line = f"{line} ({self.timing()})", time.monotonic()
        print(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            # (a RunLogger closed meanwhile put its own back)
            if self._writer is not None and sys.stdout is self._writer:
                sys.stdout = self._writer.streams[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (x86: AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's
    flags, e.g. Intel Sapphire Rapids and later, AMD Zen 4 and later; Arm: the BF16 feature), where bf16 autocast is
    faster than fp32 rather than emulated and slower. False where it cannot tell (not Linux)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(cpuinfo.split())
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def machine_line() -> str:
    """The machine a timing was taken on, in one line: CPU model, cores this process may use, native bf16, memory,
    torch (e.g. "AMD EPYC, 2 cores, bf16 native, 24 GB, torch 2.13.0+cpu")."""
    import os

    import torch

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        cpu = platform.processor() or platform.machine()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu}, {cores} cores, bf16 {'native' if cpu_bf16() else 'not native'}, {memory:.0f} GB, "
            f"torch {torch.__version__}")



def wait_until(done, pump, timeout: float, describe) -> float:
    """Call pump() (receive, admit: it returns how many things happened) until done(); raise, saying describe(),
    after `timeout` seconds without progress: a clear error, never a silent spin. Returns the seconds waited."""
    start = last_progress = time.monotonic()
    while not done():
        if pump():
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > timeout:
            raise RuntimeError(f"no sequence arrived and no prompt was admitted for {timeout:.0f}s: {describe()}")
    return time.monotonic() - start
