"""A published version's cost in a plan: the bytes each device holds of a sharded tree, and
the two routes' arithmetic, against hand-counted oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.pipeline.layout import SnapshotChannel
from asyncopd_jax.scale.chips import CHIPS
from asyncopd_jax.scale.swaps import DELTA_FRACTION, bytes_per_device, swap_figures, total_bytes


def _tree(mesh: Mesh) -> dict:
    """[64, 32] fp32 split by rows over the mesh's 4 devices, [10] bf16 whole on each, and an
    unplaced [3] int32."""

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    return {
        "w": placed((64, 32), jnp.float32, PartitionSpec("x")),
        "b": placed((10,), jnp.bfloat16, PartitionSpec()),
        "n": jax.ShapeDtypeStruct((3,), jnp.int32),
    }


def test_a_device_holds_its_shards_and_every_replicated_array():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    tree = _tree(mesh)
    # per device: 16 rows × 32 × 4 bytes + 10 × 2 bytes; the unplaced array counts on its own
    assert bytes_per_device(tree) == 16 * 32 * 4 + 10 * 2
    assert total_bytes(tree) == 64 * 32 * 4 + 10 * 2 + 3 * 4


def test_in_memory_each_sampler_chip_receives_its_shard_and_the_learner_sends_every_samplers_copy():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    tree, chip = _tree(mesh), CHIPS["v5e"]
    channel = SnapshotChannel(in_memory=True, directory="", format="", keep=3, temporary=False)
    swap = swap_figures(channel, tree, tree, learner_chips=8, samplers=2, chip=chip)
    total, shard = total_bytes(tree), bytes_per_device(tree)
    assert swap.load_seconds == pytest.approx(shard / (200e9 / 2))  # v5e: 1,600 Gbit/s both ways
    assert swap.publish_seconds == pytest.approx(2 * total / 8 / (200e9 / 2))
    assert (swap.published_bytes, swap.reader_chip_bytes) == (total, shard)


def test_through_storage_the_version_is_written_once_and_read_whole_by_each_sampler():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    tree = _tree(mesh)
    channel = SnapshotChannel(in_memory=False, directory="/snap", format="orbax", keep=3, temporary=False)
    swap = swap_figures(channel, tree, tree, learner_chips=8, samplers=2, chip=CHIPS["v5e"], storage_bytes_per_s=2.5e9)
    total = total_bytes(tree)
    assert swap.publish_seconds == pytest.approx(total / 2.5e9)
    assert swap.load_seconds == pytest.approx(total / 2.5e9)
    assert swap.route == "orbax through storage at 2.50 GB/s"
    # its fp32 and int32 leaves change in every element each step: no delta would save anything
    assert swap.delta_bytes is None and "sparse deltas would save nothing" in swap.describe()
    assert "stages.snapshot_dtype: bfloat16" in swap.describe()  # what would make them pay


@pytest.mark.parametrize("every", [1, 3])
def test_as_objects_a_version_costs_a_full_one_every_n_and_deltas_between(every):
    tree = {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), "b": jax.ShapeDtypeStruct((10,), jnp.bfloat16)}
    channel = SnapshotChannel(
        in_memory=False, directory="gs://b/s", format="objects", keep=3, temporary=False, full_every=every
    )
    swap = swap_figures(channel, tree, tree, learner_chips=8, samplers=2, chip=CHIPS["v5e"], storage_bytes_per_s=2e9)
    total = total_bytes(tree)
    expected = total * (1 + (every - 1) * DELTA_FRACTION) / every
    assert swap.delta_bytes == pytest.approx(expected) and swap.delta_seconds == pytest.approx(expected / 2e9)
    assert f"a full version every {every}" in swap.describe() and f"{expected / 1e9:.3f} GB" in swap.describe()
    in_memory = SnapshotChannel(in_memory=True, directory="", format="", keep=3, temporary=False)
    assert swap_figures(in_memory, tree, tree, learner_chips=8, samplers=2, chip=CHIPS["v5e"]).delta_bytes is None
