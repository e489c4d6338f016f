"""``gs://bucket/prefix`` through google-cloud-storage, Google's own client: it speaks the
JSON API, sends ``ifGenerationMatch`` on the upload itself, uploads objects under 8 MiB
as one multipart request (the form whose precondition fake-gcs-server enforces too), and
retries 429 and 5xx with exponential backoff and jitter — conditional writes included,
since a precondition makes them safe to repeat. ``STORAGE_EMULATOR_HOST`` points it at
an emulator (then no credentials are needed).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from asyncopd_jax.storage.store import Blob, StorageError

TIMEOUT_S = 30.0


def _client():
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage

    try:
        return storage.Client()
    except DefaultCredentialsError:
        raise StorageError(
            "no Google Cloud credentials for gs:// (run `gcloud auth application-default login`, or set "
            "GOOGLE_APPLICATION_CREDENTIALS; on a TPU VM the VM's service account is used)"
        ) from None


class GCSStore:
    """Objects under ``gs://bucket/prefix`` (see the module docstring)."""

    remote = True

    def __init__(self, bucket: str, prefix: str, client=None):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import DEFAULT_RETRY

        self.bucket_name, self.prefix = bucket, prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or _client()
        self._bucket = self._client.bucket(bucket)
        self._retry: Retry = DEFAULT_RETRY

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _upload(self, key: str, data: bytes, generation: int | None) -> Blob | None:
        from google.api_core.exceptions import GoogleAPICallError, PreconditionFailed

        blob = self._bucket.blob(self._key(key))
        try:
            # A precondition makes the library's retry policy apply to the upload (a
            # repeated conditional write cannot apply twice); without one it is an
            # unconditional write of a key one writer owns, equally safe to repeat.
            blob.upload_from_string(data, if_generation_match=generation, retry=self._retry, timeout=TIMEOUT_S)
        except PreconditionFailed:
            return None
        except GoogleAPICallError as err:
            raise StorageError(f"{self.url}/{key}: {err}") from err
        return Blob(data, str(blob.generation))

    def read(self, key: str) -> Blob | None:
        from google.api_core.exceptions import GoogleAPICallError, NotFound

        blob = self._bucket.blob(self._key(key))
        try:
            data = blob.download_as_bytes(retry=self._retry, timeout=TIMEOUT_S)
        except NotFound:
            return None
        except GoogleAPICallError as err:
            raise StorageError(f"{self.url}/{key}: {err}") from err
        return Blob(data, str(blob.generation))

    def create(self, key: str, data: bytes) -> Blob | None:
        return self._upload(key, data, 0)

    def replace(self, key: str, data: bytes, generation: str) -> Blob | None:
        return self._upload(key, data, int(generation))

    def write(self, key: str, data: bytes) -> None:
        self._upload(key, data, None)

    def delete(self, key: str) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            self._bucket.blob(self._key(key)).delete(retry=self._retry, timeout=TIMEOUT_S)

    def list(self, prefix: str) -> list[str]:
        start = len(self.prefix) + 1 if self.prefix else 0
        blobs = self._client.list_blobs(
            self.bucket_name, prefix=self._key(prefix), retry=self._retry, timeout=TIMEOUT_S
        )
        return sorted(b.name[start:] for b in blobs)

    def versions(self, prefix: str) -> dict[str, str]:
        start = len(self.prefix) + 1 if self.prefix else 0
        blobs = self._client.list_blobs(
            self.bucket_name, prefix=self._key(prefix), retry=self._retry, timeout=TIMEOUT_S
        )
        return {b.name[start:]: str(b.generation) for b in blobs}

    def download(self, key: str, path: Path) -> str:
        from google.api_core.exceptions import GoogleAPICallError
        from google.cloud.storage.exceptions import DataCorruption

        blob = self._bucket.blob(self._key(key))
        try:
            # checksum="auto": the bytes are checked against the object's CRC32C (else MD5).
            blob.download_to_filename(str(path), checksum="auto", retry=self._retry, timeout=TIMEOUT_S)
        except DataCorruption as err:
            raise StorageError(f"{self.url}/{key}: the bytes downloaded do not match the object's checksum") from err
        except GoogleAPICallError as err:
            raise StorageError(f"{self.url}/{key}: {err}") from err
        return str(blob.generation)

    def child(self, prefix: str) -> GCSStore:
        return GCSStore(self.bucket_name, self._key(prefix), self._client)

    def check(self) -> None:
        """Raise a one-line :class:`StorageError` when the bucket is missing or unreachable."""
        from google.api_core.exceptions import GoogleAPICallError

        try:
            found = self._client.lookup_bucket(self.bucket_name, timeout=TIMEOUT_S)
        except GoogleAPICallError as err:
            raise StorageError(f"{self.url}: the bucket {self.bucket_name!r} cannot be read ({err.code})") from None
        if found is None:
            emulator = os.environ.get("STORAGE_EMULATOR_HOST")
            where = f" (on the emulator at {emulator})" if emulator else ""
            raise StorageError(f"{self.url}: the bucket {self.bucket_name!r} does not exist{where}")
