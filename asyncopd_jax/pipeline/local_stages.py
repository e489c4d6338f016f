"""The stages as the learner's process starts them, wherever the layout puts them.

:class:`LocalStages` makes the weights channel and the rollout / scoring stages of one run
for the learner: rollout threads (:class:`~asyncopd_jax.pipeline.rollout.RolloutPool`),
the ``fixed_lag`` schedule's on-demand stage, stage processes
(:class:`~asyncopd_jax.pipeline.stage_processes.StageProcesses`), or, in a learner process
other than the leader, a view of the leader's (:mod:`asyncopd_jax.pipeline.multihost`).
Every rollout stage in this process is built by
:func:`~asyncopd_jax.pipeline.stage.build_rollout_stage`, as in a stage process.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax

from asyncopd_jax.config import RunConfig
from asyncopd_jax.learner import distributed, state_shardings
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.fixed_lag import FixedLagRollouts
from asyncopd_jax.pipeline.learner_stage import LearnerStage
from asyncopd_jax.pipeline.multihost import FollowerStages, LeaderStages
from asyncopd_jax.pipeline.placement import Layout, StagePlan
from asyncopd_jax.pipeline.rollout import RolloutPool, Stages
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore, InMemorySnapshotStore, SnapshotStore
from asyncopd_jax.pipeline.stage import (
    RolloutStage,
    RunModels,
    ScoringStage,
    build_rollout_stage,
    rollout_shardings,
    with_shardings,
)
from asyncopd_jax.pipeline.stage_processes import StageProcesses
from asyncopd_jax.pipeline.staleness import StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer


@dataclasses.dataclass
class LocalStages:
    """What the learner's process needs to start the run's other stages."""

    cfg: RunConfig
    layout: Layout
    models: RunModels
    learner: LearnerStage
    scoring: ScoringStage | None  # the scoring stage in this process, if the layout puts one here
    tracer: Tracer
    run_path: Path
    leader: bool
    multi_process: bool

    @property
    def learner_devices(self) -> list[jax.Device]:
        return list(self.learner.mesh.devices.flat)

    def snapshot_store(self) -> SnapshotStore:
        """The learner's end of the weights channel."""
        channel, params = self.layout.snapshots, self.learner.state.params
        if channel.in_memory:  # handed to the rollout threads by a device-to-device copy onto their devices
            rollout = self.layout.of_role("rollout")[0]
            return InMemorySnapshotStore(
                keep=channel.keep,
                shardings=rollout_shardings(self.cfg, self.layout, rollout, params, self.learner_devices),
            )
        # Versions left by an earlier incarnation of this run may be newer than the restored
        # policy; rollouts from them would be refused as "future". The learner is the only
        # writer and no reader runs yet, so start from an empty directory.
        if self.leader:
            shutil.rmtree(channel.directory, ignore_errors=True)
        distributed.barrier("snapshot directory emptied")
        abstract = with_shardings(params, state_shardings(params, self.learner.mesh))
        return DiskSnapshotStore(channel.directory, abstract, keep=channel.keep, format=channel.format)

    def rollout_stage(self, plan: StagePlan, snapshots: SnapshotStore) -> RolloutStage:
        """A rollout stage in this process: its weights from ``snapshots`` (in memory), or
        read from the snapshots on disk onto its own devices."""
        if not self.layout.snapshots.in_memory:
            params = self.learner.state.params
            shardings = rollout_shardings(self.cfg, self.layout, plan, params, self.learner_devices)
            snapshots = DiskSnapshotStore(
                self.layout.snapshots.directory,
                with_shardings(params, shardings),
                read_only=True,
                format=self.layout.snapshots.format,
            )
        return build_rollout_stage(
            self.cfg,
            self.layout,
            plan,
            self.models,
            snapshots=snapshots,
            tracer=self.tracer,
            scoring=self.scoring,
            graphdef=self.learner.graphdef,
            default_devices=self.learner_devices,
            interruptible=self.cfg.schedule.mode != "fixed_lag",
        )

    def start(self, buffer: StalenessBuffer, snapshots: SnapshotStore, first_index: int) -> Stages:
        """The rollout and scoring stages, started where the layout puts them."""
        cfg, layout = self.cfg, self.layout
        groups_per_batch = cfg.learner.batch_size // layout.group_size
        exchange = Exchange(self.run_path / "exchange") if layout.stage_processes() else None
        stages: Stages
        if not self.leader:
            if exchange is None:  # not reached: the config puts a learner over processes with stage processes
                raise RuntimeError("a follower learner process needs stage processes (stages.placement = processes)")
            return FollowerStages(exchange, groups_per_batch)
        if exchange is not None:
            stages = StageProcesses(
                cfg=cfg, layout=layout, exchange=exchange, buffer=buffer, first_index=first_index, tracer=self.tracer
            )
        elif cfg.schedule.mode == "fixed_lag":  # whole batches from one policy, in this thread
            rollout = self.rollout_stage(layout.of_role("rollout")[0], snapshots)
            stages = FixedLagRollouts(stage=rollout, lag=cfg.schedule.lag, first_version=self.learner.version)
        else:
            rollouts = [self.rollout_stage(plan, snapshots) for plan in layout.of_role("rollout")]
            stages = RolloutPool(stages=rollouts, buffer=buffer, first_index=first_index)
        if self.multi_process:
            stages = LeaderStages(stages, groups_per_batch)
        stages.start()
        return stages
