"""A spool: records committed atomically to a store, each claimed by one consumer.

The channel between stage processes, on whatever store the run's exchange is in (a local
directory, or a bucket every host reaches: :mod:`asyncopd_jax.storage`). It relies only
on the two conditional writes every backend has:

* **commit**: a producer creates ``<name>.npz`` if absent (a whole object or nothing is
  visible). A second commit under a taken name is refused; :meth:`Spool.put` returns
  False — the same group's output committed by a consumer that took over a claim.
* **claim**: a consumer creates ``claims/<name>`` (a JSON lease: owner, beat) if absent.
  While it works it renews the lease every ``lease_s / 3`` seconds (a replace against
  the generation it wrote); another consumer takes a claim over only after seeing it
  unchanged for ``lease_s`` seconds of its own clock (:class:`~asyncopd_jax.storage.records.LeaseClock`)
  — a consumer that died without giving back.
* **done**: the record is deleted, then its claim: a consumer that wins a claim after
  that finds no record and lets the claim go, so nothing is consumed twice from here;
  a group's *output*, committed under the same name, is at most one object.

Records are ``.npz`` archives of named NumPy arrays, read with ``allow_pickle=False``:
no code is ever loaded from a record. :func:`group_to_record` / :func:`group_from_record`
turn a :class:`~asyncopd_jax.pipeline.staleness.RolloutGroup` (rollout batch, teacher
scores, policy versions, rewards) into a record and back.

    spool = Spool(open_store(root))
    spool.put("000000042", {"x": np.arange(3)})      # producer
    claim = spool.claim("rollout-0")                  # a consumer: a Claim or None
    arrays = claim.read(); ...; claim.done()          # or claim.give_back()
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.npz import npz_arrays, npz_bytes
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.storage import Store, open_store, records
from asyncopd_jax.teacher.routing import TeacherRoute
from asyncopd_jax.teacher.scorer import TeacherUse

SUFFIX = ".npz"
CLAIMS = "claims/"
LEASE_S = 30.0  # a claim not renewed for this long (by the observer's clock) may be taken over


class Claim:
    """A record one consumer has taken out of the spool: its lease ``claims/<name>`` is
    renewed in the background until :meth:`done` or :meth:`give_back`."""

    def __init__(self, name: str, owner: str, generation: str, beat: int, spool: Spool, arrays: dict | None):
        self.name, self.owner, self.spool = name, owner, spool
        self.generation, self.beat = generation, beat
        self._arrays = arrays

    @property
    def key(self) -> str:
        return f"{CLAIMS}{self.name}"

    def read(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            arrays = self.spool.read(self.name)
            if arrays is None:
                raise FileNotFoundError(f"{self.spool.url}/{self.name}{SUFFIX} is gone")
            self._arrays = arrays
        return self._arrays

    def done(self) -> None:
        """The record is consumed: delete it, then its claim."""
        self.spool._release(self)
        self.spool.delete(self.name)
        self.spool.store.delete(self.key)

    def give_back(self) -> None:
        """Return the record to the spool (its consumer failed or stopped): delete the
        claim, if it is still this one (a claim taken over is left to its new owner)."""
        self.spool._release(self)
        current = self.spool.store.read(self.key)
        if current is not None and current.generation == self.generation:
            self.spool.store.delete(self.key)


class Spool:
    """Committed ``<name>.npz`` records in ``store`` (see the module docstring).

    ``store``: a :class:`~asyncopd_jax.storage.Store`, or a local directory (created)."""

    def __init__(self, store: Store | str | Path, lease_s: float = LEASE_S):
        self.store = open_store(store) if isinstance(store, (str, Path)) else store
        self.url = self.store.url
        self.lease_s = lease_s
        self._leases = records.LeaseClock(lease_s)
        self._held: dict[str, Claim] = {}
        self._lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._next_scan = 0.0  # when claims held by others are looked at next

    def put(self, name: str, arrays: dict[str, np.ndarray]) -> bool:
        """Commit a record; False if ``name`` already holds another writer's record."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"a record name must not contain '/' nor start with '.': {name!r}")
        return records.create(self.store, f"{name}{SUFFIX}", npz_bytes(arrays)) is not None

    def _listing(self) -> tuple[list[str], set[str]]:
        """(committed record names in name order, names with a claim), from one listing."""
        names, claimed = [], set()
        for key in self.store.list(""):
            if key.startswith(CLAIMS):
                claimed.add(key[len(CLAIMS) :])
            elif key.endswith(SUFFIX) and "/" not in key:
                names.append(key[: -len(SUFFIX)])
        return names, claimed

    def names(self) -> list[str]:
        """Committed, unclaimed records, in name order."""
        names, claimed = self._listing()
        return [n for n in names if n not in claimed]

    def read(self, name: str) -> dict[str, np.ndarray] | None:
        """The record ``name``'s arrays; None if it is not (or no longer) there."""
        blob = self.store.read(f"{name}{SUFFIX}")
        return None if blob is None else npz_arrays(blob.data)

    def delete(self, name: str) -> None:
        self.store.delete(f"{name}{SUFFIX}")

    def claim(self, owner: str, name: str | None = None) -> Claim | None:
        """Take ``name`` (default: the first free record in name order) for ``owner``;
        None if there is none. Claims held by others are looked at every ``lease_s / 4``
        seconds at most, and taken over once expired."""
        if name is not None:
            return self._take(owner, name) or self._take_over(owner, name)
        names, claimed = self._listing()
        for candidate in (n for n in names if n not in claimed):
            if (claim := self._take(owner, candidate)) is not None:
                return claim
        if claimed and time.monotonic() >= self._next_scan:
            self._next_scan = time.monotonic() + self.lease_s / 4
            for candidate in (n for n in names if n in claimed):
                if (claim := self._take_over(owner, candidate)) is not None:
                    return claim
        return None

    def _take(self, owner: str, name: str) -> Claim | None:
        """Create the claim of ``name`` (None if one exists)."""
        blob = records.create(self.store, f"{CLAIMS}{name}", records.record_bytes({"owner": owner, "beat": 0}))
        return None if blob is None else self._held_claim(owner, name, blob.generation, 0)

    def _take_over(self, owner: str, name: str) -> Claim | None:
        """Replace the claim of ``name`` if it has expired by this process's clock."""
        key = f"{CLAIMS}{name}"
        current = self.store.read(key)
        if current is None or not self._leases.expired(key, current.generation):
            return None
        beat = int(records.parse(current)["beat"]) + 1
        data = records.record_bytes({"owner": owner, "beat": beat})
        blob = records.replace(self.store, key, data, current.generation)
        return None if blob is None else self._held_claim(owner, name, blob.generation, beat)

    def _held_claim(self, owner: str, name: str, generation: str, beat: int) -> Claim | None:
        """The claim just won, renewed from now on; None (and the claim let go) if the
        record is gone: consumed meanwhile (done deletes the record before its claim)."""
        key = f"{CLAIMS}{name}"
        self._leases.forget(key)
        arrays = self.read(name)
        if arrays is None:
            self.store.delete(key)
            return None
        claim = Claim(name, owner, generation, beat, self, arrays)
        with self._lock:
            self._held[name] = claim
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, name="claim-renewer", daemon=True)
                self._renewer.start()
        return claim

    def _release(self, claim: Claim) -> None:
        with self._lock:
            if self._held.get(claim.name) is claim:
                del self._held[claim.name]

    def _renew(self) -> None:
        """Renew every held claim's lease every ``lease_s / 3`` seconds."""
        while True:
            time.sleep(self.lease_s / 3)
            with self._lock:
                held = list(self._held.values())
            for claim in held:
                data = records.record_bytes({"owner": claim.owner, "beat": claim.beat + 1})
                blob = records.replace(self.store, claim.key, data, claim.generation)
                if blob is not None:
                    claim.generation, claim.beat = blob.generation, claim.beat + 1
                else:  # taken over, or done meanwhile: stop renewing it
                    self._release(claim)

    def claims_of(self, owner: str) -> list[Claim]:
        """Records ``owner`` has claimed and not finished (to give back when it died)."""
        out = []
        for key in self.store.list(CLAIMS):
            blob = self.store.read(key)
            if blob is not None and records.parse(blob)["owner"] == owner:
                record = records.parse(blob)
                out.append(Claim(key[len(CLAIMS) :], owner, blob.generation, int(record["beat"]), self, None))
        return out

    def release_all(self) -> None:
        """Drop every claim (the run starts: no consumer of an earlier incarnation runs)."""
        for key in self.store.list(CLAIMS):
            self.store.delete(key)

    def clear(self) -> None:
        """Remove every record and claim."""
        for key in self.store.list(""):
            self.store.delete(key)


def read_record(path: str | Path) -> dict[str, np.ndarray]:
    """A record file's arrays (a local spool's ``<name>.npz``)."""
    return npz_arrays(Path(path).read_bytes())


# --- rollout groups as records -------------------------------------------------------------


def group_to_record(group: RolloutGroup, index: int) -> dict[str, np.ndarray]:
    """``batch.<field>``, ``cache.<field>`` (absent fields left out), the versions, the
    group's index and its per-sample rewards (if computed)."""
    out: dict[str, np.ndarray] = {
        "index": np.asarray(index),
        "oldest_version": np.asarray(group.oldest_version),
        "newest_version": np.asarray(group.newest_version),
    }
    for prefix, obj in (("batch", group.batch), ("cache", group.cache)):
        if obj is None:
            continue
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if value is not None:
                out[f"{prefix}.{field.name}"] = np.asarray(value)
    if group.rewards is not None:
        out["rewards"] = np.asarray(group.rewards, dtype=np.float32)
    if group.last_load is not None:
        out["last_load"] = np.asarray(group.last_load, np.float64)
    if group.route is not None:
        for field in dataclasses.fields(group.route):
            value = getattr(group.route, field.name)
            if value is not None:
                out[f"route.{field.name}"] = np.asarray(value)
    if group.teacher_uses:
        out["uses.names"] = np.asarray(list(group.teacher_uses))
        out["uses.values"] = np.asarray(  # NaN: an in-process teacher's wait (None)
            [dataclasses.astuple(u) for u in group.teacher_uses.values()], np.float64
        )
    return out


def group_from_record(arrays: dict[str, np.ndarray]) -> tuple[RolloutGroup, int]:
    """The inverse of :func:`group_to_record`: ``(group, index)``, arrays on the default device."""

    def build(cls, prefix):
        fields = {f.name: arrays.get(f"{prefix}.{f.name}") for f in dataclasses.fields(cls)}
        if all(v is None for v in fields.values()):
            return None
        return cls(**{k: None if v is None else jnp.asarray(v) for k, v in fields.items()})

    group = RolloutGroup(
        build(RolloutBatch, "batch"),
        build(TeacherScoreCache, "cache"),
        int(arrays["oldest_version"]),
        int(arrays["newest_version"]),
        rewards=arrays.get("rewards"),
        last_load=(int(arrays["last_load"][0]), float(arrays["last_load"][1])) if "last_load" in arrays else None,
        route=TeacherRoute(arrays["route.teacher"], arrays.get("route.prompt_tokens"), arrays.get("route.prompt_mask"))
        if "route.teacher" in arrays
        else None,
        teacher_uses={
            str(name): TeacherUse(int(rows), float(seconds), int(requests), None if np.isnan(wait) else float(wait))
            for name, (rows, seconds, requests, wait) in zip(
                arrays.get("uses.names", []), arrays.get("uses.values", [])
            )
        },
    )
    return group, int(arrays["index"])
