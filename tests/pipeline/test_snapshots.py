"""Snapshot stores: versions round-trip, old ones are removed, readers never see a partial
or deleted snapshot while a publisher keeps saving."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore, OrbaxSnapshotStore
from tests.tiny_models import tiny_decoder


def _params_of_version(template: nnx.State, version: int) -> nnx.State:
    """Every parameter filled with the version number: a reader can tell what it got."""
    return jax.tree_util.tree_map(lambda x: jnp.full(x.shape, version, x.dtype), template)


def _version_of(params: nnx.State) -> int:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    values = {float(v) for leaf in leaves for v in np.unique(leaf)}
    assert len(values) == 1, f"a mixed snapshot: {sorted(values)[:5]}"  # partial or torn read
    return int(values.pop())


def _stores(tmp_path, template):
    return [OrbaxSnapshotStore(tmp_path / "snapshots", template, keep=3), InMemorySnapshotStore(keep=3)]


@pytest.mark.parametrize("kind", ["orbax", "memory"])
def test_round_trip_and_retention(tmp_path, kind):
    _, template = nnx.split(tiny_decoder(0))
    store = _stores(tmp_path, template)[0 if kind == "orbax" else 1]
    with pytest.raises(LookupError):
        store.load()
    for v in range(6):
        store.publish(v, _params_of_version(template, v))
    store.wait_for(5)
    version, params = store.load()
    assert version == 5 and _version_of(params) == 5
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(template)
    if kind == "orbax":
        store.flush()
        assert store.committed_versions() == [3, 4, 5]
    with pytest.raises(LookupError):
        store.load(0)
    store.close()


def test_orbax_snapshot_survives_the_learner_donating_its_buffers(tmp_path):
    _, template = nnx.split(tiny_decoder(0))
    store = OrbaxSnapshotStore(tmp_path / "s", template, keep=3)
    params = _params_of_version(template, 7)
    store.publish(7, params)
    jax.tree_util.tree_map(lambda x: x.delete(), params)  # as a donated train step would
    store.flush()
    assert _version_of(store.load(7)[1]) == 7


@pytest.mark.parametrize("kind", ["orbax", "memory"])
def test_concurrent_publish_and_read_never_tears(tmp_path, kind):
    _, template = nnx.split(tiny_decoder(0))
    store = _stores(tmp_path, template)[0 if kind == "orbax" else 1]
    store.publish(0, _params_of_version(template, 0))
    store.wait_for(0)
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
    store.wait_for(24)
    done.set()
    for t in threads:
        t.join(timeout=60)
    store.close()
    assert not errors, errors[:3]
    assert len(seen) > 10 and len(set(seen)) > 3  # readers really overlapped the publishing


def test_a_snapshot_being_restored_outlives_retention_until_its_reader_is_done(tmp_path, monkeypatch):
    """Deterministic: a reader is held inside the restore of version 0 while the writer
    publishes and flushes well past ``keep``; version 0 stays on disk (pinned) and restores
    intact, and the first flush after the reader is done removes it."""
    _, template = nnx.split(tiny_decoder(0))
    store = OrbaxSnapshotStore(tmp_path / "s", template, keep=2)
    store.publish(0, _params_of_version(template, 0))
    store.flush()
    inside, release = threading.Event(), threading.Event()
    real_restore = ocp.StandardCheckpointer.restore

    def held_restore(self, directory, *args, **kwargs):
        if Path(directory).name == "0":
            inside.set()  # the store has chosen and pinned version 0 and is reading it
            assert release.wait(60)
        return real_restore(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", held_restore)
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
import orbax.checkpoint as ocp
from flax import nnx
from asyncopd_jax.pipeline.snapshots import OrbaxSnapshotStore
from tests.tiny_models import tiny_decoder
from tests.pipeline.test_snapshots import _version_of

root, signals = Path(sys.argv[1]), Path(sys.argv[2])
real_restore = ocp.StandardCheckpointer.restore

def held_restore(self, directory, *args, **kwargs):
    (signals / "inside").touch()  # version 0 is chosen and pinned; hold until told to go on
    while not (signals / "go").exists():
        time.sleep(0.01)
    return real_restore(self, directory, *args, **kwargs)

ocp.StandardCheckpointer.restore = held_restore
store = OrbaxSnapshotStore(root, nnx.split(tiny_decoder(0))[1], read_only=True)
version, params = store.load(0)
print("restored", version, _version_of(params))
"""


def test_a_reader_in_another_process_pins_its_snapshot(tmp_path):
    """As above, with the reader a separate OS process (the stage-process placement): the
    pin is a file lock, not in-process state, so the writer sees it too."""
    import subprocess
    import sys
    import time

    _, template = nnx.split(tiny_decoder(0))
    store = OrbaxSnapshotStore(tmp_path / "s", template, keep=2)
    store.publish(0, _params_of_version(template, 0))
    store.flush()
    signals = tmp_path / "signals"
    signals.mkdir()
    repo = Path(__file__).resolve().parents[2]
    reader = subprocess.Popen([sys.executable, "-c", READER_PROCESS, str(tmp_path / "s"), str(signals)], cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (signals / "inside").exists():
        assert reader.poll() is None, reader.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for v in range(1, 5):
        store.publish(v, _params_of_version(template, v))
        store.flush()
    assert store.committed_versions() == [0, 3, 4]  # 0 is pinned by the other process
    (signals / "go").touch()
    out, _ = reader.communicate(timeout=120)
    assert reader.returncode == 0, out
    assert "restored 0 0" in out
    store.publish(5, _params_of_version(template, 5))
    store.flush()
    assert store.committed_versions() == [4, 5]
    store.close()
