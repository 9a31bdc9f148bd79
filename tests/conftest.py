"""Shared fixtures. Tests are laid out like the code: one file per module or script.

Markers: `slow` (starts a sampler or runs a script; `pytest -m "not slow"` runs the unit tests in
under a minute) is added here to every test that uses the `sampler` or `run_script` fixture, and
by hand to the others that start a process; `gpu` needs CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

SLOW_FIXTURES = {"sampler", "run_script"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_path():
    import tiny_model

    return str(tiny_model.tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    import common

    return common.load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def sampler(tiny_path):
    """One real vLLM sampler process on the tiny model for the whole session."""
    import vllm_sampler

    s = vllm_sampler.start_sampler(tiny_path, placement="cpu", seed=0)
    yield s
    s.close()


@pytest.fixture(scope="session")
def realistic_path():
    """The realistic fixture (tests/realistic_model.py): Qwen2, byte-level BPE, pad == eos,
    ChatML template, bf16 weights. The path users run, built offline."""
    from realistic_model import realistic_model_path

    return str(realistic_model_path())


@pytest.fixture
def run_script(tmp_path):
    """Run a script's real command line with tmp_path as the working directory, so its runs/
    lands there and never in the repository. Returns the CompletedProcess with `.run_dir` (the
    run directory it printed, or None)."""

    def run(script: str, *flags: str, timeout: float = 600, code: str | None = None) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code] if code is not None else [sys.executable, str(ROOT / script), *flags]
        out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        out.run_dir = tmp_path / out.stdout.split("run directory: ")[1].split()[0] if "run directory: " in out.stdout else None
        return out

    return run
