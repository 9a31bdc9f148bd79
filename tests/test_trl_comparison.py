"""benchmarks/trl_comparison.py: TRL gets exactly our reward, and one TRL optimizer step is our
batch shape. The TRL parts are skipped where TRL is not installed (it is the `trl` extra)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tasks  # noqa: E402
import trl_comparison as bench  # noqa: E402


def crafted(task):
    """Four training problems and, for each, a completion worth 1.0, 0.1, 0.0 and 0.0."""
    problems = [task.problem("train", i) for i in range(4)]
    completions = [f"<answer>{problems[0].answer}</answer>",  # a correct solution: 1.0
                   "<answer>1+1</answer>",  # well formed, wrong numbers: 0.1
                   f"<answer>{problems[2].answer}",  # no closing tag: 0.0
                   "no answer at all"]
    return problems, completions


def test_reward_adapter_matches_task_reward():
    """Called the way TRL calls a reward function (prompts, completions and the dataset's extra
    columns as lists, two completions per prompt), the adapter gives task.reward."""
    task = tasks.make_task("countdown", 1, tiny_prompts=True)
    problems, completions = crafted(task)
    rows = [problems[i // 2] for i in range(8)]
    completions = [c for c in completions for _ in range(2)]
    rewards = bench.TaskReward(task)(prompts=[p.prompt for p in rows], completions=completions,
                                     numbers=[p.numbers for p in rows], target=[p.target for p in rows], trainer_state=None)
    assert rewards == [task.reward(c, p) for c, p in zip(completions, rows)]
    assert rewards == [1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0]


def test_train_dataset_is_our_prompts():
    """TRL's dataset holds the prompts ours takes, in order, and its columns round-trip the reward."""
    pytest.importorskip("datasets")
    task = tasks.make_task("countdown", 1, tiny_prompts=True)
    problems, completions = crafted(task)
    rows = bench.train_dataset(task, 4)
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    rewards = bench.TaskReward(task)(prompts=rows["prompt"], completions=completions, numbers=rows["numbers"], target=rows["target"])
    assert rewards == [task.reward(c, p) for c, p in zip(completions, problems)] == [1.0, 0.1, 0.0, 0.0]


@pytest.mark.parametrize("prompts, completions", [(32, 8), (8, 4)])
def test_trl_rloo_step_is_our_batch(tmp_path, prompts, completions):
    """One RLOOTrainer optimizer step generates P x G completions once and takes one step on them."""
    trl = pytest.importorskip("trl")
    w = bench.Workload("rloo", "unused", 3, prompts, completions, 0.8, 1e-4, 32, 1, 0, 16)
    config = trl.RLOOConfig(**bench.trl_config_kwargs(w, str(tmp_path)))
    assert config.generation_batch_size == prompts * completions
    assert config.steps_per_generation == config.gradient_accumulation_steps  # one generation per optimizer step
    assert config.num_iterations == 1 and config.num_generations == completions
    assert not config.bf16 and not config.gradient_checkpointing and config.lr_scheduler_type == "constant"


def test_accuracy_study_variants_reach_our_command_line():
    """Each --accuracy-variants entry is passed to rloo_kreuse.py after the shared flags (so it
    wins), and '' is ours as shipped."""
    w = bench.Workload("rloo", "unused", 3, 4, 2, 0.8, 1e-4, 32, 7, 20, 16)
    args = bench.Args(ours_rloo_extra="--kl-coef 0")
    shipped, no_entropy = bench.ours_flags(w, args, ""), bench.ours_flags(w, args, "--ent-coef 0")
    assert shipped[-2:] == ["--exp-name", "trl_cmp_rloo"] and "--kl-coef" not in shipped
    assert no_entropy[-2:] == ["--ent-coef", "0"] and no_entropy[:-2] == shipped
    assert bench.ours_flags(w, args)[-2:] == ["--kl-coef", "0"]  # no variant: --ours-rloo-extra
    assert shipped[shipped.index("--seed") + 1] == "7"
