"""E2: the summary reads the right metrics, the verdict follows the numbers, and the quick
study runs end to end."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.studies import stabilisers
from asyncopd_jax.studies.stabilisers import QUICK, STABILISERS, VARIANTS, _verdict, summarise


def test_summarise_takes_the_last_probe_kl_and_means_over_steps():
    records = [
        {"step": 1, "zero_grad_fraction": 0.2, "grad_norm": 1.0, "importance_ratio_max": 3.0, "probe_reverse_kl": 0.9},
        {"step": 2, "zero_grad_fraction": 0.4, "grad_norm": 3.0, "importance_ratio_max": 7.0},
        {"step": 3, "zero_grad_fraction": 0.0, "grad_norm": 2.0, "importance_ratio_max": 1.0, "probe_reverse_kl": 0.4},
    ]
    s = summarise({"records": records, "summary": {"student_after": 0.75}})
    assert s == {"accuracy": 0.75, "reverse_kl": 0.4, "zero_grad": pytest.approx(0.2), "grad_norm": 2.0,
                 "ratio_max": 7.0}
    assert np.isnan(summarise({"records": [], "summary": {}})["accuracy"])


def _summary(accuracy_of):
    """Every (variant, N, lag, seed) of the quick settings with accuracy ``accuracy_of(variant, seed)``."""
    return {(v, n, lag, seed): {"accuracy": accuracy_of(v, seed)}
            for v, n in VARIANTS for lag in QUICK.lags for seed in range(2)}


@pytest.mark.parametrize("stabiliser_gain,verdict", [
    (0.0, "Verdict: reproduced: no stabiliser beats"),
    (0.005, "Verdict: reproduced: no stabiliser beats"),   # inside one accuracy point
    (0.05, "Verdict: not reproduced: m2po at k = 2 by 5.0 points"),
])
def test_the_verdict_follows_the_accuracies(stabiliser_gain, verdict):
    def accuracy(variant, seed):
        base = 0.8 + 0.002 * seed
        return base + (stabiliser_gain if variant == "m2po" else 0.0) - (0.1 if variant in STABILISERS[:3] else 0.0)
    text = _verdict(_summary(accuracy), QUICK, seeds=2)
    assert verdict in text, text
    assert "best stabiliser m2po" in text


def test_a_stabiliser_inside_the_seed_spread_does_not_count():
    # recompute's seeds are 0.7 and 0.9 (spread ±10 points); m2po is 5 points better on average
    def accuracy(variant, seed):
        if variant == "m2po":
            return 0.85
        return 0.7 + 0.2 * seed if variant == "recompute + IS" else 0.5
    assert "Verdict: reproduced" in _verdict(_summary(accuracy), QUICK, seeds=2)


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = stabilisers.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    assert "| m2po | 1 |" in text and "| recompute + IS | 8 |" in text and "## Verdict" in text
    assert "stopped with an error" not in text
