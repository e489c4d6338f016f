"""The stages as the processes of a multi-process learner see them.

A learner over several processes or hosts (:mod:`asyncopd_jax.learner.distributed`) runs
one trainer per process. Process 0, the *leader*, owns the staleness buffer and the stage
processes; at every rollout batch it broadcasts the numbers of the spool records it took,
with a fingerprint of each, and every other process (a *follower*) reads the same records
from the run's exchange directory and checks the fingerprints (a stale read of shared
storage fails loudly instead of training on other rows). Numbers −1: the leader stopped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from asyncopd_jax.learner import distributed
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.placements import Stages
from asyncopd_jax.pipeline.spool import group_from_record
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup


def fingerprint(group: RolloutGroup) -> int:
    """A position-weighted checksum of a group's response tokens and versions."""
    values = np.concatenate(
        [np.asarray(group.batch.response_tokens).ravel(), np.asarray(group.batch.token_version).ravel()]
    ).astype(np.int64)
    return int(np.sum(values * (np.arange(values.size) % 9973 + 1)))


class LeaderStages:
    """The leader's stages: takes each batch from ``stages`` and tells the followers which."""

    def __init__(self, stages: Stages, groups_per_batch: int):
        self.stages, self.groups_per_batch = stages, groups_per_batch

    def take(self, version: int) -> list[RolloutGroup]:
        try:
            groups = self.stages.take(version)
        except PipelineStopped:
            distributed.from_leader(np.full((self.groups_per_batch, 2), -1, np.int64))  # the others stop too
            raise
        # every group of a learner over processes was read from a spool record (stage processes)
        records = [int(g.record) for g in groups if g.record is not None]
        if len(records) != len(groups):  # not reached: the config puts such a learner with stage processes
            raise RuntimeError("a learner over several processes takes its groups from the spool's records")
        distributed.from_leader(np.asarray([(r, fingerprint(g)) for r, g in zip(records, groups)], np.int64))
        return groups

    @property
    def groups_started(self) -> int:
        return self.stages.groups_started

    def start(self) -> None:
        self.stages.start()

    def consumed(self, taken: list[RolloutGroup]) -> None:
        self.stages.consumed(taken)

    def unlearned(self) -> list[int]:
        return self.stages.unlearned()

    def checkpointed(self) -> None:
        self.stages.checkpointed()

    def join(self, timeout: float = 60.0) -> None:
        self.stages.join(timeout)

    def trace_files(self) -> list[Path]:
        return self.stages.trace_files()


class FollowerStages:
    """A follower's stages: not its business (the leader starts and feeds them); it reads
    the records the leader names."""

    groups_started = 0

    def __init__(self, exchange: Exchange, groups_per_batch: int):
        self.exchange, self.groups_per_batch = exchange, groups_per_batch

    def take(self, version: int) -> list[RolloutGroup]:
        named = distributed.from_leader(np.full((self.groups_per_batch, 2), -1, np.int64))
        if (named[:, 0] < 0).any():
            raise PipelineStopped("the leader learner process stopped the run (its log has the cause)")
        scored = self.exchange.scored
        groups = [group_from_record(_read(scored, f"{n:010d}"))[0] for n in named[:, 0]]
        for group, (number, expected) in zip(groups, named):
            if fingerprint(group) != expected:
                raise RuntimeError(
                    f"rollout record {number:010d} in {scored.url} differs from the one the leader "
                    "trains on: is the run directory on storage every host sees consistently?"
                )
        return groups

    def start(self) -> None:
        pass

    def consumed(self, taken: list[RolloutGroup]) -> None:
        pass

    def unlearned(self) -> list[int]:
        return []  # the leader's checkpoint meta is the one that counts

    def checkpointed(self) -> None:
        pass

    def join(self, timeout: float = 60.0) -> None:
        pass

    def trace_files(self) -> list[Path]:
        return []


def _read(scored, name: str) -> dict:
    """The scored record the leader named; it exists until the leader checkpoints past it."""
    arrays = scored.read(name)
    if arrays is None:
        raise RuntimeError(
            f"rollout record {name} is not in {scored.url}: is the run directory on storage every host sees?"
        )
    return arrays
