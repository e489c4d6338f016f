"""Policy snapshots: versioned weights the learner publishes and rollout workers read.

Two stores with one interface:

* :class:`OrbaxSnapshotStore` — each version is an Orbax checkpoint directory
  ``<root>/<version>``, saved asynchronously (the learner goes on while it is written).
  Orbax writes into a temporary directory and renames it when complete, so a reader that
  only considers directories named by an integer never sees a partial snapshot. Old
  versions are removed by the store itself (rename, then delete), keeping at least
  ``keep`` (≥ η + 2) and never one a reader has pinned while restoring it.
* :class:`InMemorySnapshotStore` — the same contract without disk: the published arrays
  (copied, since the learner donates its buffers) are handed over directly.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx


class SnapshotStore(Protocol):
    def publish(self, version: int, params: nnx.State) -> None: ...
    def latest_version(self) -> int | None: ...
    def load(self, version: int | None = None) -> tuple[int, nnx.State]: ...
    def wait_for(self, version: int, timeout: float = 300.0) -> None: ...
    def close(self) -> None: ...


def _copy(params: nnx.State) -> nnx.State:
    return jax.tree_util.tree_map(jnp.copy, params)


class InMemorySnapshotStore:
    """Versions kept in a dict (the newest ``keep``); readers get the arrays themselves."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._versions: dict[int, nnx.State] = {}
        self._cond = threading.Condition()

    def publish(self, version: int, params: nnx.State) -> None:
        snapshot = _copy(params)
        with self._cond:
            self._versions[version] = snapshot
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]
            self._cond.notify_all()

    def latest_version(self) -> int | None:
        with self._cond:
            return max(self._versions, default=None)

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        with self._cond:
            if not self._versions:
                raise LookupError("no snapshot has been published yet")
            version = max(self._versions) if version is None else version
            if version not in self._versions:
                raise LookupError(f"snapshot {version} is not kept (kept: {sorted(self._versions)})")
            return version, self._versions[version]

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: max(self._versions, default=-1) >= version, timeout):
                raise TimeoutError(f"snapshot {version} was not published within {timeout} s")

    def close(self) -> None:
        pass


class OrbaxSnapshotStore:
    """Versioned Orbax checkpoints under ``root``, saved asynchronously.

    Args:
      root: directory of the snapshots (created).
      abstract_params: the parameter pytree's structure, shapes and dtypes (e.g.
        ``nnx.split(model)[1]``); restores place arrays like its leaves' shardings, or on
        the default device when leaves have none.
      keep: versions kept on disk (use η + 2 or more).
    """

    def __init__(self, root: str | Path, abstract_params: nnx.State, keep: int = 4):
        self.root = Path(root).resolve()  # Orbax wants absolute paths
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(keep, 1)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default),
            abstract_params,
        )
        self._writer = ocp.StandardCheckpointer()
        self._lock = threading.Lock()
        self._pins: dict[int, int] = {}

    # --- writer side ------------------------------------------------------------------

    def publish(self, version: int, params: nnx.State) -> None:
        """Start saving ``version``; returns once the arrays are copied off the device."""
        self.flush()  # one save in flight at a time: the previous one commits first
        self._writer.save(self.root / str(version), nnx.to_pure_dict(params))

    def flush(self) -> None:
        """Wait until the last published version is committed, then drop old versions."""
        self._writer.wait_until_finished()
        self._remove_old()

    def _remove_old(self) -> None:
        versions = self.committed_versions()
        with self._lock:
            doomed = [v for v in versions[: -self.keep] if not self._pins.get(v)]
            for v in doomed:
                # Rename first (atomic): readers list only integer-named directories.
                target = self.root / f"{v}.deleting"
                (self.root / str(v)).rename(target)
        for v in doomed:
            shutil.rmtree(self.root / f"{v}.deleting", ignore_errors=True)

    # --- reader side ------------------------------------------------------------------

    def committed_versions(self) -> list[int]:
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())

    def latest_version(self) -> int | None:
        versions = self.committed_versions()
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        """Restore ``version`` (default: the newest committed) onto this reader's devices."""
        with self._lock:
            versions = self.committed_versions()
            if not versions:
                raise LookupError(f"no committed snapshot under {self.root}")
            version = versions[-1] if version is None else version
            if version not in versions:
                raise LookupError(f"snapshot {version} is not on disk (committed: {versions})")
            self._pins[version] = self._pins.get(version, 0) + 1  # not deleted while we read
        try:
            restored = ocp.StandardCheckpointer().restore(self.root / str(version), nnx.to_pure_dict(self._abstract))
        finally:
            with self._lock:
                self._pins[version] -= 1
        state = jax.tree_util.tree_map(lambda x: x, self._abstract)
        nnx.replace_by_pure_dict(state, restored)
        return version, state

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while (latest := self.latest_version()) is None or latest < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot {version} was not committed within {timeout} s")
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._writer.close()
