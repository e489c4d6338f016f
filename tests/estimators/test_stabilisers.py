"""Stabilisers against NumPy oracles, in value and gradient, on [B, T] and [B, T, N]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.estimators import (
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    m2po_mask,
    ppo_clip_loss,
    second_moment_clip_loss,
    second_moment_clip_range,
    truncated_is_loss,
)
from tests.estimators import oracle


def _problem(shape, seed=0, spread=0.5):
    rng = np.random.default_rng(seed)
    behavior = np.log(rng.uniform(0.05, 0.9, size=shape)).astype(np.float32)
    logp = (behavior + rng.normal(scale=spread, size=shape)).astype(np.float32)
    adv = rng.normal(size=shape).astype(np.float32)
    return logp, behavior, adv


SHAPES = [(3, 5), (3, 5, 4)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_value_and_gradient(shape, dual_clip):
    logp, behavior, adv = _problem(shape)
    loss, grad = jax.value_and_grad(
        lambda lp: ppo_clip_loss(lp, behavior, adv, clip_eps=(0.2, 0.28), dual_clip=dual_clip).sum()
    )(logp)
    per = ppo_clip_loss(logp, behavior, adv, clip_eps=(0.2, 0.28), dual_clip=dual_clip)
    want = oracle.ppo_clip(logp, behavior, adv, 0.8, 1.28, dual_clip)
    assert per.shape == shape
    np.testing.assert_allclose(per, want, rtol=1e-5, atol=1e-6)
    # Gradient: −A r where the unclipped term is active, 0 where a clip binds.
    r = np.exp(logp.astype(np.float64) - behavior)
    active = np.isclose(want, -adv * r, rtol=1e-6) & ~((r < 0.8) & (adv < 0)) & ~((r > 1.28) & (adv > 0))
    np.testing.assert_allclose(grad, np.where(active, -adv * r, 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_decoupled_ppo_weights_and_masks(shape):
    logp, behavior, adv = _problem(shape, seed=1, spread=1.0)
    proximal = (logp - 0.1).astype(np.float32)
    per = decoupled_ppo_loss(logp, proximal, behavior, adv, clip_eps=0.2, behavior_weight_cap=2.0)
    weight = np.exp(proximal.astype(np.float64) - behavior)
    want = weight * oracle.ppo_clip(logp, proximal, adv, 0.8, 1.2)
    want = np.where(weight <= 2.0, want, 0.0)
    assert (weight > 2.0).any() and (weight <= 2.0).any()  # both branches exercised
    np.testing.assert_allclose(per, want, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda lp: decoupled_ppo_loss(lp, proximal, behavior, adv, behavior_weight_cap=2.0).sum())(logp)
    np.testing.assert_array_equal(np.asarray(grad)[weight > 2.0], 0.0)
    # Defaults: the behaviour weight is capped at 5 (weights of 4.5, 5.5 and 6.5 placed on
    # three tokens); with a dual clip c, the oracle's.
    near_cap = proximal.copy().reshape(-1)
    near_cap[:3] = behavior.reshape(-1)[:3] + np.log([4.5, 5.5, 6.5])
    near_cap = near_cap.reshape(proximal.shape)
    w = np.exp(near_cap.astype(np.float64) - behavior)
    default = np.where(w <= 5.0, w * oracle.ppo_clip(logp, near_cap, adv, 0.8, 1.2), 0.0)
    np.testing.assert_allclose(decoupled_ppo_loss(logp, near_cap, behavior, adv), default, rtol=1e-5, atol=1e-6)
    dual = decoupled_ppo_loss(logp, proximal, behavior, adv, dual_clip=1.1, behavior_weight_cap=None)
    np.testing.assert_allclose(dual, weight * oracle.ppo_clip(logp, proximal, adv, 0.8, 1.2, 1.1), rtol=1e-5, atol=1e-6)
    assert not np.allclose(dual, weight * oracle.ppo_clip(logp, proximal, adv, 0.8, 1.2))  # the dual clip binds
    # No gradient flows into the proximal or behaviour log-probs.
    g_prox = jax.grad(lambda p: decoupled_ppo_loss(logp, p, behavior, adv).sum())(proximal)
    np.testing.assert_array_equal(g_prox, 0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_truncated_is(shape):
    logp, behavior, adv = _problem(shape, seed=2, spread=1.0)
    loss_fn = lambda lp: truncated_is_loss(lp, behavior, adv, cap=1.5)  # noqa: E731
    weight = np.minimum(np.exp(logp.astype(np.float64) - behavior), 1.5)
    np.testing.assert_allclose(loss_fn(logp), -adv * weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: loss_fn(lp).sum())(logp), -adv * weight, rtol=1e-5, atol=1e-6)
    # The default cap is c = 2; any c > 0 is allowed, also below 1.
    default = np.minimum(np.exp(logp.astype(np.float64) - behavior), 2.0)
    np.testing.assert_allclose(truncated_is_loss(logp, behavior, adv), -adv * default, rtol=1e-5, atol=1e-6)
    small = np.minimum(np.exp(logp.astype(np.float64) - behavior), 0.5)
    np.testing.assert_allclose(truncated_is_loss(logp, behavior, adv, cap=0.5), -adv * small, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("budget", [0.01, 0.04, 10.0])
def test_second_moment_clip_range_matches_bisection(shape, budget):
    logp, behavior, adv = _problem(shape, seed=3, spread=0.4)
    mask = np.random.default_rng(4).uniform(size=shape) > 0.2
    tau = jax.jit(lambda *a: second_moment_clip_range(*a, second_moment_budget=budget))(logp, behavior, adv, mask)
    want = oracle.second_moment_clip_tau(logp, behavior, adv, mask, budget)
    if np.isinf(want):
        assert np.isinf(tau)
    else:
        np.testing.assert_allclose(tau, want, rtol=1e-4)
        # The defining property, checked directly.
        delta = (behavior - logp)[(mask > 0) & (adv * (behavior - logp) > 0)]
        np.testing.assert_allclose(np.mean(np.minimum(delta**2, float(tau) ** 2)), budget, rtol=1e-3)


def test_second_moment_clip_loss_uses_adaptive_range_with_floors():
    logp, behavior, adv = _problem((4, 16), seed=5, spread=1.0)
    mask = np.ones_like(logp, bool)
    tau = float(second_moment_clip_range(logp, behavior, adv, mask, second_moment_budget=0.04))
    low, high = min(np.exp(-tau), 0.7), max(np.exp(tau), 1.5)
    got = jax.jit(lambda *a: second_moment_clip_loss(*a))(logp, behavior, adv, mask)
    np.testing.assert_allclose(got, oracle.ppo_clip(logp, behavior, adv, low, high), rtol=1e-5, atol=1e-6)


def test_second_moment_clip_with_empty_mask_does_not_clip_and_is_finite():
    logp, behavior, adv = _problem((2, 3), seed=6)
    mask = np.zeros_like(logp, bool)
    assert np.isinf(second_moment_clip_range(logp, behavior, adv, mask))
    loss, grad = jax.value_and_grad(lambda lp: second_moment_clip_loss(lp, behavior, adv, mask).sum())(logp)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    r = np.exp(logp.astype(np.float64) - behavior)
    np.testing.assert_allclose(second_moment_clip_loss(logp, behavior, adv, mask), -adv * r, rtol=1e-5, atol=1e-6)


def test_bad_clip_arguments_raise():
    logp, behavior, adv = _problem((2, 3))
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_clip_loss(logp, behavior, adv, clip_eps=1.5)
    for dual in (0.5, 1.0):  # the dual clip bounds a loss from below only above 1
        with pytest.raises(ValueError, match="dual_clip"):
            ppo_clip_loss(logp, behavior, adv, dual_clip=dual)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_clip_loss(logp, behavior, adv, clip_eps=(1.0, 0.2))  # 1 − ε_low must stay > 0
    with pytest.raises(ValueError, match="cap"):
        truncated_is_loss(logp, behavior, adv, cap=0.0)
    assert jnp.all(jnp.isfinite(ppo_clip_loss(logp, behavior, adv)))
    # ε_low = 0 (no lower clip) is allowed: the ratio is clipped at 1 from below.
    np.testing.assert_allclose(
        ppo_clip_loss(logp, behavior, adv, clip_eps=(0.0, 0.2)),
        oracle.ppo_clip(logp, behavior, adv, 1.0, 1.2),
        rtol=1e-5,
        atol=1e-6,
    )
    # and ε_high = 0: clipped at 1 from above
    np.testing.assert_allclose(
        ppo_clip_loss(logp, behavior, adv, clip_eps=(0.2, 0.0)),
        oracle.ppo_clip(logp, behavior, adv, 0.8, 1.0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_second_moment_clip_loss_with_a_wide_adaptive_range_and_dual_clip():
    """A budget large enough that τ exceeds both margins: the adaptive bounds e^∓τ, not the
    floors, set the range; the budget and the dual clip are passed through."""
    logp, behavior, adv = _problem((4, 16), seed=7, spread=1.5)
    mask = np.ones_like(logp, bool)
    tau = float(second_moment_clip_range(logp, behavior, adv, mask, second_moment_budget=0.5))
    assert np.isfinite(tau) and np.exp(-tau) < 0.7 and np.exp(tau) > 1.5
    got = second_moment_clip_loss(logp, behavior, adv, mask, second_moment_budget=0.5, dual_clip=3.0)
    want = oracle.ppo_clip(logp, behavior, adv, np.exp(-tau), np.exp(tau), dual_clip=3.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    r = np.exp(logp.astype(np.float64) - behavior)
    assert ((r < np.exp(-tau)) & (adv < 0)).any() or ((r > np.exp(tau)) & (adv > 0)).any()  # a bound binds
    assert ((adv < 0) & (r > 3.0)).any()  # the dual clip binds


def test_decoupled_ppo_keeps_a_token_whose_weight_equals_the_cap():
    logp, behavior, adv = _problem((2, 3), seed=8)
    at_cap = decoupled_ppo_loss(logp, behavior, behavior, adv, behavior_weight_cap=1.0)  # π_prox = μ: w = 1
    np.testing.assert_allclose(at_cap, oracle.ppo_clip(logp, behavior, adv, 0.8, 1.2), rtol=1e-5, atol=1e-6)


def test_second_moment_clip_range_default_budget_is_0_04():
    logp, behavior, adv = _problem((4, 16), seed=5, spread=1.0)
    mask = np.ones_like(logp, bool)
    np.testing.assert_array_equal(
        second_moment_clip_range(logp, behavior, adv, mask),
        second_moment_clip_range(logp, behavior, adv, mask, second_moment_budget=0.04),
    )
    assert np.isfinite(second_moment_clip_range(logp, behavior, adv, mask))


def test_second_moment_clip_range_ignores_tokens_whose_ratio_has_not_moved():
    """δ = 0 (π_θ = μ) or A = 0: nothing to clip; such tokens must not dilute the mean."""
    logp, behavior, adv = _problem((4, 16), seed=9, spread=1.0)
    mask = np.ones_like(logp, bool)
    still = logp.copy()
    still[0] = behavior[0]  # row 0: ratio exactly 1
    adv_zero = adv.copy()
    adv_zero[1] = 0.0  # row 1: no advantage
    without = mask.copy()
    without[:2] = False
    want = second_moment_clip_range(still, behavior, adv_zero, without, second_moment_budget=0.1)
    assert np.isfinite(want)
    np.testing.assert_array_equal(
        second_moment_clip_range(still, behavior, adv_zero, mask, second_moment_budget=0.1), want
    )


def test_second_moment_clip_range_matches_bisection_on_many_random_problems():
    threshold = jax.jit(lambda lp, mu, a, m, b: second_moment_clip_range(lp, mu, a, m, second_moment_budget=b))
    rng = np.random.default_rng(10)
    for seed in range(40):
        logp, behavior, adv = _problem((3, 7), seed=100 + seed, spread=rng.uniform(0.2, 1.5))
        mask = rng.uniform(size=logp.shape) > 0.3
        budget = float(rng.choice([0.01, 0.05, 0.2, 0.5]))
        got, want = (
            float(threshold(logp, behavior, adv, mask, budget)),
            oracle.second_moment_clip_tau(logp, behavior, adv, mask, budget),
        )
        if np.isinf(want):
            assert np.isinf(got), seed
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=str(seed))


def test_second_moment_clip_range_edge_cases():
    def tau(delta, adv, mask=None, budget=0.25):
        delta, adv = np.asarray(delta, np.float32)[None], np.asarray(adv, np.float32)[None]  # [1, T]
        mask = np.ones(delta.shape, bool) if mask is None else np.asarray(mask)[None]
        return float(second_moment_clip_range(-delta, np.zeros_like(delta), adv, mask, second_moment_budget=budget))

    # Exactly at the budget (δ² = 0.25 = budget on every selected token): nothing to clip.
    assert np.isinf(tau([0.5, -0.5, 0.5], [1.0, -1.0, 1.0]))
    # A single selected token over budget: τ² = budget.
    np.testing.assert_allclose(tau([2.0, 0.3], [1.0, -1.0]), 0.5, rtol=1e-6)
    # Selected tokens within budget, many unselected ones: +inf (the unselected do not count).
    assert np.isinf(tau([0.4, 0.4] + [0.3] * 10, [1.0, 1.0] + [-1.0] * 10))


# M2PO (the paper's rule): a token mask, batch-global, no clipping.


def _m2po_problem(shape, seed, spread, ties=False):
    logp, behavior, adv = _problem(shape, seed=seed, spread=spread)
    if ties:  # log-ratios on a coarse grid: many equal δ², also at the boundary (grids exact in fp32, so the
        # fp32 differences are the exact ones the float64 oracle sees)
        behavior = (np.round(behavior * 64) / 64).astype(np.float32)
        logp = (behavior + np.round((logp - behavior) * 4) / 4).astype(np.float32)
    mask = np.random.default_rng(seed + 1).uniform(size=shape) > 0.25
    return logp, behavior, adv, mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("budget", [0.0, 0.01, 0.04, 0.3, 100.0])
@pytest.mark.parametrize("ties", [False, True])
def test_m2po_mask_removes_the_largest_squared_log_ratios_as_the_paper_does(shape, budget, ties):
    logp, behavior, adv, mask = _m2po_problem(shape, seed=11, spread=0.4, ties=ties)
    got = np.asarray(jax.jit(lambda *a: m2po_mask(*a, second_moment_budget=budget))(logp, behavior, mask))
    want = oracle.m2po_mask(logp, behavior, mask, budget)
    np.testing.assert_array_equal(got, want)
    assert not (got & ~mask).any()  # padding is never kept


def test_m2po_mask_matches_the_paper_on_many_random_problems():
    masker = jax.jit(lambda lp, mu, m, b: m2po_mask(lp, mu, m, second_moment_budget=b))
    rng = np.random.default_rng(12)
    kept_some = removed_some = 0
    for seed in range(40):
        logp, behavior, _, mask = _m2po_problem(
            (3, 9), seed=200 + seed, spread=rng.uniform(0.05, 1.0), ties=seed % 2 == 0
        )
        budget = float(rng.choice([0.01, 0.04, 0.2]))
        got = np.asarray(masker(logp, behavior, mask, budget))
        np.testing.assert_array_equal(got, oracle.m2po_mask(logp, behavior, mask, budget), err_msg=str(seed))
        kept_some += got.any()
        removed_some += (mask & ~got).any()
    assert kept_some > 20 and removed_some > 20  # both regimes exercised


def test_m2po_mask_defining_property_and_default_budget():
    logp, behavior, _, mask = _m2po_problem((4, 32), seed=13, spread=0.3)
    keep = np.asarray(m2po_mask(logp, behavior, mask))
    np.testing.assert_array_equal(keep, np.asarray(m2po_mask(logp, behavior, mask, second_moment_budget=0.04)))
    sq = (logp.astype(np.float64) - behavior) ** 2
    assert 0 < keep.sum() < mask.sum()
    assert sq[keep].mean() <= 0.04
    # every removed valid token has a larger δ² than every kept one, and keeping the smallest removed
    # one as well would break the budget
    removed = mask & ~keep
    assert sq[removed].min() >= sq[keep].max()
    assert np.append(sq[keep], sq[removed].min()).mean() > 0.04


def test_m2po_loss_is_the_unclipped_importance_weighted_gradient_on_kept_tokens():
    logp, behavior, adv, mask = _m2po_problem((4, 16), seed=14, spread=0.5)
    keep = oracle.m2po_mask(logp, behavior, mask, 0.1)
    loss_fn = lambda lp: m2po_loss(lp, behavior, adv, mask, second_moment_budget=0.1)  # noqa: E731
    r = np.exp(logp.astype(np.float64) - behavior)
    np.testing.assert_allclose(loss_fn(logp), np.where(keep, -adv * r, 0.0), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda lp: loss_fn(lp).sum())(logp)
    np.testing.assert_allclose(grad, np.where(keep, -adv * r, 0.0), rtol=1e-5, atol=1e-6)
    # nothing is clipped: kept ratios outside PPO's [0.8, 1.2] still carry their full gradient
    assert (keep & ((r < 0.8) | (r > 1.2)) & (adv != 0)).any()
    # the advantages and the behaviour log-probs get no gradient
    for index in (1, 2):
        args = [logp, behavior, adv]
        g = jax.grad(lambda x: m2po_loss(*[x if i == index else a for i, a in enumerate(args)], mask).sum())(
            args[index]
        )
        np.testing.assert_array_equal(g, 0.0)


def test_m2po_is_batch_global_with_axis_name():
    """Split over 4 devices (vmap with an axis name, as shard_map names its mesh axis), each
    device keeps exactly the tokens the whole batch keeps; without the axis each device would
    use its own budget."""
    logp, behavior, adv, mask = _m2po_problem((8, 12), seed=15, spread=0.35)
    whole = oracle.m2po_mask(logp, behavior, mask, 0.04)
    split = [x.reshape(4, 2, 12) for x in (logp, behavior, mask)]
    got = jax.vmap(lambda lp, mu, m: m2po_mask(lp, mu, m, axis_name="data"), axis_name="data")(*split)
    np.testing.assert_array_equal(np.asarray(got).reshape(8, 12), whole)
    alone = jax.vmap(lambda lp, mu, m: m2po_mask(lp, mu, m))(*split)
    assert not np.array_equal(np.asarray(alone).reshape(8, 12), whole)
    loss = jax.vmap(lambda lp, mu, a, m: m2po_loss(lp, mu, a, m, axis_name="data"), axis_name="data")(
        *split[:2], adv.reshape(4, 2, 12), split[2]
    )
    np.testing.assert_allclose(np.asarray(loss).reshape(8, 12), m2po_loss(logp, behavior, adv, mask), rtol=1e-6)


def test_m2po_edge_cases():
    zeros = np.zeros((2, 3), np.float32)
    assert not np.asarray(m2po_mask(zeros, zeros, np.zeros((2, 3), bool))).any()  # no valid token
    assert np.asarray(m2po_mask(zeros, zeros, np.ones((2, 3), bool), second_moment_budget=0.0)).all()  # δ = 0
    far = np.full((2, 3), -1.0, np.float32)  # every δ² = 1 > budget: nothing kept
    assert not np.asarray(m2po_mask(far, zeros, np.ones((2, 3), bool))).any()
    # exactly at the budget: kept (M₂ ≤ τ)
    at = np.full((2, 3), -0.5, np.float32)
    assert np.asarray(m2po_mask(at, zeros, np.ones((2, 3), bool), second_moment_budget=0.25)).all()
    with pytest.raises(ValueError, match="second_moment_budget must be >= 0"):
        m2po_mask(zeros, zeros, np.ones((2, 3), bool), second_moment_budget=-1.0)


# GSPO and decoupled PPO's truncate mode and floor.


def _gspo_problem(seed, spread=0.02, sequence_advantage=False):
    logp, behavior, adv = _problem((5, 7), seed=seed, spread=spread)
    mask = np.arange(7)[None, :] < np.array([7, 3, 5, 1, 6])[:, None]
    if sequence_advantage:
        adv = np.broadcast_to(adv[:, :1], adv.shape).copy()
    return logp, behavior, adv, mask


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_gspo_value_and_gradient(level):
    logp, behavior, adv, mask = _gspo_problem(20)
    loss_fn = lambda lp: gspo_loss(lp, behavior, adv, mask, clip_eps=(0.01, 0.02), level=level)  # noqa: E731
    want, want_grad = oracle.gspo(logp, behavior, adv, mask, 0.99, 1.02, level)
    np.testing.assert_allclose(loss_fn(logp), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: loss_fn(lp).sum())(logp), want_grad, rtol=1e-4, atol=1e-6)
    s = np.exp([(m * (lp - mu)).sum() / m.sum() for lp, mu, m in zip(logp.astype(np.float64), behavior, mask)])
    assert ((s < 0.99) | (s > 1.02)).any() and ((s > 0.99) & (s < 1.02)).any()  # clipped and unclipped rows


def test_gspo_token_equals_gspo_with_a_sequence_advantage_and_defaults_to_the_papers_clip():
    logp, behavior, adv, mask = _gspo_problem(21, spread=0.001, sequence_advantage=True)
    seq, tok = (
        jax.value_and_grad(lambda lp: gspo_loss(lp, behavior, adv, mask, level=level).sum())(logp)
        for level in ("sequence", "token")
    )
    np.testing.assert_allclose(seq[0], tok[0], rtol=1e-6)
    np.testing.assert_allclose(seq[1], tok[1], rtol=1e-5, atol=1e-7)
    want, _ = oracle.gspo(logp, behavior, adv, mask, 1 - 3e-4, 1 + 4e-4, "sequence")
    np.testing.assert_allclose(gspo_loss(logp, behavior, adv, mask), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="level = 'row' is invalid; allowed: sequence, token"):
        gspo_loss(logp, behavior, adv, mask, level="row")


def test_decoupled_ppo_truncate_mode_clamps_the_behaviour_weight():
    logp, behavior, adv = _problem((3, 5, 4), seed=22, spread=1.0)
    proximal = (logp - 0.1).astype(np.float32)
    weight = np.exp(proximal.astype(np.float64) - behavior)
    assert (weight > 2.0).any() and (weight <= 2.0).any()
    got = decoupled_ppo_loss(logp, proximal, behavior, adv, behavior_weight_cap=2.0, behavior_weight_mode="truncate")
    np.testing.assert_allclose(
        got, np.minimum(weight, 2.0) * oracle.ppo_clip(logp, proximal, adv, 0.8, 1.2), rtol=1e-5, atol=1e-6
    )
    grad = jax.grad(
        lambda lp: decoupled_ppo_loss(
            lp, proximal, behavior, adv, behavior_weight_cap=2.0, behavior_weight_mode="truncate"
        ).sum()
    )(logp)
    assert np.all(np.asarray(grad)[(weight > 2.0) & (np.abs(adv) > 0.5)] != 0)  # the capped tokens still train
    with pytest.raises(ValueError, match="behavior_weight_mode = 'clip' is invalid; allowed: mask, truncate"):
        decoupled_ppo_loss(logp, proximal, behavior, adv, behavior_weight_mode="clip")


@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_decoupled_ppo_floor_masks_tokens_whose_weight_is_too_small(mode):
    logp, behavior, adv = _problem((3, 5, 4), seed=23, spread=1.0)
    proximal = (behavior + np.random.default_rng(24).normal(scale=1.0, size=behavior.shape)).astype(np.float32)
    weight = np.exp(proximal.astype(np.float64) - behavior)
    got = decoupled_ppo_loss(
        logp, proximal, behavior, adv, behavior_weight_cap=3.0, behavior_weight_mode=mode, behavior_weight_floor=0.5
    )
    capped = np.minimum(weight, 3.0) if mode == "truncate" else np.where(weight <= 3.0, weight, 0.0)
    want = np.where(weight >= 0.5, capped * oracle.ppo_clip(logp, proximal, adv, 0.8, 1.2), 0.0)
    assert (weight < 0.5).any() and (weight > 3.0).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="behavior_weight_floor = 4.0 is invalid"):
        decoupled_ppo_loss(logp, proximal, behavior, adv, behavior_weight_cap=3.0, behavior_weight_floor=4.0)


def test_second_moment_clip_is_batch_global_with_axis_name():
    logp, behavior, adv = _problem((8, 12), seed=31, spread=0.6)
    mask = np.random.default_rng(32).uniform(size=logp.shape) > 0.2
    whole = float(second_moment_clip_range(logp, behavior, adv, mask))
    split = [x.reshape(4, 2, 12) for x in (logp, behavior, adv, mask)]
    got = jax.vmap(lambda *a: second_moment_clip_range(*a, axis_name="data"), axis_name="data")(*split)
    np.testing.assert_allclose(got, np.full(4, whole), rtol=1e-6)
    assert np.isfinite(whole) and not np.allclose(jax.vmap(second_moment_clip_range)(*split), whole)
    loss = jax.vmap(lambda *a: second_moment_clip_loss(*a, axis_name="data"), axis_name="data")(*split)
    np.testing.assert_allclose(
        np.asarray(loss).reshape(8, 12), second_moment_clip_loss(logp, behavior, adv, mask), rtol=1e-6
    )


def test_second_moment_clip_loss_counts_nonfinite_inputs_outside_the_mask_as_zero():
    """Its loss is on every token (the mask chooses the clip range only); a NaN or inf input
    at a position the mask leaves out counts as 0 there: the loss is that of zero inputs,
    finite, and the other positions and the gradient are as with clean inputs."""
    rng = np.random.default_rng(7)
    logp = jnp.asarray(rng.normal(scale=0.1, size=(3, 5)) - 1.0, jnp.float32)
    behavior = jnp.asarray(rng.normal(scale=0.1, size=(3, 5)) - 1.0, jnp.float32)
    adv = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.ones((3, 5), bool).at[1, 4].set(False).at[2, 3].set(False)
    poisoned = [x.at[1, 4].set(jnp.nan).at[2, 3].set(jnp.inf) for x in (logp, behavior, adv)]
    zeroed = [x.at[1, 4].set(0.0).at[2, 3].set(0.0) for x in (logp, behavior, adv)]
    got = second_moment_clip_loss(*poisoned, mask)
    np.testing.assert_allclose(got, second_moment_clip_loss(*zeroed, mask), rtol=1e-6)
    assert float(got[1, 4]) == 0.0 and float(got[2, 3]) == 0.0  # zero advantage: zero loss
    grad = jax.grad(lambda lp: second_moment_clip_loss(lp, *poisoned[1:], mask).sum())(poisoned[0])
    assert np.isfinite(np.asarray(grad)).all()
