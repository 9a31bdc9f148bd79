"""The sampler as a training script calls it, like a gym env: generate these prompts, n samples each, with these
sampling parameters; wait for them; push the learner's weights as policy version v.

    request = sampler.generate(prompts, n=8, temperature=0.8, top_p=0.95, max_tokens=32)
    samples, seconds = sampler.wait(request)       # a vllm_sampler.Completion per sample, the prompts in order;
                                                   # seconds: from sending to the last one finishing
    lags = sampler.check_version(samples, step)    # stop unless they were sampled by the learner's weights
    pushed = sampler.push(policy, step)            # {"time/push_seconds": ..., "charts/push_*": ...}

The sampling parameters are the logprob contract: the learner's `batch.logprobs(..., args)` applies the same
temperature and top_p. Every rank makes every call, in the same order (under torchrun); only rank 0 holds the engine
(`engine`: vllm_sampler.Sampler, or remote_sampler.RemoteSampler for --sampler-url; None elsewhere): what wait()
returns reaches every rank, and at a push every rank gathers its shard into rank 0's full copy, which rank 0 sends.

What a loop would otherwise write around these calls, they do themselves: on CPU, generate() and wait() give the
learner every core while the sampler idles and one while it generates beside it (launch.learner_threads); and the
client keeps the sampler's generators as they were before each request, so that a checkpoint (Run.save) holds what
a resumed run's first generate() restores: a resumed synchronous run samples as the uninterrupted one did."""

from __future__ import annotations

import time
from typing import NamedTuple

from fastrl import checks, distributed, launch


class Request(NamedTuple):
    """What generate() sent: the engine's request ids (rank 0; None elsewhere), when, and the sampler's generators
    just before (None: sent while another request generated, or no engine here)."""

    ids: list | None
    sent_at: float
    rng_before: object = None


class SamplerClient:
    """Rank 0's sampler engine behind the four calls a round makes (module docstring), on every rank."""

    def __init__(self, engine, dist: distributed.Dist):
        self.engine, self.dist = engine, dist
        self.weights = None  # rank 0's full copy of the policy: what a push sends (Run.learner_model sets it)
        self.weights_version = None  # the policy version `weights` holds now
        self._warned: list = []  # the push precision warning, once
        self._outstanding: list[Request] = []  # sent and not waited on yet, oldest first
        self._finished: dict[int, tuple] = {}  # id() of those a push when_idle collected: what wait() returns
        self.rng_to_restore = None  # a checkpoint's generators, restored at the first generate() (Run.resume)

    def generate(self, prompts: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int,
                 **more) -> Request:
        """Start sampling `n` completions of each prompt (token ids); returns at once with what wait() takes."""
        idle = not self._generating()  # (the generators are read and set only while nothing generates)
        if self.rng_to_restore is not None and idle:  # (after the start's evaluation, which drew from them)
            self.set_rng_state(self.rng_to_restore)
        rng = self.rng_state() if idle else None
        ids = None if self.engine is None else self.engine.submit(prompts, n=n, temperature=temperature, top_p=top_p,
                                                                  max_tokens=max_tokens, **more)
        launch.learner_threads(self.engine)  # (on CPU: one core beside the generating sampler)
        self._outstanding.append(Request(ids, time.perf_counter(), rng))
        return self._outstanding[-1]

    def wait(self, request: Request) -> tuple[list, float]:
        """(the request's completions in prompt order, the seconds it generated: from sending it to its last
        completion finishing, however much later they were collected), on every rank."""
        samples_and_seconds = self._finished.pop(id(request), None) or self._collect(request)
        self._outstanding = [r for r in self._outstanding if r is not request]
        launch.learner_threads(self.engine)  # (on CPU: every core, unless another request is generating)
        return samples_and_seconds

    def _collect(self, request: Request) -> tuple[list, float]:
        def done():
            samples = self.engine.wait_for(request.ids)
            since_finished = time.time() - max((s.finished_at for s in samples), default=time.time())
            return samples, time.perf_counter() - request.sent_at - max(since_finished, 0.0)
        return distributed.broadcast(done() if self.dist.is_main else None, self.dist)

    def check_version(self, samples, version: int, max_lag: int = 0) -> dict:
        """Stop in one line unless every token was sampled by a policy version within `max_lag` of `version`; returns
        charts/lag_min|mean|max, `version` minus the version that sampled each token."""
        checks.check_sampler_version(samples, version, max_lag=max_lag)
        lags = [version - v for s in samples for v, start, end in s.versions for _ in range(end - start)] or [0]
        return {"charts/lag_min": min(lags), "charts/lag_mean": sum(lags) / len(lags), "charts/lag_max": max(lags)}

    def push(self, policy, version: int, when_idle: bool = False, recompute_kv: bool = False,
             background: bool = False) -> dict:
        """The learner's weights to the sampler as policy `version`: in flight (`recompute_kv`: running sequences
        re-prefilled; `background`: from a thread), or `when_idle`, after the requests in flight, whose wait it returns
        apart (time/idle_wait_seconds: wait() then returns them at once); time/push_seconds, charts/push_* (kept)."""
        distributed.gather_into(policy, self.weights, self.dist)  # (always: a skipped step may share the version)
        self.weights_version = version
        idle_wait = time.perf_counter()  # the learner's wait for its data, not the push's: collected apart
        for request in self._outstanding if when_idle else []:
            if id(request) not in self._finished:
                self._finished[id(request)] = self._collect(request)
        idle_wait = time.perf_counter() - idle_wait
        seconds, kept = 0.0, {}
        if self.engine is not None:
            seconds = self.engine.push_weights(version, recompute_kv=recompute_kv, when_idle=when_idle,
                                               background=background)
            kept = self.engine.push_metrics() if hasattr(self.engine, "push_metrics") else {}
            checks.warn_push_update(kept, self._warned)
        return {"time/push_seconds": seconds, **({"time/idle_wait_seconds": idle_wait} if when_idle else {}), **kept}

    def gather(self, policy, version: int) -> None:
        """Rank 0's full copy of `policy` brought to `version` (every rank's shard; the model itself without
        torchrun): what a push sends, and a checkpoint or a snapshot of a step that was not pushed writes."""
        if self.weights_version != version:
            distributed.gather_into(policy, self.weights, self.dist)
            self.weights_version = version

    def rng_state(self):
        """The sampler's generators now, what its next request draws from (None for a remote sampler or off rank
        0); only while nothing generates."""
        return self.engine.rng_state() if hasattr(self.engine, "rng_state") else None

    def checkpoint_rng(self):
        """What a checkpoint keeps of the generators: as they were before the oldest request not waited on yet (None
        if it was sent while another generated), or now when nothing generates (None while a script's own stream
        through `engine` does: no state a resumed run could sample the same from)."""
        if self._outstanding:
            return self._outstanding[0].rng_before
        return None if self._generating() else self.rng_state()

    def _generating(self) -> bool:
        return bool(getattr(self.engine, "pending", None))

    def set_rng_state(self, state) -> None:
        """Restore rng_state()'s generators (None: leave them); a checkpoint's that the first generate() would have
        restored are then forgotten (a loop streaming through `engine` restores them itself)."""
        self.rng_to_restore = None
        if state is not None and hasattr(self.engine, "set_rng_state"):
            self.engine.set_rng_state(state)

    def set_learner_threads(self) -> None:
        """On CPU: every core for the learner while the sampler idles, one while it generates beside it (what
        generate() and wait() do; for a loop that streams through `engine` itself)."""
        launch.learner_threads(self.engine)
