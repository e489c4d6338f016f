"""AReaL staleness ablation: the summary reads the right metrics, the verdict follows the
numbers, and the quick study runs end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncopd_jax.studies import rl_staleness
from asyncopd_jax.studies.rl_staleness import FULL, OBJECTIVES, _sets, _verdict, summarise


def test_unbounded_staleness_runs_as_a_bound_that_cannot_bind():
    assert "schedule.max_staleness=200" in _sets("ppo_clip", math.inf, 0, FULL)
    assert "schedule.max_staleness=4" in _sets("ppo_clip", 4, 0, FULL)


def test_summarise_reads_reward_staleness_and_training_seconds():
    records = [{"step": s, "rollout_accuracy": s / 10, "staleness_mean": s % 3, "staleness_max": s % 4,
                "importance_ratio_max": 1 + s, "zero_grad_fraction": 0.1, "time": 2.0 * s} for s in range(1, 21)]
    records[9]["eval_seconds"] = 3.0   # an evaluation after step 10: inside the later "time"s
    records[19]["eval_seconds"] = 4.0  # after the last step: not inside any
    s = summarise({"records": records, "summary": {"student_after": 0.7}})
    assert s["accuracy"] == 0.7 and s["reward"] == pytest.approx(1.95)  # the last 2 of 20 steps
    assert s["staleness_mean"] == pytest.approx(np.mean([k % 3 for k in range(1, 21)])) and s["staleness_max"] == 3
    assert s["ratio_max"] == 21 and s["seconds"] == 37.0


def _summary(accuracy):
    return {(o, eta, seed): {"accuracy": accuracy(o, eta) + 0.02 * seed, "staleness_max": min(eta, 9)}
            for o in OBJECTIVES for eta in FULL.etas for seed in range(3)}


@pytest.mark.parametrize("naive_drop,decoupled_drop,verdict", [
    (0.2, 0.0, "Verdict: reproduced"),
    (0.01, 0.0, "Verdict: partly reproduced"),
    (0.0, 0.1, "Verdict: not reproduced"),
])
def test_the_verdict_follows_the_drops(naive_drop, decoupled_drop, verdict):
    def accuracy(objective, eta):
        drop = naive_drop if objective == "ppo_clip" else decoupled_drop
        return 0.7 - (drop if eta >= 4 else 0.0)
    text = _verdict(_summary(accuracy), FULL, seeds=3)
    assert verdict in text, text
    assert f"ppo_clip: 72.0 % at η = 0, worst at η ≥ 4 {100 * (0.72 - naive_drop):.1f} %" in text


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = rl_staleness.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    assert text.count("| ∞ |") == 2 and "## Verdict" in text
    assert (tmp_path / "docs" / "rl_staleness" / "reward.png").is_file()
