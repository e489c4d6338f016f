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

import dataclasses
import threading
from collections.abc import Callable

import jax
import numpy as np

from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.config import RunConfig
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import ReferenceScorer, Scorers, TeacherScorer

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

    def __init__(self, *, sampler: Sampler, snapshots: SnapshotStore, prompts: PromptSource, reward: RewardStage,
                 group_size: int, seed: int, prompt_slots: int, tracer: Tracer, interruptible: bool = True):
        self.sampler, self.snapshots, self.prompts, self.reward = sampler, snapshots, prompts, reward
        self.group_size, self.seed, self.prompt_slots = group_size, seed, prompt_slots
        self.tracer, self.interruptible = tracer, interruptible

    def _newer_snapshot(self, version: int):
        latest = self.snapshots.latest_version()
        if latest is not None and latest > version:
            with self.tracer.span("swap_weights", version=latest):
                return self.snapshots.load()
        return None

    def sample(self, index: int, version: int | None = None) -> RolloutGroup:
        """Sample group ``index`` from snapshot ``version`` (default: the newest); no
        teacher scores yet."""
        rng = np.random.default_rng([self.seed, index])
        prompts, problems = self.prompts(rng, self.reward.prompts_per_group(self.group_size))
        prompts, problems = self.reward.repeat(prompts), self.reward.repeat(problems)
        version, params = self.snapshots.load(version)
        with self.tracer.span("rollout", version=version) as info:
            batch = self.sampler.generate(
                params, prompts, group_key(self.seed, index), version=version, prompt_slots=self.prompt_slots,
                weight_source=self._newer_snapshot if self.interruptible else None,
            )
            jax.block_until_ready(batch.response_tokens)
            lengths = np.asarray(batch.response_mask).sum(axis=1)
            # decoding runs until the longest row is done: its cost follows ``longest``
            info.update(rows=int(lengths.size), tokens=int(lengths.sum()), longest=int(lengths.max(initial=0)))
        versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
        oldest = int(versions.min()) if versions.size else version
        newest = int(versions.max()) if versions.size else version
        with self.tracer.span("reward"):
            batch, rewards = self.reward(problems, batch)
        return RolloutGroup(batch, None, oldest, newest, {"rewards": rewards})


def make_scorers(cfg: RunConfig, teacher: Decoder | None, vocab_limit: int | None) -> Scorers | None:
    """The scoring stage's work for this run, wherever it runs (a thread or a stage process):
    the teacher's scores where the run needs them, and the reference policy's log-probs
    where the loss has a KL-to-reference term (the reference loaded here, from
    ``reference.path`` or else the student's starting weights). None: nothing to score."""
    teacher_scorer = TeacherScorer(teacher, cfg.scoring) if cfg.needs_teacher_scores else None
    reference = None
    if cfg.estimator.needs_reference_logp:
        model = from_pretrained(resolve_model_path(cfg.reference.path or cfg.student.path), dtype=cfg.reference.dtype)
        model.vocab_limit = vocab_limit
        reference = ReferenceScorer(model, cfg.sampling.temperature, cfg.learner.logprob_chunk)
    return None if teacher_scorer is None and reference is None else Scorers(teacher_scorer, reference)


def score_group(scorers: Scorers | None, group: RolloutGroup, seed: int, index: int,
                tracer: Tracer) -> RolloutGroup:
    """``group`` with its teacher score cache (and its reference log-probs) filled in;
    unchanged when ``scorers`` is None (reward-driven RL without distillation or a
    reference needs no scores)."""
    if scorers is None:
        return group
    with tracer.span("score"):
        batch, cache = jax.block_until_ready(
            scorers.score(group.batch, jax.random.fold_in(group_key(seed, index), 1)))
    return dataclasses.replace(group, batch=batch, cache=cache)


class RolloutPool:
    """``workers`` threads producing scored :class:`RolloutGroup` s of ``group_size`` prompts."""

    def __init__(self, *, producer: GroupProducer, scorer: Scorers | None, buffer: StalenessBuffer, workers: int,
                 first_index: int = 0):
        self.producer, self.scorer, self.buffer = producer, scorer, buffer
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"rollout-{i}", daemon=True)
                         for i in range(workers)]
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
        """Index of the next rollout group (groups are numbered from the run's start)."""
        with self._lock:
            return self._counter

    def _next_index(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """Nothing to do: groups never leave this process."""

    def checkpointed(self) -> None:
        """Nothing to do: groups never leave this process."""

    def _run(self, worker: int) -> None:
        size = self.producer.group_size
        try:
            while True:
                self.buffer.acquire(size)
                index = self._next_index()
                try:
                    group = self.producer.sample(index)
                    group = score_group(self.scorer, group, self.producer.seed, index, self.producer.tracer)
                except BaseException:
                    self.buffer.release(size)
                    raise
                self.buffer.put(group)
        except PipelineStopped:
            return
        except BaseException as err:  # noqa: BLE001 - forwarded to the learner
            self.buffer.fail(err)
