"""Learner memory at real scale, measured without a GPU: one learner step of each script at its paper
batch shapes on a Qwen2.5-0.5B-shaped model (random weights, built here from transformers' Qwen2Config,
nothing downloaded), with and without --autocast-bf16 and --gradient-checkpointing.

    .venv/bin/python benchmarks/memory.py                # every script and variant: ~8 minutes, one core
    .venv/bin/python benchmarks/memory.py --scripts dpo --micro-batch-tokens 4096

How: the step runs for real (the scripts' own functions: their loss, common.token_logprobs, their
micro-batch rule, clipping, Adam) but on *fake tensors* (torch's FakeTensorMode: shapes, dtypes and
autograd without data or compute), under a dispatch mode that records every tensor storage when it
is allocated and when it is freed. The peak of the live bytes, each storage rounded up to 512 bytes
as the CUDA caching allocator does, is what a GPU would allocate for tensors; the allocator's
fragmentation, cuBLAS/cuDNN workspaces and the CUDA context (~0.5-1 GB together) come on top. Values
that the step reads back to the host (.item(): ESS, gradient norm, isfinite) are not computed: the
tracker answers 1.0 / True, so every step takes the path that trains (the one that allocates Adam).
Attention: on an H100 (PyTorch 2.11), SDPA took its math kernel for this model's fp32 attention at
these shapes (RLOO's fp32 peak equalled the one with the math kernel forced, to 0.1 GB), which keeps
[heads, T, T] probabilities, and a fused kernel under bf16 autocast, which keeps none. The fake
measurement does the same: the math kernel for the fp32 variants, PyTorch's CPU flash kernel (no
[heads, T, T] matrix either) under bf16 autocast.

Checked against the same steps run for real on an H100 (`--device cuda`, torch.cuda.max_memory_allocated,
PyTorch 2.11): 12 of the 14 variants that fit in 80 GB agreed within 1.5 GB (4 within 0.1 GB); under
bf16 autocast alone PipelineRL and PPO read 2.6 and 1.8 GB more here than there; the two variants
measured above 80 GB here ran out of memory there.

Each step runs with Adam's moments already allocated (the steady state, from the second optimizer
step on) and reports the peak over the whole step. Shapes: every sequence at full length
(a 256-token prompt + the response cap), the worst case for memory.
"""

from __future__ import annotations

import copy
import math
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from fastrl import launch  # noqa: E402
from fastrl import vllm_sampler  # noqa: E402

GB = 1e9
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


# --------------------------------------------------------------------------------------
# The tracker: live tensor bytes of a computation on fake tensors
# --------------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Records every storage an op returns (once, however many views it has) until it is freed, and
    the peak of their total. Data-dependent ops, which fake tensors cannot answer, get a stand-in:
    .item() of a fake tensor is 1 / 1.0 / True; a boolean mask selects everything (an upper bound)."""

    def __init__(self):
        super().__init__()
        self.live = WeakIdKeyDictionary()
        self.current = self.peak = 0
        self.marks: dict[str, int] = {}

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.live:
            return
        size = math.ceil(storage.nbytes() / CUDA_BLOCK) * CUDA_BLOCK
        self.live[storage] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.current -= size

    def mark(self, name: str) -> None:
        self.marks[name] = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            (t,) = args
            if not isinstance(t, FakeTensor):  # a real tensor (host-side bookkeeping): its real value
                with unset_fake_temporarily():
                    return t.item()
            return True if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
        if func is torch.ops.aten.nonzero.default:  # every element selected: an upper bound
            (t,) = args
            return torch.zeros((t.numel(), t.dim()), dtype=torch.long, device=t.device)
        if func is torch.ops.aten.masked_select.default:
            t, mask = args
            return torch.empty(torch.broadcast_shapes(t.shape, mask.shape).numel(), dtype=t.dtype, device=t.device)
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            args = (args[0], [self._long_indices(i) for i in args[1]], *args[2:])
            args = (args[0], [j for i in args[1] for j in (i if isinstance(i, tuple) else (i,))], *args[2:])
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    @staticmethod
    def _long_indices(index):
        """A boolean index of k dims -> k long indices selecting all its elements (as nonzero would)."""
        if index is None or index.dtype not in (torch.bool, torch.uint8):
            return index
        return tuple(torch.zeros(index.numel(), dtype=torch.long, device=index.device) for _ in range(index.dim()))


def measure(step, math_attention: bool = False) -> dict:
    """Run step(tracker) on fake tensors; returns the peak and final live bytes and the marks the
    step set (tracker.mark), in bytes. math_attention: SDPA's math kernel, as CUDA picks it for fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = ([SDPBackend.MATH] if math_attention
               else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    with sdpa_kernel(kernels), FakeTensorMode(allow_non_fake_inputs=True), LiveTensorBytes() as tracker:
        step(tracker)
        final = tracker.current
    return dict(peak=tracker.peak, final=final, marks=dict(tracker.marks))


def measure_on_device(step, device: str) -> dict:
    """The same step with real tensors on a GPU: torch.cuda.max_memory_allocated over it (tensors
    only, as the fake measurement; the caching allocator's reserve comes on top)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device(device):
        step(None)
    peak = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    return dict(peak=peak, final=torch.cuda.memory_allocated() - base, marks={}, reserved=reserved)


def real_tensor(values: list) -> torch.Tensor:
    """A host-side index tensor (the scripts read it back with .tolist()): real under fake mode."""
    with unset_fake_temporarily():
        return torch.tensor(values)


# --------------------------------------------------------------------------------------
# Models: Qwen2.5-0.5B's shapes, random weights, built locally
# --------------------------------------------------------------------------------------


def qwen25_05b_config(num_layers: int = 24):
    """Qwen/Qwen2.5-0.5B's architecture (config.json), written out: nothing is downloaded."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=num_layers,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                       attention_dropout=0.0, use_sliding_window=False, bos_token_id=151_643, eos_token_id=151_643,
                       pad_token_id=151_643)


def causal_lm(config, trained: bool, checkpointing: bool = False):
    """A policy (trained: fp32, train mode if checkpointing, as the scripts set it) or a frozen reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not trained:
        return model.eval().requires_grad_(False)
    model.eval()  # from_pretrained's mode
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    return model


def critic_model(config, checkpointing: bool = False):
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    config.num_labels = 1  # as common.load_networks: the policy's architecture with a 1-output score head
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def adam(parameters):
    """Adam as every script builds it, its moments already allocated: the state from the second
    optimizer step on (a step on zero gradients moves no weight)."""
    parameters = list(parameters)
    optimizer = torch.optim.Adam(parameters, lr=1e-6, eps=1e-7, fused=True)
    for p in parameters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def sequences(n: int, prompt: int, response: int, vocab: int, pad_id: int = 0):
    """n right-padded rows of prompt + response tokens (token ids don't matter to memory)."""
    prompts, completions = [[5] * prompt for _ in range(n)], [[7] * response for _ in range(n)]
    ids, attn, cmask = common.pad_prompt_completions(prompts, completions, pad_id)
    return prompts, completions, ids, attn, cmask, [prompt + response] * n


def with_autocast(enabled: bool):
    return torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=enabled)


# --------------------------------------------------------------------------------------
# One learner step per script, as its main() runs it
# --------------------------------------------------------------------------------------


def preset(script, model: str) -> dict:
    """The script's defaults for `model`: its SMOLLM2 preset for "smollm2", else its PAPER one."""
    return script.SMOLLM2 if model == "smollm2" else script.PAPER


def update(loss_fn, lengths: list[int], max_tokens: int, total: float | None = None, rows_per_item: int = 1,
           max_rows: int | None = None, model=None, optimizer=None, max_grad_norm: float = 1.0):
    """The update each script writes in its round (e.g. rloo_kreuse.main): common.micro_batch_plan's micro-batches,
    each loss_fn(mb) -> (mean loss, size, outputs) backpropagated with its share size / `total` (default: the items),
    outputs laid out by common.add_outputs; then, given a model and an optimizer, one clipped step (a non-finite one
    skipped). Returns (loss, outputs). Here to drive the scripts' micro-batch losses in the memory steps and in
    tests/test_memory.py; the scripts' own loops run end to end in their tests (test_rloo_kreuse's micro-batch
    check, test_pipeline_rl's train_step)."""
    total = len(lengths) if total is None else total
    loss, outputs = 0.0, {}
    for mb in common.micro_batch_plan(lengths, max_tokens, rows_per_item, max_rows):
        mb_loss, size, mb_outputs = loss_fn(mb)
        share = mb.weight * size / total
        (mb_loss * share).backward()
        loss = loss + mb_loss.detach() * share
        common.add_outputs(outputs, mb, mb_outputs, len(lengths))
    if optimizer is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm)):
            optimizer.step()
        optimizer.zero_grad()
    return loss, outputs


def rloo_step(config, prompts: int = 4, group: int = 2, prompt: int = 256, response: int = 512,
              micro_batch_tokens: int | None = None, autocast: bool = False, checkpointing: bool = False,
              steps: int = 1, tracker=None, model: str = "qwen2.5-0.5b"):
    """rloo_kreuse.py at the paper's v3 setup: 4 prompts x 2 responses, K steps on the batch (model "smollm2": at
    its preset, whose --kl-coef 0 loads no reference)."""
    import functools

    import rloo_kreuse as rloo

    overrides = dict(model=model, autocast_bf16=autocast, gradient_checkpointing=checkpointing)
    args = rloo.Args(**preset(rloo, model) | overrides
                     | (dict(micro_batch_tokens=micro_batch_tokens) if micro_batch_tokens else {}))
    policy = causal_lm(config, True, checkpointing)
    ref = causal_lm(config, False) if args.kl_coef else None  # as rloo_kreuse.load_models
    optimizer = adam(policy.parameters())
    n = prompts * group
    _, _, ids, attn, cmask, lengths = sequences(n, prompt, response, config.vocab_size)
    mask = cmask[:, 1:].float()
    batch = rloo.Batch(ids, attn, cmask, lengths, mask, sampler_logp=torch.zeros_like(mask),
                       advantages=rloo.rloo_advantages(torch.zeros(prompts, group)).view(-1))
    batch.ref_logp = batch.logprobs(ref, args) if ref is not None else None
    batch.old_logp = batch.sampler_logp
    for k_step in range(steps):  # K steps reuse the batch
        loss_fn = functools.partial(rloo.micro_batch_loss, policy, batch, args=args, logprob_diff=k_step == 0)
        update(loss_fn, lengths, args.micro_batch_tokens, model=policy, optimizer=optimizer,
               max_grad_norm=args.max_grad_norm)
    return dict(micro_batches=len(common.micro_batches(lengths, args.micro_batch_tokens)), rows=n, tokens=sum(lengths))


def dpo_step(config, pairs: int = 64, prompt: int = 256, response: int = 512, micro_batch_tokens: int | None = None,
             autocast: bool = False, checkpointing: bool = False, steps: int = 1, group: int = 2, tracker=None,
             model: str = "qwen2.5-0.5b"):
    """online_dpo_async.py at the paper's setting: 64 prompts x 2 samples, one pair per prompt, one DPO step a round
    (the second step: the next round, Adam's moments allocated)."""
    import functools

    import online_dpo_async as dpo

    flags = ["--model", model, "--autocast-bf16" if autocast else "--no-autocast-bf16",
             "--gradient-checkpointing" if checkpointing else "--no-gradient-checkpointing"]
    args = dpo.parse_args(flags + (["--micro-batch-tokens", str(micro_batch_tokens)] if micro_batch_tokens else []))
    policy, ref = causal_lm(config, True, checkpointing), causal_lm(config, False)
    optimizer = adam(policy.parameters())
    n = pairs * group
    _, _, ids, attn, cmask, lengths = sequences(n, prompt, response, config.vocab_size)
    sampler_logp = torch.zeros(cmask[:, 1:].shape)
    chosen_rows = real_tensor([i * group for i in range(pairs)])  # the first two samples of each prompt's group
    rejected_rows = real_tensor([i * group + 1 for i in range(pairs)])
    batch = dpo.Batch(ids, attn, cmask, lengths, cmask[:, 1:].float(), sampler_logp, logp_mask=cmask[:, 1:].float())
    for round_index in range(steps):
        batch.ref_seq = batch.logprobs(ref, args).sum(1)
        loss_fn = functools.partial(dpo.dpo_micro_batch, policy, batch, chosen_rows=chosen_rows,
                                    rejected_rows=rejected_rows, args=args, logprob_diff=round_index == 0)
        update(loss_fn, dpo.pair_lengths(lengths, chosen_rows, rejected_rows), args.micro_batch_tokens, rows_per_item=2,
               model=policy, optimizer=optimizer, max_grad_norm=args.max_grad_norm)
    pair_lengths = [max(lengths[c], lengths[r]) for c, r in zip(chosen_rows.tolist(), rejected_rows.tolist())]
    return dict(micro_batches=len(common.micro_batches(pair_lengths, args.micro_batch_tokens, rows_per_item=2)), rows=n,
                tokens=sum(lengths))


def pipeline_step(config, prompt: int = 256, response: int | None = None, micro_batch_size: int | None = None,
                  autocast: bool = False, checkpointing: bool = False, steps: int = 1, tracker=None,
                  model: str = "qwen2.5-0.5b", batch_size: int | None = None):
    """pipeline_rl.py's step (its micro_batch_loss: the truncated-IS loss; its --micro-batch-size rule, clipping,
    Adam) on B = --train-batch-size sequences (or `batch_size`), at its non-tiny defaults, with its --autocast-bf16
    and --gradient-checkpointing."""
    import functools

    import pipeline_rl as prl

    overrides = dict(model=model, autocast_bf16=autocast, gradient_checkpointing=checkpointing,
                     max_new_tokens=response or preset(prl, model)["max_new_tokens"],
                     micro_batch_size=micro_batch_size or prl.Args.micro_batch_size)
    overrides |= dict(train_batch_size=batch_size) if batch_size else {}
    args = prl.mode_defaults(prl.Args(**preset(prl, model) | overrides))  # the paper's defaults, in pipeline mode
    policy = causal_lm(config, True, checkpointing)
    ref = causal_lm(config, False) if args.kl_coef else None  # main() loads a reference only with --kl-coef
    optimizer = adam(policy.parameters())
    B = args.train_batch_size
    samples = [vllm_sampler.Completion(request_id=str(i), prompt_token_ids=[5] * prompt,
                                       token_ids=[7] * args.max_new_tokens, logprobs=[-1.0] * args.max_new_tokens,
                                       finish_reason="length", versions=[(0, 0, args.max_new_tokens)])
               for i in range(B)]
    device = next(policy.parameters()).device
    batch = prl.Batch.from_samples(samples, 0, device)
    batch.advantages = prl.per_prompt_advantages(torch.zeros(B // args.group_size, args.group_size)).view(-1).to(device)
    batch.fresh, batch.total = torch.ones(B, dtype=torch.bool, device=device), B  # (--loss-norm sequence)
    for step in range(steps):  # the round's micro-batch loop, clip and step (its own autocast)
        loss_fn = functools.partial(prl.micro_batch_loss, policy, ref, batch, args=args)
        update(loss_fn, batch.lengths, args.micro_batch_tokens, total=batch.total, max_rows=args.micro_batch_size,
               model=policy, optimizer=optimizer, max_grad_norm=args.max_grad_norm)
    return dict(micro_batches=len(common.micro_batches(batch.lengths, args.micro_batch_tokens,
                                                       max_rows=args.micro_batch_size)),
                rows=B, tokens=B * (prompt + args.max_new_tokens), kl_coef=args.kl_coef)


def ppo_step(config, prompt: int = 256, response: int | None = None, micro_batch_tokens: int | None = None,
             autocast: bool = False, checkpointing: bool = False, steps: int = 1, tracker=None,
             model: str = "qwen2.5-0.5b", batch_size: int | None = None):
    """ppo_oppo.py at its non-tiny defaults (B = 112 sequences, 1024-token responses, Delta = 8 over-committed,
    C = 256-token chunks): the downstream models (critic, reference) prefill every sequence of the
    buffer chunk by chunk, keeping one KV cache per sequence and model (OPPO's intra-step overlap); the
    batch's caches are freed once read; the carried-over Delta sequences keep theirs through the update;
    then `steps` optimizer steps of PPO (one minibatch, all epochs alike) on actor + critic. `batch_size`: another
    B (the Delta carried kept), e.g. one of the preset's minibatches (--batch-size / --num-minibatches)."""
    import functools

    import ppo_oppo as po

    overrides = dict(model=model, autocast_bf16=autocast, gradient_checkpointing=checkpointing)
    args = po.Args(**preset(po, model) | overrides | (dict(max_new_tokens=response) if response else {})
                   | (dict(micro_batch_tokens=micro_batch_tokens) if micro_batch_tokens else {}))
    chunk = po.chunk_sizes(args)[0]
    policy, ref = causal_lm(config, True, checkpointing), causal_lm(config, False)
    critic = critic_model(config, checkpointing)
    learner = torch.nn.ModuleDict(dict(policy=policy, critic=critic))
    optimizer = adam(learner.parameters())
    downstream = dict(critic=critic, ref=ref)
    B, T = batch_size or args.batch_size, args.max_new_tokens
    buffer = [po.Rollout(str(i), i, None, [5] * prompt, 0, prefix={name: po.Prefix() for name in downstream})
              for i in range(B + args.delta)]
    for done in range(0, T + 1, chunk):  # the prompts, then each streamed chunk of every response
        for r in buffer:
            r.response = [7] * done
        for name, model in downstream.items():
            with with_autocast(autocast):
                po.prefill(name, model, buffer, args.temperature, args.micro_batch_size, top_p=args.top_p)
    if tracker is not None:
        tracker.mark("after prefill")
    batch = buffer[:B]
    values, ref_logp, old_logp = (torch.zeros((B, T)) for _ in range(3))
    for i, r in enumerate(batch):
        ref_logp[i] = po.scored(r, "ref", ref)
        values[i] = po.scored(r, "critic", critic)
        r.prefix.clear()  # as main(): the batch's caches are freed once read
    resp_mask = torch.ones((B, T))
    rewards = -args.kl_coef * (old_logp - ref_logp)
    advantages = po.gae(rewards, values, args.gamma, args.lam)
    returns = advantages + values
    advantages = po.whiten(advantages, resp_mask)
    per_token = dict(old_logp=old_logp, advantages=advantages, values=values, returns=returns, sampler_logp=old_logp,
                     fresh=resp_mask)
    from fastrl.vllm_sampler import Completion

    device = next(policy.parameters()).device
    samples = [Completion(r.request_id, r.prompt, r.response, [0.0] * T, "stop", [(0, 0, T)]) for r in batch]
    data = po.Batch.from_samples(samples, 0, device)
    data.add(samples, **per_token)
    lengths = [r.num_tokens for r in batch]
    learner.train()
    for step in range(steps):
        loss_fn = functools.partial(po.ppo_micro_batch, policy, critic, data, minibatch=list(range(B)), args=args,
                                    logprob_diff=step == 0)
        update(loss_fn, lengths, args.micro_batch_tokens, total=B * T, max_rows=args.micro_batch_size, model=learner,
               optimizer=optimizer, max_grad_norm=args.max_grad_norm)
    critic.eval()
    return dict(micro_batches=len(common.micro_batches(lengths, args.micro_batch_tokens,
                                                       max_rows=args.micro_batch_size)),
                rows=B, tokens=B * (prompt + T), carried=args.delta)


# --------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------

TARGETS_GB = dict(rloo=16.0, dpo=16.0, pipeline=16.0, ppo=28.0)
STEPS = dict(rloo=rloo_step, dpo=dpo_step, pipeline=pipeline_step, ppo=ppo_step)
SHAPES = dict(rloo="4 prompts x 2, 256 + 512 tokens, K steps", dpo="64 pairs (128 seq), 256 + 512 tokens",
              pipeline="B = 64, 256 + 1024 tokens, micro-batches of 16 seq",
              ppo="B = 112 (+8 carried), 256 + 1024 tokens")
VARIANTS = {"fp32": (False, False), "bf16 autocast": (True, False), "checkpointing": (False, True),
            "bf16 + checkpointing": (True, True)}


@dataclass
class Args:
    scripts: tuple[str, ...] = ("rloo", "dpo", "pipeline", "ppo")
    """which scripts' learner steps to measure"""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """fp32, 'bf16 autocast', checkpointing, 'bf16 + checkpointing'"""
    micro_batch_tokens: int | None = None
    """token budget for rloo/dpo/ppo (default: each script's own default)"""
    num_layers: int = 24
    """decoder layers (24: Qwen2.5-0.5B)"""
    device: str = "fake"
    """fake: fake tensors on this machine (no GPU needed); cuda: the same steps for real on the GPU, measured with
    torch.cuda.max_memory_allocated (a check of the fake measurement)"""


def main():
    import tyro

    args = tyro.cli(Args)
    config = qwen25_05b_config(args.num_layers)
    launch.limit_cpu_threads()
    start = time.time()
    rows = []
    for script in args.scripts:
        for variant in args.variants:
            bf16, checkpointing = VARIANTS[variant]
            kwargs = dict(autocast=bf16, checkpointing=checkpointing)
            if args.micro_batch_tokens and script != "pipeline":
                kwargs["micro_batch_tokens"] = args.micro_batch_tokens
            t0 = time.time()
            info = {}

            def step(tracker):
                info.update(STEPS[script](config, tracker=tracker, **kwargs))

            try:
                result = (measure(step, math_attention=not bf16) if args.device == "fake"
                          else measure_on_device(step, args.device))
            except torch.OutOfMemoryError:
                print(f"{script} {variant}: out of memory on {args.device}")
                rows.append((script, variant, float("inf"), TARGETS_GB[script], info, {}))
                continue
            peak = result["peak"] / GB
            rows.append((script, variant, peak, TARGETS_GB[script], info, result["marks"]))
            marks = " ".join(f"{k}: {v / GB:.2f} GB" for k, v in result["marks"].items())
            print(f"[{time.time() - start:6.1f}s] {script:8s} {variant:22s} peak {peak:6.2f} GB "
                  f"(target <= {TARGETS_GB[script]:.0f}) "
                  f"{info.get('micro_batches')} micro-batches of {info.get('rows')} seq, "
                  f"measured in {time.time() - t0:.1f}s {marks}",
                  flush=True)
    params = sum(p.numel() for p in causal_lm_params(config))
    how = ("fake tensors (no compute), each tensor rounded up to 512 bytes as CUDA's allocator does; its fragmentation "
           "and the CUDA context not included" if args.device == "fake"
           else f"real tensors on {args.device}, torch.cuda.max_memory_allocated")
    print(f"\nLearner peak tensor memory, one step at the paper's shapes, Qwen2.5-0.5B shapes "
          f"({params / 1e6:.0f}M parameters, "
          f"{args.num_layers} layers, vocabulary {config.vocab_size}); fp32 weights, gradients and Adam; {how}\n")
    print("| script | shapes | variant | peak (GB) | target (GB) | within |\n|---|---|---|---|---|---|")
    for script, variant, peak, target, info, _ in rows:
        print(f"| {script} | {SHAPES[script]} | {variant} | {peak:.2f} | <= {target:.0f} | "
              f"{'yes' if peak <= target else 'NO'} |")
    print(f"\nmeasured in {time.time() - start:.0f} s")


def causal_lm_params(config):
    with FakeTensorMode():
        return list(causal_lm(config, False).parameters())


if __name__ == "__main__":
    main()
