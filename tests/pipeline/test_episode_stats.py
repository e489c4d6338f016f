"""A multi-turn batch's episode figures for ``metrics.jsonl``, on two hand-made groups: per
answer over every row, per teacher over that teacher's rows, and the share of the tool time
the rollout kept decoding through."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.pipeline.episode_stats import episode_stats
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.teacher.routing import TeacherRoute
from asyncopd_jax.teacher.scorer import TeacherUse


def _group(student: list[list[int]], environment: list[list[int]], calls, seconds, blocked, teacher=None):
    b, t = np.shape(student)
    batch = RolloutBatch(
        prompt_tokens=jnp.ones((b, 2), jnp.int32),
        prompt_mask=jnp.ones((b, 2), bool),
        response_tokens=jnp.ones((b, t), jnp.int32),
        response_mask=jnp.asarray(student, bool),
        behavior_logp=jnp.zeros((b, t)),
        token_version=jnp.zeros((b, t), jnp.int32),
        environment_mask=jnp.asarray(environment, bool),
        tool_calls=jnp.asarray(calls, jnp.int32),
        tool_errors=jnp.asarray([0] * (b - 1) + [1], jnp.int32),
        environment_seconds=jnp.asarray(seconds, jnp.float32),
        environment_blocked_seconds=jnp.asarray(blocked, jnp.float32),
    )
    uses = {"a": TeacherUse(1, 0.0, 1), "b": TeacherUse(1, 0.0, 1)}
    route = None if teacher is None else TeacherRoute(np.asarray(teacher, np.int32))
    return RolloutGroup(batch, None, 0, 0, route=route, teacher_uses=uses if teacher is not None else {"a": uses["a"]})


def test_figures_per_answer_per_teacher_and_the_overlap():
    two_calls = ([1, 1, 0, 1, 0, 1, 0], [0, 0, 1, 0, 1, 0, 0])  # three turns, two observations of one token
    one_call = ([1, 0, 0, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0])  # two turns, one observation of two tokens
    first = _group(*zip(two_calls, one_call), calls=[2, 1], seconds=[2.0, 1.0], blocked=[0.5, 0.0], teacher=[1, 0])
    second = _group([one_call[0]], [one_call[1]], calls=[1], seconds=[1.0], blocked=[1.0])
    stats = episode_stats([first, second])
    assert stats["turns_per_answer"] == pytest.approx(7 / 3) and stats["tool_calls_per_answer"] == pytest.approx(4 / 3)
    assert stats["observation_tokens_per_answer"] == 2.0 and stats["tool_errors_per_answer"] == pytest.approx(2 / 3)
    assert stats["environment_s"] == 4.0 and stats["environment_overlapped_s"] == 2.5
    assert stats["environment_overlap"] == pytest.approx(2.5 / 4.0)
    # teacher a scored the second row of the first group and the only row of the second: one call each
    assert stats["teacher/a/tool_calls_per_answer"] == 1.0 and stats["teacher/a/turns_per_answer"] == 2.0
    assert stats["teacher/b/tool_calls_per_answer"] == 2.0 and stats["teacher/b/turns_per_answer"] == 3.0


def test_a_single_turn_batch_has_no_episode_figures():
    batch = RolloutBatch(
        prompt_tokens=jnp.ones((1, 2), jnp.int32),
        prompt_mask=jnp.ones((1, 2), bool),
        response_tokens=jnp.ones((1, 3), jnp.int32),
        response_mask=jnp.ones((1, 3), bool),
        behavior_logp=jnp.zeros((1, 3)),
        token_version=jnp.zeros((1, 3), jnp.int32),
    )
    assert episode_stats([RolloutGroup(batch, None, 0, 0)]) == {}
