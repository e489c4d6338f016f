"""The ``threads`` placement's rollout stages: a thread each in the learner's process.

Each thread runs the rollout loop (:class:`~asyncopd_jax.pipeline.rollout_loop.RolloutLoop`):
its groups are granted by the :class:`~asyncopd_jax.pipeline.staleness.StalenessBuffer`
(AReaL's capacity rule) and each sampled group is scored in the scoring stage and put
into the buffer, on a thread of its own, while the next chunks decode. A stage that raises
stops the whole run: the error is recorded in the buffer, every waiting thread wakes up,
and the learner re-raises it. JAX releases the GIL while a jitted computation runs, so
sampling, scoring and learning overlap, each on its own devices (see
:mod:`asyncopd_jax.pipeline.layout`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from asyncopd_jax.pipeline.rollout_loop import RolloutLoop
from asyncopd_jax.pipeline.rollout_stage import RolloutStage
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer


class RolloutPool:
    """``stages`` as threads, each producing scored :class:`RolloutGroup` s into ``buffer``
    (a :class:`~asyncopd_jax.pipeline.placements.Stages`)."""

    def __init__(self, *, stages: list[RolloutStage], buffer: StalenessBuffer, first_index: int = 0):
        self.stages, self.buffer = stages, buffer
        self._threads = [threading.Thread(target=self._run, args=(s,), name=s.plan.name, daemon=True) for s in stages]
        self._counter = first_index
        self._lock = threading.Lock()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        """Wait for the threads, ``timeout`` seconds for all of them together."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

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

    def unlearned(self) -> list[int]:
        """None: groups never outlive this process."""
        return []

    def checkpointed(self) -> None:
        """Nothing to do: groups never leave this process."""

    def trace_files(self) -> list[Path]:
        return []

    def _run(self, stage: RolloutStage) -> None:
        size = stage.producer.group_size

        def next_group(block: bool) -> tuple[int, int] | None:
            min_version = self.buffer.acquire(size) if block else self.buffer.try_acquire(size)
            return None if min_version is None else (self._next_index(), min_version)

        def score_and_put(index: int, group: RolloutGroup) -> None:
            self.buffer.put(stage.scored(group, index))

        try:
            RolloutLoop(stage.producer).run(next_group, score_and_put, self.buffer.check, stage.plan.name)
        except PipelineStopped:
            return
        except BaseException as err:  # noqa: BLE001 - forwarded to the learner
            self.buffer.fail(err)
