"""The built-in tiny model (fastrl/tiny_model.py): deterministic, tied embeddings like Qwen2.5, some
success for RL to improve; a bad model path fails in one line."""

from pathlib import Path

import pytest
import torch

import common
from fastrl import util
import tasks
from fastrl import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, count, split="test"):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems = [task.problem(split, i) for i in range(count)]
    return problems, [tokenizer(p.prompt)["input_ids"] for p in problems]


@pytest.mark.slow
def test_tiny_model_has_tied_embeddings_and_partial_success(tiny_path, tokenizer, sampler):
    model = common.load_policy(tiny_path, "cpu")
    assert (model.config.tie_word_embeddings
            and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems, prompts = _prompts(tokenizer, 200)
    samples = sampler.generate(prompts, n=1, temperature=1.0, max_tokens=32, seed=1)
    accuracy = sum(task.is_correct(s.text, p) for s, p in zip(samples, problems)) / len(problems)
    assert 0.02 < accuracy < 0.6, accuracy  # some success, lots of room for RL


def test_same_seed_same_weights_and_loads_in_transformers(tmp_path):
    config = tiny_model.TinyConfig(sft_steps=2)
    a = tiny_model.build_tiny_model(tmp_path / "a", config, common.tiny_sft_batch(config.task, config.seed),
                                    log=lambda *_: None)
    b = tiny_model.build_tiny_model(tmp_path / "b", config, common.tiny_sft_batch(config.task, config.seed),
                                    log=lambda *_: None)
    c = tiny_model.build_tiny_model(tmp_path / "c", tiny_model.TinyConfig(sft_steps=2, seed=1),
                                    common.tiny_sft_batch("countdown", 1), log=lambda *_: None)
    ma, mb, mc = (common.load_policy(str(p), "cpu") for p in (a, b, c))
    for (name, pa), pb, pc in zip(ma.named_parameters(), mb.parameters(), mc.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(ma.parameters(), mc.parameters()))


def test_the_tokenizer_loads_as_it_was_trained(tmp_path):
    """transformers loads a saved Qwen2 model's tokenizer as Qwen2Tokenizer, which rebuilds a
    byte-level pipeline around the vocabulary: the tiny tokenizer must encode the same after a save
    and a load (a plain-" " vocabulary once lost every space: trained on "5 7 3->15:", prompted with
    "573->15:"), and so must the steps task's prompts and answers."""
    built = tiny_model.build_tiny_model(tmp_path / "m", tiny_model.TinyConfig(sft_steps=1),
                                        common.tiny_sft_batch("countdown", 0), log=lambda *_: None)
    loaded, fresh = util.load_tokenizer(str(built)), tiny_model._tiny_tokenizer()
    assert type(loaded).__name__ == "Qwen2Tokenizer"  # what the scripts and vLLM get
    texts = ["5 7 3->15:", "a b\nc  d"]
    for name in ("countdown", "countdown-steps"):
        task = tasks.make_task(name, seed=0, tiny_prompts=True)
        texts += [text for p in (task.problem("train", i) for i in range(20)) for text in (p.prompt,
                                                                                           task.completion_text(p))]
    for text in texts:
        ids = loaded(text)["input_ids"]
        assert ids == fresh(text)["input_ids"] and loaded.decode(ids) == text, text
    assert loaded(" ")["input_ids"] != [] and loaded.unk_token_id not in loaded("5 7 3->15:")["input_ids"]


def test_steps_task_answers_vary_in_length_and_score(tmp_path):
    """The long-tail workload: 3-7 numbers, each count half as frequent as the one before, answers
    worked step by step whose length grows with the numbers; its own worked answer scores 1."""
    import numpy as np

    task = tasks.make_task("countdown-steps", seed=0, tiny_prompts=True)
    problems = [task.problem("train", i) for i in range(1000)]
    counts = np.bincount([len(p.numbers) for p in problems], minlength=8)[3:]
    assert counts.sum() == 1000 and all(a > b for a, b in zip(counts, counts[1:])) and counts[-1] > 0
    tokenizer = tiny_model._tiny_tokenizer()
    lengths = {n: np.mean([len(tokenizer(task.completion_text(p))["input_ids"])
                           for p in problems if len(p.numbers) == n])
               for n in range(3, 8)}
    assert all(lengths[n] < lengths[n + 1] for n in range(3, 7)) and lengths[7] > 2.5 * lengths[3]  # tokens: ~20 -> ~65
    assert all(task.reward(task.completion_text(p), p) == 1.0 for p in problems)
    assert task.completion_text(problems[0]).count(";") == len(problems[0].numbers) - 1  # one step per combination
    plain = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    assert plain.completion_text(plain.problem("train", 0)).startswith("<answer>")  # the default task is unchanged


def test_bad_model_path_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as stop:
        common.load_policy(str(tmp_path / "missing"), "cpu")
    message = str(stop.value)
    assert "\n" not in message and message.startswith("error: --model: cannot load") and "--model tiny" in message


def test_the_prompt_budget_and_response_cap_must_fit_the_models_context(tmp_path, monkeypatch):
    """checks.check_context reads a local model's config.json (checks.model_config) and stops a budget that vLLM would
    refuse at its start in one line naming the flag: the tiny model's context is 128 tokens."""
    from fastrl import checks

    path = str(common.tiny_model_path())
    assert checks.model_config(path, "--model").max_position_embeddings == 128
    checks.check_context(path, 64, 64)  # fits exactly
    for (prompt, response), flag in [((128, 1), "--max-prompt-tokens"), ((64, 65), "--max-new-tokens")]:
        with pytest.raises(SystemExit) as stop:
            checks.check_context(path, prompt, response)
        assert str(stop.value).startswith(f"error: {flag}: ") and "context of 128 tokens" in str(stop.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a path with no config.json: its Hub config, or one line naming the flag
    with pytest.raises(SystemExit) as stop:
        checks.model_config(str(tmp_path / "missing"), "--critic-model")
    assert str(stop.value).startswith("error: --critic-model: cannot load")
