"""A LoRA student's weights channel (issue 58): the base shipped once, each version's
adapters alone, every version rebuilt bit for bit in every format, a corrupted adapter
refused by its digest naming version and stage, and the sampler's merge at the swap always
from the base."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load, save

from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.lora import NO_ADAPTERS, LoRAParams, merged_state, split_adapters
from asyncopd_jax.pipeline.adapter_snapshots import AdapterSnapshots, MergedAtSwap
from asyncopd_jax.pipeline.layout import SnapshotChannel
from asyncopd_jax.pipeline.object_snapshots import SnapshotDigestError, VersionRecord
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore
from asyncopd_jax.pipeline.weights_channel import stored_snapshots
from asyncopd_jax.storage import open_store
from tests.storage.fixtures import pointed_at
from tests.tiny_models import tiny_lora_decoder

LORA = LoRAParams(rank=2, alpha=3.0, targets=("q_proj", "v_proj", "down_proj"))
# the fast suite: the flat file; the second step: Orbax and objects (the digest test covers objects here too)
FORMATS = [
    "safetensors",
    pytest.param("orbax", marks=pytest.mark.extended),
    pytest.param("objects", marks=pytest.mark.extended),
]


def _versions(count: int) -> tuple[nnx.GraphDef, list[nnx.State]]:
    """A LoRA student's ``count`` versions: the adapters moved at random each version, the
    base the same (as the learner of a LoRA student publishes them)."""
    graphdef, params = nnx.split(tiny_lora_decoder(LORA))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        out.append(params)
        trained, frozen = split_adapters(params)
        trained = jax.tree_util.tree_map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), trained)
        params = nnx.merge_state(trained, frozen)
    return graphdef, out


def _bits(state: nnx.State) -> list[np.ndarray]:
    return [np.asarray(x).view(f"u{x.dtype.itemsize}") for x in jax.tree_util.tree_leaves(state)]


def _nbytes(state: nnx.State) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


def _channel(directory, fmt: str) -> SnapshotChannel:
    return SnapshotChannel(in_memory=False, directory=str(directory), format=fmt, keep=3, temporary=False, full_every=3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lora_channel_ships_the_base_once_and_each_versions_adapters_alone(tmp_path, fmt):
    _, versions = _versions(5)
    channel = _channel(tmp_path / "snapshots", fmt)
    writer = stored_snapshots(channel, versions[0], read_only=False, reader="learner")
    reader = stored_snapshots(channel, versions[0], read_only=True, reader="rollout-0")
    assert isinstance(writer, AdapterSnapshots) and isinstance(reader, AdapterSnapshots)
    base_loads = []
    real_load = reader.base.load
    reader.base.load = lambda v=None: base_loads.append(v) or real_load(v)  # type: ignore[method-assign]
    trained, frozen = split_adapters(versions[0])
    records = []
    for v, state in enumerate(versions):
        writer.publish(v, state)  # commits the version before it
        records.append(dict(writer.last_published))
        reader.wait_for(v, timeout=30)
        got_version, got = reader.load(v)
        assert got_version == v
        for a, b in zip(_bits(got), _bits(state)):  # the whole student, bit for bit
            np.testing.assert_array_equal(a, b)
    writer.close()
    assert base_loads == [0]  # the base is read once
    assert reader.base.latest_version() == 0 and reader.adapters.latest_version() == 4
    # each version's record: its adapters' bytes (a safetensors header aside), and the base's once
    assert [r["snapshot_version"] for r in records[1:]] == [0, 1, 2, 3]
    for r in records[1:]:
        assert _nbytes(trained) <= r["snapshot_bytes"] < _nbytes(trained) + 2048, r
        assert r["snapshot_base_bytes"] >= _nbytes(frozen), r
    assert _nbytes(frozen) > 3 * _nbytes(trained)


def test_an_in_memory_lora_channel_copies_the_base_once_and_the_adapters_each_version():
    _, versions = _versions(3)
    channel = AdapterSnapshots(InMemorySnapshotStore(keep=1), InMemorySnapshotStore(keep=3))
    base_publishes = []
    real_publish = channel.base.publish
    channel.base.publish = lambda v, p: base_publishes.append(v) or real_publish(v, p)  # type: ignore[method-assign]
    for v, state in enumerate(versions):
        channel.publish(v, state)
        for a, b in zip(_bits(channel.load(v)[1]), _bits(state)):
            np.testing.assert_array_equal(a, b)
    trained, frozen = split_adapters(versions[0])
    assert channel.last_published == {
        "snapshot_version": 2,
        "snapshot_bytes": _nbytes(trained),
        "snapshot_base_bytes": _nbytes(frozen),
    }
    assert base_publishes == [0]  # published once


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.extended)])
def test_a_corrupted_adapter_is_refused_by_its_digest_naming_version_and_stage(tmp_path, request, where):
    _, versions = _versions(3)
    if where == "local":
        directory = str(tmp_path / "snapshots")
    else:
        stack = contextlib.ExitStack()
        request.addfinalizer(stack.close)
        directory = stack.enter_context(pointed_at(where, request.getfixturevalue(f"{where}_server").endpoint))
    channel = _channel(directory, "safetensors" if where == "local" else "objects")
    writer = stored_snapshots(channel, versions[0], read_only=False, reader="learner")
    for v, state in enumerate(versions):
        writer.publish(v, state)
    writer.close()
    adapters = open_store(f"{directory}/adapters")
    record = VersionRecord.parse(adapters.read("versions/0000000002.json"))
    arrays = dict(load(adapters.read(record.payload).data))
    key = sorted(arrays)[-1]
    arrays[key] = arrays[key].copy()
    arrays[key].reshape(-1)[0] ^= 1  # one bit of one adapter element
    adapters.write(record.payload, save(arrays))
    reader = stored_snapshots(channel, versions[0], read_only=True, reader="rollout-0")
    assert reader.load(1)[0] == 1  # the versions before it are intact
    with pytest.raises(
        SnapshotDigestError, match=r"^snapshot 2 in .*adapters does not match its digest after loading \(rollout-0\)"
    ):
        reader.load(2)


def test_the_sampler_merges_each_version_into_the_base_not_into_the_last_merge():
    """Versions 0, 1, 2 loaded in turn: each merged state equals the merge of that version
    alone, bit for bit (a sampler adding each version's change to its last merged weights
    would drift by rounding and, interrupted, hold half of one); the plain model on it
    computes what the LoRA student does."""
    graphdef, versions = _versions(3)
    channel = AdapterSnapshots(InMemorySnapshotStore(keep=1), InMemorySnapshotStore(keep=3))
    view = MergedAtSwap(channel, LORA.scale)
    plain = abstract_decoder(nnx.merge(graphdef, versions[0]).config, "float32", None, lora=NO_ADAPTERS)[0]
    tokens = jnp.asarray([[5, 9, 3, 17, 22, 4]])
    for v, state in enumerate(versions):
        channel.publish(v, state)
        got_version, merged = view.load()
        assert got_version == v and view.load()[1] is merged  # merged once per version
        for a, b in zip(_bits(merged), _bits(merged_state(state, LORA.scale))):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(
            np.asarray(nnx.merge(plain, merged)(tokens)), np.asarray(nnx.merge(graphdef, state)(tokens)), atol=2e-5
        )
    assert not jax.tree_util.tree_leaves(nnx.filter_state(merged, nnx.LoRAParam))
