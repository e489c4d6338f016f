"""Monte-Carlo candidates: N draws from the exact sampling distribution, with log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def sample_candidates(key: Array, logits: Array, n: int, temperature: float = 1.0) -> tuple[Array, Array]:
    """Draw ``n`` ids per position, with replacement, from ``softmax(logits / τ)``.

    The distribution is untruncated (no top-p / top-k): Monte-Carlo estimators are
    unbiased only when the recorded log-probs are those of the distribution the ids
    were drawn from. Sampling is by inverse CDF (one ``[..., V]`` cumulative sum and
    ``n`` binary searches per position), so memory does not grow with ``n · V`` as
    Gumbel-max would. Zero-probability ids are never drawn.

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
    vocab = logp_all.shape[-1]
    cdf = jnp.cumsum(jnp.exp(logp_all), axis=-1).reshape(-1, vocab)
    total = cdf[:, -1:]
    # u ∈ [0, total) strictly, so the search always lands on an id with positive mass.
    u = jax.random.uniform(key, (cdf.shape[0], n), jnp.float32) * total
    u = jnp.minimum(u, jnp.nextafter(total, 0.0))
    ids = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf, u)
    ids = jnp.minimum(ids, vocab - 1).astype(jnp.int32).reshape(*logits.shape[:-1], n)
    return ids, jnp.take_along_axis(logp_all, ids, axis=-1)
