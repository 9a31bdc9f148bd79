"""Tasks and rewards: what the model is asked and how an answer is scored; the prompts' tokens (encode_prompts, in a
chat template or not), a reward model's scores (RewardModel) and held-out pass@k (evaluate).

- Countdown (TinyZero's task): reach a target with + - * / using each given number once; the answer is the last
  <answer>...</answer>; 1 if right, 0.1 if well-formed but wrong, 0 if absent. `countdown-steps` is the long-tail
  workload: 3-7 numbers, few problems with many, answered step by step, so that long answers are real answers.
  `countdown` is an offline generator (train problem i is a pure function of the seed and i, test problem i of i
  alone; train and test are disjoint); `countdown-hub` is TinyZero's data on the Hub.
- Arithmetic in words (`arithmetic`, offline): "What is 63 - 15? Give the final answer as a number.", two-digit sums
  and differences; the answer is the completion's last number (one final answer: "48, or maybe 47" answers 47); 1 if
  it equals the result, else 0. The task that SmolLM2-135M-Instruct (`--model smollm2`) starts weak at (pass@1 ~0.1)
  and learns from in minutes on a CPU.
- GSM8K (`gsm8k`, from the Hub): exact match on the final number, in the dataset's `#### n` format (strict: a
  completion without `#### n` scores 0; loose: it falls back to its last number).

Held-out problems do not depend on the seed (HELD_OUT_SEED): runs on different seeds are evaluated on the same test
problems, so an average over seeds is over one test set; only the train problems (their choice, or their order where
it is drawn) follow the seed.

Scoring is safe and bounded: arithmetic is evaluated with `ast` and exact fractions (no `eval`), and every reward
runs in time linear in the completion.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fastrl.util import Progress, load_hf, load_tokenizer

if TYPE_CHECKING:  # annotations only
    from fastrl.vllm_sampler import Completion, Sampler

COUNTDOWN_FORMAT_SCORE = 0.1  # TinyZero: a well-formed but wrong answer
# the test split's seed, whatever --seed is (0: the split the tests and the tiny model's checks always used)
HELD_OUT_SEED = 0
_MAX_ABS_VALUE = 10**12  # larger intermediate values are treated as malformed


class _Unsafe(ValueError):
    pass


def safe_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Evaluate `expression` allowing only non-negative integer literals, parentheses and + - * /, exactly (Fractions).
    Returns (value, integer literals used). Raises ValueError on anything else (names, calls, **, unary ops, floats), on
    division by zero and on huge values."""
    if len(expression) > 200:
        raise _Unsafe("expression too long")
    tree = ast.parse(expression.strip(), mode="eval")
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                value = left + right
            elif isinstance(node.op, ast.Sub):
                value = left - right
            elif isinstance(node.op, ast.Mult):
                value = left * right
            else:
                if right == 0:
                    raise _Unsafe("division by zero")
                value = left / right
            if abs(value) > _MAX_ABS_VALUE:
                raise _Unsafe("value too large")
            return value
        raise _Unsafe(f"not allowed: {type(node).__name__}")

    return walk(tree), numbers


def last_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer>, pairing tags left to right as TinyZero's
    `re.finditer(r"<answer>(.*?)</answer>")` does, in time linear in the completion (the regex is quadratic in
    unclosed <answer> tags: 2.6 s for a 72 KB completion)."""
    found, position = None, 0
    while (start := completion.find("<answer>", position)) >= 0:
        end = completion.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, position = completion[start + len("<answer>"): end], end + len("</answer>")
    return found


def countdown_reward(completion: str, numbers: list[int], target: int,
                     format_score: float = COUNTDOWN_FORMAT_SCORE) -> float:
    """TinyZero convention: 1 for a correct equation in the last <answer>...</answer> that uses each given number
    exactly once; `format_score` for a well-formed but wrong answer; 0 when there is no answer."""
    answer = last_answer(completion)
    if answer is None:
        return 0.0
    try:
        value, used = safe_arithmetic(answer)
    except (SyntaxError, ValueError, RecursionError):
        return format_score
    if sorted(used) != sorted(numbers):
        return format_score
    return 1.0 if value == target else format_score


# a number as GSM8K writes them: commas only as thousands separators ("1,234"; "1,5" is two numbers)
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
GSM8K_PROMPT = "[MATH_TASK] Problem:\n{}\n\nSolution:"  # async_rlhf's GSM8k_PROMPT, "from realtreetune"
_MARKED_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def gsm8k_extract(text: str, match: str = "strict") -> str | None:
    """The final answer of a GSM8K solution. The dataset's format puts it right after '####': the number after the
    first '####' that is followed by one, as the authors' grader reads it (async_rlhf src/gsm8k_utils.py:
    ANS_RE.search; a model that goes on to a next "Problem:" and its own `#### n` keeps its first answer; a trailing
    '####' does not change it). Without a marked answer: None when `match` is "strict" (the paper's reward, §5.2: 1
    only if the answer string matches; the authors' grader `extract_answer` reads `#### n` only), the last number in
    the text when "loose" (this file's rule before issue #27). Unicode minus signs count as minus."""
    text = text.replace("\u2212", "-")
    marked = _MARKED_RE.findall(text)
    if marked:
        return marked[0].replace(",", "")
    if match == "strict":
        return None
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_reward(completion: str, answer: str, match: str = "strict") -> float:
    """Exact match on the final number, commas removed, compared numerically ("18.00" == "18").
    match: "strict" (only a `#### n` answer counts) or "loose" (else the completion's last number);
    the reference answer is always the dataset's `#### n`."""
    predicted, expected = gsm8k_extract(completion, match), gsm8k_extract(answer, "strict")
    if predicted is None or expected is None:
        return 0.0
    try:
        return 1.0 if Fraction(predicted) == Fraction(expected) else 0.0
    except (ValueError, ZeroDivisionError):
        return 0.0


@dataclass
class Problem:
    prompt: str
    numbers: list[int] = field(default_factory=list)
    target: int = 0
    answer: str = ""  # a known solution (Countdown) or the reference answer (GSM8K)
    steps: list[str] = field(default_factory=list)  # Countdown: the known solution's steps, "a*b=c"
    # under --chat-template (tasks.encode_prompts): the system turn (empty: the task has none, a template's default
    # one stays; None: no system turn at all, --system-prompt ""), the user turn (empty: the prompt) and the start of
    # the assistant's reply that the model continues (empty: none)
    system: str | None = ""
    user: str = ""
    assistant_start: str = ""


def _solution_string(rng: np.random.Generator, numbers: list[int],
                     max_target: int) -> tuple[str, int, list[str]] | None:
    """Combine `numbers` in random order with random ops into one expression whose every intermediate value is a
    non-negative integer; returns (expression, value, the steps "a*b=c" in the order they were taken)."""
    # each item: (text, value, precedence) with precedence 2 for atoms/products, 1 for sums
    items = [(str(n), n, 3) for n in numbers]
    steps = []
    while len(items) > 1:
        i, j = rng.choice(len(items), size=2, replace=False)
        (a, va, pa), (b, vb, pb) = items[i], items[j]
        op = "+-*/"[rng.integers(4)]
        if op == "-" and va < vb:
            (a, va, pa), (b, vb, pb) = (b, vb, pb), (a, va, pa)
        if op == "/" and (vb == 0 or va % vb != 0):
            op = "+"
        if op in "+-":
            text = f"{a}{op}{b if pb >= 2 or op == '+' else f'({b})'}"
            value, prec = (va + vb if op == "+" else va - vb), 1
        else:
            left = a if pa >= 2 else f"({a})"
            right = b if pb >= 3 else f"({b})"
            value, prec = (va * vb if op == "*" else va // vb), 2
            text = f"{left}{op}{right}"
        steps.append(f"{va}{op}{vb}={value}")
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [(text, value, prec)]
    text, value, _ = items[0]
    if not (1 <= value <= max_target):
        return None
    return text, value, steps


TINY_PROMPT = "{numbers}->{target}:"
# The tiny model's Countdown: three numbers 1-9, short prompts; small enough that a 0.8M-parameter model starts with
# some success and RL has room to improve it.
TINY_TASK = dict(min_numbers=3, max_numbers=3, max_number=9, max_target=100, prompt_template=TINY_PROMPT)
# `countdown-steps`, the long-tail workload: 3 to 7 numbers, few problems with many (each number count half as likely
# as the one before), and an answer worked step by step ("7*8=56;56-9=47;...;<answer>7*8-9</answer>"): its length
# grows with the numbers, ~20 tokens for 3, ~80 for 7, and all of it is answer, none is junk after it.
STEPS_NUMBER_WEIGHTS = (16, 8, 4, 2, 1)  # numbers 3, 4, 5, 6, 7
TINY_STEPS_TASK = dict(TINY_TASK, max_numbers=7, number_weights=STEPS_NUMBER_WEIGHTS, show_steps=True,
                       name="countdown-steps")
# the same for an instruct model under --chat-template, as TinyZero's qwen-instruct template splits it
CHAT_SYSTEM = ("You are a helpful assistant. You first think about the reasoning process in the mind and then provide "
               "the user with the answer.")
CHAT_USER = (
    "Using the numbers {numbers_list}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And "
    "return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
CHAT_ASSISTANT_START = "Let me solve this step by step.\n<think>"
CHAT_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer.\nUser: Using "
    "the numbers {numbers_list}, create an equation that equals {target}. You can use basic arithmetic operations "
    "(+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And return the final "
    "answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\nAssistant: Let me solve this "
    "step by step.\n<think>"
)


@dataclass
class CountdownTask:
    """Offline Countdown generator: train problem i is a pure function of (seed, i), test problem i of i alone
    (HELD_OUT_SEED: every seed is evaluated on the same problems), so a data position is one integer. Train and test
    are disjoint by a hash of the problem."""

    seed: int = 0
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 20
    max_target: int = 100
    prompt_template: str = TINY_PROMPT
    name: str = "countdown"
    number_weights: tuple[float, ...] | None = None
    """relative frequency of each number count min_numbers..max_numbers (None: uniform)"""
    show_steps: bool = False
    """the supervised completion works the solution step by step before the answer"""

    def problem(self, split: str, index: int) -> Problem:
        attempt = 0
        while True:
            train = split == "train"
            rng = np.random.default_rng([self.seed if train else HELD_OUT_SEED, 0 if train else 1, index, attempt])
            attempt += 1
            if self.number_weights is None:
                count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
            else:
                p = np.asarray(self.number_weights, dtype=float)
                count = self.min_numbers + int(rng.choice(len(p), p=p / p.sum()))
            numbers = [int(x) for x in rng.integers(1, self.max_number + 1, size=count)]
            made = _solution_string(rng, numbers, self.max_target)
            if made is None:
                continue
            solution, target, steps = made
            in_test = int(hashlib.sha1(f"{sorted(numbers)}|{target}".encode()).hexdigest(), 16) % 10 == 0
            if in_test != (split == "test"):
                continue
            prompt = self.prompt_template.format(numbers=" ".join(map(str, numbers)), numbers_list=numbers,
                                                 target=target)
            chat = {} if self.prompt_template == TINY_PROMPT else dict(
                system=CHAT_SYSTEM, user=CHAT_USER.format(numbers_list=numbers, target=target),
                assistant_start=CHAT_ASSISTANT_START)
            return Problem(prompt=prompt, numbers=numbers, target=target, answer=solution, steps=steps, **chat)

    def reward(self, completion: str, problem: Problem) -> float:
        return countdown_reward(completion, problem.numbers, problem.target)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        # the task's own check, not self.reward: a reward changed by a user never changes what counts as correct
        return countdown_reward(completion, problem.numbers, problem.target) == 1.0

    def completion_text(self, problem: Problem) -> str:
        """The supervised target used to build the tiny model."""
        worked = "".join(f"{step};" for step in problem.steps) if self.show_steps else ""
        return f"{worked}<answer>{problem.answer}</answer>"


ARITHMETIC_QUESTION = "What is {a} {op} {b}? Give the final answer as a number."


@dataclass
class ArithmeticTask:
    """Offline two-digit arithmetic in words (module docstring): train problem i is a pure function of
    (seed, i), test problem i of i alone (HELD_OUT_SEED). The 16,200 draws (a, b, op) are 12,195 distinct
    questions (8,100 sums, 4,095 differences a - b with a >= b), 8,190 up to the order of a sum's terms; a hash
    of that canonical problem puts about a tenth of them (871, asked as 1,277 questions) in the test split, so no
    held-out sum has its commuted twin (b + a) in the train split."""

    seed: int = 0
    name: str = "arithmetic"

    def problem(self, split: str, index: int) -> Problem:
        attempt = 0
        while True:
            train = split == "train"
            rng = np.random.default_rng([self.seed if train else HELD_OUT_SEED, 2 if train else 3, index, attempt])
            attempt += 1
            a, b = (int(x) for x in rng.integers(10, 100, size=2))
            op = "+" if rng.random() < 0.5 else "-"
            (a, op, b), in_test = self.question(a, b, op)
            if in_test != (split == "test"):
                continue
            question = ARITHMETIC_QUESTION.format(a=a, op=op, b=b)
            return Problem(prompt=f"Question: {question}\nAnswer:", numbers=[a, b],
                           target=a + b if op == "+" else a - b,
                           answer=str(a + b if op == "+" else a - b), user=question)

    @staticmethod
    def question(a: int, b: int, op: str) -> tuple[tuple[int, str, int], bool]:
        """The question a draw asks, (a, op, b) with a difference's larger term first (no negative results), and
        whether it is held out: a hash of the problem up to the order of a sum's terms, so that a + b and b + a fall
        on the same side (a hash of the ordered problem put 673 of 766 held-out sums' twins in the train split)."""
        if op == "-" and b > a:
            a, b = b, a
        canonical = f"{min(a, b)}+{max(a, b)}" if op == "+" else f"{a}-{b}"
        return (a, op, b), int(hashlib.sha1(canonical.encode()).hexdigest(), 16) % 10 == 0

    def reward(self, completion: str, problem: Problem) -> float:
        return float(self.is_correct(completion, problem))

    def is_correct(self, completion: str, problem: Problem) -> bool:
        found = _NUMBER_RE.findall(completion.replace("\u2212", "-"))
        return bool(found) and float(found[-1].replace(",", "")) == problem.target  # "48.0" is 48


@dataclass
class ListTask:
    """A task over a fixed list of problems (a Hub dataset, a JSONL file); index wraps around.
    `correct_fn` decides what counts as correct (accuracy, pass@k); None: a reward of 1."""

    train: list[Problem]
    test: list[Problem]
    name: str
    reward_fn: Any
    correct_fn: Any = None

    def problem(self, split: str, index: int) -> Problem:
        problems = self.train if split == "train" else self.test
        return problems[index % len(problems)]

    def reward(self, completion: str, problem: Problem) -> float:
        return self.reward_fn(completion, problem)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        if self.correct_fn is not None:
            return bool(self.correct_fn(completion, problem))
        return self.reward_fn(completion, problem) == 1.0


@dataclass
class Customised:
    """A task with a user's reward `(completion, problem) -> float` (`--reward module:function`) and/or
    system turn (`--system-prompt`); everything else, what counts as correct included, is the task's own.
    A reward function with a parameter named `task` is also given the task, to build on its own
    `task.reward(completion, problem)` and `task.is_correct(completion, problem)` (docs/tasks.md)."""

    task: Any
    reward_fn: Any = None
    system: str | None = None

    def __post_init__(self):
        import inspect

        self.passes_task = self.reward_fn is not None and "task" in inspect.signature(self.reward_fn).parameters

    def __getattr__(self, name: str):
        return getattr(self.task, name)

    def problem(self, split: str, index: int) -> Problem:
        problem = self.task.problem(split, index)
        if self.system is None:
            return problem
        return dataclasses.replace(problem, system=self.system or None)  # "": no system turn at all (Problem.system)

    def reward(self, completion: str, problem: Problem) -> float:
        if self.reward_fn is None:
            return self.task.reward(completion, problem)
        if self.passes_task:
            return float(self.reward_fn(completion, problem, task=self.task))
        return float(self.reward_fn(completion, problem))


def final_answer(completion: str) -> str | None:
    """What a completion answers, for tasks with a reference answer: the last <answer>...</answer>,
    else a GSM8K-style `#### n`, else the last number in the text, else its last non-empty line."""
    answer = last_answer(completion)
    if answer is not None:
        return answer.strip()
    marked = _MARKED_RE.findall(completion)
    if marked:
        return marked[-1].replace(",", "")
    found = _NUMBER_RE.findall(completion.replace("\u2212", "-"))
    if found:
        return found[-1].replace(",", "")
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def answer_matches(completion: str, answer: str) -> bool:
    """The completion's final answer equals the reference: as numbers when both are numbers
    ("18.00" == "18"), else as text with surrounding space and case ignored."""
    predicted = final_answer(completion)
    if predicted is None:
        return False
    numbers = [_NUMBER_RE.fullmatch(str(x).strip().removeprefix("+").removesuffix(".")) for x in (predicted, answer)]
    if all(numbers):  # "1,234", "18.00", "+5", "18."; not "1,5" (two numbers) nor "1_0" (float's)
        return float(numbers[0][0].replace(",", "")) == float(numbers[1][0].replace(",", ""))
    return predicted.strip().lower() == str(answer).strip().lower()


def load_reward(spec: str):
    """`module:function` (a module importable from the working directory, or a path to a .py file) -> the function,
    which takes (completion: str, problem: Problem) and returns a float (with a third parameter named `task`, it is also
    given the task: Customised); one line naming --reward when it cannot be loaded."""
    import importlib
    import importlib.util
    import sys

    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise SystemExit(f"error: --reward: expected module:function (e.g. my_rewards:score), got {spec!r}")
    try:
        if module_name.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # the user's own module, beside where they run the script
            module = importlib.import_module(module_name)
    except Exception as e:
        raise SystemExit(f"error: --reward: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise SystemExit(f"error: --reward: {module_name!r} has no function {function_name!r}")
    return function


def _rows_to_problems(rows, prompt_field: str, answer_field: str, source: str) -> list[Problem]:
    problems = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or prompt_field not in row:
            raise SystemExit(f"error: --prompt-field: row {i} of {source} has no field {prompt_field!r} "
                             f"(its fields: {sorted(row) if isinstance(row, dict) else type(row).__name__})")
        problems.append(Problem(prompt=str(row[prompt_field]), answer=str(row.get(answer_field, ""))))
    return problems


def _split(problems: list[Problem], seed: int, test_size: int) -> tuple[list[Problem], list[Problem]]:
    """Hold out min(test_size, a tenth) of the problems, the same ones for every seed; the rest is the
    train split in an order drawn from `seed`."""
    if len(problems) < 2:
        raise SystemExit(f"error: --task: {len(problems)} problem(s): a train and a held-out split need at least 2")
    problems = list(problems)
    random.Random(HELD_OUT_SEED).shuffle(problems)
    held_out = max(1, min(test_size, len(problems) // 10))
    train = problems[held_out:]
    random.Random(seed).shuffle(train)
    return train, problems[:held_out]


def _load_hub_dataset(*args, **kwargs):
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise SystemExit("error: --task: Hub tasks need the `datasets` package: pip install -e '.[hub]'; "
                         "offline, use --task countdown") from e
    try:
        return load_dataset(*args, **kwargs)
    except Exception as e:  # the Hub's errors are many; the user needs one line
        raise SystemExit(
            f"error: --task: could not load dataset {args[0]!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            "Offline? Use --task countdown (the offline generator)."
        ) from e


BUILT_IN = ("countdown", "countdown-steps", "countdown-hub", "arithmetic", "gsm8k", "tldr")
HUB_TASKS = ("countdown-hub", "gsm8k", "tldr")  # loaded from the Hugging Face Hub (the datasets package)


def make_task(name: str, seed: int, tiny_prompts: bool, test_size: int = 200, gsm8k_match: str = "strict",
              reward: str | None = None, prompt_field: str = "prompt", answer_field: str = "answer",
              system_prompt: str | None = None) -> Any:
    """The task `name` (see _built_in_or_data), with its reward replaced by `reward` ("module:function",
    see load_reward) and its chat system turn by `system_prompt` when given ("" for none: no system turn at all, not
    even the one a chat template such as SmolLM2's inserts when given none); what counts as correct stays the task's."""
    task = _built_in_or_data(name, seed, tiny_prompts, test_size, gsm8k_match, prompt_field, answer_field)
    if reward or system_prompt is not None:
        return Customised(task, load_reward(reward) if reward else None, system_prompt)
    return task


def _built_in_or_data(name: str, seed: int, tiny_prompts: bool, test_size: int, gsm8k_match: str, prompt_field: str,
                      answer_field: str) -> Any:
    """`countdown`: the offline generator. `countdown-steps`: the same with 3-7 numbers, long-tailed (the tiny model is
    built to answer it step by step: answers of widely varying length). `countdown-hub`: Jiayi-Pan/Countdown-Tasks-3to4
    (the TinyZero data; the first `test_size` rows of a shuffle by HELD_OUT_SEED are held out, the rest is the train
    split, in an order drawn from `seed`). `gsm8k`: openai/gsm8k with its own train/test splits in the dataset's order,
    scored by `gsm8k_match` ("strict": only `#### n` counts; "loose": else the last number). The test split never
    depends on `seed`. Hub tasks need network access to the Hub."""
    template = TINY_PROMPT if tiny_prompts else CHAT_PROMPT
    if name == "countdown":
        if tiny_prompts:
            return CountdownTask(seed=seed, **TINY_TASK)
        return CountdownTask(seed=seed, max_number=99, prompt_template=template)
    if name == "countdown-steps":  # the long-tail workload (a real model works its steps in <think>)
        if tiny_prompts:
            return CountdownTask(seed=seed, **TINY_STEPS_TASK)
        return CountdownTask(seed=seed, max_number=99, max_numbers=7, number_weights=STEPS_NUMBER_WEIGHTS,
                             prompt_template=template, name="countdown-steps")
    if name == "arithmetic":
        return ArithmeticTask(seed=seed)
    if name == "countdown-hub":
        rows = _load_hub_dataset("Jiayi-Pan/Countdown-Tasks-3to4", split="train")
        problems = [Problem(prompt=template.format(numbers=" ".join(map(str, r["nums"])), numbers_list=r["nums"],
                                                   target=r["target"]),
                            numbers=list(r["nums"]), target=int(r["target"]), system=CHAT_SYSTEM,
                            user=CHAT_USER.format(numbers_list=r["nums"], target=r["target"]),
                            assistant_start=CHAT_ASSISTANT_START) for r in rows]
        random.Random(HELD_OUT_SEED).shuffle(problems)  # the held-out rows: the same for every seed
        train = problems[test_size:]
        random.Random(seed).shuffle(train)
        return ListTask(train, problems[:test_size], name, lambda c, p: countdown_reward(c, p.numbers, p.target))
    if name == "gsm8k":
        if gsm8k_match not in ("strict", "loose"):
            raise SystemExit(f"error: --gsm8k-match: strict or loose, got {gsm8k_match!r}")
        data = _load_hub_dataset("openai/gsm8k", "main")
        # realtreetune/rho-1b-sft-GSM8K's fine-tuning format, the authors' prompt (async_rlhf src/gsm8k_utils.py)
        to_problem = lambda r: Problem(prompt=GSM8K_PROMPT.format(r["question"]),  # noqa: E731
                                       answer=r["answer"], user=r["question"])
        # all 1319 test problems in the dataset's order, whatever the seed; evaluate(num_problems=None) scores them all,
        # as the paper does
        return ListTask([to_problem(r) for r in data["train"]], [to_problem(r) for r in data["test"]],
                        name, lambda c, p: gsm8k_reward(c, p.answer, gsm8k_match))
    if name == "tldr":  # TL;DR summarisation (the Asynchronous RLHF paper's main task): scored by --reward-model
        data = _load_hub_dataset("trl-lib/tldr")
        train = _rows_to_problems(data["train"], "prompt", "completion", "trl-lib/tldr")
        test = _rows_to_problems(data["validation"], "prompt", "completion", "trl-lib/tldr")[:test_size]
        random.Random(seed).shuffle(train)
        return ListTask(train, test, name, lambda c, p: 0.0, correct_fn=lambda c, p: False)
    if name.endswith((".jsonl", ".json")):  # your own prompts: one JSON object a line
        path = Path(name).expanduser()
        if not path.is_file():
            raise SystemExit(f"error: --task: no such file: {name}")
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: --task: {name} line {number} is not JSON ({e.msg})") from None
        train, test = _split(_rows_to_problems(rows, prompt_field, answer_field, name), seed, test_size)
        return ListTask(train, test, path.stem, lambda c, p: float(answer_matches(c, p.answer)),
                        correct_fn=lambda c, p: answer_matches(c, p.answer))
    # a dataset on the Hub: hf:NAME or hf:NAME:CONFIG, its train split (and test, if it has one)
    if name.startswith("hf:"):
        dataset, _, config = name[3:].partition(":")
        data = _load_hub_dataset(dataset, config or None)
        if "train" not in data:
            raise SystemExit(f"error: --task: {dataset} has no train split (it has {', '.join(data)})")
        problems = _rows_to_problems(data["train"], prompt_field, answer_field, dataset)
        held_out = next((split for split in ("test", "validation") if split in data), None)
        if held_out:
            train, test = problems, _rows_to_problems(data[held_out], prompt_field, answer_field, dataset)[:test_size]
            random.Random(seed).shuffle(train)
        else:
            train, test = _split(problems, seed, test_size)
        return ListTask(train, test, dataset, lambda c, p: float(answer_matches(c, p.answer)),
                        correct_fn=lambda c, p: answer_matches(c, p.answer))
    raise SystemExit(f"error: --task: unknown task {name!r}: one of {', '.join(BUILT_IN)}, a .jsonl file or hf:DATASET")


# --------------------------------------------------------------------------------------
# Prompts, the reward model and held-out evaluation
# --------------------------------------------------------------------------------------


class RewardModel:
    """Any HF AutoModelForSequenceClassification with num_labels=1, scored in batches."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(path)
        self.model = load_hf(AutoModelForSequenceClassification, path, num_labels=1).to(device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # pad: EOS if none
        self.device, self.batch_size = device, batch_size

    def conversations(self, problems: list[Problem], completions: list[str]) -> list[str]:
        """What the reward model reads: the exchange in its own chat template when its tokenizer has one
        (the user turn, and the reply with the start the task gave it), else the prompt and the completion."""
        if not getattr(self.tokenizer, "chat_template", None):
            return [p.prompt + c for p, c in zip(problems, completions)]
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p.user or p.prompt},
                                                    {"role": "assistant", "content": p.assistant_start + c}],
                                                   tokenize=False)
                for p, c in zip(problems, completions)]

    def score(self, texts: list[str]) -> list[float]:
        import torch

        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=True)
            with torch.no_grad():
                logits = self.model(**batch.to(self.device)).logits
            scores += logits[:, 0].float().tolist()
        return scores


def rm_position(tokens: list[int], pad_token_id: int | None) -> int:
    """Where a transformers sequence classifier reads its score: the rightmost token not its pad id (pad == eos: before
    an ending EOS), whatever the mask; no pad id: the last; all pads: 0."""
    if pad_token_id is None:
        return len(tokens) - 1
    return next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i] != pad_token_id), 0)


def encode_prompts(tokenizer, problems: list[Problem], max_prompt_tokens: int,
                   chat_template: bool = False) -> tuple[list[Problem], list[list[int]], int]:
    """Tokenize prompts, skipping (not crashing on) those longer than `max_prompt_tokens`. `chat_template` (instruct
    models): the problem's system turn (chat_text) and user turn (its `user`, else its prompt) in the tokenizer's chat
    template with the assistant's generation prompt, then the start of the assistant's reply the task gives (TinyZero's
    instruct setting: "Let me solve this step by step.\n<think>"), which the model continues. Returns the kept
    problems, their token ids and how many were skipped (log it)."""
    kept, ids = [], []
    for problem in problems:
        if chat_template:
            text = chat_text(tokenizer, problem)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own special tokens
        else:
            tokens = tokenizer(problem.prompt, add_special_tokens=True)["input_ids"]
        if len(tokens) <= max_prompt_tokens:
            kept.append(problem)
            ids.append(list(tokens))
    return kept, ids, len(problems) - len(kept)


def chat_text(tokenizer, problem: Problem) -> str:
    """The problem in the tokenizer's chat template with the assistant's generation prompt, then the start of its reply
    (encode_prompts). Its system turn: the problem's; a template's default one when the problem has none (""); none
    at all when it is None (--system-prompt "")."""
    messages = [{"role": "user", "content": problem.user or problem.prompt}]
    if problem.system is None:
        return _without_system_turn(tokenizer, messages) + problem.assistant_start
    if problem.system:
        messages.insert(0, {"role": "system", "content": problem.system})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + problem.assistant_start


def _without_system_turn(tokenizer, messages: list[dict]) -> str:
    """`messages` in the chat template with no system turn. A template that inserts a default one when given none
    (SmolLM2's, Qwen2.5's) is given an empty one, and what that renders alone is cut from the front (a leading BOS
    token that the rest lacks is kept: Llama 3's); a template that renders it otherwise (inside the first user turn)
    keeps the empty system message, and one that has no system role renders the messages alone."""
    from jinja2 import TemplateError

    empty = [{"role": "system", "content": ""}]
    try:
        with_empty = tokenizer.apply_chat_template(empty + messages, add_generation_prompt=True, tokenize=False)
        empty_turn = tokenizer.apply_chat_template(empty, tokenize=False)
    except TemplateError:  # no system role (Gemma's template raises): it inserts no system turn either
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not empty_turn or not with_empty.startswith(empty_turn):
        return with_empty
    rest, bos = with_empty[len(empty_turn):], tokenizer.bos_token or ""
    return (bos if bos and empty_turn.startswith(bos) and not rest.startswith(bos) else "") + rest


def check_prompts_fit(tokenizer, task, max_prompt_tokens: int, chat_template: bool = False, sample: int = 64) -> None:
    """Stop with one line when none of the first `sample` training prompts fits the prompt budget:
    every round would skip all of its prompts (a silent loop or an empty batch otherwise)."""
    problems = [task.problem("train", i) for i in range(sample)]
    kept, ids, _ = encode_prompts(tokenizer, problems, max_prompt_tokens, chat_template)
    if not kept:
        shortest = min(len(encode_prompts(tokenizer, [p], 10**9, chat_template)[1][0]) for p in problems)
        raise SystemExit(f"error: --model/--task: every prompt is longer than the prompt budget of {max_prompt_tokens} "
                         f"tokens (the shortest of the first {sample} has {shortest}); use a model with a longer "
                         "context or shorter prompts")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    return (1.0 if num_samples - num_correct < k
            else 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k))


def evaluate(sampler: Sampler, task, tokenizer, num_problems: int | None, samples_per_problem: int,
             max_prompt_tokens: int, chat_template: bool = False, **sampling) -> dict[str, float]:
    """pass@k for every k the samples allow (eval_ks) on the first `num_problems` held-out problems (None: a fixed
    dataset's whole test split), sampled with `sampling` (temperature=0: greedy pass@1, as GSM8K's evaluations) by the
    sampler's weights once a push in flight has landed; all asked for at once, waited for in twenty parts (Progress)."""
    getattr(sampler, "wait_for_push", lambda: None)()  # (PipelineRL's background push: one version scores them all)
    if hasattr(task, "test"):  # a fixed split: each problem once, not wrapped around (None: all of them)
        num_problems = min(num_problems or len(task.test), len(task.test))
    problems, prompts, _ = encode_prompts(tokenizer, [task.problem("test", i) for i in range(num_problems)],
                                          max_prompt_tokens, chat_template)
    ids = sampler.submit(prompts, n=samples_per_problem, **sampling)
    samples: list[Completion] = []
    with Progress(len(ids), "eval", unit="sample", leave=False) as progress:
        for start in range(0, len(ids), part := max(1, math.ceil(len(ids) / 20))):
            samples += sampler.wait_for(ids[start:start + part])
            progress.update(len(ids[start:start + part]))
    correct = [sum(task.is_correct(s.text, p) for s in samples[i * samples_per_problem:(i + 1) * samples_per_problem])
               for i, p in enumerate(problems)]
    return {f"eval/pass@{k}": float(np.mean([pass_at_k(samples_per_problem, c, k) for c in correct]))
            for k in eval_ks(samples_per_problem)} | {
        "eval/problems": float(len(correct)), "eval/samples": float(samples_per_problem)}


def eval_ks(samples_per_problem: int) -> list[int]:
    """The k of pass@k that n samples per problem allow: the powers of two up to n, and n itself (n = 6: 1, 2, 4, 6)."""
    return sorted({2**i for i in range(samples_per_problem.bit_length())} | {samples_per_problem})


def load(args, model_path: str, sampler=None, greedy_eval: bool = False):
    """The tokenizer, the task the flags name (--task, --reward, --prompt-field, --answer-field, --system-prompt,
    DPO's --gsm8k-match) and its held-out evaluation through `sampler` (evaluator: `greedy_eval` for DPO's
    --eval-decoding greedy), with the check that needs the tokenizer: some prompt fits --max-prompt-tokens. It runs
    while the sampler starts, and a failure closes it."""
    tokenizer = load_tokenizer(model_path)
    task = make_task(args.task, args.seed, tiny_prompts=args.model == "tiny",
                     gsm8k_match=getattr(args, "gsm8k_match", "strict"), reward=args.reward,
                     prompt_field=args.prompt_field, answer_field=args.answer_field,
                     system_prompt=args.system_prompt)
    check_prompts_fit(tokenizer, task, args.max_prompt_tokens, args.chat_template)
    return tokenizer, task, evaluator(sampler, task, tokenizer, args, greedy=greedy_eval)


class TrainProblems:
    """The training split in data order, for the sampler; `position`: the next problem's (a checkpoint keeps it)."""

    def __init__(self, task, tokenizer, args, position: int = 0):
        self.task, self.tokenizer, self.args, self.position = task, tokenizer, args, position

    def problem(self, position: int) -> Problem:
        return self.task.problem("train", position)

    def take(self, n: int):
        """The next n problems whose prompts fit --max-prompt-tokens, reading on past those that do not: (the problems,
        their prompts' token ids, how many were skipped). Stops in one line once a call has skipped 10n + 1000."""
        problems, ids, skipped = [], [], 0
        while len(problems) < n:
            if skipped >= 10 * n + 1000:  # (nearly every prompt longer than the budget: no hang)
                raise SystemExit(f"error: --max-prompt-tokens: {skipped} training prompts too long for a round of {n}")
            read, self.position = n - len(problems), self.position + n - len(problems)
            more = encode_prompts(self.tokenizer, [self.problem(self.position - read + i) for i in range(read)],
                                  self.args.max_prompt_tokens, self.args.chat_template)
            problems, ids, skipped = problems + more[0], ids + more[1], skipped + more[2]
        return problems, ids, skipped


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def train_index(position: int, split_size: int | None, seed: int, shuffle: bool) -> int:
    """The train problem read at data position `position` (positions run on across epochs): epoch position //
    split_size reads the split in a permutation drawn from (seed, epoch), a pure function, so a resumed run reads what
    the uninterrupted one would have. split_size None (a generator: no epochs) or shuffle off: the position itself (a
    list task wraps it)."""
    if split_size is None or not shuffle:
        return position
    epoch, offset = divmod(position, split_size)
    return int(_epoch_order(seed, epoch, split_size)[offset])


class ShuffledTrainProblems(TrainProblems):
    """TrainProblems with a fixed train split (a ListTask: gsm8k, countdown-hub) read in a new order every epoch,
    drawn from --seed and the epoch (train_index; args.shuffle_train off: the split's own order); online DPO's data
    order, as the authors' DataLoader(shuffle=True)."""

    def problem(self, position: int) -> Problem:
        size = len(self.task.train) if hasattr(self.task, "train") else None  # a fixed split (Customised's too): epochs
        return self.task.problem("train", train_index(position, size, self.args.seed, self.args.shuffle_train))


def evaluator(sampler, task, tokenizer, args, greedy: bool = False):
    """pass@k on the held-out split as the flags say (--eval-problems, 0: a fixed dataset's whole test split;
    --eval-samples), sampling as in training (--temperature, --top-p, --max-new-tokens), or with `greedy` one greedy
    completion per problem (DPO's --eval-decoding greedy): a function of no arguments ({} without a sampler)."""
    return lambda: {} if sampler is None else evaluate(
        sampler, task, tokenizer, args.eval_problems or None, args.eval_samples, args.max_prompt_tokens,
        args.chat_template, temperature=0.0 if greedy else args.temperature, top_p=1.0 if greedy else args.top_p,
        max_tokens=args.max_new_tokens)
