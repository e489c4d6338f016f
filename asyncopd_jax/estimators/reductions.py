"""Exact masked reductions over per-token values, in the loss aggregation modes RL users know.

A token mean over a batch split into micro-batches, mini-batches or devices is exact
only if every part contributes its *sum* and the division happens once, by the token
count of the whole batch. A mean of per-part means is not the batch mean whenever the
parts hold different numbers of tokens (a known defect of other OPD trainers). These
functions keep the sum and the count apart so that callers can do it right.

The same holds for every aggregation mode (the names are verl's ``loss_agg_mode``). Each
is a ratio ``Σ_parts numerator / Σ_parts denominator`` of two sums over the rows of the
batch (rows are sequences, never split between parts):

==========================  =====================================  ==============================
mode                        numerator (per part)                   denominator (per part)
==========================  =====================================  ==============================
``token-mean``              ``Σ_{b,t} m x``                        ``Σ_{b,t} m`` (tokens)
``seq-mean-token-mean``     ``Σ_b (Σ_t m x) / (Σ_t m)``            sequences with a token
``seq-mean-token-sum``      ``Σ_{b,t} m x``                        sequences with a token
``seq-mean-token-sum-norm`` ``Σ_{b,t} m x``                        sequences with a token × ``H``
==========================  =====================================  ==============================

(verl's current ``agg_loss``, with its global-batch arguments.) ``seq-mean-token-sum-norm``
is Dr. GRPO's loss: each sequence's token sum divided by a constant horizon ``H`` (the
generation budget) instead of its own length, so that a response's length does not
rescale its tokens' gradients. ``H`` defaults to the response length ``T`` of the arrays;
pass a fixed ``horizon`` where parts are trimmed to different lengths. (verl's older
``agg_loss`` divided by ``H`` alone, not by the number of sequences.)

Masked positions: a reduction selects ``values`` with ``where`` before multiplying, so NaN
or ±inf that ``values`` holds at a position the mask leaves out reaches neither the loss
nor the gradient of ``values``. It cannot stop a NaN *input* of an estimator from reaching
the gradient through the estimator's own backward pass (``0 · ∂f(NaN) = NaN``): give the
estimator the same ``mask`` as the reduction (every estimator takes one), and it keeps
masked inputs out of its arithmetic too. Masks and values may be any array-like (a
Python list too); a mask is bool, 0/1 or float weights of the values' shape.
:func:`loss_numerator` and :func:`loss_denominator` give one part's pair,
:func:`normalized_loss` one part's share of the whole batch's loss, and
:func:`aggregate` the loss of a batch (over devices with ``axis_name``).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import check_shapes

Array = jax.Array

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def _masked_sum(fn: str, values: ArrayLike, mask: ArrayLike) -> tuple[Array, Array]:
    """:func:`token_sum` for ``fn``, whose name a shape mismatch reports."""
    values, weights = jnp.asarray(values), jnp.asarray(mask)
    if values.shape != weights.shape:
        raise ValueError(
            f"{fn}: mask has shape {list(weights.shape)}; expected {list(values.shape)} like values "
            "(one weight per value)"
        )
    weights = weights.astype(jnp.float32)
    # `where` before the product, so that NaN/inf the values hold at masked positions
    # reaches neither the sum nor the gradient of `values`.
    masked = jnp.where(weights != 0, values.astype(jnp.float32), 0.0) * weights
    return jnp.sum(masked), jnp.sum(weights)


def token_sum(values: ArrayLike, mask: ArrayLike) -> tuple[Array, Array]:
    """Masked sum and token count, in fp32.

    Math: ``S = Σ_{b,t} m[b,t] · x[b,t]``, ``C = Σ_{b,t} m[b,t]``.

    Args:
      values: ``[B, T]`` (any shape) per-token values.
      mask: same shape as ``values`` (else a ValueError naming both shapes); bool or
        float weights. Masked positions contribute 0, in value and in the gradient of
        ``values``, even when ``values`` holds NaN or ±inf there (see the module for NaN
        in an estimator's inputs).

    Returns:
      ``(S, C)``, two fp32 scalars. Sums and counts of disjoint parts add up to those
      of the whole, so ``Σ_i S_i / Σ_i C_i`` is the exact token mean of the union.
    """
    return _masked_sum("token_sum", values, mask)


def token_mean(values: ArrayLike, mask: ArrayLike) -> Array:
    """Masked token mean ``Σ m·x / max(Σ m, 1)``; 0 (not NaN) for an all-zero mask.

    Args:
      values: ``[B, T]`` per-token values.
      mask: ``[B, T]`` bool or float weights, the shape of ``values``.

    Returns:
      fp32 scalar.
    """
    total, count = _masked_sum("token_mean", values, mask)
    return total / jnp.maximum(count, 1.0)


def normalized_token_sum(values: ArrayLike, mask: ArrayLike, total_count: ArrayLike) -> Array:
    """One part's share of a token mean over a larger batch: ``Σ m·x / max(N, 1)``.

    Use it as the loss of a micro-batch (or of one device's shard) with ``N`` the token
    count of the whole mini-batch: the sum of these shares over the parts, and the sum
    of their gradients, equal the token mean of the whole mini-batch and its gradient,
    however the mini-batch was split.

    Args:
      values: ``[B, T]`` per-token values of this part.
      mask: ``[B, T]`` bool or float weights of this part, the shape of ``values``.
      total_count: the token count ``N = Σ m`` of the whole batch (scalar).

    Returns:
      fp32 scalar.
    """
    total, _ = _masked_sum("normalized_token_sum", values, mask)
    return total / jnp.maximum(jnp.asarray(total_count, jnp.float32), 1.0)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation = {mode!r} is invalid; allowed: {', '.join(AGGREGATIONS)}")


def loss_numerator(values: ArrayLike, mask: ArrayLike, mode: Aggregation = "token-mean") -> Array:
    """One part's numerator of the aggregated loss (see the module's table).

    Args:
      values: ``[B, T]`` per-token values (rows are sequences).
      mask: ``[B, T]`` bool or float weights; masked positions contribute 0 even when
        ``values`` holds NaN or ±inf there.
      mode: an aggregation mode.

    Returns:
      fp32 scalar.
    """
    _check_mode(mode)
    values, mask = jnp.asarray(values), jnp.asarray(mask)
    check_shapes(f"loss_numerator ({mode})", {"values": (values, "B T"), "mask": (mask, "B T")})
    if mode != "seq-mean-token-mean":
        return _masked_sum(f"loss_numerator ({mode})", values, mask)[0]
    weights = mask.astype(jnp.float32)
    row_sums = jnp.sum(jnp.where(weights != 0, values.astype(jnp.float32), 0.0) * weights, axis=-1)
    row_counts = jnp.sum(weights, axis=-1)
    return jnp.sum(jnp.where(row_counts > 0, row_sums / jnp.where(row_counts > 0, row_counts, 1.0), 0.0))


def loss_denominator(mask: ArrayLike, mode: Aggregation = "token-mean", *, horizon: int | None = None) -> Array:
    """One part's denominator of the aggregated loss (see the module's table).

    Args:
      mask: ``[B, T]`` bool or float weights.
      mode: an aggregation mode.
      horizon: ``seq-mean-token-sum-norm`` only: the constant ``H`` (default: ``T``).

    Returns:
      fp32 scalar; the denominators of disjoint parts add up to the whole batch's.
    """
    _check_mode(mode)
    mask = jnp.asarray(mask)
    weights = mask.astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(weights)
    sequences = jnp.sum(jnp.sum(weights, axis=-1) > 0).astype(jnp.float32)
    if mode == "seq-mean-token-sum-norm":
        return sequences * (mask.shape[-1] if horizon is None else horizon)
    return sequences


def normalized_loss(
    values: ArrayLike, mask: ArrayLike, denominator: ArrayLike, mode: Aggregation = "token-mean"
) -> Array:
    """One part's share of the aggregated loss of a larger batch: ``numerator / max(D, 1)``.

    ``D`` is the whole batch's denominator (:func:`loss_denominator` of the whole mask).
    The shares of the parts, and their gradients, add up to :func:`aggregate` of the whole
    batch however it was split into rows. ``token-mean`` is :func:`normalized_token_sum`.

    Args:
      values: ``[B, T]`` per-token values of this part.
      mask: ``[B, T]`` bool or float weights of this part.
      denominator: the whole batch's denominator ``D`` (scalar).
      mode: an aggregation mode.

    Returns:
      fp32 scalar.
    """
    return loss_numerator(values, mask, mode) / jnp.maximum(jnp.asarray(denominator, jnp.float32), 1.0)


def aggregate(
    values: ArrayLike,
    mask: ArrayLike,
    mode: Aggregation = "token-mean",
    *,
    horizon: int | None = None,
    axis_name: str | None = None,
) -> Array:
    """The loss of a batch in an aggregation mode; 0 (not NaN) when nothing is masked in.

    With ``axis_name`` (inside ``shard_map``, the batch's rows split over that mesh axis)
    numerators and denominators are summed over the devices first (``psum``), so every
    device returns the loss of the whole batch. (:func:`normalized_loss` with a psum'd
    denominator gives each device its share instead.)

    Args:
      values: ``[B, T]`` per-token values.
      mask: ``[B, T]`` bool or float weights.
      mode: an aggregation mode.
      horizon: ``seq-mean-token-sum-norm``'s ``H`` (default: ``T``).
      axis_name: the mesh axis the rows are split over, or None.

    Returns:
      fp32 scalar.
    """
    numerator, denominator = loss_numerator(values, mask, mode), loss_denominator(mask, mode, horizon=horizon)
    if axis_name is not None:
        numerator, denominator = jax.lax.psum((numerator, denominator), axis_name)
    return numerator / jnp.maximum(denominator, 1.0)
