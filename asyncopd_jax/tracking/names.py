"""The names a run's metrics take in TensorBoard, W&B and MLflow: ``metrics.jsonl``'s keys,
grouped by what they describe.

    train/…          the optimizer step: loss, estimator metrics, grad norm, lr, …
    teacher/NAME/…   a teacher's share of the batch (already so named in metrics.jsonl)
    rollout/…        the batch as the samplers wrote it: staleness, accuracy, drops, snapshots
    eval/…           held-out evaluation
    system/…         throughput and clocks

One table decides each key's group (:func:`grouped`); a key it does not name is a
``train/`` metric, so a new learner metric appears without an edit here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# Not metrics: the step is the x axis; ``groups`` are spool indices (a record of what was learned).
SKIPPED = frozenset({"step", "groups"})
HISTOGRAMS = {"staleness_hist": "rollout/staleness"}  # counts per age: a histogram, not a scalar
RENAMED = {
    "rollout_accuracy": "rollout/accuracy",
    "eval_accuracy": "eval/accuracy",
    "eval_seconds": "eval/seconds",
    "eval_version": "eval/version",  # the policy version evaluated (eval.mode: background)
    "student_before": "eval/accuracy",  # logged at step 0: the curve starts there
    "teacher_accuracy": "eval/teacher_accuracy",
}
ROLLOUT_PREFIXES = ("staleness_", "snapshot_", "dropped_", "nonfinite_rows_total")
SYSTEM = frozenset({"samples_per_s", "tokens_per_s", "time", "trace_s", "teacher_wait_s"})


def metric_name(key: str) -> str:
    """The grouped name of the scalar ``key`` of a ``metrics.jsonl`` record."""
    if key in RENAMED:
        return RENAMED[key]
    if key.startswith("teacher_accuracy/"):  # several teachers: teacher_accuracy/NAME
        return f"eval/teacher_accuracy/{key.split('/', 1)[1]}"
    if "/" in key:  # teacher/NAME/…
        return key
    if key.startswith(ROLLOUT_PREFIXES):
        return f"rollout/{key}"
    if key in SYSTEM:
        return f"system/{key}"
    return f"train/{key}"


def grouped(record: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """A record's scalars ``{name: value}`` and histograms ``{name: counts [n]}`` under their
    grouped names; lists other than the known histograms, strings and None are left out."""
    scalars: dict[str, float] = {}
    histograms: dict[str, np.ndarray] = {}
    for key, value in record.items():
        if key in SKIPPED:
            continue
        if key in HISTOGRAMS:
            histograms[HISTOGRAMS[key]] = np.asarray(value, np.int64)
        elif isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
            scalars[metric_name(key)] = float(value)
    return scalars, histograms
