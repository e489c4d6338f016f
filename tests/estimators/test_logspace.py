"""Importance ratios: exact inside the clip, clipped at e^{±LOG_RATIO_CLIP}, fp32 throughout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from asyncopd_jax.estimators import LOG_RATIO_CLIP, importance_ratio


def test_the_ratio_is_exact_inside_the_clip_and_clipped_on_both_sides():
    base = jnp.zeros(5)
    log_ratio = np.array([-3 * LOG_RATIO_CLIP, -LOG_RATIO_CLIP / 2, 0.0, LOG_RATIO_CLIP / 2, 3 * LOG_RATIO_CLIP])
    got = np.asarray(importance_ratio(jnp.asarray(log_ratio, jnp.float32), base))
    want = np.exp(np.clip(log_ratio, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.all(np.isfinite(got)) and got[0] > 0  # e^{-60} would be 1e-26: clipped to e^{-20} = 2e-9
    # a tighter clip of the caller's choice
    np.testing.assert_allclose(
        np.asarray(importance_ratio(jnp.array([5.0, -5.0]), jnp.zeros(2), 1.0)), [np.e, 1 / np.e], rtol=1e-6
    )


def test_bf16_log_probs_give_fp32_ratios():
    got = importance_ratio(jnp.array([-1.0, 0.5], jnp.bfloat16), jnp.array([0.0, 0.0], jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.exp([-1.0, 0.5]), rtol=1e-6)
