"""PipelineRL: loss/ESS/lag by hand, in-flight weight updates on the real sampler, both modes
from the command line."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
import pipeline_rl as prl

ROOT = Path(__file__).resolve().parents[1]


def test_advantages_ess_and_truncated_is_loss_by_hand():
    assert torch.allclose(prl.per_prompt_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.5]])),
                          torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.1, -0.1, -0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert prl.effective_sample_size(torch.ones(2, 3), mask) == pytest.approx(1.0)
    w = torch.tensor([[1.0, 3.0, 9.0], [1.0, 1.0, 2.0]])  # the masked 9 must not count
    assert prl.effective_sample_size(w, mask) == pytest.approx(8.0 ** 2 / (5 * 16.0))

    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -4.0, 0.0], [-0.5, -0.5 + 0.1, -1.0]])  # token weights: 1, e^2 -> 5 (truncated), 1, e^-0.1, 1
    adv = torch.tensor([1.0, -2.0])
    loss, pg, kl = prl.truncated_is_loss(logp, mu, logp.detach(), mask, adv, is_clip=5.0, kl_coef=0.0)
    expected = -(1 * 1 * -1.0 + 5 * 1 * -2.0 + 1 * -2 * -0.5 + torch.e ** -0.1 * -2 * -0.5 + 1 * -2 * -1.0) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6) and kl.item() == 0.0
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-5 / 5)  # truncated weight times advantage, per token
    assert logp.grad[0, 2].item() == 0.0


def test_token_lags_follow_version_spans():
    c = common.Completion("0", [1], [5, 6, 7, 8, 9], [0.0] * 5, "stop", versions=[(3, 0, 2), (4, 2, 5)])
    assert prl.token_lags(c, learner_version=5) == [2, 2, 1, 1, 1]


def _perturbed(model, scale=0.05, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_in_flight_weight_update(tiny_path, tokenizer, sampler, recompute_kv):
    """Push new weights while sequences are being generated: they stay alive and continue, their
    version spans cover every token once and change at the switch; with recompute_kv the tokens
    after the switch have exactly the new weights' logprobs."""
    model = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(model)
    sampler.push_weights(sampler.version + 1)
    old_version = sampler.version
    task = common.make_task("countdown", seed=0, tiny_prompts=True)
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
    ids_t, attn, cmask = common.pad_prompt_completions([c.prompt_token_ids for c in samples], [c.token_ids for c in samples], tokenizer.pad_token_id)
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


def _run(*flags, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "pipeline_rl.py"), *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


SMALL = ["--num-steps", "4", "--train-batch-size", "16", "--gen-batch-size", "16", "--eval-problems", "8", "--eval-samples", "2"]


@pytest.mark.parametrize("mode", ["pipeline", "conventional"])
def test_short_run_exits_0(mode):
    out = _run("--exp-name", f"pytest_prl_{mode}", "--mode", mode, "--g", "2", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = ROOT / out.stdout.split("run directory: ")[1].split()[0]
    rows = [r for r in common.read_metrics(run_dir) if "charts/ess" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and (run_dir / "checkpoint.pt").exists()
    if mode == "conventional":  # G=2: the second step of each RL step trains one step off-policy
        assert [r["charts/lag_max"] for r in rows] == [0, 1, 0, 1]
    assert "| PipelineRL" in out.stdout or "| Conventional RL (G=2)" in out.stdout


def test_ess_guard_skips_stale_batches():
    """With a threshold that only (near) on-policy data passes, batches holding tokens from
    before the last push are skipped and the trainer waits for fresh data, yet the run finishes."""
    out = _run("--exp-name", "pytest_prl_ess", "--ess-threshold", "0.9999", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = ROOT / out.stdout.split("run directory: ")[1].split()[0]
    rows = [r for r in common.read_metrics(run_dir) if "charts/ess" in r]
    assert all(r["charts/ess"] >= 0.9999 for r in rows)  # only (near) on-policy batches were trained on
    assert rows[-1]["charts/skipped_steps"] > 0  # after each in-flight push the stale batches were skipped


def test_bad_flags_are_rejected():
    out = _run("--train-batch-size", "10", "--group-size", "4")
    assert out.returncode != 0 and "error: --train-batch-size" in out.stderr
