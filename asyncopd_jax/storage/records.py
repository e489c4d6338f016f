"""Writes that can be repeated, leases judged by the observer's own clock, and polling.

**Idempotent conditional writes.** A client retries a request whose answer was lost (a
timeout after the server applied it); the retry of a create then meets the object it
wrote itself and is refused. Each record's bytes are unique to the attempt (records
carry their writer's id and a nonce), so a refusal is resolved by reading the object
back: the same bytes are ours, anything else is another writer's.

**Leases.** A lease record (a claim, a pin) is renewed by its holder through
:meth:`~asyncopd_jax.storage.store.Store.replace` against the generation it wrote last;
another process may take it over only after seeing the *same generation* for
``lease_s`` seconds of its own monotonic clock. No host's wall clock is compared with
another's.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from asyncopd_jax.storage.store import Blob, Store

#: This process, as written into every record it creates.
WRITER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def record_bytes(payload: dict[str, Any]) -> bytes:
    """A JSON record of ``payload`` with this process's id and a fresh nonce."""
    return json.dumps({**payload, "writer": WRITER, "nonce": uuid.uuid4().hex}, sort_keys=True).encode()


def parse(blob: Blob) -> dict[str, Any]:
    return json.loads(blob.data)


def create(store: Store, key: str, data: bytes) -> Blob | None:
    """:meth:`Store.create` that counts an earlier attempt of ours, applied, as success."""
    blob = store.create(key, data)
    if blob is not None:
        return blob
    existing = store.read(key)
    return existing if existing is not None and existing.data == data else None


def replace(store: Store, key: str, data: bytes, generation: str) -> Blob | None:
    """:meth:`Store.replace`, likewise."""
    blob = store.replace(key, data, generation)
    if blob is not None:
        return blob
    existing = store.read(key)
    return existing if existing is not None and existing.data == data else None


class LeaseClock:
    """When this process first saw each lease at its current generation."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self._seen: dict[str, tuple[str, float]] = {}

    def expired(self, key: str, generation: str) -> bool:
        """Whether ``key`` has stayed at ``generation`` for ``lease_s`` seconds of this clock."""
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is None or seen[0] != generation:
            self._seen[key] = (generation, now)
            return False
        return now - seen[1] >= self.lease_s

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)


class Backoff:
    """How long a consumer with nothing to do waits before looking again: a local store is
    polled every ``local_s`` (a directory listing costs microseconds); an object store from
    ``first_s`` doubling to ``most_s`` while idle (each listing is a billed request), back
    to ``first_s`` once something arrives."""

    def __init__(self, store: Store, local_s: float = 0.002, first_s: float = 0.05, most_s: float = 1.0):
        self.remote = store.remote
        self.local_s, self.first_s, self.most_s = local_s, first_s, most_s
        self._next = first_s

    def wait(self) -> None:
        if not self.remote:
            time.sleep(self.local_s)
            return
        time.sleep(self._next)
        self._next = min(self._next * 2, self.most_s)

    def reset(self) -> None:
        self._next = self.first_s
