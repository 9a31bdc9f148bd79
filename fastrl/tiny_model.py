"""The built-in tiny model (`--model tiny`): a 0.8M-parameter Qwen2 with tied embeddings, like
Qwen2.5-0.5B, and a character tokenizer, briefly supervised on the offline Countdown generator so
that it starts with some success and RL has room to improve it (with `--task countdown-steps`, a
second one supervised on that task's step-by-step answers). Built on first use, cached in
util.CACHE_DIR, the same for a given seed everywhere. `cached_build` is the cache's rule (also
used by the tests' realistic fixture)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fastrl import util


TINY_SPECIAL = ["<pad>", "<eos>", "<unk>"]
TINY_ADDED = ["<answer>", "</answer>"]


@dataclass(frozen=True)
class TinyConfig:
    """The built-in model: a small Qwen2 (tied embeddings, like Qwen2.5-0.5B) with a character
    tokenizer, briefly supervised on the offline Countdown generator."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 128
    sft_steps: int = 450
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    task: str = "countdown"
    """what it is supervised on: `countdown`, or `countdown-steps` (answers worked step by step)"""
    tokenizer: str = "byte-level"
    """the tokenizer's spelling (part of the cache key: models built with the earlier one lost spaces on load)"""

    def key(self) -> str:
        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def _tiny_tokenizer():
    """One token per character, spelled the byte-level way Qwen2's tokenizer spells bytes (space
    "Ġ", newline "Ċ"): transformers loads a saved Qwen2 model's tokenizer as `Qwen2Tokenizer`, which
    rebuilds the byte-level pipeline around the saved vocabulary, so a vocabulary with a plain " "
    lost every space after a save and load (the model was supervised on "5 7 3->15:" and prompted
    with "573->15:"). build_tiny_model trains with the tokenizer as it loads, to stay honest."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL)}
    byte_level = ByteLevel.alphabet()
    for c in "\n" + "".join(chr(i) for i in range(32, 127)):
        spelled = {" ": "\u0120", "\n": "\u010a"}.get(c, c)  # (printable ASCII is its own byte-level spelling)
        assert spelled in byte_level
        vocab[spelled] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in TINY_SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def build_tiny_model(out_dir: str | Path, config: TinyConfig, sft_batch, log=print) -> Path:
    """Build, briefly fine-tune and save the tiny model as a normal HF directory. `sft_batch(tokenizer,
    step, batch_size)` -> (input_ids, attention_mask, completion_mask) of worked examples of
    config.task (common.resolve_model gives it: this package does not import tasks.py). Deterministic
    for a given config on a given machine (one CPU thread, fixed seeds)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        util.set_seed(config.seed)
        tokenizer = _tiny_tokenizer()
        model_config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
        )
        # train with the tokenizer exactly as the scripts will load it (next to a Qwen2 config, which picks its class)
        with tempfile.TemporaryDirectory() as saved:
            tokenizer.save_pretrained(saved)
            model_config.save_pretrained(saved)
            tokenizer = util.load_tokenizer(saved)
        model = Qwen2ForCausalLM(model_config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.sft_lr,
                                                       total_steps=config.sft_steps, pct_start=0.1)
        # (off a terminal: the log lines)
        progress = util.Progress(config.sft_steps, "tiny model", unit="step", every=float("inf"))
        for step in range(config.sft_steps):
            input_ids, attention_mask, completion_mask = sft_batch(tokenizer, step, config.sft_batch_size)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            labels = input_ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.update(1, loss=loss.item())
            if step % 50 == 0 or step == config.sft_steps - 1:
                log(f"[tiny model] sft step {step + 1}/{config.sft_steps} loss {loss.item():.3f} ({progress.timing()})")
        progress.close()
        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "tiny_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))

        util.replace_atomically(write, out_dir)  # a half-built model is never picked up from the cache
    finally:
        torch.set_num_threads(threads)
    return out_dir


def tiny_model_path(config: TinyConfig, sft_batch, log=print) -> Path:
    """The cached tiny model, built on first use (about 2 minutes on 2 cores; the step-by-step one
    longer); `sft_batch` as in build_tiny_model (common.resolve_model passes it)."""
    return cached_build(util.CACHE_DIR / f"tiny-qwen2-{config.key()}",
                        lambda path: build_tiny_model(path, config, sft_batch, log=log),
                        lambda: log(f"building the tiny model into {util.CACHE_DIR} (once; cached afterwards)"))


def cached_build(path: Path, build, announce=lambda: None) -> Path:
    """Build a model directory into the cache once: under a file lock, so that runs started
    together build it once (the others wait, then find it); the build writes a temporary
    directory and renames it, so a half-built model is never picked up."""
    import fcntl

    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            announce()
            build(path)
    return path
