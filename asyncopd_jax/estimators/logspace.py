"""Log-space building blocks shared by the estimators: importance ratios, expectations, tail mass."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array

# exp(±20) ≈ 4.9e8: far beyond any useful weight, but finite in fp32, so a single wild
# token cannot produce inf/NaN gradients.
LOG_RATIO_CLIP = 20.0


def importance_ratio(logp: Array, base_logp: Array, log_clip: float = LOG_RATIO_CLIP) -> Array:
    """``ρ = exp(clip(log π − log base, −c, c))`` in fp32, differentiable in ``logp``.

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log-probs of the numerator policy (e.g. π_θ).
      base_logp: same shape, log-probs of the denominator policy (e.g. the behaviour
        policy μ). The caller decides whether it carries a gradient.
      log_clip: bound ``c`` on the log-ratio.

    Returns:
      ``ρ`` with the shape of ``logp``. Its gradient is ``ρ ∇log π`` inside the clip
      range and 0 outside.
    """
    log_ratio = logp.astype(jnp.float32) - base_logp.astype(jnp.float32)
    return jnp.exp(jnp.clip(log_ratio, -log_clip, log_clip))


def dense_logprobs(student_logits: Array, teacher_logits: Array) -> tuple[Array, Array]:
    """fp32 ``(log π_θ, log q)`` over the vocabulary; the teacher side is stop-gradient.

    Args:
      student_logits: ``[B, T, V]``.
      teacher_logits: ``[B, T, V]``.

    Returns:
      Two ``[B, T, V]`` fp32 arrays of log-probabilities.
    """
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    return student_logp, teacher_logp


def expectation(logp: Array, values: Array, axis: int = -1) -> Array:
    """``Σ_v exp(logp_v) · values_v`` over ``axis``, with ``0 · anything = 0``.

    Zero-probability entries (``logp = −inf``, e.g. a teacher that masks padded
    vocabulary rows) contribute exactly 0 instead of ``0 · (−inf) = NaN``.

    Args:
      logp: ``[..., K]`` log-probabilities (need not sum to 1: top-K supports don't).
      values: ``[..., K]`` values to weight.
      axis: the support axis.

    Returns:
      ``[...]`` fp32.
    """
    logp = logp.astype(jnp.float32)
    terms = jnp.where(jnp.isneginf(logp), 0.0, jnp.exp(logp) * values.astype(jnp.float32))
    return jnp.sum(terms, axis=axis)


# A support that covers (numerically) all the mass still gets a tail of at least this
# much, so that log(1 − mass) and its gradient stay finite; the tail term it adds is
# then below 1e-6 · |log-ratio| and vanishes exactly when both sides are clamped.
MIN_TAIL_MASS = 1e-6


def with_tail(support_logp: Array, min_tail: float = MIN_TAIL_MASS) -> Array:
    """Append the log of the mass outside a support: ``[..., K] → [..., K + 1]``.

    The last entry is ``log(1 − Σ_k exp(logp_k))``, computed stably (``log(−expm1(x))``
    near 0, ``log1p(−exp(x))`` below −log 2, with ``x = logsumexp(logp)``) and kept
    ≥ ``log(min_tail)``. Over the K + 1 "support ids + one tail bucket" categories a
    truncated KL is a proper divergence: ≥ 0, and 0 with 0 gradient when the two
    distributions agree.

    Args:
      support_logp: ``[..., K]`` full-vocabulary log-probs on K distinct ids.
      min_tail: floor on the tail mass.

    Returns:
      ``[..., K + 1]`` fp32.
    """
    support_logp = support_logp.astype(jnp.float32)
    mass = jax.nn.logsumexp(support_logp, axis=-1)
    mass = jnp.minimum(mass, math.log1p(-min_tail))
    tail = jnp.where(mass > -math.log(2.0), jnp.log(-jnp.expm1(mass)), jnp.log1p(-jnp.exp(mass)))
    return jnp.concatenate([support_logp, tail[..., None]], axis=-1)
