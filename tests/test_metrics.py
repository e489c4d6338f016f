"""Metrics combine over the parts of a batch by the reduction their field declares."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from asyncopd_jax.metrics import Metrics, combine, identity, weighted


def _part(values: np.ndarray) -> Metrics:
    return Metrics(means={"x_mean": values.mean()}, maxes={"x_peak": values.max()})


def test_weighted_parts_combine_into_the_whole_batch():
    """Parts of 1, 3 and 6 tokens: the token-weighted sum of the means is the whole batch's
    mean, the max of the maxima its max (a metric's name plays no part: ``x_peak`` is a max)."""
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=n) for n in (1, 3, 6)]
    whole = np.concatenate(parts)
    shares = [weighted(_part(p), len(p) / len(whole)) for p in parts]
    got = functools.reduce(combine, shares, identity(jax.eval_shape(lambda: _part(parts[0]))))
    assert got.as_dict().keys() == {"x_mean", "x_peak"}
    np.testing.assert_allclose(got.means["x_mean"], whole.mean(), rtol=1e-6)
    assert got.maxes["x_peak"] == whole.max()


def test_a_metric_has_one_reduction():
    with pytest.raises(ValueError, match=r"metrics \['x'\] are both means and maxes"):
        Metrics(means={"x": np.float32(1)}, maxes={"x": np.float32(2)}).as_dict()
