"""Exact token means: invariant to how a batch is split; all-zero masks give 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncopd_jax.estimators import normalized_token_sum, token_mean, token_sum


def test_token_mean_matches_oracle_and_ignores_nan_in_padding():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(4, 6)).astype(np.float32)
    mask = rng.uniform(size=(4, 6)) > 0.4
    values_with_junk = np.where(mask, values, np.nan)
    np.testing.assert_allclose(token_mean(values_with_junk, mask), values[mask].mean(), rtol=1e-6)
    grad = jax.grad(lambda v: token_mean(v, mask))(values_with_junk)
    np.testing.assert_allclose(grad, mask / mask.sum(), rtol=1e-6)


def test_all_zero_mask_gives_zero_not_nan():
    values = jnp.ones((2, 3))
    mask = jnp.zeros((2, 3), bool)
    value, grad = jax.value_and_grad(lambda v: token_mean(v, mask))(values)
    assert value == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert normalized_token_sum(values, mask, 0) == 0.0
    assert token_sum(values, mask) == (0.0, 0.0)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=2, max_size=9),
    cuts=st.lists(st.integers(1, 8), min_size=1, max_size=4),
)
def test_micro_batch_split_gives_the_batch_mean_and_gradient(lengths, cuts):
    """Σ over any split of normalized_token_sum (value and gradient) == whole-batch mean."""
    t = 12
    rng = np.random.default_rng(len(lengths) * 31 + sum(cuts))
    values = rng.normal(size=(len(lengths), t)).astype(np.float32)
    mask = np.arange(t)[None, :] < np.array(lengths)[:, None]
    bounds = sorted({min(c, len(lengths)) for c in cuts} | {0, len(lengths)})
    parts = list(zip(bounds[:-1], bounds[1:]))
    total_count = mask.sum()

    def split_loss(v):
        return sum(normalized_token_sum(v[a:b], mask[a:b], total_count) for a, b in parts)

    whole, whole_grad = jax.value_and_grad(lambda v: token_mean(v, mask))(values)
    split, split_grad = jax.value_and_grad(split_loss)(values)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(split_grad, whole_grad, rtol=1e-5, atol=1e-8)
    # Sums and counts of the parts add up to those of the whole.
    sums = [token_sum(values[a:b], mask[a:b]) for a, b in parts]
    np.testing.assert_allclose(sum(s for s, _ in sums) / max(sum(c for _, c in sums), 1), whole, rtol=1e-5, atol=1e-7)


def test_a_batch_of_one_token_is_its_own_mean():
    values = jnp.asarray([[3.0, 7.0]])
    mask = jnp.asarray([[False, True]])
    assert float(normalized_token_sum(values, mask, 1)) == 7.0
    assert float(token_mean(values, mask)) == 7.0
