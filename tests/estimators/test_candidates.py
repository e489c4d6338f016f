"""Monte-Carlo candidates: exact distribution (chi-square), exact log-probs, determinism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from asyncopd_jax.estimators import sample_candidates
from tests.estimators import oracle


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_frequencies_match_probabilities_chi_square(temperature):
    logits = np.array([2.0, 0.5, -1.0, 0.0, 1.2, -np.inf, -3.0, 0.3], np.float32)
    n = 50_000
    ids, logp = sample_candidates(jax.random.key(0), jnp.asarray(logits)[None, None], n, temperature)
    probs = np.exp(oracle.log_softmax(logits.astype(np.float64) / temperature))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=len(logits))
    assert counts[5] == 0  # a zero-probability id is never drawn
    support = probs > 0
    result = stats.chisquare(counts[support], n * probs[support] / probs[support].sum())
    assert result.pvalue > 1e-3, result
    # The log-probs are those of exactly the temperature-scaled, untruncated distribution.
    np.testing.assert_allclose(logp[0, 0], np.log(probs[np.asarray(ids[0, 0])]), rtol=1e-5)


def test_two_level_sampling_with_many_blocks_and_an_empty_block():
    """V = 300 (block width 24, 13 blocks, the last one partial); a whole block has mass 0."""
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=1.5, size=300).astype(np.float32)
    logits[48:72] = -np.inf  # block 2 entirely
    logits[[5, 150, 299]] = -np.inf
    n = 200_000
    ids, logp = sample_candidates(jax.random.key(5), jnp.asarray(logits)[None], n)
    probs = np.exp(oracle.log_softmax(logits.astype(np.float64)))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=300)
    assert counts[probs == 0].sum() == 0
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    np.testing.assert_allclose(logp[0], np.log(probs[np.asarray(ids[0])]), rtol=1e-5, atol=1e-6)


def test_shapes_determinism_and_independence_across_positions():
    logits = jax.random.normal(jax.random.key(1), (3, 4, 50))
    ids, logp = sample_candidates(jax.random.key(2), logits, 6, 1.0)
    assert ids.shape == logp.shape == (3, 4, 6) and ids.dtype == jnp.int32 and logp.dtype == jnp.float32
    again, _ = jax.jit(sample_candidates, static_argnums=2)(jax.random.key(2), logits, 6, 1.0)
    np.testing.assert_array_equal(ids, again)
    other, _ = sample_candidates(jax.random.key(3), logits, 6, 1.0)
    assert not np.array_equal(ids, other)


def test_peaked_distribution_and_bf16_logits():
    logits = jnp.full((1, 1, 1000), -30.0, jnp.bfloat16).at[0, 0, 999].set(30.0)
    ids, logp = sample_candidates(jax.random.key(0), logits, 100)
    assert np.all(np.asarray(ids) == 999)
    assert logp.dtype == jnp.float32 and np.allclose(logp, 0.0, atol=1e-6)


def test_invalid_arguments():
    logits = jnp.zeros((1, 1, 4))
    # the message says why, not only what
    with pytest.raises(
        ValueError,
        match=r"temperature must be > 0 \(got 0.0\); greedy decoding has no sampling "
        "distribution to draw Monte-Carlo candidates from$",
    ):
        sample_candidates(jax.random.key(0), logits, 2, 0.0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        sample_candidates(jax.random.key(0), logits, 0)
