"""The storage interface on every backend: conditional writes refused and applied as the
servers enforce them, lists, children, and the one-line errors for a bad URL."""

from __future__ import annotations

import threading

import pytest

from asyncopd_jax.storage import open_store
from asyncopd_jax.storage.store import StorageError


def test_create_writes_only_an_absent_key(store):
    first = store.create("a/k", b"one")
    assert first is not None and first.data == b"one"
    assert store.create("a/k", b"two") is None
    got = store.read("a/k")
    assert got.data == b"one" and got.generation == first.generation


def test_replace_applies_only_at_the_generation_read(store):
    first = store.create("k", b"one")
    second = store.replace("k", b"two", first.generation)
    assert second is not None and second.generation != first.generation
    assert store.replace("k", b"three", first.generation) is None  # moved on since
    assert store.read("k").data == b"two"
    assert store.replace("missing", b"x", first.generation) is None
    assert store.read("missing") is None


def test_write_delete_and_list(store):
    for key in ("x/2", "x/1", "x/sub/3", "y/1"):
        store.write(key, key.encode())
    store.write("x/1", b"again")  # unconditional
    assert store.read("x/1").data == b"again"
    assert store.list("x/") == ["x/1", "x/2", "x/sub/3"]
    store.delete("x/2")
    store.delete("x/2")  # absent: nothing to do
    assert store.list("x/") == ["x/1", "x/sub/3"]
    child = store.child("x")
    assert child.list("") == ["1", "sub/3"] and child.read("sub/3").data == b"x/sub/3"
    assert child.url == f"{store.url}/x"


def test_one_of_several_racing_creates_wins(store):
    wins = []

    def race(i: int) -> None:
        if store.create("contested", f"writer {i}".encode()) is not None:
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.read("contested").data == f"writer {wins[0]}".encode()


def test_a_storage_url_of_an_unknown_scheme_or_no_bucket_is_refused_in_one_line():
    with pytest.raises(StorageError, match=r"^ftp://h/x: ftp:// is not a storage this tool reads"):
        open_store("ftp://h/x")
    with pytest.raises(StorageError, match=r"^s3:///x: the URL names no bucket"):
        open_store("s3:///x")


def test_a_url_without_the_storage_extra_names_what_is_missing(monkeypatch):
    import builtins

    real = builtins.__import__

    def without_boto3(name, *args, **kwargs):
        if name == "boto3":
            raise ImportError("no boto3")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_boto3)
    with pytest.raises(StorageError, match=r"^s3://b/p: s3:// needs the storage extra \(boto3 is not installed\)"):
        open_store("s3://b/p")


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_bucket_that_does_not_exist_is_named(kind, request):
    from tests.storage.fixtures import SCHEME, pointed_at

    scheme = SCHEME[kind]

    server = request.getfixturevalue(f"{kind}_server")
    with (
        pointed_at(kind, server.endpoint),
        pytest.raises(
            StorageError, match=rf"^{scheme}://no-such-bucket/run: the bucket 'no-such-bucket' does not exist"
        ),
    ):
        open_store(f"{scheme}://no-such-bucket/run")


def test_gcs_without_credentials_says_how_to_get_them(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no gcloud application-default file
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # no metadata server either
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    with pytest.raises(StorageError, match=r"no Google Cloud credentials for gs://"):
        open_store("gs://b/p")
