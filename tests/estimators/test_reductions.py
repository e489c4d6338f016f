"""Exact token means and aggregation modes: invariant to how a batch is split; all-zero masks give 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncopd_jax.estimators import (
    AGGREGATIONS,
    aggregate,
    loss_denominator,
    normalized_loss,
    normalized_token_sum,
    token_mean,
    token_sum,
)
from tests.estimators import oracle


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


def _ragged(seed: int, rows: int = 6, t: int = 8, weights: bool = False):
    """Per-token values (NaN in padding) and a right-padded mask with one empty row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=rows)
    lengths[2] = 0  # a row with no token: no sequence to count
    mask = np.arange(t)[None, :] < lengths[:, None]
    if weights:
        mask = mask * rng.uniform(0.5, 2.0, size=mask.shape)
    values = np.where(mask != 0, rng.normal(size=(rows, t)), np.nan).astype(np.float32)
    return values, mask


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_modes_match_the_oracle(mode, weights):
    values, mask = _ragged(1, weights=weights)
    np.testing.assert_allclose(aggregate(values, mask, mode), oracle.aggregate(values, mask, mode), rtol=1e-5)
    np.testing.assert_allclose(
        aggregate(values, mask, mode, horizon=32), oracle.aggregate(values, mask, mode, horizon=32), rtol=1e-5
    )
    value, grad = jax.value_and_grad(lambda v: aggregate(v, mask, mode))(values)
    assert np.isfinite(value) and np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[mask == 0] == 0)


def test_the_modes_weigh_rows_differently():
    """A short row and a long one: the token mean weighs every token alike, seq-mean-token-mean
    every row alike, seq-mean-token-sum rows by their length, -norm by a constant horizon."""
    values = np.array([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 0, 0, 0]], bool)
    got = {mode: float(aggregate(values, mask, mode)) for mode in AGGREGATIONS}
    np.testing.assert_allclose(list(got.values()), [9 / 5, (1 + 5) / 2, 9 / 2, 9 / (2 * 4)], rtol=1e-6)
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm", horizon=10)) == pytest.approx(9 / 20)
    assert aggregate(values, mask) == got["token-mean"]  # the default
    with pytest.raises(ValueError, match="aggregation = 'seq-mean' is invalid; allowed: token-mean, "):
        aggregate(values, mask, "seq-mean")


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_all_zero_mask_gives_zero_in_every_mode(mode):
    values, mask = jnp.full((2, 3), jnp.nan), jnp.zeros((2, 3), bool)
    value, grad = jax.value_and_grad(lambda v: aggregate(v, mask, mode))(values)
    assert value == 0.0 and np.all(np.asarray(grad) == 0.0)


@settings(max_examples=20, deadline=None)
@given(
    mode=st.sampled_from(AGGREGATIONS),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
)
def test_every_mode_is_exact_over_any_split_into_rows(mode, cuts, seed):
    """Σ over parts of normalized_loss with the whole batch's denominator (value and
    gradient) == the whole batch's aggregate: micro-batches, packed micro-batches trimmed to
    their own length (the horizon stays the whole batch's T) and devices all split by rows."""
    values, mask = _ragged(seed)
    bounds = sorted({min(c, len(values)) for c in cuts} | {0, len(values)})
    parts = list(zip(bounds[:-1], bounds[1:]))
    denominator = loss_denominator(mask, mode)
    np.testing.assert_allclose(denominator, sum(loss_denominator(mask[a:b], mode) for a, b in parts))

    def split_loss(v):
        total = 0.0
        for a, b in parts:  # each part trimmed to its own longest row, as packing does
            t = max(int(mask[a:b].sum(-1).max()), 1)
            total = total + normalized_loss(v[a:b, :t], mask[a:b, :t], denominator, mode)
        return total

    whole, whole_grad = jax.value_and_grad(lambda v: aggregate(v, mask, mode))(values)
    split, split_grad = jax.value_and_grad(split_loss)(values)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.nan_to_num(split_grad), np.nan_to_num(whole_grad), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_over_devices_with_axis_name(mode):
    """Rows split over 3 devices (vmap with an axis name, as shard_map names a mesh axis): every
    device gets the whole batch's loss; without the axis name each would get its own."""
    values, mask = _ragged(5, rows=6)
    split = [x.reshape(3, 2, -1) for x in (values, mask)]
    got = jax.vmap(lambda v, m: aggregate(v, m, mode, axis_name="data"), axis_name="data")(*split)
    np.testing.assert_allclose(got, np.full(3, oracle.aggregate(values, mask, mode)), rtol=1e-5)
    alone = jax.vmap(lambda v, m: aggregate(v, m, mode))(*split)
    assert not np.allclose(alone, oracle.aggregate(values, mask, mode))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda v, m: token_sum(v, m), r"token_sum: mask has shape \[2, 1\]; expected \[2, 4\] like values"),
        (lambda v, m: token_mean(v, m), r"token_mean: mask has shape \[2, 1\]; expected \[2, 4\] like values"),
        (
            lambda v, m: normalized_token_sum(v, m, 7),
            r"normalized_token_sum: mask has shape \[2, 1\]; expected \[2, 4\] like values",
        ),
    ],
)
def test_mismatched_shapes_name_the_arguments_and_their_shapes(call, message):
    """[2, 1] broadcasts against [2, 4]: it used to give a sum over broadcast weights and a
    count of 2 (a wrong mean, silently); [2, 3] fell through to JAX's "Incompatible shapes"."""
    values = np.ones((2, 4), np.float32)
    for mask in (np.ones((2, 1), bool), np.ones((2, 3), bool)):
        shape = r"\[2, 1\]" if mask.shape == (2, 1) else r"\[2, 3\]"
        for run in (call, jax.jit(call)):
            with pytest.raises(ValueError, match=message.replace(r"\[2, 1\]", shape)) as err:
                run(values, mask)
            assert "\n" not in str(err.value)


def test_python_lists_are_accepted_wherever_a_mask_is():
    """A mask (or values) as nested lists: it used to fail with ``AttributeError: 'list'
    object has no attribute 'astype'``."""
    values = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    mask = [[1, 1, 0], [1, 0, 0]]
    arrays = np.asarray(values, np.float32), np.asarray(mask, bool)
    assert float(token_mean(values, mask)) == pytest.approx(7.0 / 3.0)
    assert [float(x) for x in token_sum(values, mask)] == [7.0, 3.0]
    assert float(normalized_token_sum(values, mask, 7)) == pytest.approx(1.0)
    for mode in AGGREGATIONS:
        assert float(aggregate(values, mask, mode)) == pytest.approx(float(aggregate(*arrays, mode)))
        assert float(loss_denominator(mask, mode)) == float(loss_denominator(arrays[1], mode))
        assert float(normalized_loss(values, mask, 3.0, mode)) == pytest.approx(
            float(normalized_loss(*arrays, 3.0, mode))
        )


def test_python_list_masks_in_the_estimators_that_take_one():
    import asyncopd_jax.estimators as est

    rng = np.random.default_rng(3)
    logp, behavior, adv = (jnp.asarray(rng.normal(size=(2, 3)) - 2.0, jnp.float32) for _ in range(3))
    teacher = jnp.asarray(np.log(rng.dirichlet(np.ones(5), size=(2, 3))), jnp.float32)
    mask = [[True, True, False], [True, False, False]]
    array = np.asarray(mask)
    calls = [
        lambda m: est.gspo_loss(logp, behavior, adv, m),
        lambda m: est.m2po_loss(logp, behavior, adv, m),
        lambda m: est.m2po_mask(logp, behavior, m),
        lambda m: est.second_moment_clip_loss(logp, behavior, adv, m),
        lambda m: est.ppo_clip_loss(logp, behavior, adv, mask=m),
        lambda m: est.truncated_is_loss(logp, behavior, adv, mask=m),
        lambda m: est.decoupled_ppo_loss(logp, behavior, behavior, adv, mask=m),
        lambda m: est.reference_kl(logp, behavior, mask=m),
        lambda m: est.forward_kl_topk(teacher, teacher, mask=m),
        lambda m: est.reverse_kl_mc(teacher, teacher, teacher, mask=m),
    ]
    for call in calls:
        np.testing.assert_array_equal(call(mask), call(array))
