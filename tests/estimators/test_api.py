"""Properties every public estimator keeps: zero at student = teacher, jit, vmap, bf16."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asyncopd_jax.estimators as est

B, T, V, N = 2, 4, 9, 5


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    student_logits = rng.normal(scale=2.0, size=(B, T, V)).astype(np.float32)
    teacher_logits = rng.normal(scale=2.0, size=(B, T, V)).astype(np.float32)
    behavior_logits = (student_logits + rng.normal(size=(B, T, V))).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T, N))
    return student_logits, teacher_logits, behavior_logits, ids


def _support(ids):
    """Distinct ids per position derived from the random ids: (ids[..., 0] + k) mod V."""
    return (ids[..., :1] + jnp.arange(N)) % V


def _estimators() -> dict[str, Callable]:
    """Each entry maps (student_logits, teacher_logits, behavior_logits, ids) → [B, T]."""
    g = est.gather_logprobs

    def mc(**kw):
        return lambda s, q, mu, ids: est.reverse_kl_mc(g(s, ids), g(mu, ids), g(q, ids), **kw)

    def stabiliser(fn, **kw):
        # OPD reward on the candidates: the recomputed signal log q − log π_θ.
        def run(s, q, mu, ids):
            lp = g(s, ids)
            return jnp.mean(fn(lp, g(mu, ids), jax.lax.stop_gradient(g(q, ids) - lp), **kw), axis=-1)

        return run

    def decoupled(s, q, mu, ids):
        lp = g(s, ids)
        prox = jax.lax.stop_gradient(lp)
        return jnp.mean(est.decoupled_ppo_loss(lp, prox, g(mu, ids), jax.lax.stop_gradient(g(q, ids) - lp)), -1)

    def batch_masked(fn):
        def run(s, q, mu, ids):
            lp = g(s, ids)
            adv = jax.lax.stop_gradient(g(q, ids) - lp)
            return jnp.mean(fn(lp, g(mu, ids), adv, jnp.ones(ids.shape, bool)), -1)

        return run

    def hybrid(s, q, mu, ids):
        support = _support(ids)[..., :3]  # some candidates fall inside it, some outside
        return est.reverse_kl_hybrid(g(s, support), g(q, support), support, g(s, ids), g(mu, ids), g(q, ids), ids)

    return {
        "forward_kl_dense": lambda s, q, mu, ids: est.forward_kl_dense(s, q),
        "reverse_kl_dense": lambda s, q, mu, ids: est.reverse_kl_dense(s, q),
        # Top-K supports are distinct ids: the first K of a random permutation.
        "forward_kl_topk": lambda s, q, mu, ids: est.forward_kl_topk(g(s, _support(ids)), g(q, _support(ids))),
        "forward_kl_topk_renormalized": lambda s, q, mu, ids: est.forward_kl_topk_renormalized(
            g(s, _support(ids)), g(q, _support(ids))
        ),
        "reverse_kl_topk": lambda s, q, mu, ids: est.reverse_kl_topk(g(s, _support(ids)), g(q, _support(ids))),
        # The plain forward MC gradient is 0 only in expectation (see test_forward_kl).
        "forward_kl_mc": lambda s, q, mu, ids: est.forward_kl_mc(g(s, ids), g(q, ids), control_variate=True),
        "reverse_kl_mc": mc(),
        "reverse_kl_mc_clipped": mc(clip_eps=0.2),
        "reverse_kl_mc_no_is": mc(importance_sampling=False),
        "reverse_kl_mc_loo": lambda s, q, mu, ids: est.reverse_kl_mc_loo(g(s, ids), g(mu, ids), g(q, ids)),
        "reverse_kl_hybrid": hybrid,
        "ppo_clip": stabiliser(est.ppo_clip_loss, dual_clip=3.0),
        "truncated_is": stabiliser(est.truncated_is_loss),
        "decoupled_ppo": decoupled,
        # a budget that keeps some candidates and removes others
        "m2po": batch_masked(lambda *a: est.m2po_loss(*a, second_moment_budget=0.5)),
        "second_moment_clip": batch_masked(est.second_moment_clip_loss),
        # on the first candidate as the emitted token: GSPO's ratio is over a response's tokens
        "gspo": lambda s, q, mu, ids: est.gspo_loss(
            g(s, ids[..., 0]),
            g(mu, ids[..., 0]),
            jax.lax.stop_gradient(g(q, ids[..., 0]) - g(s, ids[..., 0])),
            jnp.ones(ids.shape[:-1], bool),
            clip_eps=0.2,
        ),
        "gspo_token": lambda s, q, mu, ids: est.gspo_loss(
            g(s, ids[..., 0]),
            g(mu, ids[..., 0]),
            jax.lax.stop_gradient(g(q, ids[..., 0]) - g(s, ids[..., 0])),
            jnp.ones(ids.shape[:-1], bool),
            clip_eps=0.2,
            level="token",
        ),
    }


ESTIMATORS = _estimators()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_zero_value_and_zero_gradient_when_student_equals_teacher(name):
    s, _, mu, ids = _inputs()
    fn = ESTIMATORS[name]
    value, grad = jax.value_and_grad(lambda z: fn(z, s, mu, ids).sum())(s)
    np.testing.assert_allclose(fn(s, s, mu, ids), 0.0, atol=1e-5)
    np.testing.assert_allclose(grad, 0.0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_shape_jit_and_vmap(name):
    s, q, mu, ids = _inputs(1)
    fn = ESTIMATORS[name]
    eager = fn(s, q, mu, ids)
    assert eager.shape == (B, T) and eager.dtype == jnp.float32
    assert np.all(np.isfinite(eager))
    np.testing.assert_allclose(jax.jit(fn)(s, q, mu, ids), eager, rtol=1e-5, atol=1e-6)
    if name not in ("m2po", "second_moment_clip"):  # their statistic pools the whole batch: not per-row
        stacked = [np.stack([x, x[::-1]]) for x in (s, q, mu, ids)]
        batched = jax.vmap(fn)(*stacked)
        np.testing.assert_allclose(batched[0], eager, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(batched[1], fn(s[::-1], q[::-1], mu[::-1], ids[::-1]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_bf16_inputs_are_computed_in_fp32(name):
    s, q, mu, ids = _inputs(2)
    fn = ESTIMATORS[name]
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (s, q, mu)]
    got = fn(*as_bf16, ids)
    # Same bf16-rounded numbers, upcast first: any bf16 arithmetic inside would differ.
    want = fn(*[x.astype(jnp.float32) for x in as_bf16], ids)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_all_zero_mask_reduces_every_estimator_to_zero():
    s, q, mu, ids = _inputs(3)
    mask = jnp.zeros((B, T), bool)
    for fn in ESTIMATORS.values():
        value, grad = jax.value_and_grad(lambda z: est.token_mean(fn(z, q, mu, ids), mask))(s)
        assert value == 0.0 and np.all(np.asarray(grad) == 0.0)


def _logprob_level() -> dict[str, Callable]:
    """Estimators fed log-probs directly (not through gather_logprobs, which upcasts):
    each maps (student_logp, behaviour_logp, teacher_logp, advantages, mask) → values."""
    return {
        "forward_kl_topk": lambda lp, mu, q, a, m: est.forward_kl_topk(lp, q),
        "forward_kl_topk_no_tail": lambda lp, mu, q, a, m: est.forward_kl_topk(lp, q, tail=False),
        "reverse_kl_topk": lambda lp, mu, q, a, m: est.reverse_kl_topk(lp, q),
        "reverse_kl_topk_no_tail": lambda lp, mu, q, a, m: est.reverse_kl_topk(lp, q, tail=False),
        "forward_kl_mc": lambda lp, mu, q, a, m: est.forward_kl_mc(lp, q),
        "forward_kl_mc_cv": lambda lp, mu, q, a, m: est.forward_kl_mc(lp, q, control_variate=True),
        "reverse_kl_mc": lambda lp, mu, q, a, m: est.reverse_kl_mc(lp, mu, q),
        "reverse_kl_mc_clipped": lambda lp, mu, q, a, m: est.reverse_kl_mc(lp, mu, q, clip_eps=0.2),
        "reverse_kl_mc_stale": lambda lp, mu, q, a, m: est.reverse_kl_mc(lp, mu, q, recompute=False),
        "reverse_kl_mc_loo": lambda lp, mu, q, a, m: est.reverse_kl_mc_loo(lp, mu, q),
        # Support ids 0, 1; candidate ids 0, 1, 2, 0, 1 (inside and outside the support).
        "reverse_kl_hybrid": lambda lp, mu, q, a, m: est.reverse_kl_hybrid(
            lp[..., :2],
            q[..., :2],
            jnp.broadcast_to(jnp.arange(2), (B, T, 2)),
            lp,
            mu,
            q,
            jnp.broadcast_to(jnp.arange(N) % 3, (B, T, N)),
        ),
        "ppo_clip": lambda lp, mu, q, a, m: est.ppo_clip_loss(lp, mu, a, dual_clip=3.0),
        "decoupled_ppo": lambda lp, mu, q, a, m: est.decoupled_ppo_loss(lp, lp - 0.1, mu, a),
        "truncated_is": lambda lp, mu, q, a, m: est.truncated_is_loss(lp, mu, a),
        "m2po": lambda lp, mu, q, a, m: est.m2po_loss(lp, mu, a, m, second_moment_budget=0.5),
        "second_moment_clip": lambda lp, mu, q, a, m: est.second_moment_clip_loss(lp, mu, a, m),
        "gspo": lambda lp, mu, q, a, m: est.gspo_loss(lp[..., 0], mu[..., 0], a[..., 0], m[..., 0], clip_eps=0.2),
        "forward_kl_topk_renormalized": lambda lp, mu, q, a, m: est.forward_kl_topk_renormalized(lp, q),
        "reference_kl": lambda lp, mu, q, a, m: est.reference_kl(lp, mu),
        "token_mean": lambda lp, mu, q, a, m: est.token_mean(lp[..., 0], m[..., 0]),
        "normalized_token_sum": lambda lp, mu, q, a, m: est.normalized_token_sum(lp[..., 0], m[..., 0], 7),
    }


@pytest.mark.parametrize("name", sorted(_logprob_level()))
def test_bf16_log_probs_are_computed_in_fp32(name):
    """The same bf16 numbers give the same fp32 result as their fp32 upcast, in value and
    gradient: no arithmetic inside an estimator happens in bf16."""
    s, q, mu, ids = _inputs(4)
    g = est.gather_logprobs
    rng = np.random.default_rng(5)
    args = [g(s, _support(ids)), g(mu, _support(ids)), g(q, _support(ids)), rng.normal(size=(B, T, N))]
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in args]
    mask = jnp.asarray(rng.uniform(size=(B, T, N)) > 0.2)
    fn = _logprob_level()[name]

    def value_and_grad(lp, *rest):
        return jax.value_and_grad(lambda x: jnp.sum(fn(x, *rest, mask)))(lp)

    got, got_grad = value_and_grad(*bf16)
    want, want_grad = value_and_grad(*[x.astype(jnp.float32) for x in bf16])
    assert fn(*bf16, mask).dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The gradient comes back in the input's dtype (bf16), rounded once per use of the
    # input: equal to the fp32 gradient up to two bf16 ulps.
    assert got_grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got_grad, np.float32), want_grad, rtol=2**-6, atol=1e-6)
