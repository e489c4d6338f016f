"""The reward stage: rewards of a sampled group, and for RL group-relative advantages on the batch."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.pipeline.reward_stage import RewardStage


def _batch(rows: int, T: int = 5) -> RolloutBatch:
    return RolloutBatch(
        prompt_tokens=jnp.ones((rows, 2), jnp.int32),
        prompt_mask=jnp.ones((rows, 2), bool),
        response_tokens=jnp.zeros((rows, T), jnp.int32),
        response_mask=jnp.ones((rows, T), bool),
        behavior_logp=jnp.zeros((rows, T)),
        token_version=jnp.zeros((rows, T), jnp.int32),
    )


def test_rl_groups_repeat_each_prompt_and_carry_group_relative_advantages():
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1], np.float32)  # prompt 0: one of four right; prompt 1: all right
    stage = RewardStage(
        lambda problems, batch: [rewards[i] for i in range(len(problems))],
        samples_per_prompt=4,
        advantages=True,
        normalize_std=False,
    )
    assert stage.prompts_per_group(8) == 2
    assert stage.repeat(["a", "b"]) == ["a"] * 4 + ["b"] * 4
    batch, got = stage(list(range(8)), _batch(8))
    np.testing.assert_array_equal(got, rewards)
    want = np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], np.float32)  # reward − group mean
    np.testing.assert_allclose(batch.advantages, np.broadcast_to(want[:, None], (8, 5)), atol=1e-6)
    normalized = RewardStage(stage.rewards, samples_per_prompt=4, advantages=True, normalize_std=True)
    batch, _ = normalized(list(range(8)), _batch(8))
    np.testing.assert_allclose(batch.advantages[:4, 0], want[:4] / (np.std(rewards[:4], ddof=1) + 1e-6), rtol=1e-5)
    population = RewardStage(stage.rewards, samples_per_prompt=4, advantages=True, std="population")
    batch, _ = population(list(range(8)), _batch(8))
    np.testing.assert_allclose(batch.advantages[:4, 0], want[:4] / (np.std(rewards[:4]) + 1e-6), rtol=1e-5)


def test_the_config_chooses_the_std():
    from asyncopd_jax.config import RLConfig, RunConfig

    for std in ("unbiased", "population"):
        cfg = RunConfig(
            algorithm="rl",
            estimator=dataclasses.replace(RunConfig().estimator, name="ppo_clip"),
            rl=RLConfig(samples_per_prompt=2, advantage_std=std),
        )
        assert RewardStage.from_config(cfg, lambda p, b: []).std == std


def test_distillation_rewards_leave_the_batch_alone():
    stage = RewardStage(lambda problems, batch: [0.5] * len(problems))
    batch, rewards = stage([0, 1, 2], _batch(3))
    assert batch.advantages is None and rewards.tolist() == [0.5] * 3
    assert stage.prompts_per_group(3) == 3 and stage.repeat([1, 2]) == [1, 2]


def test_a_group_that_does_not_hold_whole_prompt_groups_is_refused():
    with pytest.raises(ValueError, match="a rollout group of 6 samples cannot hold whole groups of 4"):
        RewardStage(lambda p, b: [], samples_per_prompt=4).prompts_per_group(6)
