"""The sampler served by running vLLM servers (`--sampler-url URL`, repeatable): `RemoteSampler` has
`vllm_sampler.Sampler`'s interface, over vLLM's own HTTP endpoints instead of a private pipe, so
the sampler can be a vLLM server with its own data and tensor parallelism, on another node.

Start a server on CPU (`start_server` below builds and prints this command; on a GPU drop the
CPU-only flags and use '{"backend": "nccl"}'):

    FASTRL_IN_PLACE_UPDATES=1 VLLM_SERVER_DEV_MODE=1 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
    python -m vllm.entrypoints.launchers.api_server.entry --model MODEL --host 127.0.0.1 --port 8000 \\
        --enable-scale-out --weight-transfer-config '{"backend": "gloo"}' --logprobs-mode processed_logprobs \\
        --seed 0 --dtype float32 --enforce-eager --max-num-seqs 256 --no-enable-prefix-caching \\
        --no-async-scheduling --kv-cache-memory-bytes 268435456

That is `vllm serve MODEL ...` with the same flags: the `vllm` console script fails under vllm-cpu
(vllm/entrypoints/cli/main.py:99 looks up the distribution "vllm"), `python -m
vllm.entrypoints.openai.api_server` is the same server under a deprecated name. The flags are
`vllm_sampler.engine_settings`, the local sampler's (processed logprobs: the logprob contract).
`VLLM_SERVER_DEV_MODE=1` adds the RL endpoints (/pause, /resume, /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /get_world_size:
vllm/entrypoints/rl/online/api_router.py; /reset_prefix_cache, /collective_rpc:
vllm/entrypoints/serve/dev/); `--enable-scale-out` adds token-in/token-out generation
(/inference/v1/generate, /inference/v1/abort_requests: vllm/entrypoints/scale_out/token_in_token_out/).
The server knows the "gloo" engine through our general-plugin entry point (pyproject.toml ->
`server_plugin` below, loaded by every vLLM process); `FASTRL_IN_PLACE_UPDATES=1` makes a CPU
server load pushes in place (without it: vLLM's layerwise reload, correct but slower).

What differs from the local sampler (vllm_sampler's contract holds otherwise):
- latency: each prompt's n samples are one HTTP request (JSON over TCP), and a prompt's samples
  come back together unless streamed (`stream_every`); a round is spread over the servers prompt
  by prompt, each prompt to the server with the fewest samples outstanding;
- a push pauses every server in mode "keep" without clearing its cache (running sequences wait
  with their KV cache), loads, labels the version and resumes: the local sampler's in-flight
  update (PipelineRL). `recompute_kv` then resets the running requests' KV
  (/reset_prefix_cache?reset_running_requests=true): they re-prefill with the new weights.
  `when_idle` pauses in mode "wait": requests already running finish with the old weights;
  requests still queued start with the new ones (the local sampler finishes those too first);
- streamed chunks cost the server a JSON message per token (vLLM's stream), so stream only
  what needs it;
- text is decoded here with the model's tokenizer (the server returns token ids);
- `peak_rss_mib()` is NaN: the servers' memory is their own (their /metrics);
- `close()` aborts our requests but leaves the servers running (not ours to stop).
Failures: every HTTP call has a timeout (connect: `timeout`; a call that legitimately takes long,
generation, a pause that drains, a weight load, is watched instead: while it runs, the server's
/health must answer within `timeout` every `heartbeat` seconds). A server that refuses
connections or dies is a SamplerError at once, one that stops answering (SIGSTOP, a frozen node)
within `timeout` + `heartbeat` seconds, never a hang; after that the RemoteSampler treats that
server as failed. Not detected: an engine core that freezes while its HTTP front end keeps
answering (vLLM's /health reports only a dead engine, vllm/entrypoints/serve/instrumentator/health.py).
Verified on CPU, with servers on the learner's host (tests/test_remote_sampler.py). On paper: NCCL to
GPU servers and data-parallel servers (rank offsets from /get_world_size, the same protocol); gloo
to a server on another host needs its workers' gloo device bound to their own address
(gloo_transfer.gloo_group binds every rank's to the learner's `master_address` today).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from fastrl.vllm_sampler import Completion, SamplerConfig, SamplerError, engine_settings
from fastrl.weight_sync import WeightPusher

# vLLM's token-in/token-out server prefixes the caller's request id
# (vllm/entrypoints/scale_out/token_in_token_out/serving.py:194-196): aborts must name that id
ENGINE_ID_PREFIX = "generate-tokens-"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


# -------------------------------------------------------------------------------------------------
# Starting a server (tests, benchmark, or by hand)
# -------------------------------------------------------------------------------------------------

def server_env(on_cpu: bool = True) -> dict[str, str]:
    """The environment variables a server needs (on top of the caller's)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if on_cpu:
        env.update(FASTRL_IN_PLACE_UPDATES="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
    return env


def server_command(model: str, port: int, host: str = "127.0.0.1", placement: str = "cpu", backend: str | None = None,
                   extra_args: tuple[str, ...] = (), **config) -> list[str]:
    """The command line of a vLLM server this module can sample from: the local sampler's engine
    settings (vllm_sampler.engine_settings, `config` are SamplerConfig fields: seed, max_model_len,
    dtype, kv_cache_bytes, max_num_seqs, ...) as flags, plus the RL and scale-out endpoints and the
    weight-transfer backend ("gloo" on CPU, "nccl" on a GPU of its own)."""
    settings = engine_settings(SamplerConfig(model=model, placement=placement, **config), placement)
    # a server keeps its statistics: /metrics is how its users (and our tests) watch it
    settings.pop("disable_log_stats")
    backend = backend or ("gloo" if placement == "cpu" else "nccl")
    command = [sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port), "--enable-scale-out",
               "--weight-transfer-config", json.dumps({"backend": backend})]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + flag[2:])
        else:
            command += [flag, str(value)]
    return command + list(extra_args)


def start_server(model_path: str, port: int, host: str = "127.0.0.1", log_path: str | None = None,
                 **settings) -> subprocess.Popen:
    """Start a vLLM server on this machine for RemoteSampler (the tests and the benchmark use it;
    users start theirs by hand, or on another node: the printed command). `settings`: see
    server_command. Returns at once (wait_ready waits); the server is the leader of a process
    group of its own (stop_server ends the whole group)."""
    command = server_command(model_path, port, host=host, **settings)
    extra_env = server_env(on_cpu=settings.get("placement", "cpu") == "cpu")
    print("starting a vLLM server: " + " ".join(f"{k}={v}" for k, v in extra_env.items()) + " "
          + shlex.join(command), flush=True)
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(command, env={**os.environ, **extra_env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        if log_path:
            log.close()


def wait_ready(url: str, timeout: float = 300.0, process: subprocess.Popen | None = None,
               log_path: str | None = None) -> None:
    """Wait until the server at url answers /health with 200; a SamplerError if it does not within
    `timeout` or its process ends first (with the end of its log when `log_path` is given)."""
    import urllib.error
    import urllib.request

    def log_tail() -> str:
        if not log_path:
            return ""
        try:
            with open(log_path, "rb") as f:
                return "\n" + f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SamplerError(f"the vLLM server for {url} exited with code {process.returncode} while "
                               f"starting{log_tail()}")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SamplerError(f"the vLLM server at {url} did not become ready within {timeout:.0f}s{log_tail()}")


def stop_server(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """End a server started by start_server: its whole process group (API server, engine core,
    workers), stopped or not."""
    if process.poll() is None or _group_alive(process.pid):
        for sig in (signal.SIGCONT, signal.SIGTERM):
            _signal_group(process.pid, sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while _group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(process.pid, signal.SIGKILL)
        process.wait(5)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def server_plugin() -> None:
    """vLLM general plugin (pyproject.toml, entry-point group "vllm.general_plugins"), run by
    vllm/plugins/__init__.py load_general_plugins in every vLLM process on this Python: the API
    server (vllm/engine/arg_utils.py:906), the engine core (vllm/v1/engine/core.py:129) and each
    worker before it builds the model (vllm/v1/worker/worker_base.py:276). Registers our weight
    engines (weight_sync.server_plugin; with FASTRL_IN_PLACE_UPDATES=1 a CPU worker also keeps its
    linear weights, vllm/model_executor/layers/linear.py:214-216 looks the packing function up at
    load time) and the worker method `fastrl_weight_load_path` for /collective_rpc (a method name
    is all that endpoint takes, vllm/v1/serial_utils.py:499-505 run_method). Cheap and idempotent."""
    from fastrl import gloo_transfer, weight_sync

    weight_sync.server_plugin()
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if not hasattr(WorkerWrapperBase, "fastrl_weight_load_path"):
        WorkerWrapperBase.fastrl_weight_load_path = lambda self: gloo_transfer.weight_load_path(self.worker)


# -------------------------------------------------------------------------------------------------
# The client
# -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Group:
    """One HTTP request: one prompt's n samples (vLLM's parallel sampling, choices by index)."""

    url: str
    server_id: str
    ids: list[str]
    prompt: list[int]
    params: dict
    tags: list[Any]
    stream_every: int  # 0: not streamed
    task: Any = None
    done: set = dataclasses.field(default_factory=set)  # indices whose final completion arrived
    # streamed: per index [tokens, logprobs, sent]
    streams: dict = dataclasses.field(default_factory=dict)


class RemoteSampler(WeightPusher):
    """`vllm_sampler.Sampler`'s interface, served by the vLLM servers at `urls` (see the module
    docstring for what differs). `model_path` gives the tokenizer for `Completion.text` (None: no
    text). `timeout`: seconds for a connection or a short call, and for a server to answer its
    health probe while a long call runs. `master_address`: this machine's address as the servers
    see it, for the weight group (default FASTRL_LEARNER_ADDRESS or 127.0.0.1). push_weights and
    wait_for_push come from weight_sync.WeightPusher."""

    placement = "server"

    def __init__(self, urls: list[str], model_path: str | None = None, timeout: float = 30.0,
                 master_address: str | None = None,
                 heartbeat: float = 1.0, push_timeout: float = 600.0):
        import aiohttp  # a dependency of vLLM (vllm-cpu's METADATA: aiohttp>=3.14.3)

        if not urls:
            raise ValueError("RemoteSampler needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"the same server twice in {urls}")
        self.timeout, self.heartbeat, self.push_timeout = float(timeout), float(heartbeat), float(push_timeout)
        self.master_address = master_address or os.environ.get("FASTRL_LEARNER_ADDRESS", "127.0.0.1")
        self.tokenizer = None
        if model_path is not None:
            from fastrl.util import load_tokenizer

            self.tokenizer = load_tokenizer(model_path)
        self.pending: set[str] = set()
        self.version = 0
        self.paused = False
        self._outputs: list[Completion] = []  # received, not yet handed out (learner thread only)
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # loop thread -> learner
        self._aborted: set[str] = set()
        self._groups: dict[str, _Group] = {}  # request id -> its group (until handed out or aborted)
        self._lock = threading.Lock()  # _groups, _load, _aborted
        self._load = {u: 0 for u in self.urls}  # samples outstanding per server
        self._next_id = itertools.count()
        self._rotation = itertools.cycle(range(len(self.urls)))
        self._tag = f"fastrl-{os.getpid()}-{id(self):x}-"
        self._failed: dict[str, SamplerError] = {}  # server -> why it is considered gone
        self._busy = {u: 0 for u in self.urls}  # calls in flight per server (the monitor probes while > 0)
        self._next_version, self._recompute_kv, self._when_idle = 0, False, False
        self._world_sizes: list[int] | None = None
        self._closed = False
        self._aiohttp = aiohttp
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-sampler", daemon=True)
        self._thread.start()
        self._run(self._open(), timeout=30)

    async def _open(self) -> None:
        aiohttp = self._aiohttp
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, connect=self.timeout),
            read_bufsize=2**22)  # one streamed line can hold many tokens' logprobs
        self._dead = {u: asyncio.Event() for u in self.urls}
        self._monitors = {u: asyncio.ensure_future(self._monitor(u)) for u in self.urls}

    # -- plumbing: the event loop thread, HTTP, liveness --
    def _run(self, coro, timeout: float | None = None) -> Any:
        """Run a coroutine on the loop thread and wait for it (its own deadlines bound it; `timeout`
        is a backstop)."""
        if self._closed:
            coro.close()
            raise SamplerError("the RemoteSampler is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SamplerError(f"a call to the vLLM servers did not finish within {timeout:.0f}s") from None
        except SamplerError:
            raise
        except Exception as e:
            raise SamplerError(f"a call to the vLLM servers failed: {e!r}") from e

    def _fail(self, url: str, error: SamplerError) -> None:
        if url not in self._failed:
            self._failed[url] = error
            self._dead[url].set()

    async def _monitor(self, url: str) -> None:
        """While a call to `url` is in flight, probe its /health every `heartbeat` seconds: no answer
        within `timeout`, or an answer other than 200 (503: its engine died), fails the server."""
        aiohttp = self._aiohttp
        while url not in self._failed:
            await asyncio.sleep(self.heartbeat)
            if not self._busy[url]:
                continue
            try:
                async with self._session.get(url + "/health",
                                             timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                    await response.read()
                    if response.status != 200:
                        self._fail(url, SamplerError(f"vLLM server {url} reports itself unhealthy (/health answered "
                                                     f"{response.status}; 503: its engine died)"))
            except asyncio.TimeoutError:
                self._fail(url, SamplerError(f"vLLM server {url} did not answer /health within {self.timeout:.0f}s "
                                             "(stopped, frozen or overloaded?)"))
            except (aiohttp.ClientError, OSError) as e:
                self._fail(url, SamplerError(f"vLLM server {url} is gone ({e!r})"))

    async def _guard(self, url: str, coro, what: str):
        """Run `coro` (a call to `url`) unless or until that server fails."""
        if url in self._failed:
            coro.close()
            raise SamplerError(f"{what}: {self._failed[url]}")
        task = asyncio.ensure_future(coro)
        dead = asyncio.ensure_future(self._dead[url].wait())
        self._busy[url] += 1
        try:
            await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            raise SamplerError(f"{what}: {self._failed[url]}")
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._busy[url] -= 1
            dead.cancel()

    async def _http(self, url: str, path: str, body: dict | None = None, query: dict | None = None,
                    method: str = "POST",
                    long: bool = False) -> Any:
        """One call to one server: JSON in, JSON out. Short calls have `timeout` in all; `long` ones
        (a drain, a load, a rendezvous) no total but the health watch."""
        aiohttp = self._aiohttp
        what = f"vLLM server {url}{path}"

        async def call():
            try:
                async with self._session.request(method, url + path, json=body, params=query,
                                                 timeout=aiohttp.ClientTimeout(total=None if long else self.timeout,
                                                                               sock_connect=self.timeout)) as response:
                    text = await response.read()
                    if response.status >= 400:
                        raise SamplerError(f"{what} answered {response.status}: {text[:1500].decode(errors='replace')}")
            except asyncio.TimeoutError:
                raise SamplerError(f"{what} did not answer within {self.timeout:.0f}s") from None
            except (aiohttp.ClientError, OSError) as e:
                raise SamplerError(f"{what} failed: {e!r}") from e
            return json.loads(text) if text else None

        return await self._guard(url, call(), what)

    async def _all(self, path: str, body: dict | list | None = None, query: dict | None = None, long: bool = False,
                   method: str = "POST") -> list:
        """The same call on every server at once (a pause or a push must reach all of them); the
        first failure is raised once all have ended."""
        bodies = body if isinstance(body, list) else [body] * len(self.urls)
        results = await asyncio.gather(*(self._http(u, path, b, query, method, long) for u,
                                         b in zip(self.urls, bodies)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def _call_all(self, path: str, body=None, query: dict | None = None, long: bool = False,
                  method: str = "POST") -> list:
        return self._run(self._all(path, body, query, long, method))

    # -- requests --
    def _pick_server(self, samples: int) -> str:
        """The server with the fewest samples outstanding (ties in rotation), charged `samples`."""
        with self._lock:
            start = next(self._rotation)
            order = self.urls[start:] + self.urls[:start]
            url = min(order, key=lambda u: self._load[u])
            self._load[url] += samples
        return url

    def submit(self, prompts: list[list[int]], n: int = 1, tags: list[Any] | None = None, stream_every: int = 0,
               per_prompt: list[dict] | None = None, **sampling) -> list[str]:
        """As Sampler.submit: queue n samples of each prompt and return their ids ("0", "1", ...) at
        once. Each prompt's n samples are one request to one server (vLLM's parallel sampling: with
        a seed, sample j gets seed + j, vllm/v1/engine/parallel_sampling.py:69-82, so the seeds are
        the local sampler's)."""
        if self._closed:
            raise SamplerError("the RemoteSampler is closed")
        base = {"logprobs": 0, "max_tokens": 16, **sampling}  # 16: SamplingParams' default, as the local sampler
        ids: list[str] = []
        groups = []
        for i, prompt in enumerate(prompts):
            rids = [str(next(self._next_id)) for _ in range(n)]
            group_tags = [((tags[i], j) if n > 1 else tags[i]) if tags is not None else (i, j) for j in range(n)]
            params = dict(base, **(per_prompt[i] if per_prompt else {}), n=n)
            if params.get("seed") is not None:
                explicit = bool(per_prompt) and per_prompt[i].get("seed") is not None
                params["seed"] = params["seed"] + (0 if explicit else int(rids[0]))  # + j by vLLM per sample
            url = self._pick_server(n)
            group = _Group(url, self._tag + rids[0], rids, list(prompt), params, group_tags, int(stream_every))
            with self._lock:
                for rid in rids:
                    self._groups[rid] = group
            groups.append(group)
            ids += rids
        self.pending.update(ids)
        self._loop.call_soon_threadsafe(self._start_groups, groups)
        return ids

    def _start_groups(self, groups: list[_Group]) -> None:
        for group in groups:
            if all(rid in self._aborted for rid in group.ids):  # aborted before it started
                self._finish_group(group)
                continue
            group.task = asyncio.ensure_future(self._generate(group))

    def _finish_group(self, group: _Group) -> None:
        with self._lock:
            self._load[group.url] -= len(group.ids)

    async def _generate(self, group: _Group) -> None:
        body = {"request_id": group.server_id, "token_ids": group.prompt, "sampling_params": group.params,
                "stream": bool(group.stream_every)}
        try:
            await self._guard(group.url, self._generate_call(group, body), f"generation on vLLM server {group.url}")
        except asyncio.CancelledError:
            pass  # aborted, or closing
        except SamplerError as e:
            self._results.put(e)
        except Exception as e:
            self._results.put(SamplerError(f"generation on vLLM server {group.url} failed: {e!r}"))
        finally:
            self._finish_group(group)

    async def _generate_call(self, group: _Group, body: dict) -> None:
        aiohttp = self._aiohttp
        url = group.url + "/inference/v1/generate"
        try:
            # no read deadline: a generation may take minutes, or wait through a pause; the health
            # watch (_guard) covers a server that stops answering
            async with self._session.post(
                    url, json=body, timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)) as r:
                if r.status >= 400:
                    text = await r.read()
                    raise SamplerError(f"vLLM server {url} answered {r.status}: {text[:1500].decode(errors='replace')}")
                if not group.stream_every:
                    out = json.loads(await r.read())
                    for choice in out["choices"]:
                        tokens = choice.get("token_ids") or []
                        self._emit(group, choice["index"], tokens, _choice_logprobs(choice),
                                   choice.get("finish_reason"),
                                   choice.get("weight_versions"))
                    return
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise SamplerError(f"vLLM server {url} failed mid-stream: {chunk['error']}")
                    for choice in chunk.get("choices") or []:
                        self._stream_choice(group, choice)
        except (aiohttp.ClientError, OSError) as e:
            raise SamplerError(f"vLLM server {url} failed: {e!r}") from e
        missing = [group.ids[i] for i in range(len(group.ids)) if i not in group.done]
        if missing and not all(rid in self._aborted for rid in missing):
            raise SamplerError(f"vLLM server {url} ended the response without requests {missing}")

    def _stream_choice(self, group: _Group, choice: dict) -> None:
        """One streamed delta of sample `index` (vLLM sends only the new tokens; the weight-version
        spans come with the last one, protocol.py GenerateStreamChoiceBase)."""
        index = choice["index"]
        state = group.streams.setdefault(index, [[], [], 0])
        tokens, logprobs = state[0], state[1]
        tokens += choice.get("token_ids") or []
        logprobs += _choice_logprobs(choice)
        if choice.get("finish_reason") is not None:
            self._emit(group, index, tokens, logprobs, choice["finish_reason"], choice.get("weight_versions"))
        elif len(tokens) - state[2] >= group.stream_every:
            rid = group.ids[index]
            if rid not in self._aborted:
                self._results.put(Completion(rid, [], tokens[state[2]:], logprobs[state[2]:], None, [], "",
                                             group.tags[index],
                                             finished=False, finished_at=time.time()))
            state[2] = len(tokens)

    def _emit(self, group: _Group, index: int, tokens: list[int], logprobs: list[float], finish_reason, spans) -> None:
        group.done.add(index)
        rid = group.ids[index]
        if rid in self._aborted:
            return
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        self._results.put(Completion(rid, group.prompt, list(tokens), list(logprobs), finish_reason,
                                     _version_spans(spans, len(tokens)),
                                     text, group.tags[index], finished_at=time.time()))

    def _receive(self, timeout: float) -> None:
        """Move what has arrived into _outputs, waiting up to `timeout` for the first item; a
        failure that arrived is raised."""
        try:
            items = [self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()]
        except queue.Empty:
            return
        # what is there now, not what keeps arriving while we take it (a stream could keep us here)
        for _ in range(self._results.qsize()):
            items.append(self._results.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item.request_id not in self._aborted:
                if item.finished:
                    self.pending.discard(item.request_id)
                    with self._lock:
                        self._groups.pop(item.request_id, None)
                self._outputs.append(item)

    def poll(self, timeout: float = 0.0, min_items: int = 1) -> list[Completion]:
        """What has arrived so far (finished completions and streamed chunks), waiting up to
        `timeout` seconds for at least `min_items`."""
        deadline = time.monotonic() + timeout
        self._receive(0)
        while len(self._outputs) < min_items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._receive(min(left, 0.5))
        out, self._outputs = self._outputs, []
        return out

    def wait_for(self, request_ids: list[str], timeout: float = 3600.0) -> list[Completion]:
        """Block until these requests have finished; returns them in that order. Other items that
        arrive meanwhile stay queued for a later poll()."""
        wanted = set(request_ids)
        got: dict[str, Completion] = {}
        deadline = time.monotonic() + timeout
        while True:
            self._receive(0)
            keep = []
            for c in self._outputs:
                if c.finished and c.request_id in wanted:
                    got[c.request_id] = c
                else:
                    keep.append(c)
            self._outputs = keep
            if len(got) == len(wanted):
                return [got[r] for r in request_ids]
            left = deadline - time.monotonic()
            if left <= 0:
                raise SamplerError(f"{len(wanted) - len(got)} requests did not finish within {timeout:.0f}s")
            if not (wanted - set(got)) <= (self.pending | set(got)):
                raise SamplerError(f"unknown or aborted request ids: {sorted(wanted - self.pending - set(got))[:5]}")
            self._receive(min(left, 0.5))

    def generate(self, prompts: list[list[int]], n: int = 1, timeout: float = 3600.0, **sampling) -> list[Completion]:
        """Blocking: n samples per prompt, in prompt-major order (tag = (prompt, sample))."""
        return self.wait_for(self.submit(prompts, n=n, **sampling), timeout)

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests; whatever they generated is discarded. A prompt's request is aborted
        on its server once all its samples are (vLLM aborts on a client disconnect too,
        vllm/entrypoints/serve/utils/api_utils.py with_cancellation)."""
        request_ids = [r for r in request_ids if r in self.pending]
        if not request_ids:
            return
        stop: dict[int, _Group] = {}
        with self._lock:
            self._aborted.update(request_ids)
            for rid in request_ids:
                group = self._groups.pop(rid, None)
                if group is not None and all(r in self._aborted or i in group.done for i, r in enumerate(group.ids)):
                    stop[id(group)] = group
        self.pending.difference_update(request_ids)
        self._outputs = [c for c in self._outputs if c.request_id not in self._aborted]
        if stop:
            self._run(self._abort_groups(list(stop.values())))

    async def _abort_groups(self, groups: list[_Group]) -> None:
        by_server: dict[str, list[str]] = {}
        for group in groups:
            if group.task is not None:
                group.task.cancel()
            by_server.setdefault(group.url, []).append(ENGINE_ID_PREFIX + group.server_id)
        calls = [self._http(url, "/inference/v1/abort_requests", {"request_ids": ids})
                 for url, ids in by_server.items() if url not in self._failed]  # a failed server has nothing to abort
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def set_stream_every(self, chunk_tokens: int) -> None:
        """Change the chunk size of every streamed request, including those already running (the
        requests submitted without streaming stay unstreamed)."""
        chunk_tokens = int(chunk_tokens)

        def apply():
            with self._lock:
                groups = {id(g): g for g in self._groups.values()}
            for group in groups.values():
                if group.stream_every:
                    group.stream_every = chunk_tokens

        self._loop.call_soon_threadsafe(apply)

    def pause(self) -> None:
        """Stop decoding on every server; running sequences keep their KV cache, new requests queue
        (mode "keep", cache not cleared: the engine clears it whatever the mode when clear_cache is
        true, vllm/v1/engine/core.py:2094-2098 -> _finish_pause 914-919 -> _reset_caches 898-912, and
        that preempts the running sequences, which would then re-prefill: the route's docstring,
        api_router.py:46-47, says it is ignored for "keep"; the engine does not ignore it)."""
        self._call_all("/pause", query={"mode": "keep", "clear_cache": "false"})
        self.paused = True

    def resume(self) -> None:
        self._call_all("/resume")
        self.paused = False

    def num_unfinished(self) -> int:
        """Our requests not yet handed out (the servers may serve others too)."""
        return len(self.pending)

    def peak_rss_mib(self) -> float:
        """NaN: a server's memory is its own (see its /metrics)."""
        return float("nan")

    def weight_load_path(self) -> str:
        """How the servers load a push: "in place" or "layerwise" (after init_weight_sync), through
        the worker method our plugin adds (server_plugin); "unknown" for a server without it."""
        try:
            answers = self._call_all("/collective_rpc", {"method": "fastrl_weight_load_path"})
        except SamplerError as e:
            if "fastrl_weight_load_path" in str(e) or "not implemented" in str(e).lower():
                return "unknown"
            raise
        paths = {p for a in answers for p in (a or {}).get("results", [])}
        return paths.pop() if len(paths) == 1 else "mixed: " + ", ".join(sorted(paths))

    # -- weight sync: vLLM's 4-method client protocol (distributed/weight_transfer/base.py), fanned out --
    def init_weight_transfer_engine(self, init_info) -> None:
        """Each server's workers join the learner's group at their own rank offset: the trainer
        engines pass rank_offset 1 (gloo_transfer.py trainer_init; vLLM's NCCL one too,
        nccl_engine.py:294-303), right for one server only; the group spans 1 + every server's
        workers (world_size from /get_world_size, api_router.py:266-286)."""
        if dataclasses.is_dataclass(init_info):
            init_info = dataclasses.asdict(init_info)
        bodies, offset = [], 1
        for size in self._world_sizes:
            bodies.append({"init_info": dict(init_info, rank_offset=offset, world_size=1 + sum(self._world_sizes))})
            offset += size
        self._call_all("/init_weight_transfer_engine", bodies, long=True)

    def start_weight_update(self) -> None:
        if self._when_idle and not self.paused:  # running requests finish with the old weights first
            self._call_all("/pause", query={"mode": "wait", "clear_cache": "false"}, long=True)
        elif not self.paused:  # in flight: running sequences wait with their KV cache
            self._call_all("/pause", query={"mode": "keep", "clear_cache": "false"})
        self._call_all("/start_weight_update", long=True)

    def update_weights(self, update_info) -> None:
        # runs while the learner broadcasts: the servers' workers receive inside this call. JSON as
        # vLLM's own HTTP client sends it (vllm/distributed/weight_transfer/clients.py:87-90)
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        self._call_all("/update_weights", {"update_info": _json_safe_update_payload(update_info)}, long=True)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = str(self._next_version if weight_version is None else weight_version)
        # finish, then label the new weights (vllm/v1/engine/async_llm.py:1351-1355 finish_weight_update)
        self._call_all("/finish_weight_update", {"weight_version": version}, long=True)
        if self._recompute_kv:  # running requests drop their KV and re-prefill with the new weights
            # (vllm/v1/core/sched/scheduler.py:2840-2875 reset_prefix_cache(reset_running_requests=True))
            self._call_all("/reset_prefix_cache", query={"reset_running_requests": "true"})
        if not self.paused:  # a pause the caller made stays until its resume()
            self._call_all("/resume")

    def wait_ready(self) -> "RemoteSampler":
        """The servers were found at construction: nothing to wait for (Sampler's interface)."""
        return self

    def init_weight_sync(self, model: torch.nn.Module, background: bool = False, rounding: str = "nearest",
                         seed: int = 0, probe=None, round_to: torch.dtype | None = None) -> None:
        """Open the weight group between the learner (rank 0, its gloo device on `master_address`)
        and every server's workers: gloo on CPU (servers started with '{"backend": "gloo"}'),
        vLLM's NCCL when the learner has a GPU ('{"backend": "nccl"}',
        vllm/distributed/weight_transfer/nccl_engine.py, the same client protocol). `background`:
        pushes send from a snapshot copy while training goes on, as Sampler's do. The weights are cast on the
        learner to the servers' dtype (weight_dtype), by `rounding`, as the local sampler's are (`probe` then
        measures what the servers hold); where a server does not say its dtype, they go as they are, each server
        rounds them to nearest (its loader's copy_), and a rounding other than "nearest" is refused."""
        dtype = self.weight_dtype()
        if dtype is None:  # the server rounds what it loads itself
            if rounding not in ("auto", "nearest") or round_to is not None:
                raise ValueError(f"--push-rounding {rounding} / --push-round-to: the server (--sampler-url) does not "
                                 "say its dtype (/server_info) and rounds what it loads itself; use --push-rounding "
                                 "nearest")
            print("note: the server does not say its dtype (/server_info): it rounds the pushed weights to nearest "
                  "itself, and charts/push_* measure what was sent")
        answers = self._call_all("/get_world_size", method="GET")
        self._world_sizes = [int(a["world_size"]) for a in answers]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._start_weight_engine(backend, model, background, self.master_address,
                                  world_size=1 + sum(self._world_sizes), dtype=dtype, rounding=rounding, seed=seed,
                                  probe=probe, round_to=round_to)

    def weight_dtype(self) -> torch.dtype | None:
        """The servers' weight dtype, their model_config.dtype (/server_info, a VLLM_SERVER_DEV_MODE endpoint:
        vllm/entrypoints/serve/dev/server_info/api_router.py:43-59); None where a server does not answer it. Servers
        that disagree are an error: one push is cast for all of them."""
        try:
            answers = self._call_all("/server_info", query={"config_format": "json"}, method="GET")
            names = {str(a["vllm_config"]["model_config"]["dtype"]).removeprefix("torch.") for a in answers}
        except (SamplerError, KeyError, TypeError):
            return None
        if len(names) != 1:
            raise SamplerError(f"the servers hold their weights in different dtypes ({', '.join(sorted(names))}): "
                               "start them with the same --dtype")
        dtype = getattr(torch, names.pop(), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _push_deadline(self) -> float:
        return 3600.0 if self._when_idle else self.push_timeout

    def _send_weights(self, version: int, recompute_kv: bool, when_idle: bool) -> None:
        """One whole push, watched: the learner's side of a collective has only the group's own
        timeout, so a server that fails meanwhile is reported from here at once (the stuck
        transfer thread is left behind; the run is over anyway)."""
        self._next_version, self._recompute_kv, self._when_idle = version, recompute_kv, when_idle

        def check():
            if self._failed:
                raise SamplerError(f"weight push failed: {next(iter(self._failed.values()))}")

        try:
            self._watched(self._weight_engine.send_weights, check, poll=0.1)
        except SamplerError:
            raise
        except Exception as e:
            raise SamplerError(f"weight push to the vLLM servers failed: {e!r}") from e
        self.version = version

    # -- lifecycle --
    def close(self) -> None:
        """Abort our requests and close the connections; the servers keep running. Safe to call
        twice and from error paths."""
        if self._closed:
            return
        try:
            if self.pending:
                self.abort(list(self.pending))
        except SamplerError:
            pass
        self._closed = True

        async def shutdown():
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()
            await self._session.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._close_weight_sync()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _choice_logprobs(choice: dict) -> list[float]:
    """The sampled tokens' logprobs of one choice (GenerateLogProbs.content, protocol.py)."""
    return [c["logprob"] for c in ((choice.get("logprobs") or {}).get("content") or [])]


def _version_spans(spans, num_tokens: int) -> list[tuple[int, int, int]]:
    """vLLM's weight_versions spans ({"version", "start", "end"}, vllm/outputs.py WeightVersionSpan)
    as (policy version, start, end); the weights a server started with are labelled "default":
    policy version 0 (as vllm_sampler.version_spans)."""
    out = []
    for span in spans or [{"version": "default", "start": 0, "end": num_tokens}]:
        version, start, end = (span["version"], span["start"], span["end"]) if isinstance(span, dict) else span
        try:
            out.append((0 if version == "default" else int(version), int(start), int(end)))
        except ValueError:
            raise SamplerError(f"a vLLM server labelled its weights {version!r}: not a policy version (another client "
                               "pushing to the same server?)") from None
    return out
