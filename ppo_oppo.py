"""PPO with OPPO's pipeline overlap (Algorithm 1, Eq. 1-4). Paper: Yan et al., "OPPO: Accelerating PPO-based RLHF
via Pipeline Overlap", arXiv:2509.25762. What it adds to examples/reinforce.py: a critic (a value head), GAE on
per-token rewards with the KL penalty to the frozen reference folded in, and PPO's clipped surrogate and value loss over
epochs x minibatches, as TRL's PPOTrainer (OPPO's base); then OPPO's overlaps (both off: plain PPO). Intra-step
(--no-intra) streams each response in chunks of C tokens (C tuned) into the critic's, reference's and reward's prefill
while the sampler decodes the next; inter-step (--no-inter) over-commits B + Delta prompts, trains on the first B to
finish and carries the others, paused, into the next round (Delta follows the reward trend). A round is the paper's
training step; a step is one optimizer.step().

    python ppo_oppo.py --model tiny                           # OPPO
    python ppo_oppo.py --model tiny --no-intra --no-inter     # plain synchronous PPO
    torchrun --nproc-per-node 2 ppo_oppo.py --model tiny --no-intra   # data-parallel learner (FSDP2)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
from transformers import DynamicCache

import common
import tasks
from common import Run, scheduled_learning_rate, truncated_is_weights  # (Run: every script's setup)
from fastrl import checks, distributed, launch, memory_plan, vllm_sampler
from fastrl.run import RunArgs

ON_GPU = torch.cuda.is_available()


@dataclass
class Args(RunArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory is runs/<exp_name>__<seed>__<time>)"""
    reward_model: str | None = None
    """HF sequence-classification reward model (num_labels=1) with the policy's tokenizer; None: the task's verifier"""
    critic_model: str | None = None
    """the critic's initial weights; None: --reward-model if given (as TRL and OpenRLHF), else --model's + a new head"""

    # PPO
    num_rounds: int = 60
    """PPO rounds (the paper's training steps: generate, score, update) [paper 1000; tiny 60]"""
    batch_size: int = 64
    """B: sequences per PPO round, one per prompt [paper 112; tiny 64]"""
    num_ppo_epochs: int = 2
    """passes over each batch [paper 4, TRL's; tiny 2]"""
    num_minibatches: int = 1
    """minibatches per epoch: optimizer steps per round = epochs x minibatches"""
    micro_batch_size: int = 16
    """at most this many sequences per forward/backward of the update and per group of the downstream prefill"""
    learning_rate: float = 1e-4
    """Adam learning rate for actor and critic [paper 3e-6, TRL's; tiny 1e-4]"""
    lr_schedule: Literal["linear", "constant"] = "constant"
    """linear: from --learning-rate to 0 over --num-rounds, one value a round (TRL's PPOTrainer) [paper linear]"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (actor and critic together: losses/grad_clipped_fraction, losses/actor_grad_share)"""
    clip_coef: float = 0.2
    """epsilon of the clipped surrogate (Eq. 2)"""
    vf_clip: float = 0.2
    """value predictions are clipped to this distance from the rollout's values"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    gamma: float = 1.0
    """GAE discount (Eq. 1)"""
    lam: float = 0.95
    """GAE lambda (Eq. 1)"""
    kl_coef: float = 0.01
    """per-token KL penalty to the reference folded into the reward [paper 0.05, TRL's; tiny 0.01]"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of a response that ends without EOS (off under --long-tail, which forces lengths)"""
    temperature: float = 1.0
    """sampling temperature [paper 0.7, TRL's; tiny 1.0]"""
    top_p: float = 1.0
    """nucleus sampling, the learner's logprobs too (the logprob contract) [TRL's PPOTrainer samples without one]"""
    tis: Literal["auto", "on", "off"] = "auto"
    """mismatch correction: on (auto: when the sampler's precision differs from the learner's), pi_old is the learner's
    and each token's policy loss is weighted by min(pi_old / pi_sampler, --tis-cap) (carried staleness too); off"""
    tis_cap: float = 2.0
    """C, the truncated importance weight's cap (verl's rollout_is_threshold; TRL's differs: docs/defaults.md)"""
    request_seeds: bool = False
    """seed every request (from --seed and its problem): its tokens then do not depend on the other requests (slower)"""
    max_new_tokens: int = 32
    """response length cap [paper 1024; tiny 32]"""
    max_prompt_tokens: int = 32
    """longer prompts are skipped (charts/skipped_long_prompts) [paper 512; tiny 32]"""

    # OPPO
    intra: bool = True
    """intra-step overlap: stream C-token chunks into the downstream prefill (--no-intra: score after generation)"""
    inter: bool = True
    """inter-step overlap: over-commit Delta prompts and carry unfinished ones over (--no-inter: wait for all B)"""
    chunk_size: int | None = None
    """C: tokens per streamed chunk, under --chunk-tune-every 0 (else the tuner's); None: --max-new-tokens / 4"""
    chunk_candidates: tuple[int, ...] | None = None
    """chunk sizes tried every --chunk-tune-every rounds; None: --max-new-tokens / 8, / 4, / 2 (the paper's)"""
    chunk_tune_every: int = 20
    """rounds between chunk-size trials (0: keep --chunk-size) [paper 50; tiny 20]"""
    delta: int = 8
    """Delta: over-committed prompts at the start (0: none, and the controller leaves it at 0)"""
    delta_min: int = 0
    """lower bound of Delta"""
    delta_max: int = 16
    """upper bound of Delta"""
    delta_window: int = 5
    """W: Delta moves when 2W round rewards are in, comparing the last W with the W before [paper 10; tiny 5]"""
    delta_rule: Literal["eq4", "alg1"] = "eq4"
    """eq4: Delta grows while the reward improves, shrinks otherwise (Eq. 4, the text); alg1: Algorithm 1 line 25"""
    long_tail: float = 0.0
    """benchmark workload: > 0 forces (ignore_eos) each response's length, Pareto of this shape, capped"""
    long_tail_scale: int = 8
    """minimum forced length of the long-tailed workload"""

    def __post_init__(self):  # the method's flags first (one line naming a bad one), then the run's (RunArgs)
        chunk, candidates = chunk_sizes(self)
        for ok, flag, message in [
            (self.batch_size >= 1 and self.num_ppo_epochs >= 1, "--batch-size/--num-ppo-epochs", "must be >= 1"),
            (1 <= self.num_minibatches <= self.batch_size, "--num-minibatches", "must be between 1 and --batch-size"),
            (self.micro_batch_size >= 1 and self.tis_cap > 0, "--micro-batch-size/--tis-cap", "must be > 0"),
            (0 < self.top_p <= 1, "--top-p", "must be in (0, 1]"),
            (0 <= self.delta_min <= self.delta <= self.delta_max, "--delta", "needs --delta-min <= it <= --delta-max"),
            (chunk >= 1 and all(c >= 1 for c in candidates), "--chunk-size/--chunk-candidates", "must be >= 1"),
            (self.delta_window >= 1 and self.chunk_tune_every >= 0, "--delta-window/--chunk-tune-every", ">= 1; >= 0"),
            (not self.chunk_tune_every or self.chunk_tune_every > len(candidates), "--chunk-tune-every",
             f"must exceed the number of candidates ({len(candidates)})"),
            (self.chunk_size is None or not self.chunk_tune_every, "--chunk-size", "only with --chunk-tune-every 0"),
            (not (self.sampler_url and self.intra), "--sampler-url", "servers stream no chunks: add --no-intra"),
        ]:
            checks.check_args(ok, flag, message)
        super().__post_init__()


# a real model's defaults (the paper's and TRL's), where they differ from the tiny model's above
PAPER = dict(num_rounds=1000, batch_size=112, num_ppo_epochs=4, learning_rate=3e-6, lr_schedule="linear",
             kl_coef=0.05, temperature=0.7, max_new_tokens=1024, max_prompt_tokens=512, chunk_tune_every=50,
             delta_window=10, autocast_bf16=ON_GPU, gradient_checkpointing=ON_GPU)
# --model smollm2 (SmolLM2-135M-Instruct on a CPU): arithmetic, rounds of 32 in two minibatches (<= 15 minutes);
# critic and reference from its checkpoint; the learner (actor, critic, reference) in ~7 GB: cpu_memory.py
SMOLLM2 = PAPER | dict(task="arithmetic", num_rounds=12, batch_size=32, num_ppo_epochs=1, num_minibatches=2,
                       learning_rate=3e-5, chunk_tune_every=20, delta_window=5, max_new_tokens=64,
                       max_prompt_tokens=128, eval_problems=100, eval_samples=4, autocast_bf16=False,
                       gradient_checkpointing=False, micro_batch_tokens=512)


def chunk_sizes(args: Args) -> tuple[int, tuple[int, ...]]:
    """C at the start and the sizes the tuner tries: --chunk-size, --chunk-candidates or their defaults."""
    return (args.chunk_size or max(1, args.max_new_tokens // 4),
            args.chunk_candidates or tuple(max(1, args.max_new_tokens // d) for d in (8, 4, 2)))


# ALGO LOGIC: PPO's math and OPPO's controllers (Delta, C), each checked by hand in tests/test_ppo_oppo.py
def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Eq. 1 over right-padded [batch, T] response tensors (zeros after each response: the value after its end is 0)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros(rewards.shape[0])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) * mask) ** 2).sum() / mask.sum()
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def ppo_losses(logp, old_logp, advantages, values_pred, old_values, returns, mask, clip_coef: float, vf_clip: float,
               is_weights: torch.Tensor | None = None):
    """Clipped surrogate (Eq. 2) and clipped value loss, token means; `is_weights` (--tis) weigh the policy loss's."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef))
    pg = pg if is_weights is None else pg * is_weights
    clipped_values = old_values + (values_pred - old_values).clamp(-vf_clip, vf_clip)
    vf = 0.5 * torch.max((values_pred - returns) ** 2, (clipped_values - returns) ** 2)
    n = mask.sum()
    stats = dict(clipfrac=(((ratio - 1).abs() > clip_coef).float() * mask).sum() / n,
                 approx_kl=(0.5 * (logp - old_logp) ** 2 * mask).sum() / n,
                 ratio_deviation=((ratio.detach() - 1).abs() * mask).sum() / n)
    return (pg * mask).sum() / n, (vf * mask).sum() / n, stats


def next_delta(delta: int, rewards: list[float], window: int, delta_min: int, delta_max: int,
               rule: str) -> tuple[int, list[float]]:
    """Algorithm 1 lines 22-27: with 2W round rewards in, d = mean(last W) - mean(W before), Delta moves by max(1,
    floor(Delta / 4)) within its bounds, `eq4`: up while d > 0 (Eq. 4, the text), `alg1`: - sign(d) (line 25)."""
    if len(rewards) < 2 * window:
        return delta, rewards
    d, change = np.mean(rewards[-window:]) - np.mean(rewards[-2 * window:-window]), max(1, delta // 4)
    direction = (1 if d > 0 else -1) if rule == "eq4" else -int(np.sign(d))
    return int(np.clip(delta + direction * change, delta_min, delta_max)), rewards[-window:]


@dataclass
class Overlap:
    """OPPO's state from round to round, rank 0's (checkpointed but the tuner's seconds): Delta, C, the next prompt."""

    delta: int
    chunk: int
    candidates: tuple[int, ...]
    data_position: int = 0
    reward_history: list[float] = field(default_factory=list)
    trial_seconds: dict[int, float] = field(default_factory=dict)

    def next_chunk(self, round_index: int, tune_every: int) -> int:
        """C for this round: the first len(candidates) rounds of every tune_every-long window try one candidate each;
        the next switches to the one whose rollout (generate + exposed score) was fastest, kept until the next one."""
        phase = round_index % tune_every if tune_every and self.candidates else None
        if phase is not None and phase < len(self.candidates):
            self.chunk = self.candidates[phase]
        elif phase == len(self.candidates) and self.trial_seconds:
            self.chunk = min(self.trial_seconds, key=self.trial_seconds.get)
        self.trial_seconds = {} if phase == 0 else self.trial_seconds  # a new window: its own trials
        return self.chunk

    def update(self, args: Args, round_index: int, reward: float, rollout_seconds: float) -> None:
        """After a round: Delta from the reward trend (next_delta; --delta 0 pins it), C's seconds while on trial."""
        self.reward_history.append(reward)
        if args.inter and args.delta > 0:
            self.delta, self.reward_history = next_delta(self.delta, self.reward_history, args.delta_window,
                                                         args.delta_min, args.delta_max, args.delta_rule)
        if args.intra and args.chunk_tune_every and round_index % args.chunk_tune_every < len(self.candidates):
            self.trial_seconds[self.chunk] = rollout_seconds


# ALGO LOGIC: the intra-step overlap, an incremental prefill of the downstream models with a KV cache per sequence
@dataclass
class Prefix:
    """A downstream model's KV cache over a sequence's first `length` tokens, its outputs and last hidden state."""

    length: int = 0
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: [heads, length, head_dim]
    per_token: list[torch.Tensor] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None


@dataclass
class Rollout:
    """One sequence of the OPPO buffer."""

    request_id: str
    key: int  # index of its problem in the train split
    problem: tasks.Problem
    prompt: list[int]
    admitted: int  # the round its prompt was submitted in
    response: list[int] = field(default_factory=list)  # tokens streamed so far; all of them once finished
    final: vllm_sampler.Completion | None = None
    prefix: dict[str, Prefix] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    @property
    def num_tokens(self) -> int:  # checked on every pass of the generation loop: no list built
        return len(self.prompt) + len(self.response)


def extend_prefix(body, prefixes: list[Prefix], new_tokens: list[list[int]]):
    """A decoder on each sequence's new tokens on top of its cached prefix, batched (prefixes left-padded to length P,
    new tokens right-padded, explicit positions): each one's new hidden states and extended cache."""
    device = next(body.parameters()).device
    b, P, N = len(prefixes), max(p.length for p in prefixes), max(len(t) for t in new_tokens)
    ids, attention, positions = (torch.zeros((b, n), dtype=torch.long) for n in (N, P + N, N))
    for i, (p, t) in enumerate(zip(prefixes, new_tokens)):
        ids[i, :len(t)] = torch.tensor(t)
        attention[i, P - p.length: P + len(t)] = 1
        positions[i] = torch.arange(p.length, p.length + N)
    layers = []  # the cached prefixes, left-padded to P (none before the first chunk)
    for layer, (k0, v0) in enumerate(next(p.kv for p in prefixes if p.kv) if P else []):
        keys, values = (x.new_zeros((b, x.shape[0], P, x.shape[2])) for x in (k0, v0))
        for i, p in enumerate(prefixes):
            if p.length:
                keys[i, :, P - p.length:], values[i, :, P - p.length:] = p.kv[layer]
        layers.append((keys, values))
    cache = DynamicCache(layers) if P else DynamicCache()
    out = body(input_ids=ids.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
               past_key_values=cache, use_cache=True)
    hidden, kv = [], []
    for i, (p, t) in enumerate(zip(prefixes, new_tokens)):
        rows = torch.cat([torch.arange(P - p.length, P), torch.arange(P, P + len(t))]).to(device)
        kv.append([(layer.keys[i][:, rows], layer.values[i][:, rows]) for layer in out.past_key_values.layers])
        hidden.append(out.last_hidden_state[i, :len(t)])
    return hidden, kv


@torch.no_grad()
def prefill(name: str, model, rollouts: list[Rollout], temperature: float, micro_batch_size: int,
            top_p: float = 1.0) -> None:
    """Prefill the tokens `model` has not seen on their cached prefix, keeping per position the critic's value, the
    reference's logprob (the logprob contract) or the reward model's score."""
    todo = sorted((r for r in rollouts if r.num_tokens > r.prefix[name].length),
                  key=lambda r: (r.num_tokens - r.prefix[name].length, r.prefix[name].length))
    for start in range(0, len(todo), micro_batch_size):
        group = todo[start: start + micro_batch_size]
        prefixes = [r.prefix[name] for r in group]
        new_tokens = [r.tokens[p.length:] for r, p in zip(group, prefixes)]
        hidden, kv = extend_prefix(model.base_model, prefixes, new_tokens)
        for r, p, h, t, cache in zip(group, prefixes, hidden, new_tokens, kv):
            if name in ("critic", "rm"):
                p.per_token.append(model.score(h).float())  # [new tokens, labels]
            elif name == "ref":  # token j's logprob comes from the hidden state at j - 1: the previous chunk's last
                first = p.last_hidden is None
                states = h if first else torch.cat([p.last_hidden[None], h])
                ids = torch.tensor([r.tokens[0 if first else p.length - 1: p.length + len(t)]], device=h.device)
                ones, decoded = torch.ones_like(ids), SimpleNamespace(last_hidden_state=states[None])
                prefilled = SimpleNamespace(config=model.config, get_output_embeddings=model.get_output_embeddings,
                                            get_decoder=lambda: lambda **inputs: decoded)  # as token_logprobs reads it
                logp = common.token_logprobs(prefilled, ids, ones, ones, temperature, top_p=top_p)
                p.per_token.append(torch.cat([logp.new_zeros(1), logp[0]]) if first else logp[0])
            p.last_hidden, p.kv, p.length = h[-1], cache, p.length + len(t)


def scored(r: Rollout, name: str, model) -> torch.Tensor:
    """Model `name`'s output for the response: the critic's V(s_t), the reference's token logprobs, or the RM score."""
    outputs = torch.cat(r.prefix[name].per_token)
    if name == "rm":
        return outputs[tasks.rm_position(r.tokens, model.config.get_text_config().pad_token_id)].squeeze()
    plen, T = len(r.prompt), len(r.response)
    return outputs[plen - 1: plen - 1 + T].squeeze(-1) if name == "critic" else outputs[plen: plen + T]


def critic_values(critic, input_ids, attention_mask, completion_mask):
    """V(s_t) for every completion token's state, laid out like common.token_logprobs' output."""
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return critic.score(hidden[:, :-1]).squeeze(-1).float() * completion_mask[:, 1:]


class OPPOBuffer:
    """Algorithm 1's buffer (rank 0's): the sequences in flight by request id, the finished ones, their scoring."""

    def __init__(self, sampler, task, tokenizer, downstream: dict, args: Args, chunk: int):
        self.sampler, self.task, self.tokenizer, self.downstream, self.args = sampler, task, tokenizer, downstream, args
        self.chunk = chunk  # C of the sequences in flight
        self.inflight: dict[str, Rollout] = {}
        self.finished: list[Rollout] = []

    def admit(self, keys, round_index: int) -> int:
        """Submit these train problems' prompts, one sample each (streamed in chunks of C under --intra): skipped."""
        args, keys = self.args, list(keys)
        candidates = [self.task.problem("train", k) for k in keys]
        problems, prompts, skipped = tasks.encode_prompts(self.tokenizer, candidates, args.max_prompt_tokens,
                                                          chat_template=args.chat_template)
        kept = {id(p) for p in problems}
        keys = [k for k, p in zip(keys, candidates) if id(p) in kept]
        per_prompt = common.request_overrides(keys, args)  # --request-seeds, --long-tail
        if prompts:
            ids = self.sampler.submit(prompts, tags=keys, stream_every=self.chunk if args.intra else 0,
                                      per_prompt=per_prompt, max_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_p=args.top_p)
            for rid, key, problem, prompt in zip(ids, keys, problems, prompts):
                prefix = {name: Prefix() for name in self.downstream}
                self.inflight[rid] = Rollout(rid, key, problem, prompt, round_index, prefix=prefix)
        return skipped

    def stream_every(self, chunk: int) -> None:
        """C for the sequences in flight and the ones admitted next."""
        if chunk != self.chunk:
            self.sampler.set_stream_every(chunk)
        self.chunk = chunk

    def receive(self, timeout: float) -> None:
        """The streamed chunks and the finished sequences the sampler has for us."""
        for c in self.sampler.poll(timeout=timeout):
            r = self.inflight[c.request_id]
            if c.finished:
                assert c.token_ids[:len(r.response)] == r.response, "streamed chunks disagree with the final response"
                r.response, r.final = c.token_ids, c
                self.finished.append(r)
            else:
                r.response = r.response + c.token_ids

    def over_commit(self, n: int, overlap: Overlap, round_index: int) -> int:
        """Stage 1: admit the next training prompts until n are in flight (B + Delta); returns how many were skipped."""
        skipped = 0
        while len(self.inflight) < n:  # (a prompt over --max-prompt-tokens is skipped: the next ones fill its place)
            keys = range(overlap.data_position, overlap.data_position + n - len(self.inflight))
            skipped, overlap.data_position = skipped + self.admit(keys, round_index), keys.stop
        return skipped

    def generate_until(self, n: int) -> tuple[float, int]:
        """Stage 2: receive until n sequences have finished, under --intra prefilling every new chunk meanwhile; the
        others wait, paused with their KV cache, for the new weights. Returns the seconds prefilling, how many wait."""
        for r in self.inflight.values():  # (reference and reward model are frozen: their caches stay valid)
            r.prefix["critic"] = Prefix()
        launch.learner_threads(self.sampler)  # one thread: the sampler generates (intra scores alongside it)
        hidden_score = 0.0
        while len(self.finished) < n:
            self.receive(timeout=0.0 if self.args.intra else 0.05)
            if self.args.intra:
                score_start = time.perf_counter()
                self.score(list(self.inflight.values()))
                hidden_score += time.perf_counter() - score_start
                if len(self.finished) < n:
                    self.receive(timeout=0.01)
        unfinished = len(self.inflight) - len(self.finished)
        if unfinished:
            self.sampler.pause()
        return hidden_score, unfinished

    def take(self, n: int) -> list[Rollout]:
        """The first n finished sequences out of the buffer, in admission order (trained alike however they ended)."""
        batch, self.finished = sorted(self.finished[:n], key=lambda r: int(r.request_id)), self.finished[n:]
        for r in batch:
            del self.inflight[r.request_id]
        return batch

    def score(self, rollouts: list[Rollout]) -> None:
        """Prefill what the downstream models have not seen yet of these sequences."""
        for name, model in self.downstream.items():
            with torch.autocast(next(model.parameters()).device.type, torch.bfloat16, enabled=self.args.autocast_bf16):
                prefill(name, model, rollouts, self.args.temperature, self.args.micro_batch_size, self.args.top_p)

    def scores(self, batch: list[Rollout], run: Run, eos_penalty: float):
        """Stage 3: score what is left and read off the prefixes (freed): the task's scores [B], the same less
        `eos_penalty` where EOS is missing (TRL's missing_eos_penalty), which lack EOS, the reference's logprobs and the
        critic's values [B, T]. Under torchrun each rank scores its share."""
        mine = common.score_my_share(batch, [r.num_tokens for r in batch], self.args.micro_batch_size, self.score,
                                     lambda r: replace(r, prefix={k: Prefix() for k in self.downstream}), run.dist)
        B, T, rm = len(batch), max(len(r.response) for r in batch), self.downstream.get("rm")
        scores = torch.tensor([scored(r, "rm", rm).item() if i in mine else 0.0 for i, r in enumerate(batch)]
                              if rm is not None else [self.task.reward(r.final.text, r.problem) for r in batch])
        ref_logp, values = torch.zeros((B, T)), torch.zeros((B, T))
        for i, r in enumerate(batch):
            if i in mine:
                ref_logp[i, :len(r.response)] = scored(r, "ref", self.downstream["ref"]).cpu()
                values[i, :len(r.response)] = scored(r, "critic", self.downstream["critic"]).cpu()
            r.prefix.clear()  # read: free the batch's KV caches before the update
        no_eos = torch.tensor([r.final.finish_reason != "stop" for r in batch], dtype=torch.float32)
        scores = run.all_sum(scores) if rm is not None else scores
        return scores, scores - eos_penalty * no_eos, no_eos, *run.all_sum((ref_logp, values))


# ALGO LOGIC: one minibatch step's loss on a micro-batch (main() adds the micro-batches up to the minibatch's gradient)
@dataclass
class Batch(common.Batch):
    """The PPO batch on the learner (common.Batch: padded rows, mask, the sampler's logprobs) with main()'s tensors."""

    old_logp: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    tis: torch.Tensor | None = None
    fresh: torch.Tensor | None = None


def ppo_micro_batch(policy, critic, batch: Batch, mb, minibatch: list[int], args: Args,
                    logprob_diff: bool = False):
    """A micro-batch's PPO loss (Eq. 2 + vf_coef x value loss; mb.items index `minibatch`), its response tokens and
    the stats' token sums (`logprob_diff`: |learner - sampler| on the fresh tokens)."""
    rows, width = [minibatch[i] for i in mb.items], mb.width
    ids, attn, cmask = (x[rows, :width] for x in (batch.input_ids, batch.attention_mask, batch.completion_mask))
    cut = lambda x: None if x is None else x[rows, :width - 1]
    with torch.autocast(ids.device.type, torch.bfloat16, enabled=args.autocast_bf16):  # Adam stays in --dtype
        logp, entropy = common.token_logprobs(policy, ids, attn, cmask, with_entropy=True,
                                              temperature=args.temperature, top_p=args.top_p)
        entropy = entropy.detach()  # only logged: else the backward's recomputation of each chunk keeps it alive
        values_pred = critic_values(critic, ids, attn, cmask)
    mask = cmask[:, 1:].float()
    pg, vf, stats = ppo_losses(logp, cut(batch.old_logp), cut(batch.advantages), values_pred, cut(batch.values),
                               cut(batch.returns), mask, args.clip_coef, args.vf_clip, is_weights=cut(batch.tis))
    n = mask.sum().item()
    out = {k: v.item() * n for k, v in dict(policy=pg, value=vf, **stats, entropy=entropy.sum() / mask.sum()).items()}
    out["tokens"] = n
    if logprob_diff:
        fresh = cut(batch.fresh) * mask
        out |= dict(diff_sum=((logp.detach() - cut(batch.sampler_logp)).abs() * fresh).sum().item(),
                    diff_count=fresh.sum().item())
    return pg + args.vf_coef * vf, n, out


# TRY NOT TO MODIFY: loading
def load_models(args: Args, run: Run, tokenizer):
    """The actor, the downstream models (critic, reference, reward model), the trained pair (actor + critic), Adam."""
    policy, critic, ref_policy, reward_model = common.load_networks(  # (--reward-model, --critic-model: tokenizer)
        run.model_path, run.device, getattr(torch, args.dtype), args.reward_model, args.critic_model, tokenizer)
    if args.gradient_checkpointing:  # in train mode only (the update's); the critic's prefill keeps its KV cache
        critic.gradient_checkpointing_enable()
    policy = run.learner_model(policy)
    downstream = {name: run.learner_model(model, pushed=False) for name, model in  # (the critic: trained, not pushed)
                  dict(critic=critic, ref=ref_policy, rm=reward_model).items() if model is not None}
    learner = torch.nn.ModuleDict(dict(policy=policy, critic=downstream["critic"]))
    optimizer = torch.optim.Adam(learner.parameters(), lr=args.learning_rate, eps=1e-7, fused=True)  # one kernel
    return policy, downstream, learner, optimizer


def minibatches(run: Run, args: Args):
    """PPO's epochs x minibatches: (the round's first?, rows), each epoch's order rank 0's draw (checkpointed RNG)."""
    for epoch in range(args.num_ppo_epochs):
        order = run.from_main(np.random.permutation, args.batch_size)
        for m, rows in enumerate(np.array_split(order, args.num_minibatches)):
            yield epoch == 0 and m == 0, rows.tolist()


def main():
    args = checks.parse_args(Args, paper=PAPER, smollm2=SMOLLM2)  # on --resume: the saved run's flags
    B = args.batch_size
    run = Run(args, memory_plan.ACTOR_CRITIC, overlapped=args.intra,
              sampler_settings=dict(max_num_seqs=B + (args.delta_max if args.inter else 0)))
    tis_on = checks.tis_applies(args, args.tis)  # pi_old at the learner's precision whenever the sampler's differs
    eos_penalty = 0.0 if args.long_tail else args.missing_eos_penalty  # (--long-tail forces the lengths)
    mean = lambda x: float(np.mean(x)) if len(x) else math.nan  # (no step taken: NaN)
    ratio = lambda total, count: total / count if count else math.nan
    grads = lambda model: [p.grad for p in model.parameters() if p.grad is not None]
    with run:  # the sampler closes however this ends
        run.from_main(checks.check_args, not (args.intra and run.dist.enabled), "--intra", "runs on one process only "
                      "(rank 0 prefills while it polls): add --no-intra")
        distributed.check_world_size(B // args.num_minibatches, "sequences per minibatch", run.dist)
        tokenizer, task, evaluate = tasks.load(args, run.model_path, run.sampler.engine)
        policy, downstream, learner, optimizer = load_models(args, run, tokenizer)
        critic, overlap = downstream["critic"], Overlap(args.delta if args.inter else 0, *chunk_sizes(args))
        sampler = run.sampler
        oppo = OPPOBuffer(sampler.engine, task, tokenizer, downstream, args, overlap.chunk)
        start = run.resume(policy, optimizer, checkpointed=learner,  # actor and critic, and OPPO's state:
                           extra=("delta", "chunk", "reward_history", "carried_keys"))
        eval_start = start.eval_start or run.log(start.step, evaluate())  # pass@k at the run's start
        sampler.set_rng_state(start.sampler_rng)  # (after the start's evaluation, which drew from them)
        if args.snapshot_every and start.round == 0:
            run.snapshot(start.step)  # time 0 of the learning curve
        step, overlap.data_position = start.step, start.data_position
        totals = dict(tokens=0, round_seconds=0.0, score_hidden_seconds=0.0, score_exposed_seconds=0.0,
                      push_seconds=0.0, last_rewards=[]) | start.totals  # this method's counters, checkpointed too
        policy.eval()  # (train mode for the update only)
        if start.extra:  # resumed: OPPO's state, and the prompts that were in flight submitted again
            overlap.delta, overlap.reward_history = start.extra["delta"], start.extra["reward_history"]
            overlap.chunk = oppo.chunk = start.extra["chunk"]
            if run.is_main:
                totals["skipped_prompts"] += oppo.admit(start.extra["carried_keys"], start.round)
        clock = time.perf_counter() - totals["wall_seconds"]  # (a resumed run's time too)
        for round_index in range(start.round, args.num_rounds):
            # ALGO LOGIC: OPPO's Stages 1-2 on rank 0 (under torchrun the other ranks wait for its batch)
            round_start, unfinished, generate_seconds, hidden_score = time.perf_counter(), 0, 0.0, 0.0
            if run.is_main:
                if args.intra:
                    oppo.stream_every(overlap.next_chunk(round_index, args.chunk_tune_every))
                totals["skipped_prompts"] += oppo.over_commit(B + overlap.delta, overlap, round_index)  # Stage 1
                hidden_score, unfinished = oppo.generate_until(B)  # Stage 2: the unfinished ones paused, carried over
                generate_seconds = time.perf_counter() - round_start
            batch = run.from_main(oppo.take, B)  # every rank trains on rank 0's batch
            sampler.set_learner_threads()  # every core: the sampler is paused (carried sequences) or done
            score_start = time.perf_counter()
            task_scores, scores, no_eos, ref_logp, values = oppo.scores(batch, run, eos_penalty)  # Stage 3 (the rest)
            train_start, samples = time.perf_counter(), [r.final for r in batch]
            run.warn_no_learning(scores - scores.mean(), "every sequence of the batch scores the same")
            lags = sampler.check_version(samples, step, max_lag=step if args.inter else 0)  # plain PPO, intra: 0
            mask, sampler_logp, fresh = common.sampler_rows(samples, step)
            data = Batch.from_samples(samples, tokenizer.pad_token_id, run.device)
            old_logp, tis_weights, tis_stats = sampler_logp, None, {}  # same precision: the sampler's are the learner's
            if tis_on:  # TIS: PPO's old policy is the learner now; the sampler's numerics and staleness in a weight
                old_logp = common.token_aligned(data.logprobs(policy, args, run.dist).cpu(), samples, inverse=True)
                tis_weights, tis_stats = truncated_is_weights(old_logp, sampler_logp, mask, "token", args.tis_cap)
                logprob_diff = ratio(((old_logp - sampler_logp).abs() * fresh).sum().item(), fresh.sum().item())
            # ALGO LOGIC: per-token rewards with the KL penalty to the reference folded in, GAE (Eq. 1), whitened
            rewards = -args.kl_coef * ((old_logp - ref_logp) * mask)
            rewards[torch.arange(B), mask.sum(1).long() - 1] += scores
            advantages = gae(rewards, values, args.gamma, args.lam)
            returns = advantages + values
            data.add(samples, old_logp=old_logp, advantages=whiten(advantages, mask), values=values, returns=returns,
                     tis=tis_weights, fresh=fresh)
            # ALGO LOGIC: PPO epochs x minibatches, one optimizer step of actor + critic per minibatch
            learner.train()  # (for the update only)
            sums = dict.fromkeys(("policy", "value", "clipfrac", "approx_kl", "entropy"), 0.0)  # token means, summed
            round_start_step, norms, total_tokens = step, [], int(mask.sum())  # norms: (joint, actor) of steps taken
            learning_rate = scheduled_learning_rate(args.learning_rate, args.lr_schedule, round_index, args.num_rounds)
            optimizer.param_groups[0]["lr"] = learning_rate  # from the round alone: a resumed run gets the same
            for first, minibatch in minibatches(run, args):  # first: no step yet this round
                # micro-batches, each loss backpropagated with its share of the minibatch's response tokens
                loss, out, total = 0.0, {}, sum(len(batch[i].response) for i in minibatch)
                for mb in common.micro_batch_plan([batch[i].num_tokens for i in minibatch], args.micro_batch_tokens,
                                                  max_rows=args.micro_batch_size, dist=run.dist):
                    mb_loss, size, mb_out = ppo_micro_batch(policy, critic, data, mb, minibatch, args,
                                                            logprob_diff=first and not tis_on)
                    share = mb.weight * size / total  # (weight 0: a torchrun stand-in)
                    (mb_loss * share).backward()
                    loss = loss + mb_loss.detach() * share
                    common.add_outputs(out, mb, mb_out, len(minibatch))
                loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches
                actor_norm = torch.nn.utils.get_total_norm(grads(policy))  # its part, unclipped
                grad_norm = torch.nn.utils.clip_grad_norm_(learner.parameters(), args.max_grad_norm)
                stepped = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
                optimizer.zero_grad()
                sums = {k: v + out[k] / total_tokens for k, v in sums.items()}
                if first:  # before any step: pi_old against the learner, the learner against the sampler (TIS: above)
                    first_ratio_deviation = out["ratio_deviation"] / max(out["tokens"], 1e-9)
                    logprob_diff = logprob_diff if tis_on else ratio(out["diff_sum"], out["diff_count"])
                step += stepped
                totals["nonfinite_skipped"] += not stepped  # a NaN/inf never reaches the weights, Adam, sampler
                norms += [(grad_norm.item(), actor_norm.item())] if stepped else []
            learner.eval()  # the critic's prefill and TIS's forward (gradient checkpointing drops KV caches in train)
            train_seconds = time.perf_counter() - train_start
            pushed = (sampler.push(policy, step, recompute_kv=True) if step != round_start_step
                      else {"time/push_seconds": 0.0})  # none if no step
            if unfinished:  # the carried sequences continue under the new weights (rank 0's count: 0 elsewhere)
                sampler.engine.resume()
            totals["tokens"] += total_tokens
            totals["episodes"] += B
            stage_seconds = dict(round=time.perf_counter() - round_start, generate=generate_seconds,
                                 score_hidden=hidden_score, score_exposed=train_start - score_start,
                                 train=train_seconds, push=pushed["time/push_seconds"])  # Figure 6's stages
            totals |= {f"{stage}_seconds": totals[f"{stage}_seconds"] + t for stage, t in stage_seconds.items()}
            totals["last_rewards"] = (totals["last_rewards"] + [task_scores.mean().item()])[-10:]
            totals["wall_seconds"] = time.perf_counter() - clock
            ages, (joint, actor) = [round_index - r.admitted for r in batch], np.array(norms, float).reshape(-1, 2).T
            metrics = {
                "charts/reward": task_scores.mean().item(), "charts/reward_penalized": scores.mean().item(),  # (EOS)
                "charts/no_eos_fraction": no_eos.mean().item(), "charts/learning_rate": learning_rate,
                "charts/accuracy": mean([task.is_correct(s.text, r.problem) for s, r in zip(samples, batch)]),
                "charts/kl": common.sampled_kl(old_logp, ref_logp, mask).mean().item(),  # k3 of the sampled tokens
                "charts/kl_penalty": ((old_logp - ref_logp) * mask).sum(1).mean().item(),  # k1, in the reward
                "charts/advantage_std": advantages[mask > 0].std().item(), "charts/response_length": total_tokens / B,
                "charts/truncated_fraction": mean([s.finish_reason == "length" for s in samples]),
                "charts/delta": overlap.delta, "charts/chunk_size": overlap.chunk if args.intra else 0,
                "charts/carried_over": len(oppo.inflight), "charts/carried_in_batch": sum(a > 0 for a in ages),
                "charts/batch_age_max": max(ages), "charts/batch_age_mean": mean(ages),
                "charts/resumed_in_batch": sum(len({v for v, _, _ in s.versions}) > 1 for s in samples),  # 2 versions
                "charts/explained_variance": (1 - (returns - values)[mask > 0].var() / returns[mask > 0].var()).item(),
                "charts/logprob_diff": logprob_diff, "charts/first_ratio_deviation": first_ratio_deviation, **lags,
                "charts/tokens_per_second": totals["tokens"] / totals["wall_seconds"],
                **{f"losses/{k}": v / args.num_ppo_epochs for k, v in sums.items()},
                "losses/grad_norm": mean(joint), "losses/grad_clipped_fraction": mean(joint > args.max_grad_norm),
                "losses/actor_grad_share": mean((actor / joint) ** 2),  # of the joint norm's square (actor + critic)
                "time/round_seconds": stage_seconds["round"], "time/generate_seconds": generate_seconds,
                "time/score_hidden_seconds": hidden_score, "time/score_exposed_seconds": train_start - score_start,
                "time/train_seconds": train_seconds, **pushed, **common.throughput(totals, step),
                **{f"charts/tis_{k}": v for k, v in tis_stats.items()},  # tis_max_ratio, tis_truncated_fraction
            }
            if round_index == start.round:  # what the model really sees (chat template, special tokens) and writes
                print(f"sample: {tokenizer.decode(batch[0].tokens)!r}")
            run.log(step, metrics, round=round_index + 1, show=("losses/value", "charts/delta", "charts/carried_over"))
            # ALGO LOGIC: OPPO's controllers (the round logged the Delta it used): Delta from the reward trend
            overlap.update(args, round_index, scores.mean().item(), generate_seconds + train_start - score_start)

            # ---- after the round: the curve's weights, pass@k, the checkpoint ----
            rounds_done, last = round_index + 1, round_index + 1 == args.num_rounds
            if args.snapshot_every and rounds_done % args.snapshot_every == 0:
                run.snapshot(step)
            if args.eval_every and rounds_done % args.eval_every == 0 and not last:
                run.log(step, evaluate())
            if last or (args.save_every and rounds_done % args.save_every == 0):
                run.save(step, rounds_done, overlap.data_position, totals, tokenizer, eval_start,
                         delta=overlap.delta, chunk=overlap.chunk, reward_history=overlap.reward_history,
                         carried_keys=[r.key for r in oppo.inflight.values()])
        if sampler.engine is not None:
            sampler.engine.abort(list(sampler.engine.pending))  # the carried-over sequences: none is trained on now
        eval_end = run.log(step, evaluate())  # pass@k at the end
    method = {(1, 1): "OPPO", (1, 0): "intra only", (0, 1): "inter only", (0, 0): "plain PPO"}[args.intra, args.inter]
    run.report("PPO with OPPO's overlaps: the paper's Figure 6 (seconds per round by stage)", dict(method=method)
               | {stage: totals[f"{stage.replace(' ', '_')}_seconds"] / args.num_rounds for stage in (
                   "round", "generate", "score exposed", "score hidden", "train", "push")}  # (means per round)
               | {"reward (last 10)": mean(totals["last_rewards"])},
               totals, step, eval_start, eval_end)


if __name__ == "__main__":
    main()
