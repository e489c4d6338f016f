"""Staleness bookkeeping under random scheduling (property-based) and clean failure."""

from __future__ import annotations

import threading
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer


def _group(size: int, oldest: int, newest: int) -> RolloutGroup:
    batch = types.SimpleNamespace(response_tokens=[[0]] * size)
    return RolloutGroup(batch=batch, cache=None, oldest_version=oldest, newest_version=newest)


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 4),
    mini_batches=st.integers(1, 3),
    groups_per_batch=st.sampled_from([1, 2, 4]),
    actions=st.lists(st.tuples(st.sampled_from(["start", "finish", "learn", "swap"]), st.integers(0, 7)),
                     min_size=1, max_size=300),
)
def test_no_consumed_token_is_older_than_eta_or_from_the_future(eta, mini_batches, groups_per_batch, actions):
    """Random interleavings of producers starting / finishing (with mid-rollout weight swaps)
    and the learner training: every consumed group obeys 0 <= v − version <= η, the
    producers never run more than η_b + 1 batches ahead, and with η = 0 staleness is 0."""
    group, batch = 2, 2 * groups_per_batch
    buf = StalenessBuffer(batch, eta, mini_batches)
    version = 0  # learner version: optimizer steps
    published = 0  # newest snapshot the producers can read
    running: list[list[int]] = []  # [oldest, newest] versions seen by each running rollout
    consumed_batches = 0
    for action, pick in actions:
        if action == "start" and buf.capacity() >= group:
            buf.acquire(group)
            running.append([published, published])
            assert buf._started <= (buf.eta_batches + consumed_batches + 1) * batch
        elif action == "swap" and running:  # interruptible generation picks up a newer snapshot
            running[pick % len(running)][1] = published
        elif action == "finish" and running:
            oldest, newest = running.pop(pick % len(running))
            buf.put(_group(group, oldest, newest))
        elif action == "learn" and sum(g.size for g in buf._ready) >= batch * 3:
            taken = buf.take(version, timeout=0)
            for g in taken:
                assert g.newest_version <= version  # none from the future
                assert version - g.oldest_version <= eta  # none older than η
                if eta == 0:
                    assert g.oldest_version == g.newest_version == version
            version += mini_batches
            published = version
            consumed_batches += 1
            buf.finish_batch()


def test_future_and_stale_groups_are_dropped_and_counted():
    buf = StalenessBuffer(batch_size=2, eta=1)
    for oldest, newest in [(0, 0), (5, 6), (2, 3), (3, 3)]:
        buf.put(_group(1, oldest, newest))
    taken = buf.take(version=3, timeout=1)
    assert [(g.oldest_version, g.newest_version) for g in taken] == [(2, 3), (3, 3)]
    assert buf.dropped_stale == 1 and buf.dropped_future == 1


def test_sync_capacity_admits_one_batch_at_a_time():
    buf = StalenessBuffer(batch_size=4, eta=0)
    buf.acquire(4)
    assert buf.capacity() == 0
    with pytest.raises(TimeoutError):
        buf.acquire(1, timeout=0.01)
    buf.put(_group(4, 0, 0))
    buf.take(version=0, timeout=1)
    assert buf.capacity() == 0  # not until the learner has trained on it
    buf.finish_batch()
    assert buf.capacity() == 4


def test_a_failure_wakes_every_waiting_thread():
    buf = StalenessBuffer(batch_size=2, eta=0)
    buf.acquire(2)
    outcomes = []

    def wait(fn):
        try:
            fn()
        except PipelineStopped as err:
            outcomes.append(err)

    threads = [threading.Thread(target=wait, args=(lambda: buf.acquire(2),)),
               threading.Thread(target=wait, args=(lambda: buf.take(0),))]
    for t in threads:
        t.start()
    buf.fail(ValueError("worker exploded"))
    for t in threads:
        t.join(timeout=5)
    assert len(outcomes) == 2 and all("worker exploded" in str(e) for e in outcomes)
    assert isinstance(outcomes[0].__cause__, ValueError)
