"""The built-in tiny model (tiny_model.py): deterministic, tied embeddings like Qwen2.5, some
success for RL to improve, and `python tiny_model.py` (the smoke run) failing in one line on a bad
model path."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import common
import tasks
import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, count, split="test"):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems = [task.problem(split, i) for i in range(count)]
    return problems, [tokenizer(p.prompt)["input_ids"] for p in problems]


def test_tiny_model_has_tied_embeddings_and_partial_success(tiny_path, tokenizer, sampler):
    model = common.load_policy(tiny_path, "cpu")
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems, prompts = _prompts(tokenizer, 200)
    samples = sampler.generate(prompts, n=1, temperature=1.0, max_tokens=32, seed=1)
    accuracy = sum(task.is_correct(s.text, p) for s, p in zip(samples, problems)) / len(problems)
    assert 0.02 < accuracy < 0.6, accuracy  # some success, lots of room for RL


def test_same_seed_same_weights_and_loads_in_transformers(tmp_path):
    config = tiny_model.TinyConfig(sft_steps=8)
    a = tiny_model.build_tiny_model(tmp_path / "a", config, log=lambda *_: None)
    b = tiny_model.build_tiny_model(tmp_path / "b", config, log=lambda *_: None)
    c = tiny_model.build_tiny_model(tmp_path / "c", tiny_model.TinyConfig(sft_steps=8, seed=1), log=lambda *_: None)
    ma, mb, mc = (common.load_policy(str(p), "cpu") for p in (a, b, c))
    for (name, pa), pb, pc in zip(ma.named_parameters(), mb.parameters(), mc.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(ma.parameters(), mc.parameters()))


def test_bad_model_path_is_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tiny_model.py"), "--model", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --model: cannot load") and "--model tiny" in last
