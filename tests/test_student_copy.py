"""Issue 42: what a student's copy of a script gets wrong goes wrong loudly. Each test reproduces one
silent failure a student met: the custom-reward example, pass@k, a stripped copy on a GPU, a method that
learns nothing, and which script to start from."""

import re
from pathlib import Path

import pytest

import tasks

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# 1. docs/tasks.md's custom-reward example builds on the task's own reward and correctness
# --------------------------------------------------------------------------------------

HUB = {
    "openai/gsm8k": {split: [dict(question=f"Ann has {i} pens and gets {i + 1}. How many?", answer=f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1}")
                             for i in range(first, first + 12)] for split, first in (("train", 0), ("test", 100))},
    "Jiayi-Pan/Countdown-Tasks-3to4": [dict(nums=[i, i + 1, i + 2], target=3 * i + 3) for i in range(1, 61)],
    "trl-lib/tldr": {split: [dict(prompt=f"POST: day {i}. TL;DR:", completion=f" day {i}") for i in range(20)]
                     for split in ("train", "validation")},
}


def right_answer(task, problem) -> str:
    """A completion the task counts as correct, not written as its reference answer is."""
    if problem.numbers:  # Countdown: the known solution in parentheses, or the sum of the numbers (the hub rows' targets)
        expression = f"({problem.answer})" if problem.answer else "+".join(map(str, problem.numbers))
        return f"so <answer>{expression}</answer>"
    if "####" in problem.answer:  # GSM8K: the final number, in another form
        return f"it is {problem.answer.split('####')[-1].strip()}.0 in all\n#### {problem.answer.split('####')[-1].strip()}.0"
    return f"so <answer> {problem.answer.upper()} </answer>"


def doc_example(tmp_path) -> str:
    """docs/tasks.md's first python block, written to a file as a student would: `path:score` for --reward."""
    text = (ROOT / "docs" / "tasks.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    path = tmp_path / "my_rewards.py"
    path.write_text(code)
    return f"{path}:score"


@pytest.mark.parametrize("name", [*tasks.BUILT_IN, "file.jsonl"])
def test_the_custom_reward_example_is_the_tasks_own_reward_with_a_length_penalty(name, tmp_path, monkeypatch):
    """Issue 42, item 1: the example scored Countdown's correct `(a-b/c)` as wrong (it compared text with one known
    solution) and dropped the 0.1 format score. Built on the task's own reward, it differs from it only by a
    function of the length, for every built-in task, and what counts as correct stays the task's."""
    monkeypatch.setattr(tasks, "_load_hub_dataset", lambda name, *a, **k: HUB[name])
    if name == "file.jsonl":
        name = str(tmp_path / "file.jsonl")
        Path(name).write_text("".join(f'{{"prompt": "{i} + 1 =", "answer": "x{i + 1}"}}\n' for i in range(30)))
    task = tasks.make_task(name, seed=1, tiny_prompts=True)
    custom = tasks.make_task(name, seed=1, tiny_prompts=True, reward=doc_example(tmp_path))
    for index in range(3):
        problem = task.problem("test", index)
        right = right_answer(task, problem)
        completions = [right, right.replace("<answer>", "<answer>1+").replace("####", "#### 1"), "no answer at all"]
        width = max(map(len, completions))
        completions = [c.ljust(width) for c in completions]  # one length: the penalty is the same for all of them
        if name not in ("tldr",):  # (TL;DR has no correct answer: its reward model scores it)
            assert task.is_correct(completions[0], problem) and task.reward(completions[0], problem) > task.reward(completions[1], problem)
        differences = {round(custom.reward(c, problem) - task.reward(c, problem), 9) for c in completions}
        assert len(differences) == 1, (name, [(c, task.reward(c, problem), custom.reward(c, problem)) for c in completions])
        assert [custom.is_correct(c, problem) for c in completions] == [task.is_correct(c, problem) for c in completions]


def test_no_doc_calls_answer_matches_the_tasks_notion_of_correct():
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for line in path.read_text().splitlines():
            assert not ("answer_matches" in line and "correct" in line), f"{path.name}: {line}"
