"""fastrl/sampler_client.py's bookkeeping, on an engine that records what it is asked (the real sampler's runs: the
resume tests of each script, e.g. test_online_dpo_async.py::test_sync_resume_is_exact)."""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from fastrl import distributed, launch
from fastrl.sampler_client import SamplerClient


class Engine:
    """What SamplerClient uses of vllm_sampler.Sampler: requests stay `pending` until finish() says they are done; the
    generators are a counter that every request advances."""

    def __init__(self):
        self.pending, self.paused, self.draws, self.restored, self.finished_at = set(), False, 0, [], {}

    def submit(self, prompts, **sampling):
        ids = [f"{self.draws}-{i}" for i in range(len(prompts))]
        self.pending.update(ids)
        self.draws += 1
        return ids

    def finish(self):
        self.finished_at |= dict.fromkeys(self.pending, time.time())  # (the sampler's clock, as Completion's)
        self.pending.clear()

    def wait_for(self, ids):
        self.finish() if set(ids) & self.pending else None
        return [SimpleNamespace(text=f"completion of {i}", finished_at=self.finished_at[i]) for i in ids]

    def rng_state(self):
        assert not self.pending, "the generators are read only while nothing generates"
        return self.draws

    def set_rng_state(self, state):
        self.draws = state
        self.restored.append(state)


def client():
    engine = Engine()
    return engine, SamplerClient(engine, distributed.init())


def test_a_checkpoint_keeps_the_generators_before_the_first_round_not_waited_on():
    engine, sampler = client()
    assert sampler.checkpoint_rng() == 0  # nothing sent: now
    first = sampler.generate([[1]], n=2, temperature=1.0, top_p=1.0, max_tokens=4)
    assert sampler.checkpoint_rng() == 0  # the round in flight is sampled again on resume: from before it
    second = sampler.generate([[2]], n=2, temperature=1.0, top_p=1.0, max_tokens=4)  # sent while `first` generates
    samples, _ = sampler.wait(first)
    assert [s.text for s in samples] == ["completion of 0-0"]
    assert sampler.checkpoint_rng() is None  # before `second` is unknown: it was sent while another generated
    sampler.wait(second)
    assert sampler.checkpoint_rng() == 2  # nothing in flight: now
    engine.finish()
    sampler.generate([[3]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)  # (the next round, the others done)
    assert sampler.checkpoint_rng() == 2


def test_wait_times_a_round_from_sending_it_to_its_last_sample_finishing_however_late_it_is_collected():
    """time/generate_seconds, one meaning in every script: the sampler's time for the round. RLOO's --overlap and
    DPO's async mode collect a round after an update; the learner's wait is time/learner_wait_seconds."""
    engine, sampler = client()
    before = time.perf_counter()
    request = sampler.generate([[1], [2]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    time.sleep(0.1)
    engine.finish()
    finished = time.perf_counter()
    time.sleep(0.3)  # the learner collects the round later
    _, seconds = sampler.wait(request)
    assert 0.1 <= seconds <= finished - before + 0.01, (seconds, finished - before)


def test_a_round_waited_on_out_of_order_leaves_the_oldest_rounds_generators():
    engine, sampler = client()
    first = sampler.generate([[1]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    engine.finish()
    second = sampler.generate([[2]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)  # sent with nothing generating
    sampler.wait(second)
    assert sampler.checkpoint_rng() == 0  # `first`, not waited on: before it
    sampler.wait(first)
    assert sampler.checkpoint_rng() == 2


def test_a_stream_through_the_engine_itself_is_no_state_to_resume_from():
    engine, sampler = client()
    engine.submit([[1]])  # (PipelineRL's actor, OPPO's buffer)
    assert sampler.checkpoint_rng() is None
    engine.finish()
    assert sampler.checkpoint_rng() == 1


def test_a_resumed_run_restores_the_generators_at_its_first_generate_not_before():
    engine, sampler = client()
    sampler.rng_to_restore = 7  # (Run.resume: the checkpoint's)
    engine.submit([[0]])  # the start's evaluation draws first
    engine.finish()
    assert engine.restored == []
    request = sampler.generate([[1]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    assert engine.restored == [7] and request.ids == ["7-0"]
    sampler.wait(request)
    sampler.generate([[2]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    assert engine.restored == [7]  # once


def test_the_learner_has_one_core_while_the_sampler_generates_and_every_core_after(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (conftest's fixed budget, which learner_threads keeps)
    if torch.cuda.is_available() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("launch.learner_threads changes nothing here (a GPU or one core)")
    engine, sampler = client()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        request = sampler.generate([[1]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
        assert torch.get_num_threads() == 1
        sampler.wait(request)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0)) == launch.learner_threads(engine)
    finally:
        torch.set_num_threads(before)


def test_a_push_when_idle_collects_the_rounds_in_flight_first_and_gives_that_wait_apart():
    """RLOO's --overlap and DPO's async mode push while the next round generates: the push waits for it (no round
    mixes two policies), and that wait is the learner's for its data (time/idle_wait_seconds, which the scripts add
    to time/learner_wait_seconds), not the push's time/push_seconds. wait() then returns the round at once."""
    engine, sampler = client()
    collected, pending_at_push = [], []
    wait_for = engine.wait_for
    engine.wait_for = lambda ids: collected.append(ids) or wait_for(ids)
    engine.push_weights = lambda version, **how: pending_at_push.append(set(engine.pending)) or 0.01
    policy = torch.nn.Linear(1, 1)
    request = sampler.generate([[1], [2]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    pushed = sampler.push(policy, 1, when_idle=True)
    assert pending_at_push == [set()] and collected == [request.ids]  # collected, then the weights went
    assert pushed["time/push_seconds"] == 0.01 and pushed["time/idle_wait_seconds"] >= 0
    assert sampler.checkpoint_rng() == 0  # not waited on by the loop yet: a resumed run samples it again, as before
    samples, seconds = sampler.wait(request)
    assert [s.text for s in samples] == ["completion of 0-0", "completion of 0-1"] and seconds >= 0
    assert collected == [request.ids] and sampler.checkpoint_rng() == 1  # no second collection; nothing in flight
    request = sampler.generate([[3]], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    assert "time/idle_wait_seconds" not in sampler.push(policy, 2)  # in flight (PipelineRL's, OPPO's): no wait
    assert pending_at_push[-1] == set(request.ids) and len(collected) == 1
