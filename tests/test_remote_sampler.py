"""The sampler served by a real vLLM server on CPU (remote_sampler.py, `--sampler-url`): weights
pushed through vLLM's own RL endpoints and our gloo engine (loaded by the plugin entry point),
logprobs equal to the learner's, in-flight versions, pause/resume, a script trained through it,
and dead or hung servers as errors in seconds."""

import http.server
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import common
import remote_sampler
import tasks
from vllm_sampler import SamplerError

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.mkdtemp(prefix="fastrl-test-runs-"))
SAMPLING = dict(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def server_url(tiny_path):
    """One vLLM server (python -m vllm.entrypoints.openai.api_server) on the tiny model."""
    from vllm.utils.network_utils import get_open_port

    port = get_open_port()
    process = remote_sampler.start_server(tiny_path, port, log_path=str(WORK / "server.log"), max_model_len=128, seed=0)
    url = f"http://127.0.0.1:{port}"
    try:
        remote_sampler.wait_ready(url, timeout=300, process=process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _prompts(tokenizer, n):
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    return [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(n)]


def _learner_logprobs(model, completions, tokenizer):
    ids, attn, cmask = common.pad_prompt_completions([c.prompt_token_ids for c in completions], [c.token_ids for c in completions],
                                                     tokenizer.pad_token_id)
    with torch.no_grad():
        learner = common.token_logprobs(model, ids, attn, cmask, **SAMPLING)
    mask = cmask[:, 1:].bool()
    served = common.sampler_logprob_tensor(completions, [len(c.prompt_token_ids) for c in completions], mask.shape[1])
    return (learner - served)[mask].abs().max().item()


def test_push_then_the_servers_logprobs_are_the_learners(server_url, tiny_path, tokenizer):
    model = common.load_policy(tiny_path, "cpu")
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        sampler.init_weight_sync(model)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # the tied embedding too
        sampler.push_weights(7)
        out = sampler.generate(_prompts(tokenizer, 6), n=2, max_tokens=16, **SAMPLING)
        assert len(out) == 12 and all(c.versions == [(7, 0, len(c.token_ids))] for c in out)
        assert all(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out)
        assert _learner_logprobs(model, out, tokenizer) < 1e-4
        # pausing keeps the requests; they finish after resume
        sampler.pause()
        ids = sampler.submit(_prompts(tokenizer, 2), n=1, max_tokens=8, **SAMPLING)
        assert sampler.poll(timeout=1.5) == [] and sampler.pending == set(ids)
        sampler.resume()
        assert [c.request_id for c in sampler.wait_for(ids, timeout=60)] == ids and not sampler.pending


def test_an_in_flight_push_labels_both_versions(server_url, tiny_path, tokenizer):
    model = common.load_policy(tiny_path, "cpu")
    with remote_sampler.RemoteSampler([server_url], tiny_path) as sampler:
        sampler.init_weight_sync(model)
        sampler.push_weights(1)
        # ~25k tokens (seconds on this CPU): the push lands while most are running
        ids = sampler.submit(_prompts(tokenizer, 64), n=4, max_tokens=100, ignore_eos=True, **SAMPLING)
        time.sleep(0.5)
        sampler.push_weights(2)
        out = sampler.wait_for(ids, timeout=120)
        spans = [c.versions for c in out]
        assert all(s[0][0] == 1 and s[-1][0] == 2 and s[-1][2] == 100 for s in spans if len(s) > 1)
        assert any(len(s) == 2 for s in spans), spans  # continued with the new weights, not restarted


def test_a_script_trains_through_sampler_url(server_url):
    out = subprocess.run([sys.executable, str(ROOT / "rloo_kreuse.py"), "--sampler-url", server_url, "--exp-name", "pytest_remote",
                          "--k", "2", "--num-rounds", "2", "--num-prompts", "8", "--group-size", "4", "--eval-problems", "8",
                          "--eval-samples", "2"], cwd=WORK, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = common.read_metrics(WORK / out.stdout.split("run directory: ")[1].split()[0])
    rounds = [r for r in rows if "charts/reward" in r]
    assert [r["step"] for r in rounds] == [2, 4]
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rounds)  # the server samples with the pushed weights
    assert rounds[-1]["charts/lag_max"] == 0  # on-policy at every round's first k-step


# ---- faults and splitting, against stand-in servers (seconds, not a vLLM start-up each) ----

def test_no_server_is_an_error_at_once(tiny_path, tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    sampler = remote_sampler.RemoteSampler([f"http://127.0.0.1:{port}"], tiny_path, timeout=3)
    start = time.monotonic()
    with pytest.raises(SamplerError, match="failed"):
        sampler.generate(_prompts(tokenizer, 1), n=1, max_tokens=4)
    assert time.monotonic() - start < 10
    sampler.close()


def test_a_server_that_stops_answering_is_an_error_within_the_timeout(tiny_path, tokenizer):
    listener = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        sampler = remote_sampler.RemoteSampler([url], tiny_path, timeout=2)
        start = time.monotonic()
        with pytest.raises(SamplerError, match="timed out"):
            sampler.pause()
        assert time.monotonic() - start < 10
        sampler.close()
    finally:
        listener.close()


class _FakeGenerate(http.server.BaseHTTPRequestHandler):
    """/inference/v1/generate answering with two tokens, and counting the requests it saw."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body["request_id"])
        answer = {"request_id": body["request_id"], "choices": [{"index": 0, "finish_reason": "length", "token_ids": [5, 6],
                  "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -0.25}]},
                  "weight_versions": [{"version": "default", "start": 0, "end": 2}]}]}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_round_is_split_across_servers_prompt_by_prompt(tiny_path):
    servers = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeGenerate)
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        with remote_sampler.RemoteSampler(urls, tiny_path) as sampler:
            out = sampler.generate([[1, 2], [3, 4], [5, 6], [7, 8]], n=3, max_tokens=2)
        assert [len(s.seen) for s in servers] == [6, 6]  # 2 prompts x 3 samples each, a prompt's samples together
        assert [c.tag for c in out] == [(i, j) for i in range(4) for j in range(3)]
        assert all(c.token_ids == [5, 6] and c.logprobs == [-0.5, -0.25] and c.versions == [(0, 0, 2)] for c in out)
    finally:
        for server in servers:
            server.shutdown()
