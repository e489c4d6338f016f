"""Rollout groups: how one is sampled (:class:`GroupProducer`), the interface every
placement's stages offer the learner (:class:`Stages`), and the threads placement's
rollout workers (:class:`RolloutPool`).

Each worker thread loops: wait for capacity (:class:`StalenessBuffer`), take the newest
policy snapshot (at least the version the buffer requires), sample a group of prompts
(interruptible: between decode chunks it swaps in a newer snapshot if one was published),
score it in the scoring stage, and hand it to the buffer. A worker that raises stops the
whole run: the error is recorded in the buffer, every waiting thread wakes up, and the
learner re-raises it. JAX releases the GIL while a jitted computation runs, so sampling,
scoring and learning overlap, each on its own devices (see ``pipeline/placement.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import jax
import numpy as np

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import ContinuousSampler, Sampler, prompt_keys
from asyncopd_jax.sampling.stream import RolloutStream

if TYPE_CHECKING:
    from asyncopd_jax.pipeline.stage import RolloutStage

# (rng, n) → (prompt token lists, per-prompt problems for the reward)
PromptSource = Callable[[np.random.Generator, int], tuple[list[list[int]], list]]


def group_key(seed: int, index: int) -> jax.Array:
    """The sampling key of rollout group ``index`` (its scoring key is ``fold_in(·, 1)``).

    A function of ``(seed, index)`` only, so any process can rebuild it."""
    return jax.random.key(hash((seed, index)) % (2**31))


class GroupProducer:
    """The work of one rollout group, wherever it runs (a thread or a stage process).

    Group ``index`` draws its prompts from ``rng([seed, index])`` and its sampling key
    from :func:`group_key`, so the same index gives the same prompts in every placement.
    Each prompt is answered ``reward.samples_per_prompt`` times (RL; once for
    distillation), and ``reward`` scores the answers.
    """

    def __init__(
        self,
        *,
        sampler: Sampler | ContinuousSampler,
        snapshots: SnapshotStore,
        prompts: PromptSource,
        reward: RewardStage,
        group_size: int,
        seed: int,
        prompt_slots: int,
        tracer: Tracer,
        interruptible: bool = True,
        version_timeout: float = 600.0,
    ):
        self.sampler, self.snapshots, self.prompts, self.reward = sampler, snapshots, prompts, reward
        self.group_size, self.seed, self.prompt_slots = group_size, seed, prompt_slots
        self.tracer, self.interruptible = tracer, interruptible
        self.version_timeout = version_timeout  # how long a group waits for the version it must start from

    def newer_snapshot(self, version: int):
        """The newest snapshot as ``(version, weights)`` when it is newer than ``version``."""
        latest = self.snapshots.latest_version()
        if latest is not None and latest > version:
            with self.tracer.span("swap_weights", version=latest):
                return self.snapshots.load()
        return None

    def prompts_of(self, index: int) -> tuple[list[list[int]], list]:
        """Group ``index``'s prompts (each repeated ``samples_per_prompt`` times) and the
        problems the reward checks them against."""
        rng = np.random.default_rng([self.seed, index])
        prompts, problems = self.prompts(rng, self.reward.prompts_per_group(self.group_size))
        return self.reward.repeat(prompts), self.reward.repeat(problems)

    def sample(self, index: int, version: int | None = None, min_version: int = 0) -> RolloutGroup:
        """Sample group ``index`` from snapshot ``version`` (default: the newest, once it is
        ``min_version`` or newer); no teacher scores yet."""
        if version is None and min_version:
            with self.tracer.span("wait_for_version", version=min_version):
                self.snapshots.wait_for(min_version, timeout=self.version_timeout)
        prompts, problems = self.prompts_of(index)
        version, params = self.snapshots.load(version)
        with self.tracer.span("rollout", version=version) as info:
            batch = self.sampler.generate(
                params,
                prompts,
                group_key(self.seed, index),
                version=version,
                prompt_slots=self.prompt_slots,
                weight_source=self.newer_snapshot if self.interruptible else None,
            )
            jax.block_until_ready(batch.response_tokens)
            info.update(answer_lengths(batch))
        return self.finish(batch, problems, version)

    def finish(self, batch: RolloutBatch, problems: list, version: int) -> RolloutGroup:
        """A sampled group's rewards and version span (``version``: where it started, the
        span of a group with no answer token)."""
        versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
        oldest = int(versions.min()) if versions.size else version
        newest = int(versions.max()) if versions.size else version
        with self.tracer.span("reward"):
            batch, rewards = self.reward(problems, batch)
        return RolloutGroup(batch, None, oldest, newest, {"rewards": rewards})


def answer_lengths(batch: RolloutBatch) -> dict[str, int]:
    """What a ``rollout`` span records of a group: its rows, answer tokens and longest
    answer (a lockstep batch decodes until the longest ends: its cost follows ``longest``)."""
    lengths = np.asarray(batch.response_mask).sum(axis=1)
    return dict(rows=int(lengths.size), tokens=int(lengths.sum()), longest=int(lengths.max(initial=0)))


# (block) → the next group to start as (index, the oldest version it may start from), or
# None when none may start yet (only when ``block`` is false)
NextGroup = Callable[[bool], "tuple[int, int] | None"]


class GroupStreamer:
    """A rollout stage's continuous engine kept running across groups (``sampling.engine:
    continuous``; :class:`~asyncopd_jax.sampling.stream.RolloutStream`).

    The loop, per chunk of decode steps:

    1. start groups while fewer prompts wait for a slot than there are slots: each one
       granted by ``next_group`` (the capacity rule), its prompts queued behind the others';
       it blocks only when the stream has nothing else to do;
    2. decode one chunk; hand every group whose last answer ended to ``deliver`` (scoring
       runs there, on a thread of its own, beside the next chunks);
    3. swap in a newer snapshot, if one was published (interruptible generation).

    A group granted with a minimum version newer than the stream's weights waits for that
    snapshot and swaps it in before its prompts are queued: a ``sync`` schedule's groups
    start from the policy just trained. Token versions are recorded per token, so a group
    whose prompts entered slots under several policies reports each.
    """

    def __init__(self, producer: GroupProducer):
        if not isinstance(producer.sampler, ContinuousSampler):
            raise TypeError("a GroupStreamer needs the continuous engine (sampling.engine: continuous)")
        self.producer = producer
        self.engine: ContinuousSampler = producer.sampler
        self.stream: RolloutStream | None = None

    def _swap_to(self, min_version: int) -> None:
        """Weights at ``min_version`` or newer (waited for)."""
        p = self.producer
        if self.stream is None or self.stream.version < min_version:
            with p.tracer.span("wait_for_version", version=min_version):
                p.snapshots.wait_for(min_version, timeout=p.version_timeout)
            with p.tracer.span("swap_weights", version=p.snapshots.latest_version()):
                version, state = p.snapshots.load()
            if self.stream is None:
                slots = self.engine.params.slots or p.group_size
                self.stream = RolloutStream(
                    self.engine, state, version=version, prompt_slots=p.prompt_slots, slots=slots
                )
            else:
                self.stream.swap(version, state)

    def _start(self, index: int, min_version: int) -> None:
        p = self.producer
        self._swap_to(min_version)
        assert self.stream is not None
        prompts, problems = p.prompts_of(index)
        keys = prompt_keys(group_key(p.seed, index), len(prompts))
        self.stream.submit((index, problems, time.time(), self.stream.version), prompts, keys)

    def run(
        self,
        next_group: NextGroup,
        deliver: Callable[[int, RolloutGroup], None],
        between_chunks: Callable[[], None] = lambda: None,
        name: str = "rollout",
    ) -> None:
        """Stream groups until ``next_group``, ``deliver`` or ``between_chunks`` (called
        before every chunk) raises (a stopped run: :class:`PipelineStopped`).

        ``deliver`` (scoring, hand-over) runs on a thread of its own, ``{name}-scoring``, one
        group after another, while the next chunks decode; an error it raises is raised here
        before the next chunk, and the deliveries started finish before this returns."""
        p = self.producer
        with ThreadPoolExecutor(1, thread_name_prefix=f"{name}-scoring") as handoff:
            deliveries: list[Future[None]] = []
            while True:
                between_chunks()
                for done in [d for d in deliveries if d.done()]:
                    deliveries.remove(done)
                    done.result()  # a delivery's error, raised in this loop
                while self.stream is None or self.stream.queued < self.stream.slots:
                    granted = next_group(self.stream is None or self.stream.idle)
                    if granted is None:
                        break
                    self._start(*granted)
                assert self.stream is not None
                for (index, problems, start, version), batch in self.stream.step():
                    p.tracer.record(
                        "rollout", start, time.time(), version=version, streamed=True, **answer_lengths(batch)
                    )
                    deliveries.append(handoff.submit(deliver, index, p.finish(batch, problems, version)))
                if p.interruptible and not self.stream.idle:
                    update = p.newer_snapshot(self.stream.version)
                    if update is not None:
                        self.stream.swap(*update)


class Stages(Protocol):
    """What the learner asks of the rollout and scoring stages, wherever they run
    (:class:`RolloutPool`, :class:`~asyncopd_jax.pipeline.stage_processes.StageProcesses`,
    :class:`~asyncopd_jax.pipeline.fixed_lag.FixedLagRollouts`, and the multi-process
    learner's views in :mod:`asyncopd_jax.pipeline.multihost`)."""

    @property
    def groups_started(self) -> int:
        """Index of the last rollout group started (numbered from the run's start)."""
        ...

    def start(self) -> None: ...

    def take(self, version: int) -> list[RolloutGroup]:
        """The groups of the next batch, for the learner at ``version``."""
        ...

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """The learner trained on ``taken``."""
        ...

    def checkpointed(self) -> None:
        """A checkpoint covering every batch consumed so far was saved."""
        ...

    def join(self, timeout: float = 60.0) -> None: ...

    def trace_files(self) -> list[Path]:
        """Trace files the stages wrote in other processes."""
        ...


class RolloutPool:
    """``stages`` as worker threads, each producing scored :class:`RolloutGroup` s into
    ``buffer`` (the threads placement)."""

    def __init__(self, *, stages: list[RolloutStage], buffer: StalenessBuffer, first_index: int = 0):
        self.stages, self.buffer = stages, buffer
        self._threads = [threading.Thread(target=self._run, args=(s,), name=s.plan.name, daemon=True) for s in stages]
        self._counter = first_index
        self._lock = threading.Lock()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def groups_started(self) -> int:
        with self._lock:
            return self._counter

    def _next_index(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def take(self, version: int) -> list[RolloutGroup]:
        return self.buffer.take(version)

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """Nothing to do: groups never leave this process."""

    def checkpointed(self) -> None:
        """Nothing to do: groups never leave this process."""

    def trace_files(self) -> list[Path]:
        return []

    def _run(self, stage: RolloutStage) -> None:
        if stage.streams:
            return self._stream(stage)
        size = stage.producer.group_size
        try:
            while True:
                min_version = self.buffer.acquire(size)
                index = self._next_index()
                try:
                    group = stage.group(index, min_version=min_version)
                except BaseException:
                    self.buffer.release(size)
                    raise
                self.buffer.put(group)
        except PipelineStopped:
            return
        except BaseException as err:  # noqa: BLE001 - forwarded to the learner
            self.buffer.fail(err)

    def _stream(self, stage: RolloutStage) -> None:
        """``stage``'s engine kept running across groups (:class:`GroupStreamer`); a group
        is scored on a thread of its own while the next chunks decode."""
        size = stage.producer.group_size

        def next_group(block: bool) -> tuple[int, int] | None:
            min_version = self.buffer.acquire(size) if block else self.buffer.try_acquire(size)
            return None if min_version is None else (self._next_index(), min_version)

        def score_and_put(index: int, group: RolloutGroup) -> None:
            self.buffer.put(stage.scored(group, index))

        try:
            GroupStreamer(stage.producer).run(next_group, score_and_put, self.buffer.check, stage.plan.name)
        except PipelineStopped:
            return
        except BaseException as err:  # noqa: BLE001 - forwarded to the learner
            self.buffer.fail(err)
