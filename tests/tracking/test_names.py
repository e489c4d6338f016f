"""The grouped names the sinks give metrics.jsonl's keys: a table written here."""

from __future__ import annotations

import numpy as np

from asyncopd_jax.tracking import grouped

RECORD = {
    "step": 7,
    "loss": 0.5,
    "grad_norm": 2,
    "lr": 0.01,
    "teacher/a/kl": 0.25,
    "teacher/a/rows": 8,
    "staleness_mean": 1.5,
    "staleness_max": 3,
    "staleness_hist": [2, 0, 5, 1],
    "rollout_accuracy": 0.75,
    "dropped_stale": 0,
    "snapshot_bytes": 1000,
    "nonfinite_rows_total": 0,
    "eval_accuracy": 0.9,
    "eval_seconds": 1.25,
    "samples_per_s": 100.0,
    "time": 3.0,
    "teacher_wait_s": 0.0,
    "groups": [4, 5],
    "teacher_accuracy/b": 0.95,
    "note": "text",
}
EXPECTED = {
    "train/loss": 0.5,
    "train/grad_norm": 2.0,
    "train/lr": 0.01,
    "teacher/a/kl": 0.25,
    "teacher/a/rows": 8.0,
    "rollout/staleness_mean": 1.5,
    "rollout/staleness_max": 3.0,
    "rollout/accuracy": 0.75,
    "rollout/dropped_stale": 0.0,
    "rollout/snapshot_bytes": 1000.0,
    "rollout/nonfinite_rows_total": 0.0,
    "eval/accuracy": 0.9,
    "eval/seconds": 1.25,
    "system/samples_per_s": 100.0,
    "system/time": 3.0,
    "system/teacher_wait_s": 0.0,
    "eval/teacher_accuracy/b": 0.95,
}


def test_each_key_goes_to_its_group_and_the_histogram_stays_counts():
    scalars, histograms = grouped(RECORD)
    assert scalars == EXPECTED
    assert list(histograms) == ["rollout/staleness"]
    np.testing.assert_array_equal(histograms["rollout/staleness"], [2, 0, 5, 1])


def test_the_accuracy_before_training_is_the_eval_curve_at_step_0():
    assert grouped({"step": 0, "student_before": 0.1}) == ({"eval/accuracy": 0.1}, {})
