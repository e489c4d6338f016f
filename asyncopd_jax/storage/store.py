"""The storage interface every backend implements (local directory, S3, GCS).

Keys are ``/``-separated relative names (``exchange/tickets/0000000001.npz``). A
**generation** is the backend's token for one version of an object — an S3 ETag, a GCS
generation number, a local file's inode and modification time — which changes whenever
the object is rewritten with other bytes. The two conditional operations are the only
atomic read-modify-write a bucket offers, and everything that needs one (a commit, a
claim, a lease renewal, a takeover) is built from them:

* :meth:`Store.create` — write only if the key is absent (S3 ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``, a local hard link);
* :meth:`Store.replace` — write only if the object is still at ``generation`` (S3
  ``If-Match``, GCS ``ifGenerationMatch``, a local compare-and-rename under a lock).

A refused condition is a return value (None), not an exception: it is the expected
outcome of a race. A condition refused because *our own* earlier attempt was applied
and its answer lost is told apart by reading the object back
(:mod:`asyncopd_jax.storage.records`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Blob:
    """An object's bytes and the generation they were read or written at."""

    data: bytes
    generation: str


class StorageError(OSError):
    """A storage operation failed (after the client's own retries); the message names the URL."""


class Store(Protocol):
    """Objects under string keys (see the module docstring)."""

    url: str  # where the store is rooted, as the user wrote it (a path or gs:// / s3:// URL)
    remote: bool  # an object store reached over the network (polled with backoff)

    def read(self, key: str) -> Blob | None:
        """The object at ``key``, or None if there is none."""
        ...

    def create(self, key: str, data: bytes) -> Blob | None:
        """Write ``data`` if ``key`` is absent; None if an object is there (nothing written)."""
        ...

    def replace(self, key: str, data: bytes, generation: str) -> Blob | None:
        """Overwrite ``key`` if it is still at ``generation``; None if it moved or is gone."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Write unconditionally: only for keys one writer owns (unique names, its own logs)."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` if present (unconditionally: only what nobody can claim)."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""
        ...

    def versions(self, prefix: str) -> dict[str, str]:
        """Every key that starts with ``prefix`` → its current generation (one listing, no
        object read): what changed since a copy was made."""
        ...

    def download(self, key: str, path: Path) -> str:
        """Stream the object at ``key`` into the file ``path`` (never whole in memory),
        checked against the backend's own checksum of the object where it keeps one (a
        mismatch is a :class:`StorageError`); returns the generation downloaded."""
        ...

    def child(self, prefix: str) -> Store:
        """The same storage rooted at ``prefix`` under this store's root."""
        ...
