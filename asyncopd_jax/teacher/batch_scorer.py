"""What ``asyncopd serve-teacher`` answers, apart from HTTP: a request's JSON body parsed and
checked (:func:`parse_request`), its rows scored in a batch with others
(:class:`BatchScorer`), and the answer's JSON (:func:`answer`). The ASGI app and the
batcher that join them: :mod:`asyncopd_jax.teacher.server`.

``POST /v1/completions`` takes vLLM's body and answers as vLLM does: per row,
``prompt_logprobs`` with None at position 0 and ``{"<id>": {"logprob", "rank",
"decoded_token"}}`` after it (the top-K and the actual token; ``rank`` is null for an actual
token outside the top-K, and ``decoded_token`` is null: the server has no tokenizer).

The body: a JSON object (strict JSON: ``NaN`` and ``Infinity`` are refused), where ``null``
is an absent field and fields other than these are ignored (vLLM's ``max_tokens`` …):

* ``prompt`` (required): a non-empty list of rows, a row a non-empty list of token ids
  (JSON integers from 0 to V − 1; ``true`` and ``1.5`` are not ids); one flat list of ids
  is one row. At most ``max_request_rows`` rows, each at most the model's context (413).
* ``prompt_logprobs`` (required): K, an integer from 0 to ``max_topk``.
* ``model``: the served name. ``temperature``: a number, the server's own.

The extension, a field ``"asyncopd"`` (an object; non-empty, it switches the answer to the
extension's form), asks for the response positions only and for more than a top-K::

    "asyncopd": {"response_start": [P_0, …],         # row i's response starts at position P_i
                 "candidate_ids": [[[id, …], …], …],  # per row, per response position: N ids
                 "student_topk_ids": …,               # the same for the student's top-K
                 "num_samples": M, "seed": s,         # M ids sampled from the teacher
                 "hidden": "bfloat16",                # the teacher's final hidden states too
                 "encoding": "base64",                # arrays as base64 or "npy" (default "json": lists)
                 "pad_to": [P, T]}                    # pad prompts to P, responses to T positions

* ``response_start``: one integer per row, 1 ≤ P_i ≤ the row's length (default 1): row i
  is scored at its t_i = length − P_i positions from P_i on.
* ``candidate_ids``, ``student_topk_ids``: one entry per row, t_i lists of N ids each
  (1 ≤ N ≤ 1024, the same N at every position of every row; so a row with t_i = 0
  cannot carry them).
* ``num_samples``: M, an integer from 0 to 1024; ``seed``: an integer from 0 to 2³² − 1.
* ``hidden``: ``"float32"`` or ``"bfloat16"``: the answer also carries the teacher's final
  hidden states at the response positions (what its LM head reads, after the final norm),
  in that dtype, for a learner that applies the head itself (the exact KL over the whole
  vocabulary; the head: ``GET /v1/head``).
* ``encoding``: ``"json"``, ``"base64"`` or ``"npy"``.
* ``pad_to``: two integers, at least the longest P_i and t_i sent and at most the model's
  context together. It lets a client whose batches have fixed widths (the scoring
  stage's prompt slots and scored columns) have them scored at those widths rather than
  at the powers of two the server otherwise pads to (one compiled program per width: the
  client's to bound).
* no other field.

Each choice then carries ``"asyncopd"`` in place of ``prompt_logprobs``: per row,
``token_logprobs`` ``[t]`` (log q of each response token), ``topk_ids`` /
``topk_logprobs`` ``[t, K]``, and those asked: ``candidate_logprobs`` ``[t, N]``,
``student_topk_logprobs`` ``[t, Ks]``, ``sample_ids`` / ``sample_logprobs`` ``[t, M]``,
``hidden_states`` ``[t, H]``. With ``"encoding": "json"`` each array is nested lists of
numbers; with ``"base64"`` an object ``{"dtype": "<f4" | "<i4", "shape", "data"}``: the
array's little-endian bytes in base64 (:func:`encode_array`; float32 log-probs are what the
score cache stores, so nothing is lost); with ``"npy"`` the whole answer is a binary body
(``application/octet-stream``): an ``.npz`` archive (:mod:`asyncopd_jax.npz`) holding
row i's arrays as ``"<i>/<name>"``, each in its own dtype (bfloat16 hidden states as
bfloat16: half the bytes of base64's float32, and no base64 inflation).

A body that breaks these rules is answered 400 (413 where it is too large: the body past
``max_body_bytes``, too many rows, a row past the context) with one line naming the field.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.models.hf_checkpoint import head_digest
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.npz import npz_bytes
from asyncopd_jax.teacher import wire
from asyncopd_jax.teacher.scorer import ScoringParams, power_of_two, teacher_score_function

#: The body fields of the extension a request may carry.
EXTENSION_FIELDS = (
    "response_start",
    "candidate_ids",
    "student_topk_ids",
    "num_samples",
    "seed",
    "hidden",
    "encoding",
    "pad_to",
)

#: ``asyncopd.encoding``'s values: arrays as JSON lists, base64 objects, or one ``.npz`` body.
ENCODINGS = ("json", "base64", "npy")

#: ``asyncopd.hidden``'s values: the dtypes hidden states are answered in.
HIDDEN_DTYPES = ("float32", "bfloat16")


class BadRequest(ValueError):
    """A request this server cannot score: ``status`` 400 (malformed) or 413 (too large)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How ``asyncopd serve-teacher`` scores.

    Attributes:
      model_name: the name ``/v1/models`` lists and requests must name (or leave out).
      max_topk: the largest ``prompt_logprobs`` K a request may ask (the top-K computed).
      temperature: the teacher's distribution ``softmax(z / τ)``: fixed for the server; a
        request asking another temperature is refused (400).
      max_rows: rows scored in one batch.
      max_wait_ms: how long the batcher waits for more rows once it has one.
      queue_rows: rows waiting at most; past it, 503 with ``Retry-After``.
      max_request_rows: rows in one request at most (413 past it).
      max_body_bytes: a request body's size at most (413 past it).
      chunk_size: response positions per chunk of ``[B, chunk, V]`` logits.
    """

    model_name: str = "teacher"
    max_topk: int = 32
    temperature: float = 1.0
    max_rows: int = wire.BATCH_ROWS
    max_wait_ms: float = 5.0
    queue_rows: int = 1024
    max_request_rows: int = 256
    max_body_bytes: int = 64 << 20
    chunk_size: int = 128


@dataclasses.dataclass
class Row:
    """One row to score: ``ids`` the whole sequence, scored from ``start`` (≥ 1) on."""

    ids: np.ndarray  # [L] int
    start: int
    candidate_ids: np.ndarray | None = None  # [L − start, N]
    student_topk_ids: np.ndarray | None = None  # [L − start, Ks]


@dataclasses.dataclass
class Request:
    """A parsed request: its rows and what it asks of each."""

    rows: list[Row]
    topk: int
    num_samples: int
    seed: int
    extension: bool  # answer in the extension's dense form (else vLLM's prompt_logprobs)

    encoding: str = "json"  # how the extension's arrays are answered (``asyncopd.encoding``)
    pad_to: tuple[int, int] | None = None  # the widths prompts and responses are padded to (None: powers of two)
    hidden: str | None = None  # the dtype hidden states are answered in (None: not asked)

    @property
    def signature(self) -> tuple[int | None, int | None, int, int, int, str | None]:
        """What must agree for rows to share a batch: the id counts per position, the
        number of teacher samples and their seed (one key draws a batch's samples), the
        top-K computed (K rounded up to a power of two), and the hidden states' dtype."""
        first = self.rows[0]
        candidates, topk = first.candidate_ids, first.student_topk_ids
        return (
            None if candidates is None else candidates.shape[1],
            None if topk is None else topk.shape[1],
            self.num_samples,
            self.seed if self.num_samples else 0,
            power_of_two(max(self.topk, 1)),
            self.hidden,
        )


# --- parsing --------------------------------------------------------------------------------------


def parse_request(body: Any, settings: ServerSettings, vocab_size: int, context: int) -> Request:
    """A :class:`Request` from a ``/v1/completions`` JSON body, or a :class:`BadRequest`
    naming the field at fault. Every field is checked for its type and bounds before it is
    used (the rules: the module's docstring); ``null`` is an absent field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != settings.model_name:
        raise BadRequest(f"model {str(model)[:80]!r} is not served here; this server serves {settings.model_name!r}")
    prompts = body.get("prompt")
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest("prompt must be a non-empty list of token-id lists")
    if wire.is_json_int(prompts[0]):
        prompts = [prompts]  # one prompt as a flat id list, as vLLM accepts it
    if len(prompts) > settings.max_request_rows:
        raise BadRequest(f"{len(prompts)} prompts in one request; at most {settings.max_request_rows}", 413)
    topk = bounded_int("prompt_logprobs", body.get("prompt_logprobs"), 0, settings.max_topk)
    temperature = body.get("temperature")
    if temperature is not None and (not wire.is_json_number(temperature) or temperature != settings.temperature):
        raise BadRequest(
            f"temperature {str(temperature)[:40]}: this server scores at temperature {settings.temperature:g} only"
        )
    extension = body.get("asyncopd")
    if extension is not None and not isinstance(extension, dict):
        raise BadRequest("asyncopd must be an object")
    extension = {k: v for k, v in (extension or {}).items() if v is not None}
    unknown = sorted(set(extension) - set(EXTENSION_FIELDS))
    if unknown:
        raise BadRequest(f"asyncopd.{unknown[0][:40]} is not a field; allowed: {', '.join(EXTENSION_FIELDS)}")
    starts = extension.get("response_start", [1] * len(prompts))
    if not isinstance(starts, list) or len(starts) != len(prompts):
        raise BadRequest(f"asyncopd.response_start must list one position per prompt ({len(prompts)})")
    num_samples = bounded_int("asyncopd.num_samples", extension.get("num_samples", 0), 0, MAX_IDS_PER_POSITION)
    seed = bounded_int("asyncopd.seed", extension.get("seed", 0), 0, (1 << 32) - 1)
    rows = []
    for i, (ids, start) in enumerate(zip(prompts, starts, strict=True)):
        row = _row(i, ids, start, vocab_size, context)
        row.candidate_ids = _per_position_ids(extension, "candidate_ids", i, len(prompts), row, vocab_size)
        row.student_topk_ids = _per_position_ids(extension, "student_topk_ids", i, len(prompts), row, vocab_size)
        rows.append(row)
    for field in ("candidate_ids", "student_topk_ids"):
        widths = {None if getattr(r, field) is None else getattr(r, field).shape[1] for r in rows}
        if len(widths) > 1:
            raise BadRequest(f"asyncopd.{field} must give every row the same number of ids per position")
    encoding = extension.get("encoding", "json")
    if encoding not in ENCODINGS:
        raise BadRequest(f"asyncopd.encoding must be one of {', '.join(ENCODINGS)}, got {str(encoding)[:40]!r}")
    hidden = extension.get("hidden")
    if hidden is not None and hidden not in HIDDEN_DTYPES:
        raise BadRequest(f"asyncopd.hidden must be one of {', '.join(HIDDEN_DTYPES)}, got {str(hidden)[:40]!r}")
    pad_to = extension.get("pad_to")
    if pad_to is not None:
        longest = (max(r.start for r in rows), max(len(r.ids) - r.start for r in rows))
        if (
            not isinstance(pad_to, list)
            or len(pad_to) != 2
            or not all(wire.is_json_int(w) for w in pad_to)
            or pad_to[0] < longest[0]
            or pad_to[1] < longest[1]
            or pad_to[0] + pad_to[1] > context
        ):
            raise BadRequest(
                f"asyncopd.pad_to must be [prompt, response] widths of at least {list(longest)} (the longest "
                f"prompt and response sent) and at most {context} together, got {wire.shown(pad_to)}"
            )
        pad_to = tuple(pad_to)
    return Request(
        rows, topk, num_samples, seed, extension=bool(extension), encoding=encoding, pad_to=pad_to, hidden=hidden
    )


#: The most ids a request may send per response position (``candidate_ids``,
#: ``student_topk_ids``) and the most teacher samples it may ask (``num_samples``).
MAX_IDS_PER_POSITION = 1 << 10


def bounded_int(name: str, value: Any, low: int, high: int) -> int:
    if not wire.is_json_int(value) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}, got {str(value)[:40]}")
    return value


def vocab_ids(values: list, vocab_size: int, where: str) -> np.ndarray:
    """A flat list of JSON integers as ``[n]`` int32 ids, each checked to be an integer in the
    vocabulary while still a Python int (any size), before NumPy sees it; else a
    :class:`BadRequest` naming the first value that is not."""
    for position, value in enumerate(values):
        if not wire.is_json_int(value) or not 0 <= value < vocab_size:
            raise BadRequest(
                f"{where} holds {str(value)[:40]} at position {position}; allowed: token ids, integers from 0 to "
                f"{vocab_size - 1}"
            )
    return np.asarray(values, np.int32)


def _row(i: int, ids: Any, start: Any, vocab_size: int, context: int) -> Row:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"prompt[{i}] must be a non-empty list of token ids")
    if len(ids) > context:
        raise BadRequest(f"prompt[{i}] has {len(ids)} tokens; the model's context is {context}", 413)
    array = vocab_ids(ids, vocab_size, f"prompt[{i}]")
    if not wire.is_json_int(start) or not 1 <= start <= len(array):
        raise BadRequest(
            f"asyncopd.response_start[{i}] must be an integer from 1 to {len(array)}, got {str(start)[:40]}"
        )
    return Row(array, start)


def _per_position_ids(extension: dict, field: str, i: int, rows: int, row: Row, vocab_size: int) -> np.ndarray | None:
    """``extension[field][i]``: ``[t, n]`` ids, one list of n (1 … MAX_IDS_PER_POSITION) per
    response position."""
    if field not in extension:
        return None
    values = extension[field]
    if not isinstance(values, list) or len(values) != rows:
        raise BadRequest(f"asyncopd.{field} must list the ids of each of the {rows} prompts")
    t, lists = len(row.ids) - row.start, values[i]
    width = len(lists[0]) if isinstance(lists, list) and lists and isinstance(lists[0], list) else 0
    if (
        not isinstance(lists, list)
        or len(lists) != t
        or not 1 <= width <= MAX_IDS_PER_POSITION
        or not all(isinstance(ids, list) and len(ids) == width for ids in lists)
    ):
        raise BadRequest(
            f"asyncopd.{field}[{i}] must hold {t} lists (one per response position) of the same number of ids, "
            f"1 to {MAX_IDS_PER_POSITION}"
        )
    return vocab_ids([id_ for ids in lists for id_ in ids], vocab_size, f"asyncopd.{field}[{i}]").reshape(t, width)


# --- scoring --------------------------------------------------------------------------------------


class BatchScorer:
    """Scores lists of :class:`Row` with one jitted call per batch (its shapes padded to
    powers of two; one compiled program per shape and number of samples)."""

    def __init__(self, model: Decoder, settings: ServerSettings, mesh: Mesh | None = None):
        self.settings, self.mesh = settings, mesh
        self.graphdef, self.state = nnx.split(model)
        self.vocab_size = int(model.vocab_limit or model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        self.context = int(model.config.max_position_embeddings)
        if settings.max_topk > self.vocab_size:
            raise ValueError(f"--max-topk {settings.max_topk} is more than the model's {self.vocab_size} ids")

    @functools.cache  # noqa: B019 (one scorer per server, alive as long as the server)
    def _function(self, num_samples: int, topk: int, hidden: str | None = None):
        params = ScoringParams(
            topk=topk,
            num_samples=num_samples,
            temperature=self.settings.temperature,
            chunk_size=self.settings.chunk_size,
            payload="scores" if hidden is None else "hidden",
            hidden_dtype=hidden or "float32",
        )
        return jax.jit(teacher_score_function(self.graphdef, params))

    def head(self) -> np.ndarray:
        """The teacher's LM head on the host, ``[H, V]`` (V: its config's vocabulary; the
        embedding's transpose when tied), in its weights' dtype: what ``GET /v1/head``
        answers, the digest in ``/v1/models`` is of, and a learner applying the teacher's
        head to its hidden states holds."""
        model = nnx.merge(self.graphdef, self.state)
        with mesh_context(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            return np.asarray(model.lm_head_weight())

    @functools.cached_property
    def head_card(self) -> dict[str, Any]:
        """What ``/v1/models`` says of the head: ``{"sha256", "shape", "dtype"}``
        (:func:`~asyncopd_jax.models.head_digest`), computed once."""
        head = self.head()
        return {"sha256": head_digest(head), "shape": list(head.shape), "dtype": str(head.dtype)}

    def score(
        self,
        rows: Sequence[Row],
        num_samples: int,
        seed: int,
        topk: int | None = None,
        pad_to: tuple[int, int] | None = None,
        hidden: str | None = None,
    ) -> list[dict[str, np.ndarray]]:
        """Each row's scores at its positions ``start`` … ``L − 1`` (``[t]`` / ``[t, n]`` arrays),
        with the top ``topk`` (rounded up to a power of two, at most ``max_topk``; None:
        ``max_topk``), prompts and responses padded to ``pad_to`` (None: powers of two), and
        (``hidden``: their dtype) the final hidden states ``[t, H]``."""
        k = self.settings.max_topk if topk is None else min(power_of_two(max(topk, 1)), self.settings.max_topk)
        batch, lengths = _as_batch(rows, pad_to)
        with mesh_context(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            if self.mesh is not None:  # the rows replicated on the teacher's mesh; its weights lie as the rules say
                batch = jax.device_put(batch, NamedSharding(self.mesh, PartitionSpec()))
            cache: TeacherScoreCache = self._function(num_samples, k, hidden)(self.state, batch, jax.random.key(seed))
        host = {k: np.asarray(v) for k, v in dataclasses.asdict(cache).items() if v is not None}
        return [{k: v[i, :t] for k, v in host.items()} for i, t in enumerate(lengths)]


def _as_batch(rows: Sequence[Row], pad_to: tuple[int, int] | None = None) -> tuple[RolloutBatch, list[int]]:
    """Rows as a :class:`RolloutBatch`: each row's ``ids[:start]`` a left-padded prompt,
    ``ids[start:]`` a right-padded response (to ``pad_to``'s widths, else powers of two),
    the id sets per response position padded with id 0 (positions past a response's end are
    never read back)."""
    lengths = [len(r.ids) - r.start for r in rows]
    b, p, t = power_of_two(len(rows)), power_of_two(max(r.start for r in rows)), power_of_two(max(max(lengths), 1))
    if pad_to is not None:
        p, t = pad_to
    prompt = np.zeros((b, p), np.int32)
    prompt_mask = np.zeros((b, p), bool)
    response = np.zeros((b, t), np.int32)
    response_mask = np.zeros((b, t), bool)
    ids: dict[str, np.ndarray | None] = {"candidate_ids": None, "student_topk_ids": None}
    for name in ids:
        first = getattr(rows[0], name)
        if first is not None:
            ids[name] = np.zeros((b, t, first.shape[1]), np.int32)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        prompt[i, p - row.start :], prompt_mask[i, p - row.start :] = row.ids[: row.start], True
        response[i, :n], response_mask[i, :n] = row.ids[row.start :], True
        for name, array in ids.items():
            if array is not None:
                array[i, :n] = getattr(row, name)
    zeros = jnp.zeros((b, t), jnp.float32)
    candidates = ids["candidate_ids"]
    topk = ids["student_topk_ids"]
    batch = RolloutBatch(
        prompt_tokens=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(response),
        response_mask=jnp.asarray(response_mask),
        behavior_logp=zeros,
        token_version=jnp.zeros((b, t), jnp.int32),
        candidate_ids=None if candidates is None else jnp.asarray(candidates),
        candidate_behavior_logp=None if candidates is None else jnp.zeros(candidates.shape, jnp.float32),
        student_topk_ids=None if topk is None else jnp.asarray(topk),
        student_topk_behavior_logp=None if topk is None else jnp.zeros(topk.shape, jnp.float32),
    )
    return batch, lengths


# --- answers --------------------------------------------------------------------------------------


def answer(request: Request, scores: list[dict[str, np.ndarray]], model_name: str) -> dict | bytes:
    """The ``/v1/completions`` answer: vLLM's ``prompt_logprobs``, or the extension's dense
    arrays when the request used the extension (``"encoding": "npy"``: the bytes of one
    ``.npz`` archive, row i's arrays named ``"<i>/<name>"``)."""
    if request.extension and request.encoding == "npy":
        return npz_bytes(
            {
                f"{i}/{key}": array
                for i, score in enumerate(scores)
                for key, array in _dense(score, request.topk).items()
            }
        )
    choices = []
    for index, (row, score) in enumerate(zip(request.rows, scores, strict=True)):
        choice: dict[str, Any] = {"index": index, "text": "", "finish_reason": "length", "logprobs": None}
        if request.extension:
            binary = request.encoding == "base64"
            choice["asyncopd"] = {
                k: encode_array(a) if binary else a.tolist() for k, a in _dense(score, request.topk).items()
            }
        else:
            choice["prompt_logprobs"] = [None] * row.start + _vllm_positions(row, score, request.topk)
        choices.append(choice)
    return {"object": "text_completion", "model": model_name, "choices": choices}


def _dense(score: dict[str, np.ndarray], topk: int) -> dict[str, np.ndarray]:
    """The extension's arrays of one row, by their names in the answer."""
    arrays = {
        "token_logprobs": score["token_logp"],
        "topk_ids": score["topk_ids"][:, :topk],
        "topk_logprobs": score["topk_logp"][:, :topk],
    }
    for field, key in (
        ("candidate_logp", "candidate_logprobs"),
        ("student_topk_logp", "student_topk_logprobs"),
        ("sample_ids", "sample_ids"),
        ("sample_logp", "sample_logprobs"),
        ("hidden", "hidden_states"),
    ):
        if field in score:
            arrays[key] = score[field]
    return arrays


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """``{"dtype": "<f4" | "<i4", "shape": […], "data": base64 of its little-endian bytes}``:
    float32 log-probs and int32 ids exactly (bfloat16 hidden states as float32, exactly),
    ~4× smaller and ~20× faster to write and read than the same numbers as JSON text."""
    dtype = np.dtype("<i4") if np.issubdtype(array.dtype, np.integer) else np.dtype("<f4")
    data = np.ascontiguousarray(array, dtype)
    return {"dtype": dtype.str, "shape": list(data.shape), "data": base64.b64encode(data.tobytes()).decode("ascii")}


def _vllm_positions(row: Row, score: dict[str, np.ndarray], topk: int) -> list[dict]:
    """vLLM's per-position dicts for the positions ``start`` … ``L − 1``."""
    positions = []
    for k, actual in enumerate(row.ids[row.start :]):
        ids, logps = score["topk_ids"][k, :topk], score["topk_logp"][k, :topk]
        entry = {
            str(int(i)): {"logprob": float(lp), "rank": r + 1, "decoded_token": None}
            for r, (i, lp) in enumerate(zip(ids, logps, strict=True))
        }
        if str(int(actual)) not in entry:
            entry[str(int(actual))] = {"logprob": float(score["token_logp"][k]), "rank": None, "decoded_token": None}
        positions.append(entry)
    return positions
