"""What a run reads from a bucket (models, tokenizers, a dataset) arrives as a local copy
that follows the bucket and is checked before each use (asyncopd_jax/storage/local_copy.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncopd_jax.storage import local_copy as lc
from asyncopd_jax.storage.store import StorageError

# A local path is read where it is (resolve_location); a copy is made of a bucket's objects,
# on both servers (CI's second step).
pytestmark = pytest.mark.extended
in_buckets = pytest.mark.parametrize("store", ["s3", "gcs"], indirect=True)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCOPD_CACHE", str(tmp_path / "cache"))


def _downloads(monkeypatch, store_type) -> list[str]:
    """Record every key the copy downloads from stores of ``store_type``."""
    seen: list[str] = []
    real = store_type.download

    def counted(self, key, path):
        seen.append(key)
        return real(self, key, path)

    monkeypatch.setattr(store_type, "download", counted)
    return seen


@in_buckets
def test_a_directory_is_copied_once_and_follows_the_bucket(store, monkeypatch):
    model = store.child("models/m")
    files = {"config.json": b'{"a": 1}', "model.safetensors": b"\x00" * 3000, "tok/vocab.txt": b"a\nb\n"}
    for key, data in files.items():
        model.write(key, data)
    seen = _downloads(monkeypatch, type(store))

    copy = lc.local_copy(model.url)
    assert copy.name == "m"
    assert {str(p.relative_to(copy)): p.read_bytes() for p in copy.rglob("*") if p.is_file()} == files
    assert sorted(seen) == sorted(files)

    seen.clear()
    assert lc.local_copy(model.url + "/") == copy  # the same copy, nothing downloaded again
    assert seen == []

    model.write("config.json", b'{"a": 2}')  # rewritten, added, deleted in the bucket
    model.write("extra.bin", b"x")
    model.delete("tok/vocab.txt")
    lc.local_copy(model.url)
    assert sorted(seen) == ["config.json", "extra.bin"]
    assert (copy / "config.json").read_bytes() == b'{"a": 2}'
    assert (copy / "extra.bin").read_bytes() == b"x"
    assert not (copy / "tok" / "vocab.txt").exists()


@in_buckets
def test_a_copy_altered_on_this_host_is_fetched_again_not_used(store, monkeypatch):
    store.write("m/model.safetensors", b"weights" * 100)
    store.write("m/config.json", b"{}")
    url = store.child("m").url
    copy = lc.local_copy(url)
    seen = _downloads(monkeypatch, type(store))
    (copy / "model.safetensors").write_bytes(b"weightz" * 100)  # same size, other bytes
    lc.local_copy(url)
    assert seen == ["model.safetensors"]
    assert (copy / "model.safetensors").read_bytes() == b"weights" * 100


@in_buckets
def test_one_object_is_copied_as_a_file_of_its_name(store):
    store.write("data/train.jsonl", b'{"prompt": "1+1"}\n')
    copy = lc.local_copy(store.child("data").url + "/train.jsonl")
    assert copy.name == "train.jsonl" and copy.read_bytes() == b'{"prompt": "1+1"}\n'
    manifest = json.loads((copy.parent / lc.MANIFEST).read_text())
    assert list(manifest["files"]) == ["train.jsonl"]


@in_buckets
def test_a_url_naming_nothing_is_one_line_naming_it(store):
    url = store.child("models").url + "/missing"
    with pytest.raises(StorageError, match=r"no object and no directory there$") as refused:
        lc.local_copy(url)
    assert str(refused.value).startswith(url) and "\n" not in str(refused.value)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_s3_bytes_that_do_not_match_the_objects_md5_are_refused(store, monkeypatch):
    from asyncopd_jax.storage.s3 import S3Store

    store.write("m/model.safetensors", b"weights" * 100)
    real = S3Store.download

    def flipped(self, key, path):
        real_download_file = self._client.download_file

        def corrupt(bucket, key_, filename, **kw):
            real_download_file(bucket, key_, filename, **kw)
            data = bytearray(Path(filename).read_bytes())
            data[0] ^= 1
            Path(filename).write_bytes(bytes(data))

        monkeypatch.setattr(self._client, "download_file", corrupt)
        return real(self, key, path)

    monkeypatch.setattr(S3Store, "download", flipped)
    with pytest.raises(StorageError, match=r"model.safetensors: the bytes downloaded do not match the object's MD5"):
        lc.local_copy(store.child("m").url)
    assert not list((lc.cache_root()).rglob("model.safetensors"))  # nothing half-checked is left to load


@in_buckets
def test_a_dataset_in_a_bucket_is_read_through_its_copy(store):
    from asyncopd_jax.tasks.dataset import read_examples

    store.write("data/train.jsonl", b'{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "4"}\n')
    examples = read_examples(store.child("data").url + "/train.jsonl", "q", "a")
    assert [(e.prompt, e.answer) for e in examples] == [("1+1", "2"), ("2+2", "4")]
