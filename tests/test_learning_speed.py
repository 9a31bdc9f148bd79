"""benchmarks/learning_speed.py: time to target read off a learning curve."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import learning_speed  # noqa: E402


def test_time_to_target_interpolates_between_snapshots_and_takes_the_first_crossing():
    curve = [(0.0, 0.1), (4.0, 0.2), (8.0, 0.4), (12.0, 0.25), (16.0, 0.5)]
    assert learning_speed.time_to(curve, 0.3) == pytest.approx(6.0)  # halfway from 0.2 at 4 s to 0.4 at 8 s
    assert learning_speed.time_to(curve, 0.2) == pytest.approx(4.0)
    assert learning_speed.time_to(curve, 0.05) == 0.0  # reached at the start
    assert learning_speed.time_to(curve, 0.45) == pytest.approx(12.0 + 4.0 * (0.45 - 0.25) / 0.25)
    assert math.isnan(learning_speed.time_to(curve, 0.6))  # never


def test_every_arm_of_every_paper_names_a_script_that_exists():
    root = Path(learning_speed.ROOT)
    for paper, (script, shared, arms) in learning_speed.PAPERS.items():
        assert (root / script).is_file(), paper
        assert arms and all(every >= 1 for _, every in arms.values())


def test_a_target_some_seeds_never_reach_is_summarized_over_those_that_did():
    assert learning_speed.summarize([2.0, 4.0, 6.0]) == (pytest.approx(4.0), pytest.approx(math.sqrt(8 / 3)), 3)
    mean, sd, reached = learning_speed.summarize([2.0, float("nan"), 6.0])
    assert (mean, sd, reached) == (pytest.approx(4.0), pytest.approx(2.0), 2)
    mean, sd, reached = learning_speed.summarize([float("nan")] * 3)
    assert math.isnan(mean) and math.isnan(sd) and reached == 0


def test_every_paper_names_baselines_among_its_arms():
    for paper, (_, _, arms) in learning_speed.PAPERS.items():
        baselines = learning_speed.BASELINES[paper]
        assert baselines and set(baselines) <= set(arms) and set(arms) - set(baselines), paper


def test_a_speed_up_is_claimed_only_where_its_bootstrap_interval_excludes_one():
    ratio, low, high = learning_speed.bootstrap_speedup([5.0, 5.2, 4.8, 5.1, 4.9], [10.0, 10.4, 9.6, 10.2, 9.8])
    assert ratio == pytest.approx(2.0) and 1.8 < low < 2.0 < high < 2.2
    assert learning_speed.verdict(low, high) == "faster"
    # seeds spread wider than the gap
    ratio, low, high = learning_speed.bootstrap_speedup([3.0, 9.0, 6.0], [4.0, 8.0, 7.0])
    assert low < 1 < high and learning_speed.verdict(low, high).startswith("inconclusive")
    _, low, high = learning_speed.bootstrap_speedup([10.0, 10.5, 9.5], [5.0, 5.5, 4.5])
    assert learning_speed.verdict(low, high) == "slower"
    assert all(math.isnan(v) for v in learning_speed.bootstrap_speedup([4.0, float("nan")], [8.0, 8.0]))
    assert learning_speed.verdict(float("nan"), float("nan")).startswith("inconclusive")


def test_a_paired_bootstrap_cancels_what_a_seed_does_to_both_arms():
    # the seeds spread the times 3x, and every seed is 1.2x faster in the arm: only pairing sees it
    base = [4.0, 12.0, 6.0, 9.0, 5.0, 11.0]
    arm = [t / 1.2 * (1 + 0.02 * (-1) ** i) for i, t in enumerate(base)]
    _, low, high = learning_speed.bootstrap_speedup(arm, base)
    assert low < 1 < high
    ratio, low, high = learning_speed.bootstrap_speedup(arm, base, paired=True)
    assert ratio == pytest.approx(1.2, rel=0.02) and 1.1 < low < 1.2 < high < 1.3
    assert learning_speed.verdict(low, high) == "faster"
    with pytest.raises(ValueError, match="one time per seed"):
        learning_speed.bootstrap_speedup([1.0, 2.0], [1.0, 2.0, 3.0], paired=True)
