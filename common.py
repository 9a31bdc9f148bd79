"""Plumbing shared by the four method scripts: tasks and rewards, the built-in tiny model,
the vLLM sampler process and learner -> sampler weight sync, learner helpers, logging and
checkpoints. Algorithm logic lives in the scripts, not here.

Terms (DESIGN.md section 8): a *sampling round* is one batch of prompts sent to the sampler
and its completions returned; a *step* is one optimizer.step(); an *episode* is one completion
used for training; the *policy version* of a token is the number of steps the weights that
produced it had seen; *lag* = learner version - token version.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

# --------------------------------------------------------------------------------------
# Errors and argument checks
# --------------------------------------------------------------------------------------


class SamplerError(RuntimeError):
    """The sampler process failed, died or stopped answering."""


def check_args(condition: bool, flag: str, message: str) -> None:
    """Reject a nonsensical flag value at start-up with a message that names the flag."""
    if not condition:
        raise SystemExit(f"error: {flag}: {message}")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def limit_cpu_threads() -> None:
    """On a 2-core machine the learner, the sampler and OpenMP spin-waits fight for cores;
    one thread per process was 4-6x faster than two (vllm-notes.md)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


# --------------------------------------------------------------------------------------
# Tasks and rewards
# --------------------------------------------------------------------------------------

COUNTDOWN_FORMAT_SCORE = 0.1  # TinyZero: a well-formed but wrong answer
_MAX_ABS_VALUE = 10**12  # larger intermediate values are treated as malformed


class _Unsafe(ValueError):
    pass


def safe_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Evaluate `expression` allowing only non-negative integer literals, parentheses and
    + - * /, exactly (Fractions). Returns (value, integer literals used). Raises ValueError on
    anything else (names, calls, **, unary ops, floats), on division by zero and on huge values."""
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
    `re.finditer(r"<answer>(.*?)</answer>")` does, in time linear in the completion (the regex
    is quadratic in unclosed <answer> tags: 2.6 s for a 72 KB completion)."""
    found, position = None, 0
    while (start := completion.find("<answer>", position)) >= 0:
        end = completion.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, position = completion[start + len("<answer>"): end], end + len("</answer>")
    return found


def countdown_reward(completion: str, numbers: list[int], target: int, format_score: float = COUNTDOWN_FORMAT_SCORE) -> float:
    """TinyZero convention: 1 for a correct equation in the last <answer>...</answer> that uses
    each given number exactly once; `format_score` for a well-formed but wrong answer; 0 when
    there is no answer."""
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
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_MARKED_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def gsm8k_extract(text: str) -> str | None:
    """The final answer of a GSM8K solution. The dataset's format puts it right after '####': the
    first number after the last '####' that is followed by one (text after the answer, or a
    trailing '####', does not change it). Without a marked answer, the last number in the text.
    Unicode minus signs count as minus."""
    text = text.replace("\u2212", "-")
    marked = _MARKED_RE.findall(text)
    if marked:
        return marked[-1].replace(",", "")
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_reward(completion: str, answer: str) -> float:
    """Exact match on the final number, commas removed, compared numerically ("18.00" == "18")."""
    predicted, expected = gsm8k_extract(completion), gsm8k_extract(answer)
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


def _solution_string(rng: np.random.Generator, numbers: list[int], max_target: int) -> tuple[str, int] | None:
    """Combine `numbers` in random order with random ops into one expression whose every
    intermediate value is a non-negative integer; returns (expression, value)."""
    # each item: (text, value, precedence) with precedence 2 for atoms/products, 1 for sums
    items = [(str(n), n, 3) for n in numbers]
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
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [(text, value, prec)]
    text, value, _ = items[0]
    if not (1 <= value <= max_target):
        return None
    return text, value


TINY_PROMPT = "{numbers}->{target}:"
CHAT_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer.\nUser: Using the numbers {numbers_list}, create an "
    "equation that equals {target}. You can use basic arithmetic operations (+, -, *, /) and "
    "each number can only be used once. Show your work in <think> </think> tags. And return "
    "the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n<think>"
)


@dataclass
class CountdownTask:
    """Offline Countdown generator: problem i of a split is a pure function of (seed, split, i),
    so a data position is one integer. Train and test are disjoint by a hash of the problem."""

    seed: int = 0
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 20
    max_target: int = 100
    prompt_template: str = TINY_PROMPT
    name: str = "countdown"

    def problem(self, split: str, index: int) -> Problem:
        attempt = 0
        while True:
            rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, index, attempt])
            attempt += 1
            count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
            numbers = [int(x) for x in rng.integers(1, self.max_number + 1, size=count)]
            made = _solution_string(rng, numbers, self.max_target)
            if made is None:
                continue
            solution, target = made
            in_test = int(hashlib.sha1(f"{sorted(numbers)}|{target}".encode()).hexdigest(), 16) % 10 == 0
            if in_test != (split == "test"):
                continue
            prompt = self.prompt_template.format(
                numbers=" ".join(map(str, numbers)), numbers_list=numbers, target=target
            )
            return Problem(prompt=prompt, numbers=numbers, target=target, answer=solution)

    def reward(self, completion: str, problem: Problem) -> float:
        return countdown_reward(completion, problem.numbers, problem.target)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return self.reward(completion, problem) == 1.0

    def completion_text(self, problem: Problem) -> str:
        """The supervised target used to build the tiny model."""
        return f"<answer>{problem.answer}</answer>"


@dataclass
class ListTask:
    """A task over a fixed list of problems (a Hub dataset); index wraps around."""

    train: list[Problem]
    test: list[Problem]
    name: str
    reward_fn: Any

    def problem(self, split: str, index: int) -> Problem:
        problems = self.train if split == "train" else self.test
        return problems[index % len(problems)]

    def reward(self, completion: str, problem: Problem) -> float:
        return self.reward_fn(completion, problem)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return self.reward(completion, problem) == 1.0


def _load_hub_dataset(*args, **kwargs):
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise SystemExit("error: --task: Hub tasks need the `datasets` package: pip install -e '.[hub]'; offline, use --task countdown") from e
    try:
        return load_dataset(*args, **kwargs)
    except Exception as e:  # the Hub's errors are many; the user needs one line
        raise SystemExit(
            f"error: could not load dataset {args[0]!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
            "Offline? Use --task countdown (the offline generator)."
        ) from e


def make_task(name: str, seed: int, tiny_prompts: bool, test_size: int = 200) -> Any:
    """`countdown`: the offline generator. `countdown-hub`: Jiayi-Pan/Countdown-Tasks-3to4 (the
    TinyZero data; its first `test_size` shuffled rows are held out). `gsm8k`: openai/gsm8k with its
    own train/test splits. Hub tasks need network access to the Hub."""
    template = TINY_PROMPT if tiny_prompts else CHAT_PROMPT
    if name == "countdown":
        if tiny_prompts:
            return CountdownTask(seed=seed, **TINY_TASK)
        return CountdownTask(seed=seed, max_number=99, prompt_template=template)
    if name == "countdown-hub":
        rows = _load_hub_dataset("Jiayi-Pan/Countdown-Tasks-3to4", split="train")
        problems = [
            Problem(prompt=template.format(numbers=" ".join(map(str, r["nums"])), numbers_list=r["nums"], target=r["target"]),
                    numbers=list(r["nums"]), target=int(r["target"]))
            for r in rows
        ]
        random.Random(seed).shuffle(problems)
        return ListTask(problems[test_size:], problems[:test_size], name,
                        lambda c, p: countdown_reward(c, p.numbers, p.target))
    if name == "gsm8k":
        data = _load_hub_dataset("openai/gsm8k", "main")
        to_problem = lambda r: Problem(prompt=f"Question: {r['question']}\nAnswer:", answer=r["answer"])  # noqa: E731
        # the whole test split (1319 problems): evaluate(num_problems=None) scores all of it, as the paper does
        return ListTask([to_problem(r) for r in data["train"]], [to_problem(r) for r in data["test"]],
                        name, lambda c, p: gsm8k_reward(c, p.answer))
    raise SystemExit(f"error: --task: unknown task {name!r} (countdown, countdown-hub, gsm8k)")


class RewardModel:
    """Any HF AutoModelForSequenceClassification with num_labels=1, scored in batches."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = load_tokenizer(path)
        self.model = load_hf(AutoModelForSequenceClassification, path, num_labels=1).to(device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True, truncation=True)
            logits = self.model(**batch.to(self.device)).logits
            scores += logits[:, 0].float().tolist()
        return scores


# --------------------------------------------------------------------------------------
# Models: loading with clear errors, and the built-in tiny model
# --------------------------------------------------------------------------------------

TINY = "tiny"
# The tiny model's Countdown: three numbers 1-9, short prompts; small enough that a 0.6M-parameter
# model starts with some success and RL has room to improve it.
TINY_TASK = dict(min_numbers=3, max_numbers=3, max_number=9, max_target=100, prompt_template=TINY_PROMPT)
CACHE_DIR = Path(os.environ.get("FASTRL_CACHE", Path.home() / ".cache" / "fastrl"))
TINY_SPECIAL = ["<pad>", "<eos>", "<unk>"]
TINY_ADDED = ["<answer>", "</answer>"]


@dataclass(frozen=True)
class TinyConfig:
    """The built-in model: a small Qwen2 (tied embeddings, like Qwen2.5-0.5B) with a character
    tokenizer, briefly supervised on the offline Countdown generator."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 128
    sft_steps: int = 450
    sft_batch_size: int = 64
    sft_lr: float = 2e-3

    def key(self) -> str:
        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def _tiny_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL)}
    for c in "\n" + "".join(chr(i) for i in range(32, 127)):
        vocab[c] = len(vocab)
    # BPE with no merges splits text into single characters; Fuse joins them back on decode
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in TINY_SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def build_tiny_model(out_dir: str | Path, config: TinyConfig = TinyConfig(), log=print) -> Path:
    """Build, briefly fine-tune and save the tiny model as a normal HF directory. Deterministic
    for a given config on a given machine (one CPU thread, fixed seeds)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        set_seed(config.seed)
        tokenizer = _tiny_tokenizer()
        model_config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
        )
        model = Qwen2ForCausalLM(model_config)
        task = CountdownTask(seed=config.seed, **TINY_TASK)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.sft_lr, total_steps=config.sft_steps, pct_start=0.1)
        start = time.time()
        for step in range(config.sft_steps):
            problems = [task.problem("train", step * config.sft_batch_size + i) for i in range(config.sft_batch_size)]
            prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
            completions = [tokenizer(task.completion_text(p))["input_ids"] + [tokenizer.eos_token_id] for p in problems]
            input_ids, attention_mask, completion_mask = pad_prompt_completions(prompts, completions, tokenizer.pad_token_id)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            labels = input_ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            if step % 50 == 0 or step == config.sft_steps - 1:
                log(f"[tiny model] sft step {step + 1}/{config.sft_steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "tiny_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))

        replace_atomically(write, out_dir)  # a half-built model is never picked up from the cache
    finally:
        torch.set_num_threads(threads)
    return out_dir


def tiny_model_path(config: TinyConfig = TinyConfig(), log=print) -> Path:
    """The cached tiny model, built on first use (about 2 minutes on 2 cores)."""
    return cached_build(CACHE_DIR / f"tiny-qwen2-{config.key()}", lambda path: build_tiny_model(path, config, log=log),
                        lambda: log(f"building the tiny model into {CACHE_DIR} (once; cached afterwards)"))


def cached_build(path: Path, build, announce=lambda: None) -> Path:
    """Build a model directory into the cache once: under a file lock, so that runs started
    together build it once (the others wait, then find it); the build writes a temporary
    directory and renames it, so a half-built model is never picked up."""
    import fcntl

    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            announce()
            build(path)
    return path


def resolve_model(name: str) -> str:
    """`tiny` -> the built-in model's directory; anything else is passed on as a local path or
    Hub id."""
    return str(tiny_model_path()) if name == TINY else name


def check_context(model_path: str, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt budget + response cap must fit the model's context, or vLLM refuses to start."""
    from transformers import AutoConfig

    context = getattr(load_hf(AutoConfig, model_path), "max_position_embeddings", None)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise SystemExit(f"error: --max-new-tokens: {max_new_tokens} response tokens + {max_prompt_tokens} prompt tokens exceed "
                         f"the model's context of {context} tokens; use --max-new-tokens {context - max_prompt_tokens} or less")


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


def load_policy(path: str, device: str | torch.device, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return load_hf(AutoModelForCausalLM, path, dtype=dtype).to(device)


# --------------------------------------------------------------------------------------
# Learner helpers: padding and logprobs
# --------------------------------------------------------------------------------------


def pad_prompt_completions(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Right-pad prompt+completion rows. Returns input_ids, attention_mask and completion_mask
    (1 on completion tokens), all [batch, max_len]."""
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    completion_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[row, : len(p) + len(c)] = 1
        completion_mask[row, len(p): len(p) + len(c)] = 1
    return input_ids, attention_mask, completion_mask


def sampling_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: int = 0) -> torch.Tensor:
    """The logits of the distribution the sampler actually samples from, as vLLM builds it
    (vllm/v1/sample/sampler.py `sample`, vllm/v1/sample/ops/topk_topp_sampler.py
    `apply_top_k_top_p_pytorch`): divide by the temperature, then drop (-inf) what top-k and
    top-p exclude: sort ascending, keep the tokens whose cumulative probability from the top
    reaches top_p, always the most likely one. log_softmax of the result equals vLLM's
    `processed_logprobs`, renormalised over the kept tokens.

    The kept set is a constant for autograd (the gradient flows through the kept logits), and
    the token actually sampled (`targets`) is always kept: the learner's nucleus can differ
    from the sampler's at its edge (another precision) or after a few optimizer steps, and a
    -inf logprob would turn every ratio and loss into inf/NaN. logits: [..., V] fp32;
    targets: [...] token ids."""
    logits = logits / temperature
    if top_p >= 1.0 and top_k <= 0:
        return logits
    with torch.no_grad():
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if 0 < top_k < logits.shape[-1]:
            drop |= sorted_logits < sorted_logits[..., -top_k, None]
        if top_p < 1.0:
            cumulative = sorted_logits.masked_fill(drop, -float("inf")).softmax(dim=-1).cumsum(dim=-1)
            drop |= cumulative <= 1 - top_p
        drop[..., -1] = False  # at least the most likely token
        drop = drop.scatter(-1, order, drop)  # back to vocabulary order
        drop.scatter_(-1, targets.unsqueeze(-1), False)
    return logits.masked_fill(drop, -float("inf"))


LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of positions; a [B, T, V] copy at V=151,936 is tens of GB


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = 0, with_entropy: bool = False, chunk_bytes: int = LOGIT_CHUNK_BYTES):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens under `model`, in fp32, under the
    sampler's processing (temperature, top-k, top-p: see sampling_logits). This is the logprob
    contract: at the sampler's weights these equal the sampler's `processed_logprobs` (~1e-6 in
    fp32), so every ratio a method forms compares distributions of the same kind. Returns
    [batch, len-1] tensors aligned with input_ids[:, 1:], zero off the completion, plus the
    per-token entropy of the same distribution when asked.

    Memory: the backbone runs once; the vocabulary projection, softmax and entropy run over
    chunks of positions of at most `chunk_bytes` of fp32 logits each, and with gradients each
    chunk is recomputed in the backward pass (activation checkpointing), so no [B, T, V] copy
    is ever alive beyond one chunk."""
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    decoder, head = _backbone_and_head(model)
    if decoder is None:  # a model whose head does more than a projection: the plain way
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        chosen, entropy = _chunk_logprobs(logits, targets, temperature, top_p, top_k, with_entropy)
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        per_chunk = max(1, chunk_bytes // (4 * hidden.shape[0] * head.weight.shape[0]))
        pieces = []
        for start in range(0, hidden.shape[1], per_chunk):
            part = slice(start, start + per_chunk)

            def run(h, t):
                return _chunk_logprobs(head(h), t, temperature, top_p, top_k, with_entropy)

            if torch.is_grad_enabled() and hidden.shape[1] > per_chunk:
                from torch.utils.checkpoint import checkpoint

                pieces.append(checkpoint(run, hidden[:, part], targets[:, part], use_reentrant=False))
            else:
                pieces.append(run(hidden[:, part], targets[:, part]))
        chosen = torch.cat([c for c, _ in pieces], 1)
        entropy = torch.cat([e for _, e in pieces], 1) if with_entropy else None
    if not with_entropy:
        return chosen * mask
    return chosen * mask, entropy * mask


def _backbone_and_head(model):
    """(decoder, lm_head) when logits are just lm_head(last hidden state), else (None, None)."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) or not hasattr(model, "get_decoder"):
        return None, None
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None, None
    return model.get_decoder(), head


def _chunk_logprobs(logits, targets, temperature, top_p, top_k, with_entropy):
    logps = torch.log_softmax(sampling_logits(logits.float(), targets, temperature, top_p, top_k), dim=-1)
    chosen = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    probs = logps.exp()
    return chosen, -(probs * logps.masked_fill(probs == 0, 0.0)).sum(-1)  # excluded tokens: 0 * -inf -> 0


def sampler_logprob_tensor(samples: list["Completion"], prompt_lens: list[int], width: int) -> torch.Tensor:
    """The sampler's per-token logprobs laid out like token_logprobs' output."""
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, (s, plen) in enumerate(zip(samples, prompt_lens)):
        out[row, plen - 1: plen - 1 + len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------
# Sampler process (vLLM) and weight sync
# --------------------------------------------------------------------------------------


@dataclass
class Completion:
    """One sampled response as the sampler returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # sampler's processed logprob of each sampled token
    finish_reason: str | None  # "stop" (EOS), "length", "abort"
    versions: list[tuple[int, int, int]]  # (policy version, start, end) spans over token_ids
    text: str = ""
    tag: Any = None  # the caller's label, returned unchanged (e.g. (prompt index, sample index))
    finished: bool = True  # False for a streamed chunk (only the new tokens)
    finished_at: float = 0.0  # time.time() in the sampler when this was produced

    @property
    def version_min(self) -> int:
        return min(v for v, _, _ in self.versions) if self.versions else 0

    @property
    def version_max(self) -> int:
        return max(v for v, _, _ in self.versions) if self.versions else 0


@dataclass
class SamplerConfig:
    model: str
    placement: str = "auto"  # "cpu", "colocate" (learner's GPU, ipc), "separate" (own GPU, nccl), "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    dtype: str = "auto"  # "auto": bfloat16 on a GPU (half the KV and weight traffic, fast kernels), float32 on CPU
    kv_cache_bytes: int = 256 * 2**20  # CPU only
    gpu_memory_utilization: float | None = None  # GPU only; None: 0.3 when sharing the learner's GPU, 0.85 on its own
    max_num_seqs: int = 256
    startup_timeout: float = 300.0
    call_timeout: float = 120.0
    silence_timeout: float = 15.0  # no heartbeat for this long: the sampler is stopped or frozen (SamplerError)
    in_place_updates: bool = True  # CPU: keep the linear weights, so pushes load in place (see GlooWeightTransferEngine)


def sampler_cuda_device(placement: str, visible: str | None, device_count: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for the sampler process: the learner's own device ("colocate") or the
    next one ("separate"), picked from the devices the learner can see, so that a
    CUDA_VISIBLE_DEVICES the user set (indices, UUIDs or MIG ids) is honoured: the literal "0"/"1"
    would be another GPU (separate) or a UUID mismatch for IPC handles (colocate)."""
    if placement == "cpu":
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(device_count)]
    wanted = 0 if placement == "colocate" else 1
    if len(devices) <= wanted:
        raise SystemExit(f"error: --placement: {placement} needs {wanted + 1} visible GPU(s), found {len(devices)}")
    return devices[wanted]


def engine_settings(config: "SamplerConfig", placement: str) -> dict[str, Any]:
    """vLLM EngineArgs for the sampler, by placement. Pure, so each placement is unit-tested.
    - logprobs of the distribution actually sampled (the logprob contract);
    - async scheduling off: vLLM turns it on by default on CUDA (vllm/config/vllm.py, the
      `async_scheduling is None` branch of VllmConfig.__post_init__), and then `step()` returns
      while the next batch still runs (vllm/v1/engine/core.py, step_with_batch_queue); our loop
      applies weight updates between two step() calls, which would race that batch (and one
      token per running sequence would carry the wrong version label). Off, step() returns with
      the device idle, as vLLM's own pause does by synchronising first;
    - CUDA graphs on a GPU (enforce_eager only on CPU): the layerwise reload copies new weights
      into the original storages, which keeps captured graphs valid
      (vllm/model_executor/model_loader/reload/layerwise.py, "preserves cudagraph refs");
    - bf16 weights on a GPU unless asked, fp32 on CPU (exact comparisons with the learner)."""
    on_gpu = placement != "cpu"
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    settings: dict[str, Any] = dict(
        model=config.model, seed=config.seed, dtype=dtype, max_model_len=config.max_model_len,
        enforce_eager=not on_gpu, logprobs_mode="processed_logprobs", max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=False, async_scheduling=False,
    )
    if on_gpu:
        utilization = config.gpu_memory_utilization
        settings["gpu_memory_utilization"] = utilization if utilization is not None else (0.3 if placement == "colocate" else 0.85)
    else:
        settings["kv_cache_memory_bytes"] = config.kv_cache_bytes
    return settings


def resolve_placement(placement: str) -> str:
    if placement != "auto":
        return placement
    gpus = torch.cuda.device_count()
    return "cpu" if gpus == 0 else ("separate" if gpus >= 2 else "colocate")


def weight_backend(placement: str) -> str:
    return {"cpu": "gloo", "colocate": "ipc", "separate": "nccl"}[placement]


def peak_rss_mib(pid: int | str = "self") -> float:
    """Peak resident set size (VmHWM) of a process in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_memory_mib(sampler: "Sampler | None" = None) -> dict[str, float]:
    """Peak memory of this run: the learner's resident memory, its GPU memory (torch's peak
    allocation) when it has a GPU, and the sampler process's resident memory."""
    memory = {"learner": peak_rss_mib()}
    if torch.cuda.is_available():
        memory["learner_gpu"] = torch.cuda.max_memory_allocated() / 2**20
    if sampler is not None:
        memory["sampler"] = sampler.peak_rss_mib()
    return memory


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the gloo weight-transfer engine (CPU): vLLM's built-in backends need CUDA ----------

_GLOO_REGISTERED = False
_PACK_BYTES = 256 * 2**20


def _pack_plan(dtypes: list[torch.dtype], shapes: list) -> list[list[int]]:
    """Group parameter indices into flat broadcast buffers of one dtype and at most _PACK_BYTES:
    one broadcast per chunk instead of one per tensor (85 -> 39 ms per push for the tiny model).
    Learner and sampler compute the same plan from the same metadata."""
    chunks: list[list[int]] = []
    size = 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        nbytes = math.prod(shape) * dtype.itemsize
        if not chunks or dtypes[chunks[-1][0]] != dtype or size + nbytes > _PACK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nbytes
    return chunks


def gloo_group(host: str, port: int, rank: int, world_size: int, timeout, listen_socket=None):
    """A gloo process group outside torch.distributed's global state (vLLM's
    stateless_init_torch_distributed_process_group, with the gloo device bound to `host`: vLLM's
    binds to whatever the machine's hostname resolves to, which may be a public interface).
    Rank 0 passes a socket it already bound and listens on (`listen_socket`): no port is chosen,
    closed and bound again, so no other process can take it in between."""
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    from vllm.distributed.utils import create_tcp_store

    store = create_tcp_store(host, port, listen_socket=listen_socket, world_size=world_size, is_master=rank == 0,
                             timeout=timeout, wait_for_workers=False)
    prefix_store = PrefixStore(f"tcp://{host}:{port}", store)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    backend = ProcessGroupGloo(prefix_store, rank, world_size, options)
    group = ProcessGroup(prefix_store, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def register_gloo_engine() -> None:
    """Register the CPU weight-transfer backend "gloo" with vLLM's worker and trainer
    factories. Called in both processes before vLLM builds its engine."""
    global _GLOO_REGISTERED
    if _GLOO_REGISTERED:
        return
    from datetime import timedelta

    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    group_timeout = timedelta(seconds=float(os.environ.get("FASTRL_WEIGHT_TIMEOUT", "60")))

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = "gloo"
        master_address: str = "127.0.0.1"
        master_port: int = 0
        world_size: int = 2

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """Worker side: receive broadcasts from the learner (rank 0) and load them.

        The CPU backend packs each linear layer's weight for oneDNN and, by default, frees the
        checkpoint-format weight, so a plain load has nothing to load into; vLLM's layerwise
        reload rebuilds every layer and repacks it, mostly Python. Our sampler keeps those
        weights (keep_cpu_linear_weights), so an update loads them in place and repacks only the
        linear layers: a whole push of the tiny model takes ~18 ms instead of ~35 ms (at 50M the
        transfer dominates: ~410 vs ~440 ms). Where they were not kept (a quantized model, a vLLM
        that packs elsewhere) it falls back to the layerwise reload."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def init_transfer_engine(self, init_info):
            rank = init_info.rank_offset + self.parallel_config.rank
            self.group = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size, group_timeout)

        def kept_linears(self) -> list | None:
            """The linear layers to repack after an in-place load, or None if their weights were
            not kept (then only the layerwise reload can load them)."""
            if not hasattr(self, "_kept_linears"):
                layers = [m for m in self.model.modules() if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
                          and not getattr(m, "_cpu_skip_gemm_dispatch", False)]
                # a freed weight is an empty 1-D tensor
                kept = self.model_config.quantization is None and all(m.weight.dim() == 2 and m.weight.numel() > 0 for m in layers)
                self._kept_linears = layers if kept else None
            return self._kept_linears

        def start_weight_update(self):
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            if self.kept_linears() is None:
                initialize_layerwise_reload(self.model)

        def update_weights(self, update_info):
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator sync on CPU

        def receive_weights(self, update_info):
            dtypes = [getattr(torch, d) for d in update_info.dtype_names]
            for chunk in _pack_plan(dtypes, update_info.shapes):
                flat = torch.empty(sum(math.prod(update_info.shapes[i]) for i in chunk), dtype=dtypes[chunk[0]])
                self.group.broadcast(flat, 0).wait()
                views, offset = [], 0
                for i in chunk:
                    numel = math.prod(update_info.shapes[i])
                    views.append((update_info.names[i], flat[offset: offset + numel].view(update_info.shapes[i])))
                    offset += numel
                self.model.load_weights(views)

        def finish_weight_update(self):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.kept_linears() is None:
                finalize_layerwise_reload(self.model, self.model_config)
            else:  # the weights were loaded in place: repack them for the CPU GEMM
                for layer in self.kept_linears():
                    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            # With tied embeddings the CPU backend's packed lm_head copy stays stale after a
            # reload (vllm-notes.md): re-dispatch it from the freshly loaded embedding.
            head = getattr(self.model, "lm_head", None)
            if head is not None and hasattr(head, "weight") and self.device.type == "cpu":
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)

        def shutdown(self):
            self.group = None

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Learner side, the same shape as vLLM's NCCL trainer engine: drive start -> update
        (concurrently with our broadcast) -> finish through the client."""

        init_info_cls = GlooTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            """Both sides must join at once: ours in one thread, the sampler's in another; the first
            error from either side (the sampler's own traceback included) is raised at once, and
            the whole rendezvous has a deadline."""
            import socket
            from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            # the learner binds the port itself (0: any free one) and keeps it: no race for it
            listen = socket.create_server((init_info.master_address, init_info.master_port))
            port = listen.getsockname()[1]
            worker_info = dict(master_address=init_info.master_address, master_port=port, rank_offset=1,
                               world_size=init_info.world_size)
            pool = ThreadPoolExecutor(max_workers=2)
            try:
                theirs = pool.submit(client.init_weight_transfer_engine, worker_info)
                ours = pool.submit(gloo_group, init_info.master_address, port, 0, init_info.world_size, group_timeout, listen)
                done, _ = wait([theirs, ours], timeout=group_timeout.total_seconds(), return_when=FIRST_EXCEPTION)
                for future in (theirs, ours):
                    if future in done and future.exception() is not None:
                        raise future.exception()
                if len(done) < 2:
                    raise SamplerError(f"the weight-sync rendezvous on {init_info.master_address}:{port} did not complete "
                                       f"within {group_timeout.total_seconds():.0f}s")
                engine.group = ours.result()
            finally:
                pool.shutdown(wait=False)  # never join a thread stuck on a dead peer
            return engine

        def send_weights(self):
            from concurrent.futures import ThreadPoolExecutor

            meta = self.source.metadata()
            update_info = dict(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                               shapes=[list(m.shape) for m in meta])
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                future = pool.submit(self.client.update_weights, update_info)
                tensors = [t for _, t in self.source]
                for chunk in _pack_plan([m.dtype for m in meta], [m.shape for m in meta]):
                    flat = torch.cat([tensors[i].detach().reshape(-1).to("cpu") for i in chunk])
                    self.group.broadcast(flat, 0).wait()
                future.result()
            finally:
                pool.shutdown(wait=False)  # never join a thread stuck on a dead peer
            self.client.finish_weight_update()

        def shutdown(self):
            self.group = None

    WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
    WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)
    _GLOO_REGISTERED = True


# ---- the sampler process ---------------------------------------------------------------


def _sampler_main(config: SamplerConfig, conn, parent_pid: int, cuda_device: str | None) -> None:
    """Entry point of the spawned sampler process: owns an in-process vLLM engine and drives it
    step by step, so that commands (new requests, weight updates, pause) are applied between
    two decode steps and results stream back as soon as they exist."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: ~2.5 s start, not ~20 s
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cuda_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_device
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which shuts us down
    outbox = _Outbox(conn)
    threading.Thread(target=_heartbeat, args=(outbox, parent_pid), name="heartbeat", daemon=True).start()
    try:
        _serve(config, conn, parent_pid, outbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the learner is gone: nothing to report to
    except BaseException:
        outbox.send(("fatal", None, traceback.format_exc()))
    finally:
        closing = threading.Thread(target=outbox.flush, kwargs={"block": True}, daemon=True)
        closing.start()
        closing.join(timeout=5)  # a learner that stopped reading must not keep us alive
        import multiprocessing.util

        # unlink the named semaphores vLLM and tqdm made here (os._exit skips it, and the learner's
        # resource tracker then warns about "leaked semaphore objects" at the end of every run)
        multiprocessing.util._run_finalizers(0)
        os._exit(0)  # skip vLLM's atexit handlers, which can block on a dead peer


class _Outbox:
    """Messages from the sampler to the learner. A learner busy training does not read the
    pipe; once the pipe is full, a plain send would stall the decode loop (it cost async DPO
    ~40% of its overlap). So messages are sent only while the pipe can take them and wait here
    otherwise; the loop flushes them between decode steps."""

    def __init__(self, conn):
        self.conn, self.pending, self.lock = conn, [], threading.Lock()

    def send(self, message) -> None:
        self.pending.append(message)
        self.flush()

    def flush(self, block: bool = False) -> None:
        import select

        while self.pending:
            if not block and not select.select([], [self.conn], [], 0)[1]:
                return
            with self.lock:
                self.conn.send(self.pending.pop(0))

    def try_send(self, message) -> None:
        """Send now if the pipe can take it and nobody else is sending; else drop it."""
        import select

        if self.lock.acquire(blocking=False):
            try:
                if select.select([], [self.conn], [], 0)[1]:
                    self.conn.send(message)
            finally:
                self.lock.release()


HEARTBEAT_SECONDS = 1.0


def _heartbeat(outbox: _Outbox, parent_pid: int) -> None:
    """A thread of the sampler process: tells the learner every second that the process runs
    (a stopped or frozen process sends nothing: the learner's silence deadline catches it, even
    mid-generation or while the engine is being built), and ends the process as soon as the
    learner is gone (also while the engine is still being built)."""
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(0)
        try:
            outbox.try_send(("alive", None, None))
        except OSError:
            os._exit(0)


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU backend keep each linear layer's weight next to its packed oneDNN copy
    (it frees it by default), so that a weight update can load in place and repack, instead of
    rebuilding every layer (see GlooWeightTransferEngine). Costs one more copy of the linear
    weights in the sampler's memory. vLLM looks the function up when it loads the model, so
    this must run in the sampler process before the engine is built."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    dispatch = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def dispatch_keeping_weight(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    dispatch_keeping_weight.keeps_weights = True
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def _weight_load_path(worker) -> str:
    engine = getattr(worker, "weight_transfer_engine", None)
    if not hasattr(engine, "kept_linears"):
        return "not the gloo engine"
    return "in place" if engine.kept_linears() is not None else "layerwise"


def _serve(config: SamplerConfig, conn, parent_pid: int, outbox: _Outbox) -> None:
    register_gloo_engine()
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.sampling_params import RequestOutputKind

    if config.placement == "cpu":
        torch.set_num_threads(1)
        if config.in_place_updates:
            keep_cpu_linear_weights()
    # Every push logs "RotaryEmbedding / ParallelLMHead: Failed to load weights": the rotary cache
    # is not a parameter and a tied lm_head arrives as embed_tokens. Expected, so not shown.
    import logging

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: "Failed to load weights" not in record.getMessage())
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_settings(config, config.placement),
                                                   weight_transfer_config=WeightTransferConfig(backend=weight_backend(config.placement))))
    send = outbox.send
    send(("ready", None, None))

    paused = updating = False
    streaming: dict[str, tuple] = {}  # request id -> (chunk size, tokens, logprobs, tokens sent, text pieces)
    tags: dict[str, Any] = {}

    def version_spans(output, num_tokens: int) -> list[tuple[int, int, int]]:
        # vLLM labels the weights it started with "default": that is policy version 0
        spans = [(s.version, s.start, s.end) for s in output.weight_versions or []] or [("default", 0, num_tokens)]
        return [(0 if v == "default" else int(v), start, end) for v, start, end in spans]

    def handle(message) -> None:
        nonlocal paused, updating
        command, call_id, payload = message
        result = None
        if command == "add":
            for request_id, prompt_ids, params, stream_every, tag in payload:
                # FINAL_ONLY builds an output once per request, as LLM.generate does; building
                # cumulative outputs every step costs ~15% throughput. Streamed requests use DELTA.
                kind = RequestOutputKind.DELTA if stream_every else RequestOutputKind.FINAL_ONLY
                engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, SamplingParams(**params, output_kind=kind))
                tags[request_id] = tag
                if stream_every:
                    streaming[request_id] = (stream_every, [], [], 0, [])  # chunk size, tokens, logprobs, sent, text
        elif command == "abort":
            engine.abort_request(list(payload))
        elif command == "stream_every":  # new chunk size for every streamed request, running ones too
            for rid, (_, *state) in streaming.items():
                streaming[rid] = (payload, *state)
        elif command == "pause":
            paused = True
        elif command == "resume":
            paused = False
        elif command == "weights_init":
            engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": payload})
        elif command == "weights_start":
            # no decode step until finish: between start and finish the model is half reloaded
            updating = True
            engine.collective_rpc("start_weight_update")
        elif command == "weights_update":
            engine.collective_rpc("update_weights", kwargs={"update_info": payload})
        elif command == "weights_finish":
            version, recompute_kv = payload
            engine.collective_rpc("finish_weight_update")
            engine.set_weight_version(str(version))
            if recompute_kv:  # preempt running sequences: they re-prefill with the new weights
                engine.reset_prefix_cache(reset_running_requests=True)
            updating = False
        elif command == "num_unfinished":
            result = engine.get_num_unfinished_requests()
        elif command == "ping":
            result = os.getpid()
        elif command == "peak_rss":
            result = peak_rss_mib()
        elif command == "weight_load_path":
            result = engine.collective_rpc(_weight_load_path)[0]
        elif command == "shutdown":
            send(("ack", call_id, None))
            raise EOFError
        else:
            raise ValueError(f"unknown sampler command {command!r}")
        if call_id is not None:
            send(("ack", call_id, result))

    import select

    def handle_safely(message) -> None:
        try:
            handle(message)
        except (EOFError, BrokenPipeError):
            raise
        except Exception:
            send(("error", None, traceback.format_exc()))

    deferred = None  # a weight update asked to wait until every running request has finished
    while True:
        outbox.flush()
        if deferred is not None and not engine.has_unfinished_requests():
            handle_safely(deferred)
            deferred = None
        busy = not paused and not updating and engine.has_unfinished_requests()
        if not busy and deferred is None:  # idle: wake up for a command, or as soon as the learner can take our results
            select.select([conn], [conn] if outbox.pending else [], [], 1.0)
        # drain every pending command before the next decode step (none behind a deferred update)
        while deferred is None and conn.poll(0):
            message = conn.recv()
            if message[0] == "weights_start" and message[2] and not paused and engine.has_unfinished_requests():
                deferred = message
                break
            handle_safely(message)
            busy = not paused and not updating and engine.has_unfinished_requests()
        if os.getppid() != parent_pid:
            raise EOFError  # orphaned: the learner died without closing the pipe
        if not busy:
            continue
        results = []
        for output in engine.step():
            rid = output.request_id
            c = output.outputs[0]
            token_ids = list(c.token_ids)
            logprobs = [pos[tok].logprob for tok, pos in zip(c.token_ids, c.logprobs)] if c.logprobs else []
            text = c.text
            if rid in streaming:  # DELTA: c holds only the new tokens and text
                every, tokens, lps, sent, pieces = streaming[rid]
                tokens += token_ids
                lps += logprobs
                pieces.append(c.text)
                if output.finished:
                    token_ids, logprobs, text = tokens, lps, "".join(pieces)
                elif len(tokens) - sent >= every:
                    results.append(Completion(rid, [], tokens[sent:], lps[sent:], None, [], "", tags[rid], finished=False,
                                              finished_at=time.time()))
                    streaming[rid] = (every, tokens, lps, len(tokens), pieces)
            if output.finished:
                streaming.pop(rid, None)
                results.append(Completion(rid, list(output.prompt_token_ids), token_ids, logprobs, c.finish_reason,
                                          version_spans(c, len(token_ids)), text, tags.pop(rid, None), finished_at=time.time()))
        if results:
            send(("out", None, results))


class Sampler:
    """Learner-side handle on the sampler process. Implements vLLM's 4-method weight-sync
    client protocol (init / start / update / finish) over the control pipe, so vLLM's own
    trainer engines (nccl, ipc) and our gloo engine drive the transfer the same way.

    Every wait has a timeout and checks that the process is alive: a dead or stuck sampler is a
    SamplerError in the learner within seconds, never a hang."""

    def __init__(self, config: SamplerConfig):
        self.config = config
        self.placement = resolve_placement(config.placement)
        self.config.placement = self.placement
        self.process = None
        self.conn = None
        # Two locks: a thread that waits for a message (holding _lock, in conn.poll) must not
        # keep another from sending. With one lock, PipelineRL's main thread queued its prompts
        # only after the background push thread had got its ack, and vice versa (~1.4 ms a
        # submit, 10% of the learner's loop).
        self._lock = threading.RLock()  # receiving, and the state it fills (_outputs, _acks)
        # Messages go out through one sender thread: a sampler that stops reading (stopped, frozen)
        # fills the pipe, and a conn.send in the learner's own thread would then block forever;
        # this way only the sender blocks, and the learner's deadline on the answer fires.
        self._outgoing: "queue.SimpleQueue" = None
        self._send_error: BaseException | None = None
        self._call_ids = iter(range(1, 1 << 62))
        self._acks: dict[int, Any] = {}
        self._outputs: list[Completion] = []
        self._request_ids = iter(range(1 << 62))
        self.pending: set[str] = set()
        self.version = 0
        self._weight_engine = None

    # -- lifecycle --
    def start(self) -> "Sampler":
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        import queue

        self._outgoing = queue.SimpleQueue()
        threading.Thread(target=self._send_loop, name="sampler-send", daemon=True).start()
        self._last_heard = time.monotonic()
        cuda_device = sampler_cuda_device(self.placement, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
        self.process = ctx.Process(target=_sampler_main, args=(self.config, child, os.getpid(), cuda_device),
                                   name="vllm-sampler", daemon=False)
        self.process.start()
        child.close()
        _LIVE_SAMPLERS.add(self)
        self._wait(lambda: self._ready, self.config.startup_timeout, "start")
        return self

    _ready = False

    def close(self) -> None:
        """Stop the sampler process; safe to call twice and from error paths."""
        if self.process is None:
            return
        try:
            if self.process.is_alive():
                self._send(("shutdown", None, None))
                self.process.join(5)
        except Exception:
            pass
        if self._outgoing is not None:
            self._outgoing.put(None)  # ends the sender thread
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.process = None
        _LIVE_SAMPLERS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- plumbing --
    def _send(self, message) -> None:
        if self._send_error is not None:
            raise SamplerError(f"the sampler stopped taking messages ({self._send_error!r})")
        self._outgoing.put(message)

    def _send_loop(self) -> None:
        while (message := self._outgoing.get()) is not None:
            try:
                self.conn.send(message)
            except Exception as e:  # the sampler is gone; the next wait says how
                self._send_error = e
                return

    def _exit_code(self):
        self.process.join(1)  # reap it first: before that, exitcode is None
        return self.process.exitcode

    def _receive(self, timeout: float) -> None:
        """Receive at most one message within `timeout` seconds and file it."""
        if self.process is None:
            raise SamplerError("the sampler is not running")
        if not self.conn.poll(timeout):
            if not self.process.is_alive():
                raise SamplerError(f"the sampler process died (exit code {self._exit_code()}); see its log above")
            silent = time.monotonic() - self._last_heard
            if silent > self.config.silence_timeout:
                raise SamplerError(f"the sampler process (pid {self.process.pid}) is alive but has not answered for {silent:.0f}s "
                                   "(stopped, frozen or swapped out?)")
            return
        try:
            kind, call_id, payload = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise SamplerError(f"the sampler process died (exit code {self._exit_code()}); see its log above") from e
        self._last_heard = time.monotonic()
        if kind == "alive":
            return
        if kind == "ready":
            self._ready = True
        elif kind == "out":
            for c in payload:
                if c.finished:
                    self.pending.discard(c.request_id)
            self._outputs += payload
        elif kind == "ack":
            self._acks[call_id] = payload
        elif kind in ("error", "fatal"):
            raise SamplerError(f"the sampler failed:\n{payload}")

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise SamplerError(f"the sampler did not answer {what!r} within {timeout:.0f}s")
            with self._lock:
                if not done():
                    self._receive(min(0.5, max(0.0, deadline - time.monotonic())))

    def _call(self, command: str, payload: Any = None, timeout: float | None = None) -> Any:
        call_id = next(self._call_ids)
        self._send((command, call_id, payload))
        self._wait(lambda: call_id in self._acks, timeout or self.config.call_timeout, command)
        return self._acks.pop(call_id)

    # -- generation --
    def submit(self, prompts: list[list[int]], n: int = 1, tags: list[Any] | None = None, stream_every: int = 0,
               per_prompt: list[dict] | None = None, **sampling) -> list[str]:
        """Queue n samples of each prompt (token ids) without waiting. `sampling` are vLLM
        SamplingParams fields (temperature, top_p, max_tokens, ...), `per_prompt` optional
        overrides of them for each prompt. With stream_every=C the sampler also returns
        unfinished chunks of at least C new tokens. Returns request ids."""
        sampling = {"logprobs": 0, **sampling}
        requests, ids = [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                rid = str(next(self._request_ids))
                tag = tags[i] if tags is not None else (i, j)
                if tags is not None and n > 1:
                    tag = (tags[i], j)
                params = dict(sampling, **(per_prompt[i] if per_prompt else {}))
                if params.get("seed") is not None:
                    # distinct but reproducible per sample; a per-prompt seed stays independent of submission order
                    explicit = bool(per_prompt) and per_prompt[i].get("seed") is not None
                    params["seed"] = params["seed"] + (j if explicit else int(rid))
                requests.append((rid, list(prompt), params, stream_every, tag))
                ids.append(rid)
        self._send(("add", None, requests))
        self.pending.update(ids)
        return ids

    def poll(self, timeout: float = 0.0, min_items: int = 1) -> list[Completion]:
        """Return what the sampler has sent so far (finished completions and streamed chunks),
        waiting up to `timeout` seconds for at least `min_items`."""
        deadline = time.monotonic() + timeout
        while len(self._outputs) < min_items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with self._lock:
                if len(self._outputs) < min_items:  # another thread may have received them meanwhile
                    self._receive(min(left, 0.5))
        with self._lock:
            self._receive(0)
            out, self._outputs = self._outputs, []
        return out

    def wait_for(self, request_ids: list[str], timeout: float = 3600.0) -> list[Completion]:
        """Block until these requests have finished; returns them in the same order. Other
        finished completions that arrive meanwhile stay queued for a later poll()."""
        wanted = set(request_ids)
        got: dict[str, Completion] = {}
        keep: list[Completion] = []
        deadline = time.monotonic() + timeout
        try:
            while len(got) < len(wanted):
                if time.monotonic() > deadline:
                    raise SamplerError(f"generation did not finish within {timeout:.0f}s")
                for c in self.poll(timeout=1.0):
                    if c.finished and c.request_id in wanted:
                        got[c.request_id] = c
                    else:
                        keep.append(c)
        finally:
            self._outputs = keep + self._outputs
        return [got[i] for i in request_ids]

    def generate(self, prompts: list[list[int]], n: int = 1, timeout: float = 3600.0, **sampling) -> list[Completion]:
        """Blocking: n samples per prompt, returned in prompt-major order (tag = (prompt, sample))."""
        return self.wait_for(self.submit(prompts, n=n, **sampling), timeout)

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests; whatever they generated is discarded."""
        self._send(("abort", None, list(request_ids)))
        self.pending.difference_update(request_ids)

    def set_stream_every(self, chunk_tokens: int) -> None:
        """Change the chunk size of every streamed request, including those already running."""
        self._call("stream_every", int(chunk_tokens))

    def pause(self) -> None:
        """Stop decoding; running sequences and their KV stay, new requests queue."""
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def num_unfinished(self) -> int:
        return self._call("num_unfinished")

    def peak_rss_mib(self) -> float:
        """The sampler process's peak resident memory."""
        return self._call("peak_rss")

    def weight_load_path(self) -> str:
        """How the CPU sampler loads a push: "in place" (fast) or "layerwise" (vLLM's reload);
        after init_weight_sync."""
        return self._call("weight_load_path")

    # -- weight sync: vLLM's VLLMWeightSyncClient protocol --
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("weights_init", init_info)

    def start_weight_update(self) -> None:
        # when_idle: the sampler applies the update once its running requests have finished, so
        # the call waits as long as generation may take
        self._call("weights_start", self._when_idle, timeout=3600.0 if self._when_idle else None)

    def update_weights(self, update_info) -> None:
        self._call("weights_update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self._next_version
        self._call("weights_finish", (version, self._recompute_kv))

    _next_version = 0
    _recompute_kv = False
    _when_idle = False

    def init_weight_sync(self, model: torch.nn.Module, background: bool = False) -> None:
        """Open the torch.distributed group between the learner (rank 0) and the vLLM worker
        (rank 1) with the backend for this placement. `background`: pushes may run in a thread
        (push_weights(background=True)); they send a snapshot of the weights kept in a second copy
        of the model, so that training can go on while the sampler loads them."""
        register_gloo_engine()
        self._model, self._snapshot = model, None
        if background:
            import copy

            self._snapshot = copy.deepcopy(model).requires_grad_(False)
            model = self._snapshot
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        backend = weight_backend(self.placement)
        if backend == "gloo":
            info_cls = WeightTransferTrainerFactory._registry["gloo"]().init_info_cls
            info = info_cls(rank=0, master_address="127.0.0.1", master_port=0, world_size=2)  # loopback: the sampler is local
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=_free_port(), world_size=2)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0, packed=True)  # one handle for a packed buffer, not one per tensor
        self._weight_engine = WeightTransferTrainerFactory.trainer_init(info, client=self, source=ModuleSource(model))

    def push_weights(self, version: int, recompute_kv: bool = False, when_idle: bool = False, background: bool = False) -> float:
        """Send the learner's current weights and label them `version`. The sampler applies them
        between two decode steps: running sequences continue with the new weights on top of
        their old KV cache, or re-prefill with them when recompute_kv. With when_idle the sampler
        first finishes every running request with the old weights (the call returns once the
        update is in: requests submitted afterwards are generated by `version` only). With
        background (needs init_weight_sync(model, background=True)) the weights are copied into
        the snapshot and sent from a thread: the call returns at once and training goes on; one
        push is in flight at most (the next one, or wait_for_push(), waits for it). Returns the
        seconds this call took."""
        if self._weight_engine is None:
            raise RuntimeError("call init_weight_sync(model) before push_weights")
        if background and self._snapshot is None:
            raise RuntimeError("push_weights(background=True) needs init_weight_sync(model, background=True)")
        start = time.perf_counter()
        self.wait_for_push()
        if self._snapshot is not None:  # the engine sends from the snapshot: bring it up to date
            with torch.no_grad():
                for mine, theirs in zip(self._snapshot.parameters(), self._model.parameters()):
                    mine.copy_(theirs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copy must be done before another thread sends it
        if not background:
            self._send_weights(version, recompute_kv, when_idle)
            return time.perf_counter() - start

        def push():
            try:
                self._send_weights(version, recompute_kv, when_idle)
            except BaseException as e:  # re-raised in the learner's thread by the next call
                self._push_error = e

        self._push_thread = threading.Thread(target=push, name="weight-push", daemon=True)
        self._push_thread.start()
        return time.perf_counter() - start

    def _watched(self, transfer) -> None:
        """Run a weight transfer in a thread and watch the sampler meanwhile. A NCCL broadcast to a
        dead peer never returns (it has no timeout), and cannot be interrupted; the watchdog turns a
        dead or silent sampler into a SamplerError in the learner instead of a hang (the stuck
        thread is left behind; the run is over anyway)."""
        error: list[BaseException] = []

        def run():
            try:
                transfer()
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=run, name="weight-transfer", daemon=True)
        thread.start()
        deadline = time.monotonic() + 4 * self.config.call_timeout
        while thread.is_alive():
            thread.join(0.5)
            if not thread.is_alive():
                break
            if not self.process.is_alive():
                raise SamplerError(f"the sampler process died during a weight push (exit code {self._exit_code()})")
            if time.monotonic() - self._last_heard > self.config.silence_timeout:
                with self._lock:  # nobody received for a while: look for a heartbeat ourselves
                    self._receive(0.5)
            if time.monotonic() > deadline:
                raise SamplerError(f"a weight push did not finish within {4 * self.config.call_timeout:.0f}s")
        if error:
            raise error[0]

    _push_thread: threading.Thread | None = None
    _push_error: BaseException | None = None
    _snapshot = None

    def wait_for_push(self) -> None:
        """Wait until a background push has landed; raise its error if it failed."""
        if self._push_thread is not None:
            # every wait inside the push has its own deadline; this one bounds them all
            self._push_thread.join(timeout=4 * self.config.call_timeout)
            if self._push_thread.is_alive():
                raise SamplerError(f"a background weight push did not finish within {4 * self.config.call_timeout:.0f}s")
            self._push_thread = None
        if self._push_error is not None:
            error, self._push_error = self._push_error, None
            raise error

    def _send_weights(self, version: int, recompute_kv: bool, when_idle: bool) -> None:
        self._next_version, self._recompute_kv, self._when_idle = version, recompute_kv, when_idle
        try:
            self._watched(self._weight_engine.send_weights)
        except SamplerError:
            raise
        except Exception as e:  # a broken group usually means the sampler died: say why if it told us
            deadline = time.monotonic() + 5
            while self.process is not None and self.process.is_alive() and time.monotonic() < deadline:
                self._receive(0.5)
            self._receive(0.5)
            raise SamplerError(f"weight push failed: {e}") from e
        self.version = version


_LIVE_SAMPLERS: set[Sampler] = set()


def _close_live_samplers(*_):
    for s in list(_LIVE_SAMPLERS):
        s.close()


import atexit  # noqa: E402

atexit.register(_close_live_samplers)


def start_sampler(model_path: str, placement: str = "auto", max_model_len: int | None = None, seed: int = 0, **kwargs) -> Sampler:
    """Start the sampler process and wait until its engine is ready."""
    return Sampler(SamplerConfig(model=model_path, placement=placement, max_model_len=max_model_len, seed=seed, **kwargs)).start()


def encode_prompts(tokenizer, problems: list[Problem], max_prompt_tokens: int,
                   chat_template: bool = False) -> tuple[list[Problem], list[list[int]], int]:
    """Tokenize prompts, skipping (not crashing on) those longer than `max_prompt_tokens`.
    `chat_template`: wrap each prompt as one user turn in the tokenizer's chat template with the
    assistant's generation prompt (instruct models; TinyZero's instruct setting). Returns the
    kept problems, their token ids and how many were skipped (log it)."""
    kept, ids = [], []
    for problem in problems:
        if chat_template:
            tokens = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
        else:
            tokens = tokenizer(problem.prompt, add_special_tokens=True)["input_ids"]
        if len(tokens) <= max_prompt_tokens:
            kept.append(problem)
            ids.append(list(tokens))
    return kept, ids, len(problems) - len(kept)


def check_prompts_fit(tokenizer, task, max_prompt_tokens: int, chat_template: bool = False, sample: int = 64) -> None:
    """Stop with one line when none of the first `sample` training prompts fits the prompt budget:
    every round would skip all of its prompts (a silent loop or an empty batch otherwise)."""
    problems = [task.problem("train", i) for i in range(sample)]
    kept, ids, _ = encode_prompts(tokenizer, problems, max_prompt_tokens, chat_template)
    if not kept:
        shortest = min(len(encode_prompts(tokenizer, [p], 10**9, chat_template)[1][0]) for p in problems)
        raise SystemExit(f"error: --model/--task: every prompt is longer than the prompt budget of {max_prompt_tokens} tokens "
                         f"(the shortest of the first {sample} has {shortest}); use a model with a longer context or shorter prompts")


def check_chat_template(tokenizer, enabled: bool) -> None:
    """--chat-template needs a tokenizer that has one."""
    check_args(not enabled or bool(getattr(tokenizer, "chat_template", None)), "--chat-template",
               "this model's tokenizer has no chat template (a base model?); drop the flag")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(sampler: "Sampler", task, tokenizer, num_problems: int | None, samples_per_problem: int, max_prompt_tokens: int,
             chat_template: bool = False, **sampling) -> dict[str, float]:
    """pass@k (k = 1, 4, 8, 16 up to samples_per_problem) on the first `num_problems` held-out
    problems (None: the whole test split of a fixed dataset), sampling with the sampler's current
    weights and `sampling` (temperature=0 is greedy pass@1, as the GSM8K evaluations report)."""
    if num_problems is None:
        num_problems = len(task.test)
    problems, prompts, _ = encode_prompts(tokenizer, [task.problem("test", i) for i in range(num_problems)], max_prompt_tokens,
                                          chat_template)
    samples = sampler.generate(prompts, n=samples_per_problem, **sampling)
    correct = [sum(task.is_correct(s.text, p) for s in samples[i * samples_per_problem:(i + 1) * samples_per_problem])
               for i, p in enumerate(problems)]
    ks = [k for k in (1, 4, 8, 16) if k <= samples_per_problem]
    return {f"eval/pass@{k}": float(np.mean([pass_at_k(samples_per_problem, c, k) for c in correct])) for k in ks}


# --------------------------------------------------------------------------------------
# Logging and checkpoints
# --------------------------------------------------------------------------------------


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return False


def run_name(exp_name: str, seed: int, resume: str | None = None) -> str:
    """runs/<exp_name>__<seed>__<unix time> (RunLogger adds -1, -2, ... if that exists already); a
    resumed run keeps the directory it resumes from, after checking its checkpoint (so that a bad
    --resume is one line, before anything starts or any directory is made)."""
    if resume:
        checkpoint_state(resume)
        return Path(resume).name if Path(resume).is_dir() else Path(resume).parent.name
    return f"{exp_name}__{seed}__{int(time.time())}"


class RunLogger:
    """runs/<run_name>/: console.log (a copy of stdout), args.json, metrics.jsonl (every logged
    metric), TensorBoard event files, and wandb when `track`."""

    def __init__(self, run_name: str, args: Any, track: bool = False, wandb_project: str = "fast-rl-llm", root: str = "runs"):
        if getattr(args, "resume", None):
            self.dir = Path(root) / run_name
            self.dir.mkdir(parents=True, exist_ok=True)
        else:  # a new run gets a directory of its own, even when another run starts in the same second
            Path(root).mkdir(parents=True, exist_ok=True)
            for attempt in range(10_000):
                self.dir = Path(root) / (run_name if attempt == 0 else f"{run_name}-{attempt}")
                try:
                    self.dir.mkdir()  # atomic: exactly one process creates it
                    break
                except FileExistsError:
                    continue
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        (self.dir / "args.json").write_text(json.dumps(config, indent=1, default=str))
        self._console = open(self.dir / "console.log", "a")
        self._stdout = sys.stdout
        sys.stdout = _Tee(self._stdout, self._console)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")
        self.start = time.time()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir))
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
        except ImportError:
            self.writer = None
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(self.dir))

    def log(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float, np.floating, np.integer)) or torch.is_tensor(v) else v) for k, v in metrics.items()}
        record = {"step": step, "wall": round(time.time() - self.start, 3), **clean}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.writer is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if echo:
            shown = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in clean.items() if isinstance(v, float))
            print(f"[{record['wall']:7.1f}s] step {step}: {shown}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        self._jsonl.close()
        sys.stdout = self._stdout
        self._console.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


CHECKPOINT_KEYS = ("model", "optimizer", "step", "data_position", "rng")


def replace_atomically(write, path: Path) -> None:
    """write(tmp) then rename over `path`: a reader never sees half a file, two runs never share
    a temporary name, and a failed write (disk full) leaves the previous file as it was."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        if tmp.is_dir():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise SystemExit(f"error: could not write {path} ({e.strerror or e}); the previous copy, if any, is intact") from None


def save_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_position: int, hf_model=None, tokenizer=None, **extra) -> None:
    """Model, optimizer, step, RNG states and data position, written atomically; only tensors and
    plain data, so that --resume loads it with weights_only=True (no code runs on load). With
    `hf_model` (and its tokenizer), also <dir>/model/: a Hugging Face model directory
    (safetensors) that transformers and vLLM load as is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    rng = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "data_position": data_position,
             "rng": rng, **extra}
    replace_atomically(lambda tmp: torch.save(state, tmp), path)
    if hf_model is not None:
        save_hf_model(path.parent / "model", hf_model, tokenizer)


def save_hf_model(out_dir: str | Path, model, tokenizer=None) -> None:
    """`save_pretrained` (safetensors, tokenizer included) into out_dir, replacing it whole."""
    import shutil

    out_dir = Path(out_dir)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
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
        raise SystemExit(f"error: --resume: {path} is not a checkpoint this project wrote (missing {', '.join(missing)})")
    return state


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, required: tuple = ()) -> dict:
    """Restore what save_checkpoint wrote; returns the whole state (step, data_position, extras).
    `required`: the extra keys the caller reads, checked before anything is restored."""
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


# --------------------------------------------------------------------------------------
# `python common.py`: build the tiny model (cached), start the sampler, sample, push weights
# --------------------------------------------------------------------------------------


@dataclass
class SmokeArgs:
    model: str = TINY
    """`tiny` (built-in, offline) or an HF model directory / Hub id"""
    num_prompts: int = 128
    """held-out Countdown prompts to sample"""
    placement: str = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (own GPU, nccl), auto"""


def smoke(args: SmokeArgs) -> None:
    limit_cpu_threads()
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_policy(path, device)
    task = make_task("countdown", seed=0, tiny_prompts=args.model == TINY)
    problems, prompts, skipped = encode_prompts(tokenizer, [task.problem("test", i) for i in range(args.num_prompts)], 96)
    with start_sampler(path, placement=args.placement) as sampler:
        sampler.init_weight_sync(policy)
        start = time.perf_counter()
        samples = sampler.generate(prompts, n=1, temperature=1.0, max_tokens=48)
        seconds = time.perf_counter() - start
        accuracy = np.mean([task.is_correct(s.text, p) for s, p in zip(samples, problems)])
        tokens = sum(len(s.token_ids) for s in samples)
        push = sampler.push_weights(version=1)
        after = sampler.generate(prompts[:8], n=1, temperature=1.0, max_tokens=48)
        print(f"model {path}\nsampled {len(samples)} completions ({tokens} tokens, {tokens / seconds:.0f} tok/s), "
              f"skipped {skipped} long prompts\nheld-out accuracy at T=1: {accuracy:.3f}\n"
              f"weight push: {push:.3f}s, versions after push: {sorted({s.version_max for s in after})}\n"
              f"example: {problems[0].prompt!r} -> {samples[0].text!r}")


if __name__ == "__main__":
    import tyro

    smoke(tyro.cli(SmokeArgs))
