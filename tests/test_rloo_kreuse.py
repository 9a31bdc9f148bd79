"""RLOO K-reuse: advantages and loss against hand-computed values, importance weights on the
real sampler, and the script from its real command line."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import common
from fastrl import checks, launch, runlog, util, weight_sync
import rloo_kreuse as rloo
import tasks
from conftest import scratch_dir

ROOT = Path(__file__).resolve().parents[1]
WORK = scratch_dir("fastrl-test-runs-")  # scripts run here


def test_leave_one_out_advantage_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[1 - 0.2 / 3, 0 - 1.2 / 3, 0.1 - 1.1 / 3, 0.1 - 1.1 / 3], [0, 0, 0, 0]])
    assert torch.allclose(rloo.rloo_advantages(rewards), expected)
    assert torch.allclose(rloo.rloo_advantages(torch.tensor([[1.0, 0.0]])), torch.tensor([[1.0, -1.0]]))


def _hp(**kw):
    """rloo_loss's hyperparameters, by name: plain RLOO with sequence weights, no KL, no entropy."""
    return dict(ppo_clip=None, iw_level="sequence", iw_clip=None, kl_coef=0.0, ent_coef=0.0, kl_estimator="k3") | kw


def test_rloo_loss_by_hand():
    # two sequences of two tokens each; the second sequence's last token is padding
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    ent = torch.tensor([[0.5, 1.5], [2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([torch.e ** 0.5, 1.0])  # exp(sum(logp - old)) per sequence
    pg = -(w * adv * torch.tensor([-3.0, -0.5]))
    loss, stats = rloo.rloo_loss(logp, old, ref, ent, mask, adv, **_hp())
    assert loss.item() == pytest.approx(pg.mean().item(), rel=1e-6)
    assert torch.allclose(stats["w"], w)
    # gradient of -w A log pi wrt the token logprobs is -w A (w is not differentiated)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-w[0] / 2, -w[0] / 2], [0.5, 0.0]]))

    # KL (k3, summed per sequence) and entropy (mean per token) terms
    kl = torch.tensor([(torch.e ** 0 - 0 - 1) + (torch.e ** 1 - 1 - 1), (torch.e ** -0.5 + 0.5 - 1)])
    loss2, stats2 = rloo.rloo_loss(logp.detach(), old, ref, ent, mask, adv, **_hp(kl_coef=0.1, ent_coef=0.2))
    assert stats2["kl"].item() == pytest.approx(kl.mean().item(), rel=1e-6)
    assert stats2["entropy"].item() == pytest.approx((1.0 + 2.0) / 2, rel=1e-6)
    assert loss2.item() == pytest.approx((pg + 0.1 * kl - 0.2 * torch.tensor([1.0, 2.0])).mean().item(), rel=1e-6)

    # importance-weight clipping and the PPO-style clipped ratio
    _, clipped = rloo.rloo_loss(logp.detach(), old, ref, ent, mask, adv, **_hp(iw_clip=1.2))
    assert torch.allclose(clipped["w"], torch.tensor([1.2, 1.0]))
    loss3, _ = rloo.rloo_loss(logp.detach(), old, ref, ent, mask, adv, **_hp(ppo_clip=0.2))
    assert loss3.item() == pytest.approx(-(min(w[0], 1.2) * 1.0 + -1.0 * 1.0) / 2, rel=1e-6)


def test_ess_and_pass_at_k():
    assert common.ess(torch.ones(8)) == pytest.approx(1.0)
    assert common.ess(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert tasks.pass_at_k(16, 0, 1) == 0 and tasks.pass_at_k(16, 16, 4) == 1
    assert tasks.pass_at_k(4, 1, 1) == pytest.approx(0.25) and tasks.pass_at_k(4, 1, 2) == pytest.approx(0.5)


@pytest.mark.slow
def test_importance_weights_on_the_real_sampler(tiny_path, tokenizer, sampler):
    """K=1 / fresh weights: w = 1 (1e-4) and ESS = 1; after an update, w moves away from 1."""
    policy = common.load_policy(tiny_path, "cpu")
    sampler.init_weight_sync(policy)
    sampler.push_weights(sampler.version + 1)  # the sampler holds exactly the learner's weights
    task = tasks.make_task("countdown", seed=0, tiny_prompts=True)
    problems = [task.problem("train", i) for i in range(8)]
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    samples = sampler.generate(prompts, n=4, temperature=0.8, top_p=1.0, max_tokens=24)
    ids, attn, cmask = common.pad_prompt_completions([s.prompt_token_ids for s in samples],
                                                     [s.token_ids for s in samples], tokenizer.pad_token_id)
    mask = cmask[:, 1:].float()
    old = common.sampler_logprob_tensor(samples, [len(s.prompt_token_ids) for s in samples], mask.shape[1])

    logp = common.token_logprobs(policy, ids, attn, cmask, 0.8)
    w = rloo.importance_weights(logp.detach(), old, mask, "sequence")
    assert torch.allclose(w, torch.ones_like(w), atol=1e-4)
    assert common.ess(w) == pytest.approx(1.0, abs=1e-6)

    rewards = torch.tensor([task.reward(s.text, problems[i // 4]) for i, s in enumerate(samples)])
    adv = rloo.rloo_advantages(rewards.view(-1, 4)).view(-1)
    if adv.abs().sum() == 0:
        adv = torch.linspace(-1, 1, len(samples))  # make sure the step moves the policy
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    for _ in range(2):
        logp = common.token_logprobs(policy, ids, attn, cmask, 0.8)
        loss, _ = rloo.rloo_loss(logp, old, old, torch.zeros_like(logp), mask, adv, **_hp())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        w = rloo.importance_weights(common.token_logprobs(policy, ids, attn, cmask, 0.8), old, mask, "sequence")
    assert (w - 1).abs().max() > 1e-2 and common.ess(w) < 1.0


def _run(*flags, timeout=600, cwd=WORK):
    return subprocess.run([sys.executable, str(ROOT / "rloo_kreuse.py"), *flags], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_two_rounds_from_the_command_line_then_resume(request):
    """Two rounds at K=2 with top-p 0.9, then a resume. The first step of every round is on-policy:
    its importance weight is 1, which holds only when the learner's logprobs are over the sampler's
    nucleus (the logprob contract)."""
    flags = ["--exp-name", "pytest_rloo", "--k", "2", "--top-p", "0.9", "--num-prompts", "8", "--group-size", "4",
             "--eval-problems", "16", "--eval-samples", "4"]
    out = _run(*flags, "--num-rounds", "2", "--save-every", "1", "--keep-checkpoints", "3", "--eval-every", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = WORK / out.stdout.split("run directory: ")[1].split()[0]
    rows = runlog.read_metrics(run_dir)
    rounds = [r for r in rows if "charts/reward" in r]
    assert [r["step"] for r in rounds] == [2, 4]
    for r in rounds:
        assert (r["charts/iw_mean_k1"] == pytest.approx(1.0, abs=1e-3)
                and r["charts/ess_k1"] == pytest.approx(1.0, abs=1e-3))
        assert r["charts/logprob_diff"] < 1e-4
    assert (run_dir / "checkpoint.pt").exists() and json.loads((run_dir / "args.json").read_text())["k"] == 2
    assert "| K | wall (s)" in out.stdout and "pass@1" in out.stdout
    # a person reads it at a glance: vLLM's and torch's start-up warnings are off without --verbose
    # (vllm_sampler.log_environment)
    assert not [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line or "Warning:" in line]

    # the saved flags are the defaults (K=2, top-p 0.9, ...): only the run's length is given, from another directory
    elsewhere = scratch_dir("fastrl-elsewhere-")
    resumed = _run("--num-rounds", "3", "--resume", str(run_dir.resolve()), cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resumed from" in resumed.stdout and "round 3/3 step 6" in resumed.stdout
            and "round 1/" not in resumed.stdout)
    assert not (elsewhere / "runs").exists()  # the run went on in its own directory
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert (state["round"], state["step"]) == (3, 6)
    assert json.loads((run_dir / "args.json").read_text())["top_p"] == 0.9
    # and exactly as it was, from either checkpoint. Resumed from the one written mid-run (after round 1 and its
    # evaluation, --eval-every 1: round 2 is sent after both, so they never share the sampler), rounds 2 and 3 come
    # again: round 2 as the run that never stopped made it, and round 3 as the resume from round 2's checkpoint made
    # it (each resume against a run that went on without a stop). --eval-every 0 from there: the 2-round run's last
    # round did not evaluate (its end's evaluation came after its checkpoint), so neither may before round 3
    def same(a, b):
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "wall")) and "per_second" not in k} == \
               {k: v for k, v in b.items() if not k.startswith(("time/", "wall")) and "per_second" not in k}

    first = [r for r in runlog.read_metrics(run_dir) if "charts/reward" in r]
    assert [r["step"] for r in first] == [2, 4, 6]
    midrun = _run("--num-rounds", "3", "--eval-every", "0", "--resume-changes", "--resume",
                  str(run_dir / "checkpoints" / "2.pt"))
    assert midrun.returncode == 0, midrun.stderr[-3000:]
    again = [r for r in runlog.read_metrics(run_dir) if "charts/reward" in r][1:]  # (those after step 2: anew)
    assert [r["step"] for r in again] == [4, 6]
    for a, b in zip(first[1:], again):
        same(a, b)

    # the round's micro-batch loop accumulates exactly the whole batch's gradient: round 1 (sampled before any step)
    # again, in micro-batches of about one row each instead of one, gives the same loss, gradient norm and weights
    small = _run(*flags, "--num-rounds", "1", "--micro-batch-tokens", "64")
    assert small.returncode == 0, small.stderr[-3000:]
    small_row = [r for r in runlog.read_metrics(WORK / small.stdout.split("run directory: ")[1].split()[0])
                 if "charts/reward" in r][0]
    for key in ("losses/loss", "losses/pg", "losses/entropy", "losses/kl_penalty", "losses/grad_norm",
                "charts/iw_mean_k2"):
        assert small_row[key] == pytest.approx(first[0][key], rel=1e-4, abs=1e-6), key

    # the trained policy is also a Hugging Face model directory that transformers and vLLM load as is
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in state["model"].items() if k in saved.state_dict())
    # and model-bf16/ beside it (--save-bf16-copy): those weights stochastically rounded to bf16 as the seed and the
    # step draw them, which a bf16 server loads as they are; the summary says what each directory keeps of the update
    copy = AutoModelForCausalLM.from_pretrained(run_dir / "model-bf16")
    assert next(copy.parameters()).dtype == torch.bfloat16
    expected = weight_sync.bf16_copy(saved, json.loads((run_dir / "args.json").read_text())["seed"], 6)
    assert all(torch.equal(copy.state_dict()[k], v) for k, v in expected.items())
    assert "; model-bf16/ holds them stochastically rounded, which keeps" in (run_dir / "summary.md").read_text()
    with launch.start_sampler(str(run_dir / "model-bf16"), placement="cpu", seed=0) as served:  # (vLLM loads it)
        tokenizer = util.load_tokenizer(str(run_dir / "model-bf16"))
        assert served.generate([tokenizer("1 2 3->6:")["input_ids"]], n=1, max_tokens=4)[0].token_ids

    # a flag that would change the resumed run is refused in one line naming it, before anything loads (in this
    # process; last, since error_before_start keeps any sampler from starting)
    error_before_start = request.getfixturevalue("error_before_start")
    changed = error_before_start(rloo, "--resume", str(run_dir), "--k", "4", "--num-rounds", "3")
    assert changed.startswith("error: --k 4 (saved: 2)"), changed


@pytest.mark.slow
def test_your_own_jsonl_task_and_reward_module_from_the_command_line(tmp_path):
    """A user's prompts as JSONL and a reward in a module of their own, no code edits: the run trains on
    the file's problems with that reward, and what counts as correct stays the task's answer match."""
    problems = [tasks.make_task("countdown", seed=0, tiny_prompts=True).problem("train", i) for i in range(40)]
    (tmp_path / "my.jsonl").write_text("".join(json.dumps({"prompt": p.prompt, "answer": str(p.target)}) + "\n"
                                               for p in problems))
    (tmp_path / "mymodule.py").write_text(textwrap.dedent("""
        import os
        import tasks

        def score(completion, problem):  # right value, minus a length penalty; every call is counted
            with open(os.environ["REWARD_CALLS"], "a") as f:
                f.write("x")
            try:
                right = tasks.safe_arithmetic(tasks.last_answer(completion) or "")[0] == float(problem.answer)
            except Exception:
                right = False
            return float(right) - 0.001 * len(completion)
    """))
    env = dict(os.environ, REWARD_CALLS=str(tmp_path / "calls"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "rloo_kreuse.py"), "--model", "tiny", "--task", "my.jsonl",
                          "--reward", "mymodule:score",
                          "--num-prompts", "4", "--group-size", "2", "--num-rounds", "2", "--eval-problems", "4",
                          "--eval-samples", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [r for r in runlog.read_metrics(tmp_path / out.stdout.split("run directory: ")[1].split()[0])
              if "charts/reward" in r]
    assert len(rounds) == 2 and (tmp_path / "calls").read_text() == "x" * 16  # 2 rounds x 4 prompts x 2 samples
    assert all(r["charts/reward"] < 1.0 and 0.0 <= r["charts/accuracy"] <= 1.0 for r in rounds)


@pytest.mark.slow
def test_overlap_mode_runs_one_round_off_policy():
    """--overlap trains on a round generated one round earlier, every token of it by the same weights even where
    sampling is slower than the K steps (countdown-steps' long answers against one step on 4 sequences: the push
    waits for the round in flight); a checkpoint after round r resumes with round r+1's prompts, which were in flight;
    --snapshot-every keeps the weights (for benchmarks/learning_speed.py) from round 0 on, with the run's wall time."""
    out = _run("--exp-name", "pytest_rloo_overlap", "--k", "1", "--num-prompts", "2", "--group-size", "2",
               "--num-rounds", "3", "--task", "countdown-steps", "--max-new-tokens", "64", "--save-every", "1",
               "--keep-checkpoints", "3",
               "--overlap", "--eval-problems", "8", "--eval-samples", "2", "--snapshot-every", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = WORK / out.stdout.split("run directory: ")[1].split()[0]
    rows = [r for r in runlog.read_metrics(run_dir) if "charts/lag_mean" in r]
    # round r+1 was generated before round r's K=1 step, all of it: no token by the weights pushed meanwhile
    assert [(r["charts/lag_min"], r["charts/lag_max"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
    positions = [torch.load(run_dir / "checkpoints" / f"{step}.pt", weights_only=False)["data_position"]
                 for step in (1, 2, 3)]
    assert positions == [2, 4, 6]  # the prompts trained on, not those in flight
    snapshots = [torch.load(run_dir / "snapshots" / f"{step}.pt", weights_only=True) for step in (0, 1, 2, 3)]
    assert [s["step"] for s in snapshots] == [0, 1, 2, 3] and all(a["wall"] < b["wall"] for a,
                                                                  b in zip(snapshots, snapshots[1:]))
    trained = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(snapshots[-1]["model"][k], v) for k, v in trained.items())
    assert any(not torch.equal(snapshots[0]["model"][k], v) for k, v in trained.items())


@pytest.mark.slow
def test_overlap_with_a_bf16_sampler_corrects_the_mismatch_against_the_rounds_start():
    """--overlap with a sampler whose precision differs (bf16 on CPU: the GPU's split): --tis auto is on and
    pi_theta0 is the learner's weights at the round's start (decoupled, as ppo_oppo's), so k-step 1's K-reuse weight is
    1 and the truncated weight min(pi_learner / pi_sampler, 2) carries both the precision and the round's staleness."""
    out = _run("--exp-name", "pytest_rloo_overlap_bf16", "--k", "2", "--num-prompts", "4", "--group-size", "2",
               "--num-rounds", "3", "--overlap", "--sampler-dtype", "bfloat16", "--eval-problems", "4",
               "--eval-samples", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in runlog.read_metrics(WORK / out.stdout.split("run directory: ")[1].split()[0])
            if "charts/reward" in r]
    assert [r["charts/lag_max"] for r in rows] == [0, 2, 2]  # rounds 2 and 3 sampled a round (K=2 steps) earlier
    for r in rows:
        assert r["charts/iw_mean_k1"] == pytest.approx(1.0, abs=1e-4), r  # pi_theta0: the learner at k-step 1
        assert r["charts/tis_max_ratio"] > 1.0 and 0.0 <= r["charts/tis_truncated_fraction"] <= 1.0, r


class _Loaded(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("flags, models", [([], 2), (["--kl-coef", "0"], 1)])
def test_the_reference_model_is_loaded_only_when_a_term_uses_it(monkeypatch, tiny_path, flags, models):
    from fastrl.run import Run

    loads = []
    real_load = common.load_policy
    monkeypatch.setattr(common, "load_policy", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(launch, "start_sampler", lambda *a, **k: SimpleNamespace(close=lambda: None))  # no process

    def stop(*a, **k):
        raise _Loaded

    monkeypatch.setattr(Run, "resume", stop)  # right after the models load, before anything runs
    monkeypatch.setattr(sys, "argv", ["rloo_kreuse.py", "--model", "tiny", *flags])
    with pytest.raises(_Loaded):
        rloo.main()
    assert len(loads) == models


@pytest.mark.parametrize("flags, flag", [(["--k", "0"], "--k"), (["--group-size", "1"], "--group-size"),
                                         (["--overlap", "--recompute-old-logprobs"], "--recompute-old-logprobs"),
                                         (["--micro-batch-tokens", "0"], "--micro-batch-tokens"),
                                         (["--tis-cap", "0.5"], "--tis-cap"),
                                         (["--snapshot-every", "-1"], "--snapshot-every"),
                                         (["--model", "/no/such/model"], "--model"),
                                         (["--model", "./my-checkpoint"], "--model"),
                                         (["--max-prompt-tokens", "4096"], "--max-prompt-tokens"),
                                         (["--sampler-gpu-memory", "1.5"], "--sampler-gpu-memory"),
                                         (["--system-prompt", "Be brief."], "--system-prompt")]
                         + ([] if torch.cuda.is_available() else [(["--placement", "colocate"], "--placement")])
                         + ([] if importlib.util.find_spec("wandb") else [(["--track"], "--track")]))
@pytest.mark.slow  # main() up to its checks
def test_bad_flags_are_rejected_at_start(error_before_start, flags, flag):
    assert error_before_start(rloo, *flags).startswith(f"error: {flag}")


@pytest.mark.slow
def test_a_bad_flag_is_one_line_on_the_command_line():
    out = _run("--k", "0", timeout=120)
    assert (out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith("error: --k")
            and "Traceback" not in out.stderr)


@pytest.mark.parametrize("fields, flag",
                         [(dict(k=0), "--k"), (dict(group_size=1), "--group-size"), (dict(iw_clip=0.0), "--iw-clip"),
                                          (dict(ppo_clip=1.0), "--ppo-clip"), (dict(tis_cap=0.5), "--tis-cap"),
                                          (dict(sampler_url=["localhost:8000"]), "--sampler-url")])
def test_flag_checks_live_with_the_flags(fields, flag):
    """Args checks its own values when it is made (the parser makes it), one line naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        rloo.Args(**fields)
    assert str(exit_info.value.code).startswith(f"error: {flag}: ") and "\n" not in str(exit_info.value.code)


def test_a_real_model_gets_the_papers_defaults_and_tiny_its_own():
    paper = checks.parse_args(rloo.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=rloo.PAPER)
    tiny = checks.parse_args(rloo.Args, [], paper=rloo.PAPER)
    assert (paper.task, paper.group_size, paper.num_prompts, paper.num_rounds, paper.learning_rate, paper.ent_coef,
            paper.max_new_tokens) == ("countdown-hub", 2, 4, 250, 1e-6, 0.05, 512)
    assert (tiny.task, tiny.group_size, tiny.num_prompts, tiny.ent_coef, tiny.kl_coef) == ("countdown", 8,
                                                                                           32, 0.01, 0.01)
    assert checks.parse_args(rloo.Args, ["--model", "Qwen/Qwen2.5-0.5B", "--num-prompts", "8"],
                             paper=rloo.PAPER).num_prompts == 8


@pytest.mark.slow  # main() up to the parser
@pytest.mark.parametrize("flags, flag",
                         [(["--iw-level", "word"], "--iw-level"), (["--kl-estimator", "k4"], "--kl-estimator")])
def test_choice_flags_are_refused_by_the_parser_with_their_choices(monkeypatch, capsys, flags, flag):
    monkeypatch.setattr(sys, "argv", ["rloo_kreuse.py", *flags])
    with pytest.raises(SystemExit) as exit_info:
        rloo.main()
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and flag in err and "Expected one of" in err


def test_kl_estimators_by_hand_and_their_gradients():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    d = (ref - logp).detach() * mask  # log(pi_ref / pi)
    k3 = rloo.kl_penalty(logp, ref, mask, "k3")
    assert torch.allclose(k3, (torch.exp(d) - d - 1).mul(mask).sum(1))
    k2 = rloo.kl_penalty(logp, ref, mask, "k2")
    assert torch.allclose(k2, (0.5 * d ** 2).sum(1))
    assert torch.allclose(rloo.kl_penalty(logp, ref, mask, "k1"), -d.sum(1))
    # as losses: d k2 / d log pi = log pi - log pi_ref (the KL(pi || pi_ref) score-function weight);
    # d k3 / d log pi = 1 - pi_ref / pi (the KL(pi_ref || pi) one)
    (grad_k2,) = torch.autograd.grad(k2.sum(), logp)
    assert torch.allclose(grad_k2, -d * mask)
    (grad_k3,) = torch.autograd.grad(k3.sum(), logp)
    assert torch.allclose(grad_k3, (1 - torch.exp(d)) * mask)


def test_which_sequence_level_kl_gradient_each_estimator_gives():
    """Exact expectations over every sequence of a two-token, two-step policy (no sampling noise): the
    gradient the method gets from each estimator, against the gradient of the report's sequence-level
    KL(pi || pi_ref). k1 folded into the reward (the default) gives it exactly; k2 as a loss gives only
    the per-token KLs' gradient at the sampled prefixes (it misses how the first token moves the second
    step's KL); k3 as a loss gives neither."""
    torch.manual_seed(0)
    # step 2's logits depend on y1
    theta1, theta2 = torch.randn(2, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    ref1, ref2 = torch.randn(2).log_softmax(0), torch.randn(2, 2).log_softmax(1)
    seqs = [(a, b) for a in range(2) for b in range(2)]

    def token_logps():
        lp1, lp2 = theta1.log_softmax(0), theta2.log_softmax(1)
        return torch.stack([torch.stack([lp1[a], lp2[a, b]]) for a, b in seqs])  # [4 sequences, 2 tokens]

    ref = torch.stack([torch.stack([ref1[a], ref2[a, b]]) for a, b in seqs])
    mask = torch.ones(4, 2)
    logp = token_logps()
    prob = logp.sum(1).exp()
    true_grad = torch.autograd.grad((prob * (logp.sum(1) - ref.sum(1))).sum(), (theta1, theta2))

    def expected_grad(estimator):
        logp = token_logps()
        weight = logp.sum(1).exp().detach()  # E over y ~ pi, the sampling itself carries no gradient
        total = 0.0
        for i in range(4):
            one = (logp[i:i + 1], logp[i:i + 1].detach(), ref[i:i + 1], torch.zeros(1, 2), mask[i:i + 1])
            if estimator == "k1":  # main(): r - kl_coef * k1, here with r = 0 and kl_coef = 1, no baseline
                advantage = -rloo.kl_penalty(logp[i:i + 1].detach(), ref[i:i + 1], mask[i:i + 1], "k1")
                loss, _ = rloo.rloo_loss(*one, advantage, **_hp(kl_coef=1.0, kl_estimator="k1"))
            else:
                loss, _ = rloo.rloo_loss(*one, torch.zeros(1), **_hp(kl_coef=1.0, kl_estimator=estimator))
            total = total + weight[i] * loss
        return torch.autograd.grad(total, (theta1, theta2))

    def close(a, b):
        return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b))

    assert close(expected_grad("k1"), true_grad)
    assert not close(expected_grad("k2"), true_grad) and not close(expected_grad("k3"), true_grad)
    # k2: the gradient of the per-token KLs with the prefix's probability held fixed
    lp1, lp2 = theta1.log_softmax(0), theta2.log_softmax(1)
    kl1 = (lp1.exp() * (lp1 - ref1)).sum()
    kl2 = (lp2.exp() * (lp2 - ref2)).sum(1)
    assert close(expected_grad("k2"), torch.autograd.grad(kl1 + (lp1.exp().detach() * kl2).sum(), (theta1, theta2)))


def test_k1_in_the_reward_is_the_exact_kl_gradient_off_policy():
    """K-reuse's k-step j > 1: samples from pi_theta0, weights w = pi_theta / pi_theta0, theta != theta0. Exact
    expectation over every pair (group size 2) of sequences of a two-token, two-step policy: the loss main() builds
    (k1 of the current policy in the shaped reward, leave-one-out advantages, w A log pi) has exactly the gradient of
    E_theta[r] - kl_coef KL(pi_theta || pi_ref); k1 of pi_theta0 (computed once per round) does not."""
    torch.manual_seed(1)
    theta1, theta2 = torch.randn(2, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    # the sampling policy, far off
    theta01, theta02 = theta1.detach() + torch.randn(2), theta2.detach() + torch.randn(2, 2)
    ref1, ref2 = torch.randn(2).log_softmax(0), torch.randn(2, 2).log_softmax(1)
    seqs = [(a, b) for a in range(2) for b in range(2)]
    reward = torch.tensor([1.0, 0.0, 0.3, 0.7])
    kl_coef = 0.5

    def token_logps(t1, t2):
        lp1, lp2 = t1.log_softmax(0), t2.log_softmax(1)
        return torch.stack([torch.stack([lp1[a], lp2[a, b]]) for a, b in seqs])  # [4 sequences, 2 tokens]

    ref = torch.stack([torch.stack([ref1[a], ref2[a, b]]) for a, b in seqs])
    old = token_logps(theta01, theta02)
    p0 = old.sum(1).exp()
    logp = token_logps(theta1, theta2)
    assert not torch.allclose(logp.detach(), old, atol=0.1)  # off-policy: theta != theta0
    prob = logp.sum(1).exp()
    true_grad = torch.autograd.grad((prob * reward).sum() - kl_coef * (prob * (logp.sum(1) - ref.sum(1))).sum(),
                                    (theta1, theta2))

    def expected_grad(k1_of):
        logp = token_logps(theta1, theta2)
        total = 0.0
        for i in range(4):
            for j in range(4):
                rows = [i, j]
                adv = rloo.shaped_advantages(reward[rows], k1_of(logp)[rows], ref[rows], torch.ones(2, 2),
                                             kl_coef=kl_coef,
                                             kl_estimator="k1", group_size=2)
                loss, _ = rloo.rloo_loss(logp[rows], old[rows], ref[rows], torch.zeros(2, 2), torch.ones(2, 2), adv,
                                         **_hp(kl_coef=kl_coef, kl_estimator="k1"))
                total = total + p0[i] * p0[j] * loss
        return torch.autograd.grad(-total, (theta1, theta2))

    def close(a, b):
        return all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))

    assert close(expected_grad(lambda logp: logp.detach()), true_grad)  # main(): k1 of the current policy
    assert not close(expected_grad(lambda logp: old), true_grad)  # k1 of pi_theta0: stale


# the paper's sampling (T 0.8, top-p 0.95) over a two-step, three-token vocabulary; the reference's nucleus (by hand:
# each row's smallest token has probability 0.002-0.012 at T 0.8) leaves one token out at every position
PAPER_T, PAPER_TOP_P = 0.8, 0.95
NUCLEUS_REF1 = torch.tensor([2.0, 1.0, -2.0])
NUCLEUS_REF2 = torch.tensor([[2.0, 1.0, -2.0], [-2.5, 2.0, 1.5], [1.0, -1.5, 1.8]])
NUCLEUS_REF_KEEP1 = torch.tensor([True, True, False])
NUCLEUS_REF_KEEP2 = torch.tensor([[True, True, False], [False, True, True], [True, False, True]])


def _nucleus_logps(logits, keep):
    """log-probabilities of the nucleus distribution at PAPER_T, by hand: softmax over the kept tokens, -inf else."""
    return (logits / PAPER_T).masked_fill(~keep, -math.inf).log_softmax(-1)


def _log_rho(logits, keep, token):
    """the reference term of `token`, by hand: its probability renormalised over the nucleus and itself."""
    kept = keep.clone()
    kept[token] = True
    return logits[token] / PAPER_T - (logits / PAPER_T)[kept].logsumexp(0)


def _learner_logp(logits, token):
    """what the learner computes for a sampled token: common.sampling_logits (its own nucleus, the token kept)."""
    return common.sampling_logits(logits, torch.tensor(token), PAPER_T, PAPER_TOP_P).log_softmax(-1)[token]


@pytest.mark.parametrize("case", ["inside", "outside"])
def test_k1_in_the_reward_at_the_papers_top_p(case):
    """At T 0.8, top-p 0.95, every logprob as the learner computes it (each model's own nucleus, the sampled token
    kept), off-policy (theta != theta0, the same nucleus); exact expectation over every pair (group size 2) of
    sequences. `inside`: the reference's nucleus holds every token the policy's does, and the loss main() builds has
    exactly the gradient of E[r] - kl_coef KL(pi || pi_ref) between the two nucleus distributions (Eq. 4 at top-p
    0.95). `outside`: the policy samples tokens outside the reference's nucleus, where that KL is infinite; such a
    token's reference term is rho, its probability renormalised over the reference's nucleus and itself (finite, and
    not a distribution: it sums to more than 1), and the gradient is exactly that of
    E[r] - kl_coef E_pi[log pi - log rho]."""
    if case == "inside":  # at each position the policy's nucleus leaves out the token the reference's does
        theta1 = torch.tensor([2.2, 0.9, -1.5], requires_grad=True)
        theta2 = torch.tensor([[1.8, 1.2, -2.5], [-2.6, 1.5, 1.4], [1.6, -2.2, 2.1]], requires_grad=True)
        keep1, keep2 = NUCLEUS_REF_KEEP1, NUCLEUS_REF_KEEP2
    else:  # flat: the policy's nucleus holds all three tokens everywhere
        theta1 = torch.tensor([1.0, 0.5, 0.8], requires_grad=True)
        theta2 = torch.tensor([[1.0, 0.5, 0.8], [0.3, 1.0, 0.2], [0.5, 0.1, 0.9]], requires_grad=True)
        keep1, keep2 = torch.ones(3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)
    theta01 = theta1.detach() + torch.tensor([0.1, -0.1, 0.05])  # the sampling policy: off-policy, the same nucleus
    theta02 = theta2.detach() + torch.tensor([[0.1, -0.05, 0.0], [0.0, 0.1, -0.1], [-0.1, 0.0, 0.1]])
    for logits, keep in [(theta1, keep1), (theta01, keep1), (NUCLEUS_REF1, NUCLEUS_REF_KEEP1),
                         *zip([*theta2, *theta02, *NUCLEUS_REF2], [*keep2, *keep2, *NUCLEUS_REF_KEEP2])]:
        kept = common.sampling_logits(logits.detach(), logits.detach().argmax(), PAPER_T, PAPER_TOP_P).isfinite()
        assert torch.equal(kept, keep)  # the nuclei above, by hand, are the learner's
    seqs = [(a, b) for a in range(3) for b in range(3)]
    reward = torch.tensor([1.0, 0.0, 0.3, 0.7, 0.2, 0.9, 0.0, 0.5, 0.4])
    kl_coef = 0.5

    def learner_logps(t1, t2):  # [9 sequences, 2 tokens]
        return torch.stack([torch.stack([_learner_logp(t1, a), _learner_logp(t2[a], b)]) for a, b in seqs])

    def nucleus_logp(t1, t2):  # [9]: log pi of each sequence under the nucleus distributions (-inf outside)
        return torch.stack([_nucleus_logps(t1, keep1)[a] + _nucleus_logps(t2[a], keep2[a])[b] for a, b in seqs])

    ref = learner_logps(NUCLEUS_REF1, NUCLEUS_REF2)
    log_rho = torch.stack([_log_rho(NUCLEUS_REF1, NUCLEUS_REF_KEEP1, a)
                           + _log_rho(NUCLEUS_REF2[a], NUCLEUS_REF_KEEP2[a], b) for a, b in seqs])
    assert torch.allclose(ref.sum(1), log_rho, atol=1e-6)  # the learner's reference term is rho
    old = learner_logps(theta01, theta02)
    p0 = nucleus_logp(theta01, theta02).exp()
    support = p0 > 0
    assert support.sum() == (4 if case == "inside" else 9)

    def expected_grad():
        logp = learner_logps(theta1, theta2)
        total = 0.0
        for i in range(9):
            for j in range(9):
                rows = [i, j]
                adv = rloo.shaped_advantages(reward[rows], logp[rows].detach(), ref[rows], torch.ones(2, 2),
                                             kl_coef=kl_coef, kl_estimator="k1", group_size=2)
                loss, _ = rloo.rloo_loss(logp[rows], old[rows], ref[rows], torch.zeros(2, 2), torch.ones(2, 2), adv,
                                         **_hp(kl_coef=kl_coef, kl_estimator="k1"))
                total = total + p0[i] * p0[j] * loss
        return torch.autograd.grad(-total, (theta1, theta2))

    log_pi = nucleus_logp(theta1, theta2)[support]
    ref_nucleus = torch.stack([_nucleus_logps(NUCLEUS_REF1, NUCLEUS_REF_KEEP1)[a]
                               + _nucleus_logps(NUCLEUS_REF2[a], NUCLEUS_REF_KEEP2[a])[b] for a, b in seqs])[support]
    if case == "inside":
        assert torch.allclose(ref_nucleus, log_rho[support])  # rho is the reference's nucleus distribution here
        against = ref_nucleus
    else:
        assert torch.isinf(ref_nucleus).any()  # KL(pi || pi_ref) between the nucleus distributions is infinite
        assert sum(_log_rho(NUCLEUS_REF1, NUCLEUS_REF_KEEP1, y).exp() for y in range(3)) > 1.001  # rho: no distribution
        against = log_rho[support]
    objective = (log_pi.exp() * reward[support]).sum() - kl_coef * (log_pi.exp() * (log_pi - against)).sum()
    true_grad = torch.autograd.grad(objective, (theta1, theta2))
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(expected_grad(), true_grad))


def test_k1_is_folded_into_the_reward_not_the_loss():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-3.0, -1.0]])
    loss, stats = rloo.rloo_loss(logp, logp, ref, torch.zeros_like(logp), torch.ones_like(logp), torch.zeros(1),
                                 **_hp(kl_coef=1.0, kl_estimator="k1"))
    assert stats["kl"].item() == 0 and loss.item() == 0


def test_truncated_is_weights_by_hand():
    learner = torch.tensor([[-1.0, -1.0], [-2.0, -0.1]])
    sampler = torch.tensor([[-1.0, -2.0], [-1.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for level in ("sequence", "token"):  # the script's: its own importance_weights, truncated at C
        assert torch.equal(rloo.importance_weights(learner, sampler, mask, level).clamp(max=2.0),
                           common.truncated_is_weights(learner, sampler, mask, level, cap=2.0)[0])
    w, stats = common.truncated_is_weights(learner, sampler, mask, "sequence", cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, torch.e ** -1]))  # e^1 = 2.72 truncated at 2
    assert stats["max_ratio"] == pytest.approx(torch.e) and stats["truncated_fraction"] == 0.5
    w, stats = common.truncated_is_weights(learner, sampler, mask, "token", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0], [torch.e ** -1, 0.0]]))
    assert stats["truncated_fraction"] == pytest.approx(1 / 3)  # of the 3 response tokens
    # the loss is weighted by them: a sequence at weight 0.5 pushes half as hard
    logp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    loss, _ = rloo.rloo_loss(logp, logp.detach(), logp.detach(), torch.zeros_like(logp),
                             torch.ones_like(logp), torch.ones(2),
                             **_hp(), tis=torch.tensor([1.0, 0.5]))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5], [-0.25]]))


def test_truncated_is_per_token_by_default_whatever_the_iw_level():
    """--tis-level token (the default; verl's token-TIS preset, while TRL 1.16's GRPOTrainer masks per sequence): each
    token's gradient is weighted by its own truncated ratio, at sequence-level K-reuse weights and under Proximal RLOO
    too; a long answer is not down-weighted as a whole (a sequence-level weight would be min(prod, C))."""
    assert rloo.Args().tis_level == "token" and rloo.Args().iw_level == "sequence"
    learner = torch.tensor([[-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -0.5, -1.0]])
    mask = torch.ones(1, 3)
    tis, _ = common.truncated_is_weights(learner, sampler, mask, "token", cap=2.0)
    assert torch.allclose(tis, torch.tensor([[min(torch.e ** 0.5, 2.0), torch.e ** -0.5, 1.0]]))
    for extra in ({}, {"ppo_clip": 0.2}, {"iw_level": "token"}):
        logp = learner.clone().requires_grad_(True)
        rloo.rloo_loss(logp, learner, learner, torch.zeros_like(logp), mask, torch.ones(1), **_hp(**extra),
                       tis=tis)[0].backward()
        assert torch.allclose(logp.grad, -tis), extra  # w = 1 (theta = theta0), A = 1: -tis_t per token
    # per sequence (--tis-level sequence): one weight for every token
    seq_tis, _ = common.truncated_is_weights(learner, sampler, mask, "sequence", cap=2.0)
    logp = learner.clone().requires_grad_(True)
    rloo.rloo_loss(logp, learner, learner, torch.zeros_like(logp), mask, torch.ones(1), **_hp(),
                   tis=seq_tis)[0].backward()
    assert torch.allclose(logp.grad, -seq_tis.expand(1, 3))


# rloo_loss's inputs for the flag-combination test: 3 responses of 3 tokens (N == T, where a [N] weight broadcast
# against [N, T] scales columns instead of rows without an error); the second response's last token is padding
COMBO_LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0], [-2.0, -0.7, -1.1]]
COMBO_LOG_RATIO = [[0.05, 0.1, -0.05], [0.3, 0.2, 5.0], [0.1, 0.2, 0.1]]  # log pi_theta - log pi_theta0 per token
COMBO_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
COMBO_ADV = [1.0, -0.5, 2.0]
COMBO_TIS = {"token": [[1.5, 0.5, 2.0], [0.8, 1.2, 0.0], [0.3, 1.0, 1.7]], "sequence": [2.0, 0.4, 1.3]}


def _combo_by_hand(iw_level, tis_level, ppo_clip, rows):
    """rloo_loss's value, d loss / d log pi and w in scalars (no broadcasting): row i's term, token t's gradient."""
    m, adv = COMBO_MASK, COMBO_ADV
    token_tis = lambda i, t: COMBO_TIS["token"][i][t] if tis_level == "token" else 1.0  # noqa: E731
    seq_tis = lambda i: COMBO_TIS["sequence"][i] if tis_level == "sequence" else 1.0  # noqa: E731
    seq_w = lambda i: math.exp(sum(COMBO_LOG_RATIO[i][t] * m[i][t] for t in range(3)))  # noqa: E731
    if ppo_clip is not None:  # the sequence's ratio r whatever --iw-level: -min(r A, clip(r) A) * tis_seq
        def term(i):
            r = seq_w(i)
            return -min(r * adv[i], min(max(r, 1 - ppo_clip), 1 + ppo_clip) * adv[i]) * seq_tis(i)

        def grad(i, t):  # the unclipped side carries d r / d log pi_t = r (weighted by token tis_t); the clipped, none
            r = seq_w(i)
            unclipped = r * adv[i] <= min(max(r, 1 - ppo_clip), 1 + ppo_clip) * adv[i]
            return -seq_tis(i) * adv[i] * r * token_tis(i, t) * m[i][t] if unclipped else 0.0
        weights = [seq_w(i) for i in range(rows)]
    elif iw_level == "sequence":  # -w tis_seq A sum_t tis_t log pi_t
        def term(i):
            return -seq_w(i) * seq_tis(i) * adv[i] * sum(token_tis(i, t) * COMBO_LOGP[i][t] * m[i][t] for t in range(3))

        def grad(i, t):
            return -seq_w(i) * seq_tis(i) * adv[i] * token_tis(i, t) * m[i][t]
        weights = [seq_w(i) for i in range(rows)]
    else:  # -tis_seq A sum_t w_t tis_t log pi_t
        token_w = lambda i, t: math.exp(COMBO_LOG_RATIO[i][t]) * m[i][t]  # noqa: E731

        def term(i):
            return -seq_tis(i) * adv[i] * sum(token_w(i, t) * token_tis(i, t) * COMBO_LOGP[i][t] for t in range(3))

        def grad(i, t):
            return -seq_tis(i) * adv[i] * token_w(i, t) * token_tis(i, t)
        weights = [sum(token_w(i, t) for t in range(3)) / sum(m[i]) for i in range(rows)]
    loss = sum(term(i) for i in range(rows)) / rows
    return loss, [[grad(i, t) / rows for t in range(3)] for i in range(rows)], weights


@pytest.mark.parametrize("ppo_clip", [None, 0.2])
@pytest.mark.parametrize("tis_level", [None, "token", "sequence"])
@pytest.mark.parametrize("iw_level", ["sequence", "token"])
def test_every_iw_tis_and_ppo_combination_by_hand(iw_level, tis_level, ppo_clip):
    """--iw-level x --tis-level (none: --tis off) x --ppo-clip combine freely: the loss, its gradient and the reported
    weights equal a scalar hand computation, with N == T (3 x 3) and with N != T (2 x 3). A sequence-level TIS weight
    multiplies every token of its own row. Under --ppo-clip the ratio is the sequence's at either --iw-level (the
    second response's ratio e^0.5 lies above 1 + eps at a negative advantage, so its unclipped side is the minimum;
    the third's is clipped: no gradient)."""
    for rows in (3, 2):
        logp = torch.tensor(COMBO_LOGP[:rows], requires_grad=True)
        old = logp.detach() - torch.tensor(COMBO_LOG_RATIO[:rows])
        tis = None if tis_level is None else torch.tensor(COMBO_TIS[tis_level][:rows])
        hyperparameters = _hp(iw_level=iw_level, ppo_clip=ppo_clip)
        loss, stats = rloo.rloo_loss(logp, old, old, torch.zeros(rows, 3), torch.tensor(COMBO_MASK[:rows]),
                                     torch.tensor(COMBO_ADV[:rows]), **hyperparameters, tis=tis)
        loss.backward()
        expected_loss, expected_grad, expected_w = _combo_by_hand(iw_level, tis_level, ppo_clip, rows)
        assert loss.item() == pytest.approx(expected_loss, rel=1e-5), rows
        assert torch.allclose(logp.grad, torch.tensor(expected_grad), atol=1e-6), rows
        assert torch.allclose(stats["w"], torch.tensor(expected_w), atol=1e-6), rows


def test_sequence_weights_never_overflow():
    logp, old = torch.full((1, 400), -0.1), torch.full((1, 400), -1.0)  # summed log-ratio 360: exp() is inf in fp32
    w = rloo.importance_weights(logp, old, torch.ones_like(logp), "sequence")
    assert torch.isfinite(w).all() and common.ess(torch.cat([w, torch.ones(3)])) > 0


@pytest.mark.slow
def test_realistic_model_bf16_sampler_k1_on_policy_by_default(realistic_path):
    """The path users run on a GPU, on CPU: BPE tokenizer with pad == eos, bf16 checkpoint, T 0.8 / top-p
    0.95 (the paper's defaults for a non-tiny model), a bf16 sampler against the fp32 learner, every other
    flag at its default (sizes shrunk). The precision split turns the mismatch correction on by itself:
    pi_theta0 is the learner's, so K=1's weight is 1 in every round, and the sampler's bf16 logprobs enter
    only the truncated weight (ratio near 1, not exactly 1)."""
    out = _run("--model", realistic_path, "--task", "countdown", "--exp-name", "pytest_rloo_real", "--k", "1",
               "--num-prompts", "4", "--group-size", "2",
               "--num-rounds", "2", "--max-new-tokens", "48", "--eval-problems", "4", "--eval-samples", "2",
               "--sampler-dtype", "bfloat16")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = WORK / out.stdout.split("run directory: ")[1].split()[0]
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["temperature"], args["top_p"], args["max_new_tokens"], args["tis"]) == (0.8, 0.95, 48, "auto")
    rounds = [r for r in runlog.read_metrics(run_dir) if "charts/reward" in r]
    assert len(rounds) == 2
    for r in rounds:
        assert (r["charts/iw_mean_k1"] == pytest.approx(1.0, abs=1e-3)
                and r["charts/ess_k1"] == pytest.approx(1.0, abs=1e-6))
        assert r["charts/logprob_diff"] > 1e-4  # the split is real: bf16 against fp32
        assert r["charts/tis_max_ratio"] != pytest.approx(1.0, abs=1e-6) and r["charts/tis_max_ratio"] < 2.0
        assert r["charts/tis_truncated_fraction"] == 0
    assert rounds[0]["charts/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at round 0, both the learner's


@pytest.mark.slow
def test_a_forgotten_push_stops_the_run_in_one_line(tmp_path):
    """A student's copy that lost `sampler.push_weights(step)`: the second round was generated by
    version 0 while the learner is at 2, and the run stops saying so instead of training off-policy."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import rloo_kreuse as rloo
        from fastrl import vllm_sampler
        vllm_sampler.Sampler.push_weights = lambda self, version, **kw: 0.0
        sys.argv = ["rloo_kreuse.py", "--exp-name", "pytest_rloo_nopush", "--k", "2", "--num-prompts", "4",
                    "--group-size", "2", "--num-rounds", "3", "--eval-problems", "4", "--eval-samples", "1"]
        rloo.main()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: the sampler generated this batch with policy version(s) [0], "
        "the method expects version 2"), out.stderr[-2000:]
    assert "round 1/3 step 2" in out.stdout and "round 2/3" not in out.stdout


@pytest.mark.slow
def test_nonfinite_loss_never_reaches_the_weights(tmp_path, tiny_path):
    """A NaN loss skips the optimizer step, is counted, and neither the pushed nor the saved
    weights change."""
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import rloo_kreuse as rloo
        real = rloo.rloo_loss
        def poisoned(*a, **k):
            loss, stats = real(*a, **k)
            return loss * float("nan"), stats
        rloo.rloo_loss = poisoned
        flags = ["--k", "2", "--num-prompts", "4", "--group-size", "2", "--eval-problems", "4", "--eval-samples", "1"]
        sys.argv = ["rloo_kreuse.py", "--exp-name", "pytest_rloo_nan", "--num-rounds", "2", *flags]
        rloo.main()
        calls = []
        def first_poisoned(*a, **k):  # k-step 1 of the one round (one micro-batch a k-step), then the real loss
            calls.append(1)
            loss, stats = real(*a, **k)
            return (loss * float("nan") if len(calls) == 1 else loss), stats
        rloo.rloo_loss = first_poisoned
        sys.argv = ["rloo_kreuse.py", "--exp-name", "pytest_rloo_nan_k1", "--num-rounds", "1", *flags]
        rloo.main()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=WORK, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, k1_dir = (WORK / part.split()[0] for part in out.stdout.split("run directory: ")[1:])
    rounds = [r for r in runlog.read_metrics(run_dir) if "charts/reward" in r]
    assert [r["charts/nonfinite_skipped"] for r in rounds] == [2, 4] and [r["step"] for r in rounds] == [0, 0]
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]
    initial = common.load_policy(tiny_path, "cpu").state_dict()
    assert all(torch.equal(saved[name], initial[name]) for name in initial)
    # k-step 1 skipped, k-step 2 taken: each k-step's metrics keep its own label (k2's weight is 1: no step before it)
    [row] = [r for r in runlog.read_metrics(k1_dir) if "charts/reward" in r]
    assert (row["step"], row["charts/nonfinite_skipped"]) == (1, 1)
    assert math.isnan(row["charts/iw_mean_k1"]) and math.isnan(row["charts/ess_k1"])
    assert row["charts/iw_mean_k2"] == pytest.approx(1.0, abs=1e-5) and row["charts/ess"] == row["charts/ess_k2"]


@pytest.mark.slow
def test_two_torchrun_ranks_train_as_one_process_and_resume():
    """The script under `torchrun --nproc-per-node 2` (FSDP2 over gloo): the same rounds, losses and
    trained weights as one process on the same global batch; rank 0 alone writes the run; the run
    resumes under torchrun."""
    from safetensors.torch import load_file

    flags = ["--k", "2", "--num-prompts", "8", "--group-size", "4", "--eval-problems", "8", "--eval-samples",
             "2", "--seed", "3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {}
    for name, launcher in (("two", torchrun), ("one", [sys.executable])):
        cwd = WORK / f"torchrun_{name}"
        cwd.mkdir()
        out = subprocess.run([*launcher, str(ROOT / "rloo_kreuse.py"), *flags, "--num-rounds", "2"], cwd=cwd,
                             capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = cwd / out.stdout.split("run directory: ")[1].split()[0]
    assert len(list(runs["two"].parent.iterdir())) == 1  # only rank 0 writes a run directory
    rows = {k: [r for r in runlog.read_metrics(d) if "charts/reward" in r] for k, d in runs.items()}
    assert [r["step"] for r in rows["two"]] == [r["step"] for r in rows["one"]] == [2, 4]
    for key in ("charts/reward", "losses/loss", "losses/pg", "losses/grad_norm", "charts/kl", "charts/ess"):
        assert [r[key] for r in rows["two"]] == pytest.approx([r[key] for r in rows["one"]], rel=1e-4, abs=1e-6), key
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rows["two"])  # rank 0 pushed the gathered weights
    two, one = (load_file(d / "model" / "model.safetensors") for d in (runs["two"], runs["one"]))
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-5

    resumed = subprocess.run([*torchrun, str(ROOT / "rloo_kreuse.py"), *flags, "--num-rounds", "3", "--resume",
                              str(runs["two"])],
                             cwd=runs["two"].parent.parent, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "round 3/3 step 6" in resumed.stdout
