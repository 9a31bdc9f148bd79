import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common
from fastrl import checks, launch, runlog, util
import tasks


def test_pad_and_token_logprobs_match_a_manual_forward(tiny_path):
    model = common.load_policy(tiny_path, "cpu")
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 1]]
    ids, attn, mask = common.pad_prompt_completions(prompts, completions, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 10, 11, 0], [8, 9, 12, 13, 14, 1]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    with torch.no_grad():
        lp, ent = common.token_logprobs(model, ids, attn, mask, temperature=0.5, with_entropy=True)
        logits = model(torch.tensor([[8, 9, 12, 13]])).logits[0].float() / 0.5
    manual = torch.log_softmax(logits, -1)
    assert lp[1, 1].item() == pytest.approx(manual[1, 12].item(), abs=1e-5)  # predicts token 12 from position 1
    assert lp[1, 2].item() == pytest.approx(manual[2, 13].item(), abs=1e-5)
    assert lp[0, 0] == 0 and lp[0, 5 - 1] == 0  # prompt and padding positions are zero
    assert (ent[mask[:, 1:].bool()] > 0).all()


def test_run_logger_writes_jsonl_tensorboard_and_args(tmp_path):
    @dataclass
    class Args:
        lr: float = 1e-3
        k: int = 2

    logger = runlog.RunLogger("unit", Args(), root=str(tmp_path))
    logger.log(1, {"charts/reward": 0.5, "losses/loss": torch.tensor(2.0)})
    logger.log(2, {"charts/reward": 0.7})
    logger.close()
    run = tmp_path / "unit"
    rows = runlog.read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["losses/loss"] == 2.0 and rows[1]["charts/reward"] == 0.7
    assert json.loads((run / "args.json").read_text()) == {"lr": 1e-3, "k": 2}
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())
    assert "step 2" in (run / "console.log").read_text()


def test_checkpoint_roundtrip_restores_model_optimizer_rng_and_position(tmp_path):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    util.set_seed(7)
    runlog.save_checkpoint(tmp_path / "checkpoint.pt", model, optimizer, step=5, data_position=40, extra_thing=3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = runlog.load_checkpoint(tmp_path, fresh, fresh_opt)
    assert (state["step"], state["data_position"], state["extra_thing"]) == (5, 40, 3)
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    with pytest.raises(SystemExit, match="--resume"):
        runlog.load_checkpoint(tmp_path / "nowhere", fresh, fresh_opt)


def test_mismatch_correction_is_on_by_default_exactly_when_the_precisions_differ():
    on = checks.mismatch_correction
    # fp32 sampler, fp32 learner
    assert not on("auto", "auto", "cpu", False) and not on("auto", "float32", "colocate", False)
    # a GPU sampler is bf16 by default
    assert on("auto", "auto", "colocate", False) and on("auto", "auto", "separate", False)
    assert on("auto", "bfloat16", "cpu", False) and on("auto", "float16", "cpu", False)
    assert on("auto", "float32", "cpu", True)  # a bf16-autocast learner against an fp32 sampler
    assert on("on", "float32", "cpu", False) and not on("off", "bfloat16", "colocate", True)


def test_resume_continues_with_the_saved_flags_and_refuses_a_changed_one(tmp_path):
    import dataclasses

    import rloo_kreuse as rloo

    run = tmp_path / "run"
    run.mkdir()
    saved = dataclasses.asdict(rloo.Args(k=8, top_p=0.9, num_rounds=10, group_size=4, sampler_url=["http://a"]))
    (run / "args.json").write_text(json.dumps(saved))
    args = checks.parse_args(rloo.Args, ["--resume", str(run)])
    # forgetting --k 8 keeps K=8
    assert (args.k, args.top_p, args.group_size, args.sampler_url) == (8, 0.9, 4, ["http://a"])
    assert checks.parse_args(rloo.Args, ["--resume", str(run), "--num-rounds", "20", "--k", "8"]).num_rounds == 20
    with pytest.raises(SystemExit) as refused:
        checks.parse_args(rloo.Args, ["--resume", str(run), "--k", "4"])
    assert (str(refused.value).startswith("error: --k 4 (saved: 8): differs from the run being resumed")
            and "\n" not in str(refused.value))
    assert checks.parse_args(rloo.Args, ["--resume", str(run), "--k", "4", "--resume-changes"]).k == 4
    assert checks.parse_args(rloo.Args, ["--k", "4"]).k == 4  # no resume: the flags as given
    # a run resumed once with --resume-changes saves it in args.json; the next resume checks its flags again
    (run / "args.json").write_text(json.dumps(saved | {"resume_changes": True}))
    with pytest.raises(SystemExit, match="error: --k 4 "):
        checks.parse_args(rloo.Args, ["--resume", str(run), "--k", "4"])


def test_a_saved_run_that_a_newer_check_refuses_resumes_with_the_change_the_error_names(tmp_path):
    """A check added after a run was saved (PPO's --chunk-size needs --chunk-tune-every 0) stops its resume in one line
    naming the flag, and --resume-changes with the change it asks for resumes it: the saved flags alone are not
    checked before the command line applies (they were, and no command line could resume the run)."""
    import dataclasses

    import ppo_oppo

    run = tmp_path / "run"
    run.mkdir()
    saved = dataclasses.asdict(ppo_oppo.Args(chunk_tune_every=0)) | dict(chunk_size=4, chunk_tune_every=20)
    (run / "args.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit) as refused:
        checks.parse_args(ppo_oppo.Args, ["--resume", str(run)])
    assert str(refused.value.code).startswith("error: --chunk-size:") and "\n" not in str(refused.value.code)
    args = checks.parse_args(ppo_oppo.Args, ["--resume", str(run), "--resume-changes", "--chunk-tune-every", "0"])
    assert (args.chunk_size, args.chunk_tune_every) == (4, 0)


def test_k3_is_never_negative_and_keeps_a_small_kl():
    """k3 = r - log r - 1 (log r = ref - logp) written exp(x) - x - 1 in float32 reads 0 below |x| ~ 1e-4 and goes
    negative where exp rounds (charts/kl -0.000 on a policy at its reference); expm1(x) - x keeps it, in every k3."""
    import pipeline_rl
    import rloo_kreuse

    logp, mask = torch.full((3, 4), -0.01), torch.ones(3, 4)
    ref = logp + torch.tensor([[3e-8, -3e-8, 6e-8, -6e-8], [1e-4, -1e-4, 2e-4, -2e-4], [3e-4, 1e-3, -1e-3, 5e-4]])
    x = (ref - logp).double()  # the float32 log-ratios the functions see
    exact = (torch.exp(x) - x - 1).sum(1)
    for k3 in (common.sampled_kl(logp, ref, mask), rloo_kreuse.kl_penalty(logp, ref, mask, "k3")):
        assert (k3 >= 0).all(), k3
        assert torch.allclose(k3[1:].double(), exact[1:], rtol=1e-2, atol=0), (k3, exact)
    kl = pipeline_rl.truncated_is_loss(logp, logp, ref, mask, torch.zeros(3), tis_cap=5.0, kl_coef=0.0)[2]
    assert kl >= 0 and torch.allclose(kl.double(), exact.mean(), rtol=1e-2, atol=0), (kl, exact.mean())
    old = (torch.exp(ref - logp) - (ref - logp) - 1).sum(1)  # the form it replaced: 0 or below on rows 0 and 1
    assert (old[:2] <= 0).all() and (old[:2] < 0).any()


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    from types import SimpleNamespace

    inits = []
    fake = SimpleNamespace(init=lambda **kw: inits.append(kw), finish=lambda: None,
                           util=SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = SimpleNamespace(resume=None, seed=1)
    first = runlog.RunLogger("run", args, track=True, root=str(tmp_path))
    first.close()
    fake.util.generate_id = lambda: "another"
    again = runlog.RunLogger("run", SimpleNamespace(resume=str(first.dir), seed=1), track=True,
                             root=str(tmp_path / "elsewhere"))
    again.close()
    assert (again.dir == first.dir and [kw["id"] for kw in inits] == ["abc123", "abc123"]
            and inits[1]["resume"] == "allow")


def test_a_resumed_log_goes_on_from_where_its_checkpoint_left_it(tmp_path, capsys):
    """RunLogger.resume_at: metrics.jsonl as it was at the checkpoint (position()), the rows logged after it, at its
    own step too (a skipped batch, the end's evaluation), moved to metrics.replaced.jsonl, and the clock from the
    checkpoint's; from a checkpoint without a position, the rows up to its step, stopping at a line that is no row."""
    from types import SimpleNamespace

    log = runlog.RunLogger("run", SimpleNamespace(resume=None, seed=1), root=str(tmp_path))
    log.log(1, {"charts/reward": 0.1}, echo=False)
    log.log(2, {"charts/reward": 0.2}, echo=False)
    saved = log.position()
    log.log(2, {"charts/skipped_steps": 1.0}, echo=False)  # after the save, at its step
    log.log(3, {"charts/reward": 0.3}, echo=False)
    log.close()
    again = runlog.RunLogger("run", SimpleNamespace(resume=str(log.dir / "checkpoint.pt"), seed=1))
    again.resume_at(2, wall=100.0, log_bytes=saved["log_bytes"])
    again.log(3, {"charts/reward": 0.4}, echo=False)
    again.close()
    rows = runlog.read_metrics(log.dir)
    assert [(r["step"], r.get("charts/reward")) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.4)]
    assert rows[2]["wall"] >= 100.0 and saved["wall"] < 100.0
    replaced = [json.loads(line) for line in (log.dir / "metrics.replaced.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replaced] == [2, 3] and "2 rows logged after the checkpoint" in capsys.readouterr().out
    (log.dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n[1]\n{"step": 3}\n')  # an older checkpoint's
    runlog.RunLogger("run", SimpleNamespace(resume=str(log.dir), seed=1)).resume_at(3, wall=0.0)
    assert [r["step"] for r in runlog.read_metrics(log.dir)] == [1, 2]
    assert (log.dir / "metrics.replaced.jsonl").read_text().endswith('[1]\n{"step": 3}\n')


def test_a_sampler_at_the_wrong_version_is_one_line():
    from types import SimpleNamespace

    done = [SimpleNamespace(versions=[(3, 0, 5)]), SimpleNamespace(versions=[(3, 0, 2), (4, 2, 6)])]
    checks.check_sampler_version(done, 4, max_lag=1)  # within the lag the method allows
    with pytest.raises(SystemExit) as stale:
        checks.check_sampler_version(done, 4)
    assert str(stale.value).startswith("error: the sampler generated this batch with policy version(s) [3, 4], the "
                                       "method expects version 4")
    with pytest.raises(SystemExit):
        checks.check_sampler_version(done, 2, max_lag=5)  # ahead of the learner


def test_logprob_diff_beyond_the_precisions_warns_once(capsys):
    warned = []
    checks.warn_logprob_diff(2e-7, False, warned)
    checks.warn_logprob_diff(3e-3, True, warned)  # a bf16 sampler's size
    assert capsys.readouterr().out == ""
    checks.warn_logprob_diff(3e-2, False, warned)
    checks.warn_logprob_diff(7e-2, False, warned)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("warning: charts/logprob_diff 0.03 on fresh weights")


@pytest.mark.parametrize("tis", ["auto", "on", "off"])
def test_the_runs_logprob_diff_warning_follows_the_precisions_not_tis(capsys, tis):
    """Run.log's logprob_diff warning (a round's charts/logprob_diff, Run._warn_logprob_diff) takes its limit from the
    precisions alone (checks.tis_applies at auto): a bf16 sampler's ~1e-2 is no warning under --tis off either, and
    fp32 on both sides warns at 3e-2 under --tis on too; a row without it (not measured) never warns."""
    from fastrl.run import Run

    def warned(sampler_dtype: str, diff: float) -> bool:
        args = SimpleNamespace(tis=tis, sampler_dtype=sampler_dtype, placement="cpu", autocast_bf16=False)
        Run._warn_logprob_diff(SimpleNamespace(args=args, _warned=[]), {"charts/logprob_diff": diff})
        return "warning: charts/logprob_diff" in capsys.readouterr().out

    assert not warned("bfloat16", 3e-2) and warned("float32", 3e-2) and not warned("float32", 2e-7)
    Run._warn_logprob_diff(SimpleNamespace(args=SimpleNamespace(tis=tis, sampler_dtype="float32", placement="cpu",
                                                                autocast_bf16=False), _warned=[]), {})
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_keep_checkpoints_keeps_the_latest_n_and_each_resumes_its_run(tmp_path):
    import dataclasses

    import rloo_kreuse as rloo

    model, run = torch.nn.Linear(2, 2), tmp_path / "run"
    optimizer = torch.optim.Adam(model.parameters())
    for step in (2, 4, 6):
        runlog.save_checkpoint(run / "checkpoint.pt", model, optimizer, step, data_position=step, keep=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4.pt", "6.pt"]
    assert (runlog.checkpoint_state(run / "checkpoints" / "4.pt")["step"] == 4
            and runlog.checkpoint_state(run)["step"] == 6)
    assert (checks.run_dir_of(str(run / "checkpoints" / "4.pt")) == run
            and checks.run_dir_of(str(run / "checkpoint.pt")) == run)
    (run / "args.json").write_text(json.dumps(dataclasses.asdict(rloo.Args(k=8))))
    assert checks.parse_args(rloo.Args, ["--resume", str(run / "checkpoints" / "4.pt")]).k == 8  # the run's own flags
    runlog.save_checkpoint(tmp_path / "one" / "checkpoint.pt", model, optimizer, 1, data_position=1)
    assert not (tmp_path / "one" / "checkpoints").exists()  # the default keeps the latest only


def test_check_args_names_the_flag():
    with pytest.raises(SystemExit, match="--k"):
        checks.check_args(0 >= 1, "--k", "must be >= 1")


@pytest.mark.parametrize("temperature, top_p, top_k",
                         [(0.8, 0.95, 0), (1.0, 0.5, 0), (0.7, 1.0, 5), (1.3, 0.9, 20), (0.8, 1.0, 1)])
def test_sampling_logits_equal_vllms_processing(temperature, top_p, top_k):
    """The learner's processing is vLLM's own: compare with the function the CPU sampler calls."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    logits = torch.randn(64, 300) * 3
    theirs = apply_top_k_top_p_pytorch((logits / temperature).clone(), torch.full((64,), top_k) if top_k else None,
                                       torch.full((64,), top_p) if top_p < 1 else None).log_softmax(-1)
    kept = torch.isfinite(theirs)
    targets = torch.multinomial(theirs.exp(), 1).squeeze(1)  # tokens vLLM could have sampled
    ours = torch.log_softmax(common.sampling_logits(logits, targets, temperature, top_p, top_k), -1)
    assert torch.equal(torch.isfinite(ours), kept)
    assert torch.allclose(ours[kept], theirs[kept], atol=1e-5)
    if top_p < 1 or top_k:
        assert (~kept).any()  # the setting really cuts the vocabulary


def test_sampling_logits_keep_a_target_outside_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    out = torch.log_softmax(common.sampling_logits(logits, torch.tensor([3]), 1.0, 0.9), -1)
    assert torch.isfinite(out[0, 3]) and not torch.isfinite(out[0, 2])  # the sampled token stays finite
    assert out[0, 3] == pytest.approx((logits[0, 3] - torch.logsumexp(logits[0, [0, 1, 3]], 0)).item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.95, 0), (0.7, 0.9, 50), (1.0, 0.3, 0)])
def test_the_vocabulary_parts_written_out_gradient_is_autograds(dtype, temperature, top_p, top_k):
    """VocabularyLogprobs (log-probabilities and entropy, with the gradient written out) against autograd through
    sampling_logits, log_softmax and the entropy's formula: the same values and gradients, excluded tokens included
    (their gradient 0, not NaN), the gradient in the logits' dtype (autocast's bf16 logits)."""
    torch.manual_seed(0)
    logits = (torch.randn(37, 500) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 500, (37,))
    g_chosen, g_entropy = torch.randn(37), torch.randn(37)
    logps = torch.log_softmax(common.sampling_logits(logits.float(), targets, temperature, top_p, top_k), -1)
    chosen = logps.gather(-1, targets[:, None]).squeeze(-1)
    probs = logps.exp()
    entropy = -(probs * logps.masked_fill(probs == 0, 0.0)).sum(-1)
    loss = (chosen * g_chosen).sum() + (entropy * g_entropy).sum()
    expected = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    ours_chosen, ours_entropy = common.VocabularyLogprobs.apply(logits, targets, temperature, top_p, top_k, True)
    ours = torch.autograd.grad((ours_chosen * g_chosen).sum() + (ours_entropy * g_entropy).sum(), logits)[0]
    assert torch.equal(ours_chosen, chosen) and torch.allclose(ours_entropy, entropy, atol=1e-6)
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    assert torch.allclose(ours.float(), expected.float(), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-2)
    if top_p < 1:  # excluded tokens get no gradient (not just a small one)
        assert (ours[~torch.isfinite(logps.detach())] == 0).all() and (~torch.isfinite(logps)).any()
    only_chosen = common.VocabularyLogprobs.apply(logits, targets, temperature, top_p, top_k, False)[0]
    assert torch.allclose(torch.autograd.grad((only_chosen * g_chosen).sum(), logits)[0].float(),
                          torch.autograd.grad((chosen * g_chosen).sum(), logits)[0].float(), atol=1e-6, rtol=1e-2)


@pytest.mark.parametrize("recompute", [False, True])
def test_chunked_logprobs_equal_one_forward_values_and_gradients(realistic_path, recompute, monkeypatch):
    """Chunking the vocabulary projection over positions, each chunk's log-probabilities kept for the backward
    pass or (above SAVED_LOGPROB_BYTES) recomputed in it, changes no number: same logprobs, entropy and gradients
    as one whole forward."""
    model = common.load_policy(realistic_path, "cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    attn = torch.ones_like(ids)
    cmask = torch.zeros_like(ids)
    cmask[:, 10:] = 1
    results = []
    # one chunk; chunks of 7 positions (kept, or recomputed: the saved log-probabilities' limit below them)
    for chunk_bytes in (common.LOGIT_CHUNK_BYTES, 4 * 3 * model.config.vocab_size * 7):
        if chunk_bytes < common.LOGIT_CHUNK_BYTES and recompute:
            monkeypatch.setattr(common, "SAVED_LOGPROB_BYTES", 0)
        model.zero_grad()
        logp, ent = common.token_logprobs(model, ids, attn, cmask, 0.8, 0.95, with_entropy=True,
                                          chunk_bytes=chunk_bytes)
        (logp.sum() + 0.1 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (a_logp, a_ent, a_grad), (b_logp, b_ent, b_grad) = results
    assert torch.allclose(a_logp, b_logp, atol=1e-5) and torch.allclose(a_ent, b_ent, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a_grad, b_grad))
    with torch.no_grad():  # and both equal the model's own logits
        full = torch.log_softmax(common.sampling_logits(model(ids).logits[:, :-1].float(), ids[:, 1:], 0.8, 0.95), -1)
    expected = full.gather(-1, ids[:, 1:, None]).squeeze(-1) * cmask[:, 1:]
    assert torch.allclose(a_logp, expected, atol=1e-5)


def test_learner_threads_take_every_core_only_while_the_sampler_is_idle(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU rule")
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        sampler = type("FakeSampler", (), {})()
        cases = [(set(), False, cores), ({"7"}, False, 1), ({"7"}, True, cores), (set(), True, cores)]
        for pending, paused, expected in cases:  # (requests generating, paused) -> threads
            sampler.pending, sampler.paused = pending, paused
            assert launch.learner_threads(sampler) == expected == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an explicit budget is kept as it is
        torch.set_num_threads(1)
        sampler.pending, sampler.paused = set(), False
        assert launch.learner_threads(sampler) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_report_prints_the_row_eval_and_memory_and_writes_summary(tmp_path, capsys):
    logger = runlog.RunLogger("report__1__1", SimpleNamespace(resume=None), root=str(tmp_path))
    try:
        text = logger.report(3, "RLOO K=2", {"K": "2", "wall (s)": 123.456, "grad steps/s": 0.5},
                             {"eval/pass@1": 0.25, "eval/pass@4": 0.5}, {"eval/pass@1": 0.375, "eval/pass@4": 0.625},
                             {"learner": 512.4, "sampler": 900.0}, saved="model/ holds float32 weights; ...")
    finally:
        logger.close()
    assert "| K | wall (s) | grad steps/s |" in text and "| 2 | 123 | 0.500 |" in text
    assert ("| model | pass@1 | pass@4 |" in text and "| start | 0.250 | 0.500 |" in text
            and "| end | 0.375 | 0.625 |" in text)
    assert "peak memory: learner 512 MiB, sampler 900 MiB" in text
    assert f"\nmachine: {util.machine_line()}\nsaved: model/ holds float32 weights; ...\n" in text  # beside the times
    assert " cores, bf16 " in text
    assert (logger.dir / "summary.md").read_text() == text and text in capsys.readouterr().out
    last = runlog.read_metrics(logger.dir)[-1]
    assert last["eval/pass@1_gain"] == pytest.approx(0.125) and last["memory/sampler_peak_mib"] == 900.0


def test_the_report_says_in_two_lines_what_happened():
    start = {"eval/pass@1": 0.40, "eval/pass@16": 0.90, "eval/problems": 200.0}
    sharpened = runlog.what_happened(start, {"eval/pass@1": 0.52, "eval/pass@16": 0.70, "eval/problems": 200.0}, 1.2)
    assert sharpened[0] == ("what happened: held-out pass@1 0.400 -> 0.520, up (+-0.069 is two standard errors over "
                            "200 problems)")
    assert (sharpened[1].startswith("pass@16 0.900 -> 0.700: the policy sharpened")
            and sharpened[1].endswith("KL to the reference 1.200 nats"))
    noise = runlog.what_happened(start, {"eval/pass@1": 0.43, "eval/pass@16": 0.91, "eval/problems": 200.0}, None)
    assert "within the evaluation's noise" in noise[0] and noise[1] == "pass@16 0.900 -> 0.910"
    assert "down" in runlog.what_happened(start,
                                          {"eval/pass@1": 0.2, "eval/pass@16": 0.5, "eval/problems": 200.0}, 0.1)[0]
    # greedy: pass@1 only, no count
    assert len(runlog.what_happened({"eval/pass@1": 0.3}, {"eval/pass@1": 0.5}, 0.0)) == 2




def test_chat_prompts_on_chatml_system_user_and_the_start_of_the_reply(realistic_path):
    """An instruct model's prompt: the task's system turn, its user turn (not the base prompt's whole
    text), the generation prompt, then the start of the reply the model continues; --system-prompt
    replaces the system turn; the base prompt is untouched without the template."""

    tokenizer = util.load_tokenizer(realistic_path)
    task = tasks.make_task("countdown", seed=1, tiny_prompts=False)
    problem = task.problem("train", 0)
    _, ids, _ = tasks.encode_prompts(tokenizer, [problem], 4096, chat_template=True)
    text = tokenizer.decode(ids[0])
    assert text.startswith(f"<|im_start|>system\n{tasks.CHAT_SYSTEM}<|im_end|>\n"
                           f"<|im_start|>user\n{problem.user}<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")
    # the base prompt's own turns are not stranded in the user turn
    assert "User:" not in text and "Assistant:" not in text
    custom = tasks.make_task("countdown", seed=1, tiny_prompts=False, system_prompt="Be brief.")
    _, ids, _ = tasks.encode_prompts(tokenizer, [custom.problem("train", 0)], 4096, chat_template=True)
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    none = tasks.make_task("countdown", seed=1, tiny_prompts=False, system_prompt="")
    _, ids, _ = tasks.encode_prompts(tokenizer, [none.problem("train", 0)], 4096, chat_template=True)
    assert "Be brief" not in tokenizer.decode(ids[0]) and tasks.CHAT_SYSTEM not in tokenizer.decode(ids[0])
    _, ids, _ = tasks.encode_prompts(tokenizer, [problem], 4096, chat_template=False)
    assert tokenizer.decode(ids[0]) == problem.prompt

    # a reward model with a chat template reads the exchange in it
    scorer = tasks.RewardModel.__new__(tasks.RewardModel)
    scorer.tokenizer = tokenizer
    [read] = scorer.conversations([problem], [" 3*4 </think> <answer>12</answer>"])
    assert f"<|im_start|>user\n{problem.user}<|im_end|>" in read
    assert ("<|im_start|>assistant\nLet me solve this step by step.\n"
            "<think> 3*4 </think> <answer>12</answer><|im_end|>" in read)


def test_progress_on_a_terminal_draws_a_bar_with_lines_above_it(monkeypatch, capsys):
    """On a terminal: a bar on stderr with the metrics in its postfix; printed lines (write, or any
    print while it is shown) go to stdout whole, and stdout is put back when it closes."""
    import io

    bar_stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", bar_stream)
    stdout = sys.stdout
    with util.Progress(4, "train", unit="round", terminal=True) as progress:
        assert sys.stdout is not stdout  # the bar's line writer
        progress.update(1, reward=0.25, step=2)
        progress.write("round 1/4 step 2: reward 0.250")
        print("[ 1.0s] step 2:", "pass@1=0.5")
        progress.update(3)
    assert sys.stdout is stdout
    assert capsys.readouterr().out == "round 1/4 step 2: reward 0.250\n[ 1.0s] step 2: pass@1=0.5\n"  # as printed
    bar = bar_stream.getvalue()
    assert "train: 100%" in bar and "4/4" in bar and "reward=0.25" in bar and "round/s" in bar


def test_progress_off_a_terminal_prints_plain_lines_with_the_time_left(capsys):
    """Not a terminal (here: captured): no bar, no control characters; written lines keep their text
    with the time appended, and a quiet stretch gets a plain line every `every` seconds."""
    assert not util.on_terminal()  # pytest captures stdout
    with util.Progress(10, "eval", unit="sample", initial=2, every=0.0) as progress:
        progress.update(3, reward=0.5)
        progress.write("round 1/3 step 6: reward 0.500")
        progress.update(5)  # the last: no line (the caller prints the result)
    with util.Progress(10, "eval", unit="sample", every=3600.0) as quiet:
        quiet.update(4)
    with util.Progress(10, "eval", unit="sample", every=0.0, show=False) as other_rank:
        other_rank.update(4)
        other_rank.write("as it is")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "\r" not in "".join(lines) and "\x1b" not in "".join(lines)
    assert (lines[0].startswith("eval: 5/10 samples reward 0.5 (") and "elapsed, ~" in lines[0]
            and lines[0].endswith(" left)"))
    assert lines[1].startswith("round 1/3 step 6: reward 0.500 (") and lines[1].endswith(" left)")
    assert lines[2] == "as it is"


def test_sampler_log_levels_follow_verbose():
    """--verbose: vLLM's and torch's start-up warnings and vLLM's load bar; without it errors only."""
    from fastrl import vllm_sampler

    assert vllm_sampler.log_environment(False) == {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    assert vllm_sampler.log_environment(True) == {"VLLM_LOGGING_LEVEL": "WARNING", "TORCH_CPP_LOG_LEVEL": "WARNING"}
    for verbose in (False, True):
        config = vllm_sampler.SamplerConfig(model="m", verbose=verbose)
        assert vllm_sampler.engine_settings(config, "cpu")["use_tqdm_on_load"] is verbose


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo_kreuse", "online_dpo_async", "pipeline_rl", "ppo_oppo"])
def test_verbose_reaches_the_sampler(sampler_start_kwargs, script):
    """--verbose gets to the sampler's config (its log levels and load bar: log_environment); without it the
    sampler is started quiet. main() up to the sampler's start."""
    import importlib

    module = importlib.import_module(script)
    assert sampler_start_kwargs(module, "--model", "tiny", "--verbose")["verbose"] is True
    assert sampler_start_kwargs(module, "--model", "tiny")["verbose"] is False


def test_micro_batch_plan_and_add_outputs_give_the_whole_batch():
    """The scripts' update loop on micro-batches of a tiny budget (several per batch, of unequal sizes), each loss a
    mean backpropagated with its share: the gradient, the loss and the per-item outputs (add_outputs) equal the whole
    batch's in one pass; scalar outputs add up."""
    torch.manual_seed(0)
    lengths = [3, 7, 2, 7, 5, 1]
    x = torch.randn(len(lengths), 4)
    w = torch.randn(4, requires_grad=True)
    plan = common.micro_batch_plan(lengths, 10)
    assert len(plan) > 2 and len({len(mb.items) for mb in plan}) > 1
    loss, outputs = 0.0, {}
    for mb in plan:
        per_item = (x[mb.items] @ w) ** 2
        share = mb.weight * len(mb.items) / len(lengths)
        (per_item.mean() * share).backward()
        loss = loss + per_item.mean().detach() * share
        common.add_outputs(outputs, mb, {"per_item": per_item, "widths": mb.width}, len(lengths))
    grad, w.grad = w.grad.clone(), None
    whole = ((x @ w) ** 2)
    whole.mean().backward()
    assert torch.allclose(grad, w.grad, atol=1e-6) and torch.allclose(loss, whole.mean().detach(), atol=1e-6)
    assert torch.allclose(outputs["per_item"], whole.detach())
    assert outputs["widths"] == sum(mb.width for mb in plan)


def test_parse_args_takes_the_paper_defaults_for_a_real_model_and_the_tiny_ones_otherwise():
    import dataclasses

    @dataclasses.dataclass
    class Args:
        model: str = "tiny"
        group_size: int = 8
        resume: str | None = None

    paper = dict(group_size=2)
    assert checks.parse_args(Args, [], paper=paper).group_size == 8
    assert checks.parse_args(Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=paper).group_size == 2
    assert checks.parse_args(Args, ["--model=Qwen/Qwen2.5-0.5B"], paper=paper).group_size == 2
    assert checks.parse_args(Args, ["--model", "Qwen/Qwen2.5-0.5B", "--group-size", "4"], paper=paper).group_size == 4


def test_sampler_threads_take_every_core_when_the_schedule_takes_turns_and_half_when_it_overlaps(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert launch.sampler_threads(0, overlapped=False) == 8
    assert launch.sampler_threads(0, overlapped=True) == 4
    assert launch.sampler_threads(3, overlapped=False) == 3  # --sampler-threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert launch.sampler_threads(0, overlapped=True) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a fixed budget
    assert launch.sampler_threads(0, overlapped=False) == 2


def test_chat_template_check_reads_the_model_files(tiny_path, realistic_path, tmp_path):
    """--chat-template is checked before the sampler starts, from a local model's files (no transformers import):
    the tiny model has no template, the realistic fixture saves chat_template.jinja, an older save keeps it in
    tokenizer_config.json; the same tokenizers loaded agree."""
    checks.check_chat_template(tiny_path, False)
    with pytest.raises(SystemExit, match="^error: --chat-template: "):
        checks.check_chat_template(tiny_path, True)
    checks.check_chat_template(realistic_path, True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    checks.check_chat_template(str(tmp_path), True)
    assert not util.load_tokenizer(tiny_path).chat_template and util.load_tokenizer(realistic_path).chat_template


def test_an_nvidia_driver_older_than_torchs_cuda_is_one_line_at_start(monkeypatch, tmp_path):
    """A CUDA 13 build of torch on a 570 driver: torch sees no GPU; the start says why, and what to install, in one
    line. A recent enough driver, a CPU build of torch or no NVIDIA driver at all pass."""
    version_file = tmp_path / "version"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a,
                        **k: real_read(version_file if str(self) == "/proc/driver/nvidia/version" else self, *a, **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    version_file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
                            "(dvs-builder@U16)\n")
    assert checks.nvidia_driver_version() == "570.86.15"
    with pytest.raises(SystemExit) as refused:
        checks.check_nvidia_driver()
    message = str(refused.value)
    assert (message.startswith("error: NVIDIA driver 570.86.15 is older than CUDA 13.0") and "580" in message
            and "\n" not in message)
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:34 UTC 2025\n")
    assert checks.nvidia_driver_version() == "580.65.06"
    checks.check_nvidia_driver()  # new enough: whatever hides the GPU, it is not the driver's age
    monkeypatch.setattr(torch.version, "cuda", None)  # the CPU build
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.1  \n")
    checks.check_nvidia_driver()
    version_file.unlink()
    assert checks.nvidia_driver_version() is None


def test_nucleus_without_a_sort_is_the_sorts_set_bit_for_bit():
    """common._nucleus_excluded (top-k candidates, the sort only for ambiguous positions) excludes exactly what
    vLLM's sort excludes: peaked rows (the fast path), flat rows (past the candidates: the sort), ties on the cut."""
    torch.manual_seed(0)
    vocab = 5000
    peaked = torch.randn(200, vocab) * 6  # a nucleus of a few tokens
    flat = torch.randn(50, vocab) * 0.5  # a nucleus wider than every candidate set
    tied = (torch.randn(100, vocab) * 4).round()  # ties everywhere, on the cut too
    two = torch.full((3, vocab), -30.0)
    two[:, :2] = torch.tensor([2.0, 2.0])  # two equal tokens hold all the mass
    logits = torch.cat([peaked, flat, tied, two])
    for top_p in (0.95, 0.9, 0.5, 0.999):
        assert torch.equal(common._nucleus_excluded(logits, top_p), common._excluded_by_sort(logits, top_p, 0))
    kept = (~common._nucleus_excluded(peaked, 0.95)).sum(-1)
    assert (kept < common.NUCLEUS_CANDIDATES[0]).float().mean() > 0.9  # the fast path really ran


def test_token_logprobs_project_only_the_completion(realistic_path):
    """The vocabulary part runs on the completion's positions only: logprobs and entropy equal those of
    the full-logits computation, zero on the prompt; a row without completion tokens still backpropagates."""
    model = common.load_policy(realistic_path, "cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 30))
    attn = torch.ones_like(ids)
    cmask = torch.zeros_like(ids)
    cmask[0, 5:] = 1
    cmask[1, 20:25] = 1
    with torch.no_grad():
        logp, ent = common.token_logprobs(model, ids, attn, cmask, 0.8, 0.95, with_entropy=True)
        logits = model(ids).logits[:, :-1].float()
        full = torch.log_softmax(common.sampling_logits(logits, ids[:, 1:], 0.8, 0.95), -1)
    where = cmask[:, 1:].bool()
    assert torch.allclose(logp[where], full.gather(-1, ids[:, 1:, None]).squeeze(-1)[where], atol=1e-5)
    assert (logp[~where] == 0).all() and (ent[~where] == 0).all()
    empty = common.token_logprobs(model, ids[2:], attn[2:], cmask[2:], 0.8, 0.95)
    assert empty.abs().sum() == 0 and empty.requires_grad
    empty.sum().backward()


def test_throughput_gives_the_runs_counters_one_meaning_in_every_script():
    """common.throughput turns the run's counters into metrics, hand-computed here; charts/skipped_long_prompts is the
    whole run's count in every script (it was a round's in three and the run's in two): no script writes it itself."""
    from fastrl.run import TOTALS

    totals = TOTALS | dict(episodes=30, generate_seconds=2.0, train_seconds=1.0, wall_seconds=4.0, nonfinite_skipped=1,
                           skipped_prompts=5)
    assert common.throughput(totals, 8) == {
        "charts/episodes": 30, "charts/episodes_per_second": 7.5, "time/sample_fraction": 0.5,
        "time/grad_steps_per_second": 2.0, "charts/nonfinite_skipped": 1, "charts/skipped_long_prompts": 5}
    # the learner's wait, where the script measures it (RLOO, DPO); a stream of no rounds (PipelineRL) has no sample
    assert common.throughput(totals | dict(learner_wait_seconds=1.0), 8)["time/learner_wait_fraction"] == 0.25
    streamed = common.throughput(totals | dict(generate_seconds=0.0, learner_wait_seconds=3.0), 8)
    assert "time/sample_fraction" not in streamed and streamed["time/learner_wait_fraction"] == 0.75
    root = Path(__file__).resolve().parents[1]
    for script in ["rloo_kreuse.py", "online_dpo_async.py", "pipeline_rl.py", "ppo_oppo.py", "examples/reinforce.py"]:
        source = (root / script).read_text()
        assert '"charts/skipped_long_prompts"' not in source and 'totals["skipped_prompts"] += ' in source, script
        # time/generate_seconds is the sampler's time for a round (SamplerClient.wait's; PPO's Stage 2, until B
        # finish) in every script, never the learner's wait (it was, under RLOO's --overlap and in PipelineRL)
        if script in ("pipeline_rl.py", "ppo_oppo.py"):
            assert ('"time/generate_seconds"' in source) == (script == "ppo_oppo.py"), script
        else:
            assert "samples, generate_seconds = sampler.wait(request)" in source, script


def test_the_linear_schedule_is_hfs_stepped_once_a_round():
    """common.scheduled_learning_rate (ppo_oppo.py's; online_dpo_async.py writes the same expression in its round,
    test_sync_resume_is_exact reads its rates): HF's get_linear_schedule_with_warmup without warmup (TRL's
    lr_scheduler_type "linear"), stepped once a round; or constant."""
    from transformers import get_linear_schedule_with_warmup

    rates = [common.scheduled_learning_rate(3e-6, "linear", r, 4) for r in range(4)]
    assert rates == pytest.approx([3e-6, 2.25e-6, 1.5e-6, 0.75e-6])
    optimizer = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=3e-6)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, 4)
    hf = []
    for _ in range(4):
        hf.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx(hf)
    assert common.scheduled_learning_rate(3e-6, "constant", 3, 4) == 3e-6


def test_long_tail_lengths_follow_the_prompt_not_the_order_it_is_sent_in():
    """--long-tail's forced length of a prompt depends on --seed and its index alone: a resumed run that resubmits the
    prompts in flight gives them the lengths they had (a shared generator gave them the next draws instead)."""
    args = SimpleNamespace(seed=3, request_seeds=False, long_tail=0.5, long_tail_scale=8, max_new_tokens=4096)
    lengths = lambda keys: {k: o["max_tokens"] for k, o in zip(keys, common.request_overrides(keys, args))}  # noqa
    straight = lengths(list(range(8)))
    assert lengths([5, 6, 7]) == {k: straight[k] for k in (5, 6, 7)}
    assert lengths([7, 5]) == {7: straight[7], 5: straight[5]}
    assert len(set(straight.values())) > 1 and min(straight.values()) >= 8  # a tail, not one length
    assert all(o["ignore_eos"] for o in common.request_overrides([1, 2], args))
    assert common.request_overrides([1, 2], SimpleNamespace(**args.__dict__ | dict(long_tail=0.0))) == [{}, {}]
