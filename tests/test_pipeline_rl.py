"""PipelineRL: loss/ESS/lag by hand, the actor's admission rule on scripted states, in-flight
weight updates on the real sampler, both modes from the command line, zero-lag parity with
Conventional RL, the realistic fixture."""

import json
import math
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from fastrl import checks, distributed, launch, runlog, util, vllm_sampler, weight_sync
from fastrl.sampler_client import SamplerClient
import tasks
import pipeline_rl as prl
from conftest import run_stripped_copy, scratch_dir, strip_to_method, without_after_round

ROOT = Path(__file__).resolve().parents[1]
WORK = scratch_dir("fastrl-test-runs-")  # scripts run here


def test_advantages_ess_and_truncated_is_loss_by_hand():
    assert torch.allclose(prl.per_prompt_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.5]])),
                          torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.1, -0.1, -0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert prl.ess(torch.ones(2, 3), mask) == pytest.approx(1.0)
    w = torch.tensor([[1.0, 3.0, 9.0], [1.0, 1.0, 2.0]])  # the masked 9 must not count
    assert prl.ess(w, mask) == pytest.approx(8.0 ** 2 / (5 * 16.0))

    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -1.0]], requires_grad=True)
    # token weights: 1, e^2 -> 5 (truncated), 1, e^-0.1, 1
    mu = torch.tensor([[-1.0, -4.0, 0.0], [-0.5, -0.5 + 0.1, -1.0]])
    adv = torch.tensor([1.0, -2.0])
    total = 1 * 1 * -1.0 + 5 * 1 * -2.0 + 1 * -2 * -0.5 + torch.e ** -0.1 * -2 * -0.5 + 1 * -2 * -1.0
    # the default: Eq. 4-5's 1/(mK), divided by the 2 sequences; --loss-norm token: by the 5 response tokens
    for loss_norm, count in [("sequence", 2), ("token", 5)]:
        grad_logp = logp.detach().clone().requires_grad_(True)
        kw = {} if loss_norm == "sequence" else {"loss_norm": loss_norm}
        loss, pg, kl = prl.truncated_is_loss(grad_logp, mu, logp.detach(), mask, adv, tis_cap=5.0, kl_coef=0.0, **kw)
        assert loss.item() == pytest.approx(-total / count, rel=1e-6) and kl.item() == 0.0
        loss.backward()
        assert grad_logp.grad[0, 1].item() == pytest.approx(-5 / count)  # truncated weight times advantage, per token
        assert grad_logp.grad[0, 2].item() == 0.0
    # the KL term is normalised alike: ref = logp - 1 on every token gives k3 = e^-1 - (-1) - 1 = e^-1 per token
    _, _, kl = prl.truncated_is_loss(logp, mu, logp.detach() - 1, mask, adv, tis_cap=5.0, kl_coef=0.1)
    assert kl.item() == pytest.approx(5 * math.exp(-1) / 2, rel=1e-6)


def test_defaults_follow_the_paper():
    """H = B in pipeline mode (Section 4: the smallest H that feeds the trainer; Section 5 keeps B in flight), B*G in
    conventional mode (Algorithm 1 generates the RL step at once: no fixed engine size); the ESS guard in pipeline
    mode only (Algorithm 2 has it, Algorithm 1 not); values given on the command line stay."""
    pipeline = prl.mode_defaults(prl.Args())
    assert (pipeline.gen_batch_size, pipeline.ess_threshold, pipeline.loss_norm) == (64, 0.5, "sequence")
    assert (pipeline.num_steps, pipeline.learning_rate, pipeline.max_new_tokens) == (120, 1e-4, 32)
    conventional = prl.mode_defaults(prl.Args(mode="conventional", steps_per_rl_step=3, train_batch_size=16))
    assert (conventional.gen_batch_size, conventional.ess_threshold) == (48, 0.0)
    # the old behaviour, asked for by name
    old = prl.mode_defaults(prl.Args(mode="conventional", gen_batch_size=256, ess_threshold=0.5, loss_norm="token"))
    assert (old.gen_batch_size, old.ess_threshold, old.loss_norm) == (256, 0.5, "token")
    # a real model: the paper's defaults (PAPER), what --help shows with --model given; a flag given stays
    real = prl.mode_defaults(checks.parse_args(prl.Args, ["--model", "some/model"], paper=prl.PAPER))
    assert (real.num_steps, real.learning_rate, real.max_new_tokens, real.max_prompt_tokens) == (1000, 1e-6, 1024, 512)
    assert checks.parse_args(prl.Args, ["--model", "some/model", "--num-steps", "7"], paper=prl.PAPER).num_steps == 7
    assert checks.parse_args(prl.Args, [], paper=prl.PAPER).num_steps == 120


def test_flags_are_checked_where_they_are_declared_and_help_shows_real_defaults(capsys, monkeypatch):
    """Args refuses a bad value in one line naming the flag, whoever builds it (the command line, a test, a benchmark);
    --help shows each flag's real default: the tiny model's, a real model's (PAPER) with --model, and in words the
    ones --mode decides."""
    with pytest.raises(SystemExit, match=r"^error: --tis-cap: must be > 0"):
        prl.Args(tis_cap=0)
    with pytest.raises(SystemExit, match=r"^error: --ess-threshold: must be in \[0, 1\]"):
        prl.Args(ess_threshold=1.5)
    monkeypatch.setenv("COLUMNS", "200")
    for argv, steps in [([], 120), (["--model", "Qwen/Qwen2.5-0.5B"], 1000)]:
        with pytest.raises(SystemExit):
            checks.parse_args(prl.Args, [*argv, "--help"], paper=prl.PAPER)
        out = " ".join(capsys.readouterr().out.replace("│", " ").split())
        assert f"optimizer steps [paper 1000; tiny 120] (default: {steps})" in out
        assert "(default: B; conventional: B*G)" in out and "(default: 0.5; conventional: 0)" in out
        assert "--is-clip" not in out and "(default: 5.0)" in out


def test_truncated_is_weights_and_their_stats_by_hand():
    # c = 5: only 7 is cut (5 is at the clamp, not beyond it): main()'s charts/tis_max_ratio and tis_truncated_fraction
    # are these stats of the untruncated weights, (w > c).mean() (a run's values: test_the_guards_in_main)
    w = torch.log(torch.tensor([[0.5, 1.0, 5.0, 7.0, 2.0]]))
    _, stats = prl.truncated_is_weights(w, torch.zeros_like(w), torch.ones_like(w), "token", 5.0)
    assert stats["max_ratio"] == pytest.approx(7.0) and stats["truncated_fraction"] == pytest.approx(1 / 5)
    _, stats = prl.truncated_is_weights(torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1, 4), "token", 1.0)
    assert stats == {"max_ratio": 1.0, "truncated_fraction": 0.0}  # at the cap exactly: not cut
    # a far off-policy token: a tiny ESS, not inf / inf = NaN
    far, _ = prl.truncated_is_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-200.0, 0.0]]), torch.ones(1, 2),
                                      "token", math.inf)
    assert (far[0, 0].item() == pytest.approx(math.exp(common.MAX_LOG_WEIGHT))
            and 0 < prl.ess(far, torch.ones(1, 2)) < 0.6)
    # truncated at c, zero off the response
    w, stats = prl.truncated_is_weights(torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[-3.0, -0.5, -3.0]]),
                                        torch.tensor([[1.0, 1.0, 0.0]]),
                                        "token", 5.0)
    assert w.tolist() == [[5.0, pytest.approx(math.exp(0.5)), 0.0]]
    assert stats == {"max_ratio": pytest.approx(math.exp(3.0)), "truncated_fraction": 0.5}  # over the 2 response tokens


def test_token_lags_follow_version_spans():
    """sampler.check_version's charts/lag_min|mean|max: per token, 5 - [3, 3, 4, 4, 4] = [2, 2, 1, 1, 1]; a lag
    beyond max_lag stops the run."""
    c = vllm_sampler.Completion("0", [1], [5, 6, 7, 8, 9], [0.0] * 5, "stop", versions=[(3, 0, 2), (4, 2, 5)])
    sampler = SamplerClient(None, distributed.init())
    assert sampler.check_version([c], 5, max_lag=2) == {"charts/lag_min": 1, "charts/lag_mean": pytest.approx(1.4),
                                                        "charts/lag_max": 2}
    with pytest.raises(SystemExit, match=r"versions 4..5"):
        sampler.check_version([c], 5, max_lag=1)


def _perturbed(model, scale=0.05, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


@pytest.mark.slow
@pytest.mark.parametrize("recompute_kv", [False, True])
def test_in_flight_weight_update(tiny_path, tokenizer, sampler, recompute_kv):
    """Push new weights while sequences are being generated: they stay alive and continue, their
    version spans cover every token once and change at the switch; with recompute_kv the tokens
    after the switch have exactly the new weights' logprobs."""
    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model)
    sampler.push_weights(sampler.version + 1)
    old_version = sampler.version
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    prompts = [tokenizer(task.problem("test", i).prompt)["input_ids"] for i in range(6)]
    length = 100
    ids = sampler.submit(prompts, n=1, stream_every=4, temperature=1.0, max_tokens=length, ignore_eos=True)
    started = set()
    deadline = time.monotonic() + 60
    while started != set(ids) and time.monotonic() < deadline:  # every sequence is under way
        started |= {c.request_id for c in sampler.poll(timeout=0.5) if not c.finished and c.request_id in ids}
    assert started == set(ids)
    _perturbed(model)
    sampler.push_weights(old_version + 1, recompute_kv=recompute_kv)
    finished = {c.request_id: c for c in sampler.wait_for(ids)}

    for rid in ids:
        c = finished[rid]
        assert c.finish_reason == "length" and len(c.token_ids) == length  # alive and continued
        spans = c.versions
        assert spans[0][1] == 0 and spans[-1][2] == length
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:]))  # contiguous: each token once
        assert [v for v, _, _ in spans] == [old_version, old_version + 1]
        switch = spans[1][1]
        assert 0 < switch < length

    samples = [finished[rid] for rid in ids]
    ids_t, attn, cmask = common.pad_prompt_completions([c.prompt_token_ids for c in samples],
                                                       [c.token_ids for c in samples], tokenizer.pad_token_id)
    with torch.no_grad():
        new = common.token_logprobs(model, ids_t, attn, cmask, 1.0)
    behaviour = common.sampler_logprob_tensor(samples, [len(c.prompt_token_ids) for c in samples], new.shape[1])
    after = torch.zeros_like(new, dtype=torch.bool)
    for row, c in enumerate(samples):
        start = len(c.prompt_token_ids) - 1 + c.versions[1][1]
        after[row, start: len(c.prompt_token_ids) - 1 + length] = True
    diff = (new - behaviour)[after].abs().max().item()
    if recompute_kv:
        assert diff < 1e-4
    else:  # the stale KV cache of the old weights makes the post-switch logprobs differ
        assert diff > 1e-3




# ---- the actor's admission rule (--max-lag), on scripted states ----

def _args(**kw):
    return prl.mode_defaults(prl.Args(**{"train_batch_size": 64, "gen_batch_size": 128, "group_size": 4} | kw))


def test_admission_replays_the_max_lag_stall():
    """The reported stall (H=128, B=64, --max-lag 1): nothing in flight, 48 < B sequences queued,
    the oldest already 1 step old. The old rule ("no prompt while the oldest queued data is
    --max-lag old") admitted nothing and the trainer waited forever; now prompts are admitted."""
    args = _args(max_lag=1)
    drop, admit = prl.admission(step=5, sampler_version=5, queued_versions=[4] * 12, in_flight=0, args=args)
    assert drop == [] and admit * args.group_size >= args.train_batch_size - 48
    # data beyond the bound can never be trained: dropped (and counted by the caller), never blocking
    drop, admit = prl.admission(step=5, sampler_version=5, queued_versions=[3, 4, 3, 5], in_flight=0, args=args)
    assert drop == [0, 2] and admit > 0
    # a push on its way: wait for it (the trainer blocks on it), then admit
    assert prl.admission(step=5, sampler_version=4, queued_versions=[], in_flight=64, args=args)[1] == 0
    # --max-lag 0: one batch per weight version, admitted only once the sampler holds the learner's weights
    on_policy = _args(max_lag=0)
    assert prl.admission(3, 3, [], 0, on_policy) == ([], 16)
    assert prl.admission(3, 3, [3] * 4, 48, on_policy) == ([], 0)
    assert prl.admission(4, 3, [], 0, on_policy) == ([], 0)
    # no bound: H in flight plus one batch queued; after an ESS skip only on-policy groups are kept
    assert prl.admission(7, 7, [], 0, _args()) == ([], 48)
    assert prl.admission(7, 7, [6, 7, 2], 100, _args(), on_policy_only=True) == ([0, 2], (192 - 104) // 4)


def _simulate(args, steps, seed, push_delay=2):
    """A scripted pipeline: each admitted group takes a heavy-tailed number of ticks to generate,
    the trainer takes B sequences (oldest first) as soon as they are queued, and each push lands
    push_delay ticks after its step. Returns the lags of the trained groups and how many were dropped."""
    rng = random.Random(seed)
    step = sampler_version = tick = dropped = 0
    push_at, in_flight, queue, lags = None, [], [], []
    while step < steps:
        tick += 1
        assert tick < 200_000, f"stalled at step {step}"
        if push_at is not None and tick >= push_at:
            sampler_version, push_at = step, None
        queue += [v for t, v in in_flight if t <= tick]
        in_flight = [(t, v) for t, v in in_flight if t > tick]
        drop, admit = prl.admission(step, sampler_version, queue, len(in_flight) * args.group_size, args)
        dropped += len(drop)
        queue = [v for i, v in enumerate(queue) if i not in set(drop)]
        in_flight += [(tick + int(rng.paretovariate(1.2)), sampler_version) for _ in range(admit)]
        if not in_flight and len(queue) * args.group_size < args.train_batch_size:
            assert push_at is not None, "nothing in flight, no batch queued, nothing admitted: a stall"
        if len(queue) * args.group_size >= args.train_batch_size:
            batch, queue = (queue[:args.train_batch_size // args.group_size],
                            queue[args.train_batch_size // args.group_size:])
            lags += [step - v for v in batch]
            step, push_at = step + 1, tick + push_delay
    return lags, dropped


@pytest.mark.parametrize("max_lag, gen_batch_size",
                         [(None, 128), (0, 128), (1, 128), (3, 128), (None, None), (1, None)])
def test_admission_bounds_the_lag_and_never_stalls(max_lag, gen_batch_size):
    """gen_batch_size None: the default H = B."""
    lags, dropped = _simulate(_args(max_lag=max_lag, gen_batch_size=gen_batch_size), steps=300, seed=0)
    if max_lag is not None:
        assert max(lags) <= max_lag
    if max_lag == 0:
        assert set(lags) == {0} and dropped == 0  # strictly on-policy: nothing generated is wasted
    if max_lag == 1:
        assert dropped > 0  # the long tail outlived the bound: dropped, and the run went on


def test_a_larger_generation_batch_is_staler():
    """Section 4: a larger H raises the generation latency and with it the lag. On the scripted pipeline the mean lag of
    the trained groups grows with H: the default H = B is the least stale, the old default 4B more than 5x staler."""
    mean_lag = {h: np.mean(_simulate(_args(gen_batch_size=h), steps=300, seed=0)[0]) for h in (64, 128, 256)}
    assert mean_lag[64] < mean_lag[128] < mean_lag[256] and mean_lag[256] > 5 * mean_lag[64]


def test_wait_until_has_a_deadline():
    with pytest.raises(RuntimeError, match="no sequence arrived.*3 of 8 queued"):
        util.wait_until(lambda: False, lambda: 0, timeout=0.2, describe=lambda: "3 of 8 queued")
    progress = iter([1, 1, 1, 0])
    assert util.wait_until(lambda: next(progress, None) is None, lambda: 1, timeout=0.2, describe=str) < 0.2


def test_conventional_batches_are_shuffled_whole_groups():
    """Algorithm 1 splits a shuffled buffer: the groups arrive shortest first (completion order),
    the G batches must not follow that order; whole groups stay together; reproducible."""
    groups = [(key, [key] * 4) for key in range(16)]  # group `key` has responses of length key
    first_is_shortest = 0
    for seed in range(20):
        batches = prl.shuffled_batches(groups, 4, np.random.default_rng(seed))
        assert sorted(g[0] for b in batches for g in b) == list(range(16)) and all(len(b) == 4 for b in batches)
        means = [np.mean([g[0] for g in b]) for b in batches]
        first_is_shortest += means[0] == min(means)
        assert batches == prl.shuffled_batches(groups, 4, np.random.default_rng(seed))
    assert first_is_shortest <= 10  # ~1 in 4 at random; always, in completion order


# ---- main()'s own round on the tiny model, fed by a scripted sampler: the guards, the loss, the schedule ----

RESPONSES = ["1+2=3", "4*5", "7-1=6 ok", "9"]  # prompt `key`'s sample i: RESPONSES[(key * 2 + i) % 4], text "r<that>"


class ScriptedSampler:
    """The sampler's interface without an engine, answering every request at once, so that main() runs in this process:
    its training samples' logprobs are the learner's own at the weights it holds when asked (exactly on-policy: the
    logprob contract), or `fixed` (-1 a token), then `offset` less on every other token of the prompts in
    `offset_keys` and `poison`ed (a function of (key, sample index, logprobs)); the evaluation's samples are empty."""

    def __init__(self, tokenizer, fixed=None, offset=0.0, offset_keys=(), poison=None):
        self.responses = [tokenizer(text)["input_ids"] for text in RESPONSES]
        self.fixed, self.offset, self.offset_keys, self.poison = fixed, offset, offset_keys, poison
        self.pending, self.done, self.ready, self.pushes, self.version, self.paused = set(), {}, [], [], 0, False

    def submit(self, prompts, n=1, tags=None, per_prompt=None, temperature=1.0, top_p=1.0, **sampling):
        ids = []
        for p, prompt in enumerate(prompts):
            for i in range(n):
                c = self.sample(prompt, tags[p], i, temperature, top_p) if tags else \
                    vllm_sampler.Completion(str(len(self.done)), prompt, [], [], "stop", [(self.version, 0, 0)])
                self.done[c.request_id] = c
                self.pending.add(c.request_id)
                self.ready += [c] if tags else []
                ids.append(c.request_id)
        return ids

    def sample(self, prompt, key, i, temperature, top_p):
        r = (key * 2 + i) % len(self.responses)
        response = self.responses[r]
        ids, attn, cmask = common.pad_prompt_completions([prompt], [response], 0)
        with torch.no_grad():
            own = common.token_logprobs(self.model, ids, attn, cmask, temperature, top_p=top_p)[0, len(prompt) - 1:]
        logprobs = [self.fixed if self.fixed is not None else v for v in own[:len(response)].tolist()]
        logprobs = [v - self.offset * (t % 2) * (key in self.offset_keys) for t, v in enumerate(logprobs)]
        if self.poison:
            self.poison(key, i, logprobs)
        return vllm_sampler.Completion(str(len(self.done)), prompt, response, logprobs, "stop",
                                       [(self.version, 0, len(response))], text=f"r{r}", tag=(key, i))

    def poll(self, timeout=0.0, min_items=1):
        out, self.ready = self.ready, []
        self.pending.difference_update(c.request_id for c in out)
        return out

    def wait_for(self, ids, timeout=0.0):
        self.pending.difference_update(ids)
        return [self.done[i] for i in ids]

    def push_weights(self, version, **kw):
        self.version = version
        self.pushes.append(version)
        return 0.0

    def init_weight_sync(self, model, background=False, **push):  # (push: rounding, seed, probe)
        self.model = model

    def abort(self, ids):
        self.pending.difference_update(ids)

    def wait_ready(self): pass
    def wait_for_push(self): pass
    def close(self): pass
    def peak_rss_mib(self): return 0.0


@pytest.fixture
def scripted_main(monkeypatch, tmp_path, tokenizer):
    """`scripted_main(*flags, rewards=..., **sampler)`: main() with those flags on a ScriptedSampler, the rewards by
    response (RESPONSES' order). Returns (its sampler, its models (policy, reference, optimizer), its run directory's
    rows; with `error`, the exception it raised instead of the rows)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (launch.learner_threads: the threads as they are)
    monkeypatch.setattr(weight_sync, "register_engines", lambda: None)  # (vLLM's factories: not needed here)
    monkeypatch.setattr(vllm_sampler, "quiet_libraries", lambda verbose: None)
    load_models = prl.load_models

    def run(*flags, rewards=(1.0, 0.0, 0.0, 1.0), error=None, **sampler_kw):
        sampler, models = ScriptedSampler(tokenizer, **sampler_kw), []
        monkeypatch.setattr(launch, "start_sampler", lambda *a, **k: sampler)
        scripted = lambda task, args: lambda text, problem: (rewards[int(text[1:])],) * 2  # noqa: E731 (trained, own)
        monkeypatch.setattr(prl, "reward_function", scripted)
        monkeypatch.setattr(prl, "load_models", lambda *a: models.extend(load_models(*a)) or tuple(models))
        base = [] if "--resume" in flags else ["--exp-name", f"scripted{len(list(tmp_path.glob('runs/*')))}",
                                               "--group-size", "2", "--train-batch-size", "4", "--gen-batch-size", "4",
                                               "--eval-problems", "2", "--eval-samples", "1"]  # (a resume: the saved)
        monkeypatch.setattr(sys, "argv", ["pipeline_rl.py", *base, *flags])
        if error:
            with pytest.raises(error) as raised:
                prl.main()
        else:
            prl.main()
        run_dir = max(tmp_path.glob("runs/*"), key=lambda d: d.stat().st_mtime)
        return sampler, models, raised.value if error else runlog.read_metrics(run_dir), run_dir

    return run


def _trained(rows):
    return [r for r in rows if "losses/loss" in r]


def _unchanged(policy, tiny_path):
    return all(torch.equal(a, b) for a,
               b in zip(common.load_policy(tiny_path, "cpu").parameters(), policy.parameters()))


def test_the_guards_and_the_loss_in_mains_round(scripted_main, tiny_path):
    """main()'s round on hand-made batches: on-policy data trains (ESS 1, the learner's logprobs = the sampler's) with
    the loss -sum_i A_i log pi(y_i) / 4 (Eq. 4-5; the micro-batches of at most 3 add up to it) or / the tokens; a NaN
    ESS (a poisoned sampler logprob) or a NaN loss (a poisoned reward) never steps the optimizer (Adam holds no moments,
    the weights stay, nothing is pushed), is logged, and 10 in a row stop the run; a batch below the ESS threshold is
    skipped and the next, of the current weights, trained; Conventional RL's default (no guard) trains it."""
    shared = ("--micro-batch-size", "3", "--top-p", "0.9", "--temperature", "0.8", "--num-steps", "1")
    flags = (*shared, "--ess-threshold", "0.5")
    sampler, (policy, _, optimizer), rows, _ = scripted_main(*flags)
    [row] = _trained(rows)
    assert row["charts/ess"] == pytest.approx(1.0, abs=1e-6) and row["charts/logprob_diff"] < 1e-6
    assert row["charts/tis_max_ratio"] == pytest.approx(1.0, abs=1e-5) and row["charts/tis_truncated_fraction"] == 0
    assert sampler.pushes == [1] and not _unchanged(policy, tiny_path)
    batch = sorted((c for c in sampler.done.values() if c.tag and c.tag[0] < 2), key=lambda c: c.tag)  # keys 0, 1
    seq_logp = [sum(c.logprobs) for c in batch]  # on-policy: w = 1
    weighted = -sum(a * lp for a, lp in zip([0.5, -0.5, -0.5, 0.5], seq_logp))
    assert row["losses/pg"] == pytest.approx(weighted / 4, rel=1e-4)
    _, _, rows, _ = scripted_main(*flags, "--loss-norm", "token")
    assert _trained(rows)[0]["losses/pg"] == pytest.approx(weighted / sum(len(c.token_ids) for c in batch), rel=1e-4)

    def nan_logprob(key, i, logprobs):
        if i == 0:
            logprobs[1] = float("nan")

    for kw, ess_is_nan in [(dict(poison=nan_logprob), True), (dict(rewards=(1.0, float("nan"), 0.0, 1.0)), False)]:
        sampler, (policy, _, optimizer), error, run_dir = scripted_main(*flags, error=RuntimeError, **kw)
        assert "10 batches in a row" in str(error) and sampler.pushes == [] and _unchanged(policy, tiny_path)
        assert optimizer.state_dict()["state"] == {}  # Adam never stepped: no moments from a NaN gradient
        skips = runlog.read_metrics(run_dir)[1:]  # (the 10th stops the run before its row)
        assert [(r["step"], r["charts/nonfinite_skipped"]) for r in skips] == [(0, n) for n in range(1, 10)]
        assert all(math.isnan(r["charts/ess"]) == ess_is_nan for r in skips)

    # every other token 1 nat less likely under the sampler in the first batch: weights e and 1, ESS ~0.82, half cut
    # at c = 2; skipped below 0.9, and the next batch (the current weights') trained
    off_policy = dict(offset=1.0, offset_keys=(0, 1))
    sampler, _, rows, _ = scripted_main(*shared, "--ess-threshold", "0.9", "--tis-cap", "2", **off_policy)
    [skip] = [r for r in rows if "charts/ess" in r and "losses/loss" not in r]
    assert skip["step"] == 0 and skip["charts/skipped_steps"] == 1 and 0.7 < skip["charts/ess"] < 0.9
    assert skip["charts/tis_max_ratio"] == pytest.approx(math.e, rel=1e-4) and sampler.pushes == [1]
    assert _trained(rows)[0]["charts/ess"] > 0.9
    # Conventional RL's default threshold (Algorithm 1 has no ESS guard) trains the same batch
    sampler, (policy, _, _), rows, _ = scripted_main(*shared, "--tis-cap", "2", "--mode", "conventional",
                                                     "--steps-per-rl-step", "1", **off_policy)
    [row] = _trained(rows)
    assert 0.7 < row["charts/ess"] < 0.9 and row["charts/tis_max_ratio"] == pytest.approx(math.e, rel=1e-4)
    assert 0.3 < row["charts/tis_truncated_fraction"] < 0.7 and not _unchanged(policy, tiny_path)


def test_each_step_trains_at_its_scheduled_rate_and_a_resumed_run_continues_exactly(scripted_main):
    """main() sets each step's rate from the step alone, on the optimizer load_models builds (AdamW, biases not
    decayed); stopped after 2 steps, checkpointed (AdamW's moments) and resumed (Run.resume), 2 steps more give the
    straight run's rates and weights to the bit. Fixed sampler logprobs: the batches are the same whatever the
    weights."""
    flags = ("--mode", "conventional", "--steps-per-rl-step", "1", "--learning-rate", "1e-3", "--weight-decay", "0.01",
             "--lr-schedule", "cosine", "--warmup-steps", "2", "--lr-schedule-steps", "5", "--ess-threshold", "0")
    _, (policy, _, optimizer), rows, _ = scripted_main(*flags, "--num-steps", "4", fixed=-1.0)
    rates = [r["charts/learning_rate"] for r in _trained(rows)]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0] and isinstance(optimizer,
                                                                                             torch.optim.AdamW)
    exempt = [n for n, p in policy.named_parameters() if any(p is q for q in optimizer.param_groups[1]["params"])]
    assert exempt and all(n.endswith(".bias") for n in exempt)  # the tiny Qwen2's q/k/v biases
    hand = [0.0, 0.5e-3, 1e-3, 1e-3 * (1 + math.cos(math.pi / 3)) / 2]  # warmup 0, 1/2; then the cosine over 3 steps
    assert rates == pytest.approx(hand, abs=1e-15)
    _, _, first, stopped = scripted_main(*flags, "--num-steps", "2", fixed=-1.0)
    _, (resumed, _, _), rest, _ = scripted_main("--resume", str(stopped), "--num-steps", "4", fixed=-1.0)
    assert [r["charts/learning_rate"] for r in _trained(first)] == rates[:2]  # the resumed run goes on in its directory
    assert [r["charts/learning_rate"] for r in _trained(rest)] == rates
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), resumed.parameters()))


# ---- from the command line ----

def _run(*flags, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "pipeline_rl.py"), *flags], cwd=WORK, capture_output=True,
                          text=True, timeout=timeout)


def _rows(out):
    """The run directory and its trained steps' rows (a skipped batch's row has charts/ess but no losses)."""
    run_dir = WORK / out.stdout.split("run directory: ")[1].split()[0]
    return run_dir, [r for r in runlog.read_metrics(run_dir) if "losses/loss" in r]


SMALL = ["--num-steps", "4", "--train-batch-size", "16", "--eval-problems", "8", "--eval-samples", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "conventional"])
def test_short_run_exits_0(mode):
    """Pipeline mode with --max-lag 1 and H = 2B finishes with every trained token at most 1 step
    old (the old backpressure stalled in exactly this setting after step 3, with a token lag of 2
    already at step 3); conventional G=2 trains its second step one step off-policy."""
    extra = ["--max-lag", "1", "--gen-batch-size", "32"] if mode == "pipeline" else ["--steps-per-rl-step", "2"]
    out = _run("--exp-name", f"pytest_prl_{mode}", "--mode", mode, *SMALL, *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and (run_dir / "checkpoint.pt").exists()
    args = json.loads((run_dir / "args.json").read_text())
    # H: as given (2B) in pipeline mode; Conventional RL's default, B*G, and no ESS guard (Algorithm 1); per-sequence
    # loss
    assert (args["gen_batch_size"], args["ess_threshold"], args["loss_norm"]) == (
        (32, 0.5) if mode == "pipeline" else (32, 0.0)) + ("sequence",)
    assert ([r["charts/episodes"] for r in rows] == [16, 32, 48, 64]
            and all(r["charts/episodes_per_second"] > 0 for r in rows))
    assert all(r["charts/tis_max_ratio"] >= 1.0 - 1e-3 and 0 <= r["charts/tis_truncated_fraction"] <= 1 for r in rows)
    if mode == "pipeline":
        assert all(r["charts/lag_max"] <= 1 for r in rows)
        assert rows[0]["charts/logprob_diff"] < 1e-4  # step 1: all of it from the initial weights
    else:  # G=2: the second step of each RL step trains one step off-policy
        assert [r["charts/lag_max"] for r in rows] == [0, 1, 0, 1]
        assert [("charts/logprob_diff" in r) for r in rows] == [True, False, True, False]
        assert all(r["charts/logprob_diff"] < 1e-4 for r in rows if "charts/logprob_diff" in r)
    assert "| PipelineRL" in out.stdout or "| Conventional RL (G=2)" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags, max_num_seqs",
                         [([], 64), (["--mode", "conventional", "--steps-per-rl-step", "3"], 192),
                                                 (["--mode", "conventional", "--gen-batch-size", "100"], 100)])
def test_the_sampler_decodes_h_sequences_at_once(sampler_start_kwargs, flags, max_num_seqs):
    """vLLM's max_num_seqs is H in both modes: B by default in pipeline mode, B*G in conventional mode (Algorithm 1
    generates the whole RL step with one policy; it was a fixed 256), or --gen-batch-size. main() up to the sampler's
    start."""
    assert sampler_start_kwargs(prl, "--exp-name", "pytest_prl_h", *flags)["max_num_seqs"] == max_num_seqs


@pytest.mark.slow
def test_ess_guard_skips_stale_batches():
    """With a threshold that only (near) on-policy data passes, batches holding tokens from
    before the last push are skipped and the trainer waits for fresh data, yet the run finishes.
    Every batch's ESS is logged, the skipped ones' too (with the skip counter): the guard does not
    make the logged ESS look more on-policy than the data was. H = B, the default."""
    out = _run("--exp-name", "pytest_prl_ess", "--ess-threshold", "0.9999", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, rows = _rows(out)
    assert json.loads((run_dir / "args.json").read_text())["gen_batch_size"] == 16
    assert all(r["charts/ess"] >= 0.9999 for r in rows)  # only (near) on-policy batches were trained on
    assert rows[-1]["charts/skipped_steps"] > 0  # after each in-flight push the stale batches were skipped
    skips = [r for r in runlog.read_metrics(run_dir) if "charts/ess" in r and "losses/loss" not in r]
    assert [r["charts/skipped_steps"] for r in skips] == list(range(1, int(rows[-1]["charts/skipped_steps"]) + 1))
    assert all(r["charts/ess"] < 0.9999 and r["charts/lag_max"] >= 1 for r in skips)
    assert len([r for r in runlog.read_metrics(run_dir) if "charts/ess" in r]) == len(rows) + len(skips)


# --max-lag 0 on a fixed seed: the run that both the Conventional-RL parity test and the torchrun
# test compare against (one launch for two tests). --micro-batch-size 3: 3 micro-batches of the 8
# sequences, so that under torchrun rank 1 also runs a weight-0 stand-in.
ZERO_LAG = ["--num-steps", "3", "--train-batch-size", "8", "--group-size", "4", "--micro-batch-size", "3",
            "--eval-problems", "4", "--eval-samples", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def zero_lag_pipeline():
    out = _run("--exp-name", "pytest_prl_parity_pipeline", "--mode", "pipeline", "--max-lag", "0", *ZERO_LAG)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("zero_lag_pipeline")
def test_zero_lag_pipeline_reproduces_conventional_g1(zero_lag_pipeline):
    """--max-lag 0 degenerates PipelineRL to generate B, train one step, push: the same batches,
    rewards and losses as Conventional RL with G=1 on the same seed (per-request sampling seeds,
    batches in data order), and the in-flight push never meets a running sequence."""
    flags, pipeline = ZERO_LAG, zero_lag_pipeline
    conventional = _run("--exp-name", "pytest_prl_parity_conventional", "--mode", "conventional",
                        "--steps-per-rl-step", "1", *flags)
    assert conventional.returncode == 0, conventional.stderr[-3000:]
    (_, a), (_, b) = _rows(pipeline), _rows(conventional)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert all(r["charts/lag_max"] == 0 and r["charts/stale_dropped"] == 0 for r in a)
    # every step moves the weights (seed 3): the later batches test that too
    assert all(r["losses/grad_norm"] > 0 for r in a)
    for ra, rb in zip(a, b):
        for key in ["charts/reward", "charts/accuracy", "charts/response_length", "charts/episodes", "charts/ess",
                    "charts/logprob_diff",
                    "charts/tis_max_ratio", "losses/loss", "losses/pg", "losses/grad_norm"]:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    evals = [[r["eval/pass@1"] for r in runlog.read_metrics(d) if "eval/pass@1" in r] for d in (_rows(pipeline)[0],
                                                                                                _rows(conventional)[0])]
    assert evals[0] == evals[1]
    # and Conventional RL with G=3 resumed from its checkpoint after step 1, in the middle of the RL step (two of its
    # three batches generated, not trained), trains steps 2-6 as the straight run does, row for row: the rest of that
    # RL step from the checkpoint's batches, then a whole one sampled after the resume (the shuffle, the push)
    straight = _run("--exp-name", "pytest_prl_g3", "--mode", "conventional", "--steps-per-rl-step", "3",
                    "--save-every", "1", "--keep-checkpoints", "6", *flags, "--num-steps", "6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir, straight_rows = _rows(straight)
    resumed = _run("--resume", str(run_dir / "checkpoints" / "1.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    timing = lambda k: k.startswith(("time/", "memory/")) or k in ("wall",) or "per_second" in k or "wait" in k  # noqa: E731
    same = lambda v: "nan" if v != v else v  # noqa: E731  (charts/kl without a reference model)
    rows = [[{k: same(v) for k, v in r.items() if not timing(k)} for r in rs] for rs in (straight_rows,
                                                                                         _rows(resumed)[1][1:])]
    assert len(rows[1]) == 5 and rows[0][1:] == rows[1]  # (the copy's rows after the checkpoint: logged anew)


@pytest.mark.slow
def test_nonfinite_step_is_skipped_counted_and_never_pushed():
    """A NaN loss on the first batch: no optimizer step, no push, no checkpoint of it; counted,
    logged, and the run goes on."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import common, pipeline_rl as prl
        from fastrl import vllm_sampler
        real_loss, real_push, calls = prl.truncated_is_loss, vllm_sampler.Sampler.push_weights, []
        def poisoned(*a, **k):
            calls.append(1)
            loss, pg, kl = real_loss(*a, **k)
            return (loss * float("nan") if len(calls) == 1 else loss), pg, kl
        def push(self, version, *a, **k):
            print("PUSH", version, flush=True)
            return real_push(self, version, *a, **k)
        prl.truncated_is_loss, vllm_sampler.Sampler.push_weights = poisoned, push
        sys.argv = ["pipeline_rl.py", "--exp-name", "pytest_prl_nan", "--num-steps", "2", "--train-batch-size", "8",
                    "--gen-batch-size", "8", "--eval-problems", "4", "--eval-samples", "1"]
        prl.main()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=WORK, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, rows = _rows(out)
    assert [line for line in out.stdout.splitlines() if line.startswith("PUSH")] == ["PUSH 1", "PUSH 2"]
    assert [r["step"] for r in rows] == [1, 2] and [r["charts/nonfinite_skipped"] for r in rows] == [1, 1]
    skip_rows = [r for r in runlog.read_metrics(run_dir) if "losses/loss" not in r and "charts/nonfinite_skipped" in r]
    assert [(r["step"], r["charts/nonfinite_skipped"]) for r in skip_rows] == [(0, 1)]
    # its ESS is logged too (the loss was poisoned, not the data)
    assert skip_rows[0]["charts/ess"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow
def test_realistic_model_with_top_p_and_chat_template(realistic_path):
    """The path users run: BPE tokenizer with pad == eos, bf16 checkpoint, ChatML template, the
    non-tiny defaults shrunk by flags, temperature 1.0 (PipelineRL's) and top-p 0.95: the learner's
    logprobs of freshly generated sequences equal the sampler's."""
    out = _run("--model", realistic_path, "--exp-name", "pytest_prl_real", "--num-steps", "2",
               "--train-batch-size", "8",
               "--group-size", "4", "--gen-batch-size", "8", "--micro-batch-size", "8", "--max-new-tokens", "48",
               "--eval-problems", "4", "--eval-samples", "2", "--temperature", "1.0", "--top-p", "0.95",
               "--chat-template")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, rows = _rows(out)
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["learning_rate"], args["top_p"], args["chat_template"]) == (1e-6, 0.95, True)
    assert "<|im_start|>user" in out.stdout.split("first training prompt")[1].splitlines()[0]
    assert [r["step"] for r in rows] == [1, 2]
    diffs = [r["charts/logprob_diff"] for r in rows if "charts/logprob_diff" in r]
    assert diffs and max(diffs) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("flags, flag", [
    (["--num-steps", "0"], "--num-steps"), (["--learning-rate", "0"], "--learning-rate"),
    (["--micro-batch-size", "0"], "--micro-batch-size"), (["--train-batch-size", "0"], "--train-batch-size"),
    (["--train-batch-size", "-8"], "--train-batch-size"),
                                         (["--train-batch-size", "10", "--group-size", "4"], "--train-batch-size"),
    (["--temperature", "0"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--steps-per-rl-step", "0"], "--steps-per-rl-step"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-lag", "-1"], "--max-lag"), (["--chat-template"], "--chat-template")])  # the tiny tokenizer has no template
def test_bad_flags_are_one_line_errors_before_the_sampler_starts(error_before_start, flags, flag):
    assert error_before_start(prl, *flags).startswith(f"error: {flag}:")


@pytest.mark.slow
def test_bad_flags_are_rejected_from_the_command_line():
    start = time.monotonic()
    out = _run("--temperature", "0", timeout=120)
    assert out.returncode != 0 and "error: --temperature: must be > 0" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 60  # before any model or sampler is loaded


@pytest.mark.slow
@pytest.mark.xdist_group("zero_lag_pipeline")
def test_two_torchrun_ranks_train_as_one_process(tmp_path, zero_lag_pipeline):
    """The script under `torchrun --nproc-per-node 2` (FSDP2 over gloo): the same steps, losses and
    trained weights as one process on the same batches (zero_lag_pipeline); rank 0 alone writes the
    run. --max-lag 0: with in-flight updates which sequences make a batch depends on how fast the
    learner is, so the comparison uses the strictly on-policy pipeline (the same batches whatever
    the speed, as in test_zero_lag_pipeline_reproduces_conventional_g1); every batch is then
    generated by the weights last pushed, so charts/logprob_diff checks each push of the gathered
    weights. Resuming under torchrun (runlog.load_checkpoint) is rloo_kreuse.py's test's: a third launch here
    would test the same helper."""
    from safetensors.torch import load_file

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*torchrun, str(ROOT / "pipeline_rl.py"), "--max-lag", "0", *ZERO_LAG], cwd=tmp_path,
                         capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {"two": tmp_path / out.stdout.split("run directory: ")[1].split()[0], "one": _rows(zero_lag_pipeline)[0]}
    assert len(list(runs["two"].parent.iterdir())) == 1  # only rank 0 writes a run directory
    rows = {k: [r for r in runlog.read_metrics(d) if "losses/loss" in r] for k, d in runs.items()}
    assert [r["step"] for r in rows["two"]] == [r["step"] for r in rows["one"]] == [1, 2, 3]
    for key in ("charts/reward", "charts/ess", "charts/tis_max_ratio", "losses/loss", "losses/pg", "losses/grad_norm"):
        assert [r[key] for r in rows["two"]] == pytest.approx([r[key] for r in rows["one"]], rel=1e-4, abs=1e-6), key
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rows["two"])  # rank 0 pushed the gathered weights
    two, one = (load_file(d / "model" / "model.safetensors") for d in (runs["two"], runs["one"]))
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-5

def test_a_real_model_gets_the_papers_one_or_zero_reward():
    """Sec. 5: "reward 1 to any generated sequence with the correct answer and 0 otherwise": a real model's default;
    Countdown's 0.1 for a well-formed wrong answer stays the tiny model's (and --no-binary-reward's)."""
    real = checks.parse_args(prl.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=prl.PAPER)
    tiny = checks.parse_args(prl.Args, [], paper=prl.PAPER)
    kept = checks.parse_args(prl.Args, ["--model", "Qwen/Qwen2.5-0.5B", "--no-binary-reward"], paper=prl.PAPER)
    assert (real.binary_reward, tiny.binary_reward, kept.binary_reward) == (True, False, False)
    task = tasks.make_task("countdown", 1, tiny_prompts=False)
    problem = task.problem("train", 0)
    wrong = f"<answer>{'+'.join(map(str, problem.numbers))}</answer>"  # well formed, every number once
    if tasks.safe_arithmetic(wrong[8:-9])[0] == problem.target:
        wrong = f"<answer>{'*'.join(map(str, problem.numbers))}</answer>"
    right = f"<answer>{problem.answer}</answer>"
    assert task.reward(wrong, problem) == tasks.COUNTDOWN_FORMAT_SCORE > 0
    own = [1.0, tasks.COUNTDOWN_FORMAT_SCORE, 0.0]  # charts/reward: the task's own score, whatever is trained on
    assert [prl.reward_function(task, real)(c, problem) for c in (right, wrong, "no answer")] == [*zip([1, 0, 0], own)]
    assert [prl.reward_function(task, tiny)(c, problem) for c in (right, wrong, "no answer")] == [*zip(own, own)]


def test_a_real_model_gets_the_authors_optimizer_group_size_and_schedule():
    """The paper names Adam at 1e-6 and nothing more of the optimizer, nor a group size: a real model gets the authors'
    code's values. ServiceNow/PipelineRL conf/finetune/base.yaml at 9c755ed (2025-09-13, the paper's month; the same at
    58d3934, 2026-06): `optim: adamw_torch`, `weight_decay: 0.01`, `learning_rate: 1e-6`, `gradient_clipping_threshold:
    0.3`, `lr_scheduler_type: cosine`, `num_warmup_steps: 50`, `max_train_steps: 100000` (the cosine's length: its
    launch command sets no other), `attempts: 8` (conf/base.yaml: `attempts: ${finetune.attempts}`, the group size).
    The tiny model and --model smollm2 keep a constant rate without decay, clipped at 1.0 (their numbers unchanged)."""
    real = checks.parse_args(prl.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=prl.PAPER, smollm2=prl.SMOLLM2)
    assert (real.group_size, real.learning_rate, real.weight_decay, real.max_grad_norm) == (8, 1e-6, 0.01, 0.3)
    assert (real.lr_schedule, real.warmup_steps, real.lr_schedule_steps) == ("cosine", 50, 100_000)
    for argv in ([], ["--model", "smollm2"]):
        kept = checks.parse_args(prl.Args, argv, paper=prl.PAPER, smollm2=prl.SMOLLM2)
        assert (kept.weight_decay, kept.lr_schedule, kept.warmup_steps, kept.max_grad_norm) == (0.0, "constant", 0, 1.0)
        assert [prl.scheduled_learning_rate(kept, s) for s in (0, 7, 10**6)] == [kept.learning_rate] * 3
    assert checks.parse_args(prl.Args, ["--model", "smollm2"], paper=prl.PAPER, smollm2=prl.SMOLLM2).group_size == 8


def test_the_cosine_schedule_by_hand_and_against_transformers():
    """HF's get_cosine_schedule_with_warmup, stepped after each optimizer step as the authors' trainer does: step s (s
    steps taken before it) trains at lr * s / 50 in the warmup (the first at 0), then lr * (1 + cos(pi * (s - 50) /
    99950)) / 2; 0 from the end on."""
    from transformers import get_cosine_schedule_with_warmup

    args = checks.parse_args(prl.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=prl.PAPER)
    by_hand = {0: 0.0, 25: 0.5e-6, 49: 0.98e-6, 50: 1e-6, 1000: 1e-6 * (1 + math.cos(math.pi * 950 / 99950)) / 2,
               50_025: 0.5e-6, 100_000: 0.0, 150_000: 0.0}
    # 950/99950 of the half-cosine
    assert prl.scheduled_learning_rate(args, 1000) == pytest.approx(0.99977700e-6, rel=1e-7)
    for step, lr in by_hand.items():
        assert prl.scheduled_learning_rate(args, step) == pytest.approx(lr, rel=1e-12, abs=1e-18), step
    short = prl.Args(learning_rate=1.0, lr_schedule="cosine", warmup_steps=3, num_steps=11)  # None: over --num-steps
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    hf = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=11)
    for step in range(12):
        assert prl.scheduled_learning_rate(short, step) == pytest.approx(optimizer.param_groups[0]["lr"],
                                                                         abs=1e-12), step
        optimizer.step()
        hf.step()
    constant = prl.Args(learning_rate=2.0, warmup_steps=4)  # a warmup, then constant
    assert [prl.scheduled_learning_rate(constant, s) for s in (0, 2, 4, 99)] == [0.0, 1.0, 2.0, 2.0]


def strip_pipeline(source: str) -> str:
    """pipeline_rl.py as a student strips it to the method: no checkpoints, snapshots or evaluation between steps
    (the loop's after-step lines), no torchrun calls (from_main, all_sum), and one metric besides the
    seconds."""
    source = without_after_round(source)
    replacements = [
        ("            loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches\n", ""),
        ("run.from_main(lambda: actor.next_batch(step))", "actor.next_batch(step)"),
    ]
    return strip_to_method(source, replacements,
                           '{"charts/reward": rewards.mean().item(), '
                           '"time/learner_wait_seconds": learner_wait, "time/train_seconds": train_seconds}')


@pytest.mark.slow
def test_a_copy_stripped_to_its_method_runs_pushes_and_stops():
    """Issue 48: the copy's obligations are code. --max-lag 0: each batch is admitted only once the sampler holds the
    learner's weights, so the copy finishes only if every step's in-flight push landed."""
    out = run_stripped_copy("pipeline_stripped", strip_pipeline((ROOT / "pipeline_rl.py").read_text()),
                            ["--max-lag", "0", "--num-steps", "3", "--train-batch-size", "8", "--group-size", "4",
                             "--eval-problems", "4", "--eval-samples", "1"], "pipeline_rl")
    assert "step 3/3 step 3" in out.stdout and "reward" in out.stdout


def test_the_actors_state_goes_through_a_checkpoint_and_trains_every_admitted_prompt_once(tmp_path, monkeypatch):
    """Issue 59, item 1: a checkpoint of pipeline mode dropped the groups admitted and not trained (the trainer queue,
    and the prompts in flight), and Conventional RL's batches of the RL step. Actor.state keeps them as plain data
    (checkpoints load weights_only); a restored actor hands the queued groups over as they were, submits the prompts
    that were in flight before any new one, and goes on from the same data position and generator."""
    def completion(key, i):
        return vllm_sampler.Completion(request_id=f"{key}-{i}", prompt_token_ids=[1, 2], token_ids=[3, 4],
                                       logprobs=[-0.5, -0.25], finish_reason="stop", versions=[(2, 0, 2)], text="7",
                                       tag=(key, i))

    args = prl.mode_defaults(prl.Args(group_size=2))
    actor = object.__new__(prl.Actor)  # the actor's bookkeeping alone: no sampler, no task
    actor.args, actor.data_position, actor.resubmit = args, 9, []
    actor.shuffle_rng = np.random.default_rng([1, 1])
    actor.ready = prl.deque([(5, [completion(5, 0), completion(5, 1)])])
    actor.rl_step = [[(6, [completion(6, 0), completion(6, 1)])]]
    actor.groups = {7: [completion(7, 0)], 8: []}  # in flight: one sample of prompt 7 back, none of 8
    actor.shuffle_rng.random(3)  # (part-way through)
    path = tmp_path / "actor.pt"
    torch.save(dict(actor=actor.state()), path)
    restored = object.__new__(prl.Actor)
    restored.args, restored.data_position, restored.groups = args, 9, {}
    restored.shuffle_rng = np.random.default_rng([1, 1])
    restored.restore(torch.load(path, weights_only=True)["actor"])
    assert list(restored.ready) == list(actor.ready) and restored.rl_step == actor.rl_step
    assert restored.resubmit == [7, 8] and restored.shuffle_rng.random() == actor.shuffle_rng.random()
    long_tail = np.random.default_rng(5).bit_generator.state  # an older checkpoint's rngs: [long-tail, shuffle]
    restored.restore(actor.state() | dict(rngs=[long_tail, actor.shuffle_rng.bit_generator.state]))
    assert restored.shuffle_rng.random() == actor.shuffle_rng.random()
    submitted = []
    restored.task = SimpleNamespace(problem=lambda split, key: key)
    restored.tokenizer, restored.totals = None, {"skipped_prompts": 0}
    restored.sampler = SimpleNamespace(submit=lambda prompts, **kw: submitted.extend(kw["tags"]))
    monkeypatch.setattr(tasks, "encode_prompts", lambda tokenizer, problems, *a: (None, [[problems[0]]], 0))
    restored.submit(3)
    assert submitted == [7, 8, 9] and restored.data_position == 10  # in flight first, then on from the position


@pytest.mark.parametrize("flags, error, message", [
    (("--mode", "conventional", "--steps-per-rl-step", "2"), SystemExit, "the sampler generated this batch with"),
    (("--max-lag", "1"), RuntimeError, "the pipeline stalled: 0 of 4 sequences queued, 0 in flight, learner step 2, "
                                       "sampler version 0")])
def test_a_lost_push_stops_the_run_where_the_lag_is_bounded(scripted_main, monkeypatch, flags, error, message):
    """A sampler that never takes the pushed weights (a copy that lost its push) stops the run in one line naming the
    versions once its data is older than the bound: Conventional RL's G - 1 (the version check), or --max-lag (the
    actor, which drops that data, finds nothing it may admit: it spun before, admitting and dropping forever)."""
    monkeypatch.setattr(ScriptedSampler, "push_weights", lambda self, version, **kw: 0.0)  # version stays 0
    _, _, raised, _ = scripted_main("--num-steps", "4", *flags, error=error)
    assert message in str(raised), str(raised)
