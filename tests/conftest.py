import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_path():
    import common

    return str(common.tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    import common

    return common.load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def sampler(tiny_path):
    """One real vLLM sampler process on the tiny model for the whole session."""
    import common

    s = common.start_sampler(tiny_path, placement="cpu", seed=0)
    yield s
    s.close()


@pytest.fixture(scope="session")
def realistic_path():
    """The realistic fixture (tests/realistic_model.py): Qwen2, byte-level BPE, pad == eos,
    ChatML template, bf16 weights. The path users run, built offline."""
    from realistic_model import realistic_model_path

    return str(realistic_model_path())
