"""The rollout stage: a sampler whose weights arrive on the stage's own mesh (from the
snapshot channel), the task's prompts and reward, and the scoring stage that shares its
process (if any). :func:`build_rollout_stage` builds it the same in a thread of the
learner's process, a stage process, or the ``fixed_lag`` schedule's learner thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from asyncopd_jax.config import RunConfig
from asyncopd_jax.environments.latency import delayed
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.models.partitioning import parameter_shardings
from asyncopd_jax.pipeline.devices import stage_devices, stage_mesh
from asyncopd_jax.pipeline.layout import Layout, StagePlan
from asyncopd_jax.pipeline.producer import GroupProducer
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.scoring_stage import ScoringStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import make_sampler


@dataclasses.dataclass
class RolloutStage:
    """Samples rollout group ``index`` on the stage's mesh and scores it when a scoring
    stage shares its process (else the group goes to one that does)."""

    plan: StagePlan
    mesh: Mesh
    producer: GroupProducer
    scoring: ScoringStage | None

    def group(self, index: int, version: int | None = None, min_version: int = 0) -> RolloutGroup:
        """Group ``index`` from policy ``version`` (default: the newest, ``min_version`` or
        newer), scored when a scoring stage shares this process."""
        return self.scored(self.producer.sample(index, version, min_version), index)

    def scored(self, group: RolloutGroup, index: int) -> RolloutGroup:
        """Sampled group ``index``, scored when a scoring stage shares this process."""
        if self.scoring is None:
            return group
        return self.scoring.score(group, self.producer.seed, index, self.producer.tracer)


def build_rollout_stage(
    cfg: RunConfig,
    layout: Layout,
    plan: StagePlan,
    models: RunModels,
    *,
    snapshots: SnapshotStore,
    tracer: Tracer,
    scoring: ScoringStage | None,
    graphdef: nnx.GraphDef,
    interruptible: bool = True,
) -> RolloutStage:
    """The rollout stage ``plan``; ``snapshots`` delivers the policy's weights onto its mesh
    (:func:`rollout_shardings`)."""
    mesh = stage_mesh(stage_devices(layout, plan), cfg.stages.rollout_mesh)
    task, multi_turn = models.task, bool(models.sampling.tool_call_ids)
    env = cfg.environment
    pool = EnvironmentPool(env.workers, env.timeout_s, env.max_output) if multi_turn else None
    producer = GroupProducer(
        sampler=make_sampler(graphdef, models.sampling, pad_id=models.task.pad_id, mesh=mesh),
        snapshots=snapshots,
        prompts=models.task.train_prompts,
        reward=RewardStage.from_config(cfg, models.task.rewards),
        group_size=layout.group_size,
        seed=layout.seed,
        prompt_slots=models.task.prompt_slots,
        tracer=tracer,
        interruptible=interruptible,
        version_timeout=cfg.stages.startup_timeout,
        router=models.router if cfg.needs_teacher_scores else None,
        turns=task.turns(pool) if pool is not None else None,
        environment=delayed(task.environment, env.latency, layout.seed) if multi_turn else None,
    )
    return RolloutStage(plan, mesh, producer, scoring)


def rollout_shardings(
    cfg: RunConfig,
    layout: Layout,
    plan: StagePlan,
    abstract_params: Any,
) -> Any:
    """The shardings the rollout stage ``plan`` reads the policy's weights into."""
    mesh = stage_mesh(stage_devices(layout, plan), cfg.stages.rollout_mesh)
    return parameter_shardings(abstract_params, mesh)
