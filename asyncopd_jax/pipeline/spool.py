"""A spool: a directory of records, each committed atomically, claimed by one consumer.

The channel between stage processes (and hosts sharing a file system). A producer writes
a record to a temporary file, flushes it to disk and renames it to ``<name>.npz``: a
rename within one directory is atomic, so a consumer sees either nothing or the whole
record, and a record that was committed survives a crash of either side. A consumer
claims a record by renaming it into ``claimed/`` under its own name: exactly one of
several competing consumers wins the rename.

Records are ``.npz`` archives of named NumPy arrays, read with ``allow_pickle=False``:
no code is ever loaded from a record. :func:`group_to_record` / :func:`group_from_record`
turn a :class:`~asyncopd_jax.pipeline.staleness.RolloutGroup` (rollout batch, teacher
scores, policy versions, rewards) into a record and back.

    spool = Spool(root)
    spool.put("000000042", {"x": np.arange(3)})      # producer
    claim = spool.claim("rollout-0")                  # a consumer: a Claim or None
    arrays = claim.read(); ...; claim.done()          # or claim.give_back()
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.teacher.routing import TeacherRoute
from asyncopd_jax.teacher.scorer import TeacherUse

SUFFIX = ".npz"
POLL_SECONDS = 0.002  # how often a consumer with nothing to claim looks again


@dataclasses.dataclass(frozen=True)
class Claim:
    """A record one consumer has taken out of the spool (``claimed/<name>@<owner>.npz``)."""

    name: str
    owner: str
    path: Path
    spool: Spool

    def read(self) -> dict[str, np.ndarray]:
        return read_record(self.path)

    def done(self) -> None:
        """The record is consumed: delete it."""
        self.path.unlink(missing_ok=True)

    def give_back(self) -> None:
        """Return the record to the spool (its consumer failed or stopped)."""
        os.rename(self.path, self.spool.root / f"{self.name}{SUFFIX}")


class Spool:
    """Atomically committed ``<name>.npz`` records under ``root`` (created)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.claimed = self.root / "claimed"
        self.claimed.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, arrays: dict[str, np.ndarray]) -> Path:
        """Commit a record: write a temporary file, fsync it, rename it into place."""
        if "@" in name or "/" in name or name.startswith("."):
            raise ValueError(f"a record name must not contain '@' or '/' nor start with '.': {name!r}")
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle's bool
        tmp = self.root / f".{name}.{uuid.uuid4().hex}.tmp"
        _write_durably(tmp, buffer.getbuffer())
        final = self.root / f"{name}{SUFFIX}"
        os.rename(tmp, final)
        return final

    def names(self) -> list[str]:
        """Committed, unclaimed records, in name order."""
        return sorted(
            p.name[: -len(SUFFIX)]
            for p in self.root.iterdir()
            if p.name.endswith(SUFFIX) and not p.name.startswith(".")
        )

    def path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"

    def claim(self, owner: str, name: str | None = None) -> Claim | None:
        """Take ``name`` (default: the first record in name order) for ``owner``; None if gone."""
        for candidate in [name] if name is not None else self.names():
            target = self.claimed / f"{candidate}@{owner}{SUFFIX}"
            try:
                os.rename(self.root / f"{candidate}{SUFFIX}", target)
            except FileNotFoundError:
                continue  # another consumer was faster
            return Claim(candidate, owner, target, self)
        return None

    def claims_of(self, owner: str) -> list[Claim]:
        """Records ``owner`` has claimed and not finished (to give back when it died)."""
        out = []
        for p in sorted(self.claimed.glob(f"*@{owner}{SUFFIX}")):
            out.append(Claim(p.name[: -len(SUFFIX)].rsplit("@", 1)[0], owner, p, self))
        return out

    def clear(self) -> None:
        """Remove every record, claimed or not, and left-over temporary files."""
        for p in [*self.root.iterdir(), *self.claimed.iterdir()]:
            if p.is_file():
                p.unlink(missing_ok=True)


def _write_durably(path: Path, data: memoryview) -> None:
    """Write ``data`` to a new file and fsync it. A function of its own so that a test can
    pause a writer half-way and check that readers see nothing of the record meanwhile."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_record(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


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
