"""``serve-teacher``'s batcher (``teacher/server.py``'s ``Batcher``) on its own, with a
stand-in scorer that records each batch it is handed: which requests share a batch, that
each request gets its own rows' scores (a cancelled one's go to no one), what a batch is
scored with, and that a failed batch reaches its waiters and the batcher goes on.

Every wait is bounded by ``LIMIT_S`` (seconds; the batcher answers in milliseconds), so a
batcher that never answers fails here at once rather than at a client's timeout."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from asyncopd_jax.teacher.batch_scorer import Request, Row, ServerSettings
from asyncopd_jax.teacher.server import Batcher

LIMIT_S = 10.0


class Scorer:
    """Scores a row as its first id; records every batch (rows' first ids, and the
    samples, seed, top-K and padding it was scored with). ``gate``: each batch waits for
    it (the test decides when a batch runs); ``fail``: the first batch raises."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.batches: list[tuple[list[int], int, int, int, tuple[int, int] | None]] = []
        self.gate, self.fail = gate, fail
        self.entered = threading.Event()  # a batch is being scored
        self.hidden: list[str | None] = []  # each batch's hidden-state dtype asked

    def score(self, rows, num_samples, seed, topk, pad_to, hidden):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(LIMIT_S), "the test never opened the gate"
        self.batches.append(([int(r.ids[0]) for r in rows], num_samples, seed, topk, pad_to))
        self.hidden.append(hidden)
        if self.fail and len(self.batches) == 1:
            raise RuntimeError("the device fell over")
        return [{"row": int(r.ids[0])} for r in rows]


def request(*firsts: int, topk: int = 4, samples: int = 0, seed: int = 0, pad_to=None, hidden=None) -> Request:
    """A request of one row per first id (3 tokens each, scored from 1)."""
    rows = [Row(np.asarray([first, 7, 8]), 1) for first in firsts]
    return Request(rows, topk=topk, num_samples=samples, seed=seed, extension=True, pad_to=pad_to, hidden=hidden)


def run(scenario) -> None:
    """``scenario()`` in a fresh event loop on a thread of its own, given LIMIT_S: a
    batcher that spins without yielding blocks its loop, so the limit is kept from outside."""
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(asyncio.wait_for(scenario(), LIMIT_S))
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread
            errors.append(err)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    thread.join(LIMIT_S + 5)
    assert not thread.is_alive(), f"the batcher did not answer within {LIMIT_S:.0f} s (its loop blocked)"
    if errors:
        raise errors[0]


def _batcher(scorer: Scorer, **settings) -> Batcher:
    batcher = Batcher(scorer, ServerSettings(**{"max_wait_ms": 20.0, **settings}))  # type: ignore[arg-type]
    batcher.start()
    return batcher


def test_requests_of_one_kind_share_a_batch_up_to_max_rows_and_each_gets_its_own_rows():
    """Four requests of 2, 1, 1 and 2 rows arriving together, 4 rows a batch: the first
    three fill one exactly, the fourth goes next (a request's rows stay together); each
    answer holds its own rows' scores in its order, and the queue's row count is back to 0."""
    scorer = Scorer()

    async def scenario():
        batcher = _batcher(scorer, max_rows=4)
        requests = (request(10, 11), request(20), request(30), request(40, 41))
        answers = await asyncio.gather(*(batcher.score(r) for r in requests))
        await batcher.stop()
        assert answers == [[{"row": 10}, {"row": 11}], [{"row": 20}], [{"row": 30}], [{"row": 40}, {"row": 41}]]
        assert [b[0] for b in scorer.batches] == [[10, 11, 20, 30], [40, 41]]
        assert batcher.batches == 2 and batcher.queued_rows == 0

    run(scenario)


def test_requests_of_other_kinds_are_scored_apart_with_what_each_asks():
    """Requests that cannot share a batch (another number of teacher samples or seed, a
    top-K of another power of two, hidden states asked in another dtype or not at all) are
    scored apart, the queue's first kind first; requests of one kind share one, scored at
    their largest top-K and their widest padding."""
    scorer = Scorer()

    async def scenario():
        batcher = _batcher(scorer, max_rows=16)
        requests = [
            request(1, topk=3, pad_to=(8, 16)),
            request(2, samples=2, seed=5),
            request(3, topk=4, pad_to=(16, 8)),  # K 3 and 4 both compute a top-4: one batch
            request(4, topk=5),  # a top-8: apart
            request(5, samples=2, seed=6),
            request(6, hidden="bfloat16"),
            request(7, hidden="float32"),
            request(8, hidden="bfloat16"),
        ]
        answers = await asyncio.gather(*(batcher.score(r) for r in requests))
        await batcher.stop()
        assert answers == [[{"row": i}] for i in (1, 2, 3, 4, 5, 6, 7, 8)]
        assert scorer.batches == [
            ([1, 3], 0, 0, 4, (16, 16)),
            ([2], 2, 5, 4, None),
            ([4], 0, 0, 5, None),
            ([5], 2, 6, 4, None),
            ([6, 8], 0, 0, 4, None),
            ([7], 0, 0, 4, None),
        ]
        assert scorer.hidden == [None, None, None, None, "bfloat16", "float32"]

    run(scenario)


def test_a_request_whose_client_went_away_gives_its_rows_to_no_one():
    """Request A is cancelled (its client disconnected) while its batch is being scored;
    B, in the same batch, receives its own row's score, and the next request is served."""
    gate = threading.Event()
    scorer = Scorer(gate)

    async def scenario():
        batcher = _batcher(scorer, max_rows=8)
        a = asyncio.ensure_future(batcher.score(request(10, 11)))
        b = asyncio.ensure_future(batcher.score(request(20)))
        while not scorer.entered.is_set():  # until A and B are being scored
            await asyncio.sleep(0.005)
        a.cancel()
        gate.set()
        assert await b == [{"row": 20}]
        assert await batcher.score(request(30)) == [{"row": 30}]
        await batcher.stop()
        assert a.cancelled()
        assert [rows for rows, *_ in scorer.batches] == [[10, 11, 20], [30]]
        assert batcher.queued_rows == 0

    run(scenario)


def test_a_failed_batch_reaches_each_of_its_requests_and_the_batcher_goes_on():
    scorer = Scorer(fail=True)

    async def scenario():
        batcher = _batcher(scorer, max_rows=8)
        failed = await asyncio.gather(batcher.score(request(1)), batcher.score(request(2)), return_exceptions=True)
        assert [str(e) for e in failed] == ["the device fell over"] * 2
        assert await batcher.score(request(3)) == [{"row": 3}]
        await batcher.stop()
        assert batcher.queued_rows == 0

    run(scenario)


@pytest.mark.parametrize("queued, more, full", [(0, 8, False), (0, 9, True), (5, 3, False), (5, 4, True)])
def test_the_queue_is_full_past_queue_rows(queued, more, full):
    batcher = Batcher(Scorer(), ServerSettings(queue_rows=8))  # type: ignore[arg-type]
    batcher.queued_rows = queued
    assert batcher.full(more) is full


def test_the_head_waits_for_rows_of_its_own_kind_not_for_others():
    """A (1 row) heads the queue beside B (4 rows of another kind), 4 rows a batch: B's rows
    cannot join A's batch, so the batcher waits (up to max_wait_ms, a minute here) for rows
    of A's kind; C (3 rows), arriving 20 ms later, fills A's batch, which is then scored
    at once."""
    scorer = Scorer()

    async def scenario():
        batcher = _batcher(scorer, max_rows=4, max_wait_ms=60_000.0)
        first = [asyncio.ensure_future(batcher.score(r)) for r in (request(1), request(2, 3, 4, 5, topk=8))]
        await asyncio.sleep(0.02)
        last = await batcher.score(request(6, 7, 8))
        await asyncio.gather(*first)
        await batcher.stop()
        assert last == [{"row": 6}, {"row": 7}, {"row": 8}]
        assert [rows for rows, *_ in scorer.batches] == [[1, 6, 7, 8], [2, 3, 4, 5]]

    run(scenario)


def test_scoring_before_start_is_refused_by_name():
    async def scenario():
        with pytest.raises(AssertionError, match=r"Batcher\.start\(\) was not called"):
            await Batcher(Scorer(), ServerSettings()).score(request(1))  # type: ignore[arg-type]

    run(scenario)
