"""Snapshots in a store: full versions and sparse deltas that rebuild the learner's weights
bit for bit, a full version every ``full_every``, retention that keeps the chain and
honours pins, and a corrupted delta stopped by its digest (every backend)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load, save

from asyncopd_jax.pipeline.object_snapshots import ObjectSnapshotStore, SnapshotDigestError, VersionRecord
from asyncopd_jax.storage import records


def _model(dtype=jnp.bfloat16) -> nnx.Module:
    return nnx.Sequential(
        nnx.Linear(32, 64, param_dtype=dtype, rngs=nnx.Rngs(0)), nnx.Linear(64, 8, param_dtype=dtype, rngs=nnx.Rngs(1))
    )


def _versions(params: nnx.State, count: int, step: float, seed: int = 0) -> list[nnx.State]:
    """``count`` versions, each ``params`` of the version before moved by ``step`` (in fp32,
    then cast: a small step changes few bf16 elements)."""
    rng = np.random.default_rng(seed)
    out, master = [], jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    for _ in range(count):
        out.append(jax.tree_util.tree_map(lambda m, x: jnp.asarray(m, x.dtype), master, params))
        master = jax.tree_util.tree_map(lambda m: m + step * rng.standard_normal(m.shape).astype(np.float32), master)
    return out


def _bits(state: nnx.State) -> list[np.ndarray]:
    return [np.asarray(x).view(f"u{x.dtype.itemsize}") for x in jax.tree_util.tree_leaves(state)]


def _writer_and_reader(store, params, **kw):
    writer = ObjectSnapshotStore(store, params, **kw)
    reader = ObjectSnapshotStore(store, params, read_only=True, reader="rollout-0", **kw)
    return writer, reader


def test_full_versions_and_deltas_rebuild_every_version_bit_for_bit(store):
    _, params = nnx.split(_model())
    versions = _versions(params, 7, step=1e-4)
    writer, reader = _writer_and_reader(store, params, keep=10, full_every=3)
    for v, state in enumerate(versions):
        writer.publish(v, state)
        writer.flush()
        got_version, got = reader.load()
        # in order, a reader reads only each version's own payload: the delta, once it holds the one before
        assert (
            got_version == v
            and reader.last_load["bytes"] == VersionRecord.parse(store.read(f"versions/{v:010d}.json")).nbytes
        )
        for a, b in zip(_bits(got), _bits(state)):
            np.testing.assert_array_equal(a, b)
    committed = writer._records()
    assert [committed[v].base for v in range(7)] == [None, 0, 1, None, 3, 4, None]
    full = committed[0].nbytes
    assert all(committed[v].nbytes < full / 2 for v in (1, 2, 4, 5)), {v: r.nbytes for v, r in committed.items()}
    # a reader that starts late builds from the newest full version and the deltas after it
    late = ObjectSnapshotStore(store, params, read_only=True, reader="rollout-1")
    v, got = late.load(5)
    assert v == 5 and late.last_load["bytes"] == committed[3].nbytes + committed[4].nbytes + committed[5].nbytes
    for a, b in zip(_bits(got), _bits(versions[5])):
        np.testing.assert_array_equal(a, b)
    writer.close()


def test_a_delta_larger_than_half_the_version_is_published_full(store):
    _, params = nnx.split(_model(jnp.float32))
    writer, _ = _writer_and_reader(store, params, full_every=10)
    for v, state in enumerate(_versions(params, 3, step=1e-3)):  # fp32: every element moves
        writer.publish(v, state)
    writer.flush()
    assert [r.base for r in writer._records().values()] == [None, None, None]


def test_a_corrupted_delta_is_refused_by_its_digest_naming_version_and_stage(store):
    _, params = nnx.split(_model())
    writer, reader = _writer_and_reader(store, params, full_every=10)
    for v, state in enumerate(_versions(params, 3, step=1e-4)):
        writer.publish(v, state)
    writer.flush()
    record = VersionRecord.parse(store.read("versions/0000000002.json"))
    arrays = dict(load(store.read(record.payload).data))
    key = next(k for k in arrays if k.endswith(".values"))
    arrays[key] = arrays[key].copy()
    arrays[key][0] ^= 1  # one bit of one changed element
    store.write(record.payload, save(arrays))
    assert reader.load(1)[0] == 1  # the versions before it are intact
    with pytest.raises(
        SnapshotDigestError, match=r"^snapshot 2 in .* does not match its digest after loading \(rollout-0\)"
    ):
        reader.load(2)


@pytest.mark.parametrize(("keep", "kept"), [(2, [1, 6, 7]), (3, [1, 3, 4, 5, 6, 7])])
def test_retention_keeps_the_chain_of_the_kept_versions_and_pinned_ones(store, keep, kept):
    """8 versions, a full one every 3 (0, 3, 6): the newest ``keep`` stay loadable with the
    chain from the newest full version at or below the oldest of them; version 1 is pinned
    by a reader, so it stays too; the rest is gone, payloads with their records."""
    _, params = nnx.split(_model())
    writer, _ = _writer_and_reader(store, params, keep=keep, full_every=3)
    versions = _versions(params, 8, step=1e-4)
    store.write("pins/0000000001/rollout-9", records.record_bytes({"reader": "rollout-9"}))  # a reader loading 1
    for v, state in enumerate(versions):
        writer.publish(v, state)
        writer.flush()
    assert writer.committed_versions() == kept
    leftover = sorted({int(k.split("/")[1]) for k in store.list("versions/") if "/" in k[len("versions/") :]})
    assert leftover == kept
    reader = ObjectSnapshotStore(store, params, read_only=True, reader="late")
    for v in kept[1:]:
        for a, b in zip(_bits(reader.load(v)[1]), _bits(versions[v])):
            np.testing.assert_array_equal(a, b)
