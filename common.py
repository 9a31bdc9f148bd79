"""What a reader of the four method scripts looks up: flag checks, model loading, the learner's
logprobs (the logprob contract), prompts and evaluation, logging and checkpoints. The method
itself lives in each script; tasks.py beside this one holds tasks and rewards. The plumbing is the
package fastrl/, which never imports this module or a script (imports run scripts -> common -> fastrl):

    fastrl/vllm_sampler.py   the vLLM sampler process and its handle `Sampler` (its contract opens it)
    fastrl/remote_sampler.py the same handle over running vLLM servers (--sampler-url)
    fastrl/weight_sync.py    weight pushes; gloo_transfer.py, shm_transfer.py: our CPU engines for them
    fastrl/distributed.py    the learner under torchrun (FSDP2)
    fastrl/tiny_model.py     the built-in tiny model (`--model tiny`)
    fastrl/memory_plan.py    what a run needs on a GPU; fastrl/util.py: loading, progress, files

Terms (README, "Glossary"): a *sampling round* is one batch of prompts sent to the sampler and
its completions returned; a *step* is one optimizer.step(); an *episode* is one completion used
for training; the *policy version* of a token is the number of steps the weights that produced it
had seen; *lag* = learner version - token version; *group size* = samples per prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastrl import distributed, vllm_sampler, weight_sync
from fastrl.util import (CACHE_DIR, Progress, _Tee, load_hf, load_tokenizer, on_terminal,  # noqa: F401  (re-exported)
                         replace_atomically, set_seed)
from fastrl.vllm_sampler import peak_rss_mib

if TYPE_CHECKING:  # annotations only
    from tasks import Problem
    from fastrl.vllm_sampler import Completion, Sampler

# --------------------------------------------------------------------------------------
# Errors and argument checks
# --------------------------------------------------------------------------------------


def help_default(text: str):
    """An Args field's annotation whose --help shows `text` as its default: for a default that other
    flags decide (the mode, the memory plan). Use: `x: Annotated[int | None, common.help_default("B")] = None`."""
    import tyro

    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


def check_args(condition: bool, flag: str, message: str) -> None:
    """Reject a nonsensical flag value at start-up with a message that names the flag."""
    if not condition:
        raise SystemExit(f"error: {flag}: {message}")


def check_sampler_urls(urls: list[str] | None) -> None:
    """--sampler-url: each an http(s):// URL (whether a server answers there is checked on connecting)."""
    for url in urls or []:
        check_args(url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0, "--sampler-url",
                   f"must be the http(s):// URL of a running vLLM server, got {url!r}")


def mismatch_correction(tis: str, sampler_dtype: str, placement: str, learner_bf16: bool) -> bool:
    """Whether truncated importance sampling corrects the training-inference mismatch (`--tis`): "on",
    "off", or "auto" = on exactly when the sampler's numbers differ from the learner's beyond float
    noise: a sampler not in fp32 (the GPU default: bf16, vllm_sampler.resolve_dtype) or a learner
    computing in bf16 (autocast, bf16 weights): two bf16 engines round differently too. Runs in fp32 on
    both sides (the CPU default) keep the plain method."""
    if tis != "auto":
        return tis == "on"
    return vllm_sampler.resolve_dtype(sampler_dtype, placement) != "float32" or learner_bf16


def check_model(args, script: str) -> tuple[str, float | None]:
    """Before the sampler starts, from the model's files alone: the packages the run needs (optional_modules), the
    model's path (resolve_model), and that it can serve the
    flags: the prompt budget and response cap fit its context (check_context), --chat-template finds a template
    (check_chat_template), and on a GPU the run's memory plan fits (memory_plan). A refusal is one line naming the flag.
    Returns (model path, the sampler's share of its GPU: --sampler-gpu-memory or the plan's). script: rloo, dpo,
    pipeline or ppo. A flag the plan needs that a stripped copy lacks stops it here, on any machine (with_defaults)."""
    import importlib.util

    from fastrl import memory_plan as plan_memory

    args = plan_memory.with_defaults(script, args)  # (what a copy dropped: planned without it, or one line on a CPU too)
    for module, (flag, message) in optional_modules(args).items():  # e.g. a Hub --task without datasets
        check_args(importlib.util.find_spec(module) is not None, flag, message)
    model_path = resolve_model(args.model, getattr(args, "task", "countdown"))
    check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    check_chat_template(model_path, getattr(args, "chat_template", False))
    return model_path, memory_plan(args, model_path, script)


def memory_plan(args, model_path: str, script: str) -> float | None:
    """On a GPU, before any weight loads: the run's memory plan from the model's config alone (memory_plan.py
    has its contract), printed in one line, `memory plan: learner ~X GB + sampler Y GB + transfer Z GB + headroom H GB
    (CUDA contexts C + the sampler's push clones P + fragmentation F) of N GB`.
    Returns the sampler's share of its GPU (--sampler-gpu-memory, sized by the plan when not given); a plan
    that does not fit stops the run in one line naming the flags that would. On CPU (and under torchrun, whose
    sharded learner it does not model) it prints nothing and returns --sampler-gpu-memory as given.
    script: rloo, dpo, pipeline or ppo."""
    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return getattr(args, "sampler_gpu_memory", None)
    from transformers import AutoConfig

    from fastrl import memory_plan as plan_memory

    reward = 0
    if getattr(args, "reward_model", None):
        reward = plan_memory.reward_model_bytes(load_hf(AutoConfig, args.reward_model, flag="--reward-model"))
    plan = plan_memory.plan(script, args, plan_memory.shape_of(load_hf(AutoConfig, model_path)),
                            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, torch.cuda.device_count(), reward)
    if not plan.fits:
        raise SystemExit(plan.line)
    print(plan.line)
    return plan.share


def limit_cpu_threads() -> None:
    """On a 2-core machine the learner, the sampler and OpenMP spin-waits fight for cores;
    one thread per process was 4-6x faster than two (measured on the tiny model)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def sampler_threads(requested: int, overlapped: bool) -> int:
    """The sampler's CPU threads, fixed when its engine starts (vLLM's CPU worker then makes
    torch.set_num_threads a no-op, vllm/v1/worker/cpu_worker.py:139-145): `requested` if > 0 (the
    scripts' --sampler-threads); else every core when the schedule takes turns (the learner waits
    while the sampler generates, and the idle sampler waits while the learner trains), half of them
    when generation and training overlap. An explicit OMP_NUM_THREADS is a fixed budget and is kept."""
    if requested > 0:
        return requested
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // 2) if overlapped else cores


def learner_threads(sampler) -> int:
    """On CPU, set the learner's torch threads for the phase about to run: every core while the
    sampler has nothing to generate (a synchronous phase, or paused: its process sleeps), one while it
    generates alongside (two busy processes on two cores with two threads each ran 4-6x slower:
    OpenMP spin-waits). A tiny-model update ran 1.76x faster on 2 threads than on 1 with the
    sampler idle. An explicit OMP_NUM_THREADS is a fixed budget and is kept. Returns the count."""
    if sampler is None or torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ or torch.distributed.is_initialized():
        return torch.get_num_threads()  # (under torchrun the cores are the ranks')
    generating = bool(sampler.pending) and not sampler.paused
    threads = 1 if generating else len(os.sched_getaffinity(0))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


class RewardModel:
    """Any HF AutoModelForSequenceClassification with num_labels=1, scored in batches."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 16):
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(path)
        self.model = load_hf(AutoModelForSequenceClassification, path, num_labels=1).to(device).eval()  # pad: EOS if none
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = device, batch_size

    def conversations(self, problems: list[Problem], completions: list[str]) -> list[str]:
        """What the reward model reads: the exchange in its own chat template when its tokenizer has one
        (the user turn, and the reply with the start the task gave it), else the prompt and the completion."""
        if not getattr(self.tokenizer, "chat_template", None):
            return [p.prompt + c for p, c in zip(problems, completions)]
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p.user or p.prompt},
                                                    {"role": "assistant", "content": p.assistant_start + c}], tokenize=False)
                for p, c in zip(problems, completions)]

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
SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct from a PyPI wheel (fastrl/smollm2.py): the real model that needs no hub



def resolve_model(name: str, task: str = "countdown") -> str:
    """`tiny` -> the built-in model's directory (tiny_model.py: built once, cached; for
    `countdown-steps` the one trained to answer step by step); `smollm2` -> SmolLM2-135M-Instruct's
    directory (fastrl/smollm2.py: converted once from its PyPI wheel, cached); anything else is passed
    on as a local path or Hub id."""
    if name == SMOLLM2:
        from fastrl.smollm2 import smollm2_path

        return str(smollm2_path())
    if name != TINY:
        return name
    return str(tiny_model_path("countdown-steps" if task == "countdown-steps" else "countdown"))


def tiny_model_path(task: str = "countdown", **config) -> Path:
    """The built-in model supervised on `task` (fastrl/tiny_model.py: built once, cached);
    `config`: other TinyConfig fields."""
    from fastrl import tiny_model

    config = tiny_model.TinyConfig(task=task, **config)
    return tiny_model.tiny_model_path(config, tiny_sft_batch(config.task, config.seed))


def tiny_sft_batch(task: str, seed: int):
    """The tiny model's supervised data: `sft_batch(tokenizer, step, batch_size)` -> the padded
    batch of worked examples of `task` (each answer followed by EOS)."""
    import tasks

    sft_task = tasks.make_task(task, seed=seed, tiny_prompts=True)

    def sft_batch(tokenizer, step: int, batch_size: int):
        problems = [sft_task.problem("train", step * batch_size + i) for i in range(batch_size)]
        prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
        completions = [tokenizer(sft_task.completion_text(p))["input_ids"] + [tokenizer.eos_token_id] for p in problems]
        return pad_prompt_completions(prompts, completions, tokenizer.pad_token_id)

    return sft_batch


# the oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA toolkit release notes, table 3)
MIN_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 65)}


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.65.06"), or None where there is none."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    import re

    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def check_nvidia_driver() -> None:
    """A CUDA build of torch (and vLLM) on a machine whose NVIDIA driver is older than that CUDA needs: torch then
    sees no GPU, --placement auto falls to the CPU path with vLLM's CUDA build and fails far from the cause. Say it
    in one line at start instead, with what to install."""
    driver, cuda = nvidia_driver_version(), torch.version.cuda
    if driver is None or cuda is None or torch.cuda.is_available():
        return
    major = int(cuda.split(".")[0])
    needed = MIN_DRIVER.get(major, max(MIN_DRIVER.values()))
    have = tuple(int(x) for x in driver.split(".")[:2])
    if have < needed:
        raise SystemExit(f"error: NVIDIA driver {driver} is older than CUDA {cuda} (this torch and vLLM) needs (>= {needed[0]}.{needed[1]}), "
                         f"so no GPU is visible: install NVIDIA driver {needed[0]} or newer (e.g. apt install nvidia-driver-{needed[0]}) "
                         "and reboot, or run on CPU with the CPU build (docs/install.md)")


def check_run_flags(args) -> None:
    """The flags every script shares that can be checked before anything loads, each refused in one
    line naming it: an NVIDIA driver too old for CUDA 13, a GPU placement without a GPU, a local --model directory
    that does not exist (rather than the Hub's repo-id rules), --system-prompt without --chat-template, a --task
    file that does not exist."""
    import importlib.util

    check_nvidia_driver()
    if getattr(args, "sampler_url", None) is None and getattr(args, "placement", "auto") in ("colocate", "separate"):
        gpus = torch.cuda.device_count()
        check_args(gpus >= (1 if args.placement == "colocate" else 2), "--placement",
                   f"{args.placement} needs {1 if args.placement == 'colocate' else 2} GPU(s), {gpus} visible; use --placement cpu or auto")
    task = getattr(args, "task", "")
    check_args(not task.endswith((".jsonl", ".json")) or Path(task).expanduser().is_file(), "--task", f"no such file: {task}")
    check_args(getattr(args, "system_prompt", None) is None or getattr(args, "chat_template", False), "--system-prompt",
               "is the system turn of a chat template: add --chat-template")
    local = args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1
    check_args(args.model == TINY or not local or Path(args.model).expanduser().is_dir(), "--model",
               f"no such directory: {args.model} (a Hub id looks like Qwen/Qwen2.5-0.5B; --model tiny is the built-in model)")


def optional_modules(args) -> dict[str, tuple[str, str]]:
    """The modules beyond the core dependencies that this run will import: {module: (the flag that needs it, the
    refusal's message)}; a module's distribution has its name. (tests/test_install_plan.py holds the README's
    commands to the extras their setup installs.)"""
    import tasks

    needed = {}
    if getattr(args, "track", False):
        needed["wandb"] = ("--track", "needs wandb, which is not installed: pip install wandb (or leave --track out: TensorBoard "
                                      "files are always written)")
    if getattr(args, "model", None) == SMOLLM2:  # fastrl/smollm2.py converts it from its GGUF release (transformers' loader)
        for module in ("gguf", "accelerate"):
            needed[module] = ("--model", f"smollm2 is converted from its GGUF release, which needs the {module} package: "
                                         "bash scripts/setup.sh cpu (or pip install -e .)")
    task = getattr(args, "task", "")
    if task in tasks.HUB_TASKS or task.startswith("hf:"):
        needed["datasets"] = ("--task", f"{task} is a Hub dataset and needs the datasets package: pip install -e '.[hub]' "
                                        "(bash scripts/setup.sh gpu installs it); offline, use --task countdown or arithmetic")
    return needed


def check_sampler_version(samples, learner_version: int, max_lag: int = 0) -> None:
    """Stop with one line unless every token of `samples` was sampled by a policy version between
    `learner_version - max_lag` and `learner_version` (0: by the learner's current weights): a forgotten
    `sampler.push_weights(...)` or a sampler that lags would otherwise train off-policy in silence."""
    versions = sorted({v for s in samples for v, _, _ in s.versions})
    if versions and (versions[0] < learner_version - max_lag or versions[-1] > learner_version):
        expected = f"version {learner_version}" if max_lag == 0 else f"versions {learner_version - max_lag}..{learner_version}"
        raise SystemExit(f"error: the sampler generated this batch with policy version(s) {versions}, the method expects {expected}: "
                         "the weights were not pushed after the optimizer steps (sampler.push_weights), or the sampler lags")


def warn_logprob_diff(diff: float, mismatch_expected: bool, warned: list) -> None:
    """Print one warning line (once per run: `warned` remembers) when `charts/logprob_diff` on fresh
    weights is larger than the precisions explain: ~1e-6 when sampler and learner both run fp32, ~1e-2
    with a bf16 side. Then the sampler's logprobs are not the learner's (other weights, another model,
    other sampling settings than the learner's), and every ratio built on them is off."""
    limit = 5e-2 if mismatch_expected else 1e-3
    if math.isfinite(diff) and diff > limit and not warned:
        warned.append(diff)
        print(f"warning: charts/logprob_diff {diff:.2g} on fresh weights (expected below {limit:g} for these precisions): the sampler's "
              "logprobs are not the learner's (not the same weights, model or sampling settings); importance weights and ratios are off")


def warn_no_learning(signal, what: str, streaks: dict, patience: int) -> bool:
    """One warning line, once per run and `what`, when a round's learning signal (its advantages, its kept pairs, whether
    its step trained) has been all zero, non-finite or empty for `patience` rounds in a row (the scripts: 10, or the whole
    run when shorter): a setting under which the method learns nothing (a group size of 1, a reward that never differs
    within a group, a guard that skips every step), which a flat curve would otherwise be the only sign of. `streaks`
    (a dict kept by the caller) counts the rounds. Returns whether this round had no signal."""
    values = torch.as_tensor(signal, dtype=torch.float32)
    none = values.numel() == 0 or not bool((torch.isfinite(values) & (values != 0)).any())
    count = streaks.get(what, 0)
    if count >= 0:  # (-1: said already)
        count = count + 1 if none else 0
        if count >= patience:
            print(f"warning: {what}, in each of the last {count} rounds: the method learns nothing from them (docs/methods.md)")
            count = -1
        streaks[what] = count
    return none


def check_context(model_path: str, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt budget + response cap must fit the model's context, or vLLM refuses to start. (A local
    directory's config.json is read as it is: importing transformers here would delay the sampler's start.)"""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        context = json.loads(config_file.read_text()).get("max_position_embeddings")
    else:
        from transformers import AutoConfig

        context = getattr(load_hf(AutoConfig, model_path), "max_position_embeddings", None)
    if context and max_prompt_tokens >= context:
        raise SystemExit(f"error: --max-prompt-tokens: {max_prompt_tokens} prompt tokens leave no room for a response in the model's "
                         f"context of {context} tokens; use --max-prompt-tokens {context // 2} or less")
    if context and max_prompt_tokens + max_new_tokens > context:
        raise SystemExit(f"error: --max-new-tokens: {max_new_tokens} response tokens + {max_prompt_tokens} prompt tokens exceed "
                         f"the model's context of {context} tokens; use --max-new-tokens {context - max_prompt_tokens} or less")


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
    targets: [...] token ids. Top-p alone is found without sorting the vocabulary
    (_nucleus_excluded: the same set, bit for bit)."""
    logits = logits / temperature
    if top_p >= 1.0 and top_k <= 0:
        return logits
    with torch.no_grad():
        if top_k <= 0:
            drop = _nucleus_excluded(logits.reshape(-1, logits.shape[-1]), top_p).view(logits.shape)
        else:
            drop = _excluded_by_sort(logits, top_p, top_k)
        drop.scatter_(-1, targets.unsqueeze(-1), False)
    return logits.masked_fill(drop, -float("inf"))


def _excluded_by_sort(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """vLLM's apply_top_k_top_p_pytorch: the tokens top-k and top-p exclude, from a sort of the whole vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        drop |= sorted_logits < sorted_logits[..., -top_k, None]
    if top_p < 1.0:
        cumulative = sorted_logits.masked_fill(drop, -float("inf")).softmax(dim=-1).cumsum(dim=-1)
        drop |= cumulative <= 1 - top_p
    drop[..., -1] = False  # at least the most likely token
    return drop.scatter(-1, order, drop)  # back to vocabulary order


NUCLEUS_CANDIDATES = (256, 4096)  # the top tokens examined before sorting a position's whole vocabulary
NUCLEUS_MARGIN = 1e-5  # closer than this to the cut, a position's set is taken from the sort itself


def _nucleus_excluded(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """_excluded_by_sort(logits, top_p, 0) without sorting the vocabulary: [N, V] -> [N, V] bool, the same set.

    vLLM keeps token j when the ascending cumulative probability up to it, c_j = total - (mass of the tokens
    above j), exceeds 1 - top_p. The top-k candidates (largest logits, descending) give every c_j of the
    nucleus exactly when the nucleus ends inside them; the kept set is then {logit >= the smallest kept
    logit}. A position goes to the sort when the cut is ambiguous: the nucleus reaches past the candidates,
    a c_j lies within NUCLEUS_MARGIN of 1 - top_p (the sort's softmax and cumsum round differently; the
    margin is ~100x their error), or a tie sits on the cut (the sort's order among ties decides)."""
    n, vocab = logits.shape
    threshold = torch.tensor(1 - top_p, dtype=logits.dtype).item()  # vLLM compares in the logits' dtype
    probs = logits.softmax(-1)
    total = probs.sum(-1, dtype=torch.float64)
    drop = torch.empty((n, vocab), dtype=torch.bool, device=logits.device)
    todo = torch.arange(n, device=logits.device)
    for k in NUCLEUS_CANDIDATES:
        if k >= vocab or not len(todo):
            break
        values, index = logits[todo].topk(k, dim=-1)
        q = probs[todo].gather(-1, index).double()
        c = total[todo, None] - (q.cumsum(-1) - q)  # the ascending cumulative at each candidate
        kept = (c > threshold).sum(-1).clamp(min=1)  # c falls along the candidates: the kept ones come first
        last = values.gather(-1, (kept - 1)[:, None])  # the smallest kept logit
        after = values.gather(-1, kept.clamp(max=k - 1)[:, None])
        sure = (kept < k) & ((c - threshold).abs() > NUCLEUS_MARGIN).all(-1) & (last > after).squeeze(-1)
        rows = todo[sure]
        drop[rows] = logits[rows] < last[sure]
        todo = todo[~sure]
    if len(todo):
        drop[todo] = _excluded_by_sort(logits[todo], top_p, 0)
    return drop


LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of positions; a [B, T, V] copy at V=151,936 is tens of GB


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = 0, with_entropy: bool = False, chunk_bytes: int = LOGIT_CHUNK_BYTES):
    """Per-token log pi(y_t | x, y_<t) of the completion tokens under `model`, in fp32, under the
    sampler's processing (temperature, top-k, top-p: see sampling_logits). This is the logprob
    contract: at the sampler's weights these equal the sampler's `processed_logprobs` (~1e-6 in
    fp32), so every ratio a method forms compares distributions of the same kind. Returns
    [batch, len-1] tensors aligned with input_ids[:, 1:], zero off the completion, plus the
    per-token entropy of the same distribution when asked.

    Memory: the backbone runs once; the vocabulary projection, softmax and entropy run on the
    completion's positions only (a prompt's logits are never used), over chunks of at most
    `chunk_bytes` of fp32 logits each, and with gradients each chunk is recomputed in the backward
    pass (activation checkpointing), so no [B, T, V] copy is ever alive beyond one chunk."""
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    decoder, head = _backbone_and_head(model)
    if decoder is None:  # a model whose head does more than a projection: the plain way
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        chosen, entropy = _chunk_logprobs(logits, targets, temperature, top_p, top_k, with_entropy)
        return (chosen * mask, entropy * mask) if with_entropy else chosen * mask
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    where = mask.bool()
    hidden, flat_targets = hidden[where], targets[where]  # [N, H], [N]: the completion's positions
    per_chunk = max(1, chunk_bytes // (4 * head.weight.shape[0]))
    pieces = []
    for start in range(0, hidden.shape[0], per_chunk):
        part = slice(start, start + per_chunk)

        def run(h, t):
            return _chunk_logprobs(head(h), t, temperature, top_p, top_k, with_entropy)

        if torch.is_grad_enabled() and hidden.shape[0] > per_chunk:
            from torch.utils.checkpoint import checkpoint

            pieces.append(checkpoint(run, hidden[part], flat_targets[part], use_reentrant=False))
        else:
            pieces.append(run(hidden[part], flat_targets[part]))
    chosen = mask.masked_scatter(where, torch.cat([c for c, _ in pieces]) if pieces else hidden.sum(-1).float())
    if not with_entropy:
        return chosen
    return chosen, mask.masked_scatter(where, torch.cat([e for _, e in pieces]) if pieces else hidden.sum(-1).float())


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


def micro_batches(lengths: list[int], max_tokens: int, rows_per_item: int = 1, max_rows: int | None = None) -> list[list[int]]:
    """Token-budget micro-batches: the items' indices sorted by length, packed in that order so that
    each micro-batch's padded size (its rows x its longest length) stays within max_tokens (and it
    has at most max_rows items); an item longer than that forms a micro-batch of its own.
    rows_per_item: rows each item adds (a DPO pair: 2). Bounds the learner's activation memory by
    the budget, whatever the batch size (gradients accumulate over the micro-batches)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):  # ascending: item i is its batch's longest
        if batches and (max_rows is None or len(batches[-1]) < max_rows) \
                and (len(batches[-1]) + 1) * rows_per_item * lengths[i] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a step: `items` (indices into the batch: rows, or DPO's pairs), `width`
    (the longest item's length: cut the right-padded tensors to [:, :width]) and `weight` (1; 0 for a
    torchrun stand-in that only keeps the ranks in step: accumulate() scales it away)."""

    items: list[int]
    width: int
    weight: float = 1.0


def accumulate(loss_fn, lengths: list[int], max_tokens: int, total: float | None = None, rows_per_item: int = 1,
               dist=None, max_rows: int | None = None) -> tuple[torch.Tensor, dict]:
    """The gradient of one batch's loss, accumulated over micro-batches of at most `max_tokens`
    padded tokens (and at most `max_rows` items: micro_batches), so that memory is bounded whatever the batch size.

    loss_fn(mb: MicroBatch) -> (loss, size, outputs): the micro-batch's mean loss (a scalar tensor),
    its size in the units the batch's mean is taken over (items or tokens; `total` is the batch's
    total of them, default len(lengths)) and a dict of outputs. Each micro-batch's loss is
    backpropagated with its share of the batch, weight * size / total, so the accumulated gradient
    is exactly the batch mean's. Outputs: a tensor with one value per item ([len(mb.items)]) comes
    back as [len(lengths)] with every item's value; anything else (a number, a 0-d tensor) comes
    back summed over the micro-batches.

    Returns (loss, outputs): the batch's loss (sum of share * loss) and the outputs, whole on every
    rank. Under torchrun each rank takes its share of the micro-batches and the results are summed
    over ranks (distributed.my_micro_batches, all_sum); in one process both do nothing."""
    total = len(lengths) if total is None else total
    loss, outputs = 0.0, {}
    for items, weight in distributed.my_micro_batches(micro_batches(lengths, max_tokens, rows_per_item, max_rows), dist):
        mb = MicroBatch(items, max(lengths[i] for i in items), weight)
        mb_loss, size, mb_outputs = loss_fn(mb)
        share = weight * size / total
        (mb_loss * share).backward()
        loss = loss + mb_loss.detach() * share
        for name, value in mb_outputs.items():
            if torch.is_tensor(value) and value.dim() == 1:
                laid_out = outputs.setdefault(name, torch.zeros(len(lengths), dtype=value.dtype, device=value.device))
                laid_out[items] += value.detach() * weight
            else:
                outputs[name] = outputs.get(name, 0.0) + (value.detach() if torch.is_tensor(value) else value) * weight
    return distributed.all_sum((loss, outputs), dist)


def optimizer_step(model, optimizer, max_grad_norm: float, loss: torch.Tensor, dist=None) -> tuple[float, bool]:
    """Clip the gradient to `max_grad_norm`, step, and zero the gradient. A non-finite loss or
    gradient never reaches the weights (nor the sampler, nor a checkpoint): that step is skipped,
    for the caller to count. Returns (the gradient's norm before clipping, whether it stepped)."""
    grad_norm = distributed.full_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad()
    return grad_norm.item(), stepped



def micro_batch_plan(lengths: list[int], max_tokens: int, rows_per_item: int = 1, max_rows: int | None = None,
                     dist=None) -> list[MicroBatch]:
    """The micro-batches this process runs for one optimizer step: micro_batches' packing within `max_tokens` (and
    `max_rows`) as MicroBatch(items, width, weight). Under torchrun each rank gets its share, the same number on every
    rank: a rank short of one gets a stand-in of weight 0 (the same forward and backward, so that the ranks' collectives
    match; scale its loss share by the weight and it changes nothing). One process: all of them, weight 1."""
    plan = distributed.my_micro_batches(micro_batches(lengths, max_tokens, rows_per_item, max_rows), dist)
    return [MicroBatch(items, max(lengths[i] for i in items), weight) for items, weight in plan]


def add_outputs(outputs: dict, mb: MicroBatch, mb_outputs: dict, num_items: int) -> dict:
    """Adds one micro-batch's outputs into the step's `outputs` (in place; also returned): a tensor with one value per
    item ([len(mb.items)]) lands at the micro-batch's items of a [num_items] tensor; anything else (a number, a 0-d or a
    batch-shaped tensor) is summed. Scaled by mb.weight: a torchrun stand-in adds nothing. distributed.all_sum of the
    result gives every rank the whole batch's."""
    for name, value in mb_outputs.items():
        if torch.is_tensor(value) and value.dim() == 1:
            laid_out = outputs.setdefault(name, torch.zeros(num_items, dtype=value.dtype, device=value.device))
            laid_out[mb.items] += value.detach() * mb.weight
        else:
            outputs[name] = outputs.get(name, 0.0) + (value.detach() if torch.is_tensor(value) else value) * mb.weight
    return outputs



def sampled_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """charts/kl in every script: KL(pi || pi_ref) of the sampled responses, estimated with k3 = r - log r - 1
    (r = pi_ref / pi: unbiased for samples from pi, never negative up to rounding) per token and summed over each response ([N]; the
    scripts log its mean over the batch). logp: the sampling policy's token logprobs (the script's pi_old: the
    learner's recomputation or the sampler's), ref_logp: the reference's, mask: the response tokens ([N, T])."""
    log_ratio = (ref_logp - logp) * mask
    return (torch.exp(log_ratio) - log_ratio - 1).mul(mask).sum(1)


@torch.no_grad()
def batch_logprobs(model, input_ids, attention_mask, completion_mask, lengths: list[int], max_tokens: int, dist=None,
                   bf16: bool = False, **processing) -> torch.Tensor:
    """token_logprobs of a whole right-padded batch ([N, T - 1]; `processing`: the sampler's temperature
    and top_p, the logprob contract), micro-batch by micro-batch within `max_tokens`, each cut to its
    longest row; `bf16`: under autocast. Whole on every rank under torchrun."""
    out = torch.zeros(completion_mask[:, 1:].shape, device=input_ids.device)
    for rows, weight in distributed.my_micro_batches(micro_batches(lengths, max_tokens), dist):
        width = max(lengths[i] for i in rows)
        with autocast(input_ids.device, bf16):
            logp = token_logprobs(model, input_ids[rows, :width], attention_mask[rows, :width], completion_mask[rows, :width],
                                  **processing)
        if weight:
            out[rows, :logp.shape[1]] = logp
    return distributed.all_sum(out, dist)


def autocast(device: torch.device, enabled: bool):
    """--autocast-bf16: the forward's matrix products in bf16; parameters, gradients and Adam keep their dtype."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def sampler_logprob_tensor(samples: list["Completion"], prompt_lens: list[int], width: int) -> torch.Tensor:
    """The sampler's per-token logprobs laid out like token_logprobs' output."""
    out = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, (s, plen) in enumerate(zip(samples, prompt_lens)):
        out[row, plen - 1: plen - 1 + len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------
# Prompts and evaluation
# --------------------------------------------------------------------------------------


def start_sampler(model_path: str, placement: str = "auto", max_model_len: int | None = None, seed: int = 0,
                  weights: torch.nn.Module | None = None, version: int = 0, background_push: bool = False,
                  urls: list[str] | None = None, wait: bool = True, **kwargs) -> vllm_sampler.Sampler:
    """Start the sampler process and wait until its engine is ready; or, with `urls`, connect to
    those running vLLM servers instead (remote_sampler.RemoteSampler: the same interface; the
    engine settings are then the servers' own). With `weights`, then connect_weights. `wait=False`
    (no `weights`): return as soon as the process is spawned, so that vLLM imports and builds its
    engine while the learner loads its models, and connect_weights waits for it; where that is not
    safe (start_sampler_early) the process starts in connect_weights instead."""
    if urls:
        from fastrl import remote_sampler  # (imported only for --sampler-url)

        sampler = remote_sampler.RemoteSampler(urls, model_path)
    else:
        config = vllm_sampler.SamplerConfig(model=model_path, placement=placement, max_model_len=max_model_len, seed=seed, **kwargs)
        sampler = vllm_sampler.Sampler(config)
        if wait or start_sampler_early(placement):  # (otherwise connect_weights starts it, once the learner has loaded)
            sampler.start(wait=wait)
    if weights is not None:
        connect_weights(sampler, weights, version, background_push)
    return sampler


def start_sampler_early(placement: str) -> bool:
    """Whether the sampler may build its engine while the learner loads its models: not when it shares
    the learner's GPU, because vLLM sizes its KV cache from the device's free memory before and after
    its own profiling run (vllm/utils/mem_utils.py:312-315, total_consumed = before_create.free_memory
    - after_profile.free_memory), so the learner's allocations meanwhile would count as the engine's."""
    return vllm_sampler.resolve_placement(placement) != "colocate"


def connect_weights(sampler, weights: torch.nn.Module, version: int = 0, background_push: bool = False):
    """Wait until the sampler is ready, open weight sync with the learner's policy `weights`
    (init_weight_sync, `background_push` for pushes from a thread) and push them labelled `version`
    when resuming (`version` > 0) or to servers (always: what they loaded is not ours to know), so the
    sampler starts from the learner's weights. Closes the sampler if any of that fails."""
    try:
        weight_sync.register_engines()  # imports vLLM's trainer side while the sampler still builds (~2 s less on the critical path)
        sampler.wait_ready()
        sampler.init_weight_sync(weights, background=background_push)
        if version or getattr(sampler, "urls", None):  # (a RemoteSampler)
            sampler.push_weights(version)
    except BaseException:
        sampler.close()
        raise
    return sampler


def peak_memory_mib(sampler=None) -> dict[str, float]:
    """Peak memory of this run: the learner's resident memory, its GPU memory (torch's peak
    allocation) when it has a GPU, and the sampler process's: resident, and its GPU memory beside the
    learner's when it has one (vllm_sampler.sampler_peak_memory_mib; a remote sampler: resident only, NaN)."""
    memory = {"learner": peak_rss_mib()}
    if torch.cuda.is_available():
        memory["learner_gpu"] = torch.cuda.max_memory_allocated() / 2**20
    if sampler is not None:
        peaks = getattr(sampler, "peak_memory_mib", None)
        memory.update(peaks() if peaks is not None else {"sampler": sampler.peak_rss_mib()})
    return memory


def encode_prompts(tokenizer, problems: list[Problem], max_prompt_tokens: int,
                   chat_template: bool = False) -> tuple[list[Problem], list[list[int]], int]:
    """Tokenize prompts, skipping (not crashing on) those longer than `max_prompt_tokens`.
    `chat_template` (instruct models): the problem's system turn (if any) and user turn (its `user`,
    else its prompt) in the tokenizer's chat template with the assistant's generation prompt, then the
    start of the assistant's reply the task gives (TinyZero's instruct setting: "Let me solve this step
    by step.\n<think>"), which the model continues. Returns the kept problems, their token ids and how
    many were skipped (log it)."""
    kept, ids = [], []
    for problem in problems:
        if chat_template:
            messages = [{"role": "system", "content": problem.system}] if problem.system else []
            messages.append({"role": "user", "content": problem.user or problem.prompt})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + problem.assistant_start
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own special tokens
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


def check_chat_template(model_path: str, enabled: bool) -> None:
    """--chat-template needs a tokenizer that has one. A local directory's files say (tokenizer_config.json's
    "chat_template", or chat_template.jinja / .json beside it), so the check runs before the sampler starts without
    importing transformers; a Hub id loads its tokenizer."""
    if not enabled:
        return
    path = Path(model_path)
    if path.is_dir():
        config = path / "tokenizer_config.json"
        found = any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")) or (
            config.is_file() and bool(json.loads(config.read_text()).get("chat_template")))
    else:
        found = bool(getattr(load_tokenizer(model_path), "chat_template", None))
    check_args(found, "--chat-template", "this model's tokenizer has no chat template (a base model?); drop the flag")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    return 1.0 if num_samples - num_correct < k else 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(sampler: "Sampler", task, tokenizer, num_problems: int | None, samples_per_problem: int, max_prompt_tokens: int,
             chat_template: bool = False, **sampling) -> dict[str, float]:
    """pass@k for every k the samples allow (eval_ks: 1, 2, 4, ... and samples_per_problem) on the first `num_problems` held-out
    problems (None: the whole test split of a fixed dataset), sampling with the sampler's current
    weights and `sampling` (temperature=0 is greedy pass@1, as the GSM8K evaluations report). Shows its
    progress (Progress): all samples are asked for at once, and waited for in twenty parts."""
    if num_problems is None:
        num_problems = len(task.test)
    problems, prompts, _ = encode_prompts(tokenizer, [task.problem("test", i) for i in range(num_problems)], max_prompt_tokens,
                                          chat_template)
    ids = sampler.submit(prompts, n=samples_per_problem, **sampling)
    samples: list[Completion] = []
    with Progress(len(ids), "eval", unit="sample", leave=False) as progress:
        for start in range(0, len(ids), part := max(1, math.ceil(len(ids) / 20))):
            samples += sampler.wait_for(ids[start:start + part])
            progress.update(len(ids[start:start + part]))
    correct = [sum(task.is_correct(s.text, p) for s in samples[i * samples_per_problem:(i + 1) * samples_per_problem])
               for i, p in enumerate(problems)]
    return {f"eval/pass@{k}": float(np.mean([pass_at_k(samples_per_problem, c, k) for c in correct])) for k in eval_ks(samples_per_problem)} | {
        "eval/problems": float(len(correct)), "eval/samples": float(samples_per_problem)}


def eval_ks(samples_per_problem: int) -> list[int]:
    """The k of pass@k that n samples per problem allow: the powers of two up to n, and n itself (n = 6: 1, 2, 4, 6)."""
    return sorted({2**i for i in range(samples_per_problem.bit_length())} | {samples_per_problem})


# --------------------------------------------------------------------------------------
# Logging and checkpoints
# --------------------------------------------------------------------------------------


def run_dir_of(resume: str) -> Path:
    """The run directory of a --resume argument: the directory itself, or the one holding the checkpoint
    file (<run>/checkpoint.pt, or <run>/checkpoints/<step>.pt that --keep-checkpoints keeps)."""
    path = Path(resume)
    if path.is_dir():
        return path
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


RUN_LENGTH = ("num_rounds", "num_steps")  # what a resume may change without --resume-changes: how long it runs


def instruct_model(model: str) -> bool:
    """Whether `model` names an instruct (chat) model, by the naming convention of their releases: `smollm2`, or a
    last path component ending in -Instruct, -it or -Chat (Qwen2.5-0.5B-Instruct, gemma-2-2b-it, Llama-2-7b-chat-hf)."""
    name = Path(model.rstrip("/")).name.lower()
    return model == SMOLLM2 or name.endswith(("-instruct", "-it", "-chat", "-chat-hf"))


def model_defaults(args_cls, model: str, paper: dict | None, smollm2: dict | None):
    """The defaults for `--model model` (None: `args_cls`'s own, the tiny model's): `smollm2` for --model smollm2 (a
    CPU-sized run of the real model), else `paper` for any model but `tiny`; and --chat-template on for an instruct
    model (instruct_model), which was trained on its template."""
    if model == TINY:
        return None
    changes = dict((smollm2 if model == SMOLLM2 and smollm2 is not None else paper) or {})
    if instruct_model(model) and any(f.name == "chat_template" for f in dataclasses.fields(args_cls)):
        changes.setdefault("chat_template", True)
    return dataclasses.replace(args_cls(), **changes) if changes else None


def parse_args(args_cls, argv: list[str] | None = None, paper: dict | None = None, smollm2: dict | None = None):
    """tyro.cli(args_cls). `args_cls`'s own defaults are the built-in tiny model's; `paper` holds the
    defaults that differ for a real model (the paper's), used when --model is not `tiny`, and `smollm2`
    those of --model smollm2 (model_defaults), so --help shows the defaults of the model given
    (`--model Qwen/Qwen2.5-0.5B --help`: the paper's).
    On `--resume RUN` the saved run's args.json supplies the defaults, so the run
    continues as it was started whatever the command line leaves out. A flag given with a value other
    than the saved one is refused in one line naming it (the run would silently change), unless
    `--resume-changes` says so; the run's length (RUN_LENGTH) may always be extended, and --verbose
    given or left out (it changes what is shown, not the run)."""
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    model = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                  if (a == "--model" and i + 1 < len(argv)) or a.startswith("--model=")), args_cls.model)
    default = model_defaults(args_cls, model, paper, smollm2)
    args = tyro.cli(args_cls, args=argv, default=default)
    SCRIPT_DEFAULTS[args_cls] = default or args_cls()  # what changed_flags compares with (the run summary's title)
    if not getattr(args, "resume", None):
        return args
    saved_file = run_dir_of(args.resume) / "args.json"
    if not saved_file.is_file():
        return args
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    saved = {k: tuple(v) if isinstance(v, list) and "tuple" in str(fields[k].type) else v
             for k, v in json.loads(saved_file.read_text()).items() if k in fields}
    base = dataclasses.replace(args_cls(), **saved)
    resumed = tyro.cli(args_cls, args=argv, default=base)
    changed = [name for name in fields if name not in RUN_LENGTH + ("resume", "resume_changes", "verbose")
               and getattr(resumed, name) != getattr(base, name)]
    if changed and not getattr(resumed, "resume_changes", False):
        what = "; ".join(f"--{n.replace('_', '-')} {getattr(resumed, n)!r} (saved: {getattr(base, n)!r})" for n in changed)
        raise SystemExit(f"error: {what}: differs from the run being resumed ({saved_file}); leave it out to continue as saved, "
                         "or add --resume-changes")
    return resumed


SCRIPT_DEFAULTS: dict[type, Any] = {}  # Args class -> its defaults for the model given (parse_args)


def changed_flags(args) -> str:
    """The command line of the run as it differs from its script's defaults, for the summary's title: the script's
    file and each flag whose value is not the default (a copy's own new flags included), e.g. `rloo_grpo.py
    --advantage grpo --k 2`. Compared with what parse_args parsed against; values a script derives after parsing
    (None defaults filled in) are not named."""
    defaults = SCRIPT_DEFAULTS.get(type(args))
    if defaults is None and dataclasses.is_dataclass(args):
        defaults = type(args)()
    words = [Path(sys.argv[0]).name]
    for f in dataclasses.fields(args) if defaults is not None else ():
        value, default = getattr(args, f.name), getattr(defaults, f.name)
        if value == default or (default is None and f.name not in _given_on_command_line()):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            words.append(f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return " ".join(words)


def _given_on_command_line() -> set[str]:
    """The field names of the flags on the command line (--x-y, --x-y=v, --no-x-y)."""
    names = {a[2:].split("=", 1)[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
    return names | {n[3:] for n in names if n.startswith("no_")}


def run_name(exp_name: str, seed: int, resume: str | None = None) -> str:
    """runs/<exp_name>__<seed>__<unix time> (RunLogger adds -1, -2, ... if that exists already); a
    resumed run keeps the directory it resumes from, after checking its checkpoint (so that a bad
    --resume is one line, before anything starts or any directory is made)."""
    if resume:
        checkpoint_state(resume)
        return run_dir_of(resume).name
    return f"{exp_name}__{seed}__{int(time.time())}"


class RunLogger:
    """runs/<run_name>/: console.log (a copy of stdout), args.json, metrics.jsonl (every logged
    metric), TensorBoard event files, and wandb when `track`."""

    def __init__(self, run_name: str, args: Any, track: bool = False, wandb_project: str = "fast-rl-llm", root: str = "runs"):
        if getattr(args, "resume", None):  # the run goes on in its own directory, wherever that is
            self.dir = run_dir_of(args.resume)
            self.dir.mkdir(parents=True, exist_ok=True)
        else:  # a new run gets a directory of its own, even when another run starts in the same second
            Path(root).mkdir(parents=True, exist_ok=True)
            for attempt in range(10_000):
                self.dir = Path(root) / (run_name if attempt == 0 else f"{run_name}-{attempt}")
                with contextlib.suppress(FileExistsError):
                    self.dir.mkdir()  # atomic: exactly one process creates it
                    break
        self.args = args
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        (self.dir / "args.json").write_text(json.dumps(config, indent=1, default=str))
        self._console = open(self.dir / "console.log", "a")
        self._stdout = sys.stdout
        sys.stdout = _Tee(self._stdout, self._console)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")
        self.start = time.time()
        if track:  # before the writer: wandb mirrors TensorBoard's scalars (sync_tensorboard)
            import wandb

            id_file = self.dir / "wandb_id"  # a resumed run continues its W&B run
            run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
            id_file.write_text(run_id)
            wandb.init(project=wandb_project, name=self.dir.name, id=run_id, resume="allow", config=config, dir=str(self.dir),
                       sync_tensorboard=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir))
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in config.items()))
        except ImportError:
            self.writer = None
        self.track = track
        self.last: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float], echo: bool = True) -> None:
        self.last.update(metrics)  # the latest value of each metric, for the report
        clean = {k: (float(v) if isinstance(v, (int, float, np.floating, np.integer)) or torch.is_tensor(v) else v) for k, v in metrics.items()}
        record = {"step": step, "wall": round(time.time() - self.start, 3), **clean}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.writer is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if echo:
            shown = " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in clean.items() if isinstance(v, float))
            print(f"[{record['wall']:7.1f}s] step {step}: {shown}")

    def report(self, step: int, title: str, row: dict[str, Any], eval_start: dict, eval_end: dict, memory: dict) -> str:
        """The end-of-run report, the same shape in every script: this run's line of its paper's
        table (`row`: column -> value), held-out pass@k at the start and the end, and peak memory.
        Printed, written to <run>/summary.md, and the gain and memory logged as metrics."""
        cell = lambda v: v if isinstance(v, str) else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"  # noqa: E731
        keys = sorted((k for k in eval_end if "@" in k), key=lambda k: int(k.split("@")[1]))
        measured = (f": {eval_end['eval/problems']:.0f} problems x {eval_end['eval/samples']:.0f} samples each, "
                    f"{', '.join(k.split('/')[1] for k in keys)} (unbiased, Chen et al. 2021)" if "eval/samples" in eval_end else "")
        command = changed_flags(self.args) if dataclasses.is_dataclass(self.args) else ""
        lines = [f"## {title}" + (f" | {command}" if command else ""), "", "| " + " | ".join(row) + " |", "|" + "---|" * len(row),
                 "| " + " | ".join(cell(v) for v in row.values()) + " |",
                 "", "held-out" + measured, "", "| model | " + " | ".join(k.split("/")[1] for k in keys) + " |", "|---|" + "---|" * len(keys),
                 "| start | " + " | ".join(f"{eval_start[k]:.3f}" for k in keys) + " |",
                 "| end | " + " | ".join(f"{eval_end[k]:.3f}" for k in keys) + " |",
                 "", "peak memory: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items()),
                 "", *what_happened(eval_start, eval_end, self.last.get("charts/kl"))]
        text = "\n".join(lines) + "\n"
        print("\n" + text, end="")
        (self.dir / "summary.md").write_text(text)
        self.log(step, {"eval/pass@1_gain": eval_end["eval/pass@1"] - eval_start["eval/pass@1"],
                        **{f"memory/{name}_peak_mib": mib for name, mib in memory.items()}}, echo=False)
        return text

    def snapshot(self, step: int, model: torch.nn.Module) -> None:
        """<run>/snapshots/<step>.pt: the weights and the run's wall time at this step (--snapshot-every),
        for benchmarks/learning_speed.py to evaluate after the run, so that no evaluation pauses it."""
        (self.dir / "snapshots").mkdir(exist_ok=True)
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        snapshot = {"step": step, "wall": time.time() - self.start, "model": state}
        replace_atomically(lambda tmp: torch.save(snapshot, tmp), self.dir / "snapshots" / f"{step}.pt")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.track:
            import wandb

            wandb.finish()
        self._jsonl.close()
        sys.stdout = self._stdout
        self._console.close()


def what_happened(eval_start: dict, eval_end: dict, kl: float | None) -> list[str]:
    """Two lines for a reader of the end-of-run report: did held-out pass@1 move beyond the evaluation's
    noise (two binomial standard errors over its problems), and what the largest k's pass@k and the KL
    to the reference say (pass@k for large k falling while pass@1 rises: the policy sharpened onto
    answers it could already find, as RL does, and paid that KL for it)."""
    p0, p1, n = eval_start.get("eval/pass@1"), eval_end.get("eval/pass@1"), eval_end.get("eval/problems")
    if p0 is None or p1 is None:
        return []
    noise = 2 * math.sqrt(max(p0 * (1 - p0), 1e-4) / n) if n else 0.0
    moved = "within the evaluation's noise" if abs(p1 - p0) <= noise else ("up" if p1 > p0 else "down")
    first = f"what happened: held-out pass@1 {p0:.3f} -> {p1:.3f}, {moved}" + (
        f" (+-{noise:.3f} is two standard errors over {n:.0f} problems)" if n else "")
    ks = sorted((k for k in eval_end if "@" in k), key=lambda k: int(k.split("@")[1]))
    top = ks[-1] if ks else None
    kl_text = f"; KL to the reference {kl:.3f} nats" if kl is not None and math.isfinite(kl) else ""
    if top is None or top == "eval/pass@1":
        return [first, f"(one sample per problem: pass@1 only; --eval-samples n gives pass@k up to k = n){kl_text}"]
    q0, q1 = eval_start[top], eval_end[top]
    if q1 < q0 - 1e-9 and p1 >= p0:
        second = (f"{top.split('/')[1]} {q0:.3f} -> {q1:.3f}: the policy sharpened (it puts more mass on answers it already found, "
                  f"fewer distinct tries succeed), as RL does{kl_text}")
    else:
        second = f"{top.split('/')[1]} {q0:.3f} -> {q1:.3f}{kl_text}"
    return [first, second]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl, as RunLogger wrote them. A partly written last line (a
    run still logging) is ignored; any other bad line is an error naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {run_dir}: no metrics.jsonl (not a run directory?)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i + 1 < len(lines):
                raise SystemExit(f"error: {path}: line {i + 1} is not JSON") from None
    return rows


CHECKPOINT_KEYS = ("model", "optimizer", "step", "data_position", "rng")


def save_checkpoint(path: str | Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    data_position: int, hf_model=None, tokenizer=None, keep: int = 1, dist=None, **extra) -> None:
    """Model, optimizer, step, RNG states and data position, written atomically; only tensors and
    plain data, so that --resume loads it with weights_only=True (no code runs on load). With
    `hf_model` (and its tokenizer), also <dir>/model/: a Hugging Face model directory
    (safetensors) that transformers and vLLM load as is. `path` is always the latest; with `keep` > 1
    (--keep-checkpoints) the latest `keep` are also kept as <dir>/checkpoints/<step>.pt (hard links:
    no copy), older ones deleted; any of them resumes a run. Under torchrun (`dist`) every rank calls
    it and rank 0 writes the file one process writes (`path` and `hf_model`, rank 0's unsharded copy,
    are read on rank 0 only)."""
    if dist is not None and dist.enabled:
        write = lambda m, o: save_checkpoint(path, m, o, step, data_position, hf_model, tokenizer, keep, **extra)  # noqa: E731
        return distributed.save_sharded(model, optimizer, write, dist)
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
    if keep > 1:
        kept = path.parent / "checkpoints"
        kept.mkdir(exist_ok=True)
        (kept / f"{step}.pt").unlink(missing_ok=True)
        os.link(path, kept / f"{step}.pt")
        for old in sorted(kept.glob("*.pt"), key=lambda p: int(p.stem))[:-keep]:
            old.unlink()
    if hf_model is not None:
        save_hf_model(path.parent / "model", hf_model, tokenizer)


def save_hf_model(out_dir: str | Path, model, tokenizer=None) -> None:
    """`save_pretrained` (safetensors, tokenizer included) into out_dir, replacing it whole."""
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


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, required: tuple = (),
                    dist=None) -> dict:
    """Restore what save_checkpoint wrote; returns the whole state (step, data_position, extras).
    `required`: the extra keys the caller reads, checked before anything is restored. Under torchrun
    (`dist`) every rank calls it: rank 0 reads the file and restores its RNG, every rank gets its
    shards and the state's scalars (distributed.load_sharded)."""
    if dist is not None and dist.enabled:
        return distributed.load_sharded(path, model, optimizer, lambda m, o: load_checkpoint(path, m, o, required), dist)
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
