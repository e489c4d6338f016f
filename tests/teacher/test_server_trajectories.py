"""``asyncopd serve-teacher`` scores multi-turn trajectories as the in-process scorer does:
the observations are sent as context (the client's rows are the context mask), and the
scores after an observation depend on it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.tasks import ToolTaskData, make_task, prompt_task
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from tests.teacher.test_server import SETTINGS, assert_same_scores, running


@pytest.fixture(scope="module")
def trajectories():
    """The tool student's multi-turn answers to 12 held-out problems (sampled: calls, bad
    calls and answers without a call among them)."""
    data = make_task(TaskConfig(name="tools", eval_prompts=12), build_tokenizer("tools"), max_new_tokens=8)
    assert isinstance(data, ToolTaskData)
    graphdef, params = nnx.split(from_pretrained(resolve_model_path("builtin:student_tools")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prompt_task, "EVAL_SLOTS", 4)  # a short compile
        batch = data.rollout(graphdef, params, data.eval_items, temperature=1.0, seed=3)
    assert np.asarray(batch.environment_mask).any(), "no answer called the calculator"
    return batch


@pytest.mark.extended  # ~12 s of compiles: CI's second step, the README command's margin
def test_a_served_teacher_scores_trajectories_with_their_observations(trajectories):
    teacher = from_pretrained(resolve_model_path("builtin:teacher_tools"))
    params = ScoringParams(topk=8, chunk_size=64)
    local = TeacherScorer(teacher, params).score(trajectories)
    with running(BatchScorer(teacher, SETTINGS)) as (url, _, _):
        client = ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=4), params, 32)
        remote = client.score(trajectories)
        # the same trajectories with the observations hidden: scores after them change
        blind = client.score(dataclasses.replace(trajectories, environment_mask=None))
    student = np.asarray(trajectories.response_mask)
    for field in ("token_logp", "topk_logp"):
        assert_same_scores(np.asarray(getattr(remote, field))[student], np.asarray(getattr(local, field))[student])
    after = student & (np.cumsum(np.asarray(trajectories.environment_mask), axis=1) > 0)  # turns after an observation
    assert after.any()
    gap = np.abs(np.asarray(blind.token_logp) - np.asarray(remote.token_logp))[after]
    assert gap.max() > 0.1
