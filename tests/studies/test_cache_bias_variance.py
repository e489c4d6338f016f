"""E3's statistics on synthetic distributions, and the quick study end to end."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncopd_jax.studies import get_study
from asyncopd_jax.studies.cache_bias_variance import (
    FULL,
    LAGS,
    QUICK,
    _verdict,
    gradient_statistics,
    load_statistics,
    save_statistics,
)

TOPK, MC, STALE = (
    "top-K, student support (`reverse_kl_topk`)",
    "MC + IS, recompute (`reverse_kl_mc`)",
    "MC, stale signal (`reverse_kl_mc_stale`)",
)


@pytest.mark.extended  # 13 s: CI's second step
def test_statistics_separate_bias_from_variance():
    rng = np.random.default_rng(0)
    P, V = 64, 12
    student = rng.normal(size=(P, V)) * 1.5
    behaviour = student + rng.normal(size=(P, V)) * 0.7  # stale
    teacher = rng.normal(size=(P, V)) * 1.5
    stats = gradient_statistics(
        student, behaviour, teacher, budgets=(1, 8, 16), draws=2048, key=jax.random.key(0), names=(TOPK, MC, STALE)
    )
    assert {name for name, _ in stats} == {TOPK, MC, STALE}
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


def _stat(overrides=None):
    """``stat(k, name, budget, field)`` over two seeds: top-K biased without variance, MC + IS
    unbiased with variance 1/N, unless ``overrides[(k, name, budget, field)]`` says otherwise."""

    def stat(k, name, budget, field):
        if (k, name, budget, field) in (overrides or {}):
            return overrides[k, name, budget, field]
        if name == TOPK:
            return {"bias2": [0.01, 0.012], "variance": [0.0, 0.0]}.get(field, [0.02, 0.02])
        return {"bias2": [0.001, -0.001], "variance": [8.0 / budget, 8.4 / budget]}.get(field, [1.0, 1.0])

    return stat


ESTIMATORS = [TOPK, "top-K, teacher support", MC]


def test_the_verdict_follows_the_three_rules():
    assert _verdict(_stat(), ESTIMATORS, draws=256).endswith("Verdict: reproduced: all three hold at every k.")
    # a bias² above the draws' noise (variance / R = 1.03 / 256) at k = 8 on one seed
    text = _verdict(_stat({(8, MC, 8, "bias2"): [0.001, -0.01]}), ESTIMATORS, draws=256)
    assert text.endswith("Verdict: partly reproduced: 1 of 9 do not hold (MC + IS unbiased at k = 8)."), text
    # top-K with variance, and a variance at N = 1 inside the seeds' spread of N = 8's
    text = _verdict(
        _stat(
            {
                (0, TOPK, 8, "variance"): [0.0, 1e-9],
                (2, MC, 1, "variance"): [1.0, 2.0],
                (2, MC, 8, "variance"): [0.5, 1.5],
            }
        ),
        ESTIMATORS,
        draws=256,
    )
    assert text.endswith(
        "2 of 9 do not hold (top-K biased without variance at k = 0; more samples cut MC's variance at k = 2)."
    ), text
    assert "k = 0: top-K (student support) at K = 8 has bias² 0.011 ± 0.001 and variance 5e-10 ± 5e-10" in text, text


def test_saved_statistics_read_back_only_for_the_same_settings(tmp_path):
    results = {
        k: [
            {(TOPK, 8): {"bias2": 0.1 * k, "variance": 0.0, "mse": 0.1, "cosine": 0.9}},
            {(TOPK, 8): {"bias2": 0.2, "variance": 0.0, "mse": 0.3, "cosine": 0.8}},
        ]
        for k in LAGS
    }
    path = tmp_path / "statistics.json"
    save_statistics(path, results, QUICK, seeds=2)
    assert load_statistics(path, QUICK, seeds=2) == results
    assert load_statistics(path, FULL, seeds=2) is None and load_statistics(path, QUICK, seeds=3) is None
    assert load_statistics(tmp_path / "missing.json", QUICK, seeds=2) is None


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = get_study("cache_bias_variance")(
        tmp_path / "docs",
        tmp_path / "work",
        quick=True,
        seeds=1,
        command="asyncopd study cache_bias_variance --quick --seeds 1",
    )
    text = path.read_text()
    assert text.startswith("# E3") and "asyncopd study cache_bias_variance --quick --seeds 1" in text
    assert text.count("| top-K, student support") == 4 and "## Verdict" in text
    assert (tmp_path / "docs" / "cache_bias_variance" / "mse_by_budget.png").stat().st_size > 10_000
    # the statistics are saved: the report is rebuilt from them without training or drawing again
    (tmp_path / "docs" / "cache_bias_variance.md").unlink()
    get_study("cache_bias_variance")(
        tmp_path / "docs",
        tmp_path / "nowhere",
        quick=True,
        seeds=1,
        command="asyncopd study cache_bias_variance --quick --seeds 1",
    )
    assert (tmp_path / "docs" / "cache_bias_variance.md").read_text() == text and not (tmp_path / "nowhere").exists()


def test_an_unknown_study_names_the_allowed_ones():
    with pytest.raises(
        ValueError,
        match="unknown study 'e9'; allowed: cache_bias_variance, cross_tokenizer, extrapolation, kl_direction, "
        "rl_staleness, stabilisers, throughput",
    ):
        get_study("e9")
