"""A realistic test model, built offline: the path users run, at a size CPU tests can afford.

What it shares with Qwen/Qwen2.5-0.5B (and what the tiny model does not have): the Qwen2
architecture with tied embeddings and head_dim 64 (vLLM's CPU attention rejects 16), a
byte-level BPE tokenizer trained here with `tokenizers`, special tokens `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, **pad == eos** (`<|endoftext|>`), a ChatML chat template, and
weights saved in **bf16**. It is briefly supervised on the chat-format Countdown prompts so that
it answers sometimes and ends some completions with EOS (so pad == eos really occurs inside the
data), and its initial logits are spread out so that top-p 0.95 really cuts the vocabulary.

    path = realistic_model_path()   # built once (~30 s on 2 cores), cached like the tiny model
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import common
from fastrl import util
import tasks
from fastrl import tiny_model

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5's template, shortened: ChatML turns, a generation prompt for the assistant
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class RealisticConfig:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2  # head_dim 64
    num_kv_heads: int = 1
    max_position_embeddings: int = 1024
    initializer_range: float = 0.1  # spread-out logits at the start: top-p 0.95 drops real mass
    sft_steps: int = 40
    sft_batch_size: int = 16
    sft_lr: float = 3e-3

    def key(self) -> str:
        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def _corpus(task, count: int) -> list[str]:
    texts = []
    for i in range(count):
        p = task.problem("train", i)
        texts.append(p.prompt + task.completion_text(p))
        texts.append(f"Question: what is {p.answer}?\nAnswer: {p.answer} = {p.target}\n#### {p.target}")
    return texts


def build_tokenizer(config: RealisticConfig, task):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(_corpus(task, 2000), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
                                        additional_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_realistic_model(out_dir: str | Path, config: RealisticConfig = RealisticConfig(), log=print) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        util.set_seed(config.seed)
        task = tasks.make_task("countdown", seed=config.seed, tiny_prompts=False)
        tokenizer = build_tokenizer(config, task)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                                             num_key_value_heads=config.num_kv_heads,
            max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True, rope_theta=10000.0,
            initializer_range=config.initializer_range, bos_token_id=tokenizer.eos_token_id,
                                             eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
        start = time.time()
        for step in range(config.sft_steps):
            problems = [task.problem("train", 10_000 + step * config.sft_batch_size + i)
                        for i in range(config.sft_batch_size)]
            prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
            completions = [tokenizer(task.completion_text(p))["input_ids"] + [tokenizer.eos_token_id] for p in problems]
            ids, attn, cmask = common.pad_prompt_completions(prompts, completions, tokenizer.pad_token_id)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            labels = ids[:, 1:].masked_fill(cmask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        log(f"[realistic model] {config.sft_steps} sft steps, loss {loss.item():.3f} ({time.time() - start:.0f}s)")
        def write(tmp: Path) -> None:
            model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)  # a bf16 checkpoint, as on the Hub
            tokenizer.save_pretrained(tmp)

        util.replace_atomically(write, out_dir)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def realistic_model_path(config: RealisticConfig = RealisticConfig(), log=print) -> Path:
    return tiny_model.cached_build(util.CACHE_DIR / f"realistic-qwen2-{config.key()}",
                               lambda path: build_realistic_model(path, config, log=log))
