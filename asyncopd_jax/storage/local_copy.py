"""What a run reads from a bucket — a model directory, a tokenizer, a dataset file —
copied once to this host and checked before each use.

``local_copy("gs://b/models/qwen3-0.6b")`` returns a local directory holding every object
under that prefix (``s3://b/data/train.jsonl``: a local file of that name). The copy lives
in ``$ASYNCOPD_CACHE`` (default ``~/.cache/asyncopd``) under the URL's last part and a hash
of the URL, shared by every process of this host (a lock makes one of them download while
the others wait), and is reused by later runs. Each use:

1. lists the URL (one request) and compares each object's generation with the copy's
   manifest: an object rewritten in the bucket is downloaded again, a new one is added,
   one deleted there is deleted here;
2. downloads through :meth:`~asyncopd_jax.storage.Store.download`, which checks the bytes
   against the backend's own checksum (GCS CRC32C, an S3 MD5 ETag);
3. checks every file of the copy against the SHA-256 its manifest recorded when it was
   downloaded, so a copy truncated or altered on this host is refused (and fetched again)
   rather than loaded: a model that is not what the bucket holds never reaches a run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from asyncopd_jax.storage.location import is_url, local_name, open_store
from asyncopd_jax.storage.store import StorageError, Store

MANIFEST = ".asyncopd-manifest.json"


def cache_root() -> Path:
    """``$ASYNCOPD_CACHE``, else ``~/.cache/asyncopd``."""
    return Path(os.environ.get("ASYNCOPD_CACHE") or Path.home() / ".cache" / "asyncopd")


def resolve_location(value: str | Path) -> Path:
    """A setting that names something to read: a local path as it is, a bucket URL → its
    local copy (:func:`local_copy`)."""
    return local_copy(str(value)) if is_url(value) else Path(value)


def local_copy(url: str) -> Path:
    """The local copy of the directory or object at ``url`` (see the module docstring)."""
    url = url.rstrip("/")
    home = cache_root() / local_name(url)
    home.mkdir(parents=True, exist_ok=True)
    copy = home / url.rsplit("/", 1)[-1]
    store, root = open_store(url), copy
    objects = store.versions("")
    if not objects:  # not a directory: one object, which its parent's listing names
        parent_url, _, name = url.rpartition("/")
        store, root = open_store(parent_url), home
        objects = {k: g for k, g in store.versions(name).items() if k == name}
        if not objects:
            raise StorageError(f"{url}: no object and no directory there")
    with _locked(home):
        _sync(store, objects, root, home / MANIFEST, url)
    return copy


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    fd = os.open(home / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _sync(store: Store, objects: dict[str, str], root: Path, manifest_path: Path, url: str) -> None:
    """Make each ``root / key`` hold the object ``key`` of ``store`` at generation
    ``objects[key]``, reusing what the manifest says is already here and intact."""
    try:
        manifest: dict[str, dict[str, str]] = json.loads(manifest_path.read_text())["files"]
    except (FileNotFoundError, ValueError, KeyError):
        manifest = {}
    manifest_path.unlink(missing_ok=True)  # until the copy is whole again
    kept: dict[str, dict[str, str]] = {}
    for key, generation in sorted(objects.items()):
        local, entry = root / key, manifest.get(key)
        if entry and entry["generation"] == generation and local.is_file() and _sha256(local) == entry["sha256"]:
            kept[key] = entry
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.partial")
        try:
            got = store.download(key, partial)
            os.replace(partial, local)
        finally:
            partial.unlink(missing_ok=True)
        kept[key] = {"generation": got, "sha256": _sha256(local)}
    for gone in set(manifest) - set(objects):  # deleted in the bucket since the last copy
        (root / gone).unlink(missing_ok=True)
    manifest_path.write_text(json.dumps({"url": url, "files": kept}, indent=1, sort_keys=True))
