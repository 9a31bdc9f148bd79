"""examples/reinforce.py, the first script a student reads: its advantage by hand, its flags and presets, its page, and
runs from its real command line on the tiny model (then a resume) and on SmolLM2."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import scratch_dir
from fastrl import checks, runlog

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "reinforce.py"
WORK = scratch_dir("fastrl-test-reinforce-")
sys.path.insert(0, str(SCRIPT.parent))
import reinforce  # noqa: E402

# what every round logs, named as in the method scripts
ROUND_KEYS = {"charts/reward", "charts/accuracy", "charts/response_length", "charts/skipped_long_prompts",
              "losses/loss", "losses/grad_norm", "time/generate_seconds", "time/train_seconds", "time/push_seconds",
              "charts/episodes", "charts/episodes_per_second", "time/sample_fraction", "time/grad_steps_per_second"}


def test_mean_baseline_advantage_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    expected = torch.tensor([[1 - 0.3, 0 - 0.3, 0.1 - 0.3, 0.1 - 0.3], [0, 0, 0, 0], [0.25, 0.25, 0.25, -0.75]])
    assert torch.allclose(reinforce.mean_baseline_advantages(rewards), expected)
    # each prompt's advantages sum to zero: a group whose rewards tie teaches nothing
    assert torch.allclose(reinforce.mean_baseline_advantages(rewards).sum(1), torch.zeros(3), atol=1e-6)


def test_help_lists_the_flags_with_their_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        checks.parse_args(reinforce.Args, ["--help"], smollm2=reinforce.SMOLLM2)
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # (tyro wraps lines in a box)
    for flag, default in [("--group-size", "8"), ("--num-prompts", "32"), ("--num-rounds", "40"),
                          ("--learning-rate", "0.0001"), ("--max-grad-norm", "0.5"), ("--temperature", "0.8"),
                          ("--top-p", "0.95"), ("--max-new-tokens", "32"), ("--max-prompt-tokens", "64"),
                          ("--model", "tiny"), ("--eval-every", "0"), ("--save-every", "0"), ("--resume", "None")]:
        assert flag in text, flag
        after = text.split(flag, 1)[1].split("--", 1)[0]  # the flag's own help
        assert f"(default: {default})" in after, (flag, after)


def test_smollm2_gets_its_preset_and_tiny_its_own_defaults():
    smollm2 = checks.parse_args(reinforce.Args, ["--model", "smollm2"], smollm2=reinforce.SMOLLM2)
    assert (smollm2.task, smollm2.chat_template, smollm2.num_prompts, smollm2.learning_rate, smollm2.max_prompt_tokens,
            smollm2.micro_batch_tokens) == ("arithmetic", True, 8, 2e-5, 128, 512)
    tiny = checks.parse_args(reinforce.Args, [], smollm2=reinforce.SMOLLM2)
    assert (tiny.task, tiny.chat_template, tiny.group_size, tiny.num_prompts, tiny.num_rounds, tiny.exp_name) == \
        ("countdown", False, 8, 32, 40, "reinforce")


def test_the_first_script_is_a_page_that_names_what_each_method_adds():
    source = SCRIPT.read_text()
    assert len(source.splitlines()) <= 130
    for script in ("rloo_kreuse.py", "online_dpo_async.py", "pipeline_rl.py", "ppo_oppo.py"):
        assert (ROOT / script).is_file() and f"- {script}: " in reinforce.__doc__, script
    # the round's sampling settings in view, the same ones the learner's logprobs use (the logprob contract)
    assert ("sampler.generate(prompts, n=args.group_size, temperature=args.temperature, top_p=args.top_p," in source
            and "temperature=args.temperature" in source.split("common.token_logprobs(", 1)[1].split("top_p=", 1)[0]
            and "Run(args, memory_plan.GROUPS)" in source)


def _run(*flags, timeout=900):
    out = subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=WORK, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    return out, WORK / out.stdout.split("run directory: ")[1].split()[0]


def _rounds(run_dir: Path) -> list[dict]:
    return [r for r in runlog.read_metrics(run_dir) if "charts/reward" in r]


@pytest.mark.slow
def test_two_rounds_on_the_tiny_model_then_a_resume():
    """Three rounds with a checkpoint after each, then a resume from round 2's (--keep-checkpoints): round 3 comes
    again as the run that never stopped made it (the checkpoint kept the data position and the sampler's generators
    as the round after it draws them). Two runs; rloo_kreuse's test resumes a run directory from elsewhere."""
    flags = ["--exp-name", "pytest_reinforce", "--num-prompts", "8", "--group-size", "4", "--eval-problems", "8",
             "--eval-samples", "2"]
    out, run_dir = _run(*flags, "--num-rounds", "3", "--save-every", "1", "--keep-checkpoints", "3")
    rounds = _rounds(run_dir)
    assert [r["step"] for r in rounds] == [1, 2, 3]  # one optimizer step a round
    for r in rounds:
        assert ROUND_KEYS <= r.keys(), ROUND_KEYS - r.keys()
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, (int, float))), r
        assert r["charts/episodes"] == 32 * r["step"] and 0 <= r["charts/accuracy"] <= 1
    assert len([r for r in runlog.read_metrics(run_dir) if "eval/pass@1" in r]) == 2  # at the start and the end
    assert (run_dir / "summary.md").is_file() and "REINFORCE with a mean baseline" in out.stdout
    assert torch.load(run_dir / "checkpoints" / "2.pt", weights_only=False)["round"] == 2

    # --resume takes the checkpoint (and the saved flags): only the run's length is given
    resumed, resumed_dir = _run("--num-rounds", "3", "--resume", str(run_dir / "checkpoints" / "2.pt"))
    assert resumed_dir == run_dir and "resumed from" in resumed.stdout and "round 3/3 step 3" in resumed.stdout
    assert "round 1/" not in resumed.stdout and "round 2/" not in resumed.stdout
    again = _rounds(run_dir)
    assert [r["step"] for r in again] == [1, 2, 3]  # the first run's rows after the checkpoint: replaced
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["round"] == 3
    untimed = lambda row: {k: v for k, v in row.items()
                          if not k.startswith(("time/", "wall")) and "per_second" not in k}
    assert untimed(again[2]) == untimed(rounds[2])
    replaced = [json.loads(line) for line in (run_dir / "metrics.replaced.jsonl").read_text().splitlines()]
    assert [r for r in replaced if "charts/reward" in r] == rounds[2:] and {r["step"] for r in replaced} == {3}
    assert again[2]["wall"] > again[1]["wall"]  # the run's clock goes on from the checkpoint's
    # the summary's start is the run's, from the checkpoint: not a second evaluation at the resumed step
    assert [r["step"] for r in runlog.read_metrics(run_dir) if "eval/pass@1" in r] == [0, 3]
    start_row = lambda text: next(line for line in text.splitlines() if line.startswith("| start |"))
    assert start_row(resumed.stdout) == start_row(out.stdout)
    # a resume that changes a flag measures its start again (the saved one would be another measurement, here without
    # the pass@4 that 4 samples a problem give)
    changed, _ = _run("--num-rounds", "3", "--resume", str(run_dir / "checkpoints" / "2.pt"), "--resume-changes",
                      "--eval-samples", "4")
    assert "| model | pass@1 | pass@2 | pass@4 |" in changed.stdout and start_row(changed.stdout).count("|") == 5


@pytest.mark.slow
def test_smollm2_runs_a_round():
    import common

    common.resolve_model("smollm2")  # (built from its wheel on first use, as tests/test_smollm2.py's fixture does)
    out, run_dir = _run("--model", "smollm2", "--exp-name", "pytest_reinforce_smollm2", "--num-rounds", "1",
                        "--num-prompts", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-problems", "4",
                        "--eval-samples", "2")
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["task"], args["chat_template"], args["learning_rate"]) == ("arithmetic", True, 2e-5)
    [row] = _rounds(run_dir)
    assert ROUND_KEYS <= row.keys() and math.isfinite(row["losses/loss"]) and row["charts/episodes"] == 16
