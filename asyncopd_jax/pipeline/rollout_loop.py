"""The rollout loop: one rollout stage's sampling engine kept running across groups.

Every rollout stage of every placement runs this one loop: a rollout thread of the
learner's process (:class:`~asyncopd_jax.pipeline.placements.threads.RolloutPool`) and a rollout
stage process (:mod:`asyncopd_jax.pipeline.stage_main`), with either engine (the
static one decodes a group at a time, the continuous one keeps its slots full across
groups; both behind :class:`~asyncopd_jax.sampling.RolloutStream`). Two callables make
the difference between placements:

    next_group(block)   the next group to start, ``(index, oldest version it may start
                        from)``: the staleness buffer's capacity rule (threads) or a claimed
                        ticket (processes); None when none may start yet
    deliver(index, g)   what happens to a sampled group: scored and put into the buffer
                        (threads) or committed to the spool (processes)

The loop, per chunk of decode steps:

1. start groups while the stream wants prompts (the continuous engine: fewer wait than
   it has slots; the static engine: no group in progress), each one granted by
   ``next_group``; it blocks only when the stream has nothing else to do;
2. decode one chunk; when groups ended in it, start the next ones that may start (step 1,
   without blocking), then hand the ended groups to ``deliver``: on a thread of its own,
   beside the next chunks, or here when nothing is left to decode;
3. swap in a newer snapshot, if one was published (interruptible generation).

A group starts from the newest published snapshot when the stream is idle (the swap
rewrites no cache) or generation is interruptible; a group granted a minimum version newer
than the stream's weights waits for that snapshot and swaps it in before its prompts are
queued: a ``sync`` schedule's groups start from the policy just trained. Token versions
are recorded per token, so a group whose prompts entered rows under several policies
reports each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from asyncopd_jax.pipeline.producer import GroupProducer, answer_lengths, group_key
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.sampling import RolloutStream, prompt_keys

# While a group is being delivered (scored), a rollout loop with nothing to decode checks for
# new capacity and for the delivery's end this often, instead of blocking on capacity alone.
DELIVERY_POLL_S = 0.05

# (block) → the next group to start as (index, the oldest version it may start from), or
# None when none may start yet (only when ``block`` is false)
NextGroup = Callable[[bool], "tuple[int, int] | None"]
# (index, sampled group) → None: score / hand over / commit it
Deliver = Callable[[int, RolloutGroup], None]


class RolloutLoop:
    """The rollout loop of one stage (module docstring) over ``producer``'s engine."""

    def __init__(self, producer: GroupProducer):
        self.producer = producer
        self.stream: RolloutStream | None = None

    def _swap_to(self, min_version: int) -> None:
        """Weights at ``min_version`` or newer (waited for); the newest published when the
        stream is idle (a swap then rewrites no cache) or generation is interruptible.

        A group that started from older weights than it had to would reach the learner
        staler, and past ``η`` be dropped unread."""
        p = self.producer
        if self.stream is not None and self.stream.version >= min_version:
            if self.stream.idle or p.interruptible:
                self._take_newer()
            return
        with p.tracer.span("wait_for_version", version=min_version):
            p.snapshots.wait_for(min_version, timeout=p.version_timeout)
        version, state = p.load_snapshot()
        if self.stream is None:
            self.stream = p.open_stream(state, version)
        else:
            self.stream.swap(version, state)

    def _take_newer(self) -> None:
        """Swap in the newest published snapshot, if it is newer than the stream's weights."""
        assert self.stream is not None
        update = self.producer.newer_snapshot(self.stream.version)
        if update is not None:
            self.stream.swap(*update)

    def _start(self, index: int, min_version: int) -> None:
        p = self.producer
        self._swap_to(min_version)
        assert self.stream is not None
        prompts, problems, route = p.prompts_of(index)
        keys = prompt_keys(group_key(p.seed, index), len(prompts))
        tag = (index, problems, route, time.time(), self.stream.version)
        self.stream.submit(tag, prompts, keys, p.environments(problems))

    def run(
        self,
        next_group: NextGroup,
        deliver: Deliver,
        between_chunks: Callable[[], None] = lambda: None,
        name: str = "rollout",
    ) -> None:
        """Run until ``next_group``, ``deliver`` or ``between_chunks`` (called before every
        chunk) raises (a stopped run: :class:`~asyncopd_jax.pipeline.staleness.PipelineStopped`).

        ``deliver`` runs on a thread of its own, ``{name}-scoring``, one group after
        another, while the next chunks decode; an error it raises is raised here before the
        next chunk, and the deliveries started finish before this returns. With nothing left
        to decode (a ``sync`` schedule's group, or the last) and no delivery in progress,
        it runs here instead: a hop to another thread would only add latency."""
        p = self.producer
        with ThreadPoolExecutor(1, thread_name_prefix=f"{name}-scoring") as handoff:
            deliveries: list[Future[None]] = []
            while True:
                between_chunks()
                for done in [d for d in deliveries if d.done()]:
                    deliveries.remove(done)
                    done.result()  # a delivery's error, raised in this loop
                self._start_groups(next_group, may_block=True, deliveries=deliveries)
                assert self.stream is not None
                ended = self.stream.step()
                if ended:  # the next groups start decoding before these are delivered
                    self._start_groups(next_group, may_block=False)
                for (index, problems, route, start, version), batch in ended:
                    p.tracer.record("rollout", start, time.time(), version=version, **answer_lengths(batch))
                    group = p.finish(batch, problems, version, route)
                    if self.stream.idle and all(d.done() for d in deliveries):
                        deliver(index, group)
                    else:
                        deliveries.append(handoff.submit(deliver, index, group))
                if p.interruptible and not self.stream.idle:
                    self._take_newer()

    def _start_groups(self, next_group: NextGroup, may_block: bool, deliveries: Sequence[Future[None]] = ()) -> None:
        """Start groups while the stream wants prompts and ``next_group`` grants them; it
        blocks (``may_block``) only when the stream has nothing else to do.

        While ``deliveries`` are in progress it does not block in ``next_group``: it asks
        without blocking and waits on them in between, so that a delivery that fails is
        raised here (a group that is never delivered may hold the very capacity
        ``next_group`` would wait for)."""
        while self.stream is None or self.stream.wants_prompts:
            block = may_block and (self.stream is None or self.stream.idle)
            pending = [d for d in deliveries if not d.done()]
            for done in [d for d in deliveries if d.done()]:
                done.result()  # a delivery's error, raised here
            granted = next_group(block and not pending)
            if granted is None and block and pending:
                wait(pending, timeout=DELIVERY_POLL_S, return_when=FIRST_COMPLETED)
                continue
            if granted is None:
                return
            self._start(*granted)
