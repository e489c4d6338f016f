"""Policy snapshots in a store (a bucket or a local directory), as full versions and
sparse deltas, each checked by its digest at every load.

    <root>/versions/<version>.json                 the commit record (created once)
    <root>/versions/<version>/<nonce>.safetensors  its payload, at a key no one else writes
    <root>/pins/<version>/<reader>                 a reader loading that version

The writer publishes a **full** version (every leaf) first and then every
``full_every``-th version, and in between a **delta** against the version before it
(:mod:`~asyncopd_jax.pipeline.snapshot_deltas`), unless the delta would be larger than half
the full version (e.g. fp32 weights, whose every element moves each step). The payload
goes to a unique key first; the version becomes visible only when its commit record is
created, holding the payload's key, the version it is a delta against, its bytes and the
SHA-256 digest of the full weights it yields. A reader that holds version ``u`` applies
the deltas ``u+1 … v`` it needs; one behind the chain (its base retired) starts again from
the newest full version at or below ``v``. Either way it checks the digest of what it
built against the record: a corrupted or lost delta stops the stage in one line naming
the version and the stage, never a policy silently different from the learner's.

Retention: the writer keeps the newest ``keep`` versions loadable, i.e. everything from
the newest full version at or below the oldest of them, and deletes older versions
unless a reader pins one: a pin is a record a reader creates while it loads, which the
writer honours until it has seen it unchanged for ``PIN_LEASE_S`` seconds of its own
clock (a reader that died while loading).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from asyncopd_jax.learner import distributed
from asyncopd_jax.pipeline import snapshot_deltas
from asyncopd_jax.storage import Store, records
from asyncopd_jax.storage.records import Backoff, LeaseClock

VERSIONS, PINS = "versions/", "pins/"
PIN_LEASE_S = 300.0  # a pin unchanged this long (by the writer's clock) belongs to a dead reader
DELTA_AT_MOST = 0.5  # a delta larger than this share of the full version is published full


class SnapshotDigestError(ValueError):
    """A rebuilt version's digest differs from the one its writer recorded."""


@dataclasses.dataclass(frozen=True)
class VersionRecord:
    """What a version's commit record says."""

    version: int
    base: int | None  # the version this is a delta against; None: a full version
    payload: str  # the payload's key
    nbytes: int  # the payload's bytes
    digest: str  # of the full weights this version yields

    def to_bytes(self) -> bytes:
        return records.record_bytes(dataclasses.asdict(self))

    @classmethod
    def parse(cls, blob) -> VersionRecord:
        data = records.parse(blob)
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def _record_key(version: int) -> str:
    return f"{VERSIONS}{version:010d}.json"


class ObjectSnapshotStore:
    """Versioned snapshots in ``store`` (see the module docstring); the
    :class:`~asyncopd_jax.pipeline.snapshots.SnapshotStore` interface.

    Args:
      store: where the versions live.
      abstract_params: the parameter pytree's structure, shapes, dtypes and shardings
        (readers place what they load like its leaves).
      keep: versions kept loadable.
      read_only: a reader in another process: never publishes nor removes versions.
      full_every: a full version every this many versions (1: no deltas).
      reader: this reader's name, for pins and for the digest error (e.g. ``rollout-0``).
    """

    def __init__(
        self,
        store: Store,
        abstract_params: nnx.State,
        keep: int = 4,
        read_only: bool = False,
        full_every: int = 10,
        reader: str = "learner",
    ):
        self.store, self.url = store, store.url
        self.keep, self.full_every, self.read_only = max(keep, 1), max(full_every, 1), read_only
        self.reader = f"{reader}-{uuid.uuid4().hex[:8]}"
        self.name = reader
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default),
            abstract_params,
        )
        self._treedef = jax.tree_util.tree_structure(nnx.to_pure_dict(self._abstract))
        # writer: the last published version's host leaves, and versions since the last full one
        self._published: tuple[int, list[np.ndarray]] | None = None
        self._since_full = 0
        # the last committed version, for metrics.jsonl: its number, payload bytes and whether it is full
        self.last_published: dict[str, int] = {}
        self._committed: VersionRecord | None = None  # set by the writing thread, read by flush
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pins = LeaseClock(PIN_LEASE_S)
        # reader: the version it built last, as host leaves and as the state it returned
        self._built: tuple[int, list[np.ndarray]] | None = None
        self._last: tuple[int, nnx.State] | None = None
        self._known: dict[int, VersionRecord] = {}
        self.last_load: dict[str, float] = {}  # the last load's seconds and bytes read

    # --- writer side --------------------------------------------------------------------

    def publish(self, version: int, params: nnx.State) -> None:
        """Start publishing ``version``; returns once the arrays are copied off the device.

        A learner over several processes: every process calls it (the leaves are gathered
        from all of them), process 0 alone writes."""
        if self.read_only:
            raise RuntimeError(f"this snapshot store is read-only (a reader of {self.url})")
        self.flush()
        leaves = [np.asarray(x) for x in distributed.gather(jax.tree_util.tree_leaves(nnx.to_pure_dict(params)))]
        if not distributed.is_leader():
            return
        self._thread = threading.Thread(target=self._write, args=(version, leaves), name="snapshot-writer", daemon=True)
        self._thread.start()

    def _write(self, version: int, leaves: list[np.ndarray]) -> None:
        try:
            record = self._encode_and_upload(version, leaves)
            if records.create(self.store, _record_key(version), record.to_bytes()) is None:
                raise FileExistsError(f"{self.url}: snapshot {version} was committed by another writer")
            self._published = (version, leaves)
            self._since_full = 0 if record.base is None else self._since_full + 1
            self._committed = record
        except BaseException as err:  # noqa: BLE001 - raised by flush
            self._error = err

    def _encode_and_upload(self, version: int, leaves: list[np.ndarray]) -> VersionRecord:
        previous = self._published
        full_bytes = sum(x.nbytes for x in leaves)
        arrays: dict[str, np.ndarray] | None = None
        base = None
        if previous is not None and previous[0] == version - 1 and self._since_full + 1 < self.full_every:
            delta = snapshot_deltas.diff(previous[1], leaves)
            if snapshot_deltas.nbytes(delta) <= DELTA_AT_MOST * full_bytes:
                arrays, base = snapshot_deltas.to_arrays(delta), previous[0]
        if arrays is None:
            arrays = {f"{i:05d}": snapshot_deltas.bits(x) for i, x in enumerate(leaves)}
        data = save_safetensors(arrays)
        payload = f"{VERSIONS}{version:010d}/{uuid.uuid4().hex}.safetensors"
        self.store.write(payload, data)
        return VersionRecord(version, base, payload, len(data), snapshot_deltas.digest(leaves))

    def flush(self) -> None:
        """Wait until the last published version is committed, then retire old versions."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        record, self._committed = self._committed, None
        if record is not None:  # read here, not on the writing thread: the record of this version alone
            self.last_published = {
                "snapshot_version": record.version,
                "snapshot_bytes": record.nbytes,
                "snapshot_full": int(record.base is None),
            }
        if not self.read_only and distributed.is_leader():
            self._retire()

    def _retire(self) -> None:
        committed = self._records()
        if len(committed) <= self.keep:
            return
        oldest_kept = sorted(committed)[-self.keep]
        fulls = [v for v, r in committed.items() if r.base is None and v <= oldest_kept]
        if not fulls:
            return
        for version in [v for v in committed if v < max(fulls)]:
            if self._pinned(version):
                continue
            # the record first: no reader starts on a version whose payload is going
            self.store.delete(_record_key(version))
            self.store.delete(committed[version].payload)

    def _pinned(self, version: int) -> bool:
        for key in self.store.list(f"{PINS}{version:010d}/"):
            blob = self.store.read(key)
            if blob is not None and not self._pins.expired(key, blob.generation):
                return True
        return False

    # --- reader side --------------------------------------------------------------------

    def _records(self) -> dict[int, VersionRecord]:
        """Every committed version's record (a record never changes: each is read once)."""
        out = {}
        for version in self.committed_versions():
            record = self._known.get(version)
            if record is None:
                blob = self.store.read(_record_key(version))
                if blob is None:
                    continue  # retired since the listing
                record = VersionRecord.parse(blob)
            out[version] = record
        self._known = out
        return out

    def committed_versions(self) -> list[int]:
        return sorted(
            int(key[len(VERSIONS) : -len(".json")])
            for key in self.store.list(VERSIONS)
            if key.endswith(".json") and "/" not in key[len(VERSIONS) :]
        )

    def latest_version(self) -> int | None:
        versions = self.committed_versions()
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        """Build ``version`` (default: the newest committed) and place it on this reader's
        devices; the version read last is returned again without a read."""
        committed = self._records()
        if not committed:
            raise LookupError(f"no committed snapshot under {self.url}")
        chosen = max(committed) if version is None else version
        if chosen not in committed:
            raise LookupError(f"snapshot {chosen} is not in {self.url} (committed: {sorted(committed)})")
        if self._last is not None and self._last[0] == chosen:
            return self._last
        start = time.perf_counter()
        pin = f"{PINS}{chosen:010d}/{self.reader}"
        self.store.write(pin, records.record_bytes({"reader": self.name}))
        try:
            leaves, nbytes = self._build(chosen, committed)
        finally:
            self.store.delete(pin)
        expected = committed[chosen].digest
        if snapshot_deltas.digest(leaves) != expected:
            raise SnapshotDigestError(
                f"snapshot {chosen} in {self.url} does not match its digest after loading ({self.name}): a corrupted "
                "or lost delta; the stage stops rather than sample from other weights than the learner published"
            )
        self._built = (chosen, leaves)
        abstract = jax.tree_util.tree_leaves(nnx.to_pure_dict(self._abstract))
        placed = [jax.device_put(x.view(a.dtype).reshape(a.shape), a.sharding) for x, a in zip(leaves, abstract)]
        state = jax.tree_util.tree_map(lambda x: x, self._abstract)
        nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(self._treedef, placed))
        self._last = (chosen, state)
        self.last_load = {"seconds": time.perf_counter() - start, "bytes": nbytes}
        return chosen, state

    def _chain(self, chosen: int, committed: dict[int, VersionRecord]) -> list[int]:
        """The versions to apply, oldest first: from this reader's last built version if the
        deltas reach it, else from the newest full version at or below ``chosen``."""
        chain = [chosen]
        while committed[chain[-1]].base is not None:
            base = committed[chain[-1]].base
            if self._built is not None and base == self._built[0]:
                return chain[::-1]
            if base not in committed:
                raise LookupError(f"snapshot {chain[-1]} in {self.url} is a delta against {base}, which is gone")
            chain.append(base)
        return chain[::-1]

    def _build(self, chosen: int, committed: dict[int, VersionRecord]) -> tuple[list[np.ndarray], int]:
        """The host leaves (bit patterns) of ``chosen`` and the bytes read for them."""
        chain = self._chain(chosen, committed)
        abstract = jax.tree_util.tree_leaves(nnx.to_pure_dict(self._abstract))
        leaves = None if committed[chain[0]].base is None else self._built[1]  # type: ignore[index]
        nbytes = 0
        for version in chain:
            record = committed[version]
            blob = self.store.read(record.payload)
            if blob is None:
                raise LookupError(f"snapshot {version}'s payload {self.url}/{record.payload} is gone")
            nbytes += len(blob.data)
            arrays = load_safetensors(blob.data)
            if record.base is None:
                if len(arrays) != len(abstract):
                    raise ValueError(
                        f"{self.url}/{record.payload} holds {len(arrays)} arrays; this model has {len(abstract)}"
                    )
                leaves = [arrays[f"{i:05d}"].view(a.dtype).reshape(a.shape) for i, a in enumerate(abstract)]
            else:
                assert leaves is not None
                leaves = snapshot_deltas.apply(leaves, snapshot_deltas.from_arrays(arrays, len(leaves)))
        assert leaves is not None
        return leaves, nbytes

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        backoff = Backoff(self.store)
        while (latest := self.latest_version()) is None or latest < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"policy snapshot {version} was not committed under {self.url} within {timeout} s "
                    f"(newest: {latest}); the learner must publish every version a rollout may need "
                    "(stages.startup_timeout sets how long a rollout waits)"
                )
            backoff.wait()

    def close(self) -> None:
        if not self.read_only:
            self.flush()
