"""Group-relative advantages against a NumPy oracle; the distillation term."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.estimators import group_advantages, with_distillation
from tests.estimators import oracle


@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_group_advantages_match_the_oracle(group_size, normalize_std, std):
    rewards = np.random.default_rng(group_size).integers(0, 2, size=6 * group_size).astype(np.float32)
    rewards[:group_size] = 1.0  # one group all correct
    got = group_advantages(jnp.asarray(rewards), group_size, normalize_std=normalize_std, std=std)
    want = oracle.group_advantages(rewards, group_size, normalize_std, ddof=1 if std == "unbiased" else 0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[:group_size] == 0)  # equal rewards: no signal


def test_the_default_std_is_the_unbiased_one():
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
    got = np.asarray(group_advantages(rewards, 4))
    np.testing.assert_allclose(got, oracle.group_advantages(rewards, 4, ddof=1), rtol=1e-5)
    # √(G / (G − 1)) apart from the population std's advantages
    np.testing.assert_allclose(
        np.asarray(group_advantages(rewards, 4, std="population")) / got, np.sqrt(4 / 3), rtol=1e-5
    )
    with pytest.raises(ValueError, match="std = 'sample' is invalid; allowed: unbiased, population"):
        group_advantages(rewards, 4, std="sample")


@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_a_group_of_one_keeps_its_raw_reward(std):
    rewards = jnp.array([1.0, 0.0, 0.5])
    np.testing.assert_allclose(group_advantages(rewards, 1, std=std), np.array([1.0, 0.0, 0.5]) / (1 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 1, normalize_std=False, std=std), [1.0, 0.0, 0.5])


def test_groups_split_over_devices_are_normalised_over_all_their_members():
    """Under vmap / shard_map with ``axis_name`` a group that straddles devices is normalised
    over all its members, and each device gets its own rows back."""
    rewards = np.random.default_rng(3).normal(size=12).astype(np.float32)  # 2 groups of 6 over 4 devices
    split = jnp.asarray(rewards.reshape(4, 3))
    got = jax.vmap(lambda r: group_advantages(r, 6, axis_name="d"), axis_name="d")(split)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), oracle.group_advantages(rewards, 6), rtol=1e-5, atol=1e-6)
    alone = jax.vmap(lambda r: group_advantages(r, 3))(split)  # without the axis: groups of each device alone
    assert not np.allclose(np.asarray(alone).reshape(-1), oracle.group_advantages(rewards, 6), atol=1e-3)


def test_advantages_are_relative_to_their_own_group():
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(
        group_advantages(rewards, 4, normalize_std=False), [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]
    )
    # std-normalised: each group's advantages have unit (unbiased) std
    a = np.asarray(group_advantages(rewards, 4)).reshape(2, 4)
    np.testing.assert_allclose(a.std(axis=1, ddof=1), [1.0, 1.0], rtol=1e-4)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"B a multiple of group_size = 3 \(got shape \(4,\)\)"):
        group_advantages(jnp.zeros(4), 3)
    with pytest.raises(ValueError, match="must be \\[B\\]"):
        group_advantages(jnp.zeros((2, 2)), 2)


def test_the_distillation_term_adds_the_teacher_signal_without_gradient():
    seq = jnp.array([1.0, -1.0])
    teacher = jnp.log(jnp.array([[0.5, 0.25], [0.1, 0.2]]))
    student = jnp.log(jnp.array([[0.25, 0.25], [0.2, 0.2]]))
    got = with_distillation(seq, teacher, student, beta=0.5)
    np.testing.assert_allclose(got, [[1 + 0.5 * np.log(2), 1.0], [-1 + 0.5 * np.log(0.5), -1.0]], rtol=1e-6)
    np.testing.assert_allclose(with_distillation(seq, teacher, student, beta=0.0), [[1, 1], [-1, -1]])
    grad = jax.grad(lambda s: with_distillation(seq, teacher, s, 1.0).sum())(student)
    assert np.all(np.asarray(grad) == 0)


def test_a_group_with_a_tiny_spread_is_divided_by_std_plus_eps():
    rewards = np.array([0.0, 1e-5, 0.5, 0.5], np.float32)  # population std 5e-6: comparable to eps = 1e-6
    got = np.asarray(group_advantages(jnp.asarray(rewards), 2, std="population"))
    np.testing.assert_allclose(got, oracle.group_advantages(rewards, 2, ddof=0), rtol=1e-4)
    np.testing.assert_allclose(got[:2], [-5e-6 / 6e-6, 5e-6 / 6e-6], rtol=1e-3)


def test_bf16_rewards_are_averaged_in_fp32():
    rewards = np.array([1.0, 0.00390625, 0.0078125, 0.5], np.float32)  # exact in bf16
    got = group_advantages(jnp.asarray(rewards, jnp.bfloat16), 4, normalize_std=False)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), oracle.group_advantages(rewards, 4, False), rtol=1e-6, atol=1e-7)
