"""A teacher of another tokenizer: the student's answers re-tokenised, scored, and mapped back.

:class:`CrossTokenizerTeacher` wraps any teacher (:class:`~asyncopd_jax.teacher.scorer.TeacherScorer`
in-process, :class:`~asyncopd_jax.teacher.client.ServedTeacher` for ``serve-teacher`` or
vLLM / SGLang) and keeps its interface. For each rollout batch it

1. decodes each student answer to its text and re-encodes it with the teacher's tokenizer,
   aligning the two by text spans (:func:`asyncopd_jax.teacher.span_alignment.align_answer`; the
   teacher's prompt is already its own, in its own tokens: the router encodes it);
2. has the wrapped teacher score the teacher-token batch as it would any other;
3. maps the cache back to the student's positions (:attr:`TeacherScoreCache.span_end`):
   each span's ``log q`` (the sum over its teacher tokens) on the span's last student
   token, and the teacher's top-K at each span's first teacher token, mapped to the student
   ids of exactly the same text (none: log q −inf), on the span's first student token.

A multi-turn trajectory (:attr:`~asyncopd_jax.cache.RolloutBatch.environment_mask`) is
aligned turn by turn (:func:`~asyncopd_jax.teacher.span_alignment.join_turns`): each
observation is decoded from the student's tokens and re-encoded with the teacher's, and the
wrapped teacher reads it as context (its ``environment_mask``), so every later turn is
scored after it; no span crosses an observation, and its tokens carry no score.

The learner then reads the cache through :mod:`asyncopd_jax.estimators.spans`; staleness,
recompute and importance weights are per student token as before, summed per span.

Student tokens the teacher cannot score carry no loss: those past an answer's last complete
UTF-8 character (:mod:`asyncopd_jax.teacher.span_alignment`), those of spans that run past the
teacher's context (its prompt + the answer in its tokens; ``context`` below), and those of an
answer whose text the teacher's tokens do not spell (:meth:`Retokenizer.align`). The
learner's metrics count them (``teacher/NAME/unscored_tokens``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.models.token_bytes import TokenBytes, token_bytes
from asyncopd_jax.teacher.scorer import ScoringParams, Teacher, power_of_two
from asyncopd_jax.teacher.span_alignment import AnswerAlignment, SpanAlignment, align_answer, join_turns

Array = jax.Array


def id_map(teacher: TokenBytes, student: TokenBytes, eos: tuple[int, int]) -> np.ndarray:
    """``[V_teacher]`` int64: the student id whose bytes are exactly each teacher id's (−1: none;
    special tokens map to nothing but the two EOS ids, ``eos = (teacher's, student's)``, to
    each other)."""
    table = student.by_bytes
    mapped = np.full(len(teacher.pieces), -1, np.int64)
    for i, piece in enumerate(teacher.pieces):
        if piece and i not in teacher.special:
            mapped[i] = table.get(piece, -1)
    mapped[eos[0]] = eos[1]
    return mapped


def pieces(environment: np.ndarray) -> list[tuple[int, int, bool]]:
    """A trajectory's turns and observations in order: ``(start, stop, is an observation)``
    of each run of equal ``environment`` ``[n]`` (True: an environment's token)."""
    edges = (np.flatnonzero(np.diff(environment.astype(np.int8))) + 1).tolist()
    return [(start, stop, bool(environment[start])) for start, stop in zip([0, *edges], [*edges, environment.size])]


def lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``table[ids]``, −1 for an id past the table (a teacher's embedding padded past its
    tokenizer: those rows are no token)."""
    inside = ids < table.size
    return np.where(inside, table[np.where(inside, ids, 0)], -1)


def distinct(ids: np.ndarray) -> np.ndarray:
    """``ids`` ``[..., K]`` with each repeat of an id (≥ 0) after its first, along the last
    axis, set to −1: two teacher tokens of one text map to one student id, whose mass a
    top-K support may hold once."""
    same = (ids[..., :, None] == ids[..., None, :]) & (ids[..., None, :] >= 0)
    earlier = np.tril(np.ones((ids.shape[-1],) * 2, bool), -1)  # [i, j]: j before i
    return np.where((same & earlier).any(-1), -1, ids)


def _extremes(span_of: np.ndarray, positions: np.ndarray, spans: int) -> tuple[np.ndarray, np.ndarray]:
    """``([spans], [spans])``: the first and last of ``positions`` in each span
    (``span_of[i]`` is position i's span; −1 where a span has none)."""
    first = np.full(spans, np.iinfo(np.int64).max, np.int64)
    last = np.full(spans, -1, np.int64)
    np.minimum.at(first, span_of, positions)
    np.maximum.at(last, span_of, positions)
    return np.where(first == np.iinfo(np.int64).max, -1, first), last


@dataclasses.dataclass(frozen=True)
class Retokenizer:
    """The two tokenizers of a cross-tokenizer pair, and what is read off them once
    (:meth:`of` builds it).

    Attributes:
      student, teacher: the Hugging Face tokenizers.
      student_eos: the student's stop ids (an answer that ends on one stopped).
      teacher_eos: the id the teacher scores "the answer stops here" with.
      student_bytes, teacher_bytes: each tokenizer's bytes per id.
      teacher_to_student: :func:`id_map` of the pair.
    """

    student: Any
    teacher: Any
    student_eos: tuple[int, ...]
    teacher_eos: int
    student_bytes: TokenBytes
    teacher_bytes: TokenBytes
    teacher_to_student: np.ndarray
    _warned: list[bool] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(cls, student: Any, teacher: Any, student_eos: tuple[int, ...]) -> Retokenizer:
        if teacher.eos_token_id is None:
            name = teacher.name_or_path or "(unnamed)"
            raise ValueError(f"teacher tokenizer {name} has no EOS token; a teacher of another tokenizer must have one")
        student_bytes, teacher_bytes = token_bytes(student), token_bytes(teacher)
        teacher_eos = int(teacher.eos_token_id)
        table = id_map(teacher_bytes, student_bytes, (teacher_eos, student_eos[0]))
        return cls(student, teacher, tuple(student_eos), teacher_eos, student_bytes, teacher_bytes, table)

    def align(self, ids: np.ndarray, environment: np.ndarray | None = None) -> AnswerAlignment:
        """One answer's tokens (``[n]``, no padding) aligned to the teacher's tokens; a
        multi-turn trajectory turn by turn, where ``environment`` ``[n]`` marks its
        observations' tokens (module docstring).

        An answer whose text the teacher's tokens do not spell (start-up checked every
        student token alone; a normaliser can still rewrite a sequence of them) is left
        unscored, every token in no span, with a warning the first time: its tokens get no
        loss and count in ``teacher/NAME/unscored_tokens``. A trajectory is left unscored
        whole: its later turns would be scored after a context the teacher did not read."""
        try:
            if environment is None or not environment.any():
                return self._turn(ids, at_start=True)
            parts = []
            for start, stop, heard in pieces(environment):
                piece = ids[start:stop]
                parts.append(self.observation(piece) if heard else self._turn(piece, at_start=start == 0))
            return join_turns(parts)
        except ValueError as err:
            if not self._warned:
                self._warned.append(True)
                logging.getLogger(__name__).warning("%s; the answer is not scored (warned once)", err)
            return AnswerAlignment([], SpanAlignment(np.full(ids.size, -1, np.int32), np.zeros(0, np.int32), 0), "")

    def _turn(self, ids: np.ndarray, at_start: bool) -> AnswerAlignment:
        """A student turn (an answer, or one turn of a trajectory) aligned alone."""
        stopped = bool(ids.size) and int(ids[-1]) in self.student_eos
        return align_answer(
            self.student_bytes,
            self.teacher,
            self.teacher_bytes,
            ids,
            stopped=stopped,
            teacher_eos=self.teacher_eos,
            at_start=at_start,
        )

    def observation(self, ids: np.ndarray) -> AnswerAlignment:
        """An observation's student tokens as the teacher reads them: decoded to text (special
        tokens kept as their text: a chat template's markers) and encoded by the teacher, no
        alignment asked (it is context, never scored)."""
        text = self.student.decode(ids.tolist(), skip_special_tokens=False)
        teacher_ids = self.teacher.encode(text, add_special_tokens=False) if text else []
        return AnswerAlignment.observation(ids.size, list(teacher_ids), text)


class CrossTokenizerTeacher:
    """A :class:`~asyncopd_jax.teacher.scorer.Teacher` whose tokenizer differs from the
    student's (module docstring).

    Args:
      inner: the teacher that scores teacher tokens.
      tokens: the tokenizer pair.
      context: the teacher's positions (its ``max_position_embeddings``): a batch's prompt
        width + answer width in teacher tokens is cut to it (None: not known here, a served
        teacher; nothing is cut).
      name: the teacher's name (errors).
    """

    def __init__(self, inner: Teacher, tokens: Retokenizer, context: int | None, name: str = "teacher"):
        self.inner, self.tokens, self.context, self.name = inner, tokens, context, name
        self.params: ScoringParams = inner.params

    @property
    def last_wait_s(self) -> float | None:
        return self.inner.last_wait_s

    @property
    def last_requests(self) -> int:
        return self.inner.last_requests

    def score(self, batch: RolloutBatch, key: Array | None = None) -> TeacherScoreCache:
        """The span cache of ``batch`` (its prompts: the teacher's, in teacher tokens)."""
        tokens, context = np.asarray(batch.response_tokens), np.asarray(batch.context_mask, bool)
        environment = np.zeros_like(context) if batch.environment_mask is None else np.asarray(batch.environment_mask)
        b, t = tokens.shape
        columns = [np.flatnonzero(context[row]) for row in range(b)]  # each row's student and environment tokens
        alignments = [self.tokens.align(tokens[row, at], environment[row, at]) for row, at in enumerate(columns)]
        room = (self.context or np.iinfo(np.int32).max) - int(np.shape(batch.prompt_tokens)[1])
        if room < 1:
            raise ValueError(
                f"teacher {self.name!r}: its prompt ({np.shape(batch.prompt_tokens)[1]} tokens) fills its context "
                f"({self.context} positions); shorten the teacher's prompt"
            )
        longest = max((len(a.teacher_ids) for a in alignments), default=1)
        width = min(power_of_two(max(longest, 1)), room)  # few compiled shapes; never past the context
        teacher_tokens = np.zeros((b, width), np.int32)
        teacher_mask = np.zeros((b, width), bool)
        teacher_environment = np.zeros((b, width), bool)
        for row, a in enumerate(alignments):
            n = min(len(a.teacher_ids), width)
            teacher_tokens[row, :n], teacher_mask[row, :n] = a.teacher_ids[:n], True
            if a.environment is not None:
                teacher_environment[row, :n] = a.environment[:n]
        scored = self.inner.score(
            RolloutBatch(
                prompt_tokens=batch.prompt_tokens,
                prompt_mask=batch.prompt_mask,
                response_tokens=jnp.asarray(teacher_tokens),
                response_mask=jnp.asarray(teacher_mask & ~teacher_environment),
                behavior_logp=jnp.zeros((b, width), jnp.float32),
                token_version=jnp.zeros((b, width), jnp.int32),
                environment_mask=None if batch.environment_mask is None else jnp.asarray(teacher_environment),
            ),
            key,
        )
        return self._map_back(alignments, jax.device_get(scored), (b, t), width)

    def _map_back(
        self,
        alignments: list[AnswerAlignment],
        scored: TeacherScoreCache,
        shape: tuple[int, int],
        width: int,
    ) -> TeacherScoreCache:
        """The teacher-token cache ``scored`` at the student's positions (module docstring;
        a row's tokens, student and environment, fill its first response columns)."""
        b, t = shape
        store = np.asarray(scored.token_logp).dtype
        token_logp = np.zeros((b, t), np.float32)
        span_end = np.zeros((b, t), bool)
        topk = scored.topk_ids is not None and scored.topk_logp is not None
        k = np.shape(scored.topk_ids)[-1] if scored.topk_ids is not None else 0
        topk_ids = np.zeros((b, t, k), np.int32)
        topk_logp = np.full((b, t, k), -np.inf, np.float32)
        to_student = self.tokens.teacher_to_student
        teacher_logp = np.asarray(scored.token_logp, np.float32)
        teacher_ids = np.asarray(scored.topk_ids) if topk else None
        teacher_topk = np.asarray(scored.topk_logp, np.float32) if topk else None
        for row, a in enumerate(alignments):
            n = a.spans.spans
            # the teacher tokens scored (past the width: cut) that are in a span (not an observation's)
            teacher_at = np.flatnonzero(a.spans.teacher_span[:width] >= 0)
            teacher_span = a.spans.teacher_span[teacher_at]
            # a span whose teacher tokens run past the scored width is not scored
            everything = np.bincount(a.spans.teacher_span[a.spans.teacher_span >= 0], minlength=n)
            complete = np.bincount(teacher_span, minlength=n) == everything
            sums = np.bincount(teacher_span, weights=teacher_logp[row, teacher_at], minlength=n)
            student = np.flatnonzero(a.spans.student_span >= 0)
            span_of = a.spans.student_span[student]
            first, last = _extremes(span_of, student, n)  # each span's first and last student token
            # a span of teacher tokens only (no student bytes) has nothing to train
            scored_spans = np.flatnonzero(complete & (last >= 0))
            token_logp[row, last[scored_spans]] = sums[scored_spans]
            span_end[row, last[scored_spans]] = True
            if teacher_ids is None or teacher_topk is None:
                continue
            at, _ = _extremes(teacher_span, teacher_at, n)  # each span's first teacher token
            starts = scored_spans[at[scored_spans] >= 0]
            ids = distinct(lookup(to_student, teacher_ids[row, at[starts]]))  # [spans, K]
            topk_ids[row, first[starts]] = np.maximum(ids, 0)
            topk_logp[row, first[starts]] = np.where(ids >= 0, teacher_topk[row, at[starts]], -np.inf)
        return TeacherScoreCache(
            token_logp=jnp.asarray(token_logp, store),
            topk_ids=jnp.asarray(topk_ids) if topk else None,
            topk_logp=jnp.asarray(topk_logp, store) if topk else None,
            span_end=jnp.asarray(span_end),
        )


__all__ = ["CrossTokenizerTeacher", "Retokenizer", "id_map", "pieces"]
