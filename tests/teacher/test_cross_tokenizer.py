"""A teacher of another tokenizer: the built-in character teacher scoring answers of the
byte-pair (``merges``) student, in-process and behind ``asyncopd serve-teacher``; the span
cache checked against the teacher's own per-character scores and the two-pointer oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.models.token_bytes import token_bytes
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.tasks.arith import sample_problems
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.builtin import TaskData
from asyncopd_jax.tasks.tokenizer import EOS_ID, build_tokenizer
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher, Retokenizer, id_map
from asyncopd_jax.teacher.served import ServedTeacher, ServerParams
from asyncopd_jax.teacher.service import BatchScorer
from tests.teacher.test_server import SETTINGS, running
from tests.teacher.test_spans import oracle

PARAMS = ScoringParams(topk=4, chunk_size=64)
T = 24  # student answer slots


@pytest.fixture(scope="module")
def pair():
    return build_tokenizer("merges"), build_tokenizer("characters")


@pytest.fixture(scope="module")
def teacher():
    return from_pretrained(resolve_model_path("builtin:teacher"))


@pytest.fixture(scope="module")
def answers(pair):
    """Six answers of the student in its tokens: whole solutions ending on EOS, one cut at
    the length limit (no EOS), one empty but for the EOS; and each one's teacher prompt in
    the teacher's tokens (the router's job in a run), as a RolloutBatch."""
    student, characters = pair
    problems = sample_problems(np.random.default_rng(0), 6, 3, 99, held_out=False)
    texts = [p.solution(tuple(range(3))) for p in problems]
    ids = [student.encode(text) + [EOS_ID] for text in texts]
    ids[3] = ids[3][:7]  # cut at the limit
    ids[5] = [EOS_ID]
    tokens, mask = np.zeros((6, T), np.int32), np.zeros((6, T), bool)
    for row, answer in enumerate(ids):
        tokens[row, : len(answer)], mask[row, : len(answer)] = answer, True
    task = TaskData(TaskConfig(), characters)
    prompts, prompt_mask = left_pad(task.encode(problems), 0, task.prompt_slots)
    return RolloutBatch(
        prompt_tokens=jnp.asarray(prompts),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(tokens),
        response_mask=jnp.asarray(mask),
        behavior_logp=jnp.zeros((6, T), jnp.float32),
        token_version=jnp.zeros((6, T), jnp.int32),
    )


def cross(pair, inner) -> CrossTokenizerTeacher:
    student, characters = pair
    return CrossTokenizerTeacher(inner, Retokenizer.of(student, characters, (EOS_ID,)), context=128)


def per_character(pair, teacher, answers):
    """The oracle's side: each answer spelled in the teacher's characters (EOS kept where the
    student stopped), scored by the plain in-process scorer; with each answer's student and
    teacher token lengths in bytes."""
    student, characters = pair
    s_bytes, t_bytes = token_bytes(student), token_bytes(characters)
    mask = np.asarray(answers.response_mask)
    chars, lengths = [], []
    for row in range(mask.shape[0]):
        ids = np.asarray(answers.response_tokens)[row][mask[row]]
        stopped = ids[-1] == EOS_ID
        body = ids[:-1] if stopped else ids
        text = s_bytes.join(body).decode()
        teacher_ids = characters.encode(text) + ([EOS_ID] if stopped else [])
        chars.append(teacher_ids)
        lengths.append((s_bytes.lengths(body).tolist(), t_bytes.lengths(characters.encode(text)).tolist(), stopped))
    width = 64
    tokens, tmask = np.zeros((len(chars), width), np.int32), np.zeros((len(chars), width), bool)
    for row, ids in enumerate(chars):
        tokens[row, : len(ids)], tmask[row, : len(ids)] = ids, True
    batch = RolloutBatch(
        prompt_tokens=answers.prompt_tokens,
        prompt_mask=answers.prompt_mask,
        response_tokens=jnp.asarray(tokens),
        response_mask=jnp.asarray(tmask),
        behavior_logp=jnp.zeros((len(chars), width), jnp.float32),
        token_version=jnp.zeros((len(chars), width), jnp.int32),
    )
    return TeacherScorer(teacher, PARAMS).score(batch), lengths


def test_the_span_cache_is_the_teachers_per_character_scores_summed_and_mapped(pair, teacher, answers):
    student, characters = pair
    got = cross(pair, TeacherScorer(teacher, PARAMS)).score(answers)
    want, lengths = per_character(pair, teacher, answers)
    mask = np.asarray(answers.response_mask)
    to_student = {i: student.get_vocab()[tok] for tok, i in characters.get_vocab().items() if len(tok) == 1}
    to_student[EOS_ID] = EOS_ID
    for row, (s_len, t_len, stopped) in enumerate(lengths):
        s_span, t_span, spans = oracle(s_len, t_len)
        if stopped:  # the EOS span, of one token on each side
            s_span, t_span, spans = [*s_span, spans], [*t_span, spans], spans + 1
        ends = np.zeros(T, bool)
        logp = np.zeros(T)
        teacher_logp = np.asarray(want.token_logp[row], np.float64)
        for k in range(spans):
            positions = [t for t, s in enumerate(s_span) if s == k]
            ends[positions[-1]] = True
            logp[positions[-1]] = sum(teacher_logp[u] for u, s in enumerate(t_span) if s == k)
            first = [u for u, s in enumerate(t_span) if s == k][0]
            np.testing.assert_array_equal(  # every character (and EOS) is a student token too
                np.asarray(got.topk_ids[row, positions[0]]),
                [to_student.get(int(i), 0) for i in np.asarray(want.topk_ids[row, first])],
            )
        np.testing.assert_array_equal(np.asarray(got.span_end[row]) & mask[row], ends)
        np.testing.assert_allclose(np.where(ends, np.asarray(got.token_logp[row]), 0.0), logp, atol=2e-5, rtol=1e-5)
    # a character teacher cuts finer than the student: every student token ends a span
    np.testing.assert_array_equal(np.asarray(got.span_end) & mask, mask)
    assert np.asarray(got.span_end)[5, 0]  # an answer of only EOS: one span


def test_unmapped_and_padded_teacher_ids_hold_minus_inf(pair, teacher, answers):
    """The teacher's embedding has 32 rows for 19 tokens: an id past its tokenizer, or one no
    student token spells, holds log q = −inf in the mapped top-K (it was never a student id)."""
    student, characters = pair
    table = id_map(token_bytes(characters), token_bytes(student), (EOS_ID, EOS_ID))
    assert table[characters.get_vocab()["<pad>"]] == -1 and table[EOS_ID] == EOS_ID
    wide = cross(pair, TeacherScorer(teacher, ScoringParams(topk=30, chunk_size=64))).score(answers)
    logp, ids = np.asarray(wide.topk_logp), np.asarray(wide.topk_ids)
    starts = np.isfinite(logp).any(-1)
    assert np.isneginf(logp[starts]).any()  # 30 of 32 rows: some are padding or <pad>/<unk>
    assert (ids[np.isneginf(logp)] == 0).all()


def test_a_served_teacher_of_another_tokenizer_scores_as_in_process(pair, teacher, answers):
    """The same span cache when the character teacher is behind ``asyncopd serve-teacher``:
    the client re-tokenises, the server scores the teacher's tokens."""
    local = cross(pair, TeacherScorer(teacher, PARAMS)).score(answers)
    with running(BatchScorer(teacher, SETTINGS)) as (url, _, _):
        served = ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=4), PARAMS, 32)
        remote = cross(pair, served).score(answers)
    mask = np.asarray(answers.response_mask)
    np.testing.assert_array_equal(np.asarray(remote.span_end) & mask, np.asarray(local.span_end) & mask)
    ends = np.asarray(local.span_end) & mask
    np.testing.assert_allclose(np.asarray(remote.token_logp)[ends], np.asarray(local.token_logp)[ends], atol=1e-5)
    starts = np.isfinite(np.asarray(local.topk_logp)).any(-1) & mask
    np.testing.assert_array_equal(np.asarray(remote.topk_ids)[starts], np.asarray(local.topk_ids)[starts])
    np.testing.assert_allclose(np.asarray(remote.topk_logp)[starts], np.asarray(local.topk_logp)[starts], atol=1e-5)
