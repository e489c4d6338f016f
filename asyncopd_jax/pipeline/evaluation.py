"""Held-out evaluation in the background: a worker thread evaluates pinned copies of
policy versions while the learner goes on (``eval.mode: background``).

    learner ──(version v, a copy of its weights)──▶ BackgroundEval ──▶ EvalResult(v, accuracy)
                                                      one running, one waiting

The copy is what pins the version: the learner donates its buffers at the next step, so
the worker gets its own arrays of version ``v`` (a device-to-device copy, dispatched
asynchronously; a learner over several processes hands over the gathered host arrays).
Results come back in version order through :meth:`BackgroundEval.finished` (what is done,
without waiting) and :meth:`BackgroundEval.drain` (everything submitted), both on the
learner's thread, which writes them: the records of a run are written by one thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from asyncopd_jax.pipeline.trace import Tracer


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The held-out accuracy of policy ``version`` and the seconds it took to measure."""

    version: int
    accuracy: float
    seconds: float

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of a background evaluation (at the version's step)."""
        return {
            "step": self.version,
            "eval_accuracy": self.accuracy,
            "eval_seconds": self.seconds,
            "eval_version": self.version,
        }


class BackgroundEval:
    """Evaluates ``evaluate(params)`` of each submitted version on one worker thread.

    At most ``waiting`` submissions wait behind the one running: :meth:`submit` blocks
    (trace span ``wait_for_eval``) until the oldest is done, so an evaluation slower than
    ``eval_every`` steps of learning slows the learner instead of piling up copies of the
    weights. An evaluation that raised raises again from the next :meth:`finished` or
    :meth:`drain`."""

    def __init__(self, evaluate: Callable[[Any], float], tracer: Tracer, waiting: int = 1):
        self._evaluate, self._tracer, self._waiting = evaluate, tracer, waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-eval")
        self._pending: list[concurrent.futures.Future[EvalResult]] = []  # in version order

    def _run(self, version: int, params: Any) -> EvalResult:
        start = time.perf_counter()
        with self._tracer.span("background_eval", version=version):
            accuracy = self._evaluate(params)
        return EvalResult(version, float(accuracy), time.perf_counter() - start)

    def submit(self, version: int, params: Any) -> None:
        """Evaluate ``params`` (the worker's own copy of version ``version``)."""
        if len(self._pending) > self._waiting:
            with self._tracer.span("wait_for_eval", version=version):
                concurrent.futures.wait(self._pending[: len(self._pending) - self._waiting])
        self._pending.append(self._executor.submit(self._run, version, params))

    def finished(self) -> list[EvalResult]:
        """The results done so far, oldest first, each returned once (the oldest not yet
        done holds back the ones after it: results come in version order)."""
        out = []
        while self._pending and self._pending[0].done():
            out.append(self._pending.pop(0).result())
        return out

    def drain(self) -> list[EvalResult]:
        """Every submitted evaluation's result, waiting for those still running."""
        if self._pending:
            with self._tracer.span("wait_for_eval"):
                concurrent.futures.wait(self._pending)
        return self.finished()

    def close(self) -> None:
        """Drop what waits; an evaluation already running finishes on its thread."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
