"""Several teachers and a teacher-only prompt on multi-turn trajectories: each teacher scores
its rows under its own prompt, with the observations as context."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.tasks.tool_arith import sample_problems
from asyncopd_jax.tasks.tool_task import ToolTaskData
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.routing import TeacherRoute
from asyncopd_jax.teacher.scorer import Scorers

PARAMS = ScoringParams(topk=4, chunk_size=64)


def test_each_teacher_scores_its_trajectories_under_its_own_prompt_with_the_observations():
    task = ToolTaskData(TaskConfig(name="tools"), build_tokenizer("tools"))
    batch = task.sft_batch(np.random.default_rng(0), 4, habit="steps")  # two observations a row
    problems = sample_problems(np.random.default_rng(0), 4, task.task.max_value, held_out=False)
    # teacher b's own prompt: the student's with "+" before it (a template such as "+{prompt}")
    own, own_mask = left_pad([task.text_ids("+" + p.prompt) for p in problems], task.pad_id, task.prompt_slots + 1)
    plain, plain_mask = left_pad(task.encode(problems), task.pad_id, task.prompt_slots + 1)
    route = TeacherRoute(
        teacher=np.array([0, 1, 0, 1]),
        prompt_tokens=np.where([[False], [True], [False], [True]], own, plain),
        prompt_mask=np.where([[False], [True], [False], [True]], own_mask, plain_mask),
    )
    teacher = TeacherScorer(from_pretrained(resolve_model_path("builtin:teacher_tools")), PARAMS)
    scored = Scorers(teachers={"a": teacher, "b": teacher}).score(batch, jax.random.key(0), route)
    got = np.asarray(scored.cache.token_logp)
    student = np.asarray(batch.response_mask)

    def alone(rows: list[int], prompts: np.ndarray, masks: np.ndarray, environment: bool = True) -> np.ndarray:
        part = jax.tree_util.tree_map(lambda x: x[np.asarray(rows)], batch)
        part = dataclasses.replace(part, prompt_tokens=jnp.asarray(prompts[rows]), prompt_mask=jnp.asarray(masks[rows]))
        if not environment:  # the observations out of the context: the teacher never reads them
            part = dataclasses.replace(part, environment_mask=None)
        return np.asarray(teacher.score(part).token_logp)

    for rows, prompts, masks in (([0, 2], plain, plain_mask), ([1, 3], own, own_mask)):
        want = alone(rows, prompts, masks)
        np.testing.assert_allclose(got[rows][student[rows]], want[student[rows]], atol=2e-5)
    # the guard: b's prompt moves its scores, and without the observations its answer turn moves more
    under_plain = alone([1, 3], plain, plain_mask)
    assert np.abs(got[[1, 3]][student[[1, 3]]] - under_plain[student[[1, 3]]]).max() > 1e-3
    blind = alone([1, 3], own, own_mask, environment=False)
    assert np.abs(got[[1, 3]][student[[1, 3]]] - blind[student[[1, 3]]]).max() > 0.1
    assert np.asarray(batch.environment_mask).any()
