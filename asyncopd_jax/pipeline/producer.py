"""One rollout group's work, wherever it runs (a rollout thread, a stage process, the
``fixed_lag`` schedule's learner thread): its prompts, its keys, its policy snapshot, its
rewards.

Group ``index`` draws its prompts from ``rng([seed, index])`` and its sampling key from
:func:`group_key`, so the same index gives the same prompts and answers in every
placement and with either sampling engine (prompt i of a group samples with
``fold_in(group_key, i)``, whatever its row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.environments.protocol import Environment
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import Engine, RolloutStream, prompt_keys, run_stream
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.teacher.routing import Router, TeacherRoute

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
        sampler: Engine,
        snapshots: SnapshotStore,
        prompts: PromptSource,
        reward: RewardStage,
        group_size: int,
        seed: int,
        prompt_slots: int,
        tracer: Tracer,
        interruptible: bool = True,
        version_timeout: float = 600.0,
        router: Router | None = None,
        turns: Turns | None = None,
        environment: Callable[[Any], Environment] | None = None,
    ):
        self.sampler, self.snapshots, self.prompts, self.reward = sampler, snapshots, prompts, reward
        self.group_size, self.seed, self.prompt_slots = group_size, seed, prompt_slots
        self.tracer, self.interruptible = tracer, interruptible
        self.version_timeout = version_timeout  # how long a group waits for the version it must start from
        self.router = router  # which teacher scores each prompt (None: no teacher scores)
        self.last_load: tuple[int, float] | None = None  # the version loaded last, and the seconds it took
        # a multi-turn task's: how its turns convert and run, and a problem's environment
        self.turns, self.environment = turns, environment

    def environments(self, problems: list) -> list[Environment] | None:
        """Each problem's environment, fresh (None: single-turn)."""
        return None if self.environment is None else [self.environment(p) for p in problems]

    def open_stream(self, state: Any, version: int) -> RolloutStream:
        """A stream of this producer's engine, sampling with ``state`` (policy ``version``)."""
        engine = self.sampler
        return engine.open_stream(
            state,
            version=version,
            prompt_slots=self.prompt_slots,
            slots=engine.decode_rows(self.group_size),
            turns=self.turns,
        )

    def newer_snapshot(self, version: int):
        """The newest snapshot as ``(version, weights)`` when it is newer than ``version``."""
        latest = self.snapshots.latest_version()
        if latest is not None and latest > version:
            return self.load_snapshot()
        return None

    def load_snapshot(self):
        """The newest snapshot as ``(version, weights)``, its load timed (``last_load``)."""
        start = time.perf_counter()
        with self.tracer.span("swap_weights", version=self.snapshots.latest_version()):
            loaded = self.snapshots.load()
        self.last_load = (loaded[0], time.perf_counter() - start)
        return loaded

    def prompts_of(self, index: int) -> tuple[list[list[int]], list, TeacherRoute | None]:
        """Group ``index``'s prompts (each repeated ``samples_per_prompt`` times), the
        problems the reward checks them against, and the teachers' route (None: the only
        teacher scores every row under the student's prompt)."""
        rng = np.random.default_rng([self.seed, index])
        prompts, problems = self.prompts(rng, self.reward.prompts_per_group(self.group_size))
        route = None
        if self.router is not None:  # its own generator: the prompts drawn stay those of a one-teacher run
            draw = np.random.default_rng([self.seed, index, 1])
            route = self.router.route(problems, prompts, draw, copies=self.reward.samples_per_prompt)
        return self.reward.repeat(prompts), self.reward.repeat(problems), route

    def sample(self, index: int, version: int | None = None, min_version: int = 0) -> RolloutGroup:
        """Sample group ``index`` from snapshot ``version`` (default: the newest, once it is
        ``min_version`` or newer); no teacher scores yet."""
        if version is None and min_version:
            with self.tracer.span("wait_for_version", version=min_version):
                self.snapshots.wait_for(min_version, timeout=self.version_timeout)
        prompts, problems, route = self.prompts_of(index)
        version, params = self.snapshots.load(version)
        with self.tracer.span("rollout", version=version) as info:
            stream = self.open_stream(params, version)
            keys = prompt_keys(group_key(self.seed, index), len(prompts))
            stream.submit(None, prompts, keys, self.environments(problems))
            ((_, batch),) = run_stream(stream, self.newer_snapshot if self.interruptible else None)
            jax.block_until_ready(batch.response_tokens)
            info.update(answer_lengths(batch))
        return self.finish(batch, problems, version, route)

    def finish(self, batch: RolloutBatch, problems: list, version: int, route: TeacherRoute | None) -> RolloutGroup:
        """A sampled group's rewards and version span (``version``: where it started, the
        span of a group with no answer token), with its teachers' ``route``."""
        versions = np.asarray(batch.token_version)[np.asarray(batch.response_mask)]
        oldest = int(versions.min()) if versions.size else version
        newest = int(versions.max()) if versions.size else version
        with self.tracer.span("reward"):
            batch, rewards = self.reward(problems, batch)
        return RolloutGroup(batch, None, oldest, newest, rewards=rewards, route=route, last_load=self.last_load)


def answer_lengths(batch: RolloutBatch) -> dict[str, int]:
    """What a ``rollout`` span records of a group: its rows, answer tokens and longest
    answer (a lockstep batch decodes until the longest ends: its cost follows ``longest``)."""
    lengths = np.asarray(batch.response_mask).sum(axis=1)
    return dict(rows=int(lengths.size), tokens=int(lengths.sum()), longest=int(lengths.max(initial=0)))
