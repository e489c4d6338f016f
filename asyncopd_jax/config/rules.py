"""The checks that span sections of a run's configuration, each naming the fields involved
(each section has checked its own fields when it was built): the estimator against what
the run produces, the teachers and what each can score, the algorithm, the placement."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import TYPE_CHECKING, Any

from asyncopd_jax.config.sections import TeacherSource
from asyncopd_jax.config_checks import ConfigError, StorageLocation, url_scheme
from asyncopd_jax.estimator_ids import ID_SOURCES
from asyncopd_jax.estimator_registry import ESTIMATORS, RL_ESTIMATORS
from asyncopd_jax.storage.location import SCHEMES as STORAGE_SCHEMES

if TYPE_CHECKING:
    from asyncopd_jax.config.run_config import RunConfig


def validate(cfg: RunConfig) -> None:
    """The checks that span sections, each naming the fields involved (each section has
    checked its own fields when it was built)."""
    _check_storage_locations(cfg)
    spec = cfg.estimator.spec
    _validate_teacher(cfg)  # first: what the teacher cannot score, before the settings that make it
    for need in spec.needs:  # each id set the estimator reads, and the setting that makes it
        setting = ID_SOURCES[need].setting
        if setting.read(cfg) < 1:
            raise ConfigError(f"estimator.name = {cfg.estimator.name!r} needs {setting.name} >= 1")
    _validate_algorithm(cfg)
    _validate_payload(cfg, cfg.teachers or (cfg.teacher,))
    extrapolation = cfg.learner.extrapolation
    if (
        extrapolation.enabled
        and extrapolation.probe_metric == "accuracy"
        and cfg.task.name == "dataset"
        and not cfg.task.answer_field
    ):
        raise ConfigError(
            "learner.extrapolation.probe_metric = 'accuracy' is invalid for a dataset without "
            "task.answer_field; allowed: reverse_kl (the probe then needs no reference answers)"
        )
    # the probes below compute the exact KL over the whole vocabulary: the teacher's weights
    # must be in one of our processes (a served teacher answers only a top-K)
    if extrapolation.enabled and extrapolation.probe_metric == "reverse_kl" and cfg.in_process_teacher is None:
        raise ConfigError(
            "learner.extrapolation.probe_metric = 'reverse_kl' needs one in-process teacher (teacher.path); "
            "allowed without one: accuracy"
        )
    if cfg.train.diagnostics_every and cfg.in_process_teacher is None:
        raise ConfigError(
            f"train.diagnostics_every = {cfg.train.diagnostics_every} needs one in-process teacher (teacher.path); "
            "allowed without one: 0"
        )
    probed = cfg.train.diagnostics_every or (extrapolation.enabled and extrapolation.probe_metric == "reverse_kl")
    if probed and cfg.in_process_teacher is not None and cfg.in_process_teacher.prompt.own:
        raise ConfigError(
            "teacher.prompt.template is invalid with train.diagnostics_every or the reverse_kl extrapolation probe: "
            "they compare the student and teacher under one prompt; allowed: no template, or those probes off"
        )
    if cfg.environment.tools and cfg.task.name != "dataset":
        raise ConfigError(
            f"environment.tools = {list(cfg.environment.tools)} is for task.name = dataset (the tool task's "
            f"calculator is its own: task.tools); allowed with task.name = {cfg.task.name}: []"
        )
    if cfg.schedule.mode == "fixed_lag" and cfg.learner.mini_batches != 1:
        # One rollout batch per optimizer step, sampled in the learner's thread: with M
        # mini-batches the m-th would be k + m stale.
        raise ConfigError(
            f"learner.mini_batches = {cfg.learner.mini_batches} is invalid with schedule.mode = "
            "fixed_lag; allowed: 1 (every step then trains on exactly schedule.lag-stale rollouts)"
        )
    _validate_placement(cfg)


def _validate_placement(cfg: RunConfig) -> None:
    """Where the stages run, against the schedule and the learner's processes."""
    processes = cfg.stages.placement == "processes"
    if cfg.schedule.mode == "fixed_lag" and processes:
        raise ConfigError(
            "stages.placement = 'processes' is invalid with schedule.mode = fixed_lag; "
            "allowed: threads (fixed_lag samples in the learner's own thread)"
        )
    shared = set(cfg.stages.devices("learner")) & set(cfg.stages.devices("rollout") + cfg.stages.devices("scoring"))
    if processes and shared:
        raise ConfigError(
            f"stages.learner_devices = {cfg.stages.learner_devices!r} is invalid; allowed: devices no "
            "rollout or scoring process holds (processes cannot share a TPU chip)"
        )
    if cfg.distributed.learner_processes is not None:  # else known at start only: asyncopd train checks it then
        check_learner_processes(cfg, cfg.distributed.learner_processes)


def check_learner_processes(cfg: RunConfig, processes: int) -> None:
    """A :class:`ConfigError` for a setting a learner over ``processes`` processes cannot
    run with. Validation checks the count the config fixes
    (``distributed.learner_processes``); ``asyncopd train`` checks again, after
    ``jax.distributed.initialize``, the count the environment gave."""
    if processes <= 1:
        return
    where = f"for a learner over {processes} processes"
    if cfg.stages.placement != "processes":
        raise ConfigError(
            f"stages.placement = {cfg.stages.placement!r} is invalid {where}; allowed: "
            "processes (each learner process reads its rows of a batch from the run's spool)"
        )
    if cfg.learner.token_budget:
        raise ConfigError(
            f"learner.token_budget = {cfg.learner.token_budget} is invalid {where}; allowed: 0 "
            "(each process feeds its own rows)"
        )
    if cfg.stages.snapshot_format == "safetensors":  # one file, written by one process holding every parameter
        raise ConfigError(f"stages.snapshot_format = 'safetensors' is invalid {where}; allowed: auto, orbax, objects")
    if cfg.train.diagnostics_every:
        raise ConfigError(f"train.diagnostics_every = {cfg.train.diagnostics_every} is invalid {where}; allowed: 0")


def _validate_teacher(cfg: RunConfig) -> None:
    """The run's teachers, and what each served one can score
    (:data:`asyncopd_jax.teacher.client.SERVES`), asked up front: a run must not find out at
    its first batch that its estimator cannot train."""
    if cfg.teachers:
        if cfg.teacher.given:
            raise ConfigError(
                f"teacher.path = {cfg.teacher.path!r} / teacher.server.url = {cfg.teacher.server.url!r} is set with "
                f"teachers ({len(cfg.teachers)} listed); allowed: one of them (`teacher` for one teacher, "
                "`teachers` for several: set teacher.path: '')"
            )
        names = [t.name for t in cfg.teachers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(
                f"teachers: the name {repeated[0]!r} is used twice; allowed: a different name per teacher"
            )
        for i, teacher in enumerate(cfg.teachers):
            if not teacher.given:
                raise ConfigError(f"teachers[{i}] ({teacher.name!r}) has neither path nor server.url; allowed: one")
    if cfg.routing.by == "field" and len(cfg.teacher_sources) > 1 and cfg.task.name != "dataset":
        raise ConfigError(
            f"routing.by = field is invalid with task.name = {cfg.task.name} (it has no fields); allowed: mixture, "
            "or a dataset task whose rows name their teacher in routing.field"
        )
    sources = cfg.teachers or (cfg.teacher,)
    for i, teacher in enumerate(sources):
        _validate_served(cfg, teacher, f"teachers[{i}]" if cfg.teachers else "teacher")


def _validate_payload(cfg: RunConfig, sources: tuple[TeacherSource, ...]) -> None:
    """``teacher.payload: hidden`` (the teacher's hidden states, for the exact KL) where the
    run can carry it, and the estimators that need it."""
    hidden = [t for t in sources if t.given and t.scoring(cfg.scoring).payload == "hidden"]
    where = "teachers[].payload" if cfg.teachers else "teacher.payload"
    name = cfg.estimator.name
    if cfg.estimator.spec.needs_teacher_hidden and not (hidden and len(hidden) == len(sources)):
        raise ConfigError(
            f"estimator.name = {name!r} needs the teacher's hidden states; set {where} (or scoring.payload) = hidden"
        )
    for t in sources:
        if t.head_path and not (t.served and t in hidden):
            field = "teachers[].head_path" if cfg.teachers else "teacher.head_path"
            raise ConfigError(
                f"{field} = {t.head_path!r} is invalid for teacher {t.name!r}: it is read only for a served teacher "
                "with payload = hidden; allowed: ''"
            )
    if not hidden:
        return
    reasons = {  # what does not carry hidden states yet
        "a vllm or sglang server (it answers log-probs only; serve the teacher with asyncopd serve-teacher, "
        "server.api = asyncopd)": any(t.served and t.server.api != "asyncopd" for t in hidden),
        "algorithm = rl": cfg.algorithm == "rl",
    }
    for reason, applies in reasons.items():
        if applies:
            raise ConfigError(f"{where} = hidden is invalid with {reason}; allowed: scores")


def unserved_need(cfg: RunConfig, teacher: TeacherSource, where: str, serves: frozenset[str]) -> str | None:
    """Why the estimator cannot run with ``teacher`` (the config's section ``where``) when
    its server scores the id sets ``serves`` (None: it can)."""
    for need in cfg.estimator.spec.needs:
        if need not in serves:
            source = ID_SOURCES[need]
            usable = [n for n, e in ESTIMATORS.items() if set(e.needs) <= serves and not e.needs_teacher_hidden]
            return (
                f"estimator.name = {cfg.estimator.name!r} needs {source.scores} (the teacher's log-probs of "
                f"{source.ids}), which a {where}.server.api = {teacher.server.api} teacher cannot score; allowed: an "
                f"in-process teacher ({where}.path) or one of {', '.join(usable)}"
            )
    return None


def _validate_served(cfg: RunConfig, teacher: TeacherSource, where: str) -> None:
    """What ``teacher`` (the config's section ``where``) can score when a server scores it."""
    if not teacher.served:
        return
    if teacher.path:
        raise ConfigError(
            f"{where}.path = {teacher.path!r} and {where}.server.url = {teacher.server.url!r} are both set; "
            "allowed: one of them (the teacher runs in-process from its directory, or a server scores it)"
        )
    api = f"{where}.server.api = {teacher.server.api}"
    if cfg.needs_teacher_scores:
        refusal = unserved_need(cfg, teacher, where, teacher.server.may_serve)  # a probe at start-up decides the rest
        if refusal:
            raise ConfigError(refusal)
        serves = teacher.server.serves
        if cfg.scoring.num_samples and "teacher_samples" not in serves:
            raise ConfigError(
                f"scoring.num_samples = {cfg.scoring.num_samples} is invalid with {api} (it cannot sample "
                f"ids from the teacher); allowed: 0, or an in-process teacher ({where}.path)"
            )
        temperature = teacher.scoring(cfg.scoring).temperature
        if teacher.server.raw_only and temperature != 1.0:
            setting = f"{where}.temperature" if teacher.temperature is not None else "scoring.temperature"
            raise ConfigError(
                f"{setting} = {temperature:g} is invalid with {api}: its log-probs are the "
                "model's raw distribution (temperature 1), and a top-K cannot be re-tempered exactly; allowed: 1.0, "
                f"or an in-process teacher ({where}.path)"
            )


def _validate_algorithm(cfg: RunConfig) -> None:
    """What reward-driven RL needs."""
    if cfg.algorithm == "opd":
        return
    rl = cfg.rl
    if not cfg.estimator.spec.needs_advantage:
        raise ConfigError(
            f"estimator.name = {cfg.estimator.name!r} is invalid with algorithm = rl; allowed: "
            f"{', '.join(RL_ESTIMATORS)}"
        )
    group = cfg.group_size
    if group % rl.samples_per_prompt:
        raise ConfigError(
            f"rl.samples_per_prompt = {rl.samples_per_prompt} is invalid; allowed: a divisor of the "
            f"{group} samples of a rollout group (learner.batch_size / rollout workers)"
        )
    if cfg.needs_teacher_scores and not cfg.teacher_sources:
        raise ConfigError(
            f"teacher.path = '' is invalid with rl.distill_coef = {rl.distill_coef}; allowed: a model "
            "directory, a teacher server (teacher.server.url), or rl.distill_coef = 0 to train from rewards alone"
        )
    if not cfg.needs_scoring and cfg.stages.scoring_processes:
        raise ConfigError(
            f"stages.scoring_processes = {cfg.stages.scoring_processes} is invalid with algorithm = rl, "
            "rl.distill_coef = 0 and estimator.regularisers.reference_kl_coef = 0 (nothing to score); allowed: 0"
        )
    if cfg.task.name == "dataset" and not cfg.task.answer_field:
        raise ConfigError(
            "task.answer_field = '' is invalid with algorithm = rl; allowed: the field holding each "
            "example's reference answer (the reward checks answers against it)"
        )


def _check_locations(section: Any, prefix: str = "") -> None:
    """Every :data:`~asyncopd_jax.config_checks.StorageLocation` setting, in every section
    and every teacher, names a path or a bucket of a kind this tool reads (read as a path,
    ``ftp://h/x`` would silently become the local directory ``./ftp:/h/x``)."""
    for field in dataclasses.fields(section):
        value, name = getattr(section, field.name), prefix + field.name
        scheme = url_scheme(value) if field.name in _location_fields(section.__class__) else None
        if scheme is not None and scheme not in STORAGE_SCHEMES:
            raise ConfigError(
                f"{name} = {value!r} is invalid; allowed: a path, gs://BUCKET/PREFIX or s3://BUCKET/PREFIX"
            )
        items = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(items):
            if dataclasses.is_dataclass(item):
                _check_locations(item, f"{name}[{i}]." if isinstance(value, tuple) else f"{name}.")


def _check_storage_locations(cfg: RunConfig) -> None:
    """Snapshots in a bucket are written as objects (Orbax's and the flat file's commits
    rest on rename)."""
    _check_locations(cfg)
    in_bucket = url_scheme(cfg.stages.snapshot_dir) or (
        cfg.stages.snapshot_dir == "auto" and url_scheme(cfg.output_dir) and cfg.stages.placement != "threads"
    )
    if in_bucket and cfg.stages.snapshot_format in ("orbax", "safetensors"):
        raise ConfigError(
            f"stages.snapshot_format = {cfg.stages.snapshot_format!r} is invalid with snapshots in a bucket; "
            "allowed: auto, objects"
        )


@functools.cache
def _location_fields(cls: type) -> frozenset[str]:
    """The fields of a config section typed :data:`~asyncopd_jax.config_checks.StorageLocation`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return frozenset(f.name for f in dataclasses.fields(cls) if hints[f.name] == StorageLocation)
