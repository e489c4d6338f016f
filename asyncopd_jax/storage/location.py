"""A setting's value → the store it names: a local path, ``gs://bucket/prefix`` or
``s3://bucket/prefix``. The one place that decides which backend serves a URL."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from asyncopd_jax.config_checks import url_scheme
from asyncopd_jax.storage.store import StorageError, Store

SCHEMES = ("gs", "s3")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)/?(.*)")
# The extra that brings each scheme's client, and the module it needs.
_CLIENTS = {"gs": "google.cloud.storage", "s3": "boto3"}


def is_url(value: str | Path) -> bool:
    """Whether ``value`` is a ``scheme://`` URL rather than a path."""
    return url_scheme(str(value)) is not None


def join(location: str | Path, *parts: str) -> str:
    """``location`` / ``parts``: a URL joined with ``/``, a path as a path."""
    if is_url(location):
        return "/".join([str(location).rstrip("/"), *parts])
    return str(Path(location, *parts))


def open_store(location: str | Path, *, check: bool = True) -> Store:
    """The store rooted at ``location``.

    ``check``: for a bucket, look it up now, so that a missing bucket or missing
    credentials stop the run in one line naming the URL (:class:`StorageError`) before
    anything is written.
    """
    text = str(location)
    url = _URL.match(text)
    if url is None:
        from asyncopd_jax.storage.local import LocalStore

        return LocalStore(text)
    scheme, bucket, prefix = url.group(1).lower(), url.group(2), url.group(3)
    if scheme not in SCHEMES:
        raise StorageError(f"{text}: {scheme}:// is not a storage this tool reads; allowed: a path, gs://, s3://")
    if not bucket:
        raise StorageError(f"{text}: the URL names no bucket; allowed: {scheme}://BUCKET/PREFIX")
    try:
        __import__(_CLIENTS[scheme])
    except ImportError:
        raise StorageError(
            f"{text}: {scheme}:// needs the storage extra ({_CLIENTS[scheme]} is not installed): "
            'pip install "asyncopd-jax[storage]"'
        ) from None
    if scheme == "s3":
        from asyncopd_jax.storage.s3 import S3Store

        store: Store = S3Store(bucket, prefix)
    else:
        from asyncopd_jax.storage.gcs import GCSStore

        store = GCSStore(bucket, prefix)
    if check:
        store.check()  # type: ignore[attr-defined]
    return store


def local_name(url: str) -> str:
    """A directory name for ``url`` on this host: ``<last part>-<hash of the URL>``, the same
    for every process (and every run) of this host, distinct for distinct URLs."""
    url = url.rstrip("/")
    return f"{url.rsplit('/', 1)[-1]}-{hashlib.sha1(url.encode()).hexdigest()[:12]}"


def staging_dir(url: str) -> Path:
    """Where the bucket directory ``url`` (a run) is staged on this host:
    ``$ASYNCOPD_STAGING`` (default ``<tmp>/asyncopd-staging``) / :func:`local_name`, so a
    run resumed here finds what it wrote."""
    root = Path(os.environ.get("ASYNCOPD_STAGING") or Path(tempfile.gettempdir()) / "asyncopd-staging")
    return root / local_name(url)
