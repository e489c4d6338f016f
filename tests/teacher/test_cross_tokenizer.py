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
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher, Retokenizer, id_map
from tests.teacher.test_server import SETTINGS, running
from tests.teacher.test_span_alignment import oracle

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


class Scripted:
    """A teacher that answers a fixed score of each teacher position: log q of teacher token
    u = −(u + 1) / 10, and its top-2 ids (the token itself, ``second``) with log-probs
    (−0.1, −3)."""

    params = ScoringParams(topk=2, chunk_size=64)
    last_wait_s, last_requests = None, 1

    def __init__(self, second: int):
        self.seen: list[np.ndarray] = []
        self.second = second

    def score(self, batch, key=None):
        from asyncopd_jax.cache import TeacherScoreCache

        tokens = np.asarray(batch.response_tokens)
        self.seen.append(tokens[np.asarray(batch.response_mask)])
        b, u = tokens.shape
        logp = np.broadcast_to(-(np.arange(u) + 1) / 10, (b, u)).astype(np.float32)
        ids = np.stack([tokens, np.full_like(tokens, self.second)], -1)
        return TeacherScoreCache(
            token_logp=jnp.asarray(logp),
            topk_ids=jnp.asarray(ids),
            topk_logp=jnp.asarray(np.broadcast_to([-0.1, -3.0], (b, u, 2)), jnp.float32),
        )


def _reverse_pair_batch():
    """``12+34=46`` and EOS written by the character student, for the byte-pair teacher."""
    characters, merges = build_tokenizer("characters"), build_tokenizer("merges")
    ids = characters.encode("12+34=46") + [EOS_ID]
    batch = RolloutBatch(
        prompt_tokens=jnp.ones((1, 3), jnp.int32),
        prompt_mask=jnp.ones((1, 3), bool),
        response_tokens=jnp.asarray([ids + [0, 0]]),
        response_mask=jnp.asarray([[True] * len(ids) + [False, False]]),
        behavior_logp=jnp.zeros((1, len(ids) + 2)),
        token_version=jnp.zeros((1, len(ids) + 2), jnp.int32),
    )
    return characters, merges, batch


def test_spans_past_the_teachers_context_get_no_score():
    """A context of 7 with a prompt of 3 leaves the teacher 4 of its 7 answer tokens (1, 2,
    +3, 4): the spans they close are scored, the rest (=4, 6, EOS) are in no span."""
    characters, merges, batch = _reverse_pair_batch()
    inner = Scripted(second=merges.get_vocab()["7"])
    cache = CrossTokenizerTeacher(inner, Retokenizer.of(characters, merges, (EOS_ID,)), context=7).score(batch)
    assert inner.seen[0].size == 4
    assert np.asarray(cache.span_end[0]).tolist() == [1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]


def test_spans_of_several_student_tokens_put_log_q_on_the_last_and_the_top_k_on_the_first():
    """The reverse pair: a character student under the byte-pair teacher, whose tokens span
    several of the student's. ``12+34=46`` is 1|2|+|3|4|=|4|6 to the student, 1|2|+3|4|=4|6
    to the teacher (each a span but the two of two characters): log q of a span on its
    last student token, the teacher's top-K (mapped) on its first."""
    characters, merges, batch = _reverse_pair_batch()
    inner = Scripted(second=merges.get_vocab()["7"])
    cache = CrossTokenizerTeacher(inner, Retokenizer.of(characters, merges, (EOS_ID,)), context=128).score(batch)
    assert merges.convert_ids_to_tokens(inner.seen[0].tolist()) == ["1", "2", "+3", "4", "=4", "6", "<eos>"]
    ends = np.asarray(cache.span_end[0])
    assert ends.tolist() == [1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0]  # "+3" and "=4" span two student tokens
    np.testing.assert_allclose(np.asarray(cache.token_logp[0])[ends], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7])
    starts = np.isfinite(np.asarray(cache.topk_logp[0])).any(-1)
    assert starts.tolist() == [1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0]  # the top-K on each span's first token
    top = np.asarray(cache.topk_ids[0])[starts]  # the teacher's ids, mapped where a student token spells one
    assert characters.convert_ids_to_tokens(top[:, 0].tolist()) == ["1", "2", "<pad>", "4", "<pad>", "6", "<eos>"]
    assert characters.convert_ids_to_tokens(top[:, 1].tolist()) == ["7"] * 7
    assert np.isneginf(np.asarray(cache.topk_logp[0])[[2, 5], 0]).all()  # "+3", "=4": no character token spells it


def test_an_answer_the_teacher_cannot_spell_is_left_unscored_with_a_warning(caplog):
    """Past the start-up check (each student token alone), an answer whose text the teacher
    cannot spell (here: a byte-level student writing words the character teacher lacks) is
    in no span: no loss, counted as unscored, and the run goes on."""
    from tests.tiny_tokenizers import byte_level_bpe

    student, characters = byte_level_bpe(), build_tokenizer("characters")
    pair = Retokenizer.of(student, characters, (student.eos_token_id,))
    ids = np.asarray(student.encode("the cat") + [student.eos_token_id])
    with caplog.at_level("WARNING"):
        alignment = pair.align(ids)
    assert (alignment.spans.student_span == -1).all() and alignment.teacher_ids == [] and alignment.spans.spans == 0
    assert "spell" in caplog.text and "not scored" in caplog.text
