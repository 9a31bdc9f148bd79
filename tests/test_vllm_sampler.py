"""The real vLLM sampler process on CPU with the tiny model: weight push, versions, streaming,
pause, failure handling."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import common
from fastrl import launch
import tasks
from fastrl import vllm_sampler
from conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[1]
WORK = scratch_dir("fastrl-test-runs-")  # scripts run here


def _prompts(tokenizer, count, split="test"):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems = [task.problem(split, i) for i in range(count)]
    return problems, [tokenizer(p.prompt)["input_ids"] for p in problems]


def _learner_logprobs(model, samples, pad_id):
    ids, attn, mask = common.pad_prompt_completions([s.prompt_token_ids for s in samples],
                                                    [s.token_ids for s in samples], pad_id)
    with torch.no_grad():
        learner = common.token_logprobs(model, ids, attn, mask, temperature=1.0)
    sampler = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], learner.shape[1])
    return learner, sampler, mask[:, 1:].bool()






@pytest.mark.slow
def test_weight_push_matches_learner_logprobs(tiny_path, tokenizer, sampler):
    # the sampler path the GPU pins too (vllm_sampler.engine_settings): V1 runner, PyTorch top-k/top-p; and the
    # collector on again once the engine is built (off over vLLM's import and build: the start's ~1 s)
    assert sampler.sampler_paths() == {"model_runner": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
                                       "top_k_top_p": "pytorch", "garbage_collector": "on"}
    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model)
    assert sampler.weight_load_path() == "in place"  # the CPU sampler kept its linear weights: no layerwise reload
    _check_push_matches_learner(model, tokenizer, sampler)
    # a push that leaves a parameter out fails in the learner, naming it (it used to keep its old weights silently)
    _check_push_without_a_layer_fails(tiny_path, sampler, "model.layers.0.mlp.down_proj.weight")
    _check_push_of_a_wrong_shape_fails(tiny_path, sampler)
    sampler.init_weight_sync(model)  # the next whole push brings it back (the session's sampler serves other tests)
    sampler.push_weights(sampler.version + 1)
    _check_push_matches_learner(model, tokenizer, sampler)


@pytest.mark.slow
def test_weight_push_through_vllm_layerwise_reload(tiny_path, tokenizer):
    """The fallback for samplers whose linear weights were not kept: vLLM's layerwise reload (also how
    vLLM's own nccl and ipc engines load on a GPU). A layer that receives nothing, or a tensor of the wrong
    shape, fails the push in the learner with the layer's name."""
    model = common.load_policy(tiny_path, "cpu")
    with launch.start_sampler(tiny_path, placement="cpu", seed=0, in_place_updates=False) as own:
        own.init_weight_sync(model)
        assert own.weight_load_path() == "layerwise"
        _check_push_matches_learner(model, tokenizer, own)
        _check_push_without_a_layer_fails(tiny_path, own, r"model.layers.0.mlp.down_proj \(RowParallelLinear: weight\)")
        _check_push_of_a_wrong_shape_fails(tiny_path, own)


def _check_push_of_a_wrong_shape_fails(tiny_path, sampler):
    bad = common.load_policy(tiny_path, "cpu")
    weight = bad.model.layers[1].self_attn.o_proj.weight
    bad.model.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(weight[:, :-1].clone())
    sampler.init_weight_sync(bad)
    with pytest.raises(vllm_sampler.SamplerError,
                       match=r"could not load 'model.layers.1.self_attn.o_proj.weight' \(shape"):
        sampler.push_weights(sampler.version + 1)


def _check_push_without_a_layer_fails(tiny_path, sampler, named):
    partial = common.load_policy(tiny_path, "cpu")
    partial.model.layers[0].mlp.down_proj = torch.nn.Identity()  # its weight is not pushed
    sampler.init_weight_sync(partial)
    version = sampler.version
    with pytest.raises(vllm_sampler.SamplerError, match=f"weight push {version + 1} failed: nothing was loaded "
                                                        f"into {named}"):
        sampler.push_weights(version + 1)
    assert sampler.version == version


@pytest.mark.slow
def test_seeded_requests_longer_than_a_step_are_never_split(tiny_path, tokenizer):
    """vLLM's CPU runner cannot rewind a seeded request's generator after a partial prefill ("CPU
    Generator does not use offset": pipeline_rl.py crashed on the long-tail task); with a known
    context the sampler never splits a prefill. 80 seeded prompts of 40 tokens: 3200 prompt tokens,
    more than one step's budget of 2048."""
    prompts = [tokenizer(f"{i % 10} " * 20)["input_ids"][:40] for i in range(80)]
    assert all(len(p) == 40 for p in prompts)
    with launch.start_sampler(tiny_path, placement="cpu", seed=0, max_model_len=128) as own:
        samples = own.generate(prompts, n=1, temperature=1.0, max_tokens=8, seed=7)  # (failed here, in the sampler)
    assert len(samples) == 80 and all(s.finished and 1 <= len(s.token_ids) <= 8 for s in samples)


def _check_push_matches_learner(model, tokenizer, sampler):
    _, prompts = _prompts(tokenizer, 24)

    before = sampler.generate(prompts, n=2, temperature=1.0, max_tokens=24, seed=0)
    learner, behaviour, mask = _learner_logprobs(model, before, tokenizer.pad_token_id)
    assert (learner - behaviour)[mask].abs().max() < 1e-4
    assert {s.version_max for s in before} == {sampler.version}

    # a push that really changes the weights, including the tied embedding / lm_head
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    old_learner = learner
    sampler.push_weights(version=sampler.version + 1)
    after = sampler.generate(prompts, n=2, temperature=1.0, max_tokens=24, seed=0)
    learner, behaviour, mask = _learner_logprobs(model, after, tokenizer.pad_token_id)
    assert (learner - behaviour)[mask].abs().max() < 1e-4
    assert all(s.versions == [(sampler.version, 0, len(s.token_ids))] for s in after)
    # and the sampler's old logprobs would not have matched the new model
    stale, _, stale_mask = _learner_logprobs(model, before, tokenizer.pad_token_id)
    assert (stale - old_learner)[stale_mask].abs().max() > 1e-2


@pytest.mark.slow
def test_streaming_chunks_add_up_to_the_completion(tokenizer, sampler):
    _, prompts = _prompts(tokenizer, 4)
    ids = sampler.submit(prompts, n=1, stream_every=3, temperature=1.0, max_tokens=48, ignore_eos=True, seed=5)
    chunks, finals = {i: [] for i in ids}, {}
    deadline = time.monotonic() + 60
    resized = False
    while len(finals) < len(ids) and time.monotonic() < deadline:
        if not resized and sum(len(c) for c in chunks.values()) >= 4:
            sampler.set_stream_every(10)  # running requests switch to 10-token chunks
            resized = True
        for c in sampler.poll(timeout=1.0):
            if c.request_id not in chunks:
                continue  # left over from an earlier test on this session's sampler
            if c.finished:
                finals[c.request_id] = c
            else:
                chunks[c.request_id].append(c)
    assert set(finals) == set(ids)
    for rid in ids:
        streamed = [t for c in chunks[rid] for t in c.token_ids]
        assert len(chunks[rid]) >= 2 and all(len(c.token_ids) >= 3 for c in chunks[rid])
        assert streamed == finals[rid].token_ids[: len(streamed)]
        assert len(finals[rid].token_ids) == 48
        # the final text is the whole response's, not the last delta's
        assert finals[rid].text == tokenizer.decode(finals[rid].token_ids, skip_special_tokens=True)
        assert any(len(c.token_ids) >= 10 for c in chunks[rid][1:])  # after the resize


@pytest.mark.slow
def test_background_push_sends_the_snapshot_while_training_goes_on(tiny_path, tokenizer, sampler):
    """PipelineRL's push: copied into the snapshot, sent from a thread; the model keeps changing
    meanwhile, and the sampler ends up with exactly the weights of the moment of the push."""
    import copy

    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model, background=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pushed = copy.deepcopy(model)
    version = sampler.version + 1
    sampler.push_weights(version, background=True)
    with torch.no_grad():  # the next optimizer step, while the push is in flight
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sampler.wait_for_push()
    assert sampler.version == version
    _, prompts = _prompts(tokenizer, 16)
    samples = sampler.generate(prompts, n=2, temperature=1.0, max_tokens=24)
    learner, behaviour, mask = _learner_logprobs(pushed, samples, tokenizer.pad_token_id)
    assert (learner - behaviour)[mask].abs().max() < 1e-4
    later, _, _ = _learner_logprobs(model, samples, tokenizer.pad_token_id)
    assert (later - behaviour)[mask].abs().max() > 1e-2
    assert all(s.versions == [(version, 0, len(s.token_ids))] for s in samples)


@pytest.mark.slow
def test_push_when_idle_waits_for_the_running_requests(tiny_path, tokenizer, sampler):
    """Async online DPO's push: issued while a round is generating, applied only after its last
    request has finished, so the round is all old version and the next one all new."""
    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model)
    old = sampler.version
    _, prompts = _prompts(tokenizer, 8)
    running = sampler.submit(prompts, n=2, temperature=1.0, max_tokens=80, ignore_eos=True)
    time.sleep(0.2)  # let it start decoding (not poll: that would take the round's completions away from wait_for)
    sampler.push_weights(old + 1, when_idle=True)
    pushed_at = time.time()
    after = sampler.submit(prompts[:2], n=1, temperature=1.0, max_tokens=8)
    first, second = sampler.wait_for(running, timeout=300), sampler.wait_for(after, timeout=300)
    assert all(c.versions == [(old, 0, 80)] for c in first)
    assert max(c.finished_at for c in first) <= pushed_at
    assert all(c.version_min == c.version_max == old + 1 for c in second)


@pytest.mark.slow
def test_pause_keeps_sequences_and_resume_continues(tokenizer, sampler):
    _, prompts = _prompts(tokenizer, 8)
    sampler.pause()
    try:
        ids = sampler.submit(prompts, n=1, temperature=1.0, max_tokens=20, seed=1)
        assert [c for c in sampler.poll(timeout=2.0) if c.request_id in ids] == []  # nothing decodes while paused
        assert sampler.num_unfinished() == len(ids)
    finally:
        sampler.resume()  # the session's sampler serves the other tests
    done = []
    deadline = time.monotonic() + 60
    while len(done) < len(ids) and time.monotonic() < deadline:
        done += [c for c in sampler.poll(timeout=1.0) if c.finished and c.request_id in ids]
    assert sorted(c.request_id for c in done) == sorted(ids)


@pytest.mark.slow
def test_sampler_error_is_reported_not_hung(sampler):
    with pytest.raises(vllm_sampler.SamplerError, match="max_tokens|ValueError|must be"):
        sampler.generate([[5, 6, 7]], n=1, max_tokens=-3)
    sampler.generate([[5, 6, 7]], n=1, max_tokens=2, timeout=60)  # still serving afterwards


@pytest.mark.slow
def test_end_of_run_memory_has_the_samplers_peak(sampler):
    """On CPU the summary's sampler memory is its peak resident memory (vLLM, torch and the model: well over
    100 MiB), and no GPU figure; on a GPU "sampler_gpu" joins it (test_gpu_path)."""
    memory = launch.peak_memory_mib(sampler)
    assert set(memory) == {"learner", "sampler"} | ({"learner_gpu"} if torch.cuda.is_available() else set())
    assert 100 < memory["sampler"] <= sampler.peak_rss_mib()  # a peak only grows


@pytest.mark.slow
def test_killed_sampler_raises_clear_error_fast(tiny_path, tokenizer):
    sampler = launch.start_sampler(tiny_path, placement="cpu")
    pid = sampler.process.pid
    _, prompts = _prompts(tokenizer, 64)
    sampler.submit(prompts, n=4, temperature=1.0, max_tokens=64, ignore_eos=True)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(vllm_sampler.SamplerError, match="died"):
        sampler.generate(prompts[:1], n=1, max_tokens=4)
    assert time.monotonic() - start < 30
    sampler.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert [c for c in psutil.Process().children(recursive=True) if c.pid == pid] == []


@pytest.mark.slow
def test_close_leaves_no_thread_and_no_model_behind(tiny_path, monkeypatch):
    """close() waits for the sender thread, even a slow one, and lets go of the model: a daemon thread of ours
    that frees torch objects while Python shuts down aborts the process with "terminate called without an
    active exception" (seen under load, after a run's summary; pytorch#38228)."""
    send_loop = vllm_sampler.Sampler._send_loop

    def lingering(self):
        send_loop(self)
        time.sleep(1.0)  # done, still holding the Sampler: a thread not yet run again on a loaded machine

    monkeypatch.setattr(vllm_sampler.Sampler, "_send_loop", lingering)
    model = common.load_policy(tiny_path, "cpu")
    sampler = launch.start_sampler(tiny_path, placement="cpu")
    sampler.init_weight_sync(model)
    sampler.push_weights(1)
    sampler.close()
    assert not sampler._sender.is_alive()
    assert sampler._model is None and sampler._weight_engine is None


@pytest.mark.slow
def test_dead_learner_takes_the_sampler_down(tiny_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import common
        from fastrl import launch
        import tasks
        from fastrl import vllm_sampler
        if __name__ == "__main__":
            s = launch.start_sampler({tiny_path!r}, placement="cpu")
            print(s.process.pid, flush=True)
            os._exit(1)  # die without any cleanup
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 15
    while (psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE




@pytest.mark.slow
def test_ctrl_c_stops_learner_and_sampler(tmp_path):
    """SIGINT to the whole foreground process group (what Ctrl-C does) ends both processes."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "rloo_kreuse.py"), "--exp-name", "pytest_ctrl_c",
                             "--num-rounds", "500",
                             "--eval-problems", "8", "--eval-samples", "2"], cwd=WORK, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            # a runner started from a background shell ignores SIGINT, and children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:  # wait until training is under way
            if line.startswith("round 1/"):
                break
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 2  # learner and sampler
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    alive = lambda: [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == []
    assert proc.returncode != 0


@pytest.mark.slow
def test_quiet_libraries_turns_transformers_bars_off_without_importing_it():
    """Without --verbose, transformers' load and save bars are off whether it is imported before quiet_libraries or
    after; quiet_libraries itself does not import it (~2 s of the learner's start, before the sampler spawns)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from fastrl import vllm_sampler
        vllm_sampler.quiet_libraries(False)
        print("imported by quiet_libraries:", "transformers" in sys.modules)
        from transformers.utils import logging
        print("bars after a later import:", logging.is_progress_bar_enabled())
        logging.enable_progress_bar()
        vllm_sampler.quiet_libraries(False)
        print("bars when imported before:", logging.is_progress_bar_enabled())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines == ["imported by quiet_libraries: False", "bars after a later import: False",
                     "bars when imported before: False"], out.stdout
