"""Exact masked reductions over per-token values.

A token mean over a batch split into micro-batches, mini-batches or devices is exact
only if every part contributes its *sum* and the division happens once, by the token
count of the whole batch. A mean of per-part means is not the batch mean whenever the
parts hold different numbers of tokens (a known defect of other OPD trainers). These
functions keep the sum and the count apart so that callers can do it right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def token_sum(values: Array, mask: Array) -> tuple[Array, Array]:
    """Masked sum and token count, in fp32.

    Math: ``S = Σ_{b,t} m[b,t] · x[b,t]``, ``C = Σ_{b,t} m[b,t]``.

    Args:
      values: ``[B, T]`` (any shape) per-token values.
      mask: same shape as ``values``; bool or float weights. Masked positions
        contribute 0 even when ``values`` holds NaN or ±inf there.

    Returns:
      ``(S, C)``, two fp32 scalars. Sums and counts of disjoint parts add up to those
      of the whole, so ``Σ_i S_i / Σ_i C_i`` is the exact token mean of the union.
    """
    weights = mask.astype(jnp.float32)
    # `where` (not a bare product) so that NaN/inf in padded positions cannot leak.
    masked = jnp.where(weights != 0, values.astype(jnp.float32), 0.0) * weights
    return jnp.sum(masked), jnp.sum(weights)


def token_mean(values: Array, mask: Array) -> Array:
    """Masked token mean ``Σ m·x / max(Σ m, 1)``; 0 (not NaN) for an all-zero mask.

    Args:
      values: ``[B, T]`` per-token values.
      mask: ``[B, T]`` bool or float weights.

    Returns:
      fp32 scalar.
    """
    total, count = token_sum(values, mask)
    return total / jnp.maximum(count, 1.0)


def normalized_token_sum(values: Array, mask: Array, total_count: Array | float) -> Array:
    """One part's share of a token mean over a larger batch: ``Σ m·x / max(N, 1)``.

    Use it as the loss of a micro-batch (or of one device's shard) with ``N`` the token
    count of the whole mini-batch: the sum of these shares over the parts, and the sum
    of their gradients, equal the token mean of the whole mini-batch and its gradient,
    however the mini-batch was split.

    Args:
      values: ``[B, T]`` per-token values of this part.
      mask: ``[B, T]`` bool or float weights of this part.
      total_count: the token count ``N = Σ m`` of the whole batch (scalar).

    Returns:
      fp32 scalar.
    """
    total, _ = token_sum(values, mask)
    return total / jnp.maximum(jnp.asarray(total_count, jnp.float32), 1.0)
