"""Where a run's stages meet: one interface over a local directory, ``gs://`` and ``s3://``.

A :class:`~asyncopd_jax.storage.store.Store` holds objects under string keys with the
operations an object store guarantees atomically — read, create-if-absent, replace-if-
unchanged (against a generation read before), unconditional write and delete, list —
and nothing a bucket lacks (no rename, no locks, no append). The exchange, the snapshot
store and the run directory are written against it, so one protocol runs everywhere:
``docs/storage.md`` says what each backend guarantees and where each guarantee is used.

    store = open_store("s3://bucket/runs/demo")   # or gs://…, or a local path
    store.create("exchange/tickets/0000000001.npz", data)   # a Blob, or None: it existed
"""

from asyncopd_jax.storage.location import is_url, join, open_store
from asyncopd_jax.storage.store import Blob, Store

__all__ = ["Blob", "Store", "is_url", "join", "open_store"]
