"""Side by side with TRL (issue 7): TRL's RLOOTrainer against `rloo_kreuse.py --k 1`, and TRL's
online DPO trainer against `online_dpo_async.py` (asynchronous, its default), on the same work,
in one run. Then the same speed measurement on a ~50M-parameter random model.

    .venv/bin/pip install -e '.[trl]'                          # trl==1.16.0 (pinned)
    .venv/bin/python benchmarks/trl_comparison.py              # ~10 min on 2 cores
    .venv/bin/python benchmarks/trl_comparison.py --quick      # smoke run, a few steps each
    .venv/bin/python benchmarks/trl_comparison.py --accuracy-seeds 1 2 3   # RLOO accuracy over seeds (~10 min)
    .venv/bin/python benchmarks/trl_comparison.py --model smollm2  # SmolLM2-135M-Instruct instead (issue 39; see below)

Same work on both sides: the same model directory, the same training prompts (problems 0..N*P-1
of the offline Countdown generator, in order; TRL's online DPO reads them in order too: train_sampling_strategy
"sequential"), P prompts x G completions per optimizer step, the
same number of steps, max completion length, temperature (top-p 1, no top-k), learning rate
(constant, Adam(W) without weight decay, eps 1e-7), gradient clipping, fp32 on the CPU, and the
same reward: `task.reward` (our Countdown verifier) handed to TRL as a reward function.

Ours runs as a subprocess of the real script with its real CLI flags. The only addition is a
thin wrapper (`run_instrumented`) that times `common.token_logprobs` (with and without grad),
`Tensor.backward`, `Adam.step`, the reward, the waits for the sampler and the weight pushes, and
counts the completion tokens of every training round; it changes no number. TRL runs in a
subprocess too (`run_trl_worker`), with the same timers on the trainer's own methods (generate,
per-token logprobs, reward, backward, optimizer step). TRL's model is saved to a directory after
training and evaluated exactly as our scripts evaluate: `tasks.evaluate` on a vLLM sampler
started on that directory (same seed, same held-out problems, same samples per problem and
sampling parameters; both sides' start accuracies therefore come out identical).

Wall per step: the steady-state optimizer step, i.e. the mean over steps 2..N of the time between
consecutive optimizer steps (TRL: `on_step_end` callbacks; ours: the per-round wall time the
script logs). Our async DPO also leaves out its last round, which has no next round to generate
(as benchmarks/dpo_sync_vs_async.py does). Completion tokens/s: completion tokens generated for
training per step (EOS included, padding not) / wall per step.

What cannot be made equal (TRL 1.16 has no knob for it), and so differs:
- RLOO KL: ours adds kl_coef * KL(pi || pi_ref) (k3 estimator, summed per response) to the
  loss, with its gradient; TRL subtracts beta * (log pi_old - log pi_ref) summed per response
  (k1) from the reward, before the leave-one-out baseline. Same beta (0.01), different estimator
  and place.
- RLOO entropy bonus: ours 0.01 (the tiny default); TRL has none. `--ours-rloo-extra
  '--ent-coef 0'` removes ours.
- RLOO policy gradient: ours -w A log pi(y) with w = exp(log pi - log pi_sampler) detached
  (sequence level, ~1 at K = 1); TRL -min(r A, clip(r) A) with r = exp(log pi - log pi_old) and
  log pi_old recomputed by the learner (exactly 1 at num_iterations = 1). Same gradient at K = 1.
  TRL pays one extra no-grad forward per step for log pi_old; ours takes the sampler's logprobs.
- Online DPO: TRL always samples 2 completions per prompt (hard-coded), so ours runs with
  `--group-size 2` (its tiny default is 4). Ties: TRL keeps tied pairs (chosen = the first
  completion when rewards are equal) and trains on every prompt; ours drops prompts whose
  completions tie, so it trains on fewer pairs per step.
- Online DPO timing: ours is asynchronous (generates step t+1 while training on step t, one step
  off-policy); TRL is synchronous and on-policy. That is the comparison asked for.
- Generation: TRL generates with `model.generate` of the training model in the training process
  (use_vllm=False: a padded batch that runs until its longest completion ends; no weight sync);
  ours uses the vLLM sampler process and pushes the weights to it after every step.
- Threads: ours runs as it ships (the sampler is a second process; the learner takes every core
  while the sampler is idle and one while it generates, launch.learner_threads; an explicit
  OMP_NUM_THREADS is a fixed budget). TRL is one process; on the tiny model it gets 1 thread, its
  fastest here (torch's default of 2 was ~8x slower: the tiny model's ops are too small to
  split); on the 50M model it runs with 2 (torch's default, ~1.7x faster than 1) and with 1, and
  ours as shipped and with OMP_NUM_THREADS=2 (a learner that uses both cores).
- TRL's defaults that would slow it down are turned off: gradient checkpointing (TRL default on;
  for online DPO it also disables the KV cache during generation) and bf16 autocast (default on); ours runs
  in fp32 too (--no-autocast-bf16 --sampler-dtype auto), whatever its preset on a CPU with bf16.
  Its optimizer stays TRL's default (fused AdamW, weight decay 0, which is Adam).
- RNG: both sides use seed 1, but vLLM's and torch's sampling streams differ, so the completions
  (and so the runs) are different draws of the same process.

SmolLM2 (`--model smollm2`): SmolLM2-135M-Instruct (fastrl/smollm2.py) on our scripts' --model smollm2 presets, read
from the scripts themselves (smollm2_workloads): the arithmetic task in the chat template; RLOO 8 prompts x 8, T 0.8,
top-p 0.95 (TRL samples with it; ours also applies it to the learner's logprobs, the logprob contract), lr 2e-5, no KL
(neither side loads a reference model), no entropy bonus, 64 new tokens; online DPO 16 prompts x 2 (TRL's), T 0.7,
lr 1e-5, beta 0.1, 64 new tokens, and ours with TRL's missing-EOS penalty (score - 1: --eos-penalty-mode subtract).
TRL gets each prompt as the conversation our scripts put in the chat template and applies the same template: the
first prompt's token ids are checked equal before the runs (TRL's own tokenization code) and as each run sends them
(our sampler's submit, TRL's generate). Ours runs as it ships; TRL once per --smollm2-trl-threads (1 and 2), and the
faster is the baseline, the only TRL run evaluated (its start accuracy is our run's start evaluation: the same
model, problems, sampler settings and seed). RLOO runs in micro-batches of 32 rows on both sides (TRL's
per_device_train_batch_size 32 x 2 accumulated; ours --micro-batch-tokens 32 x (48 + 64)): the step's 64 rows in one
pass took ~16 GB on either side, which a 23 GB machine with a sampler beside it does not always have. Accuracy: pass@1
on the first --smollm2-eval-problems (50) held-out problems x 4 samples, sampled as in training, both sides by
tasks.evaluate with the same sampler settings. What still differs is what differs on the tiny model (the loss's KL and
entropy terms excepted: both are off): the online DPO ties, ours asynchronous, generation by vLLM against TRL's
model.generate, the RNG streams.

Accuracy is one run per side (one seed), not a confidence interval; --accuracy-seeds measures
the tiny RLOO accuracy over several seeds, for ours with and without the entropy bonus and TRL. The 50M model is a
random init (run by our scripts as `--model tiny` with FASTRL_CACHE pointing at it, so that they keep the
tiny prompt format): its accuracy means nothing and is not reported; only speed is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import tasks  # noqa: E402
from fastrl import checks, launch, runlog, util, vllm_sampler  # noqa: E402

TRL_VERSION = "1.16.0"
MAX_PROMPT_TOKENS = 64  # what our scripts use with --model tiny (and so with the 50M model run as `tiny`)
M50_CACHE = util.CACHE_DIR / "bench-50m"  # FASTRL_CACHE for the 50M runs of ours (see build_50m)


@dataclass
class Args:
    seed: int = 1
    """seed of every run (ours and TRL)"""
    rloo_steps: int = 40
    """RLOO optimizer steps (= sampling rounds at K = 1) on the tiny model"""
    rloo_prompts: int = 32
    """RLOO prompts per step"""
    rloo_completions: int = 8
    """RLOO completions per prompt (group size)"""
    rloo_temperature: float = 0.8
    """RLOO sampling temperature (ours' default)"""
    dpo_steps: int = 40
    """online DPO optimizer steps on the tiny model"""
    dpo_prompts: int = 32
    """online DPO prompts per step"""
    dpo_completions: int = 2
    """online DPO completions per prompt: TRL always samples 2, so ours gets --group-size 2"""
    dpo_temperature: float = 1.0
    """online DPO sampling temperature (ours' tiny default)"""
    learning_rate: float = 1e-4
    """learning rate of both methods (ours' tiny default), constant"""
    max_new_tokens: int = 32
    """max completion length (ours' tiny default)"""
    eval_problems: int = 200
    """held-out problems for the accuracy (ours' tiny default)"""
    m50_steps: int = 5
    """optimizer steps per side on the ~50M model (speed only)"""
    m50_rloo_prompts: int = 8
    """RLOO prompts per step on the ~50M model"""
    m50_rloo_completions: int = 4
    """RLOO completions per prompt on the ~50M model"""
    m50_dpo_prompts: int = 16
    """online DPO prompts per step on the ~50M model (x 2 completions)"""
    skip_50m: bool = False
    """leave out the ~50M model measurement"""
    trl_threads: int = 1
    """torch threads of the TRL process on the tiny model (1: torch's default of 2 was ~8x slower there)"""
    m50_trl_threads: tuple[int, ...] = (2, 1)
    """TRL runs on the ~50M model, one per thread count (2, torch's default, was ~1.7x faster than 1)"""
    m50_ours_threads: tuple[int, ...] = (1, 2)
    """our runs on the ~50M model, one per OMP_NUM_THREADS (1: as the scripts ship; 2: the learner uses both cores)"""
    ours_rloo_extra: str = ""
    """extra flags for rloo_kreuse.py, e.g. '--ent-coef 0'"""
    ours_dpo_extra: str = ""
    """extra flags for online_dpo_async.py"""
    quick: bool = False
    """smoke run: 3 steps per side on the tiny model, 2 on the 50M, 20 eval problems"""
    accuracy_seeds: tuple[int, ...] = ()
    """if given, run only the RLOO accuracy study instead: the tiny RLOO workload once per seed for
    each of our --accuracy-variants and for TRL, accuracies per seed and their mean"""
    accuracy_variants: tuple[str, ...] = ("", "--ent-coef 0")
    """extra flags of our runs in the accuracy study ('': as shipped; '--ent-coef 0': no entropy bonus, as TRL)"""
    model: Literal["tiny", "smollm2"] = "tiny"
    """tiny: the tiny model, then the ~50M random model; smollm2: SmolLM2-135M-Instruct (--model smollm2 of our scripts)
    on its preset task (arithmetic in the chat template) with the presets' settings, TRL at each
    --smollm2-trl-threads"""
    smollm2_rloo_steps: int = 3
    """RLOO optimizer steps on SmolLM2 (the preset's 8 prompts x 8)"""
    smollm2_dpo_steps: int = 4
    """online DPO optimizer steps on SmolLM2 (the preset's 16 prompts, x 2 completions: TRL's)"""
    smollm2_eval_problems: int = 50
    """held-out problems on SmolLM2 (x --smollm2-eval-samples, sampled as in training; both sides the same)"""
    smollm2_eval_samples: int = 4
    """samples per held-out problem on SmolLM2 (the RLOO preset's)"""
    smollm2_rloo_micro_batch: int = 32
    """SmolLM2 RLOO rows per forward/backward, the same on both sides (the gradients accumulate to the step's 64 rows):
    TRL's per_device_train_batch_size, ours --micro-batch-tokens of as many rows of the longest sequence (prompt + max
    new tokens). 64 in one pass needs ~16 GB on either side; 0: both in one pass (TRL 64 rows, ours as the preset
    ships)"""
    smollm2_trl_threads: tuple[int, ...] = (1, 2)
    """TRL runs on SmolLM2, one per torch thread count; the fastest is the baseline (and the one evaluated)"""


@dataclass
class Workload:
    """One training run, described the same way for both sides."""

    method: str  # "rloo" or "dpo"
    model_dir: str
    steps: int
    prompts: int
    completions: int
    temperature: float
    learning_rate: float
    max_new_tokens: int
    seed: int
    eval_problems: int  # 0: no evaluation (the 50M model)
    eval_samples: int  # per held-out problem: 16 for RLOO (pass@1 of the Table 4 protocol), 4 for DPO
    model: str = "tiny"  # our scripts' --model: `tiny` (also the ~50M model, see build_50m) or `smollm2`
    task: str = "countdown"  # our scripts' --task (tasks.make_task); the reward on both sides is its task.reward
    top_p: float = 1.0  # nucleus of the sampling on both sides (and of our learner's logprobs: the logprob contract)
    kl_coef: float = 0.01  # RLOO: our --kl-coef = TRL's beta (0: neither side loads a reference model)
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # our --max-prompt-tokens (no prompt of the workload is longer)
    ours_extra: tuple[str, ...] = ()  # flags our script gets besides the shared ones, to match TRL where it can
    # RLOO: TRL's rows per forward/backward (per_device_train_batch_size); the step's P x G accumulate
    micro_batch: int = 64

    @property
    def chat_template(self) -> bool:
        """Our scripts wrap the prompts in the chat template for an instruct model (smollm2); TRL then gets them as
        conversations and applies the same template (checked: run_trl_worker and run_ours record the first prompt's
        ids)."""
        return checks.instruct_model(self.model)


# --------------------------------------------------------------------------------------
# The reward, as TRL wants it
# --------------------------------------------------------------------------------------


class TaskReward:
    """Our task's reward as a TRL reward function: TRL calls it with the prompts, the decoded
    completions (for conversational prompts: [{"role": "assistant", "content": text}]) and every extra
    dataset column as lists; the `index` column names the training problem, which the task rebuilds."""

    def __init__(self, task):
        self.task = task
        self.__name__ = task.name  # TRL names the reward's metrics after it

    def __call__(self, prompts, completions, index, **kwargs):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [self.task.reward(text, self.task.problem("train", int(i))) for text, i in zip(texts, index)]


def make_task(w: Workload):
    """The workload's task, as our scripts make it (the tiny prompt format with --model tiny)."""
    return tasks.make_task(w.task, w.seed, tiny_prompts=w.model == checks.TINY)


def chat_messages(problem: tasks.Problem) -> list[dict]:
    """The conversation tasks.encode_prompts wraps in the chat template: the problem's system turn (if any) and its
    user turn. TRL cannot start the assistant's reply itself, so a task that gives one is refused."""
    assert not problem.assistant_start, "TRL cannot continue a started assistant turn (the task's assistant_start)"
    # (None: --system-prompt "", no system turn, which TRL's chat template would fill with the model's default one)
    assert problem.system is not None, "TRL renders a default system turn where ours has none (--system-prompt '')"
    return ([{"role": "system", "content": problem.system}] if problem.system else []) + [
        {"role": "user", "content": problem.user or problem.prompt}]


def train_dataset(task, num_problems: int, chat_template: bool = False):
    """The first `num_problems` training problems, in order: the prompts ours takes (as conversations under the
    chat template, which TRL then applies), and their index for the reward."""
    from datasets import Dataset

    problems = [task.problem("train", i) for i in range(num_problems)]
    prompts = [chat_messages(p) for p in problems] if chat_template else [p.prompt for p in problems]
    return Dataset.from_dict({"prompt": prompts, "index": list(range(num_problems))})


def our_prompt_ids(w: Workload, tokenizer, index: int = 0) -> list[int]:
    """The token ids our scripts send the sampler for training problem `index` (tasks.encode_prompts)."""
    _, ids, _ = tasks.encode_prompts(tokenizer, [make_task(w).problem("train", index)], w.max_prompt_tokens,
                                     w.chat_template)
    assert ids, f"training problem {index} is longer than {w.max_prompt_tokens} prompt tokens"
    return ids[0]


def trl_prompt_ids(method: str, prompt, tokenizer) -> list[int]:
    """The token ids TRL 1.16 generates from for one dataset prompt, by its own code: RLOOTrainer._tokenize_prompts
    (apply_chat_template(tokenize=True) for a conversation, the tokenizer otherwise), the online DPO trainer's _generate
    (maybe_apply_chat_template, then the tokenizer without special tokens)."""
    from types import SimpleNamespace

    if method == "rloo":
        from trl import RLOOTrainer

        trainer = SimpleNamespace(processing_class=tokenizer, chat_template_kwargs={})
        return list(RLOOTrainer._tokenize_prompts(trainer, [prompt])[0][0])
    from trl.data_utils import maybe_apply_chat_template

    text = maybe_apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
    return list(tokenizer(text=[text], add_special_tokens=False)["input_ids"][0])


# --------------------------------------------------------------------------------------
# TRL side (runs in its own process: run_trl_worker)
# --------------------------------------------------------------------------------------


def trl_config_kwargs(w: Workload, output_dir: str) -> dict:
    """Every TRL setting we change from TRL 1.16's defaults; everything else is the default."""
    shared = dict(
        output_dir=output_dir, max_steps=w.steps, learning_rate=w.learning_rate, lr_scheduler_type="constant",
        weight_decay=0.0, adam_epsilon=1e-7, temperature=w.temperature, top_p=w.top_p, top_k=0, seed=w.seed,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
    )
    if w.method == "rloo":
        batch = w.prompts * w.completions
        # ours: --micro-batch-tokens (64 rows of the tiny model fit its default in one)
        micro = min(w.micro_batch, batch)
        assert batch % micro == 0, f"{batch} completions per step must split into minibatches of {micro}"
        return shared | dict(
            num_generations=w.completions, per_device_train_batch_size=micro,
                             gradient_accumulation_steps=batch // micro,
            max_completion_length=w.max_new_tokens, beta=w.kl_coef, num_iterations=1, max_grad_norm=0.5,
            shuffle_dataset=False,
        )
    assert w.completions == 2, "TRL's online DPO samples exactly 2 completions per prompt"
    return shared | dict(
        per_device_train_batch_size=w.prompts, gradient_accumulation_steps=1, max_new_tokens=w.max_new_tokens,
        beta=0.1, loss_type="sigmoid", missing_eos_penalty=1.0, max_grad_norm=1.0,
        train_sampling_strategy="sequential",  # the prompts in order, as ours (the Trainer's default shuffles them)
    )


def make_step_profiler():
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        """Times every optimizer step (on_step_end to on_step_end) and the phases inside it, by
        wrapping the trainer's own methods; counts the completion tokens generated per step."""

        def __init__(self):
            self.start, self.step_ends, self.tokens = 0.0, [], []
            self.seconds = defaultdict(float)

        def wrap(self, obj, name, phase, count_tokens=None, inspect_args=None):
            original = getattr(obj, name)

            def timed(*args, **kwargs):
                if inspect_args is not None:
                    inspect_args(*args, **kwargs)
                key = phase() if callable(phase) else phase
                start = time.perf_counter()
                out = original(*args, **kwargs)
                self.seconds[key] += time.perf_counter() - start
                if count_tokens is not None:
                    self.tokens.append(count_tokens(out))
                return out

            setattr(obj, name, timed)

        def on_train_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, *args, **kwargs):
            self._optimizer_start = time.perf_counter()

        def on_optimizer_step(self, *args, **kwargs):
            self.seconds["optimizer"] += time.perf_counter() - self._optimizer_start

        def on_step_end(self, *args, **kwargs):
            self.step_ends.append(time.perf_counter())

    return StepProfiler()


def forward_phase():
    return "policy forward (grad)" if torch.is_grad_enabled() else "logprob forwards (no grad)"


def run_trl_worker(spec_path: str) -> None:
    """Entry point of the TRL subprocess: train one Workload with TRL, write timings (and the
    trained model, for the evaluation) next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    w, out = Workload(**spec["workload"]), Path(spec_path).parent
    torch.set_num_threads(spec["threads"])
    task = make_task(w)
    tokenizer = util.load_tokenizer(w.model_dir)
    model = common.load_policy(w.model_dir, "cpu")
    dataset = train_dataset(task, w.steps * w.prompts, w.chat_template)
    kwargs = trl_config_kwargs(w, str(out / "trl_output"))
    profiler = make_step_profiler()
    first_prompt = {}  # the token ids of the first prompt TRL generates from, as it generates

    def record_rloo(prompt_ids, *args, **kwargs):
        first_prompt.setdefault("ids", list(prompt_ids[0]))

    def record_dpo(out):
        # row 0 of the left-padded prompts, unpadded
        first_prompt.setdefault("ids", out[0][0][out[1][0].bool()].tolist())

    if w.method == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        trainer = RLOOTrainer(model=model, reward_funcs=TaskReward(task), args=RLOOConfig(**kwargs),
                              train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[profiler])
        profiler.wrap(trainer, "_generate_single_turn", "generation", count_tokens=lambda ids: sum(len(c) for c in ids),
                      inspect_args=record_rloo)
        profiler.wrap(trainer, "_get_per_token_logps_and_entropies", forward_phase)
        profiler.wrap(trainer, "_calculate_rewards", "reward")
    else:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        trainer = OnlineDPOTrainer(model=model, reward_funcs=TaskReward(task), args=OnlineDPOConfig(**kwargs),
                                   train_dataset=dataset, processing_class=tokenizer, callbacks=[profiler])
        profiler.wrap(trainer, "_generate", "generation",
                      count_tokens=lambda out: (record_dpo(out), int(out[3].sum()))[1])
        profiler.wrap(trainer, "_forward", forward_phase)
        profiler.wrap(trainer, "_calculate_rewards_from_functions", "reward")
    profiler.wrap(trainer.accelerator, "backward", "backward")
    config = trainer.args
    resolved = dict(torch_threads=torch.get_num_threads(), optim=str(config.optim),
                    per_device_train_batch_size=config.per_device_train_batch_size,
                    gradient_accumulation_steps=config.gradient_accumulation_steps)
    if w.method == "rloo":
        resolved |= dict(generation_batch_size=config.generation_batch_size,
                         steps_per_generation=config.steps_per_generation,
                         epsilon=config.epsilon, normalize_advantages=config.normalize_advantages)
    trainer.train()
    if spec["save"]:  # weights + config only; tokenizer and generation config as in the source model
        save_dir = out / "model"
        trainer.model.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
        shutil.copy(Path(w.model_dir) / "generation_config.json", save_dir / "generation_config.json")
    (out / "result.json").write_text(json.dumps(dict(
        start=profiler.start, step_ends=profiler.step_ends, tokens=profiler.tokens, seconds=profiler.seconds,
        config={k: v for k, v in kwargs.items() if k != "output_dir"}, resolved=resolved,
        trl_version=metadata.version("trl"), first_prompt_ids=first_prompt.get("ids"))))


def exit_status(code: int) -> str:
    """A subprocess's exit, in words: SIGKILL is most often the kernel's out-of-memory killer."""
    return "killed (SIGKILL: out of memory?)" if code == -9 else f"exit status {code}"


def run_trl(w: Workload, threads: int, save: bool, workdir: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"trl_{w.method}_", dir=workdir))
    (out / "spec.json").write_text(json.dumps(dict(workload=dataclasses.asdict(w), threads=threads, save=save)))
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'benchmarks')!r}, {str(ROOT)!r}]; "
            f"from trl_comparison import run_trl_worker; run_trl_worker({str(out / 'spec.json')!r})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL {w.method} failed ({exit_status(done.returncode)}):\n{done.stderr[-3000:]}")
    r = json.loads((out / "result.json").read_text())
    ends = np.array(r["step_ends"])
    steps = np.diff(np.concatenate([[r["start"]], ends]))
    result = dict(side="TRL", steps=len(ends), step=float(np.mean(steps[1:] if len(steps) > 1 else steps)),
                  loop=float(ends[-1] - r["start"]), tokens=float(np.mean(r["tokens"])), config=r["config"],
                  resolved=r["resolved"], version=r["trl_version"], first_prompt_ids=r["first_prompt_ids"])
    phases = {k: v / len(ends) for k, v in r["seconds"].items()}
    result["phases"] = phases | {"other": result["loop"] / len(ends) - sum(phases.values())}
    if save:
        result["model_dir"] = str(out / "model")
    return result


# --------------------------------------------------------------------------------------
# Our side: the real script in a subprocess, with timers around it
# --------------------------------------------------------------------------------------


def run_instrumented() -> None:
    """Entry point of the subprocess that runs one of our scripts (sys.argv[1:]: the script and
    its flags) unchanged, with timers on common.token_logprobs (with/without grad),
    Tensor.backward and Adam.step, and the completion tokens of each training round (evaluation
    excluded). Writes them to $FASTRL_BENCH_PROFILE when the script ends."""
    import runpy

    seconds, tokens, waits, pushes, in_eval, first_submit = defaultdict(float), [], [], [], [False], {}

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            key = phase() if callable(phase) else phase
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start
        return wrapper

    evaluate, wait_for = tasks.evaluate, vllm_sampler.Sampler.wait_for

    def evaluate_untracked(*args, **kwargs):
        in_eval[0] = True
        try:
            return evaluate(*args, **kwargs)
        finally:
            in_eval[0] = False

    def wait_for_counted(self, request_ids, *args, **kwargs):
        start = time.perf_counter()
        out = wait_for(self, request_ids, *args, **kwargs)
        if not in_eval[0]:
            waits.append(time.perf_counter() - start)
            tokens.append(sum(len(c.token_ids) for c in out))
        return out

    def reward_phase():
        return "evaluation reward" if in_eval[0] else "reward"

    submit = vllm_sampler.Sampler.submit

    # the first training round's first prompt and sampling settings
    def submit_recorded(self, prompts, *args, **kwargs):
        if not in_eval[0] and not first_submit:
            first_submit.update(prompt_ids=list(prompts[0]), sampling={k: v for k, v in kwargs.items() if k != "tags"})
        return submit(self, prompts, *args, **kwargs)

    tasks.evaluate, vllm_sampler.Sampler.wait_for = evaluate_untracked, wait_for_counted
    vllm_sampler.Sampler.submit = submit_recorded
    for task_class in (tasks.CountdownTask, tasks.ArithmeticTask):
        task_class.reward = timed(task_class.reward, reward_phase)
    # learner-side time spent on the sampler: waiting for completions (wait_for_counted), pushing
    # weights; the start of a push may wait for the round in flight to finish: counted as waiting
    push_weights, start_weight_update = vllm_sampler.Sampler.push_weights, vllm_sampler.Sampler.start_weight_update

    def push_timed(*args, **kwargs):
        pushes.append([0.0, 0.0])
        start = time.perf_counter()
        try:
            return push_weights(*args, **kwargs)
        finally:
            pushes[-1][0] = time.perf_counter() - start

    def start_timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return start_weight_update(*args, **kwargs)
        finally:
            pushes[-1][1] = time.perf_counter() - start

    vllm_sampler.Sampler.push_weights, vllm_sampler.Sampler.start_weight_update = push_timed, start_timed
    common.token_logprobs = timed(common.token_logprobs, forward_phase)
    torch.Tensor.backward = timed(torch.Tensor.backward, "backward")
    torch.optim.Adam.step = timed(torch.optim.Adam.step, "optimizer")
    script, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        Path(os.environ["FASTRL_BENCH_PROFILE"]).write_text(json.dumps(dict(seconds=seconds, tokens=tokens,
                                                                            waits=waits, pushes=pushes,
                                                                            first_submit=first_submit)))


def run_ours(w: Workload, flags: list[str], workdir: Path, env: dict | None = None) -> dict:
    script = "rloo_kreuse.py" if w.method == "rloo" else "online_dpo_async.py"
    profile = Path(tempfile.mkdtemp(prefix=f"ours_{w.method}_", dir=workdir)) / "profile.json"
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'benchmarks')!r}, {str(ROOT)!r}]; "
            "from trl_comparison import run_instrumented; run_instrumented()")
    command = [sys.executable, "-c", code, str(ROOT / script), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {}), "FASTRL_BENCH_PROFILE": str(profile)})
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({exit_status(done.returncode)}):\n{done.stderr[-3000:]}")
    run_dir = ROOT / done.stdout.split("run directory: ")[1].split()[0]
    rows = runlog.read_metrics(run_dir)
    prof = json.loads(profile.read_text())
    tokens = float(np.mean(prof["tokens"]))  # every generated training round (the last round's data included)
    n, seconds = w.steps, prof["seconds"]
    if w.method == "rloo":
        rounds = [r for r in rows if "time/grad_steps_per_second" in r]
        walls = np.array([r["step"] / r["time/grad_steps_per_second"] for r in rounds])  # loop wall after each round
        steps, loop = np.diff(np.concatenate([[0.0], walls])), walls[-1]
        step = float(np.mean(steps[1:] if n > 1 else steps))
        accuracy = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    else:
        rounds = [r for r in rows if "time/step_seconds" in r]
        loop = rounds[-1]["charts/episodes"] / rounds[-1]["charts/episodes_per_second"]
        steady = rounds[1:-1] if n > 2 else rounds[:-1] or rounds  # round 1 waits for its data, round N trains alone
        step = float(np.mean([r["time/step_seconds"] for r in steady]))
        accuracy = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    # both scripts wait for every round inside their loop's clock and push after each of their N rounds (fastrl/run.py)
    waits = prof["waits"]
    pushes = np.array(prof["pushes"][:n]).reshape(-1, 2)
    phases = {"generation": (sum(waits) + pushes[:, 1].sum()) / n,
              "weight push": (pushes[:, 0] - pushes[:, 1]).sum() / n}
    learner = ("logprob forwards (no grad)", "policy forward (grad)", "backward", "optimizer", "reward")
    phases |= {k: seconds.get(k, 0.0) / n for k in learner}
    phases["other"] = loop / n - sum(phases.values())
    result = dict(side="ours", steps=n, step=step, loop=float(loop), tokens=tokens, phases=phases, run_dir=str(run_dir),
                  command="".join(f"{k}={v} " for k, v in (env or {}).items()) + f".venv/bin/python {script} "
                  + " ".join(flags))
    result["first_prompt_ids"], result["sampling"] = (prof["first_submit"].get("prompt_ids"),
                                                      prof["first_submit"].get("sampling"))
    if w.method == "dpo":
        result["overlapped_generation"] = (float(np.nanmean([r["time/generate_seconds"] for r in rounds[:-1]]))
                                           if n > 1 else float("nan"))
        result["pairs"] = float(np.mean([r["charts/pairs"] for r in rounds]))
    if accuracy:
        result["accuracy"] = (accuracy[0], accuracy[-1])
    return result


def ours_flags(w: Workload, args: Args, rloo_extra: str | None = None) -> list[str]:
    eval_flags = ["--eval-problems", str(max(w.eval_problems, 4)), "--eval-samples", str(w.eval_samples)]
    shared = ["--model", w.model, "--seed", str(w.seed), "--num-rounds", str(w.steps), "--num-prompts", str(w.prompts),
              "--learning-rate", str(w.learning_rate), "--temperature", str(w.temperature),
              "--max-new-tokens", str(w.max_new_tokens), *eval_flags,
              "--no-autocast-bf16", "--sampler-dtype", "auto"]  # fp32 as TRL runs (not the preset's bf16 on a bf16 CPU)
    # the tiny model's flags stay as they were (its task and top-p are the scripts' defaults)
    if w.model != checks.TINY:
        shared += ["--task", w.task, "--top-p", str(w.top_p), "--max-prompt-tokens", str(w.max_prompt_tokens)]
    if w.method == "rloo":
        top_p = ["--top-p", "1.0"] if w.model == checks.TINY else []
        return ["--k", "1", "--group-size", str(w.completions), *top_p, *shared, *w.ours_extra,
                "--exp-name", "trl_cmp_rloo", *(args.ours_rloo_extra if rloo_extra is None else rloo_extra).split()]
    return ["--group-size", str(w.completions), *shared, *w.ours_extra, "--exp-name", "trl_cmp_dpo",
            *args.ours_dpo_extra.split()]


# --------------------------------------------------------------------------------------
# Evaluation of TRL's model, the way our scripts evaluate
# --------------------------------------------------------------------------------------


def evaluate_model(model_dir: str, w: Workload) -> float:
    """pass@1 on the held-out problems with a sampler started on `model_dir`: what both scripts log
    as eval/pass@1 (the same prompts, sampling settings, seed and sampler threads as the script's evaluation)."""
    task = make_task(w)
    tokenizer = util.load_tokenizer(w.model_dir)  # the source model's: the prompts exactly as ours encodes them
    sampling = dict(temperature=w.temperature, max_tokens=w.max_new_tokens) | (
        dict(top_p=w.top_p) if w.method == "rloo" or w.model != checks.TINY else {})
    quiet = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL")}
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # the sampler process inherits it; keeps the benchmark's output readable
    # the threads our script's sampler has: every core for the synchronous RLOO, half of them for the asynchronous DPO
    threads = {} if w.model == checks.TINY else dict(threads=launch.sampler_threads(0, overlapped=w.method == "dpo"))
    try:
        sampler = launch.start_sampler(model_dir, placement="cpu", seed=w.seed,
                                       max_model_len=w.max_prompt_tokens + w.max_new_tokens,
                                       **threads)
    finally:
        if quiet["VLLM_LOGGING_LEVEL"] is None:
            os.environ.pop("VLLM_LOGGING_LEVEL")
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = quiet["VLLM_LOGGING_LEVEL"]
    try:
        return tasks.evaluate(sampler, task, tokenizer, w.eval_problems, w.eval_samples, w.max_prompt_tokens,
                              w.chat_template,
                               **sampling)["eval/pass@1"]
    finally:
        sampler.close()


# --------------------------------------------------------------------------------------
# The ~50M-parameter model
# --------------------------------------------------------------------------------------


def build_50m() -> str:
    """A random ~50M-parameter Qwen2 (hidden 512, 8 layers, MLP 3584) with the tiny model's
    tokenizer, saved where `--model tiny` finds it when FASTRL_CACHE=M50_CACHE: so our scripts run
    it with the tiny prompts and defaults (with any other model they switch to the chat prompt,
    longer than the char tokenizer's context). Deterministic; cached."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = common.tiny_model_path()
    path = M50_CACHE / tiny.name
    if (path / "config.json").exists():
        return str(path)
    tokenizer = util.load_tokenizer(str(tiny))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=3584, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=True,
                         rope_theta=10000.0, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    Qwen2ForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.copy(tiny / "generation_config.json", tmp / "generation_config.json")
    tmp.rename(path)
    return str(path)


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------

PHASES = ["generation", "logprob forwards (no grad)", "policy forward (grad)", "backward", "optimizer", "reward",
          "weight push", "other"]


def speed_table(title: str, rows: list[dict], with_accuracy: bool, target: float = 1.5) -> None:
    print(f"\n{title}\n")
    head = "| side | steps | wall per step (s) | loop wall (s) | completion tokens / step | completion tokens/s |"
    print(head + (" held-out accuracy start -> end |" if with_accuracy else ""))
    print("|---" * (6 + with_accuracy) + "|")
    for r in rows:
        line = (f"| {r['side']} | {r['steps']} | {r['step']:.3f} | {r['loop']:.1f} | {r['tokens']:.0f} | "
                f"{r['tokens'] / r['step']:.0f} |")
        if with_accuracy:
            line += (f" {r['accuracy'][0]:.3f} -> {r['accuracy'][1]:.3f} |" if "accuracy" in r
                     else " not evaluated (not the fastest) |")
        print(line)
    print()
    for ours in (r for r in rows if r["side"].startswith("ours")):
        for trl in (r for r in rows if r["side"].startswith("TRL")):
            line = (f"{ours['side']} vs {trl['side']}: {trl['step'] / ours['step']:.2f}x faster per step "
                    f"(target >= {target:g}x)")
            if with_accuracy and "accuracy" in trl:
                line += (f", final accuracy {ours['accuracy'][1]:.3f} vs {trl['accuracy'][1]:.3f} "
                         f"({ours['accuracy'][1] - trl['accuracy'][1]:+.3f})")
            print(line)
    for r in rows:
        if "pairs" in r:
            print(f"{r['side']} trained on {r['pairs']:.1f} pairs per step on average (ties dropped); TRL on every "
                  "prompt's pair")


def phase_table(rows: list[dict]) -> None:
    """Where each side spends its step: seconds per step, averaged over all steps (loop wall / steps)."""
    print("\nwhere the step goes (learner-side seconds per step, mean over all steps; 'generation' is the time the "
          "learner spends generating or waiting for completions)\n")
    print("| side | step (loop / steps) | " + " | ".join(PHASES) + " |")
    print("|---" * (len(PHASES) + 2) + "|")
    for r in rows:
        total = r["loop"] / r["steps"]
        cells = [f"{r['phases'].get(p, 0.0):.3f} ({100 * r['phases'].get(p, 0.0) / total:.0f}%)" for p in PHASES]
        print(f"| {r['side']} | {total:.3f} | " + " | ".join(cells) + " |")
    for r in rows:
        if np.isfinite(r.get("overlapped_generation", float("nan"))):
            print(f"{r['side']}: the sampler generates the next step's completions in {r['overlapped_generation']:.3f} "
                  "s, overlapped with training")


def compare(w: Workload, args: Args, workdir: Path, trl_threads: tuple[int, ...], ours_threads: tuple[int, ...] = (1,),
            env: dict | None = None, evaluate: bool = True, start_from_ours: bool = False) -> list[dict]:
    """Ours (with each OMP_NUM_THREADS) then TRL (with each thread count) on the same workload. With `evaluate`, the
    TRL run at its fastest thread count is evaluated (its start accuracy once, on the source model; `start_from_ours`:
    taken from our run's start evaluation, which has the same sampler settings, seed and problems), the others not."""
    rows = []
    for threads in ours_threads:  # 1: the environment as it is (the learner's default is one thread)
        row = run_ours(w, ours_flags(w, args), workdir,
                       (env or {}) | ({} if threads == 1 else {"OMP_NUM_THREADS": str(threads)}))
        row["side"] = "ours" if threads == 1 else f"ours, OMP_NUM_THREADS={threads}"
        rows.append(row)
    trl_rows = []
    for threads in trl_threads:
        row = run_trl(w, threads, save=evaluate, workdir=workdir)
        row["side"] = f"TRL, {threads} thread{'s' if threads > 1 else ''}"
        trl_rows.append(row)
    if evaluate:
        fastest = min(trl_rows, key=lambda r: r["step"])
        start = rows[0]["accuracy"][0] if start_from_ours else evaluate_model(w.model_dir, w)
        fastest["accuracy"] = (start, evaluate_model(fastest["model_dir"], w))
    for row in trl_rows:
        if "model_dir" in row:
            shutil.rmtree(row["model_dir"], ignore_errors=True)  # (a SmolLM2 copy is 0.5 GB)
    check_same_prompts(rows + trl_rows)
    return rows + trl_rows


def check_same_prompts(rows: list[dict]) -> None:
    """Every side generated its first training round from the same first prompt, token for token (recorded as it
    was sent: our sampler's submit, TRL's generate)."""
    ids = {r["side"]: r.get("first_prompt_ids") for r in rows}
    if len({json.dumps(v) for v in ids.values()}) != 1:
        raise SystemExit("error: the sides' first prompts differ:\n" + "\n".join(f"  {k}: {v}" for k, v in ids.items()))


def smollm2_workloads(args: Args, model_dir: str | None = None,
                      prompt_tokens: int | None = None) -> tuple[Workload, Workload]:
    """The SmolLM2 workloads, read from our scripts' own --model smollm2 presets (rloo_kreuse.SMOLLM2,
    online_dpo_async.SMOLLM2) so they follow them: task, prompts, group size, learning rate, temperature, top-p, max new
    and prompt tokens, KL. Changed where TRL has no equal: online DPO samples 2 completions a prompt (TRL's), and ours
    gets TRL's missing-EOS penalty (score - 1, --eos-penalty-mode subtract; its preset replaces the score by -1).
    Evaluation: --smollm2-eval-problems x --smollm2-eval-samples on both sides. RLOO in micro-batches of
    --smollm2-rloo-micro-batch rows on both sides. `model_dir`: the converted model's directory (None:
    common.resolve_model, which builds it on first use); `prompt_tokens`: the longest training prompt (None:
    measured)."""
    import online_dpo_async
    import rloo_kreuse

    model_dir = model_dir or common.resolve_model(checks.SMOLLM2)
    r = checks.parse_args(rloo_kreuse.Args, ["--model", checks.SMOLLM2], paper=rloo_kreuse.PAPER,
                          smollm2=rloo_kreuse.SMOLLM2)
    d = online_dpo_async.parse_args(["--model", checks.SMOLLM2])
    # what TRL's side cannot take otherwise (trl_config_kwargs): no entropy bonus, RLOO's clip 0.5, DPO's beta 0.1, clip
    # 1
    assert r.ent_coef == 0 and r.k == 1 and r.max_grad_norm == 0.5 and r.kl_estimator == "k1", r
    assert d.beta == 0.1 and d.loss_type == "dpo" and d.max_grad_norm == 1.0 and d.missing_eos_penalty == 1.0, d
    assert r.chat_template and d.chat_template and r.task == d.task, (r, d)
    shared = dict(model_dir=model_dir, model=checks.SMOLLM2, seed=args.seed, eval_problems=args.smollm2_eval_problems,
                  eval_samples=args.smollm2_eval_samples)
    if prompt_tokens is None:  # every arithmetic prompt has the same length in SmolLM2's template
        prompt_tokens = max(len(ids) for ids in tasks.encode_prompts(util.load_tokenizer(model_dir), [
            tasks.make_task(r.task, args.seed, tiny_prompts=False).problem("train", i) for i in range(64)],
            10**6, True)[1])
    micro = args.smollm2_rloo_micro_batch
    rows = dict(micro_batch=micro,
                ours_extra=("--micro-batch-tokens", str(micro * (prompt_tokens + r.max_new_tokens)))) if micro else {}
    rloo = Workload("rloo", steps=args.smollm2_rloo_steps, prompts=r.num_prompts, completions=r.group_size,
                    temperature=r.temperature,
                    learning_rate=r.learning_rate, max_new_tokens=r.max_new_tokens, task=r.task, top_p=r.top_p,
                    kl_coef=r.kl_coef,
                    max_prompt_tokens=r.max_prompt_tokens, **rows, **shared)
    dpo = Workload("dpo", steps=args.smollm2_dpo_steps, prompts=d.num_prompts, completions=2, temperature=d.temperature,
                   learning_rate=d.learning_rate, max_new_tokens=d.max_new_tokens, task=d.task, top_p=d.top_p,
                   max_prompt_tokens=d.max_prompt_tokens, ours_extra=("--eos-penalty-mode", "subtract"), **shared)
    return rloo, dpo


def accuracy_study(w: Workload, args: Args, workdir: Path) -> None:
    """Is the RLOO accuracy gap between the sides more than seed noise, and is it our entropy
    bonus? One run per side and seed, the same workload otherwise."""
    sides = ([f"ours {v}".strip() if v else "ours" for v in args.accuracy_variants]
             + [f"TRL, {args.trl_threads} thread{'s' if args.trl_threads > 1 else ''}"])
    final, steps = {side: [] for side in sides}, {side: [] for side in sides}
    for seed in args.accuracy_seeds:
        ws = dataclasses.replace(w, seed=seed)
        rows = [run_ours(ws, ours_flags(ws, args, v), workdir) for v in args.accuracy_variants]
        trl = run_trl(ws, args.trl_threads, save=True, workdir=workdir)
        trl["accuracy"] = (None, evaluate_model(trl["model_dir"], ws))
        for side, row in zip(sides, rows + [trl]):
            final[side].append(row["accuracy"][1])
            steps[side].append(row["step"])
            print(f"seed {seed}: {side}: accuracy {row['accuracy'][1]:.3f}, {row['step']:.3f} s per step", flush=True)
    print(f"\n## RLOO accuracy study (tiny model, {w.steps} steps of {w.prompts} prompts x {w.completions}; pass@1 on "
          f"{w.eval_problems} held-out problems x {w.eval_samples} samples)\n")
    print("| side | " + " | ".join(f"seed {s}" for s in args.accuracy_seeds) + " | mean | sd | wall per step (s) |")
    print("|---" * (len(args.accuracy_seeds) + 4) + "|")
    for side in sides:
        print(f"| {side} | " + " | ".join(f"{a:.3f}" for a in final[side]) +
              f" | {np.mean(final[side]):.3f} | {np.std(final[side], ddof=1) if len(final[side]) > 1 else 0:.3f} | "
              f"{np.mean(steps[side]):.3f} |")


def main():
    args = tyro.cli(Args)
    if args.quick:
        args.rloo_steps = args.dpo_steps = 3
        args.m50_steps, args.eval_problems = 2, 20
        args.smollm2_rloo_steps = args.smollm2_dpo_steps = 2
        args.smollm2_eval_problems = 10
    try:
        trl_version = metadata.version("trl")
    except metadata.PackageNotFoundError:
        raise SystemExit("error: TRL is not installed: .venv/bin/pip install -e '.[trl]'") from None
    if trl_version != TRL_VERSION:
        print(f"warning: TRL {trl_version} installed, this benchmark pins {TRL_VERSION}")
    started = time.time()
    print(f"TRL {trl_version}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.model == checks.SMOLLM2:
        main_smollm2(args, trl_version, started)
        return
    tiny = str(common.tiny_model_path())
    workdir = Path(tempfile.mkdtemp(prefix="trl_comparison_"))
    shared = dict(learning_rate=args.learning_rate, max_new_tokens=args.max_new_tokens, seed=args.seed)
    rloo = Workload("rloo", tiny, args.rloo_steps, args.rloo_prompts, args.rloo_completions, args.rloo_temperature,
                    eval_problems=args.eval_problems, eval_samples=16, **shared)
    dpo = Workload("dpo", tiny, args.dpo_steps, args.dpo_prompts, args.dpo_completions, args.dpo_temperature,
                   eval_problems=args.eval_problems, eval_samples=4, **shared)
    if args.accuracy_seeds:
        try:
            accuracy_study(rloo, args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"\nwhole command: {time.time() - started:.0f} s")
        return
    try:
        results = {"rloo": compare(rloo, args, workdir, (args.trl_threads,)),
                   "dpo": compare(dpo, args, workdir, (args.trl_threads,))}
        if not args.skip_50m:
            m50 = build_50m()
            env = {"FASTRL_CACHE": str(M50_CACHE)}
            m50_rloo = dataclasses.replace(rloo, model_dir=m50, steps=args.m50_steps, prompts=args.m50_rloo_prompts,
                                           completions=args.m50_rloo_completions, eval_problems=0, eval_samples=1)
            m50_dpo = dataclasses.replace(dpo, model_dir=m50, steps=args.m50_steps, prompts=args.m50_dpo_prompts,
                                          eval_problems=0, eval_samples=1)
            for key, w in (("rloo_50m", m50_rloo), ("dpo_50m", m50_dpo)):
                results[key] = compare(w, args, workdir, args.m50_trl_threads, args.m50_ours_threads, env,
                                       evaluate=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    method_tables(results, rloo, dpo, "tiny model")
    if not args.skip_50m:
        with safe_open(Path(m50) / "model.safetensors", "pt") as f:  # tied embeddings: stored once
            n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) / 1e6
        for key, w in (("rloo_50m", m50_rloo), ("dpo_50m", m50_dpo)):
            print(f"\n## {w.method.upper()} on a random {n:.1f}M-parameter Qwen2 (speed only: a random init's accuracy "
                  f"means nothing): {w.steps} steps of {w.prompts} prompts x {w.completions}, max {w.max_new_tokens} "
                  "new tokens")
            speed_table("", results[key], False)
            phase_table(results[key])

    summary(results, trl_version, started)


def method_tables(results: dict, rloo: Workload, dpo: Workload, label: str, target: float = 1.5) -> None:
    """The RLOO and the online DPO tables of one model."""
    top_p = lambda w: f", top-p {w.top_p:g}" if w.top_p < 1 else ""  # noqa: E731
    print(f"\n## RLOO: TRL RLOOTrainer vs rloo_kreuse.py --k 1 ({label}, {rloo.steps} steps of {rloo.prompts} prompts "
          f"x {rloo.completions}, T={rloo.temperature}{top_p(rloo)}, lr {rloo.learning_rate}, max "
          f"{rloo.max_new_tokens} new tokens)")
    speed_table(f"accuracy: pass@1 on {rloo.eval_problems} held-out problems x {rloo.eval_samples} samples",
                results["rloo"], True,
                target)
    phase_table(results["rloo"])
    print(f"\n## Online DPO: TRL OnlineDPOTrainer vs online_dpo_async.py (async) ({label}, {dpo.steps} steps of "
          f"{dpo.prompts} prompts x {dpo.completions}, T={dpo.temperature}{top_p(dpo)}, lr {dpo.learning_rate}, "
          f"max {dpo.max_new_tokens} new tokens)")
    speed_table(f"accuracy: pass@1 on {dpo.eval_problems} held-out problems x {dpo.eval_samples} samples",
                results["dpo"], True,
                target)
    phase_table(results["dpo"])


def summary(results: dict, trl_version: str, started: float) -> None:
    print(f"\n## TRL configuration (TRL {trl_version}; every field not listed is TRL's default)\n")
    for key, rows in results.items():
        trl = next(r for r in rows if r["side"].startswith("TRL"))
        print(f"{key}: {trl['config']}\n  resolved: {trl['resolved']}")
        print("  ours: " + "; ".join(dict.fromkeys(r["command"] for r in rows if r["side"].startswith("ours"))))
    print(f"\nwhole command: {time.time() - started:.0f} s")
    # last: ours against the best baseline, TRL at its fastest thread count on the same 2 cores
    print("\nspeed-up against the best baseline at equal hardware (TRL at its fastest thread count), per step:")
    for key, rows in results.items():
        trl = min((r for r in rows if r["side"].startswith("TRL")), key=lambda r: r["step"])
        ours = min((r for r in rows if r["side"].startswith("ours")), key=lambda r: r["step"])
        line = f"{key}: {ours['side']} {trl['step'] / ours['step']:.2f}x vs {trl['side']}"
        if "accuracy" in trl and "accuracy" in ours:
            line += f"; held-out pass@1 after training {ours['accuracy'][1]:.3f} vs {trl['accuracy'][1]:.3f}"
        print(line)


def main_smollm2(args: Args, trl_version: str, started: float) -> None:
    """RLOO and online DPO on SmolLM2-135M-Instruct, ours as its presets ship against TRL at each thread count."""
    rloo, dpo = smollm2_workloads(args)
    tokenizer = util.load_tokenizer(rloo.model_dir)
    print(f"RLOO in micro-batches of {rloo.micro_batch} rows on both sides (ours: {' '.join(rloo.ours_extra)})")
    for w in (rloo, dpo):  # the check before anything runs: TRL's own tokenization of our first prompt gives our ids
        ours, trl = (our_prompt_ids(w, tokenizer),
                     trl_prompt_ids(w.method, chat_messages(make_task(w).problem("train", 0)), tokenizer))
        assert ours == trl, f"{w.method}: TRL would see other prompt ids than ours:\n  ours {ours}\n  TRL  {trl}"
    first = our_prompt_ids(rloo, tokenizer)
    print(f"first training prompt, {len(first)} tokens, the same ids on both sides (checked again as each run sends "
          f"it): {tokenizer.decode(first)!r}")
    workdir = Path(tempfile.mkdtemp(prefix="trl_comparison_"))
    try:
        # the start accuracy: our run's (the same evaluation of the same model; a 10 x 4 smoke run gave 0.050 on both
        # sides)
        results = {"rloo": compare(rloo, args, workdir, args.smollm2_trl_threads, start_from_ours=True),
                   "dpo": compare(dpo, args, workdir, args.smollm2_trl_threads, start_from_ours=True)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    method_tables(results, rloo, dpo, f"SmolLM2-135M-Instruct, {rloo.task}, chat template", target=2.0)
    for key, rows in results.items():
        ours = next(r for r in rows if r["side"].startswith("ours"))
        print(f"{key}: ours samples with {ours['sampling']}")
    summary(results, trl_version, started)


if __name__ == "__main__":
    main()
