"""The sampler's start beside the learner: start_sampler (a local vLLM process, or running servers with
--sampler-url), connect_weights (weight sync and the first push), the CPU thread split between the learner and
the sampler (limit_cpu_threads, sampler_threads, learner_threads) and the run's peak memory (peak_memory_mib)."""

from __future__ import annotations

import os

import torch

from fastrl import vllm_sampler, weight_sync
from fastrl.vllm_sampler import peak_rss_mib


def limit_cpu_threads() -> None:
    """On a 2-core machine the learner, the sampler and OpenMP spin-waits fight for cores;
    one thread per process was 4-6x faster than two (measured on the tiny model)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def sampler_threads(requested: int, overlapped: bool) -> int:
    """The sampler's CPU threads, fixed when its engine starts (vLLM's CPU worker then makes
    torch.set_num_threads a no-op, vllm/v1/worker/cpu_worker.py:139-145): `requested` if > 0 (the
    scripts' --sampler-threads); else every core when the schedule takes turns (the learner waits
    while the sampler generates, and the idle sampler waits while the learner trains), half of them
    when generation and training overlap. An explicit OMP_NUM_THREADS is a fixed budget and is kept."""
    if requested > 0:
        return requested
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // 2) if overlapped else cores


def learner_threads(sampler) -> int:
    """On CPU, set the learner's torch threads for the phase about to run: every core while the
    sampler has nothing to generate (a synchronous phase, or paused: its process sleeps), one while it
    generates alongside (two busy processes on two cores with two threads each ran 4-6x slower:
    OpenMP spin-waits). A tiny-model update ran 1.76x faster on 2 threads than on 1 with the
    sampler idle. An explicit OMP_NUM_THREADS is a fixed budget and is kept. Returns the count."""
    if (sampler is None or torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ
            or torch.distributed.is_initialized()):
        return torch.get_num_threads()  # (under torchrun the cores are the ranks')
    generating = bool(sampler.pending) and not sampler.paused
    threads = 1 if generating else len(os.sched_getaffinity(0))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


def start_sampler(model_path: str, placement: str = "auto", max_model_len: int | None = None, seed: int = 0,
                  weights: torch.nn.Module | None = None, version: int = 0, background_push: bool = False,
                  urls: list[str] | None = None, wait: bool = True, **kwargs) -> vllm_sampler.Sampler:
    """Start the sampler process and wait until its engine is ready; or, with `urls`, connect to
    those running vLLM servers instead (remote_sampler.RemoteSampler: the same interface; the
    engine settings are then the servers' own). With `weights`, then connect_weights. `wait=False`
    (no `weights`): return as soon as the process is spawned, so that vLLM imports and builds its
    engine while the learner loads its models, and connect_weights waits for it; where that is not
    safe (start_sampler_early) the process starts in connect_weights instead."""
    if urls:
        from fastrl import remote_sampler  # (imported only for --sampler-url)

        sampler = remote_sampler.RemoteSampler(urls, model_path)
    else:
        config = vllm_sampler.SamplerConfig(model=model_path, placement=placement, max_model_len=max_model_len,
                                            seed=seed, **kwargs)
        sampler = vllm_sampler.Sampler(config)
        if wait or start_sampler_early(placement):  # (otherwise connect_weights starts it, once the learner has loaded)
            sampler.start(wait=wait)
    if weights is not None:
        connect_weights(sampler, weights, version, background_push)
    return sampler


def start_sampler_early(placement: str) -> bool:
    """Whether the sampler may build its engine while the learner loads its models: not when it shares
    the learner's GPU, because vLLM sizes its KV cache from the device's free memory before and after
    its own profiling run (vllm/utils/mem_utils.py:312-315, total_consumed = before_create.free_memory
    - after_profile.free_memory), so the learner's allocations meanwhile would count as the engine's."""
    return vllm_sampler.resolve_placement(placement) != "colocate"


def connect_weights(sampler, weights: torch.nn.Module, version: int = 0, background_push: bool = False,
                    rounding: str = "nearest", seed: int = 0, probe=None, round_to: torch.dtype | None = None):
    """Wait until the sampler is ready, open weight sync with the learner's policy `weights`
    (init_weight_sync, `background_push` for pushes from a thread; `rounding`, `seed`, `probe` and `round_to`: how a
    push rounds to the sampler's dtype and what measures it) and push them labelled `version` when resuming
    (`version` > 0) or to servers (always: what they loaded is not ours to know), so the sampler starts from the
    learner's weights. Closes the sampler if any of that fails."""
    try:
        # imports vLLM's trainer side while the sampler still builds (~2 s less on the critical path)
        weight_sync.register_engines()
        sampler.wait_ready()
        sampler.init_weight_sync(weights, background=background_push, rounding=rounding, seed=seed, probe=probe,
                                 **({"round_to": round_to} if round_to is not None else {}))
        if version or getattr(sampler, "urls", None):  # (a RemoteSampler)
            sampler.push_weights(version)
    except BaseException:
        sampler.close()
        raise
    return sampler


def peak_memory_mib(sampler=None) -> dict[str, float]:
    """Peak memory of this run: the learner's resident memory, its GPU memory (torch's peak
    allocation) when it has a GPU, and the sampler process's: resident, and its GPU memory beside the
    learner's when it has one (vllm_sampler.sampler_peak_memory_mib; a remote sampler: resident only, NaN)."""
    memory = {"learner": peak_rss_mib()}
    if torch.cuda.is_available():
        memory["learner_gpu"] = torch.cuda.max_memory_allocated() / 2**20
    if sampler is not None:
        peaks = getattr(sampler, "peak_memory_mib", None)
        memory.update(peaks() if peaks is not None else {"sampler": sampler.peak_rss_mib()})
    return memory
