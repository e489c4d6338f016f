"""AReaL staleness ablation: the summary reads the right metrics, the verdict follows the
numbers, and the quick study runs end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncopd_jax.studies import rl_staleness
from asyncopd_jax.studies.rl_staleness import BOUND, EXACT, FULL, OBJECTIVES, _arms, _sets, _verdict, summarise


def test_unbounded_staleness_runs_as_a_bound_that_cannot_bind():
    assert "schedule.max_staleness=200" in _sets("ppo_clip", math.inf, 0, FULL)
    assert "schedule.max_staleness=4" in _sets("ppo_clip", 4, 0, FULL)


def test_the_exact_arm_trains_every_step_on_answers_exactly_eta_versions_old():
    sets = _sets("decoupled_ppo", 8, 1, FULL, EXACT)
    assert "schedule.mode=fixed_lag" in sets and "schedule.lag=8" in sets
    assert not any(s.startswith("schedule.max_staleness") for s in sets)
    assert (EXACT, 16.0) in _arms(FULL) and (BOUND, math.inf) in _arms(FULL)


def test_summarise_reads_reward_staleness_and_training_seconds():
    records = [
        {
            "step": s,
            "rollout_accuracy": s / 10,
            "staleness_mean": s % 3,
            "staleness_max": s % 4,
            "importance_ratio_max": 1 + s,
            "zero_grad_fraction": 0.1,
            "time": 2.0 * s,
        }
        for s in range(1, 21)
    ]
    records[9]["eval_seconds"] = 3.0  # an evaluation after step 10: inside the later "time"s
    records[19]["eval_seconds"] = 4.0  # after the last step: not inside any
    s = summarise({"records": records, "summary": {"student_after": 0.7}})
    assert s["accuracy"] == 0.7 and s["reward"] == pytest.approx(1.95)  # the last 2 of 20 steps
    assert s["staleness_mean"] == pytest.approx(np.mean([k % 3 for k in range(1, 21)])) and s["staleness_max"] == 3
    assert s["ratio_max"] == 21 and s["seconds"] == 37.0


def _summary(accuracy, staleness_mean=0.5):
    return {
        (sch, o, eta, seed): {
            "accuracy": accuracy(sch, o, eta) + 0.02 * seed,
            "staleness_mean": staleness_mean,
            "ratio_max": 2.0,
            "zero_grad": 0.1,
        }
        for sch, eta in _arms(FULL)
        for o in OBJECTIVES
        for seed in range(3)
    }


@pytest.mark.parametrize(
    "naive_drop,decoupled_drop,verdict",
    [
        (0.2, 0.0, "reproduced (naive"),
        (0.01, 0.0, "partly reproduced"),
        (0.0, 0.1, "not reproduced"),
        (0.2, 0.2, "not reproduced"),  # both lose alike: staleness hurts, but not naive PPO more
    ],
)
@pytest.mark.parametrize("schedule", [BOUND, EXACT])
def test_the_verdict_follows_the_drops_of_each_arm(naive_drop, decoupled_drop, verdict, schedule):
    def accuracy(sch, objective, eta):
        drop = naive_drop if objective == "ppo_clip" else decoupled_drop
        return 0.7 - (drop if eta >= 4 and sch == schedule else 0.0)

    text = _verdict(_summary(accuracy), FULL, seeds=3)
    other = EXACT if schedule == BOUND else BOUND
    this_arm = text.split(f"**{schedule} η**")[1].split("**")[0]
    assert verdict in this_arm, text
    assert f"ppo_clip 72.0 % at η = 0 → worst at η ≥ 4 {100 * (0.72 - naive_drop):.1f} %" in this_arm
    assert "not reproduced" in text.split(f"**{other} η**")[1].split("**")[0]  # no drop in the other arm
    assert ("most likely reason" in text) == (schedule == BOUND or verdict != "reproduced (naive")


def test_the_verdict_says_when_the_bound_never_binds():
    def flat(sch, objective, eta):
        return 0.7

    assert "never gets far ahead" in _verdict(_summary(flat, staleness_mean=0.4), FULL, seeds=3)
    assert "never gets far ahead" not in _verdict(_summary(flat, staleness_mean=3.0), FULL, seeds=3)


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = rl_staleness.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    assert text.count("| bound η = ∞ |") == 2 and text.count("| exact η = 2 |") == 2 and "## Verdict" in text
    assert (tmp_path / "docs" / "rl_staleness" / "reward.png").is_file()
