"""Shared fixtures. Tests are laid out like the code: one file per module or script
(test_common, test_tasks, test_vllm_sampler, test_tiny_model, test_<script>), plus test_faults
(reliability), test_gpu_path and test_memory.

Markers: `gpu` needs CUDA. `slow` is written on every test that starts a sampler, a server, a
subprocess or a script's run (`pytest -m "not slow"` runs the unit tests alone: 33-44 s with `-n 2`).
The rule cannot be missed: a test without the marker that starts a sampler process or a subprocess,
or uses a fixture that does (SLOW_FIXTURES), fails and says to mark it."""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest keeps the test modules it rewrites (and Python the project's modules compiled) only where bytecode may be
# written: where PYTHONDONTWRITEBYTECODE is set (this machine, its CI) every run rewrote and compiled them anew, ~8 s
sys.dont_write_bytecode = False

SCRATCH_DIRS: list[Path] = []


def scratch_dir(prefix: str) -> Path:
    """A directory for a test module's script runs (never the repository's runs/), removed when the test session
    ends (pytest_sessionfinish below): a run leaves checkpoints behind, and SmolLM2's are gigabytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    SCRATCH_DIRS.append(path)
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # (a backstop: a session that never reaches its end)
    return path


@pytest.hookimpl(trylast=True)  # after pytest's own: module fixtures (a server writing its log there) torn down first
def pytest_sessionfinish(session, exitstatus):
    """Remove the scratch directories as the session ends (in each xdist worker), not only at exit: with atexit
    alone, full runs of the suite left their scratch directories behind (40 GB in /tmp after a few), and a CI run
    found the disk full."""
    while SCRATCH_DIRS:
        shutil.rmtree(SCRATCH_DIRS.pop(), ignore_errors=True)


# fixtures that start a sampler, a server or a script's run, shared by several tests
SLOW_FIXTURES = {"sampler", "server_url", "sync_run", "zero_lag_pipeline", "plain_ppo", "sampler_start_kwargs"}
# a module's one run or server, read by several tests: they share an xdist_group, so that under the suite's
# `-n 2 --dist loadgroup` one worker makes it once (without the group, each worker that runs one of them makes its own)
SHARED_RUNS = {"sync_run", "zero_lag_pipeline", "plain_ppo", "server", "runs"}
# the longest tests (1-4 minutes each on 2 cores), started first so that none of them runs alone at the suite's end;
# the overlap test builds countdown-steps' tiny model where none is cached, as in a fresh CI (404 s at cec3c8b)
LONGEST_FIRST = ("test_rloo_kreuse.py::test_overlap_mode_runs_one_round_off_policy",
                 "test_rloo_kreuse.py::test_two_rounds_from_the_command_line_then_resume",
                 "test_rloo_kreuse.py::test_two_torchrun_ranks_train_as_one_process_and_resume",
                 "test_cpu_memory.py::test_one_learner_step_at_the_smollm2_presets_shape_peaks_under_the_goal",
                 "test_reinforce.py::test_two_rounds_on_the_tiny_model_then_a_resume")


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's tests first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))


@pytest.fixture(autouse=True)
def _slow_tests_are_marked(request, monkeypatch):
    """Fail a test that starts a sampler process or a Python subprocess (a script, a server, torchrun)
    without the `slow` marker."""
    if request.node.get_closest_marker("slow") is not None:
        shared = sorted(SHARED_RUNS & set(request.fixturenames))
        if shared and request.node.get_closest_marker("xdist_group") is None:
            pytest.fail(f"uses {', '.join(shared)} (one run for several tests): mark it @pytest.mark.xdist_group, "
                        "as the others that use it", pytrace=False)
        yield
        return
    fixtures = sorted(SLOW_FIXTURES & set(request.fixturenames))
    if fixtures:
        pytest.fail(f"uses {', '.join(fixtures)} (a sampler or a run): mark it @pytest.mark.slow", pytrace=False)
    started = []

    def refuse_sampler(*args, **kwargs):
        started.append("a sampler process")
        raise RuntimeError("a sampler process in a test not marked slow: mark it @pytest.mark.slow")

    class GuardedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            program = os.path.basename(command.split()[0]) if command.split() else ""
            # a script, a server, torchrun
            if program.startswith(("python", "torchrun", "bash")) or command.startswith(sys.executable):
                started.append(f"a subprocess ({command[:60]})")
                raise RuntimeError("a Python subprocess in a test not marked slow: mark it @pytest.mark.slow")
            super().__init__(args, *rest, **kwargs)  # (libraries probe the system with small commands)

    from fastrl import vllm_sampler

    monkeypatch.setattr(vllm_sampler.Sampler, "start", refuse_sampler)
    monkeypatch.setattr(subprocess, "Popen", GuardedPopen)
    yield
    if started:
        pytest.fail(f"started {started[0]} without the slow marker: mark it @pytest.mark.slow", pytrace=False)


@pytest.fixture(scope="session")
def tiny_path():
    import common

    return str(common.tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from fastrl import util

    return util.load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def _session_sampler(tiny_path):
    from fastrl import launch

    s = launch.start_sampler(tiny_path, placement="cpu", seed=0)
    yield s
    s.close()


@pytest.fixture
def sampler(_session_sampler, tiny_path):
    """One real vLLM sampler process on the tiny model for the whole session, holding the tiny model's
    own weights at the start of every test: a test that pushed other weights has them replaced after
    it (which tests share a worker changes with the suite, so no test may depend on another's order)."""
    import common

    version = _session_sampler.version
    yield _session_sampler
    if _session_sampler.version != version:
        _session_sampler.init_weight_sync(common.load_policy(tiny_path, "cpu"))
        _session_sampler.push_weights(_session_sampler.version + 1)


@pytest.fixture(scope="session")
def realistic_path():
    """The realistic fixture (tests/realistic_model.py): Qwen2, byte-level BPE, pad == eos,
    ChatML template, bf16 weights. The path users run, built offline."""
    from realistic_model import realistic_model_path

    return str(realistic_model_path())


@pytest.fixture
def error_before_start(monkeypatch):
    """`error_before_start(script_module, *flags)`: run the script's main() in this process with those
    flags and return the one-line SystemExit message it stops with; fails if it gets as far as
    loading a model or starting a sampler. (A command line costs ~4 s of imports each; every
    script also has one test of the real command line.)"""
    import common
    from fastrl import launch

    def never(*args, **kwargs):
        raise AssertionError("got past the argument checks")

    monkeypatch.setattr(launch, "start_sampler", never)
    monkeypatch.setattr(common, "load_policy", never)

    def run(script, *flags) -> str:
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *flags])
        with pytest.raises(SystemExit) as exit_info:
            script.main()
        message = str(exit_info.value.code)
        assert "\n" not in message, message
        return message

    return run


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_path, tmp_path_factory):
    """A sequence-classification model on the tiny architecture with a random score head, saved
    with the policy's tokenizer: a reward model the script can load."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from fastrl import util

    torch.manual_seed(3)
    model = util.load_hf(AutoModelForSequenceClassification, tiny_path, quiet=True, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(path)
    util.load_tokenizer(tiny_path).save_pretrained(path)
    return str(path)


@pytest.fixture
def sampler_start_kwargs(monkeypatch, tmp_path):
    """`sampler_start_kwargs(script_module, *flags)`: run the script's main() in this process with those flags
    (in a temporary directory) up to the sampler's start, and return the keyword arguments it passed to
    vllm_sampler.start_sampler; nothing is sampled."""
    import sys

    from fastrl import launch, runlog
    from fastrl import vllm_sampler

    class Started(Exception):
        pass

    seen, loggers, logger_init = {}, [], runlog.RunLogger.__init__

    def start_sampler(*args, **kwargs):
        seen.update(kwargs)
        raise Started

    def keep_logger(self, *args, **kwargs):
        logger_init(self, *args, **kwargs)
        loggers.append(self)

    monkeypatch.setattr(launch, "start_sampler", start_sampler)
    # (this process's filters stay as pytest set them)
    monkeypatch.setattr(vllm_sampler, "quiet_libraries", lambda verbose: None)
    monkeypatch.setattr(runlog.RunLogger, "__init__", keep_logger)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the run's logger tees stdout: undone after the test
    monkeypatch.chdir(tmp_path)

    def run(module, *flags) -> dict:
        seen.clear()
        monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *flags])
        with pytest.raises(Started):
            module.main()
        return dict(seen)

    yield run
    for logger in loggers:  # its TensorBoard writer's thread, before the working directory changes back
        logger.close()


def strip_to_method(source: str, replacements: list[tuple[str, str]], metrics: str) -> str:
    """A script as a student strips it to its method (issue 48): each (old, new) replaced (a strip that no longer
    applies fails), and the round's metrics dict literal replaced by `metrics` (one line: a reward and the seconds)."""
    for old, new in replacements:
        assert old in source, f"the strip no longer applies: {old.strip()[:60]}"
        source = source.replace(old, new)
    start = source.index("            metrics = {\n")
    end = source.index("            }\n", start) + len("            }\n")
    return source[:start] + f"            metrics = {metrics}\n" + source[end:]


def without_after_round(source: str) -> str:
    """The script without its after-round lines (snapshot, --eval-every, checkpoint: from its `# ---- after the` comment
    to the end of the loop), as a student strips them; a script without them fails."""
    lines = source.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# ---- after the"))
    indent = len(lines[at]) - len(lines[at].lstrip())
    end = next(i for i in range(at + 1, len(lines))
               if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) < indent)
    return "".join(lines[:at] + lines[end:])


# each script's batch flag and the name a student's copy gives it, and the script's memory_plan workload (issue 60)
BATCH_RENAMES = {"rloo_kreuse": ("num_prompts", "prompts_per_batch", "GROUPS"),
                 "online_dpo_async": ("num_prompts", "prompts_per_batch", "PAIRS"),
                 "pipeline_rl": ("train_batch_size", "sequences_per_step", "STREAM"),
                 "ppo_oppo": ("batch_size", "sequences_per_round", "ACTOR_CRITIC")}


def rename_batch_flag(source: str, script: str, flags: list[str]) -> tuple[str, list[str]]:
    """Issue 60: the memory plan knew each script by name (`Run(args, "rloo", ...)`, its NEEDED and BATCH_FLAG
    tables), so a copy that renamed its batch flag broke in a file its author never opened. The copy renames the flag
    everywhere in its own file and names it in its workload (memory_plan.Workload); returns it and `flags` renamed."""
    old, new, workload = BATCH_RENAMES[script]
    source = re.sub(rf"\b{old}\b", new, source)
    assert f"memory_plan.{workload}," in source
    source = source.replace(f"memory_plan.{workload},",
                            f"__import__('dataclasses').replace(memory_plan.{workload}, batch={new!r}),")
    flag = {"--" + old.replace("_", "-"): "--" + new.replace("_", "-")}
    return source, [flag.get(f, f) for f in flags]


def run_stripped_copy(name: str, source: str, flags: list[str], script: str):
    """Write the copy of `script` stripped to its method, its batch flag renamed as well (rename_batch_flag: a
    student's copy changes both), to a scratch directory and run it (importing common, tasks and fastrl from the
    checkout); it must finish, write its summary, leave no checkpoint and no traceback or leaked process. Returns
    the finished process (its stdout has the rounds' lines)."""
    source, flags = rename_batch_flag(source, script, flags)
    work = scratch_dir(f"pytest_{name}_")
    copy = work / f"{name}.py"
    copy.write_text(source)
    out = subprocess.run([sys.executable, str(copy), "--exp-name", f"pytest_{name}", *flags], cwd=work,
                         capture_output=True, text=True, timeout=600,
                         env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run_dir = next((work / "runs").glob(f"pytest_{name}__*"))
    assert (run_dir / "summary.md").is_file() and not (run_dir / "checkpoint.pt").exists()
    assert "Traceback" not in out.stderr and "leaked" not in out.stderr
    return out


def _workloads():
    from fastrl import memory_plan

    return {"rloo": memory_plan.GROUPS, "dpo": memory_plan.PAIRS, "pipeline": memory_plan.STREAM,
            "ppo": memory_plan.ACTOR_CRITIC}


WORKLOADS = _workloads()  # each script's memory_plan.Workload, by the tests' short names for the scripts
