"""Typed, validated run configuration: frozen dataclasses ⇄ YAML, with ``a.b=c`` overrides.

Every field is checked up front, when its section is built (:mod:`.sections`): an unknown
field names itself and the allowed fields, a bad value names the field and the allowed
values. :class:`RunConfig` (:mod:`.run_config`) checks what spans sections
(:mod:`.rules`), asking the estimator's spec what the run must produce; :mod:`.loading`
reads and writes YAML. There are no silent fallbacks, and nothing that depends only on the
config is left for the run to find.
"""

from asyncopd_jax.config.loading import (
    MOVED,
    SAFE_ON_RESUME,
    apply_overrides,
    check_resume_changes,
    config_yaml,
    flatten,
    load_config,
    migrate_saved_config,
    save_config,
    to_dict,
    with_overrides,
)
from asyncopd_jax.config.rules import check_learner_processes
from asyncopd_jax.config.run_config import RunConfig
from asyncopd_jax.config.sections import (
    TEACHER_NAME,
    DistributedConfig,
    EnvironmentConfig,
    EvalConfig,
    ExtrapolationConfig,
    LearnerConfig,
    LoggingConfig,
    MeshConfig,
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
from asyncopd_jax.config_checks import ConfigError, IdList
from asyncopd_jax.estimator_registry import EstimatorConfig  # the estimator: section (its knobs sit beside the table)

__all__ = [
    "MOVED",
    "SAFE_ON_RESUME",
    "TEACHER_NAME",
    "ConfigError",
    "DistributedConfig",
    "EstimatorConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "ExtrapolationConfig",
    "IdList",
    "LearnerConfig",
    "MeshConfig",
    "ModelSource",
    "StudentSource",
    "OptimConfig",
    "RLConfig",
    "RunConfig",
    "ScheduleConfig",
    "StagesConfig",
    "TaskConfig",
    "TeacherSource",
    "LoggingConfig",
    "TrainConfig",
    "apply_overrides",
    "check_learner_processes",
    "check_resume_changes",
    "load_config",
    "migrate_saved_config",
    "config_yaml",
    "save_config",
    "flatten",
    "to_dict",
    "with_overrides",
]
