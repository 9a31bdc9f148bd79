"""docs/defaults.md's table of every optimizer argument and penalty against the scripts themselves (issue 59, item 4):
each script's optimizer call and its `Args` fields that are a learning rate, a clip, a weight decay, a coefficient or a
penalty, at the tiny model's defaults, the `PAPER` preset and the `SMOLLM2` preset. A new one, or a changed value, fails
here until the table says what it is and why."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("rloo_kreuse.py", "online_dpo_async.py", "pipeline_rl.py", "ppo_oppo.py")


def is_knob(field: str) -> bool:
    return field in ("learning_rate", "max_grad_norm", "weight_decay") or field.endswith("_coef") or "penalty" in field


def script_knobs(script: str) -> dict[str, tuple[str, str, str]]:
    """knob -> (tiny, PAPER, SMOLLM2), as the table writes them, read off the script's own code."""
    tree = ast.parse((ROOT / script).read_text())
    module = importlib.import_module(script[:-3])
    knobs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and is_knob(item.target.id):
                    name, tiny = item.target.id, ast.literal_eval(item.value)
                    paper = module.PAPER.get(name, tiny)
                    knobs[f"`--{name.replace('_', '-')}`"] = tuple(str(v) for v in (tiny, paper,
                                                                                      module.SMOLLM2.get(name, paper)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "optim"):
            kwargs = ", ".join(f"{k.arg}={ast.unparse(k.value)}" for k in sorted(node.keywords, key=lambda k: k.arg)
                               if k.arg not in ("lr", "fused"))  # (lr: --learning-rate; fused: how, not what)
            knobs["optimizer"] = (f"`{node.func.attr}({kwargs})`",) * 3  # the presets never change the call
    return knobs


def table_knobs() -> dict[str, dict[str, tuple[str, str, str]]]:
    text = (ROOT / "docs" / "defaults.md").read_text()
    section = text.split("## Every optimizer argument and penalty, in each script")[1].split("\n## ")[0]
    rows: dict = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in SCRIPTS:
            assert cells[5], f"{cells[0]} {cells[1]}: no source"
            rows.setdefault(cells[0], {})[cells[1]] = tuple(cells[2:5])
    return rows


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_optimizer_argument_and_penalty_is_in_the_defaults_table(script):
    documented = table_knobs().get(script, {})
    assert script_knobs(script) == documented
