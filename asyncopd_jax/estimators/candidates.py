"""Monte-Carlo candidates: N draws from the exact sampling distribution, with log-probs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def sample_candidates(key: Array, logits: Array, n: int, temperature: float = 1.0) -> tuple[Array, Array]:
    """Draw ``n`` ids per position, with replacement, from ``softmax(logits / τ)``.

    The distribution is untruncated (no top-p / top-k): Monte-Carlo estimators are
    unbiased only when the recorded log-probs are those of the distribution the ids
    were drawn from. Sampling is by a two-level inverse CDF: the vocabulary is cut into
    ``≈ √V`` blocks, a uniform picks a block from the cumulative block masses, and the
    remainder picks the id inside that block from the block's own cumulative sum. That
    needs ``n`` uniforms per position (Gumbel-max needs ``V``) and no cumulative sum over
    the whole vocabulary (slow on CPU). Zero-probability ids are never drawn.

    Args:
      key: a PRNG key; the same key gives the same draws.
      logits: ``[B, T, V]`` (any leading shape).
      n: number of candidates ``N`` (static).
      temperature: ``τ > 0``.

    Returns:
      ``(ids, logp)``: ``[B, T, N]`` int32 ids and their fp32 log-probs
      ``log softmax(logits / τ)[ids]``.
    """
    if n < 1:
        raise ValueError(f"sample_candidates: n must be >= 1, got {n}")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(
            f"sample_candidates: temperature must be > 0 (got {temperature}); greedy decoding "
            "has no sampling distribution to draw Monte-Carlo candidates from"
        )
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    lead, vocab = logp_all.shape[:-1], logp_all.shape[-1]
    width = vocab if vocab <= 64 else -(-math.isqrt(vocab) // 8) * 8  # block size ≈ √V, multiple of 8
    n_blocks = -(-vocab // width)
    probs = jnp.exp(logp_all).reshape(-1, vocab)
    probs = jnp.pad(probs, ((0, 0), (0, n_blocks * width - vocab))).reshape(-1, n_blocks, width)
    block_cdf = jnp.cumsum(jnp.sum(probs, axis=-1), axis=-1)  # [R, n_blocks]

    u = jax.random.uniform(key, (probs.shape[0], n), jnp.float32) * block_cdf[:, -1:]
    u = jnp.minimum(u, jnp.nextafter(block_cdf[:, -1:], 0.0))  # u < total: a block with mass
    block = jnp.sum(block_cdf[:, None, :] <= u[..., None], axis=-1)  # [R, n]
    block = jnp.minimum(block, n_blocks - 1)
    before = jnp.where(block > 0, jnp.take_along_axis(block_cdf, jnp.maximum(block - 1, 0), axis=-1), 0.0)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(probs, block[..., None], axis=1), axis=-1)  # [R, n, width]
    # Rounding may put the remainder past the block's own total: keep it inside, so the
    # search lands on an id with positive mass.
    rest = jnp.clip(u - before, 0.0, jnp.nextafter(inner_cdf[..., -1], 0.0))
    within = jnp.minimum(jnp.sum(inner_cdf <= rest[..., None], axis=-1), width - 1)
    ids = (block * width + within).astype(jnp.int32).reshape(*lead, n)
    return ids, jnp.take_along_axis(logp_all, ids, axis=-1)
