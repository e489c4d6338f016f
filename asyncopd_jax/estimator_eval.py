"""Evaluating an estimator by name on the data contracts: the learner's side of
:mod:`asyncopd_jax.estimator_registry`.

:func:`required_ids` says which ids the student must be scored on for the configured
estimator (its spec's ``needs``, :data:`~asyncopd_jax.estimator_ids.ID_SOURCES`),
:func:`student_logprobs` scores them all in one fused gather, and :func:`evaluate_estimator`
checks the inputs against the spec, makes the padding finite, views the inputs per span for a
teacher of another tokenizer (:class:`_SpanView`), and runs the spec's adapter: per-token
losses ``[B, T]`` and the learner's metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

import jax
import jax.numpy as jnp

from asyncopd_jax import estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.estimator_ids import ID_SOURCES
from asyncopd_jax.estimator_inputs import EstimatorInputs, given
from asyncopd_jax.estimator_registry import EstimatorConfig, check_cross_tokenizer, get_estimator
from asyncopd_jax.metrics import Metrics

Array = jax.Array
_T = TypeVar("_T")


def required_ids(name: str, batch: RolloutBatch, cache: TeacherScoreCache | None) -> dict[str, Array]:
    """The id sets the learner must score for estimator ``name``, by StudentLogProbs field.

    Always includes ``"token"`` (the sampled tokens, ``[B, T]``); the others are
    ``[B, T, n]``. Raises a ValueError naming the missing cache or batch field and the
    setting that makes it.
    """
    spec = get_estimator(name)
    ids: dict[str, Array] = {"token": batch.response_tokens}
    for field in spec.needs:
        source = ID_SOURCES[field]
        value = source.ids.read_from(batch, cache)
        if value is None or source.scores.read_from(cache) is None:
            raise ValueError(
                f"estimator {name!r} needs {source.ids} and {source.scores}; the rollout "
                f"or teacher-scoring stage was not configured to produce them ({source.setting} >= 1)"
            )
        ids[field] = value
    return ids


def student_logprobs(
    ids: Mapping[str, Array], gather: Callable[[Array], Array | tuple[Array, Array]]
) -> StudentLogProbs:
    """Score every id set with one call of ``gather`` (``[B, T, K] ids → [B, T, K] log-probs``,
    or ``→ (log-probs, [B, T] entropy)``: then the entropy is kept too).

    The id sets of :func:`required_ids` are concatenated along the last axis so that
    one fused pass (e.g. :func:`asyncopd_jax.estimators.gather_logprobs_and_entropy_from_hidden`)
    serves them all, then split back into a :class:`StudentLogProbs`.
    """
    names = list(ids)
    parts = [ids[n][..., None] if n == "token" else ids[n] for n in names]
    sizes = [p.shape[-1] for p in parts]
    logp = gather(jnp.concatenate([p.astype(jnp.int32) for p in parts], axis=-1))
    entropy = None
    if isinstance(logp, tuple):
        logp, entropy = logp
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    fields = {n: logp[..., o : o + s] for n, o, s in zip(names, offsets, sizes)}
    fields["token"] = fields["token"][..., 0]
    return StudentLogProbs(**fields, entropy=entropy)


# The log-prob fields checked with ``check_inputs``, by owner; (field, over distinct ids: its mass is ≤ 1).
_LOGPROB_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {
    RolloutBatch: (("behavior_logp", False), ("candidate_behavior_logp", False), ("reference_logp", False)),
    TeacherScoreCache: (
        ("token_logp", False),
        ("candidate_logp", False),
        ("student_topk_logp", True),
        ("topk_logp", True),
        ("sample_logp", False),
    ),
    StudentLogProbs: (
        ("token", False),
        ("candidates", False),
        ("student_topk", True),
        ("teacher_topk", True),
        ("teacher_samples", False),
    ),
}


def _check_logprobs(name: str, inputs: Mapping[str, object], valid: Array) -> None:
    """Value checks (:mod:`asyncopd_jax.estimators.checks`) that every log-prob field of the
    estimator's inputs (label → a RolloutBatch, TeacherScoreCache or StudentLogProbs, or
    None) holds log-probs, on the valid positions ``valid`` ``[B, T]`` (bool)."""
    for label, obj in inputs.items():
        if obj is None:
            continue
        fields = _LOGPROB_FIELDS[type(obj)]
        est.checks.check_logprobs(
            name,
            {f"{label}.{f}": getattr(obj, f) for f, _ in fields},
            supports=tuple(f"{label}.{f}" for f, support in fields if support),
            mask=valid,
        )


def _finite_padding(tree: _T, valid: Array) -> _T:
    """Every float field ``[B, T, ...]`` of ``tree`` (a RolloutBatch, TeacherScoreCache or
    StudentLogProbs, or None) with its non-finite values at the padded positions (``valid``
    ``[B, T]`` False) replaced by 0, before any arithmetic: a NaN a cache holds there then
    reaches neither the values nor the gradients (``0 · ∂f(NaN)`` would be NaN). Finite
    values are kept, padded or not, so the per-token values are those of the pure
    functions, padding included."""

    def fix(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or tuple(x.shape[: valid.ndim]) != tuple(valid.shape):
            return x
        keep = valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)) | jnp.isfinite(x)
        return jnp.where(keep, x, jnp.zeros((), x.dtype))

    return jax.tree_util.tree_map(fix, tree)


def _require_inputs(
    config: EstimatorConfig,
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student: StudentLogProbs,
    proximal: StudentLogProbs | None,
    distill_coef: float,
) -> None:
    """A ValueError naming the first input the spec or the config needs and was not given."""
    spec, name = config.spec, config.name
    ids = required_ids(name, batch, cache)  # names a missing cache or batch field
    missing = [f for f in spec.needs if getattr(student, f) is None]
    if missing:
        raise ValueError(f"estimator {name!r} needs StudentLogProbs.{', '.join(missing)}")
    for field in spec.needs:
        if getattr(student, field).shape != ids[field].shape:
            raise ValueError(
                f"StudentLogProbs.{field} has shape {list(getattr(student, field).shape)}, "
                f"but its ids have shape {list(ids[field].shape)}"
            )
    if spec.needs_teacher_hidden and (cache is None or cache.hidden is None):
        raise ValueError(
            f"estimator {name!r} needs TeacherScoreCache.hidden: the teacher's hidden states (teacher.payload: hidden)"
        )
    if spec.needs_teacher_hidden and (student.forward_kl is None or student.reverse_kl is None):
        raise ValueError(f"estimator {name!r} needs StudentLogProbs.forward_kl and reverse_kl (dense_kls_from_hidden)")
    if spec.needs_proximal and proximal is None:
        raise ValueError(f"estimator {name!r} needs proximal log-probs (a no-grad forward before the update)")
    rl = batch.advantages is not None
    if cache is None and spec.needs_teacher_scores(rl=rl, distill_coef=distill_coef):
        why = f"distill_coef = {distill_coef}" if rl else f"estimator {name!r}"
        raise ValueError(f"{why} needs the teacher's scores (a TeacherScoreCache)")
    regularisers = config.regularisers
    if config.needs_reference_logp and batch.reference_logp is None:
        raise ValueError(
            f"reference_kl_coef = {regularisers.reference_kl_coef} needs RolloutBatch.reference_logp "
            "(the scoring stage scores the reference policy)"
        )
    if regularisers.entropy_coef and student.entropy is None:
        raise ValueError(
            f"entropy_coef = {regularisers.entropy_coef} needs StudentLogProbs.entropy "
            "(gather_logprobs_and_entropy_from_hidden)"
        )


def _advantage(
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student_token: Array,
    signal: Literal["stale", "recompute"],
    distill_coef: float,
) -> Array:
    """``[B, T]`` the (detached) advantage the stabilisers weight.

    Distillation: the teacher's reverse-KL reward ``log q − log base`` (base: μ for the
    ``stale`` signal, π_θ's ``student_token`` log-probs for ``recompute``). Reward-driven RL
    (``batch.advantages`` set): the reward advantage, plus ``distill_coef`` β times that
    teacher reward when β > 0.
    """
    base = batch.behavior_logp if signal == "stale" else student_token
    if batch.advantages is None:
        return jax.lax.stop_gradient(given(cache).token_logp - base)
    if distill_coef == 0:
        return jax.lax.stop_gradient(batch.advantages)
    return est.with_distillation(batch.advantages, given(cache).token_logp, base, distill_coef)


def evaluate_estimator(
    config: EstimatorConfig,
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student: StudentLogProbs,
    *,
    proximal: StudentLogProbs | None = None,
    distill_coef: float = 0.0,
) -> tuple[Array, Metrics]:
    """Evaluate the configured estimator: per-token losses ``[B, T]`` and scalar metrics.

    The losses include the optional regularisers of ``config`` (entropy bonus, KL to a
    reference). Reduce them with ``aggregate(values, batch.response_mask, mode)``
    (or the numerator/denominator forms across micro-batches). Non-finite inputs at
    padded positions (``batch.response_mask`` 0) are replaced by 0 first, so that they
    reach neither the loss nor its gradient; finite ones are left as they are. The metrics
    (:class:`~asyncopd_jax.metrics.Metrics`) are token means over the response mask
    (``means``): the loss, the 1-sample reverse-KL signal ``log π_θ − log q`` on the
    sampled tokens, the importance ratio ``π_θ / μ`` of the sampled tokens
    (``importance_ratio_mean``), ``zero_grad_fraction``, the share of tokens the estimator
    gives no gradient at all (PPO-style clipped or M2PO-masked), the student's ``entropy``
    where ``student.entropy`` is given, and ``reference_kl`` (k3) where the batch has
    reference log-probs; and the largest importance ratio (``maxes``:
    ``importance_ratio_max``).

    Args:
      config: the estimator (``config.name``, one of
        :data:`~asyncopd_jax.estimator_registry.ESTIMATORS`) and its knobs.
      batch, cache: the rollout and its teacher scores (``cache`` None: reward-driven RL
        without distillation, for the advantage estimators only).
      student: current student log-probs on the ids of :func:`required_ids`.
      proximal: log-probs of the proximal policy (a spec with ``needs_proximal`` only).
      distill_coef: reward-driven RL (``batch.advantages`` set) only: β, the weight of the
        teacher's reverse-KL reward added to the reward advantage (``rl.distill_coef``;
        0: pure RL, no teacher scores needed).

    Returns:
      ``(values [B, T] fp32, metrics: fp32 scalars by their reduction over parts)``.
    """
    spec = config.spec
    _require_inputs(config, batch, cache, student, proximal, distill_coef)
    valid = est.checks.as_mask(batch.response_mask)
    if config.check_inputs:
        _check_logprobs(config.name, {"batch": batch, "cache": cache, "student": student, "proximal": proximal}, valid)
    batch, cache = _finite_padding(batch, valid), _finite_padding(cache, valid)
    student, proximal = _finite_padding(student, valid), _finite_padding(proximal, valid)
    spans = _SpanView.of(config, cache, valid)
    token_student = student  # the per-token log-probs, for the regularisers (the student's own tokens)
    scored, seen = spans.batch(batch), spans.cache(cache)
    adv = None
    if spec.needs_advantage:  # detached: computed once, outside the gradient below
        adv = _advantage(
            scored, seen, jax.lax.stop_gradient(spans.student(student).token), config.stabiliser_signal, distill_coef
        )
    proximal = None if proximal is None else spans.student(proximal, cache)
    inputs = EstimatorInputs(scored, seen, student, proximal, adv)
    # The estimator once, with its pull-back to the student's log-probs: ∂(Σ_valid values)/∂
    # (student log-probs), elementwise and cheap, says which tokens the update moves at all
    # (zero_grad_fraction) without evaluating the estimator a second time.
    values, pullback = jax.vjp(
        lambda s: spans.values(spec.fn(dataclasses.replace(inputs, student=spans.student(s, cache)), config)), student
    )
    mask = batch.response_mask
    (grads,) = pullback(jnp.where(mask, 1.0, 0.0).astype(values.dtype))
    moved = jnp.zeros(mask.shape, bool)
    for g in jax.tree_util.tree_leaves(jax.lax.stop_gradient(grads)):
        moved = moved | ((g != 0) if g.ndim == mask.ndim else jnp.any(g != 0, axis=-1))
    regularisers = config.regularisers
    if regularisers.entropy_coef:
        values = values - regularisers.entropy_coef * given(student.entropy)
    if config.needs_reference_logp:
        values = values + regularisers.reference_kl_coef * est.reference_kl(
            token_student.token, given(batch.reference_logp), regularisers.reference_kl
        )
    # the importance ratio of what was sampled: of each token, or of each span
    signal = jax.lax.stop_gradient(spans.sums(student.token))
    token_ratio = est.importance_ratio(signal, spans.sums(batch.behavior_logp))
    actions = spans.actions(mask)
    means = {
        "loss": est.token_mean(jax.lax.stop_gradient(values), mask),
        "importance_ratio_mean": est.token_mean(token_ratio, actions),
        "zero_grad_fraction": est.token_mean((~moved).astype(jnp.float32), mask),
    }
    maxes = {"importance_ratio_max": jnp.max(jnp.where(actions, token_ratio, 0.0))}
    if student.entropy is not None:
        means["entropy"] = est.token_mean(jax.lax.stop_gradient(student.entropy), mask)
    if batch.reference_logp is not None:
        means["reference_kl"] = est.token_mean(
            est.reference_kl(jax.lax.stop_gradient(student.token), batch.reference_logp, "k3"), mask
        )
    if cache is not None:  # reward-driven RL without distillation has no teacher scores
        # per token, or per span over the answer's tokens: the sequence's signal per student token either way
        means["reverse_kl_signal"] = est.token_mean(spans.values(signal - cache.token_logp, "sum"), mask)
    return values, Metrics(means=means, maxes=maxes)


@dataclasses.dataclass(frozen=True)
class _SpanView:
    """The estimator's inputs seen per span when the teacher's tokenizer differs from the
    student's (``cache.span_end`` set: :mod:`asyncopd_jax.estimators.spans`), else as they are.

    What an estimator reads is its spec's ``spans``: ``"sum"``, the sampled tokens' log-probs
    (π_θ, μ, the proximal policy's) summed over each span onto its last token, where its
    values then live; ``"start"``, the student's log-probs on the teacher's top-K mapped to
    student ids, at the span starts where one maps (its values live there). Off those
    positions every input is made finite *before* the estimator runs (the "double where" of
    :mod:`asyncopd_jax.estimators.checks`), then its values there are set to 0."""

    span_end: Array | None = None  # [B, T] bool, the answer's span ends (None: per token)
    kind: Literal["sum", "start"] | None = None
    where: Array | None = None  # [B, T] bool, where the estimator's values live

    @classmethod
    def of(cls, config: EstimatorConfig, cache: TeacherScoreCache | None, valid: Array) -> _SpanView:
        if cache is None or cache.span_end is None:
            return cls()
        kind = config.spec.spans
        if kind is None:
            check_cross_tokenizer(config.name, "of this cache")
        span_end = jnp.asarray(cache.span_end, bool) & valid
        if kind == "start":
            return cls(span_end, kind, est.spans.mapped_starts(given(cache.topk_logp), span_end))
        return cls(span_end, kind, span_end)

    def sums(self, x: Array) -> Array:
        """``x`` ``[B, T]`` summed over each span onto its end (per token: ``x``)."""
        return x if self.span_end is None else est.spans.span_sums(x, self.span_end)

    def batch(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with μ's log-prob of each span (``"sum"``)."""
        if self.kind != "sum":
            return batch
        return dataclasses.replace(batch, behavior_logp=self.sums(batch.behavior_logp))

    def cache(self, cache: TeacherScoreCache | None) -> TeacherScoreCache | None:
        """``cache`` with the mapped top-K finite off the span starts (``"start"``)."""
        if cache is None or self.where is None or self.kind != "start":
            return cache
        return dataclasses.replace(cache, topk_logp=_off(given(cache.topk_logp), self.where))

    def student(self, logp: StudentLogProbs, cache: TeacherScoreCache | None = None) -> StudentLogProbs:
        """A :class:`StudentLogProbs` as the estimator reads it (``cache``: the teacher's,
        whose unmapped top-K entries the student's support leaves out)."""
        if self.span_end is None or self.where is None:
            return logp
        if self.kind == "sum":
            return dataclasses.replace(logp, token=self.sums(logp.token))
        mapped = est.spans.mask_unmapped(given(logp.teacher_topk), given(given(cache).topk_logp))
        return dataclasses.replace(logp, teacher_topk=_off(mapped, self.where))

    def values(self, values: Array, kind: Literal["sum", "start"] | None = None) -> Array:
        """``values`` ``[B, T]`` kept where they live (0 elsewhere); ``kind="sum"``: at the span ends."""
        where = self.span_end if kind == "sum" else self.where
        return values if where is None else jnp.where(where, values, jnp.zeros((), values.dtype))

    def actions(self, mask: Array) -> Array:
        """``[B, T]`` the positions of one sampled action each: tokens, or span ends."""
        return mask if self.span_end is None else self.span_end


def _off(x: Array, where: Array) -> Array:
    """``x`` ``[B, T, K]`` with 0 off ``where`` ``[B, T]`` (finite, and no gradient there)."""
    return jnp.where(where[..., None], x, jnp.zeros((), x.dtype))
