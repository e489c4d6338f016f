"""Span alignment: a student's answer cut into the smallest pieces both tokenizers agree on.

A student and a teacher of different tokenizers cannot compare token t with token t. They
can compare *spans*: stretches of the answer's text that both cut at the same two places.
With byte offsets from both tokenizations (:mod:`asyncopd_jax.models.token_bytes`), the
boundaries common to both cut the text into the smallest such spans; each span is one or
more student tokens and one or more teacher tokens with exactly the same bytes, so both
models' log-probs of it are their chain-rule sums over their own tokens
(:mod:`asyncopd_jax.estimators.spans`).

The convention, used everywhere a span is read:

* a span ends at a byte offset where a student token and a teacher token both end; spans
  are numbered from 0 in text order and every token belongs to exactly one;
* a token of no bytes (an added token with empty content) belongs to the span that ends
  at or after its offset: to the first span at the start of the text, else to the span it
  closes;
* the answer's end-of-sequence token (when the student stopped on one) is a span of its
  own, paired with the teacher's EOS (:func:`align_answer`), so "the answer stops here"
  is compared as any other span;
* an answer cut at the length limit inside a UTF-8 character (or holding bytes that are
  not UTF-8) is aligned up to the last complete character: the student tokens past it are
  in no span, and the teacher does not score them;
* a multi-turn trajectory is aligned turn by turn (:func:`join_turns`): each student turn
  as an answer of its own (its stop token its EOS span), each observation between them
  re-encoded for the teacher as context, in no span on either side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from asyncopd_jax.models.token_bytes import TokenBytes


@dataclasses.dataclass(frozen=True)
class SpanAlignment:
    """Two tokenizations of one text, cut into common spans.

    Attributes:
      student_span: ``[Ts]`` int32, the span of each student token (−1: in no span).
      teacher_span: ``[Tt]`` int32, the span of each teacher token.
      spans: how many spans.
    """

    student_span: np.ndarray
    teacher_span: np.ndarray
    spans: int


def align_spans(student_lengths: ArrayLike, teacher_lengths: ArrayLike) -> SpanAlignment:
    """The smallest common spans of two tokenizations of one text.

    Args:
      student_lengths: ``[Ts]`` bytes of each student token (≥ 0).
      teacher_lengths: ``[Tt]`` bytes of each teacher token (≥ 0), the same total.

    Returns:
      The :class:`SpanAlignment` (the module's convention): span ``k`` runs from the
      ``k``-th to the ``k+1``-th byte offset at which both a student and a teacher token
      end (offset 0 first).

    Raises:
      ValueError: the two do not cover the same number of bytes.
    """
    student_lengths, teacher_lengths = np.asarray(student_lengths, np.int64), np.asarray(teacher_lengths, np.int64)
    if (student_lengths < 0).any() or (teacher_lengths < 0).any():
        raise ValueError("token lengths must be >= 0")
    student_end, teacher_end = np.cumsum(student_lengths), np.cumsum(teacher_lengths)
    total = int(student_end[-1]) if student_end.size else 0
    if total != (int(teacher_end[-1]) if teacher_end.size else 0):
        raise ValueError(
            f"the two tokenizations cover different texts: {total} bytes (student) vs "
            f"{int(teacher_end[-1]) if teacher_end.size else 0} (teacher)"
        )
    common = np.intersect1d(student_end, teacher_end)
    common = common[common > 0]  # offset 0 opens the first span; it closes none
    if not common.size:  # an empty text: its tokens (of no bytes), if any, are one span
        spans = int(bool(student_lengths.size or teacher_lengths.size))
        return SpanAlignment(np.zeros(student_lengths.size, np.int32), np.zeros(teacher_lengths.size, np.int32), spans)
    # the span of a token: the first common boundary at or after its end
    return SpanAlignment(
        np.searchsorted(common, student_end, side="left").astype(np.int32),
        np.searchsorted(common, teacher_end, side="left").astype(np.int32),
        int(common.size),
    )


@dataclasses.dataclass(frozen=True)
class AnswerAlignment:
    """One answer, tokenised by the teacher and aligned to the student's tokens.

    Attributes:
      teacher_ids: the teacher's tokens of the answer (its EOS last where the student
        stopped on one).
      spans: the :class:`SpanAlignment` of the student's answer tokens (EOS included) and
        ``teacher_ids``.
      text: the answer's text, as the teacher read it.
      environment: ``[Tt]`` bool, the teacher tokens an environment wrote (a multi-turn
        trajectory's observations, :func:`join_turns`; in no span), or None: none.
    """

    teacher_ids: list[int]
    spans: SpanAlignment
    text: str
    environment: np.ndarray | None = None

    @classmethod
    def observation(cls, student_tokens: int, teacher_ids: list[int], text: str) -> AnswerAlignment:
        """An environment's observation in a trajectory: ``student_tokens`` of the student's
        and its ``teacher_ids``, context on both sides and in no span."""
        n = len(teacher_ids)
        spans = SpanAlignment(np.full(student_tokens, -1, np.int32), np.full(n, -1, np.int32), 0)
        return cls(list(teacher_ids), spans, text, np.ones(n, bool))


def join_turns(parts: list[AnswerAlignment]) -> AnswerAlignment:
    """A multi-turn trajectory's alignment from its pieces in order: each student turn
    aligned alone (:func:`align_answer`) and each observation
    (:meth:`AnswerAlignment.observation`). The spans are numbered on across the pieces, so a
    span never crosses an observation: the two tokenisations meet at every turn's boundary,
    where the environment's tokens cut both."""
    student_span, teacher_span, environment = [], [], []
    spans = 0
    for part in parts:
        s, t = part.spans.student_span, part.spans.teacher_span
        student_span.append(np.where(s >= 0, s + spans, -1))
        teacher_span.append(np.where(t >= 0, t + spans, -1))
        environment.append(part.environment if part.environment is not None else np.zeros(t.size, bool))
        spans += part.spans.spans
    ids = [i for part in parts for i in part.teacher_ids]
    joined = SpanAlignment(
        np.concatenate(student_span).astype(np.int32), np.concatenate(teacher_span).astype(np.int32), spans
    )
    return AnswerAlignment(ids, joined, "".join(part.text for part in parts), np.concatenate(environment))


def answer_text(student: TokenBytes, ids: ArrayLike, at_start: bool = True) -> tuple[bytes, np.ndarray]:
    """The bytes of an answer's tokens (no EOS) and ``[n]`` each token's share of them.

    A SentencePiece-style student's first ``▁`` is the encoder's, not the answer's: it is
    dropped from the first token that holds it (as ``tokenizer.decode`` does), where the
    tokens start the text (``at_start``; a later turn of a trajectory does not)."""
    lengths = student.lengths(ids)
    data = student.join(ids)
    text = student.at_text_start(data) if at_start else data
    if len(text) < len(data):
        lengths[int(np.argmax(lengths > 0))] -= 1
    return text, lengths


def valid_prefix(data: bytes) -> int:
    """Bytes of ``data``'s longest prefix that is UTF-8 text."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as err:
        return err.start


def teacher_tokens(teacher: Any, teacher_bytes: TokenBytes, text: str) -> tuple[list[int], np.ndarray]:
    """The teacher's tokens of ``text`` (no special tokens added) and ``[n]`` the bytes of
    the text each one holds.

    A tokenizer that adds a space before the text (SentencePiece's ``▁`` prefix, a byte-level
    ``add_prefix_space``) has it counted in no token: the first token that holds it loses a
    byte.

    Raises:
      ValueError: the teacher's tokens do not spell ``text`` (a normaliser that rewrites
        text, e.g. lower-casing or NFKC), naming the tokenizer.
    """
    ids = list(teacher.encode(text, add_special_tokens=False)) if text else []
    data, lengths = teacher_bytes.join(ids), teacher_bytes.lengths(ids)
    extra = prefix_space(data, text.encode("utf-8"))
    if extra:
        lengths[int(np.argmax(lengths > 0))] -= 1
    elif extra is None:
        raise ValueError(
            f"teacher tokenizer {teacher_bytes.name}: its tokens of {text[:40]!r} spell {data[:40]!r}, not the text "
            "(a character outside its vocabulary, or a normaliser that rewrites text); allowed across tokenizers: a "
            "teacher whose tokens spell every text the student writes"
        )
    return ids, lengths


def unspellable(student: TokenBytes, teacher: Any, teacher_bytes: TokenBytes) -> list[str]:
    """The texts of the student's tokens (non-special, whole UTF-8 characters) whose teacher
    tokens do not spell them (a character outside the teacher's vocabulary, a normaliser):
    answers holding one could not be scored. A start-up check, on the whole vocabulary at
    once (one batched encode)."""
    texts = []
    for i, piece in enumerate(student.pieces):
        if piece and i not in student.special and valid_prefix(piece) == len(piece):
            texts.append(piece.decode("utf-8"))
    texts = sorted(set(texts))
    if not texts:
        return []
    encoded = teacher(texts, add_special_tokens=False)["input_ids"]
    missing = []
    for text, ids in zip(texts, encoded):
        if prefix_space(teacher_bytes.join(ids), text.encode("utf-8")) is None:
            missing.append(text)
    return missing


def prefix_space(data: bytes, text: bytes) -> int | None:
    """How many bytes a tokenizer's tokens ``data`` hold before ``text`` that are not its:
    0 (they spell it), 1 (the tokenizer's own prefix space: SentencePiece's ``▁``, a
    byte-level ``add_prefix_space``), or None (they do not spell it)."""
    if data == text:
        return 0
    return 1 if data == b" " + text else None


def align_answer(
    student: TokenBytes,
    teacher: Any,
    teacher_bytes: TokenBytes,
    ids: ArrayLike,
    *,
    stopped: bool,
    teacher_eos: int,
    at_start: bool = True,
) -> AnswerAlignment:
    """Align one student answer to the teacher's tokenisation of its text.

    Args:
      student: the student tokenizer's bytes.
      teacher: the teacher's Hugging Face tokenizer (it encodes the text).
      teacher_bytes: its :class:`TokenBytes`.
      ids: the student's answer tokens, its EOS last when ``stopped``.
      stopped: the answer ends with the student's EOS (else it was cut at the limit).
      teacher_eos: the id the teacher's EOS span holds.
      at_start: the answer starts the text (:func:`answer_text`); False for a trajectory's
        later turns.

    Returns:
      The :class:`AnswerAlignment`; student tokens past the answer's last complete UTF-8
      character are in no span (span −1).
    """
    ids = np.asarray(ids)
    body = ids[:-1] if stopped else ids
    data, lengths = answer_text(student, body, at_start)
    keep = valid_prefix(data)
    ends = np.cumsum(lengths)
    whole = int(np.searchsorted(ends, keep, side="right"))  # tokens that end inside the text
    # a token holding the end of the text and bytes past it (an invalid byte after a character)
    # cannot be split: the text stops where the last whole token stops
    keep = int(ends[whole - 1]) if whole else 0
    text = data[:keep].decode("utf-8")
    teacher_ids, teacher_lengths = teacher_tokens(teacher, teacher_bytes, text)
    aligned = align_spans(lengths[:whole], teacher_lengths)
    student_span = np.full(ids.size, -1, np.int32)
    student_span[:whole] = aligned.student_span
    teacher_span, spans = aligned.teacher_span, aligned.spans
    if stopped and whole == body.size:  # the EOS span (an answer cut short of its end has none)
        student_span[-1] = spans
        teacher_ids = [*teacher_ids, teacher_eos]
        teacher_span = np.append(teacher_span, spans).astype(np.int32)
        spans += 1
    return AnswerAlignment(teacher_ids, SpanAlignment(student_span, teacher_span, spans), text)


__all__ = [
    "prefix_space",
    "unspellable",
    "AnswerAlignment",
    "SpanAlignment",
    "align_answer",
    "align_spans",
    "answer_text",
    "join_turns",
    "teacher_tokens",
    "valid_prefix",
]
