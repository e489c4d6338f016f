"""Environment steps on a worker pool, off the decode loop.

The rollout submits a slot's turn (:meth:`EnvironmentPool.submit`) and keeps decoding the
other slots; each time round it collects the observations that are ready
(:meth:`EnvironmentPool.ready`, never blocking), or waits for one when every slot is waiting
(:meth:`EnvironmentPool.wait`). Whatever a step does, its slot gets an :class:`Observation`:

* an exception becomes an observation whose ``error`` (and text) names it;
* a step still running ``timeout_s`` after it was submitted is answered with a timeout
  observation (its thread runs on to its end, unseen: a tool that must be stopped runs in a
  process with its own limits, as the Python sandbox does);
* text or ids past ``max_output`` characters or ids are cut there, ``error`` saying so.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable

from asyncopd_jax.environments.protocol import Environment, Observation


@dataclasses.dataclass
class _Step:
    future: concurrent.futures.Future
    deadline: float


class EnvironmentPool:
    """Runs environment steps on ``workers`` threads (module docstring).

    Args:
      workers: steps run at once.
      timeout_s: seconds a step may take before its slot is answered with a timeout.
      max_output: the most characters (or ids) an observation keeps.
      clock: the time deadlines are measured by (tests pass a fake).
    """

    def __init__(
        self,
        workers: int = 8,
        timeout_s: float = 30.0,
        max_output: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        if workers < 1 or not timeout_s > 0 or max_output < 1:
            raise ValueError(f"workers {workers}, timeout_s {timeout_s}, max_output {max_output}: each must be > 0")
        self.timeout_s, self.max_output, self._clock = timeout_s, max_output, clock
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="environment")
        self._steps: dict[Hashable, _Step] = {}
        self._done = threading.Condition()

    @property
    def pending(self) -> int:
        """Steps submitted and not yet collected."""
        return len(self._steps)

    def submit(self, key: Hashable, environment: Environment, turn: str) -> None:
        """Run ``environment.step(turn)`` for slot ``key`` (one step a key at a time)."""
        if key in self._steps:
            raise ValueError(f"slot {key!r} already has a step running")
        future = self._executor.submit(self._run, environment, turn)
        future.add_done_callback(lambda _: self._notify())
        self._steps[key] = _Step(future, self._clock() + self.timeout_s)

    def ready(self) -> list[tuple[Hashable, Observation]]:
        """The observations of the steps that have ended or timed out, collected (no wait)."""
        now, out = self._clock(), []
        for key, step in list(self._steps.items()):
            if step.future.done():
                out.append((key, step.future.result()))
            elif now >= step.deadline:
                step.future.cancel()
                message = f"the environment did not answer within {self.timeout_s:g} s"
                out.append((key, Observation(text=f"error: {message}", error=message)))
            else:
                continue
            del self._steps[key]
        return out

    def wait(self, timeout: float | None = None) -> list[tuple[Hashable, Observation]]:
        """:meth:`ready`, after waiting until at least one step has ended or timed out (or
        ``timeout`` seconds, or nothing is pending)."""
        end = None if timeout is None else self._clock() + timeout
        with self._done:
            while self._steps:
                got = self.ready()
                if got:
                    return got
                deadlines = [step.deadline for step in self._steps.values()] + ([end] if end is not None else [])
                left = min(deadlines) - self._clock()
                if end is not None and self._clock() >= end:
                    return []
                self._done.wait(max(left, 0.0) + 1e-3)
        return []

    def close(self) -> None:
        """Stop taking steps; those running end on their own threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _notify(self) -> None:
        with self._done:
            self._done.notify_all()

    def _run(self, environment: Environment, turn: str) -> Observation:
        try:
            observation = environment.step(turn)
        except Exception as err:  # noqa: BLE001 - any tool failure is the student's observation
            message = f"{type(err).__name__}: {err}"
            return Observation(text=f"error: {message}", error=message)
        return self._bounded(observation)

    def _bounded(self, observation: Observation) -> Observation:
        size = len(observation.text) if observation.text is not None else len(observation.ids or ())
        if size <= self.max_output:
            return observation
        unit = "characters" if observation.text is not None else "ids"
        message = f"the output has {size} {unit}; kept the first {self.max_output}"
        if observation.text is not None:
            return dataclasses.replace(observation, text=observation.text[: self.max_output], error=message)
        return dataclasses.replace(observation, ids=tuple(observation.ids or ())[: self.max_output], error=message)
