"""Fixtures (a plugin of the whole suite: tests/conftest.py): the storage servers of the test
session, and a fresh store on each backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from asyncopd_jax.storage import Store, open_store
from tests.storage import servers

# The object-storage tests run in CI's second step (docs/testing.md): each backend's server
# starts once per test worker.
SCHEME = {"s3": "s3", "gcs": "gs"}
BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.extended), pytest.param("gcs", marks=pytest.mark.extended)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[servers.Server]:
    server = servers.start_s3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[servers.Server]:
    server = servers.start_gcs()
    yield server
    server.stop()


@contextlib.contextmanager
def pointed_at(kind: str, endpoint: str) -> Iterator[str]:
    """A fresh bucket on the server at ``endpoint``; clients made inside the block talk to
    ``endpoint`` (the server itself or a proxy in front of it). Yields the bucket's URL."""
    bucket = servers.new_bucket(kind, endpoint)
    with servers.environment(servers.client_env(kind, endpoint)):
        yield f"{SCHEME[kind]}://{bucket}/run"


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> Iterator[Store]:
    """A fresh, empty store on each backend."""
    if request.param == "local":
        yield open_store(tmp_path / "store")
        return
    server = request.getfixturevalue(f"{request.param}_server")
    with pointed_at(request.param, server.endpoint) as url:
        yield open_store(url)
