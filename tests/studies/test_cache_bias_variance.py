"""E3's statistics on synthetic distributions, and the quick study end to end."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from asyncopd_jax import configs
from asyncopd_jax.config import load_config
from asyncopd_jax.studies import get_study
from asyncopd_jax.studies.cache_bias_variance import (
    FORWARD,
    FORWARD_MC,
    FORWARD_RENORMALISED,
    FORWARD_TOPK,
    FULL,
    LAGS,
    QUICK,
    REVERSE,
    SMALL_BUDGETS,
    _forward_verdict,
    _verdict,
    gradient_statistics,
    load_statistics,
    save_statistics,
)
from asyncopd_jax.studies.cache_bias_variance_training import (
    ARMS,
    FULL_TRAINING,
    QUICK_TRAINING,
    REFERENCE,
    training_sets,
    training_verdict,
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


NO_TAIL, K3 = FORWARD[1], FORWARD[4]


def test_the_forward_arms_against_the_exact_forward_gradient():
    """Each forward arm against ∇_z KL(q ‖ softmax z) = softmax z − q: the top-K arms' gradients
    worked out by hand at K = 2, all exact at K = V, MC over teacher samples unbiased with
    variance 1/N. A reverse reference, a support or draws from another policy than the
    teacher, or an arm calling another estimator fails one of these."""
    rng = np.random.default_rng(1)
    P, V, draws = 48, 10, 256
    student, teacher = rng.normal(size=(P, V)) * 1.5, rng.normal(size=(P, V)) * 1.5
    behaviour = student + rng.normal(size=(P, V))  # the forward arms must not read it
    stats = gradient_statistics(
        student, behaviour, teacher, budgets=(2, V), draws=draws, key=jax.random.key(0), names=FORWARD
    )
    assert {name for name, _ in stats} == set(FORWARD)
    pi, q = np.asarray(jax.nn.softmax(student)), np.asarray(jax.nn.softmax(teacher))
    exact = pi - q
    support = np.zeros((P, V), bool)
    np.put_along_axis(support, np.argsort(-teacher, -1)[:, :2], True, -1)
    qs, ps = np.where(support, q, 0), np.where(support, pi, 0)
    q_in, p_in = qs.sum(-1, keepdims=True), ps.sum(-1, keepdims=True)
    by_hand = {  # the gradient of each top-K arm with respect to the student's logits
        FORWARD_TOPK: np.where(support, exact, pi * (1 - (1 - q_in) / (1 - p_in))),  # the tail bucket
        NO_TAIL: q_in * pi - qs,  # −Σ_S q ∇log π
        FORWARD_RENORMALISED: np.where(support, ps / p_in - qs / q_in, 0),
    }
    scale = float(np.mean(np.sum(exact**2, -1)))
    for name, grad in by_hand.items():
        assert stats[name, 2]["bias2"] == pytest.approx(np.mean(np.sum((grad - exact) ** 2, -1)) / scale, rel=1e-4)
        assert stats[name, 2]["variance"] == 0 and stats[name, 2]["bias2"] > 1e-3, name
        assert stats[name, V]["mse"] < 1e-8 and stats[name, V]["cosine"] > 0.9999, name  # K = V: exact
    assert stats[FORWARD_TOPK, 2]["teacher_tail"] == pytest.approx(float(np.mean(1 - q_in)), rel=1e-5)
    assert stats[FORWARD_TOPK, V]["teacher_tail"] == pytest.approx(0.0, abs=1e-6)
    assert stats[FORWARD_TOPK, 2]["support_fraction"] == pytest.approx(0.2)
    # MC over teacher samples (and its k3 form): unbiased, its bias² the draws' noise; variance ∝ 1/N
    for name in (FORWARD_MC, K3):
        for n in (2, V):
            assert abs(stats[name, n]["bias2"]) < 4 * stats[name, n]["variance"] / draws, (name, n)
    assert 3.5 < stats[FORWARD_MC, 2]["variance"] / stats[FORWARD_MC, V]["variance"] < 6.5
    # k3 adds (r − 1): the same mean, more variance where the student has mass the teacher has not
    assert stats[K3, 2]["variance"] > 3 * stats[FORWARD_MC, 2]["variance"]


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


def _forward_stat(overrides=None):
    """``stat`` for the forward arms over two seeds: top-K biased without variance, renormalised
    less biased, MC unbiased, unless ``overrides[(k, name, budget, field)]`` says otherwise."""

    def stat(k, name, budget, field):
        if (k, name, budget, field) in (overrides or {}):
            return overrides[k, name, budget, field]
        values = {
            FORWARD_TOPK: {"bias2": [0.1, 0.12], "variance": [0.0, 0.0], "mse": [0.1, 0.12]},
            FORWARD_RENORMALISED: {"bias2": [0.05, 0.06], "variance": [0.0, 0.0], "mse": [0.05, 0.06]},
            FORWARD_MC: {"bias2": [0.001, -0.001], "variance": [2.0 / budget, 2.2 / budget], "mse": [1.0, 1.1]},
        }[name]
        return values.get(field, {"teacher_tail": [0.3, 0.32], "support_fraction": [budget / 32] * 2}.get(field))

    return stat


def test_the_forward_verdict_follows_its_three_rules():
    text = _forward_verdict(_forward_stat(), draws=256)
    assert text.endswith(
        "Verdict: top-K biased without variance: holds at every k and small K; renormalisation reduces top-K's "
        "bias: holds at every k and small K; MC removes the bias: holds at every k and small K."
    ), text
    assert "K = 2 (K/V = 0.0625, teacher mass outside 0.31 ± 0.01): bias² top-K 0.11 ± 0.01" in text, text
    # renormalised above top-K on one seed at (k = 2, K = 1); MC's bias² above its noise at (k = 8, K = 4)
    text = _forward_verdict(
        _forward_stat({(2, FORWARD_RENORMALISED, 1, "bias2"): [0.05, 0.2], (8, FORWARD_MC, 4, "bias2"): [0.01, 0.0]}),
        draws=256,
    )
    assert "renormalisation reduces top-K's bias: holds at 8 of 9, not at (k = 2, K = 1);" in text, text
    assert text.endswith("MC removes the bias: holds at 8 of 9, not at (k = 8, K = 4)."), text
    everywhere = {(k, FORWARD_TOPK, b, "variance"): [0.0, 1e-9] for k in LAGS for b in SMALL_BUDGETS}
    assert "top-K biased without variance: holds nowhere;" in _forward_verdict(_forward_stat(everywhere), draws=256)


def test_the_training_arms_run_what_they_name():
    """Every arm's overrides make a valid config with that estimator, the cache it reads, the
    staleness bound η of the fully asynchronous schedule, and nothing of fixed_lag."""
    assert FULL_TRAINING.arms[0] == QUICK_TRAINING.arms[0] == REFERENCE == "forward_kl_dense"
    assert FULL_TRAINING.etas == (0, 2, 4) and "forward_kl_topk" in FULL_TRAINING.arms
    assert set(QUICK_TRAINING.arms) == set(ARMS)
    for arm in ARMS:
        cfg = load_config(configs.DEMO, training_sets(arm, 4, 1, QUICK_TRAINING))
        assert cfg.estimator.name == arm and cfg.seed == 1 and cfg.train.steps == QUICK_TRAINING.steps
        assert (cfg.schedule.mode, cfg.schedule.max_staleness) == ("fully_async", 4)
        assert (cfg.teacher.payload == "hidden") == (arm == REFERENCE)
        assert cfg.scoring.num_samples == (8 if arm == "forward_kl_mc" else 0)
        assert not any(x.startswith("schedule.lag") for x in training_sets(arm, 4, 1, QUICK_TRAINING))


def test_the_training_verdict_compares_each_arm_with_the_dense_reference():
    s = dataclasses.replace(FULL_TRAINING, arms=tuple(ARMS))
    accuracies = {(arm, eta): [0.5, 0.6] for arm in s.arms for eta in s.etas}
    before = 0.04
    text = training_verdict(lambda arm, eta: accuracies[arm, eta], s, before)
    assert text.endswith("Verdict: every cache arm ends within the seeds' spread of the dense reference at every η.")
    accuracies["forward_kl_topk", 2] = [0.3, 0.35]  # below the reference by more than the spread
    accuracies["forward_kl_mc", 0] = [0.5, 0.7]  # above it by less than the spread: within
    accuracies["forward_kl_topk_renormalized", 4] = [0.47, 0.49]  # 7 points below: more than the spread
    text = training_verdict(lambda arm, eta: accuracies[arm, eta], s, before)
    assert "forward_kl_topk 32.5 ± 2.5 % (below the reference, -22.5)" in text, text
    assert "forward_kl_mc 60 ± 10 % (within the seeds' spread, +5.0)" in text, text
    assert text.endswith(
        "Verdict: 2 of 9 arm-η pairs end outside it (forward_kl_topk at η = 2; forward_kl_topk_renormalized at η = 4)."
    ), text
    accuracies[REFERENCE, 0] = [0.05, 0.1]  # the reference does not train at η = 0
    text = training_verdict(lambda arm, eta: accuracies[arm, eta], s, before)
    assert "η = 0: no comparison, the reference ends at 7.5 ± 2.5 %" in text, text


def test_saved_statistics_read_back_only_for_the_same_settings(tmp_path):
    def stats(k, seed):
        values = {"bias2": 0.1 * k + seed, "variance": 0.0, "mse": 0.1, "cosine": 0.9}
        return {
            (name, 8): {**values, **({"teacher_tail": 0.2} if name in FORWARD else {})} for name in REVERSE + FORWARD
        }

    results = {k: [stats(k, 0), stats(k, 1)] for k in LAGS}
    path = tmp_path / "statistics.json"
    save_statistics(path, results, QUICK, seeds=2)
    assert load_statistics(path, QUICK, seeds=2) == results
    assert load_statistics(path, FULL, seeds=2) is None and load_statistics(path, QUICK, seeds=3) is None
    assert load_statistics(tmp_path / "missing.json", QUICK, seeds=2) is None
    # statistics measured before the forward arms existed are measured again
    save_statistics(
        path,
        {k: [{key: v for key, v in r.items() if key[0] in REVERSE} for r in results[k]] for k in LAGS},
        QUICK,
        seeds=2,
    )
    assert load_statistics(path, QUICK, seeds=2) is None


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
    assert text.count("| top-K, student support") == 4 and "## Verdict (reverse KL)" in text
    # the forward arms: 3 MSE tables and 4 of bias² and variance, the mass outside the top-K, the verdict
    assert text.count("| top-K renormalised (`forward_kl_topk_renormalized`) |") == 7, text
    assert "| teacher mass outside top-K, k = 8 |" in text and "| K / V | 0.0312 |" in text
    assert "## Verdict (forward KL, per gradient)" in text and "none is claimed" in text
    # the training arms: every arm at every η, and the verdict on them
    for arm in QUICK_TRAINING.arms:
        assert f"| {arm} |" in text and f'"{arm}": [' in text
    assert "Training verdict" in text and "Runs that stopped with an error" not in text
    for png in ("mse_by_budget.png", "forward_mse_by_budget.png"):
        assert (tmp_path / "docs" / "cache_bias_variance" / png).stat().st_size > 10_000
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
        match="unknown study 'e9'; allowed: cache_bias_variance, cross_tokenizer, extrapolation, kl_direction, lora, "
        "multi_turn, rl_staleness, stabilisers, throughput",
    ):
        get_study("e9")
