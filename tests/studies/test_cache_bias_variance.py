"""E3's statistics on synthetic distributions, and the quick study end to end."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncopd_jax.studies import get_study
from asyncopd_jax.studies.cache_bias_variance import gradient_statistics

TOPK, MC, STALE = ("top-K, student support (`reverse_kl_topk`)", "MC + IS, recompute (`reverse_kl_mc`)",
                   "MC, stale signal (`reverse_kl_mc_stale`)")


def test_statistics_separate_bias_from_variance():
    rng = np.random.default_rng(0)
    P, V = 64, 12
    student = rng.normal(size=(P, V)) * 1.5
    behaviour = student + rng.normal(size=(P, V)) * 0.7  # stale
    teacher = rng.normal(size=(P, V)) * 1.5
    stats = gradient_statistics(student, behaviour, teacher, budgets=(1, 8, 16), draws=2048, key=jax.random.key(0))
    # Top-K is deterministic: no variance; biased below V ids, exact at V (16 ≥ 12).
    assert stats[TOPK, 8]["variance"] == 0 and stats[TOPK, 8]["bias2"] > 1e-3
    assert stats[TOPK, 16]["mse"] < 1e-8 and stats[TOPK, 16]["cosine"] > 0.9999
    # MC + IS is unbiased: its bias² is noise, far below its variance and the stale signal's bias².
    assert abs(stats[MC, 8]["bias2"]) < 0.02 * stats[MC, 8]["variance"]
    assert stats[STALE, 8]["bias2"] > 10 * abs(stats[MC, 8]["bias2"])
    # Independent candidates: variance ∝ 1/N.
    assert 6 < stats[MC, 1]["variance"] / stats[MC, 8]["variance"] < 10
    for s in stats.values():  # MSE = bias² + variance (the bias² keeps its draw-noise correction)
        assert s["mse"] == pytest.approx(s["bias2"] + s["variance"] * (1 + 1 / 2048), rel=1e-4, abs=1e-9)


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = get_study("cache_bias_variance")(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1,
                                            command="asyncopd study cache_bias_variance --quick --seeds 1")
    text = path.read_text()
    assert text.startswith("# E3") and "asyncopd study cache_bias_variance --quick --seeds 1" in text
    assert text.count("| top-K, student support") == 4 and "## Verdict" in text
    assert (tmp_path / "docs" / "cache_bias_variance" / "mse_by_budget.png").stat().st_size > 10_000


def test_an_unknown_study_names_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown study 'e9'; allowed: cache_bias_variance, extrapolation, kl_direction, "
                       "rl_staleness, stabilisers, throughput"):
        get_study("e9")
