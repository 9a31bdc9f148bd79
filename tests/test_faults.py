"""Bad input and faults: one clear line, no hang, nothing lost, nobody let in.

Each test here backs one reliability promise of docs/reliability.md."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

import common
from fastrl import launch, runlog
import rloo_kreuse as rloo
import tasks
from fastrl import vllm_sampler
from conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[1]
WORK = scratch_dir("fastrl-test-runs-")  # scripts run here


@dataclass
class _Args:
    lr: float = 1e-3
    resume: str | None = None


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path):
    first = runlog.RunLogger("same__1__1700000000", _Args(lr=1.0), root=str(tmp_path))
    second = runlog.RunLogger("same__1__1700000000", _Args(lr=2.0), root=str(tmp_path))
    first.log(1, {"charts/reward": 1.0}, echo=False)
    second.log(1, {"charts/reward": 2.0}, echo=False)
    second.close()
    first.close()
    assert first.dir != second.dir and second.dir.name == "same__1__1700000000-1"
    assert [r["charts/reward"] for r in runlog.read_metrics(first.dir)] == [1.0]
    assert [r["charts/reward"] for r in runlog.read_metrics(second.dir)] == [2.0]
    assert ('"lr": 1.0' in (first.dir / "args.json").read_text()
            and '"lr": 2.0' in (second.dir / "args.json").read_text())


def _tiny_checkpoint(path):
    model = torch.nn.Linear(3, 2)
    runlog.save_checkpoint(path, model, torch.optim.Adam(model.parameters()), 3, 7, totals={"wall": 1.0})
    return model


def test_checkpoint_round_trip_restores_rng_and_plain_data(tmp_path):
    import random

    import numpy as np

    model = _tiny_checkpoint(tmp_path / "checkpoint.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    state = runlog.load_checkpoint(tmp_path, model, torch.optim.Adam(model.parameters()), required=("totals",))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert (state["step"], state["data_position"], state["totals"]) == (3, 7, {"wall": 1.0})
    assert not list(tmp_path.glob("*.tmp*"))  # no temporary left behind


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _tiny_checkpoint(tmp_path / "checkpoint.pt")
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def full(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit, match="No space left on device.*previous copy"):
        _tiny_checkpoint(tmp_path / "checkpoint.pt")
    assert (tmp_path / "checkpoint.pt").read_bytes() == before and not list(tmp_path.glob("*.tmp*"))


def _run(script, *flags, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / script), *flags], cwd=WORK, capture_output=True, text=True,
                          timeout=timeout)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


# one on the command line (its stderr is the one line); the others through main() in this process, as far as the check
@pytest.mark.parametrize("kind", ["missing", "empty", pytest.param("truncated", marks=pytest.mark.slow), "foreign",
                                  "code"])
def test_bad_resume_is_one_line_and_creates_nothing(tmp_path, kind, error_before_start, monkeypatch):
    target = tmp_path / "run" / "checkpoint.pt"
    target.parent.mkdir()
    _Evil.marker = tmp_path / "pwned"
    if kind == "empty":
        target.write_bytes(b"")
    elif kind == "truncated":
        _tiny_checkpoint(target)
        target.write_bytes(target.read_bytes()[:200])
    elif kind == "foreign":
        torch.save({"weights": torch.zeros(2)}, target)
    elif kind == "code":
        torch.save({"model": _Evil(), "optimizer": {}, "step": 0, "data_position": 0, "rng": {}}, target)
    resume = str(tmp_path / "nowhere") if kind == "missing" else str(target)
    runs_before = set(os.listdir(WORK / "runs")) if (WORK / "runs").exists() else set()
    if kind == "truncated":
        out = _run("rloo_kreuse.py", "--resume", resume)
        assert out.returncode != 0 and out.stderr.strip().startswith("error: --resume:"), out.stderr[-2000:]
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    else:
        monkeypatch.chdir(WORK)  # (where the command line runs: no runs/ made there either)
        assert error_before_start(rloo, "--resume", resume).startswith("error: --resume:")
    assert not _Evil.marker.exists()  # weights_only: the pickled shell command never ran
    runs_after = set(os.listdir(WORK / "runs")) if (WORK / "runs").exists() else set()
    assert runs_after == runs_before  # no runs/<that path> made before failing


@pytest.mark.slow
def test_weight_sync_listens_on_loopback_only(tiny_path, monkeypatch):
    """The rendezvous store and the gloo pairs are bound to 127.0.0.1 for a local sampler, on a
    port the learner bound itself (no bind-close-reuse race). (The local default is shared memory,
    which listens nowhere: gloo is chosen here.)"""
    monkeypatch.setenv("FASTRL_CPU_WEIGHT_BACKEND", "gloo")  # the sampler process inherits it
    model = common.load_policy(tiny_path, "cpu")
    with launch.start_sampler(tiny_path, placement="cpu", seed=0) as sampler:
        sampler.init_weight_sync(model)
        pids = [os.getpid(), sampler.process.pid]
        listening = [c for pid in pids for c in psutil.Process(pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening), listening
        sampler.push_weights(1)  # and the group works


def _prompts(tokenizer, count):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    return [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(count)]


def _stopped_sampler_is_an_error_in_seconds(sampler, action):
    os.kill(sampler.process.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(vllm_sampler.SamplerError, match="has not answered"):
            action()
        assert time.monotonic() - start < sampler.config.silence_timeout + 15
    finally:
        os.kill(sampler.process.pid, signal.SIGCONT)
        sampler.close()


@pytest.mark.slow
def test_stopped_sampler_during_generation(tiny_path, tokenizer):
    sampler = launch.start_sampler(tiny_path, placement="cpu", silence_timeout=5)
    prompts = _prompts(tokenizer, 64)
    ids = sampler.submit(prompts, n=4, temperature=1.0, max_tokens=64, ignore_eos=True)
    time.sleep(0.3)
    _stopped_sampler_is_an_error_in_seconds(sampler, lambda: sampler.wait_for(ids))


@pytest.mark.slow
def test_stopped_sampler_during_a_push(tiny_path):
    model = common.load_policy(tiny_path, "cpu")
    sampler = launch.start_sampler(tiny_path, placement="cpu", silence_timeout=5)
    sampler.init_weight_sync(model)
    _stopped_sampler_is_an_error_in_seconds(sampler, lambda: sampler.push_weights(1))


@pytest.mark.slow
def test_stopped_sampler_while_its_engine_is_built(tiny_path):
    sampler = vllm_sampler.Sampler(vllm_sampler.SamplerConfig(model=tiny_path, placement="cpu", silence_timeout=5))
    real_wait = sampler._wait

    def stop_then_wait(done, timeout, what):  # stop it right after spawning, while it imports and builds vLLM
        time.sleep(1.5)
        os.kill(sampler.process.pid, signal.SIGSTOP)
        return real_wait(done, timeout, what)

    sampler._wait = stop_then_wait
    start = time.monotonic()
    try:
        with pytest.raises(vllm_sampler.SamplerError, match="has not answered"):
            sampler.start()
        assert time.monotonic() - start < 30
    finally:
        os.kill(sampler.process.pid, signal.SIGCONT)
        sampler.close()


@pytest.mark.slow
def test_learner_killed_while_the_engine_is_built_takes_the_sampler_down(tiny_path):
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        import common
        from fastrl import launch, runlog, util
        import tasks
        from fastrl import vllm_sampler
        if __name__ == "__main__":
            s = vllm_sampler.Sampler(vllm_sampler.SamplerConfig(model={tiny_path!r}, placement="cpu"))
            threading.Thread(target=s.start, daemon=True).start()
            while s.process is None:
                time.sleep(0.05)
            time.sleep(1.0)
            print(s.process.pid, flush=True)
            os._exit(1)  # die mid-build, without any cleanup
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 5
    gone = lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # noqa: E731
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()


@pytest.mark.slow
def test_killed_sampler_reports_its_exit_code_and_leaves_no_temporary_files(tiny_path, tokenizer):
    sampler = launch.start_sampler(tiny_path, placement="cpu")
    tmpdir = Path(sampler.tmpdir)
    assert list(tmpdir.glob("vllm_dist_*"))  # vLLM's rendezvous file, which a killed process cannot delete
    os.kill(sampler.process.pid, signal.SIGKILL)
    with pytest.raises(vllm_sampler.SamplerError, match=r"exit code -9"):
        sampler.generate(_prompts(tokenizer, 2), n=1, max_tokens=4)
    sampler.close()
    assert not tmpdir.exists()


@pytest.mark.slow
def test_two_runs_building_a_model_build_it_once(tmp_path):
    """Runs started together on an empty cache: one builds, the other waits and uses it; no
    temporary directory is left behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import common
        from fastrl import launch, runlog, util
        import tasks
        from fastrl import tiny_model

        def build(path):
            def write(tmp):
                tmp.mkdir()
                time.sleep(1.0)
                (tmp / "config.json").write_text("{{}}")
            with open({str(tmp_path / "builds")!r}, "a") as f:
                f.write("built\\n")
            util.replace_atomically(write, path)

        print(tiny_model.cached_build(Path({str(tmp_path / "cache" / "model")!r}), build))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outputs)) == 1
    assert (tmp_path / "builds").read_text() == "built\n"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["model", "model.lock"]


@pytest.mark.slow
def test_a_run_ends_without_leaked_semaphores(tiny_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import common
        from fastrl import launch, runlog, util
        import tasks
        if __name__ == "__main__":
            launch.start_sampler({tiny_path!r}, placement="cpu").close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "leaked semaphore" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_prompts_all_too_long_is_one_clear_line():
    out = _run("rloo_kreuse.py", "--max-prompt-tokens", "3")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: --model/--task: every prompt is longer than the "
                                                          "prompt budget of 3")


@pytest.mark.slow
def test_sampler_killed_during_a_push(tiny_path):
    model = common.load_policy(tiny_path, "cpu")
    sampler = launch.start_sampler(tiny_path, placement="cpu")
    sampler.init_weight_sync(model)
    real_update = sampler.update_weights

    def die_mid_push(update_info):  # the sampler dies between start and the data
        os.kill(sampler.process.pid, signal.SIGKILL)
        return real_update(update_info)

    sampler.update_weights = die_mid_push
    start = time.monotonic()
    with pytest.raises(vllm_sampler.SamplerError, match="died|push failed"):
        sampler.push_weights(1)
    assert time.monotonic() - start < 60
    sampler.close()
