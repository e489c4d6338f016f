"""Estimators over spans: a student and a teacher of different tokenizers.

When the two tokenizers cut an answer differently, the teacher cannot score the student's
token t. Both can score a *span*: a stretch of the answer that both cut at its two ends
(:mod:`asyncopd_jax.teacher.span_alignment` finds the smallest ones). A span is written by the
student as tokens ``y_a..y_b`` and read by the teacher as its own tokens ``z_c..z_d``; the
two log-probs of the span given the text before it are chain-rule sums:

    log π_θ(span) = Σ_{t=a..b} log π_θ(y_t | y_<t),   log q(span) = Σ_{u=c..d} log q(z_u | z_<u)

and the behaviour policy's ``log μ(span)`` likewise. A span is then one action, and every
estimator built on the sampled token's ``log π_θ``, ``log μ`` and ``log q`` (the 1-sample
reverse KL with its importance weight and clip, PPO-style stabilisers) applies to it as it
is: summed over spans, the sampled ``log π_θ(y) − log q(y)`` is the whole answer's, so the
span forms are unbiased for the sequence-level KL exactly when the per-token forms are.
(``log q(y)`` is the teacher's log-prob of its own tokenisation of the text, as a served
teacher reports it; the mass it gives other tokenisations of the same text is left out.)

Layout, as everywhere else (``[B, T]`` over the student's answer tokens, target-aligned):

* ``span_end`` ``[B, T]`` bool: True on the last student token of each span the teacher
  scored. A span is the tokens after one end up to the next. Tokens after a row's last end
  are in no span (an answer cut inside a character): they get no loss and no gradient.
* the teacher's ``log q(span)`` sits on the span's last token; :func:`span_sums` puts the
  student's (and μ's) there too, and the per-span value is returned there, 0 elsewhere.
  A token mean of those values over the answer's tokens is then the sequence-level
  estimate over the number of student tokens, as the per-token form's is.
* forward KL compares next-token distributions where both tokenizers start a token: at a
  span's first token. The teacher's top-K there is mapped to the student tokens of exactly
  the same text; a teacher id with no such student token holds ``log q = −inf`` in the
  mapped cache (:func:`mask_unmapped`), so its mass joins the tail bucket (``tail=True``:
  ``q̄ = 1 − q(mapped)``, ``π̄ = 1 − π_θ(mapped)``) or drops out of the renormalised form.

With identical tokenizers every token is a span (``span_end`` = the answer's mask) and every
function here equals its per-token form in value and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, check_shapes, keep
from asyncopd_jax.estimators.forward_kl import forward_kl_topk
from asyncopd_jax.estimators.reverse_kl import reverse_kl_mc
from asyncopd_jax.estimators.stabilisers import ClipEps

Array = jax.Array


def span_index(span_end: ArrayLike) -> Array:
    """``[B, T]`` int32: each token's span, counted from 0 along the row (a token after the
    row's last end gets the number of its spans)."""
    ends = jnp.asarray(span_end, bool).astype(jnp.int32)
    return jnp.cumsum(ends, axis=-1) - ends


def span_sums(x: Array, span_end: ArrayLike) -> Array:
    """``[B, T]``: the sum of ``x`` over each span, on the span's last token; 0 elsewhere.

    Sums are exact per span (a segment sum, not a difference of running sums), and the
    gradient of a span's sum reaches each of its tokens with weight 1."""
    span_end = jnp.asarray(span_end, bool)
    check_shapes("span_sums", {"x": (x, "B T"), "span_end": (span_end, "B T")})
    t = x.shape[-1]
    index = span_index(span_end)
    sums = jax.vmap(lambda row, ids: jax.ops.segment_sum(row, ids, num_segments=t + 1))(x, index)
    return jnp.where(span_end, jnp.take_along_axis(sums, index, axis=-1), jnp.zeros((), x.dtype))


def in_spans(span_end: ArrayLike) -> Array:
    """``[B, T]`` bool: the tokens of a span that ends in the row (an end at or after them)."""
    span_end = jnp.asarray(span_end, bool)
    return jnp.flip(jnp.cumsum(jnp.flip(span_end, -1), -1), -1) > 0


def span_starts(span_end: ArrayLike) -> Array:
    """``[B, T]`` bool: the first token of each span (of a span that ends in the row)."""
    span_end = jnp.asarray(span_end, bool)
    after_end = jnp.pad(span_end[..., :-1], [(0, 0)] * (span_end.ndim - 1) + [(1, 0)], constant_values=True)
    return after_end & in_spans(span_end)


def mask_unmapped(student_logp: Array, teacher_logp: Array) -> Array:
    """``student_logp`` ``[B, T, K]`` with ``−inf`` where the teacher's is ``−inf``: a mapped
    top-K entry that names no student token (its id in the cache is a placeholder) is out of
    the student's support too, so both sides' tails hold its mass."""
    return jnp.where(jnp.isneginf(teacher_logp), -jnp.inf, student_logp)


def reverse_kl_spans(
    student_logp: Array,
    behavior_logp: Array,
    teacher_logp: Array,
    span_end: ArrayLike,
    *,
    recompute: bool = True,
    importance_sampling: bool = True,
    clip_eps: ClipEps | None = None,
    mask: ArrayLike | None = None,
) -> Array:
    """The sampled reverse KL per span: :func:`~asyncopd_jax.estimators.reverse_kl_mc` with
    the span as its one draw.

    ``L_span = − sg[log q(span) − log π_θ(span)] · ρ_span``, ``ρ_span = π_θ(span) / μ(span)``
    (clipped in log space; PPO-clipped with ``clip_eps``); ``recompute=False`` uses the
    stale signal ``log μ(span) − log q(span)``, ``importance_sampling=False`` drops ρ's
    value.

    Args:
      student_logp: ``[B, T]`` log π_θ of each student token.
      behavior_logp: ``[B, T]`` log μ of each student token (sampling time).
      teacher_logp: ``[B, T]`` log q of each span on its last token (stop-gradient).
      span_end: ``[B, T]`` bool, the spans (module docstring).
      recompute, importance_sampling, clip_eps: as :func:`reverse_kl_mc`'s.
      mask: ``[B, T]`` the answer's tokens, or None.

    Returns:
      ``[B, T]`` fp32: each span's value on its last token, 0 elsewhere.
    """
    span_end = jnp.asarray(span_end, bool)
    mask = as_mask(mask)
    check_shapes(
        "reverse_kl_spans",
        {
            "student_logp": (student_logp, "B T"),
            "behavior_logp": (behavior_logp, "B T"),
            "teacher_logp": (teacher_logp, "B T"),
            "span_end": (span_end, "B T"),
            "mask": (mask, "B T"),
        },
    )
    ends = span_end if mask is None else span_end & mask
    student = span_sums(keep(student_logp, mask).astype(jnp.float32), ends)
    behavior = span_sums(keep(behavior_logp, mask).astype(jnp.float32), ends)
    values = reverse_kl_mc(
        student[..., None],
        behavior[..., None],
        teacher_logp[..., None],
        recompute=recompute,
        importance_sampling=importance_sampling,
        clip_eps=clip_eps,
        mask=ends,
    )
    return keep(values, ends)


def forward_kl_topk_spans(
    student_logp: Array,
    teacher_logp: Array,
    span_end: ArrayLike,
    *,
    tail: bool = True,
    mask: ArrayLike | None = None,
) -> Array:
    """Forward KL on the teacher's top-K at each span's first token, mapped to student ids.

    :func:`~asyncopd_jax.estimators.forward_kl_topk` at the span starts, with the entries
    that map to no student token (``teacher_logp`` −inf) out of both supports
    (:func:`mask_unmapped`): their teacher mass is in the tail bucket (module docstring).

    Args:
      student_logp: ``[B, T, K]`` student log-probs on the mapped ids.
      teacher_logp: ``[B, T, K]`` the teacher's log-probs of its top-K (−inf: unmapped).
      span_end: ``[B, T]`` bool, the spans.
      tail: add the tail bucket.
      mask: ``[B, T]`` the answer's tokens, or None.

    Returns:
      ``[B, T]`` fp32, on each span's first token (0 elsewhere).
    """
    span_end = jnp.asarray(span_end, bool)
    where = mapped_starts(teacher_logp, span_end, mask)
    return forward_kl_topk(mask_unmapped(student_logp, teacher_logp), teacher_logp, tail=tail, mask=where)


def mapped_starts(teacher_logp: Array, span_end: ArrayLike, mask: ArrayLike | None = None) -> Array:
    """``[B, T]`` bool: the span starts (of the answer's tokens, ``mask``) where at least one of
    the teacher's top-K ``[B, T, K]`` maps to a student token. Where none does, both sides
    are all tail: the coarse KL is 0, and leaving the position out keeps a support of −inf
    alone out of ``logsumexp``'s gradient (NaN there)."""
    span_end = jnp.asarray(span_end, bool)
    mask = as_mask(mask)
    starts = span_starts(span_end if mask is None else span_end & mask)
    starts = starts if mask is None else starts & mask
    return starts & jnp.any(~jnp.isneginf(teacher_logp), axis=-1)


__all__ = [
    "forward_kl_topk_spans",
    "in_spans",
    "mapped_starts",
    "mask_unmapped",
    "reverse_kl_spans",
    "span_index",
    "span_starts",
    "span_sums",
]
