"""The learner's side of the method, what a reader of the four scripts looks up: loading the policy
(and the built-in tiny model, PPO's networks), the learner's token logprobs under the logprob contract
(the sampler's temperature and top-p, sampling_logits), padding and per-response values in their layout,
token-budget micro-batches and adding up their outputs (a frozen scoring's share per rank), the sampled
KL of `charts/kl`, bf16 autocast and per-request sampling overrides. The method itself lives in each
script; tasks.py holds tasks, prompts, rewards and evaluation. Plumbing is the package fastrl/, which
never imports this module, tasks.py or a script (imports run scripts -> common, tasks -> fastrl):

    fastrl/checks.py         flags and checks: parse_args, check_run_flags, check_model, warnings
    fastrl/runlog.py         run logging and checkpoints: RunLogger, read_metrics, save/load_checkpoint
    fastrl/launch.py         the sampler's start beside the learner: start_sampler, connect_weights, threads
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

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fastrl import distributed, run
from fastrl.checks import SMOLLM2, TINY, check_args
from fastrl.util import load_hf, load_tokenizer

if TYPE_CHECKING:  # annotations only
    from fastrl.vllm_sampler import Completion


# --------------------------------------------------------------------------------------
# Models: the policy and the built-in tiny model
# --------------------------------------------------------------------------------------


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


class Run(run.Run):
    """fastrl.run.Run (the run's setup and teardown) for this project's models and tasks: --model resolves by
    resolve_model, and the --task names in tasks.HUB_TASKS need the datasets package."""

    def __init__(self, args, workload, **settings):
        import tasks

        super().__init__(args, workload, tasks.HUB_TASKS, resolve_model, **settings)


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


def load_policy(path: str, device: str | torch.device, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return load_hf(AutoModelForCausalLM, path, dtype=dtype).to(device)


def load_networks(model_path: str, device, dtype: torch.dtype, reward_model: str | None = None,
                  critic_model: str | None = None, tokenizer=None):
    """PPO's networks: actor, critic (from `critic_model`, else the reward model, else the policy's checkpoint with a
    fresh score head drawn with std 1/(hidden size + 1)) and frozen reference in `dtype` whatever the checkpoint's; the
    frozen reward model in its own dtype. `tokenizer` (the policy's): first a one-line error naming --reward-model /
    --critic-model if its model's tokenizer differs (it reads the actor's token ids as they stream)."""
    from transformers import AutoModelForSequenceClassification

    for flag, path in (("--reward-model", reward_model), ("--critic-model", critic_model)):
        check_args(tokenizer is None or path is None or load_tokenizer(path, flag).get_vocab() == tokenizer.get_vocab(),
                   flag, "must share the policy's tokenizer: it reads the actor's token ids as they stream")
    policy = load_policy(model_path, device, dtype=dtype)
    critic_path = critic_model or reward_model or model_path  # a reward model already reads whole responses
    flag = "--critic-model" if critic_model else "--reward-model" if reward_model else "--model"
    critic = load_hf(AutoModelForSequenceClassification, critic_path, quiet=critic_path == model_path,
                     num_labels=1, flag=flag, dtype=dtype).to(device)
    if critic_path == model_path:  # a new head as OpenRLHF's init_value_head: HF's std 0.02 starts V at +-1 on SmolLM2
        torch.nn.init.normal_(critic.score.weight, std=1 / (critic.config.hidden_size + 1))
    ref_policy = load_policy(model_path, device, dtype=dtype).eval().requires_grad_(False)
    rm = load_hf(AutoModelForSequenceClassification, reward_model, flag="--reward-model", num_labels=1,
                 dtype="auto").to(device).eval().requires_grad_(False) if reward_model else None
    return policy, critic, ref_policy, rm


# --------------------------------------------------------------------------------------
# The learner's logprobs (the logprob contract) and micro-batches
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
# Each chunk's backward keeps its fp32 log-probabilities (VocabularyLogprobs). Up to SAVED_LOGPROB_BYTES for the
# whole micro-batch (SmolLM2's CPU micro-batches: ~0.1 GB) they are kept, in chunks of SAVED_CHUNK_BYTES so that the
# forward's temporaries stay small; above it (a GPU's 8,192 tokens at V=151,936: GBs) each chunk is recomputed.
SAVED_LOGPROB_BYTES = 512 * 2**20
SAVED_CHUNK_BYTES = 32 * 2**20


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = 0, with_entropy: bool = False, chunk_bytes: int = LOGIT_CHUNK_BYTES):
    """The logprob contract: per-token fp32 log pi(y_t | x, y_<t) of the completion tokens under the sampler's
    processing (temperature, top-k, top-p; equal to the sampler's own at its weights), [batch, len-1] aligned with
    input_ids[:, 1:], zero off the completion; with `with_entropy` also that distribution's entropy per token."""
    # Memory: the backbone runs once; the vocabulary projection, softmax and entropy run on the completion's positions
    # only, over chunks of at most `chunk_bytes` of fp32 logits, each keeping only its fp32 log-probabilities for the
    # backward (VocabularyLogprobs); above SAVED_LOGPROB_BYTES each chunk is recomputed in the backward instead
    # (activation checkpointing), so no [B, T, V] copy is ever alive beyond one chunk.
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    decoder, head = _backbone_and_head(model)
    if decoder is None:  # a model whose head does more than a projection: the plain way
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        chosen, entropy = VocabularyLogprobs.apply(logits, targets, temperature, top_p, top_k, with_entropy)
        return (chosen * mask, entropy * mask) if with_entropy else chosen * mask
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    where = mask.bool()
    hidden, flat_targets = hidden[where], targets[where]  # [N, H], [N]: the completion's positions
    row_bytes = 4 * head.weight.shape[0]  # one position's fp32 logits
    recompute = torch.is_grad_enabled() and hidden.shape[0] * row_bytes > SAVED_LOGPROB_BYTES
    per_chunk = max(1, (chunk_bytes if recompute else min(chunk_bytes, SAVED_CHUNK_BYTES)) // row_bytes)
    pieces = []
    for start in range(0, hidden.shape[0], per_chunk):
        part = slice(start, start + per_chunk)

        def run(h, t):
            return VocabularyLogprobs.apply(head(h), t, temperature, top_p, top_k, with_entropy)

        if recompute:
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
    if (getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None)
            or not hasattr(model, "get_decoder")):
        return None, None
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None, None
    return model.get_decoder(), head


class VocabularyLogprobs(torch.autograd.Function):
    """[N, V] logits (fp32 or autocast's bf16), [N] targets -> the targets' fp32 log-probabilities under
    sampling_logits (and the entropy, or None), with the gradient written out instead of autograd's chain of
    [N, V] intermediates: the forward keeps one fp32 [N, V] tensor (the log-probabilities), the backward forms
    d/dz = g_chosen * (onehot - p) - g_entropy * p * (log p + H) from it, z = logits / temperature. Excluded tokens
    (p = 0) keep a log-probability of EXCLUDED instead of -inf, so 0 * log p stays 0 in both passes."""

    EXCLUDED = -1e30

    @staticmethod
    def forward(ctx, logits, targets, temperature, top_p, top_k, with_entropy):
        logps = torch.log_softmax(sampling_logits(logits.float(), targets, temperature, top_p, top_k), dim=-1)
        logps.clamp_(min=VocabularyLogprobs.EXCLUDED)
        chosen = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = torch.special.entr(logps.exp()).sum(-1) if with_entropy else None
        ctx.save_for_backward(logps, targets, entropy)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen, grad_entropy):
        logps, targets, entropy = ctx.saved_tensors
        grad_chosen = torch.zeros_like(logps[:, 0]) if grad_chosen is None else grad_chosen
        if entropy is not None and grad_entropy is not None:
            grad = (logps + entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_chosen[:, None])
        else:
            grad = grad_chosen[:, None].expand_as(logps).clone()
        grad.mul_(logps.exp()).neg_()
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_chosen.unsqueeze(-1))
        return grad.div_(ctx.temperature).to(ctx.dtype), None, None, None, None, None


def micro_batches(lengths: list[int], max_tokens: int, rows_per_item: int = 1,
                  max_rows: int | None = None) -> list[list[int]]:
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
    torchrun stand-in that only keeps the ranks in step: the scripts scale its share to 0)."""

    items: list[int]
    width: int
    weight: float = 1.0


def micro_batch_plan(lengths: list[int], max_tokens: int, rows_per_item: int = 1, max_rows: int | None = None,
                     dist=None) -> list[MicroBatch]:
    """The micro-batches this process runs for one optimizer step, MicroBatch(items, width, weight): the items packed
    within `max_tokens` padded tokens (and `max_rows`), all of weight 1; under torchrun this rank's share, as many on
    every rank, a rank short of one given a stand-in of weight 0 (scale its loss by the weight: it changes nothing)."""
    plan = distributed.my_micro_batches(micro_batches(lengths, max_tokens, rows_per_item, max_rows), dist)
    return [MicroBatch(items, max(lengths[i] for i in items), weight) for items, weight in plan]


def add_outputs(outputs: dict, mb: MicroBatch, mb_outputs: dict, num_items: int) -> dict:
    """Add one micro-batch's outputs into the step's `outputs` (in place; also returned), times mb.weight: a tensor of
    one value per item lands at its items of a [num_items] tensor, anything else is summed. run.all_sum of the result:
    the whole batch's, on every rank."""
    for name, value in mb_outputs.items():
        if torch.is_tensor(value) and value.dim() == 1:
            laid_out = outputs.setdefault(name, torch.zeros(num_items, dtype=value.dtype, device=value.device))
            laid_out[mb.items] += value.detach() * mb.weight
        else:
            outputs[name] = outputs.get(name, 0.0) + (value.detach() if torch.is_tensor(value) else value) * mb.weight
    return outputs


def score_my_share(items: list, lengths: list[int], max_rows: int, score, stand_in, dist=None) -> set[int]:
    """Frozen scoring of a batch spread over the ranks: under torchrun score(...) runs on this rank's micro-batches of
    at most `max_rows` items (distributed.my_micro_batches; a rank short of one scores [stand_in(an item)] so that the
    ranks' forwards match), else once on all the items. Returns the indices of the items this rank scored."""
    if dist is None or not dist.enabled:
        score(items)
        return set(range(len(items)))
    mine: set[int] = set()
    for rows, weight in distributed.my_micro_batches(micro_batches(lengths, 2**62, max_rows=max_rows), dist):
        score([items[i] for i in rows] if weight else [stand_in(items[rows[0]])])
        mine.update(rows if weight else [])
    return mine


def scheduled_learning_rate(learning_rate: float, schedule: str, round_index: int, num_rounds: int) -> float:
    """The learning rate of round `round_index` (0-based), for all its steps (ppo_oppo, online_dpo_async): constant,
    or a linear decay to 0, lr * (1 - round_index / num_rounds) (HF's linear schedule without warmup, one step a
    round: docs/defaults.md)."""
    if schedule == "constant":
        return learning_rate
    return learning_rate * max(0.0, 1 - round_index / num_rounds)


def throughput(totals: dict, step: int) -> dict:
    """The run's counters as metrics (fastrl/run.py TOTALS; over the whole run, resumes included): episodes, and per
    second of the loop's wall, its shares generating and waiting for data (those measured), steps per second, steps
    skipped for a non-finite loss, prompts skipped as longer than --max-prompt-tokens."""
    wall = max(totals["wall_seconds"], 1e-9)
    shares = {"time/sample_fraction": totals["generate_seconds"] / wall} if totals["generate_seconds"] else {}
    if totals["learner_wait_seconds"]:
        shares["time/learner_wait_fraction"] = totals["learner_wait_seconds"] / wall
    return {"charts/episodes": totals["episodes"], "charts/episodes_per_second": totals["episodes"] / wall, **shares,
            "time/grad_steps_per_second": step / wall, "charts/nonfinite_skipped": totals["nonfinite_skipped"],
            "charts/skipped_long_prompts": totals["skipped_prompts"]}


def sampled_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """charts/kl: KL(pi || pi_ref) of each sampled response ([N]), k3 = r - log r - 1 per token (r = pi_ref / pi:
    unbiased for samples from pi, never negative) summed over its `mask`; logp: the sampling policy's token logprobs
    ([N, T]), ref_logp: the reference's. (rloo_kreuse.py's kl_penalty(..., "k3") is the same.)"""
    log_ratio = (ref_logp - logp) * mask
    return (torch.expm1(log_ratio) - log_ratio).mul(mask).sum(1)


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
            logp = token_logprobs(model, input_ids[rows, :width], attention_mask[rows, :width],
                                  completion_mask[rows, :width], **processing)
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


def sampler_rows(samples: list["Completion"], version: int):
    """Response-aligned [N, T] rows (T: the longest completion) of the completions: the mask, the sampler's logprobs
    and `fresh` (1 on the tokens that the weights of `version` sampled, from Completion.versions' spans)."""
    N, T = len(samples), max(len(s.token_ids) for s in samples)
    mask, sampler_logp, fresh = (torch.zeros((N, T)) for _ in range(3))
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        mask[i, :n] = 1
        sampler_logp[i, :n] = torch.tensor(s.logprobs)
        fresh[i, :n] = torch.tensor([float(v == version) for v, start, end in s.versions for _ in range(end - start)])
    return mask, sampler_logp, fresh


def token_aligned(x: torch.Tensor, samples: list["Completion"], inverse: bool = False) -> torch.Tensor:
    """Per-response values [N, T] (sampler_rows' layout) -> token_logprobs' layout [N, L - 1] of the completions'
    prompt + completion rows (zeros elsewhere); `inverse`: back."""
    ends = [len(s.prompt_token_ids) + len(s.token_ids) - 1 for s in samples]
    out = torch.zeros((len(samples), max(len(s.token_ids) for s in samples) if inverse else max(ends)))
    for i, (s, end) in enumerate(zip(samples, ends)):
        response, in_rows = slice(0, len(s.token_ids)), slice(len(s.prompt_token_ids) - 1, end)
        out[i, response if inverse else in_rows] = x[i, in_rows if inverse else response]
    return out

# the training-inference mismatch correction and its diagnostics, shared by the scripts whose samples can be off-policy
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a sequence weight beyond it is as good as infinite, and inf * 0 is NaN


def truncated_is_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, level: str,
                         cap: float):
    """Truncated importance weights min(pi / mu, cap) from [N, T] logprobs, mu the behaviour policy: per `token` ([N,
    T], zero off `mask`) or per `sequence` ([N]: its tokens' ratios multiplied); log-ratios capped at MAX_LOG_WEIGHT.
    Returns (weights, stats): the largest untruncated ratio, the fraction truncated (over those tokens or sequences)."""
    if level == "sequence":
        ratio = torch.exp((logp - behaviour_logp).mul(mask).sum(1).clamp(max=MAX_LOG_WEIGHT))
        considered = torch.ones_like(ratio, dtype=torch.bool)
    else:
        ratio = torch.exp((logp - behaviour_logp).clamp(max=MAX_LOG_WEIGHT)) * mask
        considered = mask.bool()
    measured = bool(considered.any())
    stats = dict(max_ratio=ratio[considered].max().item() if measured else math.nan,
                 truncated_fraction=(ratio[considered] > cap).float().mean().item() if measured else math.nan)
    return ratio.clamp(max=cap), stats


def ess(weights: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Normalised effective sample size (sum w)^2 / (N sum w^2) of the weights (those where `mask` is 1), in (0, 1]: 1
    when every weight is the same (on-policy), 1/N when one weight carries them all."""
    w = weights if mask is None else weights[mask.bool()]
    return (w.sum() ** 2 / (len(w) * (w ** 2).sum())).item()


@dataclasses.dataclass
class Batch:
    """A round's completions on the learner, row i = sample i: right-padded prompt + completion rows ([N, T]), each
    row's length, and `mask` and the sampler's token logprobs ([N, T - 1], aligned with input_ids[:, 1:]:
    token_logprobs' layout). A script's Batch extends it with its method's tensors, in the same layout."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    lengths: list[int]
    mask: torch.Tensor
    sampler_logp: torch.Tensor

    @classmethod
    def from_samples(cls, samples, pad_token_id: int, device):
        """The completions (the sampler's Completion objects) as padded rows on `device`, with their logprobs."""
        input_ids, attention_mask, completion_mask = (t.to(device) for t in pad_prompt_completions(
            [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], pad_token_id))
        mask = completion_mask[:, 1:].float()
        prompt_lengths = [len(s.prompt_token_ids) for s in samples]
        sampler_logp = sampler_logprob_tensor(samples, prompt_lengths, mask.shape[1]).to(device)
        lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
        return cls(input_ids, attention_mask, completion_mask, lengths, mask, sampler_logp)

    def add(self, samples, **response_tensors) -> None:
        """Set these per-token tensors (a script's Batch fields) from the completions' [N, T] response-aligned values
        (token_aligned), on the batch's device; None stays None."""
        for name, x in response_tensors.items():
            setattr(self, name, None if x is None else token_aligned(x, samples).to(self.input_ids.device))

    def logprobs(self, model, args, dist=None) -> torch.Tensor:
        """No-grad token logprobs of every row under `model`, processed as the sampler's (args.temperature and
        args.top_p: the logprob contract), within --micro-batch-tokens, under --autocast-bf16; whole on every rank."""
        return batch_logprobs(model, self.input_ids, self.attention_mask, self.completion_mask, self.lengths,
                              args.micro_batch_tokens, dist, bf16=args.autocast_bf16, temperature=args.temperature,
                              top_p=args.top_p)


def request_overrides(keys: list[int], args) -> list[dict]:
    """Each request's sampling overrides (Sampler.submit's per_prompt), keys: its problem's index: --request-seeds, a
    seed per problem (Sampler.submit adds the request id); --long-tail, the benchmark workload's forced length
    (ignore_eos, not min_tokens: min_tokens would distort the sampled distribution's logprobs), drawn from the seed and
    the problem alone (a resumed run's resubmitted prompts get their lengths again)."""
    per_prompt = [dict(seed=(args.seed * 1_000_003 + k) % 2**31) if args.request_seeds else {} for k in keys]
    for extra, k in zip(per_prompt, keys if args.long_tail else []):
        tail = args.long_tail_scale * (1 + np.random.default_rng([args.seed, k]).pareto(args.long_tail))
        extra.update(ignore_eos=True, max_tokens=int(min(args.max_new_tokens, tail)))
    return per_prompt
