"""The sampler as a training script calls it, like a gym env: generate these prompts, n samples each, with these
sampling parameters; wait for them; push the learner's weights as policy version v.

    request = sampler.generate(prompts, n=8, temperature=0.8, top_p=0.95, max_tokens=32)
    samples, seconds = sampler.wait(request)       # a vllm_sampler.Completion per sample, the prompts in order
    sampler.check_version(samples, step)           # stop unless they were sampled by the learner's weights
    pushed = sampler.push(policy, step)            # {"time/push_seconds": ..., "charts/push_*": ...}

The sampling parameters are the logprob contract: the learner's `batch.logprobs(..., args)` applies the same
temperature and top_p. Every rank makes every call, in the same order (under torchrun); only rank 0 holds the engine
(`engine`: vllm_sampler.Sampler, or remote_sampler.RemoteSampler for --sampler-url; None elsewhere): what wait()
returns reaches every rank, and at a push every rank gathers its shard into rank 0's full copy, which rank 0 sends."""

from __future__ import annotations

import time
from typing import NamedTuple

from fastrl import checks, distributed, launch


class Request(NamedTuple):
    """What generate() sent: the engine's request ids (rank 0; None elsewhere) and when."""

    ids: list | None
    sent_at: float


class SamplerClient:
    """Rank 0's sampler engine behind the four calls a round makes (module docstring), on every rank."""

    def __init__(self, engine, dist: distributed.Dist):
        self.engine, self.dist = engine, dist
        self.weights = None  # rank 0's full copy of the policy: what a push sends (Run.learner_model sets it)
        self.weights_version = None  # the policy version `weights` holds now
        self._warned: list = []  # the push precision warning, once

    def generate(self, prompts: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int,
                 **more) -> Request:
        """Start sampling `n` completions of each prompt (token ids); returns at once with what wait() takes."""
        ids = None if self.engine is None else self.engine.submit(prompts, n=n, temperature=temperature, top_p=top_p,
                                                                  max_tokens=max_tokens, **more)
        return Request(ids, time.perf_counter())

    def wait(self, request: Request) -> tuple[list, float]:
        """(the request's completions in prompt order, seconds since it was sent), on every rank."""
        done = (lambda: (self.engine.wait_for(request.ids), time.perf_counter() - request.sent_at))
        return distributed.broadcast(done() if self.dist.is_main else None, self.dist)

    def check_version(self, samples, version: int, max_lag: int = 0) -> None:
        """Stop in one line unless every token was sampled by a policy version within `max_lag` of `version`."""
        checks.check_sampler_version(samples, version, max_lag=max_lag)

    def push(self, policy, version: int, when_idle: bool = False, recompute_kv: bool = False,
             background: bool = False) -> dict:
        """The learner's weights to the sampler as policy `version`: in flight, between two decode steps
        (`recompute_kv`: running sequences re-prefilled; `background`: sent from a thread), or `when_idle`, once the
        requests in flight finish. Returns time/push_seconds and what the sampler's copy kept (charts/push_*)."""
        distributed.gather_into(policy, self.weights, self.dist)  # (always: a skipped step may share the version)
        self.weights_version = version
        seconds, kept = 0.0, {}
        if self.engine is not None:
            seconds = self.engine.push_weights(version, recompute_kv=recompute_kv, when_idle=when_idle,
                                               background=background)
            kept = self.engine.push_metrics() if hasattr(self.engine, "push_metrics") else {}
            checks.warn_push_update(kept, self._warned)
        return {"time/push_seconds": seconds, **kept}

    def gather(self, policy, version: int) -> None:
        """Rank 0's full copy of `policy` brought to `version` (every rank's shard; the model itself without
        torchrun): what a push sends, and a checkpoint or a snapshot of a step that was not pushed writes."""
        if self.weights_version != version:
            distributed.gather_into(policy, self.weights, self.dist)
            self.weights_version = version

    def rng_state(self):
        """The sampler's generators now, what its next request draws from (None for a remote sampler or off rank
        0): a checkpoint keeps them so that a resumed synchronous run samples as an uninterrupted one."""
        return self.engine.rng_state() if hasattr(self.engine, "rng_state") else None

    def set_rng_state(self, state) -> None:
        """Restore rng_state()'s generators (None: leave them)."""
        if state is not None and hasattr(self.engine, "set_rng_state"):
            self.engine.set_rng_state(state)

    def set_learner_threads(self) -> None:
        """On CPU: every core for the learner while the sampler idles, one while it generates beside it."""
        launch.learner_threads(self.engine)
