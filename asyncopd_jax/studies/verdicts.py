"""What the training studies' reports conclude from their runs, by rules stated once.

A verdict compares settings across seeds, so each rule is about a set of per-seed values:

- a setting **trains** when its mean held-out accuracy ends at least ``TRAINS_ABOVE``
  above the student's before distillation (a setting that never leaves the floor can
  show neither robustness nor vulnerability to staleness);
- one setting **beats** another when its mean is higher by more than either's half-range
  over seeds, and by at least ``least`` (differences inside the seeds' scatter are not
  findings);
- a run under ``fixed_lag`` had **exact staleness** when every token consumed after
  step k was exactly k versions old.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

# 10 accuracy points: the built-in task's student starts at 3.9 %; E1's runs that train at all end at 30–77 %
TRAINS_ABOVE = 0.10


def trains(accuracies: Sequence[float] | np.ndarray, before: float) -> bool:
    """Whether the per-seed ``accuracies`` end, on average, ``TRAINS_ABOVE`` above ``before``."""
    return float(np.mean(accuracies)) >= before + TRAINS_ABOVE


def beats(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, least: float = 0.01) -> bool:
    """Whether ``a``'s mean exceeds ``b``'s by more than either's half-range over seeds (and ``least``)."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    return float(np.mean(x) - np.mean(y)) > max(np.ptp(x) / 2, np.ptp(y) / 2, least)


K = TypeVar("K", bound=Hashable)


def student_before(results: Mapping[Hashable, Mapping[str, Any]]) -> tuple[float, float]:
    """``(teacher accuracy, student accuracy before training)`` as the runs measured them
    (the same for every run of a study: same task, same checkpoints); NaN without runs."""
    for result in results.values():
        summary = result["summary"]
        if summary and "student_before" in summary:
            return float(summary.get("teacher_accuracy", np.nan)), float(summary["student_before"])
    return np.nan, np.nan


def exact_staleness_note(results: Mapping[K, Mapping[str, Any]], lag_of: Callable[[K], int]) -> str:
    """A report's sentence on ``fixed_lag``: whether, in every run, every token consumed
    after step k was exactly k versions old (staleness mean = max = k at each step)."""
    wrong = []
    for key, result in results.items():
        lag = lag_of(key)
        late = [r for r in result["records"] if r["step"] > lag and "staleness_max" in r]
        if not late or any(r["staleness_max"] != lag or r["staleness_mean"] != lag for r in late):
            wrong.append(str(key))
    if wrong:
        return f"Staleness was NOT exactly k after step k in {len(wrong)} runs: {', '.join(wrong)}."
    return (
        f"Staleness: in all {len(results)} runs, every token consumed after step k was exactly k versions old "
        "(the per-step staleness mean and maximum in metrics.jsonl both equal k)."
    )
