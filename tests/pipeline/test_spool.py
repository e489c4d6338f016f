"""The spool between stage processes: atomic commit, exactly-once claims, give-back, and
rollout groups that survive the trip bit for bit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.pipeline.spool import Spool, group_from_record, group_to_record
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.storage.local import LocalStore


def test_a_record_is_invisible_until_committed_and_then_whole(tmp_path):
    spool = Spool(tmp_path)
    spool.put("b", {"x": np.arange(3)})
    spool.put("a", {"x": np.arange(2), "y": np.ones((2, 2), np.float32)})
    # A writer that died mid-write leaves only a hidden temporary file: never listed.
    (tmp_path / ".c.123.tmp").write_bytes(b"partial")
    assert spool.names() == ["a", "b"]
    claim = spool.claim("me")
    assert claim.name == "a" and spool.names() == ["b"]
    got = claim.read()
    np.testing.assert_array_equal(got["y"], np.ones((2, 2), np.float32))
    claim.done()
    assert spool.read("a") is None and spool.store.list("claims/") == []


def test_a_record_being_written_is_invisible_to_readers_until_put_returns(tmp_path, monkeypatch):
    """Atomicity, deterministically: the writer is held half-way through its write while
    this thread looks with everything a consumer uses (names, claim, the record's path)."""
    spool = Spool(tmp_path)
    arrays = {"x": np.arange(1000, dtype=np.int64), "y": np.ones((4, 4), np.float32)}
    halfway, resume = threading.Event(), threading.Event()
    real_temporary = LocalStore._temporary

    def write_half_then_wait(local: LocalStore, key: str, data: bytes) -> Path:
        if not key.endswith(".npz"):
            return real_temporary(local, key, data)
        path = local.path(key)
        with open(path.with_name(f".{path.name}.partial.tmp"), "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()  # the half is on disk where a reader could find it
        halfway.set()
        assert resume.wait(timeout=30), "the test never let the writer finish"
        return real_temporary(local, key, data)

    monkeypatch.setattr(LocalStore, "_temporary", write_half_then_wait)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            spool.put("r", arrays)
        except BaseException as err:  # reported by the test thread, not lost with this thread
            errors.append(err)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not halfway.wait(timeout=0.05):
            assert thread.is_alive() and time.monotonic() < deadline, "put never wrote through LocalStore._temporary"
        assert spool.names() == []
        assert spool.claim("reader") is None and spool.claim("reader", "r") is None
        assert spool.read("r") is None
    finally:
        resume.set()
        thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors
    assert spool.names() == ["r"]
    got = spool.claim("reader").read()
    assert got.keys() == arrays.keys()
    for key, value in arrays.items():
        np.testing.assert_array_equal(got[key], value)


def test_competing_consumers_claim_every_record_exactly_once(tmp_path):
    spool = Spool(tmp_path)
    for i in range(200):
        spool.put(f"{i:04d}", {"i": np.asarray(i)})
    taken: dict[str, list[int]] = {f"c{k}": [] for k in range(4)}

    def consume(owner: str) -> None:
        while (claim := spool.claim(owner)) is not None:
            taken[owner].append(int(claim.read()["i"]))
            claim.done()

    threads = [threading.Thread(target=consume, args=(o,)) for o in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = sorted(i for got in taken.values() for i in got)
    assert everything == list(range(200))


def test_claims_of_a_dead_consumer_go_back(tmp_path):
    spool = Spool(tmp_path)
    for name in ("x", "y", "z"):
        spool.put(name, {"v": np.zeros(1)})
    spool.claim("dead", "y")
    spool.claim("alive", "x")
    assert [c.name for c in spool.claims_of("dead")] == ["y"]
    for claim in spool.claims_of("dead"):
        claim.give_back()
    assert spool.names() == ["y", "z"]
    assert spool.claim("other", "x") is None  # still held by "alive"


def test_record_names_cannot_escape_the_spool(tmp_path):
    with pytest.raises(ValueError, match="must not contain"):
        Spool(tmp_path).put("../x", {"v": np.zeros(1)})


def test_a_rollout_group_round_trips_exactly(tmp_path):
    rng = np.random.default_rng(0)
    B, T, N, K = 3, 5, 2, 4
    batch = RolloutBatch(
        prompt_tokens=rng.integers(0, 9, (B, 4)).astype(np.int32),
        prompt_mask=np.ones((B, 4), bool),
        response_tokens=rng.integers(0, 9, (B, T)).astype(np.int32),
        response_mask=rng.random((B, T)) < 0.8,
        behavior_logp=rng.normal(size=(B, T)).astype(np.float32),
        token_version=rng.integers(3, 6, (B, T)).astype(np.int32),
        candidate_ids=rng.integers(0, 9, (B, T, N)).astype(np.int32),
        candidate_behavior_logp=rng.normal(size=(B, T, N)).astype(np.float32),
    )
    bf16 = jax.numpy.bfloat16  # scoring.store_dtype / hidden_dtype: NumPy's .npz has no such dtype
    cache = TeacherScoreCache(
        token_logp=rng.normal(size=(B, T)).astype(np.float32),
        candidate_logp=rng.normal(size=(B, T, N)).astype(bf16),
        topk_ids=rng.integers(0, 9, (B, T, K)).astype(np.int32),
        topk_logp=rng.normal(size=(B, T, K)).astype(np.float32),
        hidden=rng.normal(size=(B, T, 6)).astype(bf16),  # the teacher's hidden states (teacher.payload: hidden)
    )
    group = RolloutGroup(batch, cache, 3, 5, rewards=np.array([1.0, 0.0, 1.0], np.float32), last_load=(5, 0.25))
    spool = Spool(tmp_path)
    spool.put("g", group_to_record(group, index=41))
    back, index = group_from_record(spool.claim("learner").read())
    assert index == 41 and (back.oldest_version, back.newest_version) == (3, 5)
    np.testing.assert_array_equal(back.rewards, [1.0, 0.0, 1.0])
    assert back.last_load == (5, 0.25)
    for name, want, got in [("batch", batch, back.batch), ("cache", cache, back.cache)]:
        want_leaves = jax.tree_util.tree_leaves_with_path(want)
        got_leaves = jax.tree_util.tree_leaves(got)
        assert len(want_leaves) == len(got_leaves), name
        for (path, w), g in zip(want_leaves, got_leaves):
            assert np.asarray(g).dtype == w.dtype, (name, path)
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name}{path}")
    assert back.batch.student_topk_ids is None and back.cache.sample_ids is None


# --- on every store: leases, takeovers, commits refused -------------------------------------
# (the object stores' cases run in CI's second step with the storage tests)


def test_a_held_claim_is_renewed_and_not_taken_over(store):
    spool = Spool(store.child("tickets"), lease_s=0.6)
    spool.put("g", {"v": np.zeros(1)})
    claim = spool.claim("a")
    other = Spool(store.child("tickets"), lease_s=0.6)  # another process's view
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # > 3 leases: renewed every 0.2 s, never expired
        assert other.claim("b") is None and other.claim("b", "g") is None
        time.sleep(0.05)
    assert claim.beat >= 3
    claim.done()
    assert other.claim("b") is None and spool.names() == [] and store.list("") == []


def test_an_abandoned_claim_is_taken_over_after_the_lease_and_its_output_committed_once(store):
    dead = Spool(store.child("tickets"), lease_s=0.5)
    dead.put("g", {"v": np.arange(3)})
    abandoned = dead.claim("dead")
    dead._release(abandoned)  # its renewals stop, as when its process is killed
    alive = Spool(store.child("tickets"), lease_s=0.5)
    assert alive.claim("alive") is None  # first sight of the lease starts this process's clock
    time.sleep(0.6)
    taken = alive.claim("alive")
    assert taken is not None and taken.name == "g" and taken.beat == 1
    np.testing.assert_array_equal(taken.read()["v"], np.arange(3))
    # both commit the group's output under its name: the first commit stands
    outbox = Spool(store.child("scored"))
    assert outbox.put("g", {"by": np.asarray(1)}) is True
    assert outbox.put("g", {"by": np.asarray(2)}) is False
    assert int(outbox.read("g")["by"]) == 1
    # the slow consumer gives back: the claim is no longer its own, so it stays the new owner's
    abandoned.give_back()
    assert [c.owner for c in alive.claims_of("alive")] == ["alive"]
    taken.done()
    assert alive.names() == [] and alive.claim("x") is None


def test_a_record_consumed_while_its_claim_was_being_won_is_let_go(store):
    spool = Spool(store.child("tickets"))
    spool.put("g", {"v": np.zeros(1)})
    spool.delete("g")  # done by another consumer between our listing and our claim
    assert spool.claim("late", "g") is None
    assert store.list("") == []  # the claim won on a missing record is deleted
