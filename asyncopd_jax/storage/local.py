"""A directory on this host (or on a file system every host mounts) as a store.

* create: the bytes go to a temporary sibling, flushed to disk, then ``os.link`` ed to the
  key — a hard link fails if the name exists, atomically, also over NFS;
* replace: compare the file's generation and rename the new bytes over it, under an
  exclusive ``flock`` of ``<root>/.replace.lock`` (writers on one host; over NFS, as far
  as its locks go);
* a generation is ``inode:mtime_ns:size`` of the file read (a rename makes a new inode).

Readers open the file and ``fstat`` the descriptor they read from, so bytes and
generation belong together even while the file is being replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from pathlib import Path

from asyncopd_jax.storage.store import Blob


def _generation(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


class LocalStore:
    """Objects as files under ``root`` (created); see the module docstring."""

    remote = False

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """The file of ``key`` (local stores only: for code that needs a real path)."""
        return self.root / key

    def _temporary(self, key: str, data: bytes) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. ENOSPC: no half-written file is left behind
            raise
        return tmp

    def read(self, key: str) -> Blob | None:
        try:
            with open(self.path(key), "rb") as f:
                return Blob(f.read(), _generation(os.fstat(f.fileno())))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def create(self, key: str, data: bytes) -> Blob | None:
        tmp = self._temporary(key, data)
        try:
            os.link(tmp, self.path(key))
        except FileExistsError:
            return None
        finally:
            tmp.unlink(missing_ok=True)
        return Blob(data, _generation(os.stat(self.path(key))))

    def replace(self, key: str, data: bytes, generation: str) -> Blob | None:
        tmp = self._temporary(key, data)
        try:
            with self._lock():
                try:
                    current = _generation(os.stat(self.path(key)))
                except FileNotFoundError:
                    return None
                if current != generation:
                    return None
                os.replace(tmp, self.path(key))
                return Blob(data, _generation(os.stat(self.path(key))))
        finally:
            tmp.unlink(missing_ok=True)

    def write(self, key: str, data: bytes) -> None:
        os.replace(self._temporary(key, data), self.path(key))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        base = self.root / directory
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for name in files:
                if name.startswith("."):
                    continue  # temporary files and the lock
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def versions(self, prefix: str) -> dict[str, str]:
        found = {}
        for key in self.list(prefix):
            with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                found[key] = _generation(os.stat(self.path(key)))
        return found

    def download(self, key: str, path: Path) -> str:
        with open(self.path(key), "rb") as source, open(path, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
            return _generation(os.fstat(source.fileno()))

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self.root / prefix)

    @contextlib.contextmanager
    def _lock(self):
        fd = os.open(self.root / ".replace.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
