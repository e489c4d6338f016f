"""Policy snapshots: versioned weights the learner publishes and rollout workers read.

Two stores with one interface:

* :class:`DiskSnapshotStore` — each version is a directory ``<root>/<version>``, saved
  asynchronously (the learner goes on while it is written), in one of two formats:
  ``orbax`` (an Orbax checkpoint: every process of a multi-process learner writes its
  own shards) or ``safetensors`` (one flat ``params.safetensors`` file, written from the
  host copy of a one-process learner's parameters: about 1 ms for the demo's student
  against about 80 ms to save and 45 ms to restore through Orbax, whose cost per
  checkpoint is mostly fixed; ``benchmarks/bench_pipeline.py`` measures both). Either
  way the version is written into a temporary directory and renamed when complete, so a
  reader that only considers directories named by an integer never sees a partial
  snapshot. Old versions are removed by the store itself (rename, then delete), keeping
  at least ``keep`` (the versions a rollout may still start from, plus one) and never one
  that a reader — a thread of this process or another process on the host — is restoring:
  a reader holds a shared ``flock`` on ``<root>/<version>.lock`` while it restores, and
  the writer deletes a version only while it holds the exclusive lock (see
  :func:`_pinned`). Readers and the writer may be different processes opening the same
  ``root``.
* :class:`InMemorySnapshotStore` — the same contract without disk, for readers in the
  learner's process: each version is copied device-to-device onto the readers' devices
  (a copy even where those are the learner's: the learner donates its buffers).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.flax import load_file, save_file

SNAPSHOT_FORMATS = ("orbax", "safetensors")
FLAT_FILE = "params.safetensors"


class SnapshotStore(Protocol):
    """The weights channel's interface. ``last_published``: the last committed version's
    record for ``metrics.jsonl`` (``snapshot_version``, ``snapshot_bytes``: what it shipped;
    a store may add its own fields), {} before the first."""

    @property
    def last_published(self) -> dict[str, int]: ...

    def publish(self, version: int, params: nnx.State) -> None: ...
    def flush(self) -> None: ...  # the version published last is committed on return
    def latest_version(self) -> int | None: ...
    def load(self, version: int | None = None) -> tuple[int, nnx.State]: ...
    def wait_for(self, version: int, timeout: float = 300.0) -> None: ...
    def close(self) -> None: ...


def as_published(tree: Any, dtype: str) -> Any:
    """``tree`` (arrays or ``ShapeDtypeStruct`` s) with its floating leaves in ``dtype``: the
    weights as the samplers receive them (``RunConfig.published_dtype``). A leaf already in
    ``dtype`` is returned as it is (no copy: the default publishes the master weights)."""
    target = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)
        return x.astype(target)

    return jax.tree_util.tree_map(cast, tree)


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def _copy(params: nnx.State) -> nnx.State:
    return jax.tree_util.tree_map(jnp.copy, params)


class InMemorySnapshotStore:
    """Versions kept in a dict (the newest ``keep``); readers get the arrays themselves.

    ``shardings``: where readers want the weights (a pytree of shardings like the
    parameters, e.g. a rollout stage's mesh); None: where the learner has them."""

    def __init__(self, keep: int = 4, shardings: Any = None):
        self.keep = keep
        self.shardings = shardings
        self._versions: dict[int, nnx.State] = {}
        self._cond = threading.Condition()
        self.last_published: dict[str, int] = {}

    def publish(self, version: int, params: nnx.State) -> None:
        # Dispatched asynchronously: the learner goes on while the copy runs.
        snapshot = _copy(params) if self.shardings is None else jax.device_put(params, self.shardings, may_alias=False)
        self.last_published = {"snapshot_version": version, "snapshot_bytes": _nbytes(params)}
        with self._cond:
            self._versions[version] = snapshot
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]
            self._cond.notify_all()

    def flush(self) -> None:
        pass  # committed as it is published

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
                raise TimeoutError(
                    f"policy snapshot {version} was not published within {timeout} s "
                    f"(newest: {max(self._versions, default=None)}); the learner must publish every "
                    "version a rollout may need"
                )

    def close(self) -> None:
        pass


class _SafetensorsWriter:
    """Writes a version as one flat safetensors file (leaves numbered in tree order) from
    a background thread: into ``.<version>.tmp/``, then renamed to ``<version>/``."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, path: Path, pure_params: dict) -> None:
        # Copied to the host here: the learner donates its parameter buffers next step.
        leaves = jax.device_get(jax.tree_util.tree_leaves(pure_params))
        tmp = path.parent / f".{path.name}.tmp"

        def write() -> None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                save_file({f"{i:05d}": x for i, x in enumerate(leaves)}, str(tmp / FLAT_FILE))
                os.rename(tmp, path)  # the commit
            except BaseException as err:  # noqa: BLE001 - raised by wait_until_finished
                self._error = err

        self._thread = threading.Thread(target=write, name="snapshot-writer", daemon=True)
        self._thread.start()

    def wait_until_finished(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self.wait_until_finished()


def _gone(root: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"the snapshot directory {root} was removed while the run was using it (a cleaner of /tmp or "
        "/dev/shm?); the run stops; continue it with asyncopd train --resume (stages.snapshot_dir sets "
        "another place)"
    )


class DiskSnapshotStore:
    """Versioned snapshots under ``root`` (Orbax or flat safetensors), saved asynchronously.

    Args:
      root: directory of the snapshots (created).
      abstract_params: the parameter pytree's structure, shapes and dtypes (e.g.
        ``nnx.split(model)[1]``); restores place arrays like its leaves' shardings, or on
        the default device when leaves have none.
      keep: versions kept on disk (the trainer keeps ⌈η / mini_batches⌉ + 2).
      read_only: a reader in another process: never publishes nor removes versions.
      format: ``orbax`` or ``safetensors`` (see the module docstring); readers and the
        writer of one ``root`` must agree.
    """

    def __init__(
        self,
        root: str | Path,
        abstract_params: nnx.State,
        keep: int = 4,
        read_only: bool = False,
        format: str = "orbax",  # noqa: A002 - the word users know
    ):
        if format not in SNAPSHOT_FORMATS:
            raise ValueError(f"snapshot format {format!r} is invalid; allowed: {', '.join(SNAPSHOT_FORMATS)}")
        self.format = format
        self.root = Path(root).resolve()  # Orbax wants absolute paths
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(keep, 1)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default),
            abstract_params,
        )
        self.read_only = read_only
        self._last: tuple[int, nnx.State] | None = None  # the version this store read last
        self._saving: int | None = None  # the version being written
        self.last_published: dict[str, int] = {}
        self._writer = None
        if not read_only:
            self._writer = ocp.StandardCheckpointer() if format == "orbax" else _SafetensorsWriter()

    # --- writer side ------------------------------------------------------------------

    def publish(self, version: int, params: nnx.State) -> None:
        """Start saving ``version``; returns once the arrays are copied off the device."""
        if self._writer is None:
            raise RuntimeError(f"this snapshot store is read-only (a reader of {self.root})")
        self.flush()  # one save in flight at a time (the previous one commits first); raises if root is gone
        self._writer.save(self.root / str(version), nnx.to_pure_dict(params))
        self._saving = version

    def flush(self) -> None:
        """Wait until the last published version is committed, then drop old versions."""
        if self._writer is None:
            return
        try:
            self._writer.wait_until_finished()
        except Exception as err:  # the writers report a vanished directory in their own ways
            if not self.root.is_dir():
                raise _gone(self.root) from err
            raise
        if self._saving is not None and jax.process_index() == 0:
            files = (self.root / str(self._saving)).rglob("*")
            self.last_published = {
                "snapshot_version": self._saving,
                "snapshot_bytes": sum(f.stat().st_size for f in files if f.is_file()),
            }
        self._saving = None
        self._remove_old()

    def _remove_old(self) -> None:
        if jax.process_index() != 0:
            return  # a learner over several processes: process 0 alone retires versions
        versions = self.committed_versions()
        for v in versions[: -self.keep]:
            with _exclusive(self.root / f"{v}.lock") as free:
                if not free:
                    continue  # a reader is restoring it: try again at the next flush
                # Rename first (atomic): readers list only integer-named directories, and a
                # reader that takes the lock after us finds the version gone.
                (self.root / str(v)).rename(self.root / f"{v}.deleting")
                (self.root / f"{v}.lock").unlink(missing_ok=True)
            shutil.rmtree(self.root / f"{v}.deleting", ignore_errors=True)

    # --- reader side ------------------------------------------------------------------

    def committed_versions(self) -> list[int]:
        try:
            return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())
        except FileNotFoundError:
            raise _gone(self.root) from None

    def latest_version(self) -> int | None:
        versions = self.committed_versions()
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        """Restore ``version`` (default: the newest committed) onto this reader's devices;
        the version read last is returned again without a read (versions never change)."""
        for _ in range(100):  # the newest version can be retired between listing and locking it
            versions = self.committed_versions()
            if not versions:
                raise LookupError(f"no committed snapshot under {self.root}")
            chosen = versions[-1] if version is None else version
            if chosen not in versions:
                raise LookupError(f"snapshot {chosen} is not on disk (committed: {versions})")
            last = self._last
            if last is not None and last[0] == chosen:
                return last
            if not self.root.is_dir():
                raise _gone(self.root)
            with _pinned(self.root / f"{chosen}.lock"):
                # Under the shared lock the writer cannot delete it; it may have just before.
                if (self.root / str(chosen)).is_dir():
                    restored = self._read(self.root / str(chosen))
                    break
            if version is not None:
                raise LookupError(f"snapshot {version} was removed while it was being opened")
        else:
            raise LookupError(f"could not pin a snapshot under {self.root}: versions retired faster than read")
        state = jax.tree_util.tree_map(lambda x: x, self._abstract)
        nnx.replace_by_pure_dict(state, restored)
        self._last = (chosen, state)
        return chosen, state

    def _read(self, path: Path) -> dict:
        """The pure-dict parameters of the version directory ``path``."""
        abstract = nnx.to_pure_dict(self._abstract)
        if self.format == "orbax":
            return ocp.StandardCheckpointer().restore(path, abstract)
        flat = load_file(str(path / FLAT_FILE))
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        if len(flat) != len(leaves):
            raise ValueError(f"{path / FLAT_FILE} holds {len(flat)} arrays; this model has {len(leaves)}")
        return jax.tree_util.tree_unflatten(
            treedef, [jax.device_put(flat[f"{i:05d}"], x.sharding) for i, x in enumerate(leaves)]
        )

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while (latest := self.latest_version()) is None or latest < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"policy snapshot {version} was not committed under {self.root} within {timeout} s "
                    f"(newest: {latest}); the learner must publish every version a rollout may need "
                    "(stages.startup_timeout sets how long a rollout waits)"
                )
            time.sleep(0.005)

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._writer.close()


# --- pins across threads and processes ---------------------------------------------------
# ``flock`` locks belong to an open file description, so two threads that each open the
# lock file exclude each other just as two processes do. The lock file is created by
# whoever comes first and removed by the writer together with its version.


@contextlib.contextmanager
def _pinned(lock_file: Path) -> Iterator[None]:
    """Hold a shared lock on ``lock_file`` (a reader restoring that version)."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[bool]:
    """Try to take the exclusive lock without waiting; yield whether it was free."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
