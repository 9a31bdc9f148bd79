"""The learner's step on SmolLM2-135M-Instruct (CPU, fp32 and bf16 autocast) against the machine's floors (issues 39,
50).

    .venv/bin/python benchmarks/learner.py                       # both shapes, one A B B A cycle
    .venv/bin/python benchmarks/learner.py --shapes 16x32 --baseline 6b68e63   # + the learner of a past commit
    .venv/bin/python benchmarks/learner.py --shapes 64x32 --other-budgets 8192  # + the step at the GPU's budget

One round's batch: `EPISODESxRESPONSE` episodes (default 64x32, the issue's RLOO round: 8 prompts x 8
samples, responses ~32 tokens; and 16x128, the long-response round), each prompt an arithmetic question in
the chat template with its system turn (~45 tokens), each response sampled from the model itself at T 0.8,
top-p 0.95 (cached in ~/.cache/fastrl/learner_bench), lengths varied around RESPONSE. The step is RLOO's
(rloo_kreuse.micro_batch_loss without its ratios): the scripts' update loop over micro-batches of
--micro-batch-tokens, common.token_logprobs under the sampler's processing with the entropy, a
policy-gradient loss with an entropy bonus, backward.

Arms, alternated (each arm once in order, then in reverse: A B C D D C B A) with the same torch threads for all, in
each of --precisions (fp32; bf16: under bf16 autocast, weights, gradients and Adam in fp32, as --autocast-bf16):
- learner_P: the step above (this checkout's common.py);
- floor_P: the bare model on the same micro-batches: model(...).logits, a plain log-softmax over every position,
  no top-p, no entropy, the same loss shape, backward (floor_bf16: the machine's bf16 floor);
- base (with --baseline COMMIT): the fp32 learner step with common.py as it was at COMMIT.
learner_vs_floor_P = median learner_P seconds / median floor_P seconds; learner_bf16_vs_fastest_floor
against the faster of the two floors. Also printed: the fp32 matmul throughput at
the model's shapes and the seconds the step's matmul FLOPs take at that throughput (floor_matmul_s); a breakdown
of one learner step (backbone forward, backward, the vocabulary part -- projection, top-p, log-softmax, entropy,
forward and backward -- and the padding's share of the backbone); and the peak memory of each arm (resident
memory above the step's start, sampled every 2 ms: activations, logits, gradients) beside
fastrl/memory_plan.py's formula for the same shapes."""

import dataclasses
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import tyro  # noqa: E402

import common  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from memory import update  # noqa: E402  (the scripts' update loop)
from fastrl import cpu_memory, memory_plan, util  # noqa: E402

CACHE = Path.home() / ".cache" / "fastrl" / "learner_bench"


@dataclasses.dataclass
class Args:
    shapes: tuple[str, ...] = ("64x32", "16x128")
    """EPISODESxRESPONSE_TOKENS: one round's batch"""
    cycles: int = 1
    """A B B A cycles per shape (each arm runs 2 x cycles timed steps, after one untimed warm-up step each)"""
    threads: int = 2
    """torch threads, the same for every arm"""
    temperature: float = 0.8
    top_p: float = 0.95
    micro_batch_tokens: int = 1024
    """--micro-batch-tokens (the --model smollm2 presets' on a CPU)"""
    precisions: tuple[str, ...] = ("fp32", "bf16")
    """fp32; bf16: the learner and the floor under bf16 autocast (weights, gradients, Adam in fp32)"""
    other_budgets: tuple[int, ...] = ()
    """more --micro-batch-tokens for the learner in the last of --precisions (arm learner_P_at_B), e.g. 8192"""
    ent_coef: float = 0.05
    """RLOO's entropy bonus (the entropy is used: with_entropy=True)"""
    baseline: str | None = None
    """a commit whose common.py runs as a third arm (the learner before a change), e.g. 6b68e63"""
    breakdown: bool = True
    """time one learner step by parts"""
    model: str = "smollm2"


# --------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------


def round_batch(model, tokenizer, episodes: int, response: int, temperature: float, top_p: float):
    """`episodes` chat-template arithmetic prompts with responses the model sampled (cached): padded rows."""
    CACHE.mkdir(parents=True, exist_ok=True)
    cached = CACHE / f"{episodes}x{response}_T{temperature}_p{top_p}.pt"
    if cached.exists():
        prompts, responses = torch.load(cached)
    else:
        rng = random.Random(0)
        prompts = []
        for _ in range(episodes):
            a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(10, 99)
            text = tokenizer.apply_chat_template([{"role": "user",
                                                   "content": f"What is {a} * {b} + {c}? Think step by step."}],
                                                 add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        lengths = [max(4, int(response * rng.uniform(0.6, 1.4))) for _ in range(episodes)]  # ~response tokens each
        torch.manual_seed(0)
        responses = []
        with torch.no_grad():
            for p, n in zip(prompts, lengths):
                out = model.generate(torch.tensor([p]), do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.eos_token_id)
                responses.append(out[0, len(p):].tolist())
        torch.save((prompts, responses), cached)
    ids, attn, cmask = common.pad_prompt_completions(prompts, responses, tokenizer.pad_token_id or 0)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    return ids, attn, cmask, lengths, prompts, responses


# --------------------------------------------------------------------------------------
# Peak memory (CPU: resident memory sampled in a thread)
# --------------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __enter__(self):
        self.start, self.peak, self.running = rss_bytes(), 0, True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.delta = self.peak - self.start


# --------------------------------------------------------------------------------------
# The arms
# --------------------------------------------------------------------------------------


def learner_step(lib, model, batch, args, bf16: bool = False):
    """One RLOO-shaped step through `lib` (common, or a past commit's): token_logprobs with the entropy (bf16: under
    autocast, as --autocast-bf16)."""
    ids, attn, cmask, lengths = batch[:4]
    advantages = torch.linspace(-1, 1, len(lengths))
    mask = cmask[:, 1:].float()

    def loss_fn(mb):
        rows = mb.items
        with common.autocast(ids.device, bf16):
            logp, entropy = lib.token_logprobs(model, ids[rows, :mb.width], attn[rows, :mb.width],
                                               cmask[rows, :mb.width], temperature=args.temperature, top_p=args.top_p,
                                               with_entropy=True)
        m = mask[rows, :logp.shape[1]]
        per_row = m.sum(1).clamp(min=1)
        pg = -(advantages[rows] * (logp * m).sum(1) / per_row).mean()
        ent = ((entropy * m).sum(1) / per_row).mean()
        return pg - args.ent_coef * ent, len(rows), {}

    return update(loss_fn, lengths, args.micro_batch_tokens)


def floor_step(model, batch, args, bf16: bool = False):
    """The bare model on the same micro-batches: all-position logits, plain log-softmax, no top-p, no entropy (bf16:
    the forward under autocast, the machine's bf16 floor)."""
    ids, attn, cmask, lengths = batch[:4]
    advantages = torch.linspace(-1, 1, len(lengths))
    mask = cmask[:, 1:].float()

    def loss_fn(mb):
        rows = mb.items
        x = ids[rows, :mb.width]
        with common.autocast(ids.device, bf16):
            logits = model(input_ids=x, attention_mask=attn[rows, :mb.width]).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        m = mask[rows, :logp.shape[1]]
        return -(advantages[rows] * (logp * m).sum(1) / m.sum(1).clamp(min=1)).mean(), len(rows), {}

    return update(loss_fn, lengths, args.micro_batch_tokens)


class HeadOnly(torch.nn.Module):
    """The model as token_logprobs reads it, its decoder replaced by a given last hidden state: the vocabulary
    part alone (projection, top-p, log-softmax, entropy), forward and backward into that hidden state."""

    def __init__(self, model, hidden):
        super().__init__()
        self.config, self.model, self.hidden = model.config, model, hidden

    def get_decoder(self):
        return lambda **_: types.SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


def breakdown(model, batch, args) -> dict:
    """One learner step by parts, micro-batch by micro-batch as the scripts cut it (common.micro_batches)."""
    ids, attn, cmask, lengths = batch[:4]
    mask = cmask[:, 1:].float()
    parts = dict(backbone_forward=0.0, vocab=0.0, backbone_backward=0.0, padding=0.0)
    decoder = model.get_decoder()
    model.zero_grad(set_to_none=True)
    for rows in common.micro_batches(lengths, args.micro_batch_tokens):
        width = max(lengths[i] for i in rows)
        x, a, c = ids[rows, :width], attn[rows, :width], cmask[rows, :width]
        t0 = time.perf_counter()
        hidden = decoder(input_ids=x, attention_mask=a).last_hidden_state
        t1 = time.perf_counter()
        h = hidden.detach().requires_grad_()
        logp, entropy = common.token_logprobs(HeadOnly(model, h), x, a, c, temperature=args.temperature,
                                              top_p=args.top_p, with_entropy=True)
        m = mask[rows, :logp.shape[1]]
        ((logp * m).sum() / m.sum() + args.ent_coef * (entropy * m).sum() / m.sum()).backward()
        t2 = time.perf_counter()
        hidden.backward(h.grad)
        t3 = time.perf_counter()
        parts["backbone_forward"] += t1 - t0
        parts["vocab"] += t2 - t1
        parts["backbone_backward"] += t3 - t2
        real = sum(lengths[i] for i in rows)
        parts["padding"] += (t1 - t0 + t3 - t2) * (1 - real / (len(rows) * width))  # the backbone's share on pad tokens
    model.zero_grad(set_to_none=True)
    return parts


def load_baseline(commit: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:common.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"common_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"common_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------
# The machine's floor: fp32 matmul throughput at the model's shapes
# --------------------------------------------------------------------------------------


def matmul_floor(model, batch, repeats: int = 3) -> tuple[dict, float, float]:
    """GFLOP/s of the model's fp32 matmuls at this batch's padded token count, and the seconds the bare step's
    matmul FLOPs (forward + backward = 3x forward, every position through the head) take at those rates."""
    cfg = model.config
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    lengths = batch[3]
    tokens = sum(len(rows) * max(lengths[j] for j in rows) for rows in common.micro_batches(lengths, 8192))
    shapes = {"q/o": (h, h, 2), "k/v": (h, kv, 2), "mlp": (h, i, 3), "head": (h, v, 1 / cfg.num_hidden_layers)}
    rates, seconds, flops_total = {}, 0.0, 0.0
    n = min(tokens, 2048)
    for name, (k, out, per_layer) in shapes.items():
        x, w = torch.randn(n, k), torch.randn(out, k)
        x @ w.T
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x @ w.T
            best = min(best, time.perf_counter() - t)
        rates[name] = 2 * n * k * out / best / 1e9
        flops = 3 * 2 * tokens * k * out * per_layer * cfg.num_hidden_layers
        flops_total += flops
        seconds += flops / (rates[name] * 1e9)
    return rates, seconds, flops_total


# --------------------------------------------------------------------------------------


def plan_bytes(model, batch, args) -> tuple[int, int]:
    """memory_plan.learner_bytes for this batch (RLOO, no reference): whole, and less the models (weights, Adam)."""
    s = memory_plan.shape_of(model.config)
    lengths = batch[3]
    mbs = common.micro_batches(lengths, args.micro_batch_tokens)
    rows = max(len(r) for r in mbs)
    seq = max(lengths)
    step = memory_plan.Step(rows, seq, (s.params,), micro_batches=len(mbs), top_p=args.top_p,
                            completion_len=max(len(r) for r in batch[5]))
    whole = memory_plan.learner_bytes(s, step)
    return whole, whole - 3 * s.params * 4


def main():
    args = tyro.cli(Args)
    cpu_memory.release_freed_memory(glibc=False)  # as the scripts' learner (Run) on a machine with room for malloc
    torch.set_num_threads(args.threads)
    print(f"command: {' '.join([sys.executable.split('/')[-1], *sys.argv])}")
    print(f"machine: {util.machine_line()}; {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    from transformers import AutoTokenizer

    path = common.resolve_model(args.model)
    model = common.load_policy(path, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = load_baseline(args.baseline) if args.baseline else None
    arms = {}
    for p in args.precisions:
        arms[f"learner_{p}"] = lambda b, bf16=p == "bf16": learner_step(common, model, b, args, bf16)
        arms[f"floor_{p}"] = lambda b, bf16=p == "bf16": floor_step(model, b, args, bf16)
    for budget in args.other_budgets:
        p = args.precisions[-1]
        arms[f"learner_{p}_at_{budget}"] = lambda b, bf16=p == "bf16", budget=budget: learner_step(
            common, model, b, dataclasses.replace(args, micro_batch_tokens=budget), bf16)
    if base is not None:
        arms["base"] = lambda b: learner_step(base, model, b, args)
    order = list(arms) + list(arms)[::-1]
    for shape in args.shapes:
        episodes, response = (int(x) for x in shape.split("x"))
        batch = round_batch(model, tokenizer, episodes, response, args.temperature, args.top_p)
        ids, _, cmask, lengths, prompts, responses = batch
        mbs = common.micro_batches(lengths, args.micro_batch_tokens)
        padded = sum(len(r) * max(lengths[i] for i in r) for r in mbs)
        print(f"\n== {shape}: {episodes} episodes, prompts {statistics.mean(map(len, prompts)):.1f} tokens, responses "
              f"{statistics.mean(map(len, responses)):.1f} tokens, {sum(lengths)} tokens ({padded} padded, "
              f"{len(mbs)} micro-batches of <= {args.micro_batch_tokens})")
        times = {name: [] for name in arms}
        peaks = {name: 0 for name in arms}
        for name in arms:  # warm-up, untimed
            model.zero_grad(set_to_none=True)
            arms[name](batch)
        for _ in range(args.cycles):
            for name in order:
                model.zero_grad(set_to_none=True)
                with PeakRSS() as peak:
                    t = time.perf_counter()
                    arms[name](batch)
                    times[name].append(time.perf_counter() - t)
                peaks[name] = max(peaks[name], peak.delta)
                print(f"  {name}: {times[name][-1]:.2f} s, peak +{peak.delta / 2**20:.0f} MiB", flush=True)
        med = {name: statistics.median(v) for name, v in times.items()}
        rates, matmul_s, flops = matmul_floor(model, batch)
        print("  matmul GFLOP/s at the model's shapes: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
        print(f"  floor_matmul_s={matmul_s:.2f} ({flops / 1e12:.2f} TFLOP of the bare step's matmuls at those rates)")
        for name in arms:
            print(f"  {name}_s={med[name]:.2f} (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
        if base is not None:
            print(f"  base_vs_floor={med['base'] / med['floor_fp32']:.2f}  "
                  f"learner_vs_base={med['learner_fp32'] / med['base']:.2f}")
        for p in args.precisions:
            print(f"  learner_vs_floor_{p}={med[f'learner_{p}'] / med[f'floor_{p}']:.2f}  "
                  f"floor_{p}_vs_matmul={med[f'floor_{p}'] / matmul_s:.2f}")
        for budget in args.other_budgets:
            p = args.precisions[-1]
            print(f"  learner_{p}_at_{budget}_vs_{args.micro_batch_tokens}="
                  f"{med[f'learner_{p}_at_{budget}'] / med[f'learner_{p}']:.2f}")
        if len(args.precisions) == 2:
            fastest = min(med["floor_fp32"], med["floor_bf16"])
            print(f"  bf16_speedup: learner {med['learner_fp32'] / med['learner_bf16']:.2f}x, floor "
                  f"{med['floor_fp32'] / med['floor_bf16']:.2f}x; learner_bf16_vs_fastest_floor="
                  f"{med['learner_bf16'] / fastest:.2f}")
        if args.breakdown:
            parts = breakdown(model, batch, args)
            total = sum(v for k, v in parts.items() if k != "padding")
            print("  learner step by parts: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
                  + f" (sum {total:.2f} s; padding is the backbone's share on pad tokens, "
                    "inside its forward and backward)")
        whole, step_part = plan_bytes(model, batch, args)
        print("  peak memory above the step's start: "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in peaks.items())
              + f"; memory plan: learner {whole / 2**20:.0f} MiB, of which the step (gradients, activations, logits) "
              f"{step_part / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
