"""``POST /v1/byte_prefix``: the teacher's side of ``teacher.mapping: byte_prefix``
(:class:`~asyncopd_jax.teacher.prefix_trees.PrefixTrees`) answered by ``asyncopd
serve-teacher``, and the client that asks it (:class:`ServedPrefixTrees`).

The run keeps the student's side (both tokenizers, the student's ids and the cache); only
teacher token ids and candidate bytes cross the wire. A request (JSON)::

    {"model": "teacher", "temperature": 1.0,
     "sequences": [[ids…], …],                  # each answer's teacher sequence
     "contexts": [[row, length] | [row, [ids…]], …],   # a prefix of sequence row, or its own ids
     "top": m}                                  # each context's m likeliest next ids, or
     "candidates": [["<base64 bytes>" | id, …], …]     # each context's candidates

A candidate is its bytes, base64 (``""``: not scored), or a teacher id scored as itself (the
EOS). The answer is one ``.npz`` body (:mod:`asyncopd_jax.npz`): ``ids`` ``[n, m]`` int64 and
``logprobs`` ``[n, m]`` for ``top``; ``logprobs`` ``[n, C]`` float64 (−inf past a context's
candidates) and ``rows`` (the tree rows of each level) for ``candidates``. The server keeps
the last request's forward, so a batch's two requests run its answers once when no other
request comes between them. A batch of more answers than the server takes in one request
(its ``--max-request-rows``, on its ``/v1/models`` card) goes in several, each with the
contexts of its answers; then its answers run twice where ``top`` is asked.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncopd_jax.npz import npz_bytes
from asyncopd_jax.teacher import wire
from asyncopd_jax.teacher.batch_scorer import BadRequest, bounded_int, vocab_ids
from asyncopd_jax.teacher.byte_prefix import Candidate
from asyncopd_jax.teacher.prefix_trees import Context, PrefixTrees
from asyncopd_jax.teacher.wire import ServerError

if TYPE_CHECKING:
    from asyncopd_jax.teacher.client import ServedTeacher

PATH = "/v1/byte_prefix"

#: The most candidates one context may ask to score (a student's top-K and its sampled token).
MAX_CANDIDATES = 1024

#: The most contexts one request may hold.
MAX_CONTEXTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PrefixRequest:
    """A parsed ``/v1/byte_prefix`` request: ``top`` or ``asked``, not both."""

    sequences: list[list[int]]
    contexts: list[Context]
    top: int | None
    asked: list[list[Candidate]] | None


def request_body(
    model: str,
    temperature: float,
    sequences: list[list[int]],
    contexts: Sequence[Context],
    *,
    top: int | None = None,
    asked: Sequence[Sequence[Candidate]] | None = None,
) -> dict[str, Any]:
    """The JSON body of a request (module docstring): each context sent as a length where it
    is a prefix of its sequence."""
    body: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "sequences": [list(map(int, s)) for s in sequences],
        "contexts": [
            [row, len(ids)] if list(sequences[row][: len(ids)]) == list(ids) else [row, list(map(int, ids))]
            for row, ids in contexts
        ],
    }
    if top is not None:
        body["top"] = top
    if asked is not None:
        body["candidates"] = [
            [base64.b64encode(c).decode() if isinstance(c, bytes) else int(c) for c in cands] for cands in asked
        ]
    return body


def parse_prefix_request(
    body: Any, model: str, temperature: float, max_sequences: int, vocab_size: int, context: int
) -> PrefixRequest:
    """A :class:`PrefixRequest` from a JSON body, or a :class:`~asyncopd_jax.teacher.batch_scorer.BadRequest`
    naming the field at fault (each checked for its type and bounds before it is used)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - {"model", "temperature", "sequences", "contexts", "top", "candidates"})
    if unknown:
        raise BadRequest(f"{unknown[0][:40]} is not a field of {PATH}")
    if body.get("model") not in (None, model):
        raise BadRequest(f"model {str(body['model'])[:80]!r} is not served here; this server serves {model!r}")
    given = body.get("temperature")
    if given is not None and (not wire.is_json_number(given) or given != temperature):
        raise BadRequest(f"temperature {str(given)[:40]}: this server scores at temperature {temperature:g} only")
    sequences = body.get("sequences")
    if not isinstance(sequences, list) or not 0 < len(sequences) <= max_sequences:
        raise BadRequest(f"sequences must be a list of 1 to {max_sequences} token-id lists", 413)
    checked: list[list[int]] = []
    for i, ids in enumerate(sequences):
        if not isinstance(ids, list) or not 0 < len(ids) <= context:
            raise BadRequest(f"sequences[{i}] must be a list of 1 to {context} token ids (the model's context)")
        checked.append(vocab_ids(ids, vocab_size, f"sequences[{i}]").tolist())
    contexts = [_context(i, c, checked, vocab_size, context) for i, c in enumerate(_list(body, "contexts"))]
    top, candidates = body.get("top"), body.get("candidates")
    if (top is None) == (candidates is None):
        raise BadRequest("give one of top (the likeliest next ids) and candidates (the byte prefixes to score)")
    if top is not None:
        return PrefixRequest(checked, contexts, bounded_int("top", top, 1, vocab_size), None)
    asked = [_candidates(i, c, vocab_size) for i, c in enumerate(_list(body, "candidates"))]
    if len(asked) != len(contexts):
        raise BadRequest(f"candidates must list one candidate list per context ({len(contexts)}), got {len(asked)}")
    return PrefixRequest(checked, contexts, None, asked)


def answer(trees: PrefixTrees, request: PrefixRequest) -> bytes:
    """The ``.npz`` answer to ``request`` (module docstring)."""
    if request.top is not None:
        ids, logp = trees.top(request.sequences, request.contexts, request.top)
        return npz_bytes({"ids": ids, "logprobs": logp})
    assert request.asked is not None
    logp = trees.prefixes(request.sequences, request.contexts, request.asked)
    return npz_bytes({"logprobs": logp, "rows": np.asarray(trees.last_levels, np.int64)})


def _list(body: dict, field: str) -> list:
    values = body.get(field)
    if not isinstance(values, list) or not 0 < len(values) <= MAX_CONTEXTS:
        raise BadRequest(f"{field} must be a list of 1 to {MAX_CONTEXTS} entries")
    return values


def _context(i: int, value: Any, sequences: list[list[int]], vocab_size: int, context: int) -> Context:
    """Context ``i``: ``[row, length]`` (a prefix of sequence ``row``) or ``[row, [ids…]]``."""
    where = f"contexts[{i}]"
    if not isinstance(value, list) or len(value) != 2:
        raise BadRequest(f"{where} must be [row, length] or [row, [ids]]")
    row = bounded_int(f"{where}[0]", value[0], 0, len(sequences) - 1)
    if isinstance(value[1], list):
        if not 0 < len(value[1]) <= context:
            raise BadRequest(f"{where}[1] must list 1 to {context} token ids (the model's context)")
        return row, vocab_ids(value[1], vocab_size, f"{where}[1]").tolist()
    return row, sequences[row][: bounded_int(f"{where}[1]", value[1], 1, len(sequences[row]))]


def _candidates(i: int, values: Any, vocab_size: int) -> list[Candidate]:
    """Context ``i``'s candidates: base64 bytes, or a teacher id."""
    where = f"candidates[{i}]"
    if not isinstance(values, list) or len(values) > MAX_CANDIDATES:
        raise BadRequest(f"{where} must be a list of at most {MAX_CANDIDATES} candidates")
    out: list[Candidate] = []
    for k, value in enumerate(values):
        if isinstance(value, str):
            try:
                out.append(base64.b64decode(value, validate=True))
            except (binascii.Error, ValueError):
                raise BadRequest(f"{where}[{k}] is not base64: {value[:40]!r}") from None
        else:
            out.append(bounded_int(f"{where}[{k}]", value, 0, vocab_size - 1))
    return out


class ServedPrefixTrees:
    """:class:`~asyncopd_jax.teacher.prefix_trees.PrefixTrees`' two calls answered by a
    server (``teacher.server.api: asyncopd``), through ``teacher``'s HTTP client (its
    retries, its model name)."""

    def __init__(self, teacher: ServedTeacher, temperature: float):
        self.teacher, self.temperature = teacher, temperature
        self.last_rows = 0
        self.requests = 0  # /v1/byte_prefix requests answered, over its life (retries not counted)

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting to retry the server, over the client's life."""
        return self.teacher.stats.wait_s

    def top(self, sequences: list[list[int]], contexts: Sequence[Context], m: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`PrefixTrees.top`, asked of the server."""
        ids_out, logp_out = np.zeros((len(contexts), 0), np.int64), np.zeros((len(contexts), 0))
        for part, (rows, mine) in self._parts(sequences, contexts):
            arrays = self._ask(request_body(self._model(), self.temperature, rows, mine, top=m))
            ids, logp = arrays.get("ids"), arrays.get("logprobs")
            if not (isinstance(ids, np.ndarray) and isinstance(logp, np.ndarray)) or ids.shape != logp.shape:
                raise ServerError(f"teacher server {self._where()} answered {sorted(arrays)}, not ids and logprobs")
            self._check(logp, len(mine), m, exact=False)
            if not ids_out.shape[1]:
                ids_out = np.zeros((len(contexts), ids.shape[1]), np.int64)
                logp_out = np.zeros((len(contexts), ids.shape[1]))
            ids_out[part], logp_out[part] = ids, logp
        self.last_rows = len(contexts)
        return ids_out, logp_out

    def prefixes(
        self, sequences: list[list[int]], contexts: Sequence[Context], asked: Sequence[Sequence[Candidate]]
    ) -> np.ndarray:
        """:meth:`PrefixTrees.prefixes`, asked of the server."""
        out = np.full((len(contexts), max((len(c) for c in asked), default=0)), -np.inf)
        self.last_rows = 0
        for part, (rows, mine) in self._parts(sequences, contexts):
            theirs = [asked[i] for i in part]
            arrays = self._ask(request_body(self._model(), self.temperature, rows, mine, asked=theirs))
            logp, levels = arrays.get("logprobs"), arrays.get("rows")
            if not (isinstance(logp, np.ndarray) and isinstance(levels, np.ndarray)):
                raise ServerError(f"teacher server {self._where()} answered {sorted(arrays)}, not logprobs and rows")
            self._check(logp, len(mine), max((len(c) for c in theirs), default=0), exact=True)
            out[part, : logp.shape[1]] = logp
            self.last_rows += int(levels.sum())
        return out

    def _parts(
        self, sequences: list[list[int]], contexts: Sequence[Context]
    ) -> Iterator[tuple[list[int], tuple[list[list[int]], list[Context]]]]:
        """The batch in requests of at most the server's rows a request: each part's context
        indices, and its sequences and contexts (rows counted within the part)."""
        size = self.teacher.request_rows()
        for first in range(0, len(sequences), size):
            part = [i for i, (row, _) in enumerate(contexts) if first <= row < first + size]
            if part:
                yield part, (sequences[first : first + size], [(contexts[i][0] - first, contexts[i][1]) for i in part])

    def _ask(self, body: dict) -> dict:
        arrays = self.teacher.post(PATH, body)
        self.requests += 1
        if not isinstance(arrays, dict) or not all(isinstance(a, np.ndarray) for a in arrays.values()):
            raise ServerError(f"teacher server {self._where()} answered {str(arrays)[:120]}, not an .npz body")
        return arrays

    def _check(self, logp: np.ndarray, n: int, width: int, exact: bool) -> None:
        """A :class:`ServerError` unless ``logp`` is ``[n, width]`` (``[n, ≤ width]`` unless
        ``exact``) of log-probs (≤ 0, not NaN)."""
        shape_ok = (
            logp.ndim == 2 and logp.shape[0] == n and (logp.shape[1] == width if exact else logp.shape[1] <= width)
        )
        if not shape_ok or np.isnan(logp).any() or (logp > 1e-4).any():
            raise ServerError(
                f"teacher server {self._where()} answered log-probs of shape {list(logp.shape)}; expected [{n}, "
                f"{'' if exact else '<= '}{width}] log-probs (<= 0)"
            )

    def _model(self) -> str:
        return self.teacher.model_name()

    def _where(self) -> str:
        return f"{self.teacher.server.url}{PATH}"
