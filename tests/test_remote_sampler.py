"""The sampler served by a real vLLM server on CPU (remote_sampler.py, `--sampler-url`): one server
for the module, started the way users start theirs (python -m ...api_server.entry, our plugin
entry point loading the gloo engine). Generation, weight pushes through vLLM's RL endpoints (the
server's logprobs equal the learner's), in-flight pushes (old KV kept, or recomputed), pause and
resume, abort, a script trained through `--sampler-url`, a round split over two (stand-in)
servers, and a hung or dead server as a SamplerError within the timeout. The fault test stops and
then kills the module's server: it runs last."""

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import common
from fastrl import runlog
from fastrl import remote_sampler, weight_sync
import tasks
from fastrl.vllm_sampler import SamplerError
from conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[1]
WORK = scratch_dir("fastrl-test-remote-")  # the script writes its run here, not into the repository
SAMPLING = dict(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def server(tiny_path):
    """One vLLM server on the tiny model, on a free port; its whole process group ends at teardown."""
    from vllm.utils.network_utils import get_open_port

    port, log = get_open_port(), str(WORK / "server.log")
    # request logging: the log says when each request has reached the engine (_submit_long waits for them)
    process = remote_sampler.start_server(tiny_path, port, log_path=log, max_model_len=128, seed=0,
                                          extra_args=("--enable-log-requests",))
    url = f"http://127.0.0.1:{port}"
    try:
        remote_sampler.wait_ready(url, timeout=300, process=process, log_path=log)
        yield SimpleNamespace(url=url, process=process, log=log)
    finally:
        remote_sampler.stop_server(process)


@pytest.fixture(scope="module")
def server_url(server):
    return server.url


def _prompts(tokenizer, n):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    return [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(n)]


def _learner_vs_served(model, completions, pad_id):
    """|learner - served| per completion token (learner under the same processing), 0 where the
    nucleus is decided by rounding (_on_the_nucleus_edge); asserts those are a few."""
    ids, attn, cmask = common.pad_prompt_completions([c.prompt_token_ids for c in completions],
                                                     [c.token_ids for c in completions], pad_id)
    with torch.no_grad():
        learner = common.token_logprobs(model, ids, attn, cmask, **SAMPLING)
        edge = _on_the_nucleus_edge(model(input_ids=ids, attention_mask=attn).logits[:, :-1]) & cmask[:, 1:].bool()
    served = common.sampler_logprob_tensor(completions, [len(c.prompt_token_ids) for c in completions],
                                           learner.shape[1])
    # ~0.5% at the tiny model's 101 tokens: the check still checks
    assert edge.sum() <= 0.05 * cmask.sum(), (edge.sum(), cmask.sum())
    return (learner - served).abs().masked_fill(edge, 0.0)


def _on_the_nucleus_edge(logits):
    """Positions whose top-p cut lies within common.NUCLEUS_MARGIN of 1 - top_p: there the server's
    forward pass and the learner's (equal to ~1e-7) can keep different sets, and a token's logprob
    then differs by the mass of the token at the cut (the tiny model's 101 tokens: 0.002-0.007;
    a loaded CI run once saw 0.0016, in 1 of 48 completions)."""
    probs = (logits.double() / SAMPLING["temperature"]).softmax(-1).sort(-1).values.cumsum(-1)  # ascending, as vLLM
    return ((probs - (1 - SAMPLING["top_p"])).abs() < common.NUCLEUS_MARGIN).any(-1)


def _span_mask(completions, width, version):
    """The columns (token_logprobs layout) of the tokens each completion sampled with `version`."""
    mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for row, c in enumerate(completions):
        offset = len(c.prompt_token_ids) - 1
        for v, start, end in c.versions:
            if v == version:
                mask[row, offset + start: offset + end] = True
    return mask


def _perturb(model, seed, scale=0.02):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)  # the tied embedding / lm_head too


def _counter(url, name) -> float:
    """A vLLM metric from the server's /metrics (summed over its labels; gauges are updated as the
    engine steps)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def _submit_long(sampler, tokenizer, url):
    """~28k tokens (seconds here; a push under load took up to ~1 s), all started when this returns:
    queued on the paused server and started together (HTTP requests arrive over a while on a
    loaded machine, and the first could finish before the last started). Under load they can also
    have finished by then: the server's API process handles the engine's steps late and in bursts
    (it once reported the whole 27,500 tokens at once), so a caller that needs them in flight tries
    again when they were not. The last two prompts are streamed. Returns all ids and the streamed ones."""
    prompts = _prompts(tokenizer, 64)
    sampler.pause()
    added, generated = _added_requests(), _counter(url, "vllm:generation_tokens_total")
    ids = sampler.submit(prompts[2:], n=4, max_tokens=110, ignore_eos=True, **SAMPLING)
    streamed = sampler.submit(prompts[:2], n=1, stream_every=2, max_tokens=110, ignore_eos=True, **SAMPLING)
    ids += streamed
    # every request is in the engine before it resumes: no gauge moves while it is paused, and under load the
    # server's API process takes seconds to hand 64 calls on (a fixed wait after they arrived was too short)
    _wait(lambda: _added_requests() >= added + len(ids), "the server did not hand the requests to its engine", url)
    sampler.resume()
    # a step of (nearly) all of them: a counter, which stays where it got; the running gauge's moment can be missed
    _wait(lambda: _counter(url, "vllm:generation_tokens_total") >= generated + 0.9 * len(ids),
          "the requests did not start", url)
    return ids, streamed


def _added_requests() -> int:
    """Requests the module's server has handed to its engine: vLLM's API process logs "Added request" right
    after sending one (vllm/v1/engine/async_llm.py:549-552, with --enable-log-requests), one line per sample."""
    return (WORK / "server.log").read_text(errors="replace").count("Added request ")


def _wait(condition, what: str, url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # generous: a loaded machine is slow, a stuck one still fails
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s; the server then: {_server_state(url)}"
        time.sleep(0.02)


def _server_state(url: str) -> str:
    """What the module's server was doing, for a failed wait: its request gauges and token counters,
    and the end of its log."""
    try:
        names = ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total")
        state = ", ".join(f"{n}={_counter(url, 'vllm:' + n):.0f}" for n in names)
    except OSError as e:
        state = f"/metrics failed: {e!r}"
    log = WORK / "server.log"
    return state + "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:] if log.exists() else [])


def _wait_all(sampler, ids, finals, timeout=120):
    """The completions of `ids`, some of which already came (`finals`), in order."""
    finals = dict(finals)
    rest = [i for i in ids if i not in finals]
    finals.update((c.request_id, c) for c in sampler.wait_for(rest, timeout=timeout))
    return [finals[i] for i in ids]


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_generation_returns_token_ids_logprobs_and_tags(server_url, tiny_path, tokenizer):
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        prompts = _prompts(tokenizer, 4)
        ids = sampler.submit(prompts, n=3, tags=["a", "b", "c", "d"], max_tokens=12, **SAMPLING)
        assert ids == [str(i) for i in range(12)] and sampler.pending == set(ids)  # ints, as the local sampler's
        out = sampler.wait_for(ids, timeout=60)
        assert not sampler.pending and sampler.num_unfinished() == 0
        assert [c.tag for c in out] == [(t, j) for t in "abcd" for j in range(3)]
        for c in out:
            assert c.prompt_token_ids == prompts[int(c.request_id) // 3]
            assert 0 < len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs) and c.finish_reason in ("stop", "length")
            assert c.versions == [(c.version_max, 0, len(c.token_ids))] and c.finished
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        # per-prompt seeds make a round reproducible (sample j: seed + j, as locally)
        again = [sampler.wait_for(sampler.submit(prompts[:2], n=2, per_prompt=[{"seed": 5}, {"seed": 9}],
                                                 max_tokens=12, **SAMPLING))
                 for _ in range(2)]
        assert [c.token_ids for c in again[0]] == [c.token_ids for c in again[1]]
        assert len({tuple(c.token_ids) for c in again[0]}) > 1


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_a_push_makes_the_servers_logprobs_the_learners_and_pause_keeps_requests(server_url, tiny_path, tokenizer):
    model = common.load_policy(tiny_path, "cpu")
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        sampler.init_weight_sync(model)
        assert sampler.weight_load_path() == "in place"  # the plugin kept the server's linear weights
        _perturb(model, 0)
        sampler.push_weights(7)
        out = sampler.generate(_prompts(tokenizer, 8), n=2, max_tokens=24, **SAMPLING)
        assert sampler.version == 7 and all(c.versions == [(7, 0, len(c.token_ids))] for c in out)
        diff = _learner_vs_served(model, out, tokenizer.pad_token_id)
        assert diff[_span_mask(out, diff.shape[1], 7)].max() < 1e-4
        # pause (keep): decoding stops, the running requests stay; after resume they continue
        # a pause that lands after most requests finished (a loaded machine) says nothing: again
        for attempt in range(3):
            ids, streamed = _submit_long(sampler, tokenizer, server_url)
            sampler.pause()
            chunks, finals = {i: [] for i in streamed}, {}
            # what was produced before the pause took effect, until 2 s pass without anything (on a loaded machine
            # the last chunks arrive over seconds: a fixed 0.5 s left some to fail the check below)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                arrived = sampler.poll(timeout=2.0, min_items=10**9)
                for c in arrived:
                    if c.finished:
                        finals[c.request_id] = c
                    else:
                        chunks[c.request_id] += c.token_ids
                if not arrived:
                    break
            frozen = set(sampler.pending)
            if len(frozen) > len(ids) / 2:
                break
            sampler.resume()
            _wait_all(sampler, ids, finals)
        assert len(frozen) > len(ids) / 2
        assert sampler.poll(timeout=1.5, min_items=10**9) == [] and sampler.pending == frozen
        sampler.resume()
        out = _wait_all(sampler, ids, finals)
        assert all(len(c.token_ids) == 110 for c in out) and not sampler.pending
        by_id = {c.request_id: c for c in out}
        for rid, tokens in chunks.items():
            assert by_id[rid].token_ids[:len(tokens)] == tokens  # continued, not restarted


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
@pytest.mark.parametrize("recompute_kv", [False, True])
def test_an_in_flight_push_labels_both_versions(server_url, tiny_path, tokenizer, recompute_kv):
    """The push lands while the requests run: tokens before it are the old model's, tokens after
    it the new weights' on top of the old KV cache (PipelineRL), or with recompute_kv the new
    model's exactly (re-prefilled)."""
    model = common.load_policy(tiny_path, "cpu")
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        sampler.init_weight_sync(model)
        sampler.push_weights(1)
        old = common.load_policy(tiny_path, "cpu")
        # a push that lands after every request finished (a loaded machine) says nothing: again
        for attempt in range(3):
            ids, _ = _submit_long(sampler, tokenizer, server_url)
            _perturb(model, 1 + attempt, scale=0.05)
            sampler.push_weights(2 + attempt, recompute_kv=recompute_kv)
            out = sampler.wait_for(ids, timeout=120)
            if any(len(c.versions) == 2 for c in out):
                break
            old.load_state_dict(model.state_dict())
    new = 2 + attempt
    assert all(len(c.token_ids) == 110 for c in out)
    for c in out:  # old weights, then new: never back, no gap
        assert ([v for v, _, _ in c.versions] in ([new - 1], [new - 1, new], [new]) and c.versions[0][1] == 0
                and c.versions[-1][2] == 110)
        assert all(a[2] == b[1] for a, b in zip(c.versions, c.versions[1:]))
    mixed = [c for c in out if len(c.versions) == 2]
    assert mixed, [c.versions for c in out]  # continued with the new weights, not restarted
    mixed = mixed[:48]  # enough to see it; the learner's forward passes cost seconds on one core
    before = _learner_vs_served(old, mixed, tokenizer.pad_token_id)
    assert before[_span_mask(mixed, before.shape[1], new - 1)].max() < 1e-4
    after = _learner_vs_served(model, mixed, tokenizer.pad_token_id)[_span_mask(mixed, before.shape[1], new)]
    if recompute_kv:
        assert after.max() < 1e-4
    else:  # the old KV cache was kept: not what the new model computes from scratch
        assert after.max() > 1e-3


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_a_push_when_idle_lets_the_running_requests_finish_first(server_url, tiny_path, tokenizer):
    model = common.load_policy(tiny_path, "cpu")
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        sampler.init_weight_sync(model)
        sampler.push_weights(1)
        ids, _ = _submit_long(sampler, tokenizer, server_url)
        _perturb(model, 5)
        sampler.push_weights(2, when_idle=True)  # returns once the update is in
        out = sampler.wait_for(ids, timeout=120)
        assert all(c.versions == [(1, 0, 110)] for c in out)  # no completion mixes versions
        assert all(c.versions == [(2, 0, len(c.token_ids))] for c in sampler.generate(_prompts(tokenizer, 2),
                                                                                      max_tokens=8, **SAMPLING))


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_abort_stops_the_requests_on_the_server(server_url, tiny_path, tokenizer):
    prompts = _prompts(tokenizer, 64)
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        # queued (the server paused): the aborted prompts never start
        prefilled = _counter(server_url, "vllm:prompt_tokens_total")
        sampler.pause()
        ids = sampler.submit(prompts[:4], n=2, max_tokens=8, **SAMPLING)
        sampler.abort(ids[:1])  # one sample of a prompt: the prompt's request goes on for the other
        sampler.abort(ids[2:])
        assert sampler.pending == {ids[1]}
        sampler.resume()
        assert len(sampler.wait_for([ids[1]], timeout=60)) == 1
        assert sampler.poll(timeout=0.5) == []  # nothing of the aborted ones
        assert _counter(server_url, "vllm:prompt_tokens_total") - prefilled == 2 * len(prompts[0])
        # running: ~28k tokens, aborted as soon as the first are out
        # an abort that lands after every request finished (a loaded machine) says nothing: again
        for attempt in range(3):
            generated = _counter(server_url, "vllm:generation_tokens_total")
            ids, _ = _submit_long(sampler, tokenizer, server_url)
            sampler.abort(ids)
            assert not sampler.pending
            _wait(lambda: _counter(server_url, "vllm:num_requests_running") == 0,
                  "the aborted requests kept running", server_url)
            assert all(not c.finished for c in sampler.poll(timeout=0.5))  # at most chunks that were on their way
            made = _counter(server_url, "vllm:generation_tokens_total") - generated
            if made < len(ids) * 110:
                break
    # stopped short (ignore_eos: run to the end, they would make all len(ids) * 110 tokens); how short depends on
    # how fast the server turns round, which a loaded machine decides, so only the stop itself is checked
    assert made < len(ids) * 110


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_a_script_trains_through_sampler_url(server_url):
    """`--sampler-url`: rloo_kreuse.py samples from the server (launch.start_sampler(urls=...)),
    pushes every round, and the server's logprobs stay the learner's."""
    out = subprocess.run([sys.executable, str(ROOT / "rloo_kreuse.py"), "--sampler-url", server_url, "--exp-name",
                          "pytest_remote",
                          "--k", "2", "--num-rounds", "2", "--num-prompts", "8", "--group-size", "4",
                          "--eval-problems", "8",
                          "--eval-samples", "2"], cwd=WORK, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = runlog.read_metrics(WORK / out.stdout.split("run directory: ")[1].split()[0])
    rounds = [r for r in rows if "charts/reward" in r]
    assert [r["step"] for r in rounds] == [2, 4]
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rounds)  # the server samples with the pushed weights
    assert all(r["charts/lag_max"] == 0 for r in rounds)  # on-policy at each round's first k-step


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_a_push_to_a_server_rounds_on_the_learner_and_measures_what_the_server_holds(server_url, tiny_path, tokenizer):
    """The server says its dtype (/server_info), so the learner casts the push as the local sampler's: here
    --push-round-to bfloat16 with stochastic rounding into the fp32 server (refused before: the server rounded what
    it loaded itself, and the probe measured the fp32 weights sent). The probe sees every weight, and a small update
    is kept whole on average; the served logprobs are those of the learner's weights as rounded."""
    model = common.load_policy(tiny_path, "cpu")
    with torch.no_grad():
        for p in model.parameters():  # bf16-exact to start with, as released checkpoints are (SmolLM2's, Qwen's)
            p.copy_(p.to(torch.bfloat16))
    probe = weight_sync.UpdateProbe(model)
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        assert sampler.weight_dtype() == torch.float32
        sampler.init_weight_sync(model, rounding="stochastic", seed=3, probe=probe, round_to=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():  # a tenth of a bf16 spacing: round to nearest would keep none of it
                p.add_(p.abs() / 2560)
        sampler.push_weights(4)
        kept = sampler.push_metrics()
        assert kept["charts/push_update_kept"] == pytest.approx(1.0, abs=0.1), kept
        assert 0.02 < kept["charts/push_changed_fraction"] < 0.15, kept  # 5-10% of them moved, each a spacing
        rounded = common.load_policy(tiny_path, "cpu")
        cast = weight_sync.PushCast(torch.float32, "stochastic", seed=3, round_to=torch.bfloat16)
        cast.begin(4)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), rounded.parameters()):
                q.copy_(cast(name, p))
        out = sampler.generate(_prompts(tokenizer, 4), n=2, max_tokens=16, **SAMPLING)
        diff = _learner_vs_served(rounded, out, tokenizer.pad_token_id)
        assert diff[_span_mask(out, diff.shape[1], 4)].max() < 1e-4


# ---- splitting, against stand-in servers (no vLLM start-up) ----

class _FakeServerInfo(http.server.BaseHTTPRequestHandler):
    """/server_info?config_format=json answering `dtype` as vLLM's dev endpoint does ("torch.bfloat16"), or 404."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        known = self.server.dtype is not None and self.path.startswith("/server_info")
        data = json.dumps({"vllm_config": {"model_config": {"dtype": self.server.dtype}}}).encode() if known else b""
        self.send_response(200 if known else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_servers_dtype_is_what_their_server_info_says_and_must_agree():
    servers, urls = [], []
    for dtype in ("torch.bfloat16", "torch.bfloat16", "torch.float32", None):
        servers.append(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServerInfo))
        servers[-1].dtype = dtype
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        urls.append(f"http://127.0.0.1:{servers[-1].server_address[1]}")
    try:
        _check_server_dtypes(urls)
    finally:
        for server in servers:
            server.shutdown()


def _check_server_dtypes(servers: list[str]):
    with remote_sampler.RemoteSampler(servers[:2], timeout=5) as sampler:
        assert sampler.weight_dtype() == torch.bfloat16
    with remote_sampler.RemoteSampler(servers[1:3], timeout=5) as sampler, pytest.raises(SamplerError) as mixed:
        sampler.weight_dtype()
    assert "bfloat16, float32" in str(mixed.value) and "--dtype" in str(mixed.value)
    with remote_sampler.RemoteSampler(servers[3:], timeout=5) as sampler:
        assert sampler.weight_dtype() is None  # (no dev endpoint: the server rounds what it loads; nearest only)
        with pytest.raises(ValueError, match="--push-rounding stochastic"):
            sampler.init_weight_sync(torch.nn.Linear(2, 2), rounding="stochastic")

class _FakeGenerate(http.server.BaseHTTPRequestHandler):
    """/inference/v1/generate answering n choices of two tokens after `delay` seconds, recording
    the requests it saw; /health."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        time.sleep(self.server.delay)
        choice = {"finish_reason": "length", "token_ids": [5, 6],
                  "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                  "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -0.25}]}}
        answer = {"request_id": body["request_id"],
                  "choices": [dict(choice, index=i) for i in range(body["sampling_params"]["n"])]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # /health: the client probes a server whose calls take longer than its heartbeat
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_round_is_split_across_servers_prompt_by_prompt():
    servers = []
    for delay in (0.0, 1.0):  # the second is slow: the least-loaded rule sends it less
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeGenerate)
        server.seen, server.delay = [], delay
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        with remote_sampler.RemoteSampler(urls, timeout=5) as sampler:
            out = sampler.generate([[1, 2], [3, 4], [5, 6], [7, 8]], n=3, max_tokens=2, seed=10)
            assert [len(s.seen) for s in servers] == [2, 2]  # one request per prompt, its 3 samples together
            assert sorted(tuple(b["token_ids"]) for s in servers for b in s.seen) == [(1, 2), (3, 4), (5, 6), (7, 8)]
            # + first id
            assert sorted(b["sampling_params"]["seed"] for s in servers for b in s.seen) == [10, 13, 16, 19]
            assert [c.tag for c in out] == [(i, j) for i in range(4) for j in range(3)]
            assert all(c.token_ids == [5, 6] and c.logprobs == [-0.5, -0.25] and c.versions == [(3, 0, 2)] for c in out)
            # prompts submitted one at a time, as a pipeline does: the slow server, still busy, gets fewer
            for s in servers:
                s.seen.clear()
            ids = []
            for _ in range(8):
                ids += sampler.submit([[1]], n=1, max_tokens=2)
                time.sleep(0.1)
            sampler.wait_for(ids, timeout=30)
            assert len(servers[0].seen) >= 5 and len(servers[0].seen) + len(servers[1].seen) == 8
    finally:
        for server in servers:
            server.shutdown()


@pytest.mark.slow
def test_no_server_is_an_error_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with remote_sampler.RemoteSampler([f"http://127.0.0.1:{port}"], timeout=3) as sampler:
        # the refused connection is the error, not a timeout (the text, not a clock: a loaded machine is slow)
        with pytest.raises(SamplerError, match="failed") as refused:
            sampler.generate([[1, 2, 3]], n=1, max_tokens=4)
        assert "within" not in str(refused.value)
        with pytest.raises(SamplerError) as refused:
            sampler.pause()
        assert ("within" not in str(refused.value)
                and ("failed" in str(refused.value) or "is gone" in str(refused.value)))


# ---- faults on the real server: last, it ends the module's server ----

@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")
def test_a_hung_then_a_dead_server_is_an_error_within_the_timeout(server, tiny_path, tokenizer):
    prompts = _prompts(tokenizer, 8)
    # hung (SIGSTOP, the whole server: front end, engine core): the health watch gives up after `timeout`
    sampler = remote_sampler.RemoteSampler([server.url], tiny_path, timeout=3)
    ids, _ = _submit_long(sampler, tokenizer, server.url)
    os.killpg(server.process.pid, signal.SIGSTOP)
    try:
        # the health watch's error, not wait_for's own after 60 s
        with pytest.raises(SamplerError, match="did not answer /health within 3s"):
            sampler.wait_for(ids, timeout=60)
        with pytest.raises(SamplerError, match="did not answer"):  # the server stays failed for this client
            sampler.pause()
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    sampler.close()
    # a fresh client finds it answering again (30 s: a loaded machine's server, just continued, answers slowly)
    with remote_sampler.RemoteSampler([server.url], tiny_path, timeout=30) as sampler:
        assert len(sampler.generate(prompts[:2], n=1, max_tokens=4, **SAMPLING)) == 2
        # dead (killed mid-generation): an error from the server's side (the broken connections, or the health
        # watch when a loaded server was already too slow for /health), never wait_for's own 60 s deadline; the
        # text, not a clock, tells them apart (on a loaded machine even an immediate error takes seconds)
        ids, _ = _submit_long(sampler, tokenizer, server.url)
        os.killpg(server.process.pid, signal.SIGKILL)
        with pytest.raises(SamplerError) as broken:
            sampler.wait_for(ids, timeout=60)
        with pytest.raises(SamplerError) as refused:
            sampler.resume()
        for error in (broken.value, refused.value):
            assert str(server.url) in str(error) and "did not finish within" not in str(error), error


def test_a_server_keeps_its_statistics():
    """The local sampler turns vLLM's per-step statistics off (vllm_sampler.engine_settings); a
    server keeps them: its /metrics gauges are how users, and the tests above, watch it."""
    command = remote_sampler.server_command("m", 8000)
    assert "--disable-log-stats" not in command and "--logprobs-mode" in command
