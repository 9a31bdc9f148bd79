"""Issue 42: what a student's copy of a script gets wrong goes wrong loudly. Each test reproduces one
silent failure a student met: the custom-reward example, pass@k, a stripped copy on a GPU, a method that
learns nothing, and which script to start from."""

import re
from pathlib import Path

import pytest
from conftest import WORKLOADS as W  # each script's memory_plan.Workload, by its short name

import tasks

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# 1. docs/tasks.md's custom-reward example builds on the task's own reward and correctness
# --------------------------------------------------------------------------------------

HUB = {
    "openai/gsm8k": {split: [dict(question=f"Ann has {i} pens and gets {i + 1}. How many?",
                                  answer=f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1}")
                             for i in range(first, first + 12)] for split, first in (("train", 0), ("test", 100))},
    "Jiayi-Pan/Countdown-Tasks-3to4": [dict(nums=[i, i + 1, i + 2], target=3 * i + 3) for i in range(1, 61)],
    "trl-lib/tldr": {split: [dict(prompt=f"POST: day {i}. TL;DR:", completion=f" day {i}") for i in range(20)]
                     for split in ("train", "validation")},
}


def right_answer(task, problem) -> str:
    """A completion the task counts as correct, not written as its reference answer is."""
    if task.name == "arithmetic":  # the last number, written as a decimal
        return f"{problem.numbers[0]} and {problem.numbers[1]} make {problem.answer}.0"
    # Countdown: the known solution in parentheses, or the sum of the numbers (the hub rows' targets)
    if problem.numbers:
        expression = f"({problem.answer})" if problem.answer else "+".join(map(str, problem.numbers))
        return f"so <answer>{expression}</answer>"
    if "####" in problem.answer:  # GSM8K: the final number, in another form
        return (f"it is {problem.answer.split('####')[-1].strip()}.0 in all\n"
                f"#### {problem.answer.split('####')[-1].strip()}.0")
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
        wrong = (right.replace("<answer>", "<answer>1+").replace("####", "#### 1") if task.name != "arithmetic"
                 else right.replace(f"{problem.answer}.0", f"{problem.answer}1"))
        completions = [right, wrong, "no answer at all"]
        width = max(map(len, completions))
        completions = [c.ljust(width) for c in completions]  # one length: the penalty is the same for all of them
        if name not in ("tldr",):  # (TL;DR has no correct answer: its reward model scores it)
            assert (task.is_correct(completions[0], problem)
                    and task.reward(completions[0], problem) > task.reward(completions[1], problem))
        differences = {round(custom.reward(c, problem) - task.reward(c, problem), 9) for c in completions}
        assert len(differences) == 1, (name,
                                       [(c, task.reward(c, problem), custom.reward(c, problem)) for c in completions])
        assert ([custom.is_correct(c, problem) for c in completions]
                == [task.is_correct(c, problem) for c in completions])


def test_no_doc_calls_answer_matches_the_tasks_notion_of_correct():
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for line in path.read_text().splitlines():
            assert not ("answer_matches" in line and "correct" in line), f"{path.name}: {line}"


# --------------------------------------------------------------------------------------
# 2. pass@k for every k the samples allow, in all four scripts; the summary says what was measured and changed
# --------------------------------------------------------------------------------------

import dataclasses  # noqa: E402

import common  # noqa: E402
from fastrl import checks, runlog  # noqa: E402
from fastrl.vllm_sampler import Completion  # noqa: E402


class ScriptedSampler:
    """A stand-in for the sampler in evaluate(): sample j of prompt i is right when j < right[i] (Countdown)."""

    def __init__(self, task, right: list[int]):
        self.task, self.right, self.asked = task, right, {}

    def submit(self, prompts, n=1, **sampling):
        self.asked = dict(n=n, **sampling)
        return [(i, j) for i in range(len(prompts)) for j in range(n)]

    def wait_for(self, ids):
        def text(i, j):
            problem = self.task.problem("test", i)
            return f"<answer>{problem.answer}</answer>" if j < self.right[i] else "<answer>1</answer>"
        return [Completion(f"{i}-{j}", [1], [2], [0.0], "stop", [(0, 0, 1)], text=text(i, j)) for i, j in ids]


class CharTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 50 for c in text]}


@pytest.mark.parametrize("samples, ks", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (16, [1, 2, 4, 8, 16])])
def test_evaluate_reports_pass_at_k_for_every_k_the_samples_allow(samples, ks):
    """Issue 42, item 2: k was only ever 1, 4, 8, 16: --eval-samples 2 gave pass@1 alone and a summary saying
    one sample."""
    task = tasks.make_task("countdown", seed=1, tiny_prompts=True)
    right = [0, 1, samples, samples // 2]
    result = tasks.evaluate(ScriptedSampler(task, right), task, CharTokenizer(), len(right), samples, 64)
    assert sorted(int(k.split("@")[1]) for k in result if "@" in k) == ks
    for k in ks:
        assert result[f"eval/pass@{k}"] == pytest.approx(sum(tasks.pass_at_k(samples, c, k) for c in right)
                                                         / len(right))
    assert result["eval/samples"] == samples and result["eval/problems"] == len(right)
    lines = runlog.what_happened(result, result, None)
    assert ("one sample per problem" in " ".join(lines)) == (samples == 1)


def test_dpo_evaluates_pass_at_k_too():
    import online_dpo_async as dpo

    task = tasks.make_task("countdown", seed=1, tiny_prompts=True)
    args = dpo.parse_args(["--eval-samples", "4", "--eval-problems", "3"])
    evaluate = tasks.evaluator(ScriptedSampler(task, [0, 1, 4]), task, CharTokenizer(), args,
                               greedy=args.eval_decoding == "greedy")
    result = evaluate()
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4"} <= set(result) and result["eval/samples"] == 4


def test_the_summary_says_what_was_measured_and_names_the_changed_flags(tmp_path, monkeypatch):
    """A student's copy with an added flag, run with it: the title named neither the flag nor the copy."""
    import rloo_kreuse as rloo

    student = dataclasses.make_dataclass("Args", [("advantage", str, dataclasses.field(default="rloo"))],
                                         bases=(rloo.Args,))
    monkeypatch.setattr("sys.argv", ["rloo_grpo.py"])
    args = checks.parse_args(student, ["--advantage", "grpo", "--k", "2", "--eval-samples", "2"], paper=rloo.PAPER)
    logger = runlog.RunLogger("summary__1__1", args, root=str(tmp_path))
    try:
        evaluation = {"eval/pass@1": 0.25, "eval/pass@2": 0.5, "eval/problems": 200.0, "eval/samples": 2.0}
        text = logger.report(3, "RLOO K=2", {"K": "2"}, evaluation, evaluation, {"learner": 1.0})
    finally:
        logger.close()
    title = text.splitlines()[0]
    assert "rloo_grpo.py" in title and "--advantage grpo" in title and "--k 2" in title and "--eval-samples 2" in title
    assert "--num-rounds" not in title and "--seed" not in title  # defaults are not named
    assert "200 problems" in text and "2 samples" in text and "pass@2" in text


# --------------------------------------------------------------------------------------
# 3. a copy without a flag the method does not use runs its memory plan and checks, on a GPU too
# --------------------------------------------------------------------------------------

import importlib  # noqa: E402

from fastrl import memory_plan  # noqa: E402

SCRIPTS = {"rloo": "rloo_kreuse", "dpo": "online_dpo_async", "pipeline": "pipeline_rl", "ppo": "ppo_oppo"}
# Qwen2.5-0.5B's shape (tests/test_memory.py): a real model's plan, from numbers alone
QWEN = memory_plan.Shape(params=494_032_768, critic_params=494_033_664, largest=136_134_656, layers=24, hidden=896,
                         intermediate=4864, heads=14, kv_dim=128, vocab=151_936)


def stripped_copy(script: str, without: str):
    """A student's copy of the script's Args at its real-model defaults, with the field `without` deleted (and the
    __post_init__ checks that read it, as a student deletes them too)."""
    module = importlib.import_module(SCRIPTS[script])
    full = dataclasses.replace(module.Args(), **module.PAPER)
    fields = [(f.name, f.type, dataclasses.field(default=getattr(full, f.name)))
              for f in dataclasses.fields(module.Args) if f.name != without]
    return dataclasses.make_dataclass("Args", fields)()


def optional_flags(script: str) -> list[str]:
    module = importlib.import_module(SCRIPTS[script])
    return [f.name for f in dataclasses.fields(module.Args) if f.name not in ("model",
                                                                              *W[script].needed())]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_copy_without_any_one_optional_flag_plans_and_checks(script, monkeypatch):
    """Issue 42, item 3: the plan read args.kl_coef (and others) by name, so a copy without it passed every CPU run and
    raised AttributeError on its first GPU start. Every optional flag deleted in turn: the plan on an 80 GB GPU (its
    line or its one-line refusal) and the checks before the sampler starts (check_run_flags, check_model) still run."""
    for name in optional_flags(script):
        args = stripped_copy(script, name)
        plan = memory_plan.plan(W[script], args, QWEN, 80e9)
        assert (plan.line.startswith(("memory plan: ", "error: memory plan: "))
                and "\n" not in plan.line), (name, plan.line)
        if name not in ("sampler_url",):  # (not about the flags: a copy's plan names only flags it has)
            assert f"--{name.replace('_', '-')} " not in plan.line, (name, plan.line)
        checks.check_run_flags(args)
        args.model = checks.TINY  # (the check reads the model's files: the built-in model's)
        if hasattr(args, "task"):
            args.task = "countdown"  # (the paper's countdown-hub needs the datasets package, which CPU setups lack)
        if hasattr(args, "max_prompt_tokens"):
            args.max_prompt_tokens, args.max_new_tokens = 32, 32
        checks.check_model(args, W[script], tasks.HUB_TASKS, common.resolve_model)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_copy_without_a_flag_the_plan_needs_stops_in_one_line_on_cpu_too(script):
    for name in W[script].needed():
        args = stripped_copy(script, name)
        args.model = checks.TINY
        with pytest.raises(SystemExit, match=f"^error: --{name.replace('_', '-')}: ") as stopped:
            checks.check_model(args, W[script], tasks.HUB_TASKS, common.resolve_model)
        assert "\n" not in str(stopped.value)


# --------------------------------------------------------------------------------------
# 4. a setting under which the method learns nothing is said in one line
# --------------------------------------------------------------------------------------

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


def test_no_learning_signal_is_said_once_after_patience_rounds(capsys):
    streaks = {}
    said = [checks.warn_no_learning(signal, "every advantage is 0", streaks, patience=3)
            for signal in (torch.zeros(4), torch.ones(4), torch.zeros(4), torch.full((4,), float("nan")),
                           torch.zeros(0), torch.zeros(4))]
    assert said == [True, False, True, True, True, True]  # zero, non-finite and empty are no signal
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: every advantage is 0") and "learns nothing" in lines[0]
    checks.warn_no_learning(torch.zeros(4), "every advantage is 0", streaks, patience=1)  # said already: not again
    assert capsys.readouterr().out == ""
    assert not checks.warn_no_learning(torch.tensor([True, False]), "pairs", {}, patience=1)  # one kept pair is signal


@pytest.mark.slow
def test_a_copy_without_the_group_size_check_says_it_learns_nothing(tmp_path):
    """Issue 42, item 3's second half: a copy of rloo_kreuse.py without its `group_size >= 2` check trained on
    advantages that carry nothing (0/0 with one response a prompt) without a word. Two rounds of a real copy."""
    source = (ROOT / "rloo_kreuse.py").read_text()
    check = next(line for line in source.splitlines() if "self.group_size >= 2" in line)
    copy = tmp_path / "rloo_copy.py"
    copy.write_text(source.replace(check + "\n", ""))
    out = subprocess.run([sys.executable, str(copy), "--group-size", "1", "--num-prompts", "4", "--num-rounds", "2",
                          "--max-new-tokens", "16",
                          "--eval-problems", "2", "--eval-samples", "1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stdout.splitlines() if "learns nothing" in line]
    assert len(said) == 1 and said[0].startswith("warning: each prompt's rewards tie (or --group-size 1)"), \
        out.stdout[-3000:]


@pytest.mark.slow
def test_rewards_that_tie_are_said_even_where_k1_shapes_the_advantages(tmp_path):
    """Issue 59, item 5: with the default k1 KL folded into the reward, a group whose task rewards tie still gets
    non-zero advantages (from KL differences), so a check on the advantages never saw it. A reward that scores every
    completion 0.5: the warning comes, read off the task rewards' spread."""
    (tmp_path / "flat_reward.py").write_text("def score(completion, problem):\n    return 0.5\n")
    out = subprocess.run([sys.executable, str(ROOT / "rloo_kreuse.py"), "--reward", "flat_reward:score",
                          "--kl-coef", "0.05", "--kl-estimator", "k1", "--num-prompts", "4", "--num-rounds", "2",
                          "--max-new-tokens", "16", "--eval-problems", "2", "--eval-samples", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env=os.environ | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in runlog.read_metrics(tmp_path / out.stdout.split("run directory: ")[1].split()[0])
            if "charts/advantage_std" in r]
    assert all(r["charts/advantage_std"] > 0 for r in rows[1:])  # k1 differences: advantages that are not 0
    said = [line for line in out.stdout.splitlines() if "learns nothing" in line]
    assert len(said) == 1 and said[0].startswith("warning: each prompt's rewards tie"), out.stdout[-3000:]


# --------------------------------------------------------------------------------------
# 5. docs/methods.md says which script to start from, and everything a copy must keep
# --------------------------------------------------------------------------------------


def _section(text: str, title: str) -> str:
    start = text.index(f"### {title}")
    return text[start:text.find("\n#", start + 4)]


def test_methods_md_says_which_script_to_start_from_and_what_a_copy_must_keep():
    """Issue 42, item 4: which script to copy for REINFORCE, GRPO or a new loss was not said, and the list of what a
    copy must keep left out the flags the shared code reads. Each kind of change names a script that exists and a
    function of it; the keep list names every field the plan needs, in every script, and the calls a copy keeps; the
    README points at both."""
    methods = (ROOT / "docs" / "methods.md").read_text()
    table = _section(methods, "Which script to start from")
    for change in ("REINFORCE", "GRPO", "new policy-gradient loss", "new preference loss", "new reward"):
        row = next(line for line in table.splitlines() if change in line)
        for script in re.findall(r"`([\w/]+\.py)`", row):
            if str((ROOT / script).parent) not in sys.path:  # (examples/reinforce.py: its folder importable)
                sys.path.append(str((ROOT / script).parent))
            module = importlib.import_module(Path(script).stem)
            for name in re.findall(r"`(\w+)`", row.split("|")[3]):
                assert hasattr(module, name), (change, script, name)
    keep = _section(methods, "What a copy must keep")
    for script in SCRIPTS:
        for name in W[script].needed():
            assert f"--{name.replace('_', '-')}" in keep, name
    for call in ("sampler.push(policy, step)", "sampler.check_version", "with run:", "Run(args", "run.warn_no_learning",
                 "__main__"):
        assert call in keep, call
    from fastrl.run import Run
    from fastrl.sampler_client import SamplerClient

    assert all(callable(getattr(Run, name)) for name in ("warn_no_learning", "__exit__"))
    assert all(callable(getattr(SamplerClient, name)) for name in ("push", "check_version", "generate", "wait"))
    readme = (ROOT / "README.md").read_text()
    assert "methods.md#which-script-to-start-from" in readme and "methods.md#what-a-copy-must-keep" in readme


# --------------------------------------------------------------------------------------
# Issue 59, items 7 and 8: flags a copy no longer serves, and a console line of what was measured


@pytest.mark.slow
def test_a_copy_without_the_save_line_refuses_the_flags_it_no_longer_serves(tmp_path):
    """A copy of rloo_kreuse.py whose loop no longer has its `if ... args.save_every ...: run.save(...)` lines accepted
    --save-every (and --eval-every, --snapshot-every), wrote no checkpoint and said nothing. Now it stops in one line
    naming the flag, at the round after the one that should have saved, before training on."""
    source = (ROOT / "rloo_kreuse.py").read_text()
    lines = source.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if "args.save_every and" in line)
    assert "run.save(" in lines[at + 1]
    copy = tmp_path / "rloo_copy.py"
    copy.write_text("".join(lines[:at] + lines[at + 2:]))
    out = subprocess.run([sys.executable, str(copy), "--save-every", "1", "--num-prompts", "4", "--num-rounds", "3",
                          "--max-new-tokens", "16", "--eval-problems", "2", "--eval-samples", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --save-every 1: never served") and "if args.save_every" in last, out.stderr[-2000:]
    assert "round 2/3" not in out.stdout  # stopped when round 2 was logged, its line not printed


def test_the_console_line_shows_what_was_measured_and_the_clipped_fraction():
    """The round's console line: no `kl nan` where no reference model exists (the SmolLM2 presets), and the fraction
    of steps whose gradient was clipped (1.0 in every round of the README's SmolLM2 run, and nobody saw it)."""
    import math
    from types import SimpleNamespace

    from fastrl import distributed
    from fastrl.run import Run

    lines = []
    run = object.__new__(Run)  # the round's log alone: no sampler, no process
    run.args = SimpleNamespace(save_every=0, eval_every=0, snapshot_every=0)
    run._served, run._first_round = dict(save_every=0, snapshot_every=0, eval_every=0), 0  # (its bar: below)
    run.logger, run.unit, run.rounds = distributed.NullLogger(), "round", 3
    run._progress = SimpleNamespace(update=lambda *a, **k: None, write=lines.append)
    run.log(2, {"charts/reward": 0.25, "charts/accuracy": 0.5, "charts/kl": math.nan, "losses/entropy": 0.7,
                "losses/grad_clipped_fraction": 1.0, "time/generate_seconds": 1.5, "time/train_seconds": 2.0}, round=1)
    assert lines == ["round 1/3 step 2: reward 0.250 accuracy 0.500 entropy 0.700 clipped 1.000 generate 1.50s "
                     "train 2.00s"]


def test_an_evaluation_off_rank_0_serves_eval_every_too():
    """Under torchrun only rank 0 evaluates (tasks.evaluator gives {} elsewhere); every rank logs the row. The check
    that a copy serves --eval-every counted only rows with pass@k in them, so rank 1 stopped at round 3 of
    `--eval-every 2` while rank 0 waited for it in the next collective. Now any row logged after a round counts."""
    from types import SimpleNamespace

    from fastrl import distributed
    from fastrl.run import Run

    run = object.__new__(Run)
    run.args = SimpleNamespace(save_every=0, eval_every=2, snapshot_every=0)
    run._served, run._first_round = dict(save_every=0, snapshot_every=0, eval_every=0), 0
    run.logger, run.unit, run.rounds = distributed.NullLogger(), "round", 6
    run._progress = SimpleNamespace(update=lambda *a, **k: None, write=lambda line: None, close=lambda: None)
    for round in range(1, 7):
        run.log(round, {"charts/reward": 0.5}, round=round)  # rank 1's view: its evaluations are {}
        if round % 2 == 0 and round < 6:
            run.log(round, {})
    run._served["eval_every"] = 0  # and a copy without the line still stops, on every rank alike
    with pytest.raises(SystemExit, match="--eval-every 2: never served"):
        run.log(7, {"charts/reward": 0.5}, round=7)
