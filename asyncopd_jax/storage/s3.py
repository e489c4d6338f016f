"""``s3://bucket/prefix`` through boto3, AWS's own client: it sends S3's conditional
writes on the request itself (``If-None-Match: *``, ``If-Match``), retries throttling and
server errors (429, 500, 503) with exponential backoff and full jitter in its
``standard`` retry mode, and takes an S3-compatible endpoint from AWS's documented
settings (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, e.g. MinIO or moto).

Only ``put_object`` is used to write, so every write is one atomic request: a reader sees
the old object or the new one.
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

from asyncopd_jax.storage.store import Blob, StorageError

# An ETag that is the MD5 of the object's bytes: one written in a single request without
# KMS encryption (a multipart upload's ETag has a "-N" suffix and is no digest of the bytes).
_MD5_ETAG = re.compile(r'"?([0-9a-f]{32})"?')

# How many times a request is tried (botocore's standard mode: exponential backoff with
# full jitter, capped at 20 s) and how long a connection or a read may take.
ATTEMPTS = 8
TIMEOUT_S = 30.0


class S3Store:
    """Objects under ``s3://bucket/prefix`` (see the module docstring)."""

    remote = True

    def __init__(self, bucket: str, prefix: str, client=None):
        import boto3
        import botocore.config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or boto3.client(
            "s3",
            config=botocore.config.Config(
                retries={"mode": "standard", "max_attempts": ATTEMPTS},
                connect_timeout=TIMEOUT_S,
                read_timeout=TIMEOUT_S,
            ),
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _put(self, key: str, data: bytes, **condition: str) -> Blob | None:
        from botocore.exceptions import ClientError

        for _ in range(ATTEMPTS):
            try:
                answer = self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
                return Blob(data, answer["ETag"])
            except ClientError as err:
                code = err.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "NoSuchKey"):  # If-Match on a missing key: 404
                    return None
                if code == "ConditionalRequestConflict":  # a concurrent conditional write: S3 asks to retry
                    time.sleep(0.05)
                    continue
                raise StorageError(f"{self.url}/{key}: {err}") from err
        raise StorageError(f"{self.url}/{key}: conditional write kept conflicting")

    def read(self, key: str) -> Blob | None:
        from botocore.exceptions import ClientError

        try:
            answer = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return Blob(answer["Body"].read(), answer["ETag"])
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StorageError(f"{self.url}/{key}: {err}") from err

    def create(self, key: str, data: bytes) -> Blob | None:
        return self._put(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, generation: str) -> Blob | None:
        return self._put(key, data, IfMatch=generation)

    def write(self, key: str, data: bytes) -> None:
        self._put(key, data)

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str) -> list[str]:
        start = len(self.prefix) + 1 if self.prefix else 0
        return sorted(item["Key"][start:] for item in self._pages(prefix))

    def _pages(self, prefix: str):
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        ):
            yield from page.get("Contents", [])

    def versions(self, prefix: str) -> dict[str, str]:
        start = len(self.prefix) + 1 if self.prefix else 0
        return {item["Key"][start:]: item["ETag"] for item in self._pages(prefix)}

    def download(self, key: str, path: Path) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            etag = self._client.head_object(Bucket=self.bucket, Key=self._key(key))["ETag"]
            # boto3's managed transfer: ranged parts in parallel, each retried; S3's own
            # checksums of the object (where it was written with one) are checked on the way.
            self._client.download_file(self.bucket, self._key(key), str(path), ExtraArgs={"ChecksumMode": "ENABLED"})
        except (BotoCoreError, ClientError) as err:
            raise StorageError(f"{self.url}/{key}: {err}") from err
        if md5 := _MD5_ETAG.fullmatch(etag):
            digest = hashlib.md5(usedforsecurity=False)
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != md5.group(1):
                raise StorageError(
                    f"{self.url}/{key}: the bytes downloaded do not match the object's MD5 (ETag {etag}): "
                    "it changed during the download or was corrupted on the way"
                )
        return etag

    def child(self, prefix: str) -> S3Store:
        return S3Store(self.bucket, self._key(prefix), self._client)

    def check(self) -> None:
        """Raise a one-line :class:`StorageError` when the bucket is missing or unreachable."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError:
            raise StorageError(
                f"{self.url}: no AWS credentials (set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile)"
            ) from None
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            what = (
                "does not exist" if status == 404 else f"cannot be read ({err.response.get('Error', {}).get('Code')})"
            )
            raise StorageError(f"{self.url}: the bucket {self.bucket!r} {what}") from None
        except BotoCoreError as err:
            raise StorageError(f"{self.url}: {err}") from None
