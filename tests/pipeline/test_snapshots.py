"""Snapshot stores: versions round-trip, old ones are removed, readers never see a partial
or deleted snapshot while a publisher keeps saving."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore, InMemorySnapshotStore, as_published
from tests.tiny_models import tiny_decoder
from tests.waits import WAIT_S


def _params_of_version(template: nnx.State, version: int) -> nnx.State:
    """Every parameter filled with the version number: a reader can tell what it got."""
    return jax.tree_util.tree_map(lambda x: jnp.full(x.shape, version, x.dtype), template)


def _version_of(params: nnx.State) -> int:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    values = {float(v) for leaf in leaves for v in np.unique(leaf)}
    assert len(values) == 1, f"a mixed snapshot: {sorted(values)[:5]}"  # partial or torn read
    return int(values.pop())


def _store(tmp_path, template, kind: str, keep: int = 3):
    if kind == "memory":
        return InMemorySnapshotStore(keep=keep)
    return DiskSnapshotStore(tmp_path / "snapshots", template, keep=keep, format=kind)


KINDS = ["orbax", "safetensors", "memory"]
FORMATS = ["orbax", "safetensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_and_retention(tmp_path, kind):
    _, template = nnx.split(tiny_decoder(0))
    store = _store(tmp_path, template, kind)
    with pytest.raises(LookupError):
        store.load()
    for v in range(6):
        store.publish(v, _params_of_version(template, v))
    store.wait_for(5, timeout=WAIT_S)
    version, params = store.load()
    assert version == 5 and _version_of(params) == 5
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(template)
    if kind != "memory":
        store.flush()
        assert store.committed_versions() == [3, 4, 5]
        assert not [p.name for p in (tmp_path / "snapshots").iterdir() if "tmp" in p.name]  # no temporaries left
    with pytest.raises(LookupError):
        store.load(0)
    store.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_disk_snapshot_survives_the_learner_donating_its_buffers(tmp_path, fmt):
    _, template = nnx.split(tiny_decoder(0))
    store = DiskSnapshotStore(tmp_path / "s", template, keep=3, format=fmt)
    params = _params_of_version(template, 7)
    store.publish(7, params)
    jax.tree_util.tree_map(lambda x: x.delete(), params)  # as a donated train step would
    store.flush()
    assert _version_of(store.load(7)[1]) == 7


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_publish_and_read_never_tears(tmp_path, kind):
    _, template = nnx.split(tiny_decoder(0))
    store = _store(tmp_path, template, kind)
    store.publish(0, _params_of_version(template, 0))
    store.wait_for(0, timeout=WAIT_S)
    errors, seen = [], []
    done = threading.Event()

    def reader():
        try:
            while not done.is_set():
                version, params = store.load()
                assert _version_of(params) == version
                seen.append(version)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for v in range(1, 25):
        store.publish(v, _params_of_version(template, v))
    store.wait_for(24, timeout=WAIT_S)
    done.set()
    for t in threads:
        t.join(timeout=60)
    store.close()
    assert not errors, errors[:3]
    assert len(seen) > 10 and len(set(seen)) > 3  # readers really overlapped the publishing


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_snapshot_being_restored_outlives_retention_until_its_reader_is_done(tmp_path, monkeypatch, fmt):
    """Deterministic: a reader is held inside the restore of version 0 while the writer
    publishes and flushes well past ``keep``; version 0 stays on disk (pinned) and restores
    intact, and the first flush after the reader is done removes it."""
    _, template = nnx.split(tiny_decoder(0))
    store = DiskSnapshotStore(tmp_path / "s", template, keep=2, format=fmt)
    store.publish(0, _params_of_version(template, 0))
    store.flush()
    inside, release = threading.Event(), threading.Event()
    real_read = DiskSnapshotStore._read

    def held_read(self, directory):
        if Path(directory).name == "0":
            inside.set()  # the store has chosen and pinned version 0 and is reading it
            assert release.wait(60)
        return real_read(self, directory)

    monkeypatch.setattr(DiskSnapshotStore, "_read", held_read)
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(loaded=store.load(0)))
    reader.start()
    assert inside.wait(60)
    for v in range(1, 5):
        store.publish(v, _params_of_version(template, v))
        store.flush()
    assert store.committed_versions() == [0, 3, 4]  # 1 and 2 went; 0 is pinned by the reader
    release.set()
    reader.join(60)
    version, params = result["loaded"]
    assert version == 0 and _version_of(params) == 0
    store.publish(5, _params_of_version(template, 5))
    store.flush()
    assert store.committed_versions() == [4, 5]  # unpinned: removed by the next flush
    assert not any(p.name.startswith("0") for p in (tmp_path / "s").iterdir())
    store.close()


READER_PROCESS = """
import sys, time
from pathlib import Path
from flax import nnx
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore
from tests.tiny_models import tiny_decoder
from tests.pipeline.test_snapshots import _version_of

root, signals, fmt = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
real_read = DiskSnapshotStore._read

def held_read(self, directory):
    (signals / "inside").touch()  # version 0 is chosen and pinned; hold until told to go on
    while not (signals / "go").exists():
        time.sleep(0.01)
    return real_read(self, directory)

DiskSnapshotStore._read = held_read
store = DiskSnapshotStore(root, nnx.split(tiny_decoder(0))[1], read_only=True, format=fmt)
version, params = store.load(0)
print("restored", version, _version_of(params))
"""


@pytest.mark.e2e  # another process: the end-to-end step (-m e2e)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_in_another_process_pins_its_snapshot(tmp_path, fmt):
    """As above, with the reader a separate OS process (the stage-process placement): the
    pin is a file lock, not in-process state, so the writer sees it too."""
    import subprocess
    import sys
    import time

    _, template = nnx.split(tiny_decoder(0))
    store = DiskSnapshotStore(tmp_path / "s", template, keep=2, format=fmt)
    store.publish(0, _params_of_version(template, 0))
    store.flush()
    signals = tmp_path / "signals"
    signals.mkdir()
    repo = Path(__file__).resolve().parents[2]
    reader = subprocess.Popen(
        [sys.executable, "-c", READER_PROCESS, str(tmp_path / "s"), str(signals), fmt],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not (signals / "inside").exists():
            assert reader.poll() is None, reader.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for v in range(1, 5):
            store.publish(v, _params_of_version(template, v))
            store.flush()
        assert store.committed_versions() == [0, 3, 4]  # 0 is pinned by the other process
        (signals / "go").touch()
        out, _ = reader.communicate(timeout=WAIT_S)
    finally:
        if reader.poll() is None:  # a failure above: the reader would wait for "go" forever
            reader.kill()
    assert reader.returncode == 0, out
    assert "restored 0 0" in out
    store.publish(5, _params_of_version(template, 5))
    store.flush()
    assert store.committed_versions() == [4, 5]
    store.close()


def test_a_bfloat16_snapshot_round_trips_in_both_formats(tmp_path):
    _, template = nnx.split(tiny_decoder(0))
    template = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), template)
    for fmt in FORMATS:
        store = DiskSnapshotStore(tmp_path / fmt, template, keep=2, format=fmt)
        store.publish(3, _params_of_version(template, 3))
        store.flush()
        version, params = store.load()
        assert version == 3 and _version_of(params) == 3
        assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
        store.close()


def test_an_unknown_snapshot_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="snapshot format 'npz' is invalid; allowed: orbax, safetensors"):
        DiskSnapshotStore(tmp_path, {}, format="npz")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_reads_each_version_once(tmp_path, monkeypatch, fmt):
    """A rollout process loads the newest snapshot for every group: a version it already
    holds costs no read."""
    _, template = nnx.split(tiny_decoder(0))
    writer = DiskSnapshotStore(tmp_path / "s", template, keep=3, format=fmt)
    reader = DiskSnapshotStore(tmp_path / "s", template, read_only=True, format=fmt)
    reads = []
    real_read = DiskSnapshotStore._read
    monkeypatch.setattr(DiskSnapshotStore, "_read", lambda self, path: reads.append(path.name) or real_read(self, path))
    writer.publish(0, _params_of_version(template, 0))
    writer.flush()
    assert [reader.load()[0] for _ in range(3)] == [0, 0, 0]
    writer.publish(1, _params_of_version(template, 1))
    writer.flush()
    version, params = reader.load()
    assert version == 1 and _version_of(params) == 1 and _version_of(reader.load(1)[1]) == 1
    assert _version_of(reader.load(0)[1]) == 0  # an older version is read again
    assert reads == ["0", "1", "0"]
    writer.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_snapshot_directory_removed_under_its_users_is_a_clear_error(tmp_path, fmt):
    import shutil

    _, template = nnx.split(tiny_decoder(0))
    writer = _store(tmp_path, template, fmt)
    writer.publish(1, _params_of_version(template, 1))
    writer.flush()
    reader = DiskSnapshotStore(tmp_path / "snapshots", template, read_only=True, format=fmt)
    assert reader.load()[0] == 1
    shutil.rmtree(tmp_path / "snapshots")
    for action in (reader.load, reader.latest_version, lambda: writer.publish(2, _params_of_version(template, 2))):
        with pytest.raises(FileNotFoundError, match=f"the snapshot directory {tmp_path / 'snapshots'} was removed"):
            action()


def test_the_published_weights_are_the_floating_leaves_in_the_published_dtype():
    tree = {"w": jnp.full((2, 3), 1 + 2**-10, jnp.float32), "step": jnp.arange(3), "b": jnp.ones(2, jnp.bfloat16)}
    cast = as_published(tree, "bfloat16")
    assert (cast["w"].dtype, cast["step"].dtype, cast["b"].dtype) == (jnp.bfloat16, tree["step"].dtype, jnp.bfloat16)
    assert float(cast["w"][0, 0]) == 1.0  # rounded to bf16's 8 bits
    assert cast["step"] is tree["step"] and cast["b"] is tree["b"]  # nothing to cast: no copy
    assert as_published(tree, "float32")["w"] is tree["w"]
    abstract = as_published(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree), "bfloat16")
    assert abstract["w"] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
