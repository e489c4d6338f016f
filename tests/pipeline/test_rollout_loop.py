"""A rollout stage's continuous engine kept running across groups (``RolloutLoop``): each
group is the one its index gives when sampled alone, groups are handed on while others
still decode, and a group granted a minimum version starts from it."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.pipeline.producer import GroupProducer
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.rollout_loop import RolloutLoop
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore
from asyncopd_jax.pipeline.staleness import PipelineStopped
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import make_sampler
from asyncopd_jax.teacher.routing import RoutedTeacher, Router, RoutingParams
from tests.tiny_models import slot_sampling, tiny_decoder
from tests.waits import WAIT_S

PROMPT_SLOTS = 5


def _prompts(rng: np.random.Generator, n: int):
    """Prompts of 1–5 tokens drawn from ``rng`` (the group's own: ``[seed, index]``)."""
    prompts = [rng.integers(3, 60, size=rng.integers(1, PROMPT_SLOTS + 1)).tolist() for _ in range(n)]
    return prompts, [None] * n


def _producer(
    interruptible: bool = True, engine: str = "continuous", router: Router | None = None, slots: int | None = None
) -> tuple[GroupProducer, InMemorySnapshotStore]:
    graphdef, state = nnx.split(tiny_decoder(0, scale=0.7))
    params = slot_sampling(engine)
    if slots is not None:
        params = dataclasses.replace(params, slots=slots)
    snapshots = InMemorySnapshotStore()
    snapshots.publish(0, state)
    producer = GroupProducer(
        sampler=make_sampler(graphdef, params),
        snapshots=snapshots,
        prompts=_prompts,
        reward=RewardStage(lambda problems, batch: [0.0] * len(problems)),
        group_size=4,
        seed=7,
        prompt_slots=PROMPT_SLOTS,
        tracer=Tracer(),
        interruptible=interruptible,
        version_timeout=WAIT_S,
        router=router,
    )
    return producer, snapshots


def _stream(producer: GroupProducer, grants: list[tuple[int, int]], before_grant=None):
    """Run a RolloutLoop over ``grants`` (index, min_version); returns the delivered groups,
    per delivery how many groups were still in the stream, and per grant how many were in
    the stream already (read in the loop's own thread: a delivery runs beside the next
    chunks, on a thread of its own)."""
    streamer = RolloutLoop(producer)
    pending = list(grants)
    delivered, still_in_stream, in_stream_at_grant = {}, [], []

    def next_group(block: bool):
        in_stream_at_grant.append(0 if streamer.stream is None else streamer.stream.pending_groups)
        if not pending:
            if len(delivered) == len(grants):
                raise PipelineStopped("done")
            return None
        if before_grant is not None:
            before_grant(pending[0])
        return pending.pop(0)

    def deliver(index, group):
        delivered[index] = group
        still_in_stream.append(streamer.stream.pending_groups)

    with pytest.raises(PipelineStopped):
        streamer.run(next_group, deliver)
    return delivered, still_in_stream, in_stream_at_grant


def _two_teachers() -> Router:
    """Each prompt scored by teacher a or b, drawn 1 : 1 from the group's generator."""
    return Router(
        [RoutedTeacher("a"), RoutedTeacher("b")],
        RoutingParams(by="mixture"),
        fields=lambda item: item,
        items=lambda: [],
        where=str,
        pad_id=0,
        student_slots=PROMPT_SLOTS,
    )


@pytest.mark.parametrize("engine, slots", [("continuous", None), ("continuous", 0), ("static", None)])
def test_streamed_groups_are_the_groups_their_indices_give_alone(engine, slots):
    """The one rollout loop, over either engine: the continuous engine hands a group on while
    others still decode (its 3 slots, or with ``sampling.slots: 0`` one a prompt of a group);
    the static one decodes a group at a time. Each group carries the teachers its index
    routes its prompts to."""
    producer, _ = _producer(engine=engine, router=_two_teachers(), slots=slots)
    delivered, still_in_stream, in_stream_at_grant = _stream(producer, [(i, 0) for i in range(4)])
    assert sorted(delivered) == [0, 1, 2, 3]
    if engine == "continuous":
        assert max(still_in_stream) > 0  # handed on while other groups were still decoding
    else:
        assert max(in_stream_at_grant) == 0  # a group starts once the one before it was handed back
    for index, group in delivered.items():
        alone = producer.sample(index)
        assert group.route is not None and len(set(group.route.teacher.tolist())) == 2
        np.testing.assert_array_equal(group.route.teacher, alone.route.teacher)
        for field in ("response_tokens", "response_mask", "candidate_ids", "token_version"):
            np.testing.assert_array_equal(getattr(group.batch, field), getattr(alone.batch, field), err_msg=field)
        np.testing.assert_allclose(group.batch.behavior_logp, alone.batch.behavior_logp, atol=1e-5)


def test_a_group_granted_a_newer_minimum_version_starts_from_it():
    """Group 2 may start only from version 1: the stream waits for it and swaps it in; the
    groups in flight then go on under version 1 (their recorded token versions say so). Not
    interruptible: only the minimum version can bring version 1 in."""
    producer, snapshots = _producer(interruptible=False)
    _, state = snapshots.load()
    newer = jax.tree_util.tree_map(lambda x: x * 1.01, state)

    def publish_before_group_2(grant):
        if grant[0] == 2 and snapshots.latest_version() == 0:
            snapshots.publish(1, newer)

    delivered, _, _ = _stream(producer, [(0, 0), (1, 0), (2, 1), (3, 1)], publish_before_group_2)
    for index in (2, 3):
        batch = delivered[index].batch
        versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
        assert (versions == 1).all() and delivered[index].oldest_version == 1
    assert {delivered[i].newest_version for i in (0, 1)} <= {0, 1}
    # the trace (trace.json, and the summary's stage seconds): the first load and the swap to 1, a
    # rollout span per group with the version it started from and its answers' lengths
    events = producer.tracer.events()
    assert [e["args"] for e in events if e["name"] == "swap_weights"] == [{"version": 0}, {"version": 1}]
    spans = [e["args"] for e in events if e["name"] == "rollout"]
    assert sorted(a["version"] for a in spans) == [0, 0, 1, 1]
    mask = np.concatenate([np.asarray(delivered[i].batch.response_mask) for i in range(4)])
    assert sum(a["tokens"] for a in spans) == mask.sum() and sum(a["rows"] for a in spans) == len(mask)


@pytest.mark.parametrize("interruptible", [False, True])
def test_a_group_starting_on_an_idle_stream_starts_from_the_newest_snapshot(interruptible):
    """Group 1 may start from version 0, but version 1 was published before it started and
    the static stream is idle then (a swap rewrites no cache): every token of group 1 is
    version 1. Starting from the stream's old weights would make the group a version staler
    than it had to be: under ``fully_async`` the buffer then drops such groups unread."""
    producer, snapshots = _producer(interruptible=interruptible, engine="static")
    _, state = snapshots.load()
    newer = jax.tree_util.tree_map(lambda x: x * 1.01, state)

    def publish_before_group_1(grant):
        if grant[0] == 1 and snapshots.latest_version() == 0:
            snapshots.publish(1, newer)

    delivered, _, _ = _stream(producer, [(0, 0), (1, 0)], publish_before_group_1)
    batch = delivered[1].batch
    versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
    assert versions.size and (versions == 1).all()
    assert delivered[1].oldest_version == 1


def test_a_failed_delivery_is_raised_while_the_loop_waits_for_capacity():
    """Group 0's delivery (scoring) fails on the scoring thread after the stream has decoded
    everything it was granted, when ``next_group`` would block until capacity frees (which
    that lost group never frees): the loop raises the delivery's error instead of blocking."""
    import threading

    producer, _ = _producer()
    streamer = RolloutLoop(producer)
    grants = [(0, 0), (1, 0)]
    never = threading.Event()

    def next_group(block: bool):
        if grants:
            return grants.pop(0)
        if block:  # capacity that only the failed group's consumer would free
            never.wait(WAIT_S)
            raise AssertionError("blocked on capacity past a failed delivery")
        return None

    def deliver(index, group):
        if index == 0:
            time.sleep(0.5)  # the stream runs dry meanwhile
            raise RuntimeError("scoring group 0 failed")

    with pytest.raises(RuntimeError, match="scoring group 0 failed"):
        streamer.run(next_group, deliver)


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_the_loop_blocks_for_a_group_only_when_its_stream_is_idle(engine):
    """While groups decode, the loop asks for more without blocking (it must keep decoding);
    once the stream is idle and no delivery is pending it blocks in ``next_group`` rather
    than spinning: here, asked without blocking on an idle stream, it would call again and
    again."""
    producer, _ = _producer(engine=engine)
    streamer = RolloutLoop(producer)
    grants = [(0, 0), (1, 0)]
    asked: list[tuple[bool, bool]] = []  # (block, the stream idle) per call

    def next_group(block: bool):
        stream = streamer.stream
        asked.append((block, stream is None or stream.idle))
        assert len(asked) < 1000, "asked again and again between two chunks"  # 5 or 6 calls a run here
        if grants:
            return grants.pop(0)
        if stream is not None and stream.idle:
            if block:
                raise PipelineStopped("blocked, as it should")
            assert sum(1 for b, idle in asked if idle and not b) < 50, "spinning on an idle stream"
        return None

    with pytest.raises(PipelineStopped, match="blocked, as it should"):
        streamer.run(next_group, lambda index, group: time.sleep(0.05))
    busy = [b for b, idle in asked if not idle]
    assert not any(busy), asked  # never blocked while a group decoded
    assert busy or engine == "static", asked  # a continuous stream asks for more while it decodes


@pytest.mark.parametrize("groups", [1, 4])
def test_a_group_is_delivered_in_the_loop_only_when_nothing_is_left_to_decode(groups):
    """A delivery (the teacher's scoring, in a rollout process) runs beside the next chunks
    on the ``rollout-scoring`` thread; in the loop's own thread only when the stream is idle
    and no other delivery runs (nothing would overlap it). One group: delivered in the
    loop. Four on the continuous engine: the first ends while others decode, with no
    delivery running, and still goes to the scoring thread."""
    import threading

    producer, _ = _producer()
    streamer = RolloutLoop(producer)
    grants = [(i, 0) for i in range(groups)]
    deliveries: list[tuple[str, bool]] = []  # (thread, the stream idle) per delivery

    def next_group(block: bool):
        if grants:
            return grants.pop(0)
        if len(deliveries) == groups:
            raise PipelineStopped("done")
        return None

    def deliver(index, group):
        deliveries.append((threading.current_thread().name, streamer.stream.idle))

    here = threading.current_thread().name
    with pytest.raises(PipelineStopped):
        streamer.run(next_group, deliver)
    if groups == 1:
        assert deliveries == [(here, True)]
    else:
        assert deliveries[0] == ("rollout-scoring_0", False), deliveries
        assert all(idle for thread, idle in deliveries if thread == here), deliveries
