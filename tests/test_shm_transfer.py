"""The "shm" weight transfer (shm_transfer.py), the local CPU sampler's backend: after pushes of
changed weights the sampler's logprobs equal the learner's (tied-embedding tiny model), the
background push sends the snapshot, a dead sampler is a SamplerError, and no shared memory
outlives the processes (nothing under /dev/shm, no mapping left), whichever side ends first."""

import copy
import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

import common
from fastrl import launch
from fastrl import shm_transfer
import tasks
from fastrl import vllm_sampler

ROOT = Path(__file__).resolve().parents[1]
MAPPING = "memfd:fastrl-weights"  # the name /proc/<pid>/maps shows for the shared buffer


def _mapped(pid: int | str = "self") -> int:
    try:
        return sum(MAPPING in line for line in open(f"/proc/{pid}/maps"))
    except FileNotFoundError:
        return 0


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _dev_shm_ours() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "fastrl" in name}


def _prompts(tokenizer, count):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    return [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(count)]


def _max_logprob_gap(model, samples, pad_id, temperature):
    ids, attn, mask = common.pad_prompt_completions([s.prompt_token_ids for s in samples],
                                                    [s.token_ids for s in samples], pad_id)
    with torch.no_grad():
        learner = common.token_logprobs(model, ids, attn, mask, temperature=temperature)
    sampler = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], learner.shape[1])
    return (learner - sampler)[mask[:, 1:].bool()].abs().max().item()


def _perturb(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # the tied embedding / lm_head too
            p.add_(0.05 * torch.randn_like(p))


@pytest.fixture
def session_sampler(sampler, tiny_path):
    """The session's sampler, given back with the tiny model's own weights (other test files
    compare it with the model on disk)."""
    yield sampler
    sampler.wait_for_push()
    sampler.init_weight_sync(common.load_policy(tiny_path, "cpu"))
    sampler.push_weights(sampler.version + 1)


def test_layout_is_aligned_and_views_round_trip():
    dtypes, shapes = [torch.float32, torch.bfloat16, torch.float32], [[3, 5], [7], [2, 2]]
    offsets, size = shm_transfer.layout(dtypes, shapes)
    assert offsets == [0, 64, 128] and size == 192
    buffer = torch.zeros(size, dtype=torch.uint8)
    tensors = [torch.randn(s).to(d) for d, s in zip(dtypes, shapes)]
    for view, t in zip(shm_transfer.views(buffer, dtypes, shapes, offsets), tensors):
        view.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(shm_transfer.views(buffer, dtypes, shapes, offsets), tensors))
    with pytest.raises(shm_transfer.TransferError, match="outside"):
        shm_transfer.views(buffer, [torch.float32], [[100]], [0])


def test_a_buffer_of_the_wrong_size_is_refused():
    fd = os.memfd_create("fastrl-weights-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(shm_transfer.TransferError, match="4096 bytes, expected 8192"):
            shm_transfer.map_shared(f"/proc/self/fd/{fd}", 8192)
        assert os.fstat(fd).st_size == 4096  # not grown
    finally:
        os.close(fd)


@pytest.mark.slow
def test_pushes_match_the_learner_logprobs(tiny_path, tokenizer, session_sampler):
    sampler = session_sampler
    model = common.load_policy(tiny_path, "cpu")
    assert model.config.tie_word_embeddings
    sampler.init_weight_sync(model)
    assert isinstance(sampler._weight_engine, shm_transfer.ShmTrainerWeightTransferEngine)
    assert sampler.weight_load_path() == "in place"
    # the learner's parameters now live in the shared buffer (same Parameter objects): a push copies nothing on its side
    assert {p.data_ptr() for p in model.parameters()} == {v.data_ptr() for v in sampler._weight_engine.views}
    # from this model's weights, whatever an earlier test pushed into the shared sampler
    sampler.push_weights(sampler.version + 1)
    prompts = _prompts(tokenizer, 16)
    for round_ in range(3):  # several pushes in a row, each of changed weights
        before = sampler.generate(prompts[:4], n=2, temperature=0.7, max_tokens=16, seed=round_)
        _perturb(model, round_)
        sampler.push_weights(sampler.version + 1)
        after = sampler.generate(prompts, n=2, temperature=0.7, max_tokens=24, seed=round_)
        assert _max_logprob_gap(model, after, tokenizer.pad_token_id, 0.7) < 1e-4
        assert {s.version_max for s in after} == {sampler.version}
        # the push really changed the sampler's model: its earlier logprobs no longer match
        assert _max_logprob_gap(model, before, tokenizer.pad_token_id, 0.7) > 1e-2
    assert _mapped() >= 1 and not _dev_shm_ours()


@pytest.mark.slow
def test_background_push_sends_the_snapshot(tiny_path, tokenizer, session_sampler):
    sampler = session_sampler
    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model, background=True)
    # the snapshot's are
    assert not {p.data_ptr() for p in model.parameters()} & {v.data_ptr() for v in sampler._weight_engine.views}
    _perturb(model, 10)
    pushed = copy.deepcopy(model)
    version = sampler.version + 1
    sampler.push_weights(version, background=True)
    _perturb(model, 11)  # the next optimizer step, while the push is in flight
    sampler.wait_for_push()
    assert sampler.version == version
    samples = sampler.generate(_prompts(tokenizer, 12), n=2, temperature=1.0, max_tokens=24)
    assert _max_logprob_gap(pushed, samples, tokenizer.pad_token_id, 1.0) < 1e-4
    assert _max_logprob_gap(model, samples, tokenizer.pad_token_id, 1.0) > 1e-2
    assert all(s.versions == [(version, 0, len(s.token_ids))] for s in samples)


@pytest.mark.slow
def test_dead_sampler_is_an_error_and_nothing_is_left(tiny_path):
    gc.collect()
    mapped_before = _mapped()
    model = common.load_policy(tiny_path, "cpu")
    sampler = launch.start_sampler(tiny_path, placement="cpu", seed=0)
    try:
        sampler.init_weight_sync(model)
        sampler.push_weights(1)
        assert _mapped() == mapped_before + 1 and _mapped(sampler.process.pid) == 1
        # the learner's descriptor is closed: only the two mappings hold the memory
        assert not any("fastrl-weights" in _link(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd"))
        os.kill(sampler.process.pid, signal.SIGKILL)
        # the liveness check's error, not the push deadline's
        with pytest.raises(vllm_sampler.SamplerError, match="died"):
            sampler.push_weights(2)
    finally:
        sampler.close()
    # the learner's mapping goes with the Sampler (its weight engine) and the model (its parameters live there)
    del sampler, model
    gc.collect()
    assert _mapped() == mapped_before and not _dev_shm_ours()


@pytest.mark.slow
def test_a_killed_learner_leaves_no_shared_memory(tiny_path, tmp_path):
    """SIGKILL the learner right after a push: its sampler ends, and with it the last mapping."""
    script = tmp_path / "learner.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import common
        from fastrl import launch
        import tasks
        if __name__ == "__main__":  # the sampler is spawned: it imports this file
            model = common.load_policy({tiny_path!r}, "cpu")
            sampler = launch.start_sampler({tiny_path!r}, placement="cpu", seed=0)
            sampler.init_weight_sync(model)
            sampler.push_weights(1)
            maps = open(f"/proc/{{sampler.process.pid}}/maps").read()
            print(sampler.process.pid, maps.count({MAPPING!r}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    sampler_pid, mappings = map(int, out.stdout.split()[-2:])
    assert mappings == 1  # the sampler had the buffer mapped when its learner died
    try:
        psutil.Process(sampler_pid).wait(timeout=30)  # it notices the learner is gone within seconds
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(sampler_pid) or psutil.Process(sampler_pid).status() == psutil.STATUS_ZOMBIE
    assert not _dev_shm_ours()  # and the buffer never had a name: with both mappings gone, it is freed
