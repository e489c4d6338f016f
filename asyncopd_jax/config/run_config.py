"""The whole run's configuration (:class:`RunConfig`): its sections, what it derives from
them (η, the teachers, the stage counts), checked across sections as it is built
(:mod:`asyncopd_jax.config.rules`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncopd_jax.config.rules import validate
from asyncopd_jax.config.sections import (
    DistributedConfig,
    EnvironmentConfig,
    EvalConfig,
    LearnerConfig,
    LoggingConfig,
    ModelSource,
    OptimConfig,
    RLConfig,
    ScheduleConfig,
    StagesConfig,
    StudentSource,
    TaskConfig,
    TeacherSource,
    TrainConfig,
)
from asyncopd_jax.config_checks import StorageLocation
from asyncopd_jax.estimator_registry import EstimatorConfig
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.teacher.routing import RoutingParams
from asyncopd_jax.teacher.scorer import ScoringParams


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    output_dir: StorageLocation = "runs"  # a directory, or gs://BUCKET/PREFIX, s3://BUCKET/PREFIX
    seed: int = 0
    # "opd": distil from the teacher's scores (the estimator is a KL estimator);
    # "rl": reinforce from the task's rewards (see RLConfig; the estimator is a stabiliser).
    algorithm: Literal["opd", "rl"] = "opd"
    task: TaskConfig = TaskConfig()
    student: StudentSource = StudentSource()
    teacher: TeacherSource = TeacherSource()
    # several teachers (each a `teacher` section with its own `name`), instead of `teacher`;
    # each prompt is scored by one of them, picked as `routing` says
    teachers: tuple[TeacherSource, ...] = ()
    routing: RoutingParams = RoutingParams()
    # π_ref of estimator.regularisers.reference_kl_coef (scored by the scoring stage); path '':
    # the student's starting weights
    reference: ModelSource = ModelSource()
    sampling: SamplingParams = SamplingParams(max_new_tokens=32, num_candidates=4, chunk_steps=8)
    scoring: ScoringParams = ScoringParams(chunk_size=64)
    environment: EnvironmentConfig = EnvironmentConfig()  # a multi-turn task's tools
    estimator: EstimatorConfig = EstimatorConfig()
    optim: OptimConfig = OptimConfig()
    learner: LearnerConfig = LearnerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    stages: StagesConfig = StagesConfig()
    distributed: DistributedConfig = DistributedConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    rl: RLConfig = RLConfig()

    def __post_init__(self) -> None:
        validate(self)

    @property
    def eta(self) -> int:
        """The staleness bound η in optimizer steps: 0 for ``sync``; for ``n_step_off``
        rollouts run ``schedule.n_step`` batches (of ``learner.mini_batches`` steps) ahead;
        ``schedule.lag`` for ``fixed_lag``; else ``schedule.max_staleness``."""
        schedule = self.schedule
        if schedule.mode == "sync":
            return 0
        if schedule.mode == "n_step_off":
            return schedule.n_step * self.learner.mini_batches
        if schedule.mode == "fixed_lag":
            return schedule.lag
        return schedule.max_staleness

    @property
    def needs_teacher_scores(self) -> bool:
        """Whether rollouts are scored by the teacher: the estimator's spec says (all but
        an advantage estimator in RL with ``rl.distill_coef = 0``)."""
        return self.estimator.spec.needs_teacher_scores(rl=self.algorithm == "rl", distill_coef=self.rl.distill_coef)

    @property
    def teacher_sources(self) -> tuple[TeacherSource, ...]:
        """The run's teachers: ``teachers``, else ``teacher`` when it is set (else none).
        A row's teacher index in a :class:`~asyncopd_jax.teacher.routing.TeacherRoute`
        counts in this order."""
        return self.teachers or ((self.teacher,) if self.teacher.given else ())

    @property
    def in_process_teacher(self) -> TeacherSource | None:
        """The one teacher a whole-vocabulary probe reads (diagnostics, the extrapolation
        probe): the run's only teacher when it runs in-process, else None."""
        sources = self.teacher_sources
        return sources[0] if len(sources) == 1 and sources[0].path else None

    @property
    def needs_scoring(self) -> bool:
        """Whether rollouts go through a scoring stage: teacher scores, or reference log-probs
        for a KL-to-reference term."""
        return self.needs_teacher_scores or self.estimator.needs_reference_logp

    @property
    def samples_per_prompt(self) -> int:
        """Answers sampled per prompt: G in RL, 1 in distillation."""
        return self.rl.samples_per_prompt if self.algorithm == "rl" else 1

    @property
    def rollout_stages(self) -> int:
        """Rollout stages (``stages.rollouts``); one for ``fixed_lag``, which samples in the
        learner's own thread."""
        return 1 if self.schedule.mode == "fixed_lag" else self.stages.rollouts

    @property
    def published_dtype(self) -> str:
        """The dtype of the policy's weights as the samplers receive them
        (``stages.snapshot_dtype``; auto: ``student.dtype``)."""
        return self.student.dtype if self.stages.snapshot_dtype == "auto" else self.stages.snapshot_dtype

    @property
    def dropout_seed(self) -> int | None:
        """The seed of the LoRA adapters' dropout masks in the learner's forward (None: no
        dropout; :func:`asyncopd_jax.learner.step.dropout_key`)."""
        lora = self.student.lora
        return self.seed if lora.enabled and lora.dropout else None

    @property
    def group_size(self) -> int:
        """Samples per rollout group: the batch split over the rollout stages (the whole
        batch per group when it does not split evenly)."""
        batch, stages = self.learner.batch_size, self.rollout_stages
        return batch // stages if batch % stages == 0 else batch
