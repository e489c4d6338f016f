"""Dense and chunked, fused log-prob gathers: values and gradients equal the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.estimators import (
    gather_logprobs,
    gather_logprobs_and_entropy_from_hidden,
    gather_logprobs_from_hidden,
)
from tests.estimators import oracle

B, T, H, V = 2, 5, 8, 11


def _problem(seed: int = 0, k: int | None = 3):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    head = (rng.normal(size=(H, V)) / np.sqrt(H)).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T) if k is None else (B, T, k))
    if k is not None and k >= 2:
        ids[..., 1] = ids[..., 0]  # duplicate ids must accumulate gradients
    return hidden, head, ids


@pytest.mark.parametrize("k", [None, 1, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_logprobs_matches_oracle(k, temperature):
    hidden, head, ids = _problem(k=k)
    logits = hidden @ head
    got = gather_logprobs(logits, ids, temperature)
    full = oracle.log_softmax(logits.astype(np.float64) / temperature)
    want = np.take_along_axis(full, ids if k is not None else ids[..., None], -1)
    want = want if k is not None else want[..., 0]
    assert got.shape == ids.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [None, 4])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])  # 3 does not divide B·T = 10
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_chunked_equals_dense_in_values_and_gradients(k, chunk_size, temperature):
    hidden, head, ids = _problem(seed=1, k=k)
    cotangent = np.random.default_rng(2).normal(size=ids.shape).astype(np.float32)

    def dense(h, w):
        return jnp.sum(gather_logprobs(h @ w, ids, temperature) * cotangent)

    def chunked(h, w):
        return jnp.sum(gather_logprobs_from_hidden(h, w, ids, chunk_size, temperature) * cotangent)

    np.testing.assert_allclose(
        gather_logprobs_from_hidden(hidden, head, ids, chunk_size, temperature),
        gather_logprobs(hidden @ head, ids, temperature),
        rtol=1e-5,
        atol=1e-6,
    )
    dense_grads = jax.grad(dense, argnums=(0, 1))(hidden, head)
    chunked_grads = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, head)
    for got, want in zip(chunked_grads, dense_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_chunked_gradient_matches_finite_differences():
    """Independent of the dense path: the custom VJP agrees with central differences."""
    hidden, head, ids = _problem(seed=3, k=2)
    hidden64, head64 = hidden.astype(np.float64), head.astype(np.float64)

    def loss64(w):
        return np.sum(np.take_along_axis(oracle.log_softmax(hidden64 @ w), ids, -1))

    grad = np.asarray(jax.grad(lambda w: gather_logprobs_from_hidden(hidden, w, ids, 4).sum())(head))
    eps = 1e-5
    for i, j in [(0, 0), (3, 7), (7, 10)]:
        bump = np.zeros_like(head64)
        bump[i, j] = eps
        fd = (loss64(head64 + bump) - loss64(head64 - bump)) / (2 * eps)
        np.testing.assert_allclose(grad[i, j], fd, rtol=1e-3, atol=1e-5)


def test_chunked_never_materialises_full_logits():
    """The compiled backward holds O(chunk · V), not O(B · T · V), temporaries."""
    b, t, h, v, chunk = 1, 512, 16, 4096, 32
    hidden = jnp.zeros((b, t, h), jnp.float32)
    head = jnp.zeros((h, v), jnp.float32)
    ids = jnp.zeros((b, t, 4), jnp.int32)
    full_logits_bytes = b * t * v * 4

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda hh, w: fn(hh, w).sum(), argnums=(0, 1)))
        return grad.lower(hidden, head).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda hh, w: gather_logprobs_from_hidden(hh, w, ids, chunk))
    dense = temp_bytes(lambda hh, w: gather_logprobs(hh @ w, ids))
    assert dense >= full_logits_bytes  # sanity: the dense path does hold them
    # Chunk temporaries plus the fp32 [H, V] weight-gradient accumulator.
    assert chunked < 8 * chunk * v * 4 + h * v * 4, (chunked, dense)


def test_bf16_inputs_give_fp32_accurate_results():
    hidden, head, ids = _problem(seed=4, k=3)
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16)
    got = gather_logprobs_from_hidden(h16, w16, ids, 4)
    # Reference: the same bf16-rounded values, upcast, computed in float64.
    ref_logits = np.asarray(h16, np.float64) @ np.asarray(w16, np.float64)
    want = np.take_along_axis(oracle.log_softmax(ref_logits), ids, -1)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g_h, g_w = jax.grad(lambda a, b: gather_logprobs_from_hidden(a, b, ids, 4).sum(), argnums=(0, 1))(h16, w16)
    assert g_h.dtype == jnp.bfloat16 and g_w.dtype == jnp.bfloat16


def test_bad_shapes_raise_clear_errors():
    hidden, head, ids = _problem()
    with pytest.raises(ValueError, match=rf"hidden has H={hidden.shape[-1]}, lm_head has shape \({head.shape[1]}, "):
        gather_logprobs_from_hidden(hidden, head.T, ids)
    with pytest.raises(ValueError, match="ids must have shape"):
        gather_logprobs(hidden @ head, ids[..., None])
    with pytest.raises(ValueError, match="chunk_size"):
        gather_logprobs_from_hidden(hidden, head, ids, 0)


def test_chunked_gradient_with_vocabulary_not_a_multiple_of_the_weight_grad_slice():
    """The weight gradient is accumulated in column slices; the last one overlaps and is masked."""
    from asyncopd_jax.estimators.logprobs import _WEIGHT_GRAD_COLUMNS

    rng = np.random.default_rng(5)
    v = 2 * _WEIGHT_GRAD_COLUMNS + 77
    hidden = rng.normal(size=(1, 6, 4)).astype(np.float32)
    head = (rng.normal(size=(4, v)) / 2).astype(np.float32)
    ids = rng.integers(0, v, size=(1, 6, 3))
    ids[0, 0] = [v - 1, v - 1, _WEIGHT_GRAD_COLUMNS]  # ids in the overlapped slice, duplicated
    dense = jax.grad(lambda w: gather_logprobs(hidden @ w, ids).sum())(head)
    chunked = jax.grad(lambda w: gather_logprobs_from_hidden(hidden, w, ids, 4).sum())(head)
    np.testing.assert_allclose(chunked, dense, rtol=1e-4, atol=1e-7)


def test_ids_without_a_support_axis_give_one_log_prob_per_position():
    hidden, head, ids = _problem()
    one = ids[..., 0]  # [B, T]
    got = gather_logprobs_from_hidden(hidden, head, one, 4)
    assert got.shape == one.shape
    np.testing.assert_allclose(got, gather_logprobs_from_hidden(hidden, head, ids, 4)[..., 0], rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_from_the_fused_pass_matches_the_oracle_in_value_and_gradient(chunk_size, temperature):
    hidden, head, ids = _problem(seed=4, k=2)
    rng = np.random.default_rng(5)
    g_logp, g_entropy = rng.normal(size=ids.shape).astype(np.float32), rng.normal(size=(B, T)).astype(np.float32)
    logp, entropy = gather_logprobs_and_entropy_from_hidden(hidden, head, ids, chunk_size, temperature)
    full = oracle.log_softmax((hidden @ head).astype(np.float64) / temperature)
    np.testing.assert_allclose(entropy, -np.sum(np.exp(full) * full, -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp, np.take_along_axis(full, ids, -1), rtol=1e-5, atol=1e-6)

    def dense(h, w):  # the same two outputs through plain autodiff over the [B, T, V] log-softmax
        lp = jax.nn.log_softmax(h @ w / temperature, axis=-1)
        return jnp.sum(jnp.take_along_axis(lp, ids, -1) * g_logp) + jnp.sum(-jnp.sum(jnp.exp(lp) * lp, -1) * g_entropy)

    def fused(h, w):
        lp, ent = gather_logprobs_and_entropy_from_hidden(h, w, ids, chunk_size, temperature)
        return jnp.sum(lp * g_logp) + jnp.sum(ent * g_entropy)

    for got, want in zip(
        jax.jit(jax.grad(fused, argnums=(0, 1)))(hidden, head), jax.grad(dense, argnums=(0, 1))(hidden, head)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


GATHERS = {
    "gather_logprobs": lambda hidden, head, ids, **kw: gather_logprobs(hidden @ head, ids, **kw),
    "gather_logprobs_from_hidden": lambda hidden, head, ids, **kw: gather_logprobs_from_hidden(
        hidden, head, ids, 4, **kw
    ),
    "gather_logprobs_and_entropy_from_hidden": lambda hidden, head, ids, **kw: gather_logprobs_and_entropy_from_hidden(
        hidden, head, ids, 4, **kw
    )[0],
}


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_out_of_range_ids_give_nan_with_no_gradient_never_a_wrapped_id(name):
    """An id outside [0, V) (−1, V) gives NaN there, not the log-prob of V − 1 (NumPy's
    wrapping of −1) nor of a clamped id; the other positions and the gradient through them
    are those of in-range ids."""
    hidden, head, ids = _problem(k=3)
    bad = ids.copy()
    bad[0, 1, 0], bad[1, 4, 2] = -1, V
    gather = GATHERS[name]
    got = np.asarray(gather(hidden, head, bad))
    want = np.asarray(gather(hidden, head, ids))
    wrong = bad != ids
    assert np.all(np.isnan(got[wrong]))
    np.testing.assert_array_equal(got[~wrong], want[~wrong])

    def loss(h, w, i):  # the estimator's mask would drop the NaN positions
        return jnp.sum(jnp.where(jnp.asarray(~wrong), gather(h, w, i), 0.0))

    got_grads = jax.grad(loss, argnums=(0, 1))(hidden, head, bad)
    want_grads = jax.grad(loss, argnums=(0, 1))(hidden, head, ids)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_check_inputs_names_the_ids_and_the_vocabulary_size(name):
    hidden, head, ids = _problem(k=3)
    bad = ids.copy()
    bad[1, 2, 1] = V + 2
    gather = GATHERS[name]
    source = "the logits' last axis" if name == "gather_logprobs" else "lm_head's last axis"  # where V comes from
    message = (
        rf"{name}: ids holds ids from 0 to 13; expected ids in \[0, V\) with the vocabulary size V = 11 "
        rf"\({source}\)"
    )
    with pytest.raises(ValueError, match=message):  # eagerly: at once, one line
        gather(hidden, head, bad, check_inputs=True)
    step = jax.jit(lambda h, w, i: gather(h, w, i, check_inputs=True))
    with pytest.raises(Exception, match=message):  # under a plain jit: from the step
        jax.block_until_ready(step(hidden, head, bad))
    assert np.all(np.isfinite(step(hidden, head, ids)))
    from jax.experimental import checkify

    error, _ = checkify.checkify(jax.jit(lambda h, w, i: gather(h, w, i, check_inputs=True)))(hidden, head, bad)
    with pytest.raises(Exception, match=message):
        error.throw()


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_masked_positions_are_not_checked_and_give_zero(name):
    """Padding ids may be anything (here −1 and V): with the mask they are neither checked
    nor gathered, and NaN hidden states or logits there do not reach the gradient."""
    hidden, head, ids = _problem(k=3)
    mask = np.ones((B, T), bool)
    mask[0, 3:] = False
    padded_ids = np.where(mask[..., None], ids, -1)
    padded_ids[0, 4] = V
    gather = GATHERS[name]
    padded_hidden = np.where(mask[..., None], hidden, np.nan).astype(np.float32)
    if name == "gather_logprobs":  # NaN in the logits it is given, not in the caller's matmul
        padded_hidden = hidden

        def gather(h, w, i, **kw):
            return gather_logprobs(jnp.where(mask[..., None], h @ w, jnp.nan), i, **kw)

    got = gather(padded_hidden, head, padded_ids, mask=mask, check_inputs=True)
    want = gather(hidden, head, ids)
    np.testing.assert_array_equal(np.asarray(got)[~mask], 0.0)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda w: jnp.sum(gather(padded_hidden, w, padded_ids, mask=mask)))(head)
    want_grad = jax.grad(lambda w: jnp.sum(jnp.where(mask[..., None], gather(hidden, w, ids), 0.0)))(head)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
