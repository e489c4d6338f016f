"""The staleness buffer between rollout workers and the learner.

Versions count optimizer steps. The learner consumes rollout batches of B samples; each
batch drives ``mini_batches`` optimizer steps, so after ``c`` consumed batches the
learner is at version ``v = c · mini_batches``. Two rules bound staleness:

* **Capacity (AReaL).** A new rollout may start only while
  ``accepted + running < (η_b + c + 1) · B``, with ``η_b = ⌊η / mini_batches⌋`` the bound
  in batches (with one step per batch this is AReaL's ``(η + v + 1) · B``). Producers
  therefore never run more than ``η_b + 1`` batches ahead of the learner; ``η = 0`` is
  synchronous training (a batch starts only after the previous one was trained on).
* **Drop on consume.** When the learner takes a batch at version ``v``, samples whose
  oldest token version is below ``v − η`` are dropped, and samples with a version above
  ``v`` (from the future: a bug upstream) are refused; both are counted and their
  capacity released. Staleness is measured when the learner takes the batch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
    from asyncopd_jax.teacher.routing import TeacherRoute
    from asyncopd_jax.teacher.scorer import TeacherUse


@dataclasses.dataclass
class RolloutGroup:
    """A group of G samples produced together (one rollout group), with their teacher scores."""

    batch: RolloutBatch  # G rows
    cache: TeacherScoreCache | None  # G rows; None until scored (and in a run that scores nothing)
    oldest_version: int  # the oldest policy version that sampled one of its tokens
    newest_version: int  # the newest
    rewards: np.ndarray | None = None  # [G] the task's reward of each sample (None: not computed)
    record: str | None = None  # the spool record it was read from (stage processes)
    route: TeacherRoute | None = None  # which teacher scores each row, and under which prompt (None: the only one)
    teacher_uses: dict[str, TeacherUse] = dataclasses.field(default_factory=dict)  # each teacher's scoring cost
    # the policy version its stage loaded last before it finished, and the seconds the load took
    last_load: tuple[int, float] | None = None

    @property
    def size(self) -> int:
        return int(np.shape(self.batch.response_tokens)[0])


class PipelineStopped(RuntimeError):
    """Raised in every waiting thread once the run stops (cleanly or with an error)."""


class StalenessBuffer:
    """Thread-safe capacity control and staleness-filtered hand-over of rollout groups."""

    def __init__(self, batch_size: int, eta: int, mini_batches: int = 1, first_version: int = 0):
        self.batch_size = batch_size
        self.eta = eta
        self.mini_batches = mini_batches
        self.first_version = first_version  # the learner's version when this buffer starts (a resume's)
        self.eta_batches = eta // mini_batches
        self._cond = threading.Condition()
        self._ready: deque[RolloutGroup] = deque()
        self._started = 0  # accepted (ever, minus dropped) + running, in samples
        self._consumed_batches = 0
        self._error: BaseException | None = None
        self._stopped = False
        self.dropped_stale = 0
        self.dropped_future = 0

    # --- producers -----------------------------------------------------------------

    def capacity(self) -> int:
        """Samples that may still start under the capacity rule."""
        return (self.eta_batches + self._consumed_batches + 1) * self.batch_size - self._started

    def acquire(self, n: int, timeout: float | None = None) -> int:
        """Block until ``n`` more samples may start, then count them as running.

        Returns the oldest policy version they may start from: the learner trains on them
        at version ``v₀ + c · mini_batches`` or later (c batches consumed now), so they
        must start from ``v₀ + c · mini_batches − η`` or newer; a snapshot still being written when
        they are admitted is waited for, not replaced by an older one (which ``take`` would
        drop as stale: under ``sync``, every time). Versions count from ``first_version``."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._stopped or self.capacity() >= n, timeout)
            self._raise_if_stopped()
            if not ok:
                raise TimeoutError("no rollout capacity within the timeout")
            return self._start(n)

    def try_acquire(self, n: int) -> int | None:
        """:meth:`acquire` without waiting: None when ``n`` more samples may not start now."""
        with self._cond:
            self._raise_if_stopped()
            return self._start(n) if self.capacity() >= n else None

    def _start(self, n: int) -> int:
        """Count ``n`` samples as running; the oldest version they may start from."""
        self._started += n
        return max(0, self.first_version + self._consumed_batches * self.mini_batches - self.eta)

    def put(self, group: RolloutGroup) -> None:
        with self._cond:
            self._raise_if_stopped()
            self._ready.append(group)
            self._cond.notify_all()

    def release(self, n: int) -> None:
        """Return capacity of samples that were started but will never be put."""
        with self._cond:
            self._started -= n
            self._cond.notify_all()

    # --- the learner -----------------------------------------------------------------

    def take(self, version: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Block until B fresh-enough samples are ready; return their groups.

        Groups older than ``version − η`` are dropped and groups from the future refused
        (counted in ``dropped_stale`` / ``dropped_future``). Raises the first worker error.
        """
        taken: list[RolloutGroup] = []
        n = 0
        with self._cond:
            while n < self.batch_size:
                ok = self._cond.wait_for(lambda: self._stopped or bool(self._ready), timeout)
                self._raise_if_stopped()
                if not ok:
                    raise TimeoutError(f"no rollouts arrived within {timeout} s")
                group = self._ready.popleft()
                if group.newest_version > version:
                    self.dropped_future += group.size
                    self._started -= group.size
                elif group.oldest_version < version - self.eta:
                    self.dropped_stale += group.size
                    self._started -= group.size
                else:
                    taken.append(group)
                    n += group.size
                self._cond.notify_all()
        if n != self.batch_size:
            raise RuntimeError(f"rollout groups do not add up to the batch size: {n} != {self.batch_size}")
        return taken

    def finish_batch(self) -> None:
        """The learner has trained on one more batch: capacity for one more opens."""
        with self._cond:
            self._consumed_batches += 1
            self._cond.notify_all()

    # --- stopping --------------------------------------------------------------------

    def fail(self, error: BaseException) -> None:
        """Stop everything; every waiting and future call raises (with ``error`` as cause)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._stopped = True
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def check(self) -> None:
        """Raise :class:`PipelineStopped` once the run stopped."""
        with self._cond:
            self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise PipelineStopped(f"the run stopped: {type(self._error).__name__}: {self._error}") from self._error
        if self._stopped:
            raise PipelineStopped("the run stopped")
