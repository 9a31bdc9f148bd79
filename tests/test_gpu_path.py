"""The GPU path, tested where it can be on a CPU machine: device choice and engine settings per
placement as pure functions, and vLLM's NCCL / IPC weight-transfer types built from the installed
vLLM (an API change in a version bump fails here). Tests that need CUDA are marked `gpu`."""

import contextlib
import copy
import os
import threading
import time

import pytest
import torch

import common
import tasks
import vllm_sampler
import weight_sync

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("placement, visible, count, expected", [
    ("cpu", None, 0, None),
    ("colocate", None, 1, "0"),
    ("separate", None, 2, "1"),
    ("colocate", "2,3", 8, "2"),  # the user's CUDA_VISIBLE_DEVICES, not the literal "0"
    ("separate", "2,3", 8, "3"),
    ("colocate", "GPU-8f0c1a2b,GPU-77aa", 2, "GPU-8f0c1a2b"),  # UUIDs pass through (IPC handles carry them)
    ("separate", " 5 , 6 ", 8, "6"),
])
def test_sampler_device_follows_the_visible_devices(placement, visible, count, expected):
    assert vllm_sampler.sampler_cuda_device(placement, visible, count) == expected


def test_separate_placement_needs_two_visible_gpus():
    with pytest.raises(SystemExit, match="error: --placement: separate needs 2"):
        vllm_sampler.sampler_cuda_device("separate", "4", 8)


@pytest.mark.parametrize("placement, eager, dtype, memory", [
    ("cpu", True, "float32", ("kv_cache_memory_bytes", 256 * 2**20)),
    ("colocate", False, "bfloat16", ("gpu_memory_utilization", 0.3)),
    ("separate", False, "bfloat16", ("gpu_memory_utilization", 0.85)),
])
def test_engine_settings_per_placement(placement, eager, dtype, memory):
    settings = vllm_sampler.engine_settings(vllm_sampler.SamplerConfig(model="m"), placement)
    assert settings["enforce_eager"] is eager and settings["dtype"] == dtype and settings[memory[0]] == memory[1]
    assert settings["async_scheduling"] is False  # updates between step() calls must not race a running batch
    assert settings["logprobs_mode"] == "processed_logprobs"
    assert settings["disable_log_stats"] is True  # as vLLM's LLM: collecting them cost the sampler ~5%
    if placement == "cpu":  # a known context on CPU: prefills are never split (seeded requests need it)
        known = vllm_sampler.engine_settings(vllm_sampler.SamplerConfig(model="m", max_model_len=4096), placement)
        assert known["enable_chunked_prefill"] is False and known["max_num_batched_tokens"] >= 4096
    from vllm import EngineArgs  # every key is one vLLM knows
    from vllm.config import WeightTransferConfig

    EngineArgs(**settings, weight_transfer_config=WeightTransferConfig(backend=vllm_sampler.weight_backend(placement)))


def test_sampler_environment_pins_the_v1_model_runner(monkeypatch):
    """vLLM defaults to its V2 model runner on CUDA; the sampler pins V1, the CPU path (engine_settings)."""
    env = vllm_sampler.sampler_environment("3")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in vllm_sampler.sampler_environment(None)
    import vllm.envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env["VLLM_USE_V2_MODEL_RUNNER"])
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is False  # what vLLM's use_v2_model_runner returns first (vllm/config/vllm.py)


def test_top_k_top_p_is_pinned_to_pytorch_even_where_triton_works(monkeypatch):
    """Where Triton works (CUDA), vLLM's apply_top_k_top_p takes the Triton kernel; pinned, it is the
    PyTorch one whatever HAS_TRITON says. The Triton kernel is a fake here that records its calls."""
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    monkeypatch.setattr(topk_topp, "apply_top_k_top_p", topk_topp.apply_top_k_top_p)  # restored after the test
    calls = []
    monkeypatch.setattr(topk_topp, "HAS_TRITON", True)
    monkeypatch.setattr(topk_topp, "apply_top_k_top_p_triton", lambda *a: calls.append(a) or a[0], raising=False)
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    k, p = torch.tensor([5, 50, 10, 3]), torch.tensor([0.9, 0.5, 1.0, 0.95])
    topk_topp.apply_top_k_top_p(logits.clone(), k, p)
    assert len(calls) == 1  # unpinned, the fake "Triton" kernel ran
    vllm_sampler.pin_pytorch_top_k_top_p()
    vllm_sampler.pin_pytorch_top_k_top_p()  # idempotent
    pinned = topk_topp.apply_top_k_top_p(logits.clone(), k, p)
    assert len(calls) == 1
    expected = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
    assert torch.equal(pinned, expected) and torch.isinf(pinned).any()
    assert topk_topp.apply_top_k_top_p(logits, None, None) is logits


def test_engine_settings_honour_explicit_choices():
    config = vllm_sampler.SamplerConfig(model="m", dtype="float16", gpu_memory_utilization=0.5)
    settings = vllm_sampler.engine_settings(config, "separate")
    assert settings["dtype"] == "float16" and settings["gpu_memory_utilization"] == 0.5


def test_packed_push_buffer_is_sized_to_the_largest_tensor():
    """vLLM's fixed 1 GiB staging buffer, sized instead to what the push needs (at least its largest tensor)."""
    qwen_embedding = 151936 * 896 * 2  # Qwen2.5-0.5B's embedding in bf16: 272 MB
    assert weight_sync.packed_buffer_bytes([qwen_embedding, 896 * 4864 * 2, 896 * 2]) == qwen_embedding
    assert weight_sync.packed_buffer_bytes([1000, 3000]) == 4000  # a small model: one chunk, no bigger than it
    assert weight_sync.packed_buffer_bytes([2**20] * 200) == weight_sync.MIN_PACKED_BYTES  # many small ones
    assert weight_sync.trainer_init_info("ipc", packed_bytes=4000).packed_buffer_size_bytes == 4000
    nccl = weight_sync.trainer_init_info("nccl", packed_bytes=4000)
    assert nccl.packed_buffer_size_bytes == 4000 and nccl.packed


def test_pushes_go_in_the_samplers_dtype_rounded_as_vllms_loader_rounds():
    """A bf16 sampler gets bf16 tensors, rounded exactly as vLLM's loader would have rounded the fp32 ones;
    an fp32 sampler gets the parameters themselves (CPU runs unchanged, bit for bit)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Embedding(16, 64))
    with torch.no_grad():
        model[0].weight.mul_(1 + 1e-3 * torch.randn_like(model[0].weight))  # values bf16 cannot hold
    source = weight_sync.sampler_source(model, torch.bfloat16)
    assert [(m.name, m.dtype) for m in source.metadata()] == [(n, torch.bfloat16) for n, _ in model.named_parameters()]
    for (name, sent), (_, param) in zip(source, model.named_parameters()):
        loaded_by_vllm = torch.empty(param.shape, dtype=torch.bfloat16)
        default_weight_loader(loaded_by_vllm, param.detach())  # what the sampler did with an fp32 push
        assert sent.dtype == torch.bfloat16 and torch.equal(sent.view(torch.int16), loaded_by_vllm.view(torch.int16)), name
    exact = weight_sync.sampler_source(model, torch.float32)
    assert type(exact) is ModuleSource and all(sent is param for (_, sent), param in zip(exact, model.parameters()))
    assert type(weight_sync.sampler_source(model, None)) is ModuleSource


def test_a_background_push_to_a_bf16_sampler_keeps_a_bf16_snapshot():
    """The learner's half of a real (shm) push with the sampler's calls recorded instead: a bf16 sampler's
    snapshot is bf16 (half the memory), and what lands in the shared buffer is the model cast to bf16."""

    class Recorder(weight_sync.WeightPusher):
        calls = []

        def init_weight_transfer_engine(self, info):
            self.calls.append(("init", info))

        def start_weight_update(self):
            self.calls.append(("start",))

        def update_weights(self, info):
            self.calls.append(("update", info))

        def finish_weight_update(self):
            self.calls.append(("finish",))

        def _push_deadline(self):
            return 60.0

        def _send_weights(self, version, recompute_kv, when_idle):
            self._weight_engine.send_weights()
            self.version = version

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    pusher = Recorder()
    pusher._start_weight_engine("shm", model, background=True, dtype=torch.bfloat16)
    try:
        assert all(p.dtype == torch.bfloat16 for p in pusher._snapshot.parameters())
        with torch.no_grad():
            model[0].weight.add_(0.123456)
        pusher.push_weights(1, background=True)
        pusher.wait_for_push()
        update = [c[1] for c in Recorder.calls if c[0] == "update"][-1]
        assert set(update["dtype_names"]) == {"bfloat16"}
        for view, param in zip(pusher._weight_engine.views, model.parameters()):
            assert torch.equal(view, param.detach().to(torch.bfloat16))
    finally:
        pusher._weight_engine.shutdown()


def test_vllm_nccl_and_ipc_transfer_types_build_from_the_installed_vllm():
    """The trainer-side init and update infos our Sampler builds for the GPU backends."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLWeightTransferUpdateInfo

    nccl = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=29500, world_size=2)
    assert nccl.is_sender and nccl.packed and nccl.backend == "nccl"
    NCCLWeightTransferUpdateInfo(names=["w"], dtype_names=["bfloat16"], shapes=[[2, 2]])
    ipc = IPCTrainerInitInfo(rank=0, packed=True)
    assert ipc.backend == "ipc" and ipc.packed
    IPCWeightTransferUpdateInfo(names=["w"], dtype_names=["bfloat16"], shapes=[[2, 2]], ipc_handles={})
    import gloo_transfer

    gloo_transfer.register()
    assert {"nccl", "ipc", "gloo"} <= set(WeightTransferTrainerFactory._registry)
    for backend in ("nccl", "ipc", "gloo"):
        engine_cls = WeightTransferTrainerFactory._registry[backend]()
        assert hasattr(engine_cls, "trainer_init") and hasattr(engine_cls, "send_weights")


class _FakeCuda:
    """torch.cuda's stream calls, recorded: ("sync", stream) for each synchronize(); the current stream is
    "default" unless a `stream(...)` block in this thread says otherwise."""

    def __init__(self, log):
        self.log, self.local = log, threading.local()

    class _Stream:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def synchronize(self):
            self.log.append(("sync", self.name))

    def current_stream(self, device=None):
        return getattr(self.local, "stream", None) or self._Stream(self.log, "default")

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        return self._Stream(self.log, "push")

    @contextlib.contextmanager
    def stream(self, stream):
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = None


class _RecordingPusher(weight_sync.WeightPusher):
    """WeightPusher's own push_weights with a fake CUDA and a transfer that records the stream it runs on."""

    def __init__(self, log, device, model=None):
        self.log, self._cuda, self._device, self._weight_engine = log, _FakeCuda(log), torch.device(device), object()
        if model is not None:
            self._model, self._snapshot = model, copy.deepcopy(model)

    def _push_deadline(self):
        return 60.0

    def _send_weights(self, version, recompute_kv, when_idle):
        def transfer():  # as Sampler._send_weights: the transfer runs in a thread of its own
            self.log.append(("send", self._cuda.current_stream().name))

        thread = threading.Thread(target=self._on_push_stream(transfer))
        thread.start()
        thread.join()
        self.version = version


def test_a_push_waits_for_the_learners_queued_kernels_first():
    """On CUDA every push first waits for the learner's stream (optimizer.step's kernels may still run);
    vLLM's NCCL producer packs on streams that do not wait for it. On CPU there is nothing to wait for."""
    log = []
    _RecordingPusher(log, "cuda:0").push_weights(1)
    assert log == [("sync", "default"), ("send", "default")]
    log.clear()
    _RecordingPusher(log, "cpu").push_weights(1)
    assert log == [("send", "default")]
    assert weight_sync.wait_for_learner_kernels("cpu", _FakeCuda(log)) is False and log == [("send", "default")]


def test_a_background_push_runs_on_its_own_stream_after_the_snapshot():
    """PipelineRL's push: the snapshot is copied on the learner's stream and waited for, then the transfer
    runs on a stream of its own, so vLLM's per-chunk wait on the current stream does not wait for the
    next training step."""
    log = []
    model = torch.nn.Linear(3, 2)
    pusher = _RecordingPusher(log, "cuda:0", model)
    with torch.no_grad():
        model.weight.add_(1.0)
    pusher.push_weights(2, background=True)
    pusher.wait_for_push()
    assert log == [("sync", "default"), ("send", "push")] and pusher.version == 2
    assert torch.equal(pusher._snapshot.weight, model.weight)
    log.clear()
    pusher.push_weights(3)  # a foreground push after it stays on the learner's stream
    assert log == [("sync", "default"), ("send", "default")]


@pytest.mark.gpu
@needs_gpu
def test_gpu_push_waits_for_a_kernel_still_running():
    """Real CUDA: a parameter written behind a long kernel is written once wait_for_learner_kernels returns
    (without the wait, the stream is still busy: query() is False)."""
    weight = torch.zeros(1024, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before the write
    weight.add_(1.0)
    assert not torch.cuda.current_stream().query()  # still queued: what a push straight after step() would meet
    assert weight_sync.wait_for_learner_kernels(weight.device) is True
    assert torch.cuda.current_stream().query() and bool((weight == 1).all())


@pytest.mark.gpu
@needs_gpu
def test_gpu_background_transfer_runs_off_the_default_stream():
    pusher = _RecordingPusher([], "cuda:0")
    pusher._cuda = torch.cuda
    pusher._push_stream, pusher._in_background = torch.cuda.Stream(), True
    seen = []
    thread = threading.Thread(target=pusher._on_push_stream(lambda: seen.append(torch.cuda.current_stream())))
    thread.start()
    thread.join()
    assert seen == [pusher._push_stream] and seen[0] != torch.cuda.default_stream()


def test_watchdog_turns_a_dead_sampler_mid_transfer_into_an_error(tiny_path):
    """A NCCL broadcast to a dead peer never returns; the watchdog must not wait for it. Here the
    transfer is a stand-in that never returns, and the sampler is killed meanwhile."""
    sampler = vllm_sampler.start_sampler(tiny_path, placement="cpu")
    pid = sampler.process.pid

    def stuck_transfer():
        os.kill(pid, 9)
        time.sleep(3600)

    start = time.monotonic()
    with pytest.raises(vllm_sampler.SamplerError, match="died during a weight push"):
        sampler._watched(stuck_transfer)
    assert time.monotonic() - start < 10
    sampler.close()


def _push_then_compare(placement, tiny_path, tokenizer):
    model = common.load_policy(tiny_path, "cuda")
    with vllm_sampler.start_sampler(tiny_path, placement=placement, dtype="float32") as sampler:
        sampler.init_weight_sync(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        sampler.push_weights(1)
        task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
        prompts = [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(16)]
        samples = sampler.generate(prompts, n=2, temperature=0.8, top_p=0.95, max_tokens=24)
        ids, attn, cmask = common.pad_prompt_completions([s.prompt_token_ids for s in samples], [s.token_ids for s in samples],
                                                         tokenizer.pad_token_id)
        with torch.no_grad():
            learner = common.token_logprobs(model, ids.cuda(), attn.cuda(), cmask.cuda(), 0.8, 0.95).cpu()
        behaviour = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], learner.shape[1])
        mask = cmask[:, 1:].bool()
        assert (learner - behaviour)[mask].abs().mean() < 1e-3 and {s.version_max for s in samples} == {1}
        # the GPU path is the CPU one (vllm_sampler.engine_settings): V1 runner, PyTorch top-k/top-p
        assert sampler.sampler_paths() == {"model_runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "top_k_top_p": "pytorch"}
        memory = common.peak_memory_mib(sampler)  # the sampler's GPU peak beside the learner's
        assert memory["sampler_gpu"] > 0 and memory["learner_gpu"] > 0 and memory["sampler"] > 0


@pytest.mark.gpu
@needs_gpu
def test_gpu_colocated_push_then_logprobs_match(tiny_path, tokenizer):
    _push_then_compare("colocate", tiny_path, tokenizer)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_separate_push_then_logprobs_match(tiny_path, tokenizer):
    _push_then_compare("separate", tiny_path, tokenizer)


@pytest.mark.gpu
@needs_gpu
def test_gpu_in_flight_update_labels_versions(tiny_path, tokenizer):
    """Under CUDA (async scheduling off), a push in the middle of generation splits each running
    sequence's tokens into a version-0 span and a version-1 span, contiguous, covering every token."""
    model = common.load_policy(tiny_path, "cuda")
    with vllm_sampler.start_sampler(tiny_path, placement="colocate") as sampler:
        sampler.init_weight_sync(model)
        task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
        prompts = [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(32)]
        ids = sampler.submit(prompts, n=1, temperature=1.0, max_tokens=64, ignore_eos=True)
        time.sleep(0.2)
        sampler.push_weights(1)
        for s in sampler.wait_for(ids):
            spans = s.versions
            assert spans[0][1] == 0 and spans[-1][2] == len(s.token_ids)
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:])) and {v for v, _, _ in spans} <= {0, 1}
