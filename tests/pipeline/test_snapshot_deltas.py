"""Sparse deltas between published versions: exact on bit patterns, the smallest form per
leaf (against the byte counts of the module's table), through a safetensors file and
back, and a digest that changes with any bit, dtype or shape."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load, save

from asyncopd_jax.pipeline import snapshot_deltas as sd

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8]


def _changed(old: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """``old`` with about ``fraction`` of its elements given new random bit patterns."""
    bits = sd.bits(old).copy()
    where = rng.random(bits.size) < fraction
    bits[where] ^= rng.integers(1, 2 ** (8 * bits.itemsize) - 1, where.sum(), dtype=np.uint64).astype(bits.dtype) | 1
    return bits.view(old.dtype).reshape(old.shape)


def _random(shape, dtype, rng):
    width = np.dtype(dtype).itemsize
    raw = rng.integers(0, 2 ** (8 * width), shape, dtype=np.uint64).astype(f"u{width}")
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.05, 0.5, 1.0])
def test_apply_of_diff_rebuilds_the_new_leaf_bit_for_bit_in_the_smallest_form(dtype, fraction):
    rng = np.random.default_rng(int(fraction * 1000) + np.dtype(dtype).itemsize)
    old = _random((37, 129), dtype, rng)
    new = _changed(old, fraction, rng)
    delta = sd.diff_leaf(old, new)
    count = int(np.count_nonzero(sd.bits(old) != sd.bits(new)))
    if count == 0:
        assert delta is None and sd.apply_leaf(old, delta) is old
        return
    n, width = old.size, np.dtype(dtype).itemsize
    sizes = {"indices": count * (4 + width), "bitmap": -(-n // 8) + count * width, "full": n * width}
    assert delta.form == min(sizes, key=sizes.get) and delta.nbytes == min(sizes.values())
    rebuilt = sd.apply_leaf(old, delta)
    assert rebuilt.dtype == old.dtype and rebuilt.shape == old.shape
    np.testing.assert_array_equal(sd.bits(rebuilt), sd.bits(new))
    assert sd.bits(old).tobytes() != sd.bits(new).tobytes()  # old untouched, still different


def test_nan_equals_itself_and_signed_zeros_differ():
    old = np.array([np.nan, 0.0, 1.0], np.float32)
    new = np.array([np.nan, -0.0, 1.0], np.float32)
    delta = sd.diff_leaf(old, new)
    assert sd.changed_elements([delta]) == 1  # the NaN at 0 is unchanged
    assert np.signbit(sd.apply_leaf(old, delta)[1])


def test_a_tree_goes_through_a_safetensors_file_and_back():
    rng = np.random.default_rng(0)
    old = [_random((64, 64), ml_dtypes.bfloat16, rng), _random((8,), np.float32, rng), _random((5, 3), np.int8, rng)]
    new = [_changed(old[0], 0.01, rng), old[1].copy(), _changed(old[2], 1.0, rng)]
    delta = sd.diff(old, new)
    assert delta[1] is None and [d.form for d in (delta[0], delta[2])] == ["indices", "full"]
    arrays = load(save(sd.to_arrays(delta)))
    back = sd.from_arrays(arrays, len(old))
    assert sd.nbytes(back) == sd.nbytes(delta) > 0
    assert sd.changed_elements(back) == int(np.count_nonzero(sd.bits(old[0]) != sd.bits(new[0]))) + old[2].size
    rebuilt = sd.apply(old, back)
    assert sd.digest(rebuilt) == sd.digest(new) != sd.digest(old)


def test_the_digest_sees_any_bit_the_dtype_and_the_shape():
    rng = np.random.default_rng(1)
    leaves = [rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    base = sd.digest(leaves)
    assert sd.digest([x.copy() for x in leaves]) == base
    flipped = sd.bits(leaves[1]).copy()
    flipped[3] ^= 1
    assert sd.digest([leaves[0], flipped.view(np.float32)]) != base
    assert sd.digest([leaves[0].reshape(256), leaves[1]]) != base
    assert sd.digest([leaves[0].view(np.int32), leaves[1]]) != base
    assert sd.digest(leaves[::-1]) != base


def test_mismatched_deltas_are_refused():
    a = np.zeros((4,), np.float32)
    with pytest.raises(ValueError, match="same shape and dtype"):
        sd.diff_leaf(a, np.zeros((5,), np.float32))
    with pytest.raises(ValueError, match="same leaves"):
        sd.diff([a], [a, a])
    delta = sd.diff_leaf(a, np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="cannot apply"):
        sd.apply_leaf(np.zeros((4,), np.float16), delta)
    bad = sd.LeafDelta("indices", np.array([9], np.uint32), np.array([1], np.uint32))
    with pytest.raises(ValueError, match="positions do not fit"):
        sd.apply_leaf(a, bad)
    with pytest.raises(ValueError, match="does not fit a tree of 1 leaves"):
        sd.from_arrays({"00003.full.values": np.zeros(1), "00003.full.positions": np.zeros(0)}, 1)
