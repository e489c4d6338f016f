"""Staleness bookkeeping under random scheduling (property-based) and clean failure."""

from __future__ import annotations

import threading
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer


def _group(size: int, oldest: int, newest: int) -> RolloutGroup:
    batch = types.SimpleNamespace(response_tokens=[[0]] * size)
    return RolloutGroup(batch=batch, cache=None, oldest_version=oldest, newest_version=newest)


def allowed_to_start(in_flight: int, n: int, *, eta: int, mini_batches: int, consumed: int, batch: int) -> bool:
    """AReaL's capacity rule, written out: ``accepted + running + n ≤ (⌊η / M⌋ + c + 1) · B``
    (accepted and running samples, dropped ones excluded; c consumed batches)."""
    return in_flight + n <= (eta // mini_batches + consumed + 1) * batch


def expected_take(ready: list[RolloutGroup], version: int, eta: int, batch: int):
    """What ``take(version)`` must do to the FIFO queue ``ready``: (taken, stale, future, rest),
    or None when the queue runs out before ``batch`` fresh samples (``take`` would block)."""
    taken, stale, future = [], [], []
    for i, g in enumerate(ready):
        if g.newest_version > version:
            future.append(g)
        elif version - g.oldest_version > eta:
            stale.append(g)
        else:
            taken.append(g)
            if sum(t.size for t in taken) == batch:
                return taken, stale, future, ready[i + 1 :]
    return None


# (η, mini-batches per rollout batch): η ∈ {0, 1} and mini-batch counts that do and do not divide η.
ETA_MINI_BATCHES = [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (4, 3), (5, 2)]


@pytest.mark.parametrize("eta,mini_batches", ETA_MINI_BATCHES)
def test_random_schedules_obey_the_capacity_rule_and_the_staleness_bound(eta, mini_batches):
    """Random interleavings of producers starting / finishing (with mid-rollout weight swaps)
    and the learner training, checked step by step against the rules written out above: a
    start succeeds exactly when the capacity rule allows it; ``take`` consumes, drops and
    refuses exactly the groups the staleness bound says; no consumed group is older than η
    or from the future; with η = 0 every consumed token is of the learner's own version."""
    seen = {"learn": 0, "refused_start": 0, "stale": 0}

    @settings(max_examples=40, deadline=None, database=None)
    @given(
        groups_per_batch=st.sampled_from([1, 2, 3]),
        actions=st.lists(
            st.tuples(st.sampled_from(["start", "finish", "learn", "swap"]), st.integers(0, 7)),
            min_size=100,
            max_size=400,
        ),
    )
    def run(groups_per_batch, actions):
        group, batch = 2, 2 * groups_per_batch
        buf = StalenessBuffer(batch, eta, mini_batches)
        version = 0  # learner version: optimizer steps
        published = 0  # newest snapshot the producers can read
        running: list[list[int]] = []  # [oldest, newest] versions seen by each running rollout
        ready: list[RolloutGroup] = []  # the test's own copy of the buffer's queue
        started = dropped = consumed = 0
        for action, pick in actions:
            if action == "start":
                in_flight = started - dropped
                if allowed_to_start(
                    in_flight, group, eta=eta, mini_batches=mini_batches, consumed=consumed, batch=batch
                ):
                    buf.acquire(group, timeout=0)
                    started += group
                    running.append([published, published])
                else:
                    assert buf.try_acquire(group) is None  # refused without waiting
                    seen["refused_start"] += 1
            elif action == "swap" and running:  # interruptible generation picks up a newer snapshot
                running[pick % len(running)][1] = published
            elif action == "finish" and running:
                oldest, newest = running.pop(pick % len(running))
                ready.append(_group(group, oldest, newest))
                buf.put(ready[-1])
            elif action == "learn" and (want := expected_take(ready, version, eta, batch)) is not None:
                taken_want, stale, future, ready = want
                stale_before, future_before = buf.dropped_stale, buf.dropped_future
                taken = buf.take(version, timeout=0)
                assert [id(g) for g in taken] == [id(g) for g in taken_want]
                assert buf.dropped_stale - stale_before == sum(g.size for g in stale)
                assert buf.dropped_future - future_before == sum(g.size for g in future)
                dropped += sum(g.size for g in stale + future)
                for g in taken:
                    assert g.newest_version <= version  # none from the future
                    assert version - g.oldest_version <= eta  # none older than η
                    if eta == 0:
                        assert g.oldest_version == g.newest_version == version
                version += mini_batches
                published = version
                consumed += 1
                buf.finish_batch()
                seen["learn"] += 1
                seen["stale"] += len(stale)

    run()
    # The examples really exercised the learner, the capacity limit and (for η > 0, where a
    # rollout can outlive η learner steps) the stale drop.
    assert seen["learn"] >= 20 and seen["refused_start"] >= 20, seen
    if eta // mini_batches >= 1:
        assert seen["stale"] >= 1, seen


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_exactly_eta_old_is_consumed_eta_plus_one_dropped_future_refused(eta):
    version = 10
    buf = StalenessBuffer(batch_size=2, eta=eta)
    too_old = _group(1, version - eta - 1, version)  # its first token is η + 1 versions old
    future = _group(1, version, version + 1)
    far_future = _group(2, version + 5, version + 5)
    oldest_allowed = _group(1, version - eta, version - eta)
    mixed = _group(1, version - eta, version)
    for g in (too_old, future, far_future, oldest_allowed, mixed):
        buf.put(g)
    taken = buf.take(version, timeout=0)
    assert taken == [oldest_allowed, mixed]
    assert (buf.dropped_stale, buf.dropped_future) == (1, 3)  # counted in samples


def test_dropped_samples_give_their_capacity_back():
    buf = StalenessBuffer(batch_size=2, eta=1)
    buf.acquire(4, timeout=0)  # (η + 0 + 1) · B = 4: full
    _refused(buf, 1, 0)
    for oldest in (0, 6, 5, 5):  # at version 5: stale, future, then two taken
        buf.put(_group(1, oldest, oldest))
    buf.take(version=5, timeout=0)
    buf.acquire(2, timeout=0)  # the slots of the stale and the future sample are free again
    _refused(buf, 1, 0)


@pytest.mark.parametrize("eta", [0, 1, 2, 5])
@pytest.mark.parametrize("mini_batches", [1, 2, 3])
def test_capacity_is_eta_in_batches_plus_one_batch_ahead(eta, mini_batches):
    batch = 4
    buf = StalenessBuffer(batch, eta, mini_batches)
    started = 0
    for consumed in range(3):
        while buf.try_acquire(1) is not None:  # start samples one by one until the buffer says no
            started += 1
        assert started == (eta // mini_batches + consumed + 1) * batch  # the formula, written out
        # The learner trains on one batch: B samples (all fresh) go through, one more batch opens.
        buf.put(_group(batch, consumed * mini_batches, consumed * mini_batches))
        buf.take(consumed * mini_batches, timeout=0)
        buf.finish_batch()


def test_sync_capacity_admits_one_batch_at_a_time():
    buf = StalenessBuffer(batch_size=4, eta=0)
    buf.acquire(4, timeout=0)
    assert buf.capacity() == 0
    _refused(buf, 1, 0.01)
    buf.put(_group(4, 0, 0))
    buf.take(version=0, timeout=1)
    assert buf.capacity() == 0  # not until the learner has trained on it
    buf.finish_batch()
    assert buf.capacity() == 4


def _refused(buf: StalenessBuffer, n: int, timeout: float = 0) -> TimeoutError:
    """``buf.acquire(n, timeout)`` gives up after its timeout with a TimeoutError. It runs on
    a thread given 5 s, so that an ``acquire`` that ignored its timeout fails here instead
    of waiting forever."""
    thread, outcome = _in_thread(lambda: buf.acquire(n, timeout=timeout))
    thread.join(5)
    assert not thread.is_alive(), f"acquire({n}, timeout={timeout}) was still waiting after 5 s"
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError), outcome
    return outcome[0]


def _in_thread(fn) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run():
        try:
            outcome.append(fn())
        except Exception as err:  # noqa: BLE001 - inspected by the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_failure_wakes_every_waiting_thread():
    buf = StalenessBuffer(batch_size=2, eta=0)
    buf.acquire(2, timeout=0)
    waiters = [_in_thread(lambda: buf.acquire(2)), _in_thread(lambda: buf.take(0))]
    buf.fail(ValueError("worker exploded"))
    outcomes = []
    for thread, outcome in waiters:
        thread.join(timeout=5)
        outcomes += outcome
    assert len(outcomes) == 2 and all(isinstance(e, PipelineStopped) for e in outcomes)
    assert all(str(e) == "the run stopped: ValueError: worker exploded" for e in outcomes)
    assert isinstance(outcomes[0].__cause__, ValueError)


def test_release_gives_capacity_back_and_wakes_a_waiting_producer():
    buf = StalenessBuffer(batch_size=4, eta=0)
    buf.acquire(4, timeout=0)
    thread, outcome = _in_thread(lambda: buf.acquire(1, timeout=30))
    thread.join(0.2)
    assert thread.is_alive()  # waiting for capacity
    buf.release(1)  # a rollout that failed before it could be put
    thread.join(5)
    assert not thread.is_alive() and outcome == [0]  # the oldest version it may start from
    _refused(buf, 1, 0)


@pytest.mark.parametrize(
    "eta,mini_batches,first_version,expected",
    [
        (0, 1, 0, [0, 1, 2, 3]),  # sync: exactly the version the learner is at
        (2, 1, 0, [0, 0, 0, 1]),  # η = 2: up to two versions back
        (2, 2, 10, [8, 10, 12, 14]),  # two steps per batch, after a resume at version 10
    ],
)
def test_acquire_names_the_oldest_version_a_rollout_may_start_from(eta, mini_batches, first_version, expected):
    """A group admitted after c consumed batches is trained at version v₀ + c·M or later,
    so it may start from v₀ + c·M − η or newer (never older: it would be dropped)."""
    buf = StalenessBuffer(batch_size=2, eta=eta, mini_batches=mini_batches, first_version=first_version)
    versions = []
    for _ in range(4):
        versions.append(buf.acquire(2, timeout=0))
        buf.finish_batch()  # the learner trained on a batch: one more may start
    assert versions == expected


def test_stop_wakes_every_waiter_and_refuses_new_work():
    buf = StalenessBuffer(batch_size=2, eta=0)
    buf.acquire(2, timeout=0)
    waiters = [_in_thread(lambda: buf.acquire(1)), _in_thread(lambda: buf.take(0))]
    time.sleep(0.2)
    buf.stop()
    for thread, outcome in waiters:
        thread.join(5)
        assert not thread.is_alive()
        assert isinstance(outcome[0], PipelineStopped) and str(outcome[0]) == "the run stopped"
    for call in (lambda: buf.acquire(1, timeout=0), lambda: buf.put(_group(1, 0, 0)), lambda: buf.take(0, timeout=0)):
        with pytest.raises(PipelineStopped, match="^the run stopped$"):
            call()


def test_timeouts_and_a_batch_that_does_not_add_up_are_reported():
    buf = StalenessBuffer(batch_size=2, eta=0)
    buf.acquire(2, timeout=0)
    assert str(_refused(buf, 1, 0.01)) == "no rollout capacity within the timeout"
    with pytest.raises(TimeoutError, match=r"^no rollouts arrived within 0.01 s$"):
        buf.take(0, timeout=0.01)
    buf.put(_group(3, 0, 0))  # a group larger than the batch: a bug upstream
    with pytest.raises(RuntimeError, match=r"^rollout groups do not add up to the batch size: 3 != 2$"):
        buf.take(0, timeout=0)
