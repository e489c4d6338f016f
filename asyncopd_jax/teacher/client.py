"""A teacher behind an HTTP server: the scoring stage sends token ids, the server answers
log-probs, and the result is the :class:`~asyncopd_jax.cache.TeacherScoreCache` the
in-process :class:`~asyncopd_jax.teacher.TeacherScorer` fills.

Only token ids cross the wire (prompt and response, never text): nothing is detokenised and
retokenised, so the positions the server scores are the student's own. Each row is sent as
its real prompt tokens followed by its real response tokens; the server's log-prob at
position ``len(prompt) + t`` is response token t's, target-aligned as in
:mod:`asyncopd_jax.alignment`.

Wire formats (``teacher.server.api``), in :mod:`asyncopd_jax.teacher.wire`:

* ``vllm``: vLLM's OpenAI-compatible ``POST /v1/completions`` with ``prompt_logprobs: K``.
  It answers the teacher's top-K and the actual token at every position: the cache's
  ``token_logp``, ``topk_ids`` and ``topk_logp``. A vLLM that scores per-position ids
  (``prompt_logprob_token_ids`` on ``/inference/v1/generate``:
  :mod:`asyncopd_jax.teacher.vllm_candidates`) also scores the ids the student chose
  (Monte-Carlo candidates, its top-K), one request a row; a start-up probe
  (:meth:`ServedTeacher.probe_ids`) finds whether it does, and a run whose estimator needs
  them is refused where it does not (:data:`PROBED`). It cannot sample from the teacher.
* ``sglang``: SGLang's native ``POST /generate`` with ``return_logprob``,
  ``logprob_start_len: 0`` and ``top_logprobs_num: K``, prefill only: the same three
  fields, and the same refusals (its ``token_ids_logprob`` takes one id list per request,
  not one per position).
* ``asyncopd``: ``asyncopd serve-teacher`` (:mod:`asyncopd_jax.teacher.server`): the same
  request with an extension that also sends the ids the student chose and asks for
  teacher samples, so it fills every field of the cache and serves every estimator. With
  ``payload: hidden`` it also answers the teacher's final hidden states, in one binary
  ``.npz`` body (``asyncopd.encoding: npy``), and the learner applies the teacher's head:
  from ``teacher.head_path`` or fetched once from ``GET /v1/head``, either checked against
  the digest the server's ``/v1/models`` card states (:meth:`ServedTeacher.head`).

The client: rows go out ``rows_per_request`` to a request (by default 64, the rows
``serve-teacher`` scores in a batch, and 8 to vLLM / SGLang: :attr:`ServerParams.request_rows`),
``in_flight`` requests at once; a request that fails to connect, times out, or gets a 429 /
5xx answer is retried with exponential backoff and full jitter (a 503's ``Retry-After`` is
honoured) until ``give_up_after`` seconds have passed since it was first sent, so a server
that is restarted mid-run costs a wait, not the run. Any other failure (a 4xx answer, an
answer that is not what was asked) raises :class:`ServerError`: one line naming the server
and what was wrong. Before its first batch is used the scorer scores it twice and refuses
to train when the two differ by more than ``determinism_tolerance`` (a server whose
batching changes its numbers gives the learner noise in place of the teacher's signal).

Temperature: vLLM's prompt log-probs are the model's raw distribution (its logits at
temperature 1, before any sampling parameter), and SGLang's are asked at sampling
temperature 1 (a build that scales its log-probs by the sampling temperature then gives the
same), so ``scoring.temperature`` must be 1.0 with ``api: vllm`` or ``sglang`` (checked
with the config): a top-K cannot be re-tempered exactly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.teacher import vllm_candidates, wire
from asyncopd_jax.teacher.scorer import ScoringParams
from asyncopd_jax.teacher.wire import Row, RowScores, ServerError

Array = jax.Array

#: The id sets (keys of :data:`asyncopd_jax.estimator_ids.ID_SOURCES`) each kind of
#: teacher can score besides the sampled tokens. In-process: all of them.
SERVES: dict[str, frozenset[str]] = {
    "vllm": frozenset({"teacher_topk"}),
    "sglang": frozenset({"teacher_topk"}),  # its token_ids_logprob is one id list per request, not per position
    "asyncopd": frozenset({"candidates", "student_topk", "teacher_topk", "teacher_samples"}),
}

#: The id sets a kind of teacher scores when its start-up probe finds the server can
#: (:meth:`ServedTeacher.probe_ids`): vLLM's per-position ``prompt_logprob_token_ids``.
PROBED: dict[str, frozenset[str]] = {"vllm": frozenset({"candidates", "student_topk"})}


@dataclasses.dataclass(frozen=True)
class ServerParams:
    """How the scoring stage reaches a served teacher (``teacher.server``).

    Attributes:
      url: the server's base URL, ``http://host:port`` ('' : the teacher runs in-process,
        from ``teacher.path``).
      api: the wire format: ``vllm`` (OpenAI-compatible completions with ``prompt_logprobs``),
        ``sglang`` (SGLang's native ``/generate`` with ``return_logprob``) or ``asyncopd``
        (``asyncopd serve-teacher``: vLLM's, with the extension).
      model: the served model's name ('' : the server's only model, asked from ``/v1/models``;
        SGLang's ``/generate`` takes none).
      rows_per_request: rollout rows per request (None: by ``api``, :attr:`request_rows`).
      in_flight: requests sent at once.
      timeout: seconds one request may take before it is retried.
      give_up_after: seconds a request may keep failing (retried) before the run stops.
      backoff: the first retry's mean wait in seconds (doubled each retry, at most 30 s,
        times a uniform draw: full jitter).
      determinism_tolerance: the largest difference in log-prob allowed between two
        scorings of the same batch at start-up (< 0: not checked).
    """

    url: str = ""
    api: Literal["vllm", "sglang", "asyncopd"] = "vllm"
    model: str = ""
    rows_per_request: int | None = None
    in_flight: int = 4
    timeout: float = 120.0
    give_up_after: float = 600.0
    backoff: float = 0.5
    determinism_tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"teacher.server.url = {self.url!r} is invalid; allowed: http://host:port, https://…")
        for field in ("rows_per_request", "in_flight"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"teacher.server.{field} must be >= 1, got {getattr(self, field)}")
        for field in ("timeout", "give_up_after", "backoff"):
            if getattr(self, field) <= 0:
                raise ValueError(f"teacher.server.{field} must be > 0 seconds, got {getattr(self, field)}")

    @property
    def request_rows(self) -> int:
        """Rows in one request: ``rows_per_request`` where set; else, for ``serve-teacher``,
        the rows it scores in one batch (:data:`~asyncopd_jax.teacher.wire.BATCH_ROWS`:
        a group that fits is scored at its own widths, the same numbers every run, at the
        least cost), and for vLLM / SGLang 8, the AsyncOPD reference's scoring batch (their
        JSON answers grow as rows × positions × K, and they batch concurrent requests)."""
        if self.rows_per_request is not None:
            return self.rows_per_request
        return wire.BATCH_ROWS if self.api == "asyncopd" else 8

    @property
    def serves(self) -> frozenset[str]:
        """The id sets this server's API can score (:data:`SERVES`)."""
        return SERVES[self.api]

    @property
    def may_serve(self) -> frozenset[str]:
        """:attr:`serves`, and what a start-up probe may find it scores (:data:`PROBED`)."""
        return self.serves | PROBED.get(self.api, frozenset())

    @property
    def raw_only(self) -> bool:
        """Whether this API's log-probs are the model's raw distribution (temperature 1)
        only; ``asyncopd serve-teacher`` scores at its own ``--temperature``, and answers a
        request at another with 400."""
        return self.api != "asyncopd"


@dataclasses.dataclass
class ServerStats:
    """What a scorer's requests cost, summed over its life (thread-safe through ``lock``)."""

    requests: int = 0
    retries: int = 0
    wait_s: float = 0.0  # seconds spent waiting to retry
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requests: int = 0, retries: int = 0, wait_s: float = 0.0) -> None:
        with self.lock:
            self.requests += requests
            self.retries += retries
            self.wait_s += wait_s


class ServedTeacher:
    """Scores rollouts through a teacher server (a drop-in for
    :class:`~asyncopd_jax.teacher.TeacherScorer`: the same ``params`` and ``score``).

    Args:
      server: where and how to reach it.
      params: what to store (for ``api: vllm``, ``num_samples`` must be 0 and ``temperature``
        1, checked with the config; ``asyncopd serve-teacher`` scores at its own temperature,
        which must be the run's, and answers 400 otherwise).
      vocab_size: the ids the student has; a teacher id at or past it is an error.
      client: an ``httpx2.Client`` (tests pass one with a mock transport); default: a new
        one with the server's timeout.
      sleep, clock: the waits between retries and the time they are measured by (tests
        pass fakes).
    """

    def __init__(
        self,
        server: ServerParams,
        params: ScoringParams,
        vocab_size: int,
        *,
        client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import httpx2  # the `served` extra: only a run with a served teacher needs it

        self.server, self.params, self.vocab_size = server, params, vocab_size
        self.stats = ServerStats()
        self._httpx = httpx2
        self._client = client or httpx2.Client(timeout=server.timeout)
        self._sleep, self._clock = sleep, clock
        self._random = random.Random()
        self._model = server.model
        self._models: Any = None  # the server's GET /v1/models answer, once asked
        self._checked = server.determinism_tolerance < 0
        self._calls = threading.local()  # each scoring thread's own last call
        self._hidden = params.hidden_dtype if params.payload == "hidden" else None  # asked in this dtype

    # --- the scorer's interface -----------------------------------------------------------------

    def score(self, batch: RolloutBatch, key: Array | None = None) -> TeacherScoreCache:
        """Score one rollout batch (``key`` seeds the teacher samples, for ``asyncopd``).

        Returns the cache with ``token_logp`` ``[B, T]``, for ``params.topk`` K > 0
        ``topk_ids`` / ``topk_logp`` ``[B, T, K]``, and (``asyncopd``) the log-probs of the
        batch's candidates and student top-K and the teacher samples; positions past a
        response's end repeat its last scored position (finite values the mask leaves out)."""
        seed = 0 if key is None else int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
        self._calls.wait_s, self._calls.requests = 0.0, 0
        rows = _rows(batch)
        # the batch's own widths: serve-teacher scores at them, as the in-process scorer would
        widths = (int(np.shape(batch.prompt_tokens)[1]), int(np.shape(batch.response_tokens)[1]))
        scores = self._score_rows(rows, seed, widths)
        if not self._checked:
            self._check_determinism(scores, self._score_rows(rows, seed, widths))
            self._checked = True
        t = np.shape(batch.response_tokens)[1]
        return _cache(scores, t, self.params)

    @property
    def last_wait_s(self) -> float | None:
        """Seconds this thread's last :meth:`score` waited to retry the server."""
        return getattr(self._calls, "wait_s", 0.0)

    @property
    def last_requests(self) -> int:
        """Scoring requests this thread's last :meth:`score` sent (retries not counted)."""
        return getattr(self._calls, "requests", 0)

    # --- requests -------------------------------------------------------------------------------

    def _score_rows(self, rows: list[Row], seed: int, widths: tuple[int, int] | None = None) -> list[RowScores]:
        """Every row's scores, ``request_rows`` rows a request, ``in_flight`` at once."""
        model = self.model_name()
        size = self.request_rows()
        waited_before = self.stats.wait_s
        starts = range(0, len(rows), size)
        if len(starts) == 1:  # one request: no thread to hand it to
            scores = self._score_request(model, rows, seed, widths)
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.server.in_flight, len(starts))) as pool:
                parts = pool.map(lambda i: self._score_request(model, rows[i : i + size], seed + i, widths), starts)
                scores = [row for part in parts for row in part]
        # the waits of this call's requests (another thread's calls may add theirs meanwhile:
        # an overlap is counted in both, a bound the metric states)
        self._calls.wait_s = getattr(self._calls, "wait_s", 0.0) + self.stats.wait_s - waited_before
        self._calls.requests = getattr(self._calls, "requests", 0) + -(-len(rows) // size)
        return scores

    def _score_request(
        self, model: str, rows: Sequence[Row], seed: int, widths: tuple[int, int] | None = None
    ) -> list[RowScores]:
        """One request's rows scored (``widths``: the batch's prompt and response widths,
        which ``serve-teacher`` scores at)."""
        topk, server = self.params.topk, self.server.url
        if self.server.api == "asyncopd":
            samples, hidden = self.params.num_samples, self._hidden
            # hidden states go in one binary body: bfloat16 kept, no base64 inflation
            encoding = "npy" if hidden else "base64"
            body = wire.asyncopd_request(
                model, rows, topk, samples, seed, self.params.temperature, widths, hidden, encoding
            )
            answer = self.post("/v1/completions", body)
            if isinstance(answer, dict) and "choices" not in answer:  # a binary answer's arrays
                answer = wire.npz_choices(answer, server)
            width = self.head_card().hidden_size if hidden else None
            return wire.parse_asyncopd(answer, rows, topk, samples, self.vocab_size, server, width)
        if self.server.api == "sglang":
            answer = self.post("/generate", wire.sglang_request(rows, topk))
            return wire.parse_sglang(answer, rows, topk, self.vocab_size, server)
        if rows[0].candidate_ids is not None or rows[0].student_topk_ids is not None:  # one request a row
            return [self._score_ids(model, row, topk) for row in rows]
        answer = self.post("/v1/completions", wire.vllm_request(model, rows, topk))
        return wire.parse_vllm(answer, rows, topk, self.vocab_size, server)

    def _score_ids(self, model: str, row: Row, topk: int) -> RowScores:
        """One row's scores from vLLM's per-position id scoring (a row without answer tokens:
        empty arrays, nothing sent)."""
        if len(row.response) == 0:
            empty = np.zeros((0, topk))

            def none(ids: np.ndarray | None) -> np.ndarray | None:
                return None if ids is None else np.zeros((0, np.shape(ids)[1]))

            return RowScores(
                np.zeros(0), empty.astype(np.int64), empty, none(row.candidate_ids), none(row.student_topk_ids)
            )
        answer = self.post(vllm_candidates.GENERATE_PATH, vllm_candidates.candidates_request(model, row, topk))
        return vllm_candidates.parse_candidates(answer, row, topk, self.vocab_size, self.server.url)

    def probe_ids(self, width: int) -> None:
        """Return when the server scores ``width`` ids a position as :data:`PROBED` says
        (a two-token request at the run's widths), else a :class:`ServerError` saying what
        the server answered and how to serve it (:func:`~asyncopd_jax.teacher.vllm_candidates.check_probe`)."""
        model, topk = self.model_name(), self.params.topk
        body = vllm_candidates.probe_request(model, width, topk)
        try:
            answer = self.post(vllm_candidates.GENERATE_PATH, body)
        except ServerError as err:  # 403: no --enable-scale-out; 400: no V2 runner, --max-logprobs; 404: older
            raise ServerError(f"{err}; {vllm_candidates.serve_hint(width, topk)}") from None
        vllm_candidates.check_probe(answer, width, topk, self.vocab_size, self.server.url)

    def model_name(self) -> str:
        """``server.model``, else the one model ``/v1/models`` lists (SGLang's ``/generate``
        needs none)."""
        if not self._model and self.server.api != "sglang":
            self._model = wire.only_model(self._listed_models(), self.server.url)
        return self._model

    def request_rows(self) -> int:
        """Rows in one request: ``server.request_rows``, the default held to the rows
        ``serve-teacher`` takes in one request (``--max-request-rows``, which its
        ``/v1/models`` card states), so that a server started with a lower limit gets
        more requests, not a 413."""
        rows = self.server.request_rows
        if self.server.rows_per_request is None and self.server.api == "asyncopd":
            limit = wire.max_request_rows(self._listed_models(), self.server.url)
            rows = min(rows, limit) if limit is not None else rows
        return rows

    def head_card(self) -> wire.HeadCard:
        """What the server's ``/v1/models`` card says of its LM head (asked once)."""
        return wire.head_card(self._listed_models(), self.server.url)

    def head(self, path: str = "") -> np.ndarray:
        """The served teacher's LM head ``[H, V]`` in the server's dtype: read alone from
        ``path`` (a local copy of its checkpoint, ``teacher.head_path``), else fetched once
        from ``GET /v1/head``; either way checked against the digest the server states, so
        that hidden states are never read with another model's head."""
        from asyncopd_jax.models import head_digest, read_lm_head

        card = self.head_card()
        if path:
            head, origin = read_lm_head(path, None, card.dtype), f"teacher.head_path {path}"
        else:
            arrays, origin = self._request("GET", "/v1/head", None), f"{self.server.url}/v1/head"
            if not (isinstance(arrays, dict) and isinstance(arrays.get("head"), np.ndarray)):
                raise ServerError(f"teacher server {origin} answered {str(arrays)[:120]}, not an LM head")
            head = arrays["head"]
        digest = head_digest(head)
        if digest != card.sha256:
            raise ServerError(
                f"{origin}: the LM head [{', '.join(map(str, head.shape))}] {head.dtype} has digest {digest[:12]}…; "
                f"teacher server {self.server.url} serves one of {list(card.shape)} {card.dtype}, digest "
                f"{card.sha256[:12]}… (a head_path of another checkpoint, or a corrupted copy)"
            )
        return head

    def _listed_models(self) -> Any:
        """The server's ``GET /v1/models`` answer (asked once)."""
        if self._models is None:
            self._models = self._request("GET", "/v1/models", None)
        return self._models

    def post(self, path: str, body: dict) -> Any:
        """The server's answer to ``POST path`` with the JSON ``body`` (retried as the module says)."""
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None) -> Any:
        """The server's answer to one request, retried as the module says: its JSON, or a
        binary answer's arrays (``application/octet-stream``: an ``.npz`` archive)."""
        url = self.server.url.rstrip("/") + path
        first = self._clock()
        attempt = 0
        while True:
            try:
                response = self._client.request(method, url, json=body)
            except self._httpx.TransportError as err:  # connect refused or reset, timed out
                problem, retry_after = f"{type(err).__name__}: {err}", None
            else:
                if response.status_code < 400:
                    self.stats.add(requests=1)
                    if response.headers.get("content-type", "").startswith(BINARY):
                        return binary_answer(response.content, f"{self.server.url}{path}")
                    return wire.json_of(response.content, f"{self.server.url}{path}")
                if response.status_code not in (408, 429) and response.status_code < 500:
                    raise ServerError(
                        f"teacher server {self.server.url}{path} refused the request: HTTP {response.status_code}: "
                        f"{wire.error_text(response.content)}"
                    )
                problem = f"HTTP {response.status_code}: {wire.error_text(response.content)}"
                retry_after = _retry_after(response.headers.get("retry-after"))
            waited = self._clock() - first
            if waited >= self.server.give_up_after:
                raise ServerError(
                    f"teacher server {self.server.url} failed {path} for {waited:.0f} s "
                    f"(teacher.server.give_up_after = {self.server.give_up_after:g}); last: {problem}"
                )
            mean = min(self.server.backoff * 2**attempt, 30.0)
            pause = retry_after if retry_after is not None else mean * self._random.random()
            pause = min(pause, self.server.give_up_after - waited)
            self.stats.add(retries=1, wait_s=pause)
            self._sleep(pause)
            attempt += 1

    # --- the start-up check ---------------------------------------------------------------------

    def _check_determinism(self, first: list[RowScores], second: list[RowScores]) -> None:
        """Refuse to train when two scorings of the same rows differ by more than the tolerance."""
        difference = max(wire.difference(a, b) for a, b in zip(first, second, strict=True))
        if difference > self.server.determinism_tolerance:
            raise ServerError(
                f"teacher server {self.server.url} is not deterministic: two scorings of the same batch differ "
                f"by {difference:.3g} in log-prob (teacher.server.determinism_tolerance = "
                f"{self.server.determinism_tolerance:g}; serve it with batch-invariant kernels, or raise the tolerance)"
            )


#: The media type of a binary answer.
BINARY = "application/octet-stream"


def binary_answer(content: bytes, where: str) -> dict[str, np.ndarray]:
    """A binary answer's arrays, else a :class:`ServerError` naming ``where``."""
    from asyncopd_jax.npz import npz_arrays

    try:
        return npz_arrays(content)
    except Exception as err:  # zipfile's BadZipFile, numpy's ValueError, a truncated archive's EOFError …
        raise ServerError(f"teacher server {where} answered a binary body that is not an .npz archive: {err}") from None


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (None: absent, or an HTTP date we do not parse)."""
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def _rows(batch: RolloutBatch) -> list[Row]:
    """Each row's real prompt and response tokens (masks applied; a trajectory's environment
    tokens are response tokens to the teacher), and the ids the student chose at its
    response positions (where the batch has them)."""
    host = jax.device_get(
        (batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, batch.context_mask)
        + (batch.candidate_ids, batch.student_topk_ids)
    )
    prompt_tokens, prompt_mask, response_tokens, response_mask, candidates, student_topk = host
    rows = []
    for i, n in enumerate(np.sum(response_mask, axis=1)):
        rows.append(
            Row(
                prompt=np.asarray(prompt_tokens[i][prompt_mask[i]], np.int64),
                response=np.asarray(response_tokens[i, :n], np.int64),
                candidate_ids=None if candidates is None else np.asarray(candidates[i, :n]),
                student_topk_ids=None if student_topk is None else np.asarray(student_topk[i, :n]),
            )
        )
    return rows


def _cache(rows: list[RowScores], t: int, params: ScoringParams) -> TeacherScoreCache:
    """The rows' scores as a ``[B, T]`` / ``[B, T, n]`` cache (log-probs in
    ``params.store_dtype``; hidden states ``[B, T, H]`` in ``params.hidden_dtype``, padded
    with zeros to ``params.hidden_width``), each row padded to ``t`` positions by repeating
    its last one (an empty row: log-prob 0 on id 0); K = 0 leaves out the top-K."""
    store = jnp.dtype(params.store_dtype)

    def padded(x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((t, *x.shape[1:]), x.dtype)
        return x[np.minimum(np.arange(t), len(x) - 1)]

    def stacked(field: str, dtype: Any) -> Array | None:
        values = [getattr(r, field) for r in rows]
        if values[0] is None or (field.startswith("topk") and values[0].shape[-1] == 0):
            return None
        return jnp.asarray(np.stack([padded(v) for v in values]), dtype)

    token = stacked("token_logp", store)
    assert token is not None  # every row has its tokens' log-probs
    return TeacherScoreCache(
        token_logp=token,
        topk_ids=stacked("topk_ids", jnp.int32),
        topk_logp=stacked("topk_logp", store),
        candidate_logp=stacked("candidate_logp", store),
        student_topk_logp=stacked("student_topk_logp", store),
        sample_ids=stacked("sample_ids", jnp.int32),
        sample_logp=stacked("sample_logp", store),
        hidden=_padded_hidden(stacked("hidden", jnp.dtype(params.hidden_dtype)), params.hidden_width),
    )


def _padded_hidden(hidden: Array | None, width: int) -> Array | None:
    """``[B, T, H]`` hidden states padded with zeros to ``width`` (the run's widest teacher's)."""
    if hidden is None or hidden.shape[-1] >= width:
        return hidden
    return jnp.pad(hidden, ((0, 0), (0, 0), (0, width - hidden.shape[-1])))
