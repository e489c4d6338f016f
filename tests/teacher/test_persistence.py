"""Rollouts and score caches written with tensorstore read back bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.teacher import load_arrays, save_arrays


def test_round_trip_fp32_bf16_and_optional_fields(tmp_path):
    rng = np.random.default_rng(0)
    cache = TeacherScoreCache(
        token_logp=jnp.asarray(rng.normal(size=(2, 5)), jnp.bfloat16),
        topk_ids=jnp.asarray(rng.integers(0, 100, (2, 5, 3)), jnp.int32),
        topk_logp=jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32),
    )
    save_arrays(cache, tmp_path / "cache")
    back = load_arrays(tmp_path / "cache", TeacherScoreCache)
    assert back.candidate_logp is None and back.sample_ids is None
    for field in ("token_logp", "topk_ids", "topk_logp"):
        got, want = getattr(back, field), np.asarray(getattr(cache, field))
        assert got.dtype == want.dtype, field
        np.testing.assert_array_equal(got, want)

    batch = RolloutBatch(
        prompt_tokens=np.ones((2, 3), np.int32),
        prompt_mask=np.ones((2, 3), bool),
        response_tokens=np.ones((2, 5), np.int32),
        response_mask=np.ones((2, 5), bool),
        behavior_logp=np.zeros((2, 5), np.float32),
        token_version=np.arange(10, dtype=np.int32).reshape(2, 5),
    )
    save_arrays(batch, tmp_path / "batch")
    np.testing.assert_array_equal(load_arrays(tmp_path / "batch").token_version, batch.token_version)
    with pytest.raises(ValueError, match="holds a RolloutBatch, not a TeacherScoreCache"):
        load_arrays(tmp_path / "batch", TeacherScoreCache)


def test_incomplete_write_is_detected(tmp_path):
    (tmp_path / "partial").mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete write"):
        load_arrays(tmp_path / "partial")
