"""The object stores through a proxy: every conditional write carries its precondition on
the write request itself; a response lost after the server applied the write is told
apart from another writer's win; racing writers with slow requests leave one winner;
throttling and unavailability are retried."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from asyncopd_jax.storage import open_store, records
from tests.storage import servers
from tests.storage.fixtures import pointed_at

pytestmark = pytest.mark.extended


@pytest.fixture(params=["s3", "gcs"])
def proxied(request) -> Iterator[tuple[str, servers.Proxy, object]]:
    """(kind, a proxy in front of that kind's server, a store whose client goes through it)."""
    server = request.getfixturevalue(f"{request.param}_server")
    proxy = servers.Proxy(server.port)
    with pointed_at(request.param, proxy.endpoint) as url:
        yield request.param, proxy, open_store(url)
    proxy.close()


def _writes(kind: str, proxy: servers.Proxy, key_part: str) -> list[servers.Seen]:
    """The requests that wrote an object whose name contains ``key_part``."""
    if kind == "s3":
        return [s for s in proxy.seen if s.method == "PUT" and s.names(key_part)]
    return [s for s in proxy.seen if s.method == "POST" and "/upload/" in s.path and s.names(key_part)]


def _query(seen: servers.Seen) -> dict[str, list[str]]:
    return parse_qs(urlsplit(seen.path).query)


def test_commit_and_claim_carry_the_precondition_on_the_write_itself(proxied):
    kind, proxy, store = proxied
    blob = records.create(store, "claims/g1", records.record_bytes({"owner": "a"}))
    records.replace(store, "claims/g1", records.record_bytes({"owner": "b"}), blob.generation)
    # nothing but the two writes (and no check before them): a read-then-write client
    # would show a GET or HEAD of the key before each PUT
    touching = [s for s in proxy.seen if s.names("g1")]
    create, replace = _writes(kind, proxy, "g1")
    assert touching == [create, replace]
    if kind == "s3":
        assert create.headers.get("if-none-match") == "*" and "if-match" not in create.headers
        assert replace.headers.get("if-match") == blob.generation
    else:
        assert _query(create)["ifGenerationMatch"] == ["0"] and _query(create)["uploadType"] == ["multipart"]
        assert _query(replace)["ifGenerationMatch"] == [blob.generation]


def test_a_lost_response_to_a_create_is_recognised_as_our_own_write(proxied):
    kind, proxy, store = proxied
    data = records.record_bytes({"owner": "a"})
    proxy.lose(lambda s: s in _writes(kind, proxy, "lost-1"))
    # the bare store: the retry meets the object the first attempt wrote, and is refused
    assert store.create("lost-1", data) is None
    assert proxy.lost == 1 and len(_writes(kind, proxy, "lost-1")) == 2
    assert store.read("lost-1").data == data
    # through records: the refusal is resolved by reading the object back
    proxy.lose(lambda s: s in _writes(kind, proxy, "lost-2"))
    blob = records.create(store, "lost-2", data)
    assert blob is not None and blob.data == data and proxy.lost == 2
    # and another writer's object is still a refusal
    assert records.create(store, "lost-2", records.record_bytes({"owner": "b"})) is None


def test_a_lost_response_to_a_replace_is_recognised_as_our_own_write(proxied):
    kind, proxy, store = proxied
    first = store.create("lease", records.record_bytes({"beat": 0}))
    renewal = records.record_bytes({"beat": 1})
    proxy.lose(lambda s: s in _writes(kind, proxy, "lease")[1:])
    blob = records.replace(store, "lease", renewal, first.generation)
    assert blob is not None and blob.data == renewal and proxy.lost == 1


def test_slow_racing_claimants_leave_one_winner(proxied):
    """Every request waits 0.3 s at the proxy: a client that checked for the key and then
    wrote it unconditionally would find it absent in both threads, and both would win."""
    kind, proxy, store = proxied
    proxy.delay(lambda s: True, 0.3)
    wins, barrier = [], threading.Barrier(2)

    def claim(owner: str) -> None:
        barrier.wait()
        if records.create(store, "claims/ticket", records.record_bytes({"owner": owner})) is not None:
            wins.append(owner)

    threads = [threading.Thread(target=claim, args=(o,)) for o in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert records.parse(store.read("claims/ticket"))["owner"] == wins[0]


@pytest.mark.parametrize("status", [429, 503])
def test_throttling_and_unavailability_are_retried(proxied, status):
    kind, proxy, store = proxied
    proxy.fail(lambda s: s.method in ("PUT", "POST"), status, times=2)
    assert store.create("busy", b"x") is not None
    assert len(_writes(kind, proxy, "busy")) == 3  # two refused, the third applied
    proxy.fail(lambda s: s.method == "GET", status, times=2)
    assert store.read("busy").data == b"x"
