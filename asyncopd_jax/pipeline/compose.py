"""What one process of the run holds, built in one place: the composition root.

:func:`build_process` makes, from the config, the typed
:class:`~asyncopd_jax.pipeline.layout.Layout` and a process's name, every stage the layout
puts in that process, on its own devices, and the weights channel's end it uses:

    the learner's process   the learner (and, in the leader, the scoring stage and the
                            rollout stages the layout puts there: ``threads``, ``fixed_lag``),
                            the writing end of the snapshot channel
    rollout-i, scoring-j    its rollout and / or scoring stage (``asyncopd stage``); a rollout
                            stage reads the snapshots on disk onto its own devices

The trainer (:class:`~asyncopd_jax.pipeline.trainer.Trainer`) and every stage process
(:mod:`asyncopd_jax.pipeline.stage_main`) call it, so a stage is built the same way
wherever the layout puts it. :func:`start_stages` then starts, in the learner's process,
the :class:`~asyncopd_jax.pipeline.placements.Stages` the learner takes its batches from.
(``asyncopd plan`` builds no models: it asks the same layout where each stage runs and
compiles the stages' functions on meshes made by the same
:func:`~asyncopd_jax.pipeline.devices.stage_mesh`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from asyncopd_jax.config import RunConfig
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.layout import LEARNER_PROCESS, Layout
from asyncopd_jax.pipeline.learner_stage import LearnerStage
from asyncopd_jax.pipeline.model_loading import sampler_graph
from asyncopd_jax.pipeline.placements import Stages
from asyncopd_jax.pipeline.placements.fixed_lag import FixedLagRollouts
from asyncopd_jax.pipeline.placements.multihost import FollowerStages, LeaderStages
from asyncopd_jax.pipeline.placements.stage_processes import StageProcesses
from asyncopd_jax.pipeline.placements.threads import RolloutPool
from asyncopd_jax.pipeline.rollout_stage import RolloutStage, build_rollout_stage
from asyncopd_jax.pipeline.run_models import RunModels, run_models
from asyncopd_jax.pipeline.scoring_stage import ScoringStage, build_scoring_stage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.pipeline.weights_channel import learner_snapshots, reader_snapshots, sampler_view


@dataclasses.dataclass
class RunProcess:
    """Every stage one process of the run holds (None / empty: the layout puts none here)."""

    cfg: RunConfig
    layout: Layout
    name: str  # the process: "learner", "rollout-0", "scoring-1", ...
    models: RunModels
    tracer: Tracer
    learner: LearnerStage | None
    scoring: ScoringStage | None
    rollouts: tuple[RolloutStage, ...]
    snapshots: SnapshotStore | None  # the learner's (writing) end of the weights channel
    leader: bool = True  # the learner's process 0 (the only one with a learner over one process)
    multi_process: bool = False  # the learner spans several processes


def build_process(
    cfg: RunConfig,
    layout: Layout,
    name: str,
    *,
    tracer: Tracer,
    leader: bool = True,
    multi_process: bool = False,
    models: RunModels | None = None,
) -> RunProcess:
    """The stages ``layout`` puts in process ``name``, built on their devices.

    ``leader`` / ``multi_process``: this is the learner's process 0 / the learner spans
    several processes (a follower holds the learner only: the leader's stages feed it)."""
    models = models or run_models(cfg)
    hosted = layout.hosted_by(name)
    learner = LearnerStage(cfg, layout, models, multi_process) if name == LEARNER_PROCESS else None
    scoring_plan = next((s for s in hosted if s.role == "scoring"), None)
    scoring = build_scoring_stage(cfg, layout, scoring_plan, models) if scoring_plan is not None and leader else None
    snapshots = learner_snapshots(cfg, layout, learner, leader) if learner is not None else None
    # the sampler's graph: the learner's own where it is here (unless the adapters are merged
    # at the swap: a plain model), else built from the student's config
    merged = cfg.student.lora.merged_at_swap
    graphdef = learner.graphdef if learner is not None and not merged else sampler_graph(cfg, models)
    rollouts = tuple(
        build_rollout_stage(
            cfg,
            layout,
            plan,
            models,
            snapshots=sampler_view(
                cfg,
                snapshots
                if layout.snapshots.in_memory and snapshots is not None
                else reader_snapshots(cfg, layout, plan, models),
            ),
            tracer=tracer,
            scoring=scoring,
            graphdef=graphdef,
            # fixed_lag samples whole batches from one policy: no weights swapped mid-group
            interruptible=cfg.schedule.mode != "fixed_lag",
        )
        for plan in hosted
        if plan.role == "rollout" and leader
    )
    return RunProcess(cfg, layout, name, models, tracer, learner, scoring, rollouts, snapshots, leader, multi_process)


def start_stages(
    process: RunProcess,
    buffer: StalenessBuffer,
    first_index: int,
    exchange: Exchange | None,
    unlearned: Sequence[int] | None = None,
) -> Stages:
    """In the learner's process: the rollout and scoring stages, started where the layout
    puts them (rollout threads, the ``fixed_lag`` schedule's on-demand batches, or stage
    processes, which meet the learner through ``exchange``; a follower learner process sees
    the leader's). ``first_index``, ``unlearned``: what a resumed run's checkpoint says of
    the groups started before it (``Stages.unlearned``)."""
    cfg, layout, learner = process.cfg, process.layout, process.learner
    assert learner is not None, "the stages are started from the learner's process"
    groups_per_batch = cfg.learner.batch_size // layout.group_size
    stages: Stages
    if not process.leader:
        if exchange is None:  # not reached: the config puts a learner over processes with stage processes
            raise RuntimeError("a follower learner process needs stage processes (stages.placement = processes)")
        return FollowerStages(exchange, groups_per_batch)
    if exchange is not None:
        stages = StageProcesses(
            cfg=cfg,
            layout=layout,
            exchange=exchange,
            buffer=buffer,
            first_index=first_index,
            tracer=process.tracer,
            unlearned=unlearned,
        )
    elif cfg.schedule.mode == "fixed_lag":  # whole batches from one policy, in this thread
        stages = FixedLagRollouts(stage=process.rollouts[0], lag=cfg.schedule.lag, first_version=learner.version)
    else:
        stages = RolloutPool(stages=list(process.rollouts), buffer=buffer, first_index=first_index)
    if process.multi_process:
        stages = LeaderStages(stages, groups_per_batch)
    stages.start()
    return stages
