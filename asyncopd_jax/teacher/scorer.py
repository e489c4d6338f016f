"""Teacher scoring: one forward over prompt + response fills the finite score cache.

The teacher's hidden states are aligned by :mod:`asyncopd_jax.alignment`, as the
learner's are: row t predicts response token t. Log-probs are then computed over chunks
of ``chunk_size`` response positions, so the ``[B, T, V]`` logits never exist at once;
only ``[B, chunk, V]`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.estimators import gather_logprobs_from_hidden, sample_candidates
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.teacher.routing import TeacherRoute

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ScoringParams:
    """What the teacher stores per response position.

    Attributes:
      topk: the teacher's own top-K ids and log-probs (0 = none).
      num_samples: ids sampled from the teacher for forward-KL Monte Carlo (0 = none).
      temperature: the teacher distribution ``softmax(z / τ)`` (1.0 = the model's own).
      chunk_size: response positions per chunk of ``[B, chunk, V]`` logits.
      store_dtype: ``"float32"`` or ``"bfloat16"`` for the stored log-probs.
      payload: ``"scores"``: the cache holds log-probs only; ``"hidden"``: it also holds the
        teacher's final hidden states at the response positions (what its LM head reads,
        after the final norm), for the learner to compute the exact KL over the whole
        vocabulary with the teacher's head (:mod:`asyncopd_jax.estimators.dense_from_hidden`).
      hidden_dtype: ``"float32"`` or ``"bfloat16"`` for the stored hidden states.
      hidden_width: the width the hidden states are padded to with zeros (0: their own),
        so that several teachers' rows stack (the run's widest; the learner pads each
        teacher's head with zero rows to it).
    """

    topk: int = 0
    num_samples: int = 0
    temperature: float = 1.0
    chunk_size: int = 128
    store_dtype: str = "float32"
    payload: str = "scores"
    hidden_dtype: str = "float32"
    hidden_width: int = 0

    def __post_init__(self) -> None:
        for field in ("store_dtype", "hidden_dtype"):
            if getattr(self, field) not in ("float32", "bfloat16"):
                raise ValueError(f"scoring.{field} = {getattr(self, field)!r} is invalid; allowed: float32, bfloat16")
        if self.hidden_width < 0:
            raise ValueError(f"scoring.hidden_width must be >= 0, got {self.hidden_width}")
        if self.payload not in ("scores", "hidden"):
            raise ValueError(f"scoring.payload = {self.payload!r} is invalid; allowed: scores, hidden")
        for field in ("topk", "num_samples"):
            if getattr(self, field) < 0:
                raise ValueError(f"scoring.{field} must be >= 0, got {getattr(self, field)}")
        if self.chunk_size < 1 or self.temperature <= 0:
            raise ValueError("scoring.chunk_size must be >= 1 and scoring.temperature > 0")


def score_hidden(
    hidden: Array, lm_head: Array, batch: RolloutBatch, key: Array, params: ScoringParams
) -> TeacherScoreCache:
    """Fill a :class:`TeacherScoreCache` from target-aligned teacher hidden states.

    Args:
      hidden: ``[B, T, H]`` teacher hidden states, row t predicting response token t.
      lm_head: ``[H, V]`` teacher output projection.
      batch: the rollout (its response tokens, MC candidates, student top-K ids are scored).
      key: PRNG key for the teacher samples.
      params: what to store.

    Returns:
      The cache, log-probs in ``params.store_dtype``; with ``params.payload`` ``"hidden"``,
      ``hidden`` too, in ``params.hidden_dtype``.
    """
    b, t, _ = hidden.shape
    chunk = min(params.chunk_size, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t

    def by_chunks(x: Array | None) -> Array | None:
        """``[B, T, ...]`` → ``[n_chunks, B, chunk, ...]`` (padded)."""
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    def one_chunk(xs):
        h, index, token, candidates, student_topk = xs
        logits = jnp.dot(h, lm_head, preferred_element_type=jnp.float32) / params.temperature
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, chunk, V]
        gather = functools.partial(jnp.take_along_axis, logp, axis=-1)
        out = {"token_logp": gather(token[..., None])[..., 0]}
        if candidates is not None:
            out["candidate_logp"] = gather(candidates)
        if student_topk is not None:
            out["student_topk_logp"] = gather(student_topk)
        if params.topk:
            out["topk_logp"], out["topk_ids"] = jax.lax.top_k(logp, params.topk)
        if params.num_samples:
            out["sample_ids"], out["sample_logp"] = sample_candidates(
                jax.random.fold_in(key, index), logp, params.num_samples
            )
        return out

    xs = (
        by_chunks(hidden),
        jnp.arange(n_chunks),
        by_chunks(batch.response_tokens),
        by_chunks(batch.candidate_ids),
        by_chunks(batch.student_topk_ids),
    )
    chunks = jax.lax.map(one_chunk, xs)
    store = jnp.dtype(params.store_dtype)

    def unchunk(x: Array) -> Array:
        x = jnp.moveaxis(x, 0, 1).reshape(b, n_chunks * chunk, *x.shape[3:])[:, :t]
        return x.astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(store)

    cache = TeacherScoreCache(**{name: unchunk(value) for name, value in chunks.items()})
    if params.payload == "hidden":
        width = max(params.hidden_width, hidden.shape[-1])
        padded = jnp.pad(hidden, ((0, 0), (0, 0), (0, width - hidden.shape[-1])))
        cache = dataclasses.replace(cache, hidden=padded.astype(jnp.dtype(params.hidden_dtype)))
    return cache


def teacher_score_function(
    graphdef: nnx.GraphDef, params: ScoringParams
) -> Callable[[nnx.State, RolloutBatch, Array], TeacherScoreCache]:
    """The teacher's scoring as a pure ``(weights, batch, key) → cache``: what
    :class:`TeacherScorer` jits, and what ``asyncopd plan`` compiles at shapes only."""

    def score(state: nnx.State, batch: RolloutBatch, key: Array) -> TeacherScoreCache:
        model: Decoder = nnx.merge(graphdef, state)
        return score_hidden(response_hidden(model, batch), model.lm_head_weight(), batch, key, params)

    return score


class Teacher(Protocol):
    """What the scoring stage asks of a teacher, in-process (:class:`TeacherScorer`) or
    served (:class:`asyncopd_jax.teacher.client.ServedTeacher`)."""

    params: ScoringParams

    def score(self, batch: RolloutBatch, key: Array | None = None) -> TeacherScoreCache:
        """The teacher's score cache of ``batch`` (``key`` seeds any teacher samples)."""
        ...

    @property
    def last_wait_s(self) -> float | None:
        """Seconds this thread's last :meth:`score` waited to retry a teacher server (None:
        the teacher is not served)."""
        ...

    @property
    def last_requests(self) -> int:
        """Requests this thread's last :meth:`score` sent (HTTP requests to a server; one
        compiled call in-process)."""
        ...


class TeacherScorer:
    """Runs a teacher :class:`Decoder` over rollouts and returns their score cache.

    Args:
      model: the teacher (split once; its weights are fixed).
      params: what to store.
      pad_rows: score a batch's rows padded to a power of two (copies of its last row, cut
        off after): a routed teacher's share of a group varies from group to group, and this
        bounds its compiled shapes to one per power of two.
    """

    def __init__(self, model: Decoder, params: ScoringParams, pad_rows: bool = False):
        self.graphdef, self.state = nnx.split(model)
        self.params, self.pad_rows = params, pad_rows
        self._score = jax.jit(teacher_score_function(self.graphdef, params))

    def score(self, batch: RolloutBatch, key: Array | None = None) -> TeacherScoreCache:
        """Score one rollout batch (``key`` seeds the teacher samples)."""
        key = jax.random.key(0) if key is None else key
        b = batch.response_tokens.shape[0]
        if not self.pad_rows or b & (b - 1) == 0:
            return self._score(self.state, batch, key)
        padded = jnp.minimum(jnp.arange(power_of_two(b)), b - 1)
        cache = self._score(self.state, take_rows(batch, padded), key)
        return take_rows(cache, jnp.arange(b))

    @property
    def last_wait_s(self) -> float | None:
        """None: in-process, nothing waits on a server."""
        return None

    @property
    def last_requests(self) -> int:
        """One compiled call per :meth:`score`."""
        return 1


class ReferenceScorer:
    """Log-probs of the sampled tokens under a fixed reference policy π_ref (e.g. the
    starting student), for a KL-to-reference term (``RolloutBatch.reference_logp``).

    Args:
      model: the reference (split once; its weights are fixed).
      temperature: the sampling temperature: π_ref is scored at the temperature the learner
        scores π_θ at, so that ``log π_θ − log π_ref`` compares the same distributions.
      chunk_size: rows per chunk of the fused LM-head gather.
    """

    def __init__(self, model: Decoder, temperature: float = 1.0, chunk_size: int = 512):
        self.graphdef, self.state = nnx.split(model)
        self.temperature, self.chunk_size = temperature, chunk_size
        self._score = jax.jit(self._score_fn)

    def _score_fn(self, state, batch: RolloutBatch) -> Array:
        model: Decoder = nnx.merge(self.graphdef, state)
        return gather_logprobs_from_hidden(
            response_hidden(model, batch),
            model.lm_head_weight(),
            batch.response_tokens,
            self.chunk_size,
            self.temperature,
        )

    def score(self, batch: RolloutBatch) -> Array:
        """``[B, T]`` fp32 log π_ref of ``batch.response_tokens``."""
        return self._score(self.state, batch)


@dataclasses.dataclass(frozen=True)
class TeacherUse:
    """What scoring one rollout group cost one teacher.

    Attributes:
      rows: the group's rows it scored.
      seconds: wall time of its scoring (to the cache on its devices).
      requests: requests it took (HTTP requests to a server; compiled calls in-process).
      wait_s: seconds of that time spent waiting to retry a server (None: in-process).
    """

    rows: int
    seconds: float
    requests: int
    wait_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Scored:
    """A scored rollout: the batch (with its reference log-probs where there is a reference),
    the teachers' score cache (None: no teacher), and what each teacher's scoring cost."""

    batch: RolloutBatch
    cache: TeacherScoreCache | None
    uses: dict[str, TeacherUse]


@dataclasses.dataclass(frozen=True)
class Scorers:
    """What the scoring stage runs on a rollout: the teachers (their score cache), by name
    in the run's order, and, for a KL-to-reference term, the reference policy (the batch's
    ``reference_logp``)."""

    teachers: dict[str, Teacher] = dataclasses.field(default_factory=dict)
    reference: ReferenceScorer | None = None

    def score(self, batch: RolloutBatch, key: Array, route: TeacherRoute | None = None) -> Scored:
        """Score ``batch``: each teacher its rows (``route``; None: the only teacher all of
        them, under the student's prompt), the reference all of them (``key`` seeds the
        teachers' samples; the k-th of several teachers uses ``fold_in(key, k)``).

        Only the response columns up to the longest answer are scored (:func:`scored_columns`:
        on long-tailed answers most of the ``T`` columns are padding); the columns past them
        repeat the last scored one, so every value stays a finite log-prob under the mask."""
        t = batch.response_tokens.shape[1]
        if self.reference is not None:  # as many columns as the (first) teacher scores
            chunk = next(iter(self.teachers.values())).params.chunk_size if self.teachers else t
            kept = scored_columns(longest(batch), t, chunk)
            reference = repeat_last_column(self.reference.score(response_columns(batch, kept)), t)
            batch = dataclasses.replace(batch, reference_logp=reference)
        if not self.teachers:
            return Scored(batch, None, {})
        parts, order, uses = [], [], {}
        for k, (name, teacher) in enumerate(self.teachers.items()):
            rows = np.arange(batch.response_tokens.shape[0]) if route is None else route.rows(k)
            if not rows.size:
                uses[name] = TeacherUse(0, 0.0, 0, None if teacher.last_wait_s is None else 0.0)
                continue
            start = time.perf_counter()
            cache = jax.block_until_ready(
                self._score_rows(
                    teacher, batch, rows, route, key if len(self.teachers) == 1 else jax.random.fold_in(key, k)
                )
            )
            uses[name] = TeacherUse(
                int(rows.size), time.perf_counter() - start, teacher.last_requests, teacher.last_wait_s
            )
            parts.append(cache)
            order.append(rows)
        if len(parts) == 1 and route is None:
            return Scored(batch, parts[0], uses)
        if any(part.span_end is not None for part in parts):  # a teacher of another tokenizer among them:
            # the others' rows are spans of one token each (their cache is per token, the same thing)
            parts = [
                part
                if part.span_end is not None
                else dataclasses.replace(part, span_end=jnp.take(batch.response_mask, jnp.asarray(rows), axis=0))
                for part, rows in zip(parts, order)
            ]
        back = jnp.asarray(np.argsort(np.concatenate(order)))  # each row's place among the parts
        cache = jax.tree_util.tree_map(lambda *xs: jnp.take(jnp.concatenate(xs), back, axis=0), *parts)
        if cache.hidden is not None and route is not None:  # whose head reads each row's hidden states
            index = jnp.asarray(route.teacher, jnp.int32)[:, None]
            cache = dataclasses.replace(cache, teacher_index=jnp.broadcast_to(index, batch.response_tokens.shape))
        return Scored(batch, cache, uses)

    @staticmethod
    def _score_rows(
        teacher: Teacher, batch: RolloutBatch, rows: np.ndarray, route: TeacherRoute | None, key: Array
    ) -> TeacherScoreCache:
        """``teacher``'s cache of ``batch``'s ``rows`` (under the route's prompts, if any),
        ``T`` columns wide."""
        t = batch.response_tokens.shape[1]
        if route is not None:
            batch = take_rows(batch, jnp.asarray(rows))
            if route.prompt_tokens is not None and route.prompt_mask is not None:
                batch = dataclasses.replace(
                    batch,
                    prompt_tokens=jnp.asarray(route.prompt_tokens[rows]),
                    prompt_mask=jnp.asarray(route.prompt_mask[rows]),
                )
        kept = scored_columns(longest(batch), t, teacher.params.chunk_size)
        return jax.tree_util.tree_map(
            functools.partial(repeat_last_column, width=t), teacher.score(response_columns(batch, kept), key)
        )


def longest(batch: RolloutBatch) -> int:
    """The longest answer of ``batch``, in tokens."""
    return int(jnp.max(jnp.sum(batch.context_mask, axis=1)))  # a trajectory's environment tokens too


def take_rows(tree: Any, rows: Array) -> Any:
    """``tree`` (a batch or cache) with only its ``rows``, in that order."""
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), tree)


def power_of_two(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for ``n`` ≤ 1): the padded sizes that keep the
    compiled shapes few."""
    return 1 << max(n - 1, 0).bit_length()


def scored_columns(longest: int, t: int, chunk: int) -> int:
    """Response columns to score for answers of at most ``longest`` tokens out of ``t``: a
    power of two (few compiled shapes), a whole number of ``chunk`` s when ``t`` holds one
    (the chunks, and so the teacher's samples, stay those of the whole batch), at most ``t``."""
    columns = power_of_two(longest)
    if t >= chunk:
        columns = -(-columns // chunk) * chunk
    return min(columns, t)


def response_columns(batch: RolloutBatch, t: int) -> RolloutBatch:
    """``batch`` with its per-response-position fields cut to their first ``t`` columns."""
    return RolloutBatch(
        **{
            f.name: value if value is None or RolloutBatch.axis(f.name) != "response" else value[:, :t]
            for f in dataclasses.fields(batch)
            for value in [getattr(batch, f.name)]
        }
    )


def repeat_last_column(x: Array, width: int) -> Array:
    """``[B, t, ...]`` → ``[B, width, ...]``, the columns past ``t`` copies of the last."""
    return jnp.take(x, jnp.minimum(jnp.arange(width), x.shape[1] - 1), axis=1)
