"""Issue 48: each script is a page. Its length (wc -l) within its budget, its round (the body of main()'s loop over
rounds) within 100 lines, no line over 120 columns (ruff, configured in pyproject.toml), and a copy stripped to its
method (no checkpoints, no evaluation between rounds, no torchrun calls, one metric) still runs, pushes and stops."""

import ast
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import run_stripped_copy, strip_to_method

ROOT = Path(__file__).resolve().parents[1]
# the scripts on the run object (fastrl/run.py), with their budgets in lines (issue 48)
# (rloo 350 -> 370: log pi_theta0 read off k-step 1's forward instead of a pass of its own, issue 50)
# (pipeline 450 -> 470: its actor's state in the checkpoint: a mid-run resume trains every prompt once, issue 59)
BUDGETS = {"rloo_kreuse.py": 370, "online_dpo_async.py": 400, "pipeline_rl.py": 470, "ppo_oppo.py": 650}
ROUND_BUDGET = 100
# every Python file of the repository is kept within 120 columns by ruff (configured in pyproject.toml)
RUFF_CLEAN = ["."]


def round_loop(path: Path) -> ast.For | ast.While:
    """main()'s loop over rounds: the outermost `for` or `while` loop in main() (inside its `with run:` block)."""
    main = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return next(n for n in ast.walk(main) if isinstance(n, (ast.For, ast.While)))


@pytest.mark.parametrize("script", BUDGETS)
def test_the_script_is_a_page(script):
    path = ROOT / script
    lines = len(path.read_text().splitlines())
    assert lines <= BUDGETS[script], f"{script}: {lines} lines, budget {BUDGETS[script]}"
    loop = round_loop(path)
    round_lines = loop.end_lineno - loop.lineno + 1
    assert round_lines <= ROUND_BUDGET, f"{script}: the round is {round_lines} lines, budget {ROUND_BUDGET}"


def ruff() -> str:
    found = shutil.which("ruff", path=sysconfig.get_path("scripts")) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (the dev extra installs it)")
    return found


def test_no_line_over_120_columns():
    out = subprocess.run([ruff(), "check", "--output-format", "concise", *RUFF_CLEAN], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_line_limit_is_ruffs_and_it_finds_a_long_line(tmp_path):
    """The check above can fail: the configured limit is 120 and a 121-column line is reported."""
    long_line = tmp_path / "long.py"
    long_line.write_text("x = '" + "a" * 115 + "'\n")
    out = subprocess.run([ruff(), "check", "--config", str(ROOT / "pyproject.toml"), "--output-format", "concise",
                          str(long_line)], capture_output=True, text=True)
    assert out.returncode == 1 and "E501" in out.stdout and "(121 > 120)" in out.stdout


def strip_rloo(source: str) -> str:
    """rloo_kreuse.py as a student strips it to the method: no checkpoints, snapshots or evaluation between rounds
    (run.end_round), no torchrun calls (all_sum, full_norm), and one metric besides the seconds."""
    replacements = [
        ("            run.end_round(round_index + 1, step, data_position, sampler_rng, tokenizer)\n", ""),
        ("                loss, out = run.all_sum((loss, out))  # under torchrun: every rank's micro-batches\n", ""),
        ("grad_norm = run.full_norm(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm))",
         "grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)"),
    ]
    return strip_to_method(source, replacements,
                           '{"charts/reward": rewards.mean().item(), '
                           '"time/generate_seconds": generate_seconds, "time/train_seconds": train_seconds}')


@pytest.mark.slow
def test_a_copy_stripped_to_its_method_runs_pushes_and_stops(tmp_path):
    out = run_stripped_copy("rloo_stripped", strip_rloo((ROOT / "rloo_kreuse.py").read_text()),
                            ["--num-rounds", "3", "--num-prompts", "4", "--group-size", "4", "--k", "2",
                             "--eval-problems", "4", "--eval-samples", "1"])
    # each round after the first was sampled by the weights pushed after the one before (run.check_version in the
    # copy stops the run otherwise): K=2 steps a round, so round 3 ran on policy version 4
    assert "round 3/3 step 6" in out.stdout and "reward" in out.stdout
