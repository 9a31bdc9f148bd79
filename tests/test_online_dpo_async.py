"""Online DPO: losses, pair selection and the missing-EOS penalty by hand; defaults and flag
checks; sync/async lag from the real sampler's versions; async at staleness 0 = sync; non-finite
steps skipped; the logprob contract on the realistic fixture."""

import json
import math
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import common
import online_dpo_async as dpo

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.mkdtemp(prefix="fastrl-test-runs-"))  # scripts run here: no test writes into the repository's runs/
SMALL = ["--num-prompts", "8", "--eval-problems", "4", "--eval-samples", "1"]


def test_dpo_and_ipo_losses_by_hand():
    pc, pr = torch.tensor([-3.0, -1.0]), torch.tensor([-4.0, -1.5])
    rc, rr = torch.tensor([-3.5, -1.0]), torch.tensor([-3.5, -1.0])
    # h = (pc - rc) - (pr - rr) = [0.5 - (-0.5), 0 - (-0.5)] = [1.0, 0.5]
    loss, logits = dpo.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="dpo")
    assert torch.allclose(logits, torch.tensor([0.1, 0.05]))
    assert torch.allclose(loss, torch.tensor([math.log1p(math.exp(-0.1)), math.log1p(math.exp(-0.05))]))
    loss, _ = dpo.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo")
    assert torch.allclose(loss, torch.tensor([(1.0 - 5.0) ** 2, (0.5 - 5.0) ** 2]))


def test_pair_selection_and_ties():
    rewards = torch.tensor([[0.1, 1.0, 0.0, 0.1],   # best 1, worst 2
                            [0.1, 0.1, 0.1, 0.1],   # all tie: dropped
                            [0.0, 0.0, 1.0, 1.0],   # first best (2), first worst (0)
                            [-1.0, 0.1, 0.1, 0.1]])  # a missing-EOS penalty makes the worst
    chosen, rejected, keep = dpo.select_pairs(rewards)
    assert keep.tolist() == [True, False, True, True]
    assert chosen[keep].tolist() == [1, 2, 1] and rejected[keep].tolist() == [2, 0, 0]


def test_missing_eos_penalty_replaces_or_subtracts_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.1, 0.0, -0.5])
    eos = torch.tensor([True, False, False, True, False])
    # replace (the paper's code): a completion without EOS scores -penalty, whatever it said
    assert dpo.penalize_missing_eos(scores, eos, 1.0, "replace").tolist() == [1.0, -1.0, -1.0, 0.0, -1.0]
    # subtract (TRL): its score minus the penalty
    assert torch.allclose(dpo.penalize_missing_eos(scores, eos, 1.0, "subtract"), torch.tensor([1.0, 0.0, -0.9, 0.0, -1.5]))
    # the difference that matters: a correct but truncated answer is never preferred to a finished one
    chosen, rejected, keep = dpo.select_pairs(dpo.penalize_missing_eos(torch.tensor([[1.0, 0.0]]), torch.tensor([[False, True]]),
                                                                       1.0, "replace"))
    assert keep.tolist() == [True] and (chosen.item(), rejected.item()) == (1, 0)
    assert dpo.penalize_missing_eos(torch.tensor([2.0]), torch.tensor([False]), 1.0, "subtract").item() == 1.0  # still the best
    assert dpo.parse_args([]).eos_penalty_mode == "replace"


def test_defaults_follow_the_paper_per_task_and_explicit_flags_win():
    """Resolved from the command line without the Hub (the dataset is loaded later, in main)."""
    gsm8k = dpo.parse_args(["--model", "some/model", "--task", "gsm8k"])
    # Table 10: 4 completions per prompt, beta 0.05, T 0.7; evaluation: greedy pass@1 on the whole test set
    assert (gsm8k.group_size, gsm8k.beta, gsm8k.temperature, gsm8k.top_p) == (4, 0.05, 0.7, 1.0)
    assert (gsm8k.eval_decoding, gsm8k.eval_problems, gsm8k.eval_samples) == ("greedy", 0, 1)
    tldr_like = dpo.parse_args(["--model", "some/model"])
    assert (tldr_like.group_size, tldr_like.beta, tldr_like.temperature) == (2, 0.1, 0.7)
    assert (tldr_like.eval_decoding, tldr_like.eval_problems, tldr_like.eval_samples) == ("sample", 50, 4)
    tiny = dpo.parse_args([])
    assert (tiny.group_size, tiny.temperature, tiny.staleness, tiny.sync) == (4, 1.0, 1, False)
    explicit = dpo.parse_args(["--model", "some/model", "--task", "gsm8k", "--group-size", "2", "--beta", "0.1",
                               "--eval-decoding", "sample", "--eval-problems", "100"])
    assert (explicit.group_size, explicit.beta, explicit.eval_decoding, explicit.eval_problems, explicit.eval_samples) == \
        (2, 0.1, "sample", 100, 4)
    assert (dpo.parse_args(["--sync"]).staleness, dpo.parse_args(["--staleness", "0"]).sync) == (0, True)


def _run(*flags, cwd=WORK, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "online_dpo_async.py"), *flags], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _run_dir(out, cwd=WORK) -> Path:
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(cwd) / out.stdout.split("run directory: ")[1].split()[0]


@pytest.mark.parametrize("flags, flag", [
    (["--temperature", "0"], "--temperature"), (["--temperature", "-0.5"], "--temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--eval-samples", "0"], "--eval-samples"),
    (["--group-size", "1"], "--group-size"), (["--top-p", "0"], "--top-p"), (["--sync", "--staleness", "1"], "--sync"),
    (["--eval-problems", "0"], "--eval-problems"),  # the countdown generator has no whole test split
    (["--eval-decoding", "greedy", "--eval-samples", "4"], "--eval-samples"),
])
def test_bad_flags_are_rejected_before_anything_starts(error_before_start, flags, flag):
    assert error_before_start(dpo, *flags).startswith(f"error: {flag}:")


def test_a_bad_flag_is_one_line_on_the_command_line():
    out = _run("--temperature", "0", timeout=120)
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1  # one line that names the flag
    assert out.stderr.startswith("error: --temperature:") and "Traceback" not in out.stderr and "run directory" not in out.stdout


@pytest.mark.parametrize("flags, flag", [(["--loss-type", "kto"], "--loss-type"), (["--eos-penalty-mode", "clip"], "--eos-penalty-mode"),
                                         (["--num-completions", "4"], "--num-completions")])
def test_choice_flags_and_the_old_name_are_refused_by_the_parser(flags, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dpo.parse_args(flags)
    assert exit_info.value.code != 0 and flag in capsys.readouterr().err


def test_a_bad_choice_is_refused_on_the_command_line():
    out = _run("--loss-type", "kto", timeout=120)
    assert out.returncode != 0 and "--loss-type" in out.stderr and "Traceback" not in out.stderr


def _check_rounds(run_dir, mode, minibatches, num_prompts):
    """A short run's rounds: the lag of each batch from the sampler's versions, the pairs, the KL."""
    rounds = [r for r in common.read_metrics(run_dir) if "charts/lag_min" in r]
    assert len(rounds) == 3 and (run_dir / "checkpoint.pt").exists()
    lags = [(r["charts/lag_min"], r["charts/lag_max"]) for r in rounds]
    steps = [0] + [r["step"] for r in rounds]
    if mode == "sync":
        assert lags == [(0, 0)] * 3  # generated by exactly the weights being trained
        # the learner holds the sampling weights every round: its logprobs are the sampler's
        assert all(r["charts/logprob_diff"] < 1e-4 for r in rounds if r["charts/pairs"])
    else:  # the learner is one round (its N steps) ahead of every batch after the first
        assert lags == [(0, 0)] + [(steps[i] - steps[i - 1],) * 2 for i in (1, 2)]
        assert steps[1] == minibatches  # (a round whose prompts all tie takes no step)
        assert "charts/logprob_diff" not in rounds[1] and rounds[1]["charts/lag_min"] > 0  # only where the weights are the sampler's
    assert all(r["charts/pairs"] + r["charts/ties_dropped"] == num_prompts * minibatches for r in rounds)
    assert all("charts/kl" in r and "charts/kl_to_init" not in r and r["charts/nonfinite_skipped"] == 0 for r in rounds)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_async_short_run_and_lag_from_sampler_versions(minibatches, tmp_path):
    """(--sync's: test_sync_run_has_lag_0, on the shared sync run below)"""
    flags = ["--exp-name", "pytest_dpo_async", "--num-rounds", "3", "--num-prompts", "16", "--eval-problems", "8",
             "--eval-samples", "2", "--num-minibatches", str(minibatches)]
    _check_rounds(_run_dir(_run(*flags, cwd=tmp_path), tmp_path), "async", minibatches, num_prompts=16)


# --sync on a fixed seed: the run that both the staleness-0 parity test and the torchrun test compare
# against (one launch for two tests). A small --micro-batch-tokens, so that under torchrun each rank
# gets several micro-batches of pairs and of reference rows.
SYNC = [*SMALL, "--sync", "--micro-batch-tokens", "256", "--num-rounds", "3", "--seed", "3"]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("dpo_sync")
    return _run_dir(_run(*SYNC, "--exp-name", "pytest_dpo_parity_sync", cwd=cwd), cwd)


def test_sync_run_has_lag_0(sync_run):
    _check_rounds(sync_run, "sync", minibatches=1, num_prompts=8)


def test_async_at_staleness_zero_reproduces_sync(tmp_path, sync_run):
    """The asynchronous loop with the next round submitted only after the push is the synchronous
    schedule: on a fixed seed, the same sampled tokens (the same rewards, lengths, pairs), the same
    losses and the same final weights."""
    flags = [f for f in SYNC if f != "--sync"]
    sync_dir = sync_run
    lag0_dir = _run_dir(_run(*flags, "--exp-name", "pytest_dpo_parity_lag0", "--staleness", "0", cwd=tmp_path), tmp_path)
    sync_rows, lag0_rows = common.read_metrics(sync_dir), common.read_metrics(lag0_dir)
    assert len(sync_rows) == len(lag0_rows) == 6  # eval, 3 rounds, eval, the end-of-run report
    assert sum(r.get("charts/pairs", 0) for r in sync_rows) > 0 and all(r.get("charts/lag_max", 0) == 0 for r in lag0_rows)
    for a, b in zip(sync_rows, lag0_rows):
        timing = lambda k: k.startswith(("time/", "memory/")) or k in ("wall", "charts/episodes_per_second")  # noqa: E731
        keys = {k for k in a if not timing(k)}
        assert keys == {k for k in b if not timing(k)}
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7, nan_ok=True), k
    sync_weights = torch.load(sync_dir / "checkpoint.pt", weights_only=False)["model"]
    lag0_weights = torch.load(lag0_dir / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.allclose(sync_weights[n], lag0_weights[n], atol=1e-6) for n in sync_weights)


def test_resume_continues_from_the_checkpoint(tmp_path):
    flags = ["--exp-name", "pytest_dpo_resume", "--num-prompts", "16", "--eval-problems", "8", "--eval-samples", "2"]
    run_dir = _run_dir(_run(*flags, "--num-rounds", "2", cwd=tmp_path), tmp_path)
    resumed = _run(*flags, "--num-rounds", "3", "--resume", str(run_dir), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_step = int(resumed.stdout.split("resumed from")[1].split("step ")[1].split()[0])
    assert resumed_step >= 1 and "round 1/" not in resumed.stdout and "round 2/" not in resumed.stdout
    assert f"round 3/3 step {resumed_step + 1}" in resumed.stdout or f"round 3/3 step {resumed_step}:" in resumed.stdout  # a tied round takes no step


def test_nonfinite_loss_never_reaches_the_weights(tmp_path, tiny_path):
    """A NaN loss skips the optimizer step, is counted and logged, and neither the pushed nor the
    saved weights change."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import online_dpo_async as dpo
        real = dpo.dpo_loss
        def poisoned(*a, **k):
            loss, logits = real(*a, **k)
            return loss * float("nan"), logits
        dpo.dpo_loss = poisoned
        sys.argv = ["online_dpo_async.py", "--exp-name", "pytest_dpo_nan", "--num-rounds", "3", "--num-minibatches", "2",
                    *{SMALL!r}]
        if __name__ == "__main__":
            dpo.main()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    run_dir = _run_dir(out, tmp_path)
    rounds = [r for r in common.read_metrics(run_dir) if "charts/reward" in r]
    # every minibatch that holds a pair attempts a step (2 minibatches: min(pairs, 2) a round); all are skipped
    attempted = [sum(min(r["charts/pairs"], 2) for r in rounds[: i + 1]) for i in range(3)]
    assert [r["charts/nonfinite_skipped"] for r in rounds] == attempted and attempted[-1] >= 1
    assert [r["step"] for r in rounds] == [0, 0, 0]
    assert all(math.isnan(r["losses/loss"]) for r in rounds)  # no step taken: no loss to report
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    initial = common.load_policy(tiny_path, "cpu").state_dict()
    assert all(torch.equal(saved["model"][name], initial[name]) for name in initial)
    assert saved["optimizer"]["state"] == {} and saved["totals"]["nonfinite_skipped"] == rounds[-1]["charts/nonfinite_skipped"]


def test_chat_template_needs_a_tokenizer_that_has_one():
    out = _run("--chat-template", "--num-rounds", "1", timeout=300)  # the tiny model's tokenizer has none
    assert out.returncode != 0 and "error: --chat-template" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("extra", [["--chat-template"], ["--sync", "--top-p", "0.9"]], ids=["paper-sampling-chat", "sync-top-p"])
def test_realistic_model_logprobs_match_the_sampler(realistic_path, tmp_path, extra):
    """The path users run: byte-level BPE with pad == eos, a bf16 checkpoint, the non-tiny defaults
    shrunk by flags; the paper's sampling (T 0.7, full distribution) or a nucleus that really cuts.
    The learner's logprobs of the sampler's tokens equal the sampler's, and at the initial
    weights the KL to the reference (the same distribution kind) is zero."""
    flags = ["--model", realistic_path, "--exp-name", "pytest_dpo_real", "--num-rounds", "2", "--group-size", "4",
             "--max-new-tokens", "48", *SMALL, *extra]
    out = _run(*flags, cwd=tmp_path)
    run_dir = _run_dir(out, tmp_path)
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["temperature"], args["top_p"]) == ((0.7, 1.0) if "--top-p" not in extra else (0.7, 0.9))
    if "--chat-template" in extra:  # the prompt went through the ChatML template
        assert "<|im_start|>user\\n" in out.stdout.split("example: ")[1].splitlines()[0]
    rounds = [r for r in common.read_metrics(run_dir) if "charts/reward" in r]
    assert len(rounds) == 2 and abs(rounds[0]["charts/kl"]) < 1e-3
    diffs = [r["charts/logprob_diff"] for r in rounds if "charts/logprob_diff" in r]
    assert diffs and all(d <= 1e-4 for d in diffs)


def test_two_torchrun_ranks_train_as_one_process(tmp_path, sync_run):
    """The script under `torchrun --nproc-per-node 2` (FSDP2 over gloo): the same rounds, pairs, losses
    and trained weights as one process on the same global batches (sync_run); rank 0 alone writes
    the run. --sync: every round is sampled by the weights just pushed, so charts/logprob_diff checks
    each push of the gathered weights (the async schedule gives the same numbers on both launchers
    too, but logs logprob_diff for its first round only). Resuming under torchrun is left out: a
    third launch would add ~25 s (it goes through the same distributed.load_checkpoint as
    rloo_kreuse.py's, whose test resumes)."""
    from safetensors.torch import load_file

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*torchrun, str(ROOT / "online_dpo_async.py"), *SYNC], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    runs = {"two": _run_dir(out, tmp_path), "one": sync_run}
    assert len(list(runs["two"].parent.iterdir())) == 1  # only rank 0 writes a run directory
    rows = {k: [r for r in common.read_metrics(d) if "charts/reward" in r] for k, d in runs.items()}
    assert [r["step"] for r in rows["two"]] == [r["step"] for r in rows["one"]] and rows["one"][-1]["step"] >= 1
    for key in ("charts/reward", "charts/pairs", "charts/kl", "losses/loss", "losses/logits_margin", "losses/dpo_accuracy",
                "losses/grad_norm"):
        assert [r[key] for r in rows["two"]] == pytest.approx([r[key] for r in rows["one"]], rel=1e-4, abs=1e-6, nan_ok=True), key
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rows["two"] if r["charts/pairs"])  # rank 0 pushed the gathered weights
    two, one = (load_file(d / "model" / "model.safetensors") for d in (runs["two"], runs["one"]))
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-5