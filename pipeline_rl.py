"""PipelineRL with in-flight weight updates (Algorithm 2), and Conventional RL (Algorithm 1) for the paper's comparison.
Paper: Piché et al., "PipelineRL: Faster On-policy RL for Long Sequence Generation", arXiv:2509.19128.

What it adds to examples/reinforce.py: in-flight weight pushes and the lag they give. The actor keeps H sequences in
flight; finished groups queue for the trainer, new prompts take their place. After every optimizer step the learner
pushes its weights in flight: running sequences pause, take them and go on (on their stale KV cache, or re-prefilled:
--recompute-kv), so a sequence mixes policy versions; REINFORCE's loss is weighted by min(c, pi/mu), mu the sampler's
own logprobs (Eq. 4-5), and below --ess-threshold a step is skipped for fresh data.
Conventional RL (--mode conventional --steps-per-rl-step G): B*G sequences from one policy, shuffled into G batches,
G steps, then the push. --max-lag 0 gives PipelineRL the batches of Conventional RL with G = 1.

    python pipeline_rl.py --model tiny [--mode conventional --steps-per-rl-step 4]
    torchrun --nproc-per-node 2 pipeline_rl.py --model tiny   # the learner data-parallel (FSDP2)
"""

import dataclasses
import math
import os
import time
from collections import deque
from typing import Annotated, Literal

import numpy as np
import torch

import common
import tasks
from common import Run, ess, truncated_is_weights  # (Run: every script's setup)
from fastrl import checks, memory_plan, util, vllm_sampler
from fastrl.run import RunArgs


@dataclasses.dataclass
class Args(RunArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    mode: Literal["pipeline", "conventional"] = "pipeline"
    """pipeline (Algorithm 2) or conventional (Algorithm 1)"""
    steps_per_rl_step: int = 4
    """the paper's G (conventional mode; not the group size): optimizer steps per RL step of B*G sequences"""
    train_batch_size: int = 64
    """B: sequences per optimizer step (a multiple of --group-size)"""
    gen_batch_size: Annotated[int | None, checks.help_default("B; conventional: B*G")] = None
    """H: sequences the sampler decodes at once, kept in flight; Section 4's smallest that feeds the trainer"""
    group_size: int = 4
    """samples per prompt; the per-prompt mean reward is the baseline [paper 8, the authors' `attempts`; tiny 4]"""
    num_steps: int = 120
    """optimizer steps [paper 1000; tiny 120]"""
    learning_rate: float = 1e-4
    """AdamW's peak learning rate [paper 1e-6; tiny 1e-4]"""
    weight_decay: float = 0.0
    """AdamW's weight decay, not on names holding "bias" or "LayerNorm.weight" (the authors' split: Qwen2's q/k/v biases
    are spared, nothing of Llama's; RMSNorm weights decay) (the paper names Adam) [paper 0.01; tiny 0]"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after the warmup, constant or HF's cosine to 0 at --lr-schedule-steps [paper cosine; tiny constant]"""
    warmup_steps: int = 0
    """the rate rises linearly from 0 over this many steps (HF's: the first step's is 0) [paper 50; tiny 0]"""
    lr_schedule_steps: int | None = None
    """the step where the cosine reaches 0 (None: --num-steps) [paper 100000, the authors' `max_train_steps`]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm [paper 0.3, the authors' `gradient_clipping_threshold`; tiny 1.0]"""
    micro_batch_size: int = 16
    """at most this many sequences per forward/backward, grouped by length (memory and padding only: one step per B)"""
    tis_cap: float = 5.0
    """c: token importance weights pi/mu (mu: the sampler's logprobs) truncated at c (Eq. 5; Section 5's 5)"""
    ess_threshold: Annotated[float | None, checks.help_default("0.5; conventional: 0")] = None
    """skip a step whose batch ESS (Eq. 6) is below this and wait for data of the current weights (0: never)"""
    loss_norm: Literal["sequence", "token"] = "sequence"
    """divide the loss's sum over response tokens by the sequences (Eq. 4-5's 1/(mK)) or the tokens (a token mean)"""
    recompute_kv: bool = False
    """after a push, re-prefill running sequences with the new weights (off: keep the stale KV cache, as the paper)"""
    background_push: bool = True
    """pipeline mode: push from a thread, from a snapshot (one more copy of the weights), and train meanwhile"""
    max_lag: int | None = None
    """pipeline mode: drop (and count) data more than this many steps old (None: no bound; 0: strictly on-policy)"""
    kl_coef: float = 0.0
    """optional KL(pi || pi_ref) penalty (k3 estimator per token)"""
    binary_reward: bool = False
    """reward 1 if correct, else 0 (Sec. 5), not the task's own (--reward, if given, wins) [paper on; tiny off]"""
    temperature: float = 1.0
    """sampling temperature (PipelineRL trains at 1.0); the learner's logprobs use the same"""
    top_p: float = 1.0
    """nucleus sampling (PipelineRL trains without one); the learner applies the same nucleus (the logprob contract)"""
    max_new_tokens: int = 32
    """response length cap [paper 1024; tiny 32]"""
    max_prompt_tokens: int = 64
    """prompt budget: longer prompts are skipped and counted [paper 512; tiny 64]"""
    long_tail: float = 0.0
    """benchmark workload: if > 0, responses forced to Pareto lengths of this shape, at least --long-tail-scale"""
    long_tail_scale: int = 8
    """minimum forced length of the long-tailed workload"""
    data_timeout: float = 1800.0
    """the trainer raises if no sequence arrives and no prompt is admitted for this many seconds while it waits"""

    def __post_init__(self):
        B, n = self.train_batch_size, self.group_size
        for ok, flag, message in [  # before RunArgs' checks: these name --temperature and --top-p apart
            (self.num_steps >= 1, "--num-steps", f"must be >= 1, got {self.num_steps}"),
            (self.steps_per_rl_step >= 1, "--steps-per-rl-step", f"must be >= 1, got {self.steps_per_rl_step}"),
            (self.micro_batch_size >= 1, "--micro-batch-size", f"must be >= 1, got {self.micro_batch_size}"),
            (n >= 2, "--group-size", "the per-prompt baseline needs at least 2 samples per prompt"),
            (B >= n and B % n == 0, "--train-batch-size", f"must be a positive multiple of --group-size ({B} vs {n})"),
            (self.gen_batch_size is None or self.gen_batch_size >= n, "--gen-batch-size", "must hold a prompt's group"),
            (self.temperature > 0, "--temperature", "must be > 0 (greedy has no logprobs for the importance weights)"),
            (0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}"),
            (self.tis_cap > 0, "--tis-cap", f"must be > 0, got {self.tis_cap}"),
            (self.ess_threshold is None or 0 <= self.ess_threshold <= 1, "--ess-threshold", "must be in [0, 1]"),
            (self.max_lag is None or self.max_lag >= 0, "--max-lag", f"must be >= 0, got {self.max_lag}"),
            (self.lr_schedule_steps is None or self.lr_schedule_steps > self.warmup_steps, "--lr-schedule-steps",
             f"must be > --warmup-steps ({self.warmup_steps}), got {self.lr_schedule_steps}"),
            (min(self.weight_decay, self.warmup_steps, self.kl_coef, self.save_every, self.long_tail) >= 0,
             "--weight-decay/--warmup-steps/--kl-coef/--save-every/--long-tail", "must be >= 0"),
            (self.max_grad_norm > 0 and self.data_timeout > 0 and self.long_tail_scale >= 1,
             "--max-grad-norm/--data-timeout/--long-tail-scale", "must be > 0 (the scale >= 1)"),
        ]:
            checks.check_args(ok, flag, message)  # one line naming the flag, before any process starts
        super().__post_init__()


# a real model's defaults; the group size, weight decay, schedule and clipping: the authors' conf/finetune/base.yaml
PAPER = dict(num_steps=1000, learning_rate=1e-6, binary_reward=True, max_new_tokens=1024, max_prompt_tokens=512,
             autocast_bf16=torch.cuda.is_available(), gradient_checkpointing=torch.cuda.is_available(), group_size=8,
             weight_decay=0.01, lr_schedule="cosine", warmup_steps=50, lr_schedule_steps=100_000, max_grad_norm=0.3)
# --model smollm2 on a CPU: arithmetic at T 0.8 (at 1.0 a seed found no signal), constant rate, pushes from the loop
SMOLLM2 = PAPER | dict(task="arithmetic", num_steps=20, train_batch_size=32, learning_rate=2e-5, temperature=0.8,
                       max_new_tokens=64, max_prompt_tokens=128, eval_problems=100, eval_samples=4, autocast_bf16=False,
                       gradient_checkpointing=False, weight_decay=0.0, lr_schedule="constant", warmup_steps=0,
                       lr_schedule_steps=None, max_grad_norm=1.0, micro_batch_tokens=512, background_push=False)


def mode_defaults(args: Args) -> Args:
    """H and the ESS threshold by --mode where not given: B and the guard (Section 5), or B*G and none (Algorithm 1)."""
    conventional = args.mode == "conventional"
    H = args.gen_batch_size or args.train_batch_size * (args.steps_per_rl_step if conventional else 1)
    return dataclasses.replace(args, gen_batch_size=H, ess_threshold=(0.0 if conventional else 0.5)
                               if args.ess_threshold is None else args.ess_threshold)


def scheduled_learning_rate(args: Args, step: int) -> float:
    """The rate of the step after `step` steps (HF's linear warmup from 0, then constant or a half cosine to 0)."""
    if step < args.warmup_steps:
        return args.learning_rate * step / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.learning_rate
    progress = min(1.0, (step - args.warmup_steps) / ((args.lr_schedule_steps or args.num_steps) - args.warmup_steps))
    return args.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))


def reward_function(task, args: Args):
    """A completion's (reward trained on, its own score: charts/reward): --binary-reward's 1/0, else the score."""
    def score(completion, problem, binary=args.binary_reward and args.reward is None):
        own = task.reward(completion, problem)
        return (float(task.is_correct(completion, problem)) if binary else own), own
    return score


# ALGO LOGIC: the advantage and the truncated-IS loss (Eq. 4-5); the weights and the ESS (Eq. 6) are common.py's
def per_prompt_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A = r - mean of the prompt's group. rewards: [prompts, group]."""
    return rewards - rewards.mean(1, keepdim=True)


def truncated_is_loss(logp, behaviour_logp, ref_logp, mask, advantages, *, tis_cap: float, kl_coef: float,
                      loss_norm: Literal["sequence", "token"] = "sequence"):
    """Eq. 5: -sum over response tokens of min(c, pi/mu) * A * log pi, over the rows (Eq. 4-5's 1/(mK)) or the tokens
    (loss_norm="token"); plus kl_coef * the k3 KL to the reference, summed alike. Returns (loss, pg, kl)."""
    count = mask.shape[0] if loss_norm == "sequence" else mask.sum().clamp(min=1)
    w, _ = truncated_is_weights(logp.detach(), behaviour_logp, mask, "token", tis_cap)
    pg = -(w * advantages[:, None] * logp * mask).sum() / count
    log_ratio = (ref_logp - logp) * mask
    kl = ((torch.expm1(log_ratio) - log_ratio) * mask).sum() / count
    return pg + kl_coef * kl, pg, kl


@dataclasses.dataclass
class Batch(common.Batch):  # B sequences on the learner (padded rows, mask, the sampler's logprobs mu), and:
    advantages: torch.Tensor | None = None  # [N]
    fresh: torch.Tensor | None = None  # [N] bool: generated wholly by the learner's weights (charts/logprob_diff's)
    total: int = 1  # what the loss divides by: the sequences, or the response tokens (--loss-norm token)


def micro_batch_loss(policy, ref_policy, batch: Batch, mb, args: Args):
    """truncated_is_loss on a micro-batch's rows (the logprob contract). Returns (loss, size in the loss's units,
    outputs): pg, kl_penalty, the untruncated pi/mu in the batch's layout, k3 KL per row, |log pi/mu| on fresh rows."""
    rows, cut, width = mb.items, slice(0, mb.width - 1), mb.width
    inputs = (batch.input_ids[rows, :width], batch.attention_mask[rows, :width], batch.completion_mask[rows, :width])
    mask, mu = batch.mask[rows, cut], batch.sampler_logp[rows, cut]  # mu: the behaviour policy's, the sampler's
    with torch.autocast(batch.input_ids.device.type, torch.bfloat16, enabled=args.autocast_bf16):  # Adam: --dtype
        logp = common.token_logprobs(policy, *inputs, temperature=args.temperature, top_p=args.top_p)
        with torch.no_grad():
            ref_logp = (logp.detach() if ref_policy is None else
                        common.token_logprobs(ref_policy, *inputs, temperature=args.temperature, top_p=args.top_p))
    loss, pg, kl = truncated_is_loss(logp, mu, ref_logp, mask, batch.advantages[rows], tis_cap=args.tis_cap,
                                     kl_coef=args.kl_coef, loss_norm=args.loss_norm)
    size = len(rows) if args.loss_norm == "sequence" else mask.sum().item()
    share = size / batch.total  # of the batch's sequences (or tokens): what the update weights this loss by
    weights = torch.zeros_like(batch.mask)  # (its rows only: the micro-batches add up to the batch's)
    weights[rows, cut], _ = truncated_is_weights(logp.detach(), mu, mask, "token", math.inf)
    fresh, diff = batch.fresh[rows], (logp.detach() - mu).abs() * mask
    return loss, size, dict(pg=pg.item() * share, kl_penalty=kl.item() * share, weights=weights,
                            kl=common.sampled_kl(mu, ref_logp, mask), diff=diff[fresh].sum().item(),
                            diff_tokens=mask[fresh].sum().item())


def admission(step: int, sampler_version: int, queued_versions: list[int], in_flight: int, args: Args,
              on_policy_only: bool = False) -> tuple[list[int], int]:
    """(queued groups to drop, prompts to admit): drop groups older than --max-lag (after an ESS skip: not of the
    current weights); admit up to H in flight plus a batch queued (--max-lag L: L + 1 batches a weight version)."""
    oldest_usable = step if on_policy_only else (step - args.max_lag if args.max_lag is not None else None)
    drop = [i for i, v in enumerate(queued_versions) if oldest_usable is not None and v < oldest_usable]
    outstanding = in_flight + (len(queued_versions) - len(drop)) * args.group_size
    limit = args.gen_batch_size + args.train_batch_size
    if args.max_lag is not None:
        limit = min(limit, (args.max_lag + 1 - (step - sampler_version)) * args.train_batch_size)
    return drop, max(0, limit - outstanding) // args.group_size


def shuffled_batches(groups: list, groups_per_batch: int, rng: np.random.Generator) -> list[list]:
    """Conventional RL: the RL step's groups (whole) in batches of B at random (not in finishing order: short first)."""
    order = rng.permutation(len(groups))
    return [[groups[i] for i in order[at: at + groups_per_batch]] for at in range(0, len(order), groups_per_batch)]


class Actor:
    """The sampler's side (rank 0; elsewhere never asked): prompts in, finished groups queued, batches out."""

    def __init__(self, sampler, task, tokenizer, args: Args, data_position: int, totals: dict):
        self.sampler, self.task, self.tokenizer, self.args, self.totals = sampler, task, tokenizer, args, totals
        self.data_position = data_position  # the next training prompt
        self.groups: dict[int, list[vllm_sampler.Completion]] = {}  # data position -> the samples finished so far
        self.ready: deque[tuple] = deque()  # the trainer queue: (data position, the prompt's samples)
        self.rl_step: list[list[tuple]] = []  # Conventional RL: the RL step's batches not handed over yet
        self.on_policy_only = False  # after an ESS skip: Algorithm 2 waits for a batch of the current weights
        self.shuffle_rng = np.random.default_rng([args.seed, 1])  # Conventional RL's batch order
        self.resubmit: list[int] = []  # prompts in flight at the checkpoint a run resumed from: admitted first
        first = tasks.encode_prompts(tokenizer, [task.problem("train", data_position)], args.max_prompt_tokens,
                                     args.chat_template)[1]
        if first and sampler is not None:
            print(f"first training prompt, as the model sees it: {tokenizer.decode(first[0])!r}")

    def state(self) -> dict:
        """A checkpoint's (plain data): the finished groups not trained yet as they are, the prompts in flight (a
        resumed run submits them first) and the generators, so that every admitted prompt is trained once."""
        plain = lambda groups: [(key, [dataclasses.asdict(c) for c in group]) for key, group in groups]  # noqa: E731
        return dict(ready=plain(self.ready), rl_step=[plain(b) for b in self.rl_step], in_flight=sorted(self.groups),
                    rngs=[self.shuffle_rng.bit_generator.state])

    def restore(self, state: dict) -> None:
        back = lambda groups: [(key, [vllm_sampler.Completion(**c) for c in group]) for key, group in groups]  # noqa
        self.ready, self.rl_step, self.resubmit = deque(back(state["ready"])), [back(b) for b in state["rl_step"]], \
            list(state["in_flight"])
        self.shuffle_rng.bit_generator.state = state["rngs"][-1]  # (an older checkpoint's: [long-tail, shuffle])

    def describe(self, step: int) -> str:  # (--data-timeout's and a stall's error)
        return (f"{len(self.ready) * self.args.group_size} of {self.args.train_batch_size} sequences queued, "
                f"{len(self.sampler.pending)} in flight, learner step {step}, sampler version {self.sampler.version}, "
                f"--max-lag {self.args.max_lag}")

    def submit(self, count: int) -> None:
        """The next `count` prompts that fit --max-prompt-tokens (the others counted), group_size samples each."""
        args, keys, prompts, overrides = self.args, [], [], []
        while len(keys) < count:
            key = self.resubmit.pop(0) if self.resubmit else self.data_position  # (a resumed run's in flight first)
            self.data_position = max(self.data_position, key + 1)
            _, ids, too_long = tasks.encode_prompts(self.tokenizer, [self.task.problem("train", key)],
                                                     args.max_prompt_tokens, args.chat_template)
            self.totals["skipped_prompts"] += too_long
            if too_long:
                continue
            keys.append(key)
            prompts.append(ids[0])
            self.groups[key] = []
            # a seed per prompt (plus the sample's index): its samples depend on --seed and its data position alone
            overrides.append(dict(seed=((args.seed & 0x7FFFFFFF) << 32) + key * args.group_size))  # (resumes alike)
            if args.long_tail:  # ignore_eos, not min_tokens: min_tokens masks EOS out of the sampled distribution
                tail = args.long_tail_scale * (1 + np.random.default_rng([args.seed, key]).pareto(args.long_tail))
                overrides[-1] |= dict(ignore_eos=True, max_tokens=int(min(args.max_new_tokens, tail)))  # resumes alike
        if keys:
            self.sampler.submit(prompts, n=args.group_size, tags=keys, per_prompt=overrides,
                                temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens)

    def receive(self, timeout: float) -> int:
        """File finished samples; a prompt's group goes to the trainer queue once all of it is done."""
        finished = self.sampler.poll(timeout=timeout)
        for c in finished:
            self.groups[c.tag[0]].append(c)
            if len(self.groups[c.tag[0]]) == self.args.group_size:
                self.ready.append((c.tag[0], sorted(self.groups.pop(c.tag[0]), key=lambda s: s.tag[1])))
        return len(finished)

    def pump(self, timeout: float, step: int) -> int:
        """Pipeline mode: receive, drop stale groups, admit prompts. Returns sequences received + prompts admitted."""
        args, engine = self.args, self.sampler
        received = self.receive(timeout)
        drop, admit = admission(step, engine.version, [min(c.version_min for c in g) for _, g in self.ready],
                                len(self.groups) * args.group_size, args, self.on_policy_only)  # in flight: unfinished
        self.ready = deque(group for i, group in enumerate(self.ready) if i not in drop)
        self.totals["stale_dropped"] += len(drop) * args.group_size
        self.submit(admit)
        if not (received or admit or self.groups) and len(self.ready) * args.group_size < args.train_batch_size:
            landing = engine.version < step  # admission waits for the learner's weights to land in the sampler
            engine.wait_for_push()
            if not landing or engine.version < step:  # admission() rules a stall out, unless a push was lost
                raise RuntimeError(f"the pipeline stalled: {self.describe(step)}")
            return 1
        return received + admit

    def next_batch(self, step: int) -> tuple[float, list[tuple], bool]:
        """(seconds waited, the next B sequences, whether they end an RL step): the B oldest finished (H in flight), or
        Conventional RL's next of the G batches it generated at once."""
        args, per_batch = self.args, self.args.train_batch_size // self.args.group_size
        wait = lambda ready, work: util.wait_until(ready, work, args.data_timeout, lambda: self.describe(step))
        if args.mode == "pipeline":
            self.pump(0.0, step)
            waited = wait(lambda: len(self.ready) >= per_batch, lambda: self.pump(0.1, step))
            return waited, [self.ready.popleft() for _ in range(per_batch)], False
        waited = 0.0
        if not self.rl_step:
            steps = min(args.steps_per_rl_step, args.num_steps - step)
            self.submit(per_batch * steps)
            waited = wait(lambda: len(self.ready) >= per_batch * steps, lambda: self.receive(0.5))
            self.rl_step, self.ready = shuffled_batches(list(self.ready), per_batch, self.shuffle_rng), deque()
        return waited, self.rl_step.pop(0), not self.rl_step


# TRY NOT TO MODIFY: loading
def load_models(args: Args, run: Run, model_path: str):
    """The policy, the frozen reference (for --kl-coef) and the authors' AdamW (pipelinerl/finetune/optim.py)."""
    load = lambda: common.load_policy(model_path, run.device, dtype=getattr(torch, args.dtype))  # noqa: E731
    policy = run.learner_model(load())
    ref_policy = run.learner_model(load().eval().requires_grad_(False) if args.kl_coef else None, pushed=False)
    exempt = lambda name: args.weight_decay > 0 and any(k in name for k in ("bias", "LayerNorm.weight"))  # noqa: E731
    groups = [dict(params=[p for n, p in policy.named_parameters() if not exempt(n)]),
              dict(params=[p for n, p in policy.named_parameters() if exempt(n)], weight_decay=0.0)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                                  weight_decay=args.weight_decay, eps=1e-7, fused=True)  # one kernel for all tensors
    return policy, ref_policy, optimizer


def main():
    args = mode_defaults(checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2))  # on --resume: the saved run's flags
    run = Run(args, memory_plan.STREAM, overlapped=args.mode == "pipeline", rounds=args.num_steps, unit="step",
              sampler_settings=dict(max_num_seqs=args.gen_batch_size))
    with run:  # the sampler closes however this ends
        tokenizer, task, evaluate = tasks.load(args, run.model_path, run.sampler.engine)
        policy, ref_policy, optimizer = load_models(args, run, run.model_path)
        sampler = run.sampler
        start = run.resume(policy, optimizer, extra=("actor",),  # (the checkpoints keep the actor's state)
                           background_push=args.mode == "pipeline" and args.background_push)  # pushes from a thread
        eval_start = start.eval_start or run.log(start.step, evaluate())  # pass@k at the run's start
        if args.snapshot_every and start.round == 0:
            run.snapshot(start.step)  # time 0 of the learning curve
        step, score, nonfinite_in_a_row = start.step, reward_function(task, args), 0
        totals = dict(tokens=0, ess_skipped=0, stale_dropped=0, ess_sum=0.0, ess_batches=0, lag_sum=0.0) | start.totals
        actor = Actor(sampler.engine, task, tokenizer, args, start.data_position, totals)
        if start.extra.get("actor"):  # a resumed run: what the checkpoint's actor held, untrained, comes first
            actor.restore(start.extra["actor"])
        clock = time.perf_counter() - totals["wall_seconds"]  # (a resumed run's time too)
        while step < args.num_steps:  # one batch a pass: a step, or a batch the ESS guard or a non-finite loss skips
            # ---- sample: the actor's next B finished sequences (under torchrun: rank 0's, on every rank) ----
            learner_wait, groups, rl_step_done = run.from_main(lambda: actor.next_batch(step))
            train_start = time.perf_counter()
            samples = [c for _, group in sorted(groups, key=lambda group: group[0]) for c in group]  # in data order
            problems = [task.problem("train", c.tag[0]) for c in samples]  # (a sample's tag: its data position, index)
            rewards, scores = torch.tensor([score(c.text, p) for c, p in zip(samples, problems)]).T  # trained on, own
            correct = [task.is_correct(c.text, p) for c, p in zip(samples, problems)]
            max_lag = args.steps_per_rl_step - 1 if args.mode == "conventional" else args.max_lag  # a lost push stops
            lags = sampler.check_version(samples, step, max_lag=step if max_lag is None else max_lag)
            sampler.set_learner_threads()  # every core in Conventional RL's training; one beside the pipeline's
            # ALGO LOGIC: the per-prompt mean baseline; the truncated-IS loss (Eq. 5) summed over the micro-batches
            batch = Batch.from_samples(samples, tokenizer.pad_token_id, run.device)
            batch.advantages = per_prompt_advantages(rewards.view(-1, args.group_size)).view(-1).to(run.device)
            batch.fresh = torch.tensor([c.version_min == step for c in samples], device=run.device)
            tokens = sum(len(c.token_ids) for c in samples)
            batch.total = len(samples) if args.loss_norm == "sequence" else tokens
            loss, out = 0.0, {}
            for mb in common.micro_batch_plan(batch.lengths, args.micro_batch_tokens, max_rows=args.micro_batch_size):
                mb_loss, size, mb_out = micro_batch_loss(policy, ref_policy, batch, mb, args)
                share = mb.weight * size / batch.total  # (weight 0: a torchrun stand-in)
                (mb_loss * share).backward()
                loss = loss + mb_loss.detach() * share
                common.add_outputs(out, mb, mb_out, len(samples))
            loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches
            # ALGO LOGIC: the ESS guard (Algorithm 2, lines 20-23), then one clipped step at the scheduled rate
            by_length = sorted(range(len(samples)), key=batch.lengths.__getitem__)  # the sums' order, to the last bit
            batch_ess = ess(out["weights"][by_length], batch.mask[by_length])
            if math.isfinite(batch_ess):  # the summary's mean ESS: every batch's, a skipped one's too
                totals["ess_sum"], totals["ess_batches"] = totals["ess_sum"] + batch_ess, totals["ess_batches"] + 1
            grad_norm, trained, ratios = math.nan, False, out["weights"][batch.mask.bool()]  # pi/mu, untruncated
            if batch_ess >= args.ess_threshold:  # (a NaN ESS fails it too)
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
                trained = bool(torch.isfinite(loss)) and math.isfinite(grad_norm)
            if trained:  # a NaN/inf never reaches the weights, Adam, the sampler nor a checkpoint
                for group in optimizer.param_groups:  # from the step alone: a resumed run continues the schedule
                    group["lr"] = scheduled_learning_rate(args, step)
                optimizer.step()
            optimizer.zero_grad()
            low_ess = not trained and batch_ess < args.ess_threshold and math.isfinite(loss.item())
            actor.on_policy_only = low_ess or (actor.on_policy_only and not trained)  # line 22, until a step trains
            run.warn_no_learning(batch.advantages, "every advantage is 0 (each prompt's rewards tie)")
            run.warn_no_learning(trained, "no optimizer step (the ESS guard or a non-finite loss skipped it)")
            step += trained
            train_seconds = time.perf_counter() - train_start
            totals["learner_wait_seconds"] += learner_wait  # (a skipped batch's wait and update too)
            totals["train_seconds"] += train_seconds
            # ---- push: PipelineRL's after every step, in flight (pause, update, resume); Conventional RL's per RL step
            pushed = {"time/push_seconds": 0.0}
            if args.mode == "pipeline" and trained:
                pushed = sampler.push(policy, step, recompute_kv=args.recompute_kv, background=args.background_push)
            elif args.mode == "conventional" and rl_step_done:
                pushed = sampler.push(policy, step)
            nonfinite_in_a_row = 0 if trained else nonfinite_in_a_row + (not low_ess)
            if not trained:  # counted, logged with its ESS (else the mean ESS sees only passing batches), not a round
                totals["ess_skipped" if low_ess else "nonfinite_skipped"] += 1
                if not low_ess:
                    print(f"step {step + 1} skipped: ESS {batch_ess:.3g}, loss {loss.item():.3g}, grad {grad_norm:.3g}")
                    if nonfinite_in_a_row >= 10:  # the data or the model is broken: stop, not skip forever
                        raise RuntimeError(f"{nonfinite_in_a_row} batches in a row gave a non-finite ESS, loss or grad")
                run.logger.log(step, {"charts/ess": batch_ess, **lags, "charts/tis_max_ratio": ratios.max().item(),
                                      "charts/skipped_steps": totals["ess_skipped"],
                                      "charts/nonfinite_skipped": totals["nonfinite_skipped"]}, echo=False)
                continue
            totals["tokens"] += tokens
            totals["lag_sum"] += lags["charts/lag_mean"]  # the summary's mean token lag: the trained steps'
            totals["episodes"] += len(samples)
            totals["wall_seconds"] = time.perf_counter() - clock
            metrics = {
                "charts/reward": scores.mean().item(), "charts/accuracy": float(np.mean(correct)), **lags,
                "charts/response_length": tokens / len(samples), "charts/ess": batch_ess, "losses/pg": out["pg"],
                "charts/tis_truncated_fraction": (ratios > args.tis_cap).float().mean().item(),
                "charts/truncated_fraction": float(np.mean([c.finish_reason == "length" for c in samples])),
                "charts/advantage_std": batch.advantages.std().item(), "charts/tis_max_ratio": ratios.max().item(),
                "charts/tokens_per_second": totals["tokens"] / totals["wall_seconds"],
                "charts/skipped_steps": totals["ess_skipped"], "charts/stale_dropped": totals["stale_dropped"],
                "charts/in_flight": len(actor.sampler.pending) if actor.sampler else 0, "losses/loss": loss.item(),
                "charts/kl": out["kl"].mean().item() if ref_policy is not None else math.nan,
                "charts/learning_rate": optimizer.param_groups[0]["lr"], "losses/grad_norm": grad_norm,
                "losses/kl_penalty": out["kl_penalty"], **pushed, **common.throughput(totals, step),
                "losses/grad_clipped_fraction": float(grad_norm > args.max_grad_norm),
                "time/learner_wait_seconds": learner_wait, "time/train_seconds": train_seconds,
                **({"charts/logprob_diff": out["diff"] / out["diff_tokens"]} if out["diff_tokens"] else {}),
            }
            run.log(step, metrics, round=step, show=("charts/ess", "charts/lag_mean", "charts/in_flight"))
            # ---- after the step: the curve's weights, pass@k, the checkpoint ----
            if args.snapshot_every and step % args.snapshot_every == 0:
                run.snapshot(step)
            if args.eval_every and step % args.eval_every == 0 and step < args.num_steps:
                run.log(step, evaluate())
            if step == args.num_steps or (args.save_every and step % args.save_every == 0):
                run.save(step, step, actor.data_position, totals, tokenizer, eval_start, actor=actor.state())
        if sampler.engine is not None:  # the last push landed (the evaluation samples with it); training's dropped
            sampler.engine.wait_for_push()
            sampler.engine.abort(list(sampler.engine.pending))
        eval_end = run.log(step, evaluate())  # pass@k at the end
    t = totals
    run.report("PipelineRL (Algorithm 2) or Conventional RL (Algorithm 1), as --mode says", {
        "method": "PipelineRL" if args.mode == "pipeline" else f"Conventional RL (G={args.steps_per_rl_step})",
        "episodes/s": t["episodes"] / t["wall_seconds"], "tokens/s": t["tokens"] / t["wall_seconds"],
        "mean ESS": t["ess_sum"] / max(t["ess_batches"], 1), "mean token lag": t["lag_sum"] / max(step, 1),
        "skipped": str(t["ess_skipped"] + t["nonfinite_skipped"]), "dropped": str(t["stale_dropped"])},
        totals, step, eval_start, eval_end)


if __name__ == "__main__":
    main()
