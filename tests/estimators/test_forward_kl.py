"""Forward KL estimators against the NumPy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.estimators import (
    forward_kl_dense,
    forward_kl_mc,
    forward_kl_topk,
    forward_kl_topk_renormalized,
    gather_logprobs,
    with_tail,
)
from tests.estimators import oracle

B, T, V = 2, 3, 7


def _logits(seed: int, scale: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=scale, size=(B, T, V)).astype(np.float32)


def test_dense_matches_oracle_value_and_gradient():
    s, q = _logits(0), _logits(1)
    value, grad = jax.value_and_grad(lambda z: forward_kl_dense(z, q).sum())(s)
    np.testing.assert_allclose(
        forward_kl_dense(s, q), oracle.kl(oracle.log_softmax(q), oracle.log_softmax(s)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(grad, oracle.forward_kl_grad_wrt_logits(s, q), atol=1e-6)
    # The teacher receives no gradient.
    teacher_grad = jax.grad(lambda z: forward_kl_dense(s, z).sum())(q)
    np.testing.assert_array_equal(teacher_grad, 0.0)


def test_teacher_with_zero_probability_ids_gives_finite_values():
    s, q = _logits(0), _logits(1)
    q[..., :2] = -np.inf  # e.g. padded vocabulary rows
    value, grad = jax.value_and_grad(lambda z: forward_kl_dense(z, q).sum())(s)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(
        forward_kl_dense(s, q), oracle.kl(oracle.log_softmax(q), oracle.log_softmax(s)), rtol=1e-5
    )


@pytest.mark.parametrize("tail", [True, False])
def test_topk_equals_dense_when_k_is_vocabulary(tail):
    s, q = _logits(2), _logits(3)
    perm = np.random.default_rng(0).permutation(V)
    ids = np.broadcast_to(perm, (B, T, V))

    def topk(z):
        return forward_kl_topk(gather_logprobs(z, ids), gather_logprobs(jnp.asarray(q), ids), tail=tail)

    np.testing.assert_allclose(topk(s), forward_kl_dense(s, q), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda z: topk(z).sum())(s),
        jax.grad(lambda z: forward_kl_dense(z, q).sum())(s),
        atol=1e-6,
    )


def test_topk_without_tail_drops_the_tail():
    s, q = _logits(4), _logits(5)
    lq, ls = oracle.log_softmax(q), oracle.log_softmax(s)
    ids = np.argsort(-lq, axis=-1)[..., :3]
    got = forward_kl_topk(np.take_along_axis(ls, ids, -1), np.take_along_axis(lq, ids, -1), tail=False)
    want = np.sum(np.exp(np.take_along_axis(lq, ids, -1)) * np.take_along_axis(lq - ls, ids, -1), -1)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_topk_with_tail_is_the_coarse_grained_kl():
    s, q = _logits(4), _logits(5)
    lq, ls = oracle.log_softmax(q), oracle.log_softmax(s)
    ids = np.argsort(-lq, axis=-1)[..., :3]
    got = forward_kl_topk(np.take_along_axis(ls, ids, -1), np.take_along_axis(lq, ids, -1))
    want = oracle.kl(oracle.coarse_grain(lq, ids), oracle.coarse_grain(ls, ids))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.all(np.asarray(got) <= oracle.kl(lq, ls) + 1e-6)  # biased low, never above the full KL
    # Plain truncation is not stationary at student = teacher; the tail bucket is.
    sup = np.take_along_axis(lq, ids, -1).astype(np.float32)
    for tail, stationary in ((True, True), (False, False)):
        grad = jax.grad(lambda z: forward_kl_topk(gather_logprobs(z, ids), sup, tail=tail).sum())(q)
        assert np.allclose(grad, 0.0, atol=1e-6) == stationary


def _mc_draws(n_draws: int, seed: int, student: np.ndarray, teacher: np.ndarray, control_variate: bool):
    """Per-draw values [P] and gradients w.r.t. the student logits [P, V], one sample each."""
    rng = np.random.default_rng(seed)
    lq = oracle.log_softmax(teacher)
    samples = rng.choice(V, size=(n_draws, 1, 1), p=np.exp(lq))
    s_rep = jnp.broadcast_to(jnp.asarray(student, jnp.float32), (n_draws, 1, V))

    def per_draw(z):
        return forward_kl_mc(
            gather_logprobs(z, samples), lq[samples].astype(np.float32), control_variate=control_variate
        )

    values = np.asarray(per_draw(s_rep)).ravel()
    grads = np.asarray(jax.grad(lambda z: per_draw(z).sum())(s_rep)).reshape(n_draws, V)
    return values, grads


@pytest.mark.parametrize("control_variate", [False, True])
def test_mc_is_unbiased_for_value_and_gradient(control_variate):
    rng = np.random.default_rng(6)
    s, q = rng.normal(size=(V,)) * 1.5, rng.normal(size=(V,)) * 1.5
    n_draws = 200_000
    values, grads = _mc_draws(n_draws, 0, s, q, control_variate)
    exact_value = oracle.kl(oracle.log_softmax(q), oracle.log_softmax(s))
    exact_grad = oracle.forward_kl_grad_wrt_logits(s, q)
    # 5 standard errors: a false alarm has probability ~6e-7 per component.
    assert abs(values.mean() - exact_value) < 5 * values.std() / np.sqrt(n_draws)
    se = grads.std(axis=0) / np.sqrt(n_draws)
    assert np.all(np.abs(grads.mean(axis=0) - exact_grad) < 5 * se + 1e-7)
    if control_variate:
        assert np.all(values >= -1e-6)  # k3 is non-negative sample by sample


def test_mc_at_student_equals_teacher():
    """Value 0 per draw; gradient 0 per draw with the control variate, 0 on average without."""
    q = np.random.default_rng(8).normal(size=(V,)) * 1.5
    values, grads = _mc_draws(50_000, 1, q, q, control_variate=False)
    np.testing.assert_allclose(values, 0.0, atol=1e-6)
    assert np.abs(grads).max() > 0.1  # a single draw's gradient is not zero ...
    se = grads.std(axis=0) / np.sqrt(len(grads))
    assert np.all(np.abs(grads.mean(axis=0)) < 5 * se)  # ... but its mean is
    values, grads = _mc_draws(1_000, 1, q, q, control_variate=True)
    np.testing.assert_allclose(values, 0.0, atol=1e-6)
    np.testing.assert_allclose(grads, 0.0, atol=1e-6)


def test_with_tail_keeps_a_tiny_tail_to_float32_precision():
    # A support holding all but 1e-5 of the mass: log(1 − e^x) must come from expm1, since
    # e^x rounds to float32 with an absolute error ~3e-8, a few tenths of a percent of 1e-5.
    tails = np.array([1e-5, 2e-5, 3e-6, 7e-6, 1.3e-5])
    support = np.log1p(-tails)[:, None].astype(np.float32)
    np.testing.assert_allclose(np.exp(with_tail(support)[:, 1]), tails, rtol=2e-5)
    # and from log1p below −log 2 (a support with little mass)
    small = np.log(np.array([[0.1, 0.05], [0.3, 0.1]], np.float32))
    np.testing.assert_allclose(np.exp(with_tail(small)[:, 2]), [0.85, 0.6], rtol=1e-6)


def test_renormalised_top_k_is_the_kl_of_the_renormalised_distributions():
    """NumPy oracle; invariant to a per-position shift of either input (log-probs or logits);
    0 with 0 gradient when the student matches the teacher up to a factor on the support."""
    rng = np.random.default_rng(30)
    student, teacher = (np.log(rng.dirichlet(np.ones(12), size=(2, 3)))[..., :5].astype(np.float32) for _ in range(2))
    q = oracle.log_softmax(teacher.astype(np.float64))
    p = oracle.log_softmax(student.astype(np.float64))
    np.testing.assert_allclose(forward_kl_topk_renormalized(student, teacher), oracle.kl(q, p), rtol=1e-5, atol=1e-6)
    shifted = forward_kl_topk_renormalized(student + 3.0, teacher - 1.0)
    np.testing.assert_allclose(shifted, oracle.kl(q, p), rtol=1e-5, atol=1e-6)
    value, grad = jax.value_and_grad(lambda s: forward_kl_topk_renormalized(s, teacher).sum())(teacher - 0.7)
    np.testing.assert_allclose(value, 0.0, atol=1e-6)
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)
    # the gradient w.r.t. the student: π_K − q_K on the support
    grad = jax.grad(lambda s: forward_kl_topk_renormalized(s, teacher).sum())(student)
    np.testing.assert_allclose(grad, np.exp(p) - np.exp(q), rtol=1e-4, atol=1e-6)
