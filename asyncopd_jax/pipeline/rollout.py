"""Rollout workers: host threads that sample from the newest snapshot and get teacher scores.

Each worker loops: wait for capacity (:class:`StalenessBuffer`), load the newest policy
snapshot, sample a group of prompts (interruptible: between decode chunks it swaps in a
newer snapshot if one was published), score the group with the teacher, and hand it to
the buffer. A worker that raises stops the whole run: the error is recorded in the
buffer, every waiting thread wakes up, and the learner re-raises it.

On one host all workers and the learner share the devices; JAX releases the GIL while
a jitted computation runs, so sampling, scoring and learning overlap on separate cores
(CPU) or as concurrent streams (GPU). See the README for placement on a TPU pod.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax
import numpy as np

from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.teacher import TeacherScorer

# (rng, n) → (prompt token lists, per-prompt metadata for metrics)
PromptSource = Callable[[np.random.Generator, int], tuple[list[list[int]], list]]


class RolloutPool:
    """``workers`` threads producing :class:`RolloutGroup` s of ``group_size`` prompts."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        scorer: TeacherScorer,
        snapshots: SnapshotStore,
        buffer: StalenessBuffer,
        prompts: PromptSource,
        group_size: int,
        workers: int,
        seed: int,
        prompt_slots: int,
        tracer: Tracer,
        interruptible: bool = True,
    ):
        self.sampler, self.scorer, self.snapshots, self.buffer = sampler, scorer, snapshots, buffer
        self.prompts, self.group_size, self.prompt_slots = prompts, group_size, prompt_slots
        self.seed, self.tracer, self.interruptible = seed, tracer, interruptible
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"rollout-{i}", daemon=True)
                         for i in range(workers)]
        self._counter = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 60.0) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def groups_started(self) -> int:
        """Rollout groups started so far (each seeds its prompts and sampling keys)."""
        with self._lock:
            return self._counter

    def _next_index(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def _newer_snapshot(self, version: int):
        latest = self.snapshots.latest_version()
        if latest is not None and latest > version:
            with self.tracer.span("swap_weights", version=latest):
                return self.snapshots.load()
        return None

    def _run(self, worker: int) -> None:
        try:
            while True:
                self.buffer.acquire(self.group_size)
                index = self._next_index()
                try:
                    rng = np.random.default_rng([self.seed, index])
                    prompts, meta = self.prompts(rng, self.group_size)
                    version, params = self.snapshots.load()
                    key = jax.random.key(hash((self.seed, index)) % (2**31))
                    with self.tracer.span("rollout", version=version):
                        batch = self.sampler.generate(
                            params, prompts, key, version=version, prompt_slots=self.prompt_slots,
                            weight_source=self._newer_snapshot if self.interruptible else None,
                        )
                        jax.block_until_ready(batch.response_tokens)
                    with self.tracer.span("score"):
                        cache = jax.block_until_ready(self.scorer.score(batch, jax.random.fold_in(key, 1)))
                except BaseException:
                    self.buffer.release(self.group_size)
                    raise
                versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
                oldest = int(versions.min()) if versions.size else version
                newest = int(versions.max()) if versions.size else version
                self.buffer.put(RolloutGroup(batch, cache, oldest, newest, {"problems": meta}))
        except PipelineStopped:
            return
        except BaseException as err:  # noqa: BLE001 - forwarded to the learner
            self.buffer.fail(err)
