"""Exact KL from hidden states (asyncopd_jax/estimators/dense_from_hidden.py) against the
dense estimators on the full logits and a NumPy oracle: values and the student's gradients
within 1e-5 (fp32), chunks that do not divide the positions or the vocabulary, both
temperatures, padding that holds NaN, a Qwen3-sized vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax import estimators as est
from asyncopd_jax.estimators.dense_from_hidden import (
    dense_kls_from_hidden,
    forward_kl_dense_from_hidden,
    reverse_kl_dense_from_hidden,
)


def _pair(rng, B, T, hs, ht, V, scale=1.0):
    f32 = np.float32
    return (
        jnp.asarray(rng.normal(size=(B, T, hs)), f32),
        jnp.asarray(rng.normal(scale=scale, size=(hs, V)), f32),
        jnp.asarray(rng.normal(size=(B, T, ht)), f32),
        jnp.asarray(rng.normal(scale=scale, size=(ht, V)), f32),
    )


def _numpy_kls(hs, ws, ht, wt, tau_s, tau_t):
    """The definitions in float64: KL(q ‖ π) and KL(π ‖ q) per position."""
    z = np.asarray(hs, np.float64) @ np.asarray(ws, np.float64) / tau_s
    u = np.asarray(ht, np.float64) @ np.asarray(wt, np.float64) / tau_t
    log_p = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    log_q = u - np.log(np.exp(u - u.max(-1, keepdims=True)).sum(-1, keepdims=True)) - u.max(-1, keepdims=True)
    p, q = np.exp(log_p), np.exp(log_q)
    return (q * (log_q - log_p)).sum(-1), (p * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize(
    ("chunk_size", "vocab_chunk", "tau_s", "tau_t"),
    [(4, 8, 1.0, 1.0), (512, 8192, 1.0, 1.0), (3, 5, 0.7, 1.3), (1, 37, 1.2, 0.8)],
)
def test_values_and_gradients_equal_the_dense_estimators_on_full_logits(chunk_size, vocab_chunk, tau_s, tau_t):
    rng = np.random.default_rng(0)
    B, T, V = 3, 5, 37  # 15 positions and 37 ids: no chunk size here divides both
    hs, ws, ht, wt = _pair(rng, B, T, 6, 9, V, scale=0.8)
    kwargs = dict(student_temperature=tau_s, teacher_temperature=tau_t, chunk_size=chunk_size, vocab_chunk=vocab_chunk)
    forward, reverse = dense_kls_from_hidden(hs, ws, ht, wt, **kwargs)
    want_f, want_r = _numpy_kls(hs, ws, ht, wt, tau_s, tau_t)
    np.testing.assert_allclose(forward, want_f, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(reverse, want_r, atol=1e-5, rtol=1e-5)

    teacher_logits = ht @ wt / tau_t
    g_f, g_r = (jnp.asarray(rng.uniform(0.5, 1.5, size=(B, T)), jnp.float32) for _ in range(2))

    def ours(h, w):
        f, r = dense_kls_from_hidden(h, w, ht, wt, **kwargs)
        return jnp.sum(g_f * f) + jnp.sum(g_r * r)

    def dense(h, w):
        z = h @ w / tau_s
        return jnp.sum(g_f * est.forward_kl_dense(z, teacher_logits)) + jnp.sum(
            g_r * est.reverse_kl_dense(z, teacher_logits)
        )

    np.testing.assert_allclose(ours(hs, ws), dense(hs, ws), rtol=1e-5)
    for got, want in zip(jax.grad(ours, argnums=(0, 1))(hs, ws), jax.grad(dense, argnums=(0, 1))(hs, ws)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # each direction alone: its own gradient
    for one, dense_one in (
        (forward_kl_dense_from_hidden, est.forward_kl_dense),
        (reverse_kl_dense_from_hidden, est.reverse_kl_dense),
    ):
        got = jax.grad(lambda h: jnp.sum(one(h, ws, ht, wt, **kwargs)))(hs)
        want = jax.grad(lambda h: jnp.sum(dense_one(h @ ws / tau_s, teacher_logits)))(hs)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_teacher_gets_no_gradient_and_padding_reaches_nothing():
    rng = np.random.default_rng(1)
    hs, ws, ht, wt = _pair(rng, 2, 4, 5, 7, 11)
    mask = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    hs = hs.at[~mask].set(jnp.nan)  # padding may hold anything
    ht = ht.at[~mask].set(jnp.nan)

    def loss(h, w, t_h, t_w):
        f, r = dense_kls_from_hidden(h, w, t_h, t_w, chunk_size=3, vocab_chunk=4, mask=mask)
        return jnp.sum(f + r), (f, r)

    grads, (forward, reverse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(hs, ws, ht, wt)
    assert np.all(np.asarray(forward)[~np.asarray(mask)] == 0) and np.all(np.asarray(reverse)[~np.asarray(mask)] == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert not np.asarray(grads[0])[~np.asarray(mask)].any()  # no gradient at the padding
    assert not np.asarray(grads[2]).any() and not np.asarray(grads[3]).any()  # the teacher's are constants
    want_f, want_r = _numpy_kls(np.nan_to_num(hs), ws, np.nan_to_num(ht), wt, 1.0, 1.0)
    np.testing.assert_allclose(forward, np.where(mask, want_f, 0), atol=1e-5)
    np.testing.assert_allclose(reverse, np.where(mask, want_r, 0), atol=1e-5)


def test_a_qwen3_sized_vocabulary_at_short_length():
    """V = 151,936 (Qwen3's head) in blocks of 8,192: values and gradients against the dense
    estimators on the [1, 3, V] logits."""
    rng = np.random.default_rng(2)
    hs, ws, ht, wt = _pair(rng, 1, 3, 16, 24, 151_936, scale=0.25)
    teacher_logits = ht @ wt

    def ours(h, w):
        f, r = dense_kls_from_hidden(h, w, ht, wt, chunk_size=2, vocab_chunk=8192)
        return jnp.sum(f) + 0.5 * jnp.sum(r), (f, r)

    def dense(h, w):
        z = h @ w
        return jnp.sum(est.forward_kl_dense(z, teacher_logits)) + 0.5 * jnp.sum(est.reverse_kl_dense(z, teacher_logits))

    (_, (forward, reverse)), got = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(hs, ws)
    want_f, want_r = _numpy_kls(hs, ws, ht, wt, 1.0, 1.0)
    np.testing.assert_allclose(forward, want_f, rtol=1e-5)
    np.testing.assert_allclose(reverse, want_r, rtol=1e-5)
    for g, w in zip(got, jax.grad(dense, argnums=(0, 1))(hs, ws)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bad_shapes_name_the_argument():
    rng = np.random.default_rng(3)
    hs, ws, ht, wt = _pair(rng, 2, 3, 4, 5, 7)
    with pytest.raises(ValueError, match="the heads' vocabularies differ .student 7, teacher 6.; slice both"):
        dense_kls_from_hidden(hs, ws, ht, wt[:, :6])
    with pytest.raises(ValueError, match=r"teacher_hidden has H=5; teacher_head has shape \[4, 7\]"):
        dense_kls_from_hidden(hs, ws, ht, ws)
    with pytest.raises(ValueError, match="must share their positions"):
        dense_kls_from_hidden(hs, ws, ht[:, :2], wt)
