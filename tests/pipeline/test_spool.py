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
from asyncopd_jax.pipeline import spool as spool_module
from asyncopd_jax.pipeline.spool import Spool, group_from_record, group_to_record
from asyncopd_jax.pipeline.staleness import RolloutGroup


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
    assert not claim.path.exists()


def test_a_record_being_written_is_invisible_to_readers_until_put_returns(tmp_path, monkeypatch):
    """Atomicity, deterministically: the writer is held half-way through its write while
    this thread looks with everything a consumer uses (names, claim, the record's path)."""
    spool = Spool(tmp_path)
    arrays = {"x": np.arange(1000, dtype=np.int64), "y": np.ones((4, 4), np.float32)}
    halfway, resume = threading.Event(), threading.Event()
    real_write = spool_module._write_durably

    def write_half_then_wait(path: Path, data: memoryview) -> None:
        data = bytes(data)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()  # the half is on disk where a reader could find it
        halfway.set()
        assert resume.wait(timeout=30), "the test never let the writer finish"
        real_write(path, data)

    monkeypatch.setattr(spool_module, "_write_durably", write_half_then_wait)
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
            assert thread.is_alive() and time.monotonic() < deadline, "put never wrote through _write_durably"
        assert spool.names() == []
        assert spool.claim("reader") is None and spool.claim("reader", "r") is None
        assert not spool.path("r").exists()
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
    cache = TeacherScoreCache(
        token_logp=rng.normal(size=(B, T)).astype(np.float32),
        candidate_logp=rng.normal(size=(B, T, N)).astype(np.float32),
        topk_ids=rng.integers(0, 9, (B, T, K)).astype(np.int32),
        topk_logp=rng.normal(size=(B, T, K)).astype(np.float32),
    )
    group = RolloutGroup(batch, cache, 3, 5, rewards=np.array([1.0, 0.0, 1.0], np.float32))
    spool = Spool(tmp_path)
    spool.put("g", group_to_record(group, index=41))
    back, index = group_from_record(spool.claim("learner").read())
    assert index == 41 and (back.oldest_version, back.newest_version) == (3, 5)
    np.testing.assert_array_equal(back.rewards, [1.0, 0.0, 1.0])
    for name, want, got in [("batch", batch, back.batch), ("cache", cache, back.cache)]:
        want_leaves = jax.tree_util.tree_leaves_with_path(want)
        got_leaves = jax.tree_util.tree_leaves(got)
        assert len(want_leaves) == len(got_leaves), name
        for (path, w), g in zip(want_leaves, got_leaves):
            assert np.asarray(g).dtype == w.dtype, (name, path)
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name}{path}")
    assert back.batch.student_topk_ids is None and back.cache.sample_ids is None
