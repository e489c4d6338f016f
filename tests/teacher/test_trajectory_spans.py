"""A teacher of another tokenizer on multi-turn trajectories: the tool task's byte-pair
student (``tools_merges``) under its character teacher (``builtin:teacher_tools``), by spans
and by byte prefixes.

The oracle is the same-tokenizer path: each trajectory spelled in the teacher's characters
(turns, their stop tokens as the teacher's EOS, and the observations as environment
tokens), scored by the plain in-process scorer. A character teacher writes a student token's
text one character a token, so both mappings must give each student token the sum of the
teacher's log-probs of its characters, read after every observation before it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import EOS_ID, build_tokenizer
from asyncopd_jax.tasks.tool_arith import ToolProblem
from asyncopd_jax.tasks.tool_task import ToolTaskData
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from asyncopd_jax.teacher.byte_prefix_teacher import BytePrefixTeacher
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher, Retokenizer
from asyncopd_jax.teacher.prefix_trees import PrefixTrees
from tests.teacher.test_server import SETTINGS, running

PARAMS = ScoringParams(topk=4, chunk_size=64)
PROBLEMS = [ToolProblem(12, 34, 56), ToolProblem(97, 13, 40), ToolProblem(25, 25, 11), ToolProblem(60, 71, 99)]
HABITS = ["whole", "steps", "steps", "whole"]
CUT = 3  # row 3 is cut at the length limit inside its last turn (no stop token)


@pytest.fixture(scope="module")
def pair():
    config = TaskConfig(name="tools")
    return ToolTaskData(config, build_tokenizer("tools_merges")), ToolTaskData(config, build_tokenizer("tools"))


@pytest.fixture(scope="module")
def teacher():
    return from_pretrained(resolve_model_path("builtin:teacher_tools"))


def _batch(task: ToolTaskData, prompts: ToolTaskData, cut: int = 0) -> RolloutBatch:
    """The four problems' teacher trajectories in ``task``'s tokens, prompted in ``prompts``'
    (the teacher's, as the router gives them); row :data:`CUT` loses its last ``cut`` tokens.
    The second row's first observation is an error (``R:E;``), as a bad call gets."""
    rows = [task._trajectory_ids(p, h) for p, h in zip(PROBLEMS, HABITS)]
    if cut:
        ids, heard = rows[CUT]
        rows[CUT] = ids[:-cut], heard[:-cut]
    error = task.text_ids("R:E;")
    ids, heard = rows[1]
    start = int(np.argmax(heard))
    stop = start + int(np.argmin(heard[start:]))
    rows[1] = (
        np.concatenate([ids[:start], error, ids[stop:]]).astype(np.int32),
        np.concatenate([heard[:start], np.ones(len(error), bool), heard[stop:]]),
    )
    width = 48
    tokens, environment, student = (np.zeros((len(rows), width), t) for t in (np.int32, bool, bool))
    for row, (ids, heard) in enumerate(rows):
        tokens[row, : len(ids)], environment[row, : len(ids)], student[row, : len(ids)] = ids, heard, ~heard
    prompt, prompt_mask = left_pad(prompts.encode(PROBLEMS), 0, prompts.prompt_slots)
    topk = np.stack([tokens, np.roll(tokens, 1, axis=1), np.full_like(tokens, 5)], -1)  # byte_prefix's support
    return RolloutBatch(
        prompt_tokens=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(tokens),
        response_mask=jnp.asarray(student),
        behavior_logp=jnp.zeros(tokens.shape, jnp.float32),
        token_version=jnp.zeros(tokens.shape, jnp.int32),
        student_topk_ids=jnp.asarray(topk),
        student_topk_behavior_logp=jnp.zeros(topk.shape, jnp.float32),
        environment_mask=jnp.asarray(environment),
    )


def _oracle(pair, teacher, batch: RolloutBatch) -> tuple[np.ndarray, np.ndarray]:
    """``([B, T] the teacher's log-prob of each student token's characters, [B, T] the column
    of the first of them in the character trajectory)``: the trajectory respelled a
    character a token (its stop tokens as EOS, its observations as environment tokens) and
    scored by the same-tokenizer scorer."""
    student, characters = pair[0].tokenizer, pair[1].tokenizer
    tokens, context = np.asarray(batch.response_tokens), np.asarray(batch.context_mask)
    environment = np.asarray(batch.environment_mask)
    b, t = tokens.shape
    chars = np.zeros((b, 96), np.int32)
    heard, said = np.zeros(chars.shape, bool), np.zeros(chars.shape, bool)
    first, width = np.zeros((b, t), np.int64), np.zeros((b, t), np.int64)
    for row in range(b):
        column = 0
        for position in np.flatnonzero(context[row]):
            token = int(tokens[row, position])
            ids = [EOS_ID] if token == EOS_ID else characters.encode(student.decode([token]))
            chars[row, column : column + len(ids)] = ids
            (heard if environment[row, position] else said)[row, column : column + len(ids)] = True
            first[row, position], width[row, position] = column, len(ids)
            column += len(ids)
    respelled = RolloutBatch(
        prompt_tokens=batch.prompt_tokens,
        prompt_mask=batch.prompt_mask,
        response_tokens=jnp.asarray(chars),
        response_mask=jnp.asarray(said),
        behavior_logp=jnp.zeros(chars.shape, jnp.float32),
        token_version=jnp.zeros(chars.shape, jnp.int32),
        environment_mask=jnp.asarray(heard),
    )
    logp = np.asarray(TeacherScorer(teacher, PARAMS).score(respelled).token_logp, np.float64)
    sums = np.zeros((b, t))
    for row, position in zip(*np.nonzero(context)):
        sums[row, position] = logp[row, first[row, position] : first[row, position] + width[row, position]].sum()
    return sums, first


def _retokenizer(pair) -> Retokenizer:
    return Retokenizer.of(pair[0].tokenizer, pair[1].tokenizer, (EOS_ID,))


def test_spans_score_each_turn_after_the_observations_before_it(pair, teacher):
    batch = _batch(*pair)
    want, _ = _oracle(pair, teacher, batch)
    cache = CrossTokenizerTeacher(TeacherScorer(teacher, PARAMS), _retokenizer(pair), context=128).score(batch)
    student, environment = np.asarray(batch.response_mask), np.asarray(batch.environment_mask)
    ends = np.asarray(cache.span_end)
    # the character teacher cuts finer than the student: every student token ends a span, no observation's does
    np.testing.assert_array_equal(ends & (student | environment), student)
    np.testing.assert_allclose(np.asarray(cache.token_logp)[student], want[student], atol=3e-5, rtol=1e-5)
    assert np.isneginf(np.asarray(cache.topk_logp)[environment]).all()
    # the steps rows made two calls: their third turn was scored after both observations
    assert (np.diff(environment.astype(int), axis=1) == 1).sum(axis=1).tolist() == [1, 2, 2, 1]


def test_a_trajectory_cut_inside_its_last_turn_scores_what_it_has(pair, teacher):
    batch = _batch(*pair, cut=2)
    want, _ = _oracle(pair, teacher, batch)
    cache = CrossTokenizerTeacher(TeacherScorer(teacher, PARAMS), _retokenizer(pair), context=128).score(batch)
    student = np.asarray(batch.response_mask)
    np.testing.assert_allclose(np.asarray(cache.token_logp)[student], want[student], atol=3e-5, rtol=1e-5)
    assert np.asarray(cache.span_end)[student].all()


def test_byte_prefixes_score_each_turn_after_the_observations_before_it(pair, teacher):
    """``teacher.mapping: byte_prefix`` on the same trajectories: each student token's
    ``token_logp`` is the teacher's probability of its characters (its EOS: the teacher's EOS)
    after the prompt, the turns and the observations before it."""
    batch = _batch(*pair)
    want, _ = _oracle(pair, teacher, batch)
    pairing = _retokenizer(pair)
    cache = BytePrefixTeacher(PrefixTrees(teacher, pairing.teacher_bytes), pairing, ScoringParams()).score(batch)
    student = np.asarray(batch.response_mask)
    np.testing.assert_allclose(np.asarray(cache.token_logp)[student], np.maximum(want[student], -30.0), atol=3e-5)
    # the sampled id is the support's first: its mass is the token's own where no longer candidate extends it
    sampled = np.asarray(cache.topk_logp)[..., 0][student]
    assert (sampled <= np.asarray(cache.token_logp)[student] + 1e-5).all()


def test_a_served_teacher_of_another_tokenizer_scores_trajectories_as_in_process(pair, teacher):
    """The client re-tokenises turns and observations; ``serve-teacher`` scores the teacher's
    tokens with the observations as context: the same span cache."""
    batch = _batch(*pair)
    local = CrossTokenizerTeacher(TeacherScorer(teacher, PARAMS), _retokenizer(pair), context=128).score(batch)
    with running(BatchScorer(teacher, SETTINGS)) as (url, _, _):
        served = ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=4), PARAMS, 32)
        remote = CrossTokenizerTeacher(served, _retokenizer(pair), context=None).score(batch)
    student = np.asarray(batch.response_mask)
    np.testing.assert_array_equal(np.asarray(remote.span_end)[student], np.asarray(local.span_end)[student])
    np.testing.assert_allclose(np.asarray(remote.token_logp)[student], np.asarray(local.token_logp)[student], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(remote.topk_ids)[student], np.asarray(local.topk_ids)[student])
