"""Typed, validated run configuration: frozen dataclasses ⇄ YAML, with ``a.b=c`` overrides.

Every field is checked up front, when its section is built: an unknown field names itself
and the allowed fields, a bad value names the field and the allowed values. Each section
checks its own fields (its ``__post_init__``); :class:`RunConfig` checks what spans
sections, asking the estimator's spec what the run must produce. There are no silent
fallbacks, and nothing that depends only on the config is left for the run to find.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncopd_jax import configs
from asyncopd_jax.atomic_files import write_text_atomically
from asyncopd_jax.config_checks import ConfigError, IdList, check_fields, parse_id_list
from asyncopd_jax.estimator_registry import ESTIMATORS, ID_SOURCES, RL_ESTIMATORS, EstimatorConfig
from asyncopd_jax.pipeline import placement
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.teacher.prompts import TeacherPrompt
from asyncopd_jax.teacher.routing import RoutingParams
from asyncopd_jax.teacher.scorer import ScoringParams
from asyncopd_jax.teacher.served import ServerParams


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What the student answers: the built-in synthetic task (``arith``) or a user's file
    (``dataset``: :mod:`asyncopd_jax.tasks.dataset_task`)."""

    name: Literal["arith", "dataset"] = "arith"
    difficulty: int = 3  # arith: operands per problem (lengths = long_tailed: the fewest)
    max_value: int = 99  # arith: operands are drawn from [0, max_value]
    # arith: "fixed" gives every problem `difficulty` operands; "long_tailed" draws each problem's
    # count k from difficulty to max_operands with P(k) ∝ (k − difficulty + 1) ** −tail_exponent
    # (asyncopd_jax.tasks.arith: answers of 10 to 494 tokens, median 16, at the defaults and difficulty 2)
    lengths: Literal["fixed", "long_tailed"] = "fixed"
    max_operands: int = 40  # arith, lengths = long_tailed: the most operands a problem has
    tail_exponent: float = 2.0  # arith, lengths = long_tailed: the Zipf exponent (0: uniform counts)
    path: str = ""  # dataset: a .jsonl or .parquet file, one example per line / row
    prompt_field: str = "prompt"  # dataset: the field holding the prompt (dots reach into nested objects)
    answer_field: str = "answer"  # dataset: the reference answer ("" for none: distillation needs none)
    eval_fraction: float = 0.05  # dataset: share of the examples held out (fixed by prompt hash)
    eval_prompts: int = 256  # held-out problems evaluated (at most)
    seed: int = 0

    def __post_init__(self) -> None:
        long_tailed = self.name == "arith" and self.lengths == "long_tailed"
        check_fields(
            "task",
            [
                ("eval_fraction", self.eval_fraction, 0 <= self.eval_fraction < 1, "0 <= fraction < 1"),
                ("difficulty", self.difficulty, not long_tailed or self.difficulty >= 2, ">= 2 (the fewest operands)"),
                (
                    "max_operands",
                    self.max_operands,
                    not long_tailed or self.difficulty <= self.max_operands <= self.max_value + 1,
                    f"task.difficulty ({self.difficulty}) to task.max_value + 1 ({self.max_value + 1}: operands are "
                    "distinct)",
                ),
                ("tail_exponent", self.tail_exponent, self.tail_exponent >= 0, ">= 0 (0: uniform counts)"),
            ],
        )
        if self.name == "dataset" and not self.path:
            raise ConfigError("task.path = '' is invalid with task.name = dataset; allowed: a .jsonl or .parquet file")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model directory in the Hugging Face layout; ``builtin:NAME`` for a shipped one."""

    path: str = ""
    dtype: Literal["float32", "bfloat16"] = "float32"
    # How whole-sequence attention is computed (the learner, the teacher's scoring): "auto"
    # is Pallas splash attention on TPU, a pure-JAX flash attention on GPU, the plain one on
    # CPU (asyncopd_jax.models.attention); the long-sequence ones never hold [S, S] scores.
    attention: Literal["auto", "xla", "blockwise", "splash"] = "auto"


TEACHER_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a teacher's name is part of its metrics' names


@dataclasses.dataclass(frozen=True)
class TeacherSource(ModelSource):
    """A teacher: a model directory scored in one of our processes (``path``), or a server
    that scores it (``server.url``: :mod:`asyncopd_jax.teacher.served`), not both.

    ``name`` names it in the metrics (``teacher/NAME/…``) and in a dataset's routing column;
    ``weight`` is its share of the prompts under ``routing.by = mixture``; ``temperature``
    its own scoring temperature (None: ``scoring.temperature``); ``prompt`` the prompt it
    scores the student's answers under (:mod:`asyncopd_jax.teacher.prompts`; default: the
    student's)."""

    server: ServerParams = ServerParams()
    name: str = "teacher"
    weight: float = 1.0
    temperature: float | None = None
    prompt: TeacherPrompt = TeacherPrompt()
    # The directory of the teacher's tokenizer ('' : its model directory, ``path``; for a
    # served teacher, the student's). A tokenizer other than the student's makes the teacher
    # a cross-tokenizer one: answers are re-tokenised for it and compared by text spans
    # (asyncopd_jax.teacher.cross_tokenizer), under a prompt in its own tokens.
    tokenizer: str = ""

    def __post_init__(self) -> None:
        if not TEACHER_NAME.fullmatch(self.name):
            raise ValueError(f"teacher name {self.name!r} is invalid; allowed: letters, digits, '_' and '-'")
        if not self.weight > 0:
            raise ValueError(f"teacher {self.name!r}: weight = {self.weight!r} is invalid; allowed: > 0")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"teacher {self.name!r}: temperature = {self.temperature!r} is invalid; allowed: > 0")

    def scoring(self, run: ScoringParams) -> ScoringParams:
        """The run's scoring settings with this teacher's own temperature."""
        return run if self.temperature is None else dataclasses.replace(run, temperature=self.temperature)

    @property
    def served(self) -> bool:
        """Whether a server scores the teacher (else it runs in-process from ``path``)."""
        return bool(self.server.url)

    @property
    def given(self) -> bool:
        """Whether the run has a teacher at all."""
        return bool(self.path) or self.served


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Reward-driven RL (``algorithm: rl``): the task's verifier rewards each answer.

    Every prompt is answered ``samples_per_prompt`` (G) times; a response's advantage is
    its reward relative to its group's (:func:`asyncopd_jax.estimators.group_advantages`)
    and one of :data:`RL_ESTIMATORS` (``estimator.name``: a spec with ``needs_advantage``)
    turns it into a loss. With ``distill_coef`` β > 0 the teacher's per-token reverse-KL
    reward is added to the advantage (distil and reinforce at once); with β = 0 the
    teacher scores nothing.
    """

    samples_per_prompt: int = 8  # G
    normalize_std: bool = True  # GRPO: divide by the group's reward std; False: Dr. GRPO (centre only)
    advantage_std: Literal["unbiased", "population"] = "unbiased"  # that std over G − 1 (verl, AReaL, Tunix) or G
    distill_coef: float = 0.0  # β

    def __post_init__(self) -> None:
        check_fields(
            "rl",
            [
                ("samples_per_prompt", self.samples_per_prompt, self.samples_per_prompt >= 1, ">= 1"),
                ("distill_coef", self.distill_coef, self.distill_coef >= 0, ">= 0"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95

    def __post_init__(self) -> None:
        check_fields("optim", [("learning_rate", self.learning_rate, self.learning_rate > 0, "> 0")])


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh of a stage: ``data × fsdp × tensor`` devices (−1 for ``data`` or ``fsdp``:
    all remaining devices); see :mod:`asyncopd_jax.models.partitioning` for what each axis
    splits."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        check_fields(
            "mesh",
            [
                ("data", self.data, self.data == -1 or self.data >= 1, "-1 or >= 1"),
                ("fsdp", self.fsdp, self.fsdp == -1 or self.fsdp >= 1, "-1 or >= 1"),
                ("tensor", self.tensor, self.tensor >= 1, ">= 1"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class ExtrapolationConfig:
    """EffOPD (:mod:`asyncopd_jax.learner.extrapolation`): at optimizer steps 1, 2, 4, 8, …
    try θ_a + f·(θ_t − θ_a) for each factor f in turn on a probe, keep the best while the
    probe strictly improves (else roll back to θ_t), and re-anchor there.

    The probe is ``probe_prompts`` fixed prompts drawn from the training distribution with
    their own seed (not the held-out evaluation set). ``probe_metric``: ``accuracy`` (the
    verifier's mean score of the answers; needs reference answers) or ``reverse_kl``
    (minus the exact KL(student ‖ teacher) per token of the answers; any task).
    ``probe_temperature`` 0 answers greedily; above 0 the answers are sampled with the same
    key for every candidate (common random numbers: the comparison sees one draw).
    """

    enabled: bool = False
    factors: tuple[float, ...] = (3.0, 5.0, 7.0, 9.0, 11.0)
    probe_prompts: int = 64
    probe_metric: Literal["accuracy", "reverse_kl"] = "accuracy"
    probe_temperature: float = 0.0

    def __post_init__(self) -> None:
        check_fields(
            "learner.extrapolation",
            [
                (
                    "factors",
                    self.factors,
                    len(self.factors) > 0 and all(f > 1 for f in self.factors),
                    "a non-empty list of factors > 1, tried in order (EffOPD: [3, 5, 7, 9, 11])",
                ),
                ("probe_prompts", self.probe_prompts, self.probe_prompts >= 1, ">= 1"),
                ("probe_temperature", self.probe_temperature, self.probe_temperature >= 0, ">= 0 (0: greedy answers)"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    batch_size: int = 32  # prompts per rollout batch (B)
    mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batches: int = 1  # gradient accumulation inside one optimizer step
    logprob_chunk: int = 512
    # What each decoder layer keeps for the backward pass: "none" (everything; fastest, the
    # demo's models are tiny), "layer" (only its input: least memory, ~1/3 more compute),
    # "dots" (its weight matmuls' outputs: attention and activations recomputed).
    remat: Literal["none", "layer", "dots"] = "none"
    # Mixed precision: the dtype the forward and backward run in; the student's weights (its
    # master copy) and the optimizer's moments stay in student.dtype. null: student.dtype.
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    # Dynamic batching (asyncopd_jax.learner.packing): > 0 cuts each mini-batch into
    # micro-batches of rows of similar length, at most this many prompt + response slots
    # each (trimmed to their own longest row, in steps of token_bucket); 0: micro_batches.
    token_budget: int = 0
    token_bucket: int = 8
    mesh: MeshConfig = MeshConfig()
    extrapolation: ExtrapolationConfig = ExtrapolationConfig()  # EffOPD, off by default

    def __post_init__(self) -> None:
        B, M, m = self.batch_size, self.mini_batches, self.micro_batches
        check_fields(
            "learner",
            [
                ("batch_size", B, B >= 1, ">= 1"),
                ("mini_batches", M, M >= 1 and B % M == 0, "a divisor of learner.batch_size"),
                (
                    "micro_batches",
                    m,
                    m >= 1 and (B // max(M, 1)) % m == 0,
                    "a divisor of learner.batch_size / learner.mini_batches",
                ),
                (
                    "token_budget",
                    self.token_budget,
                    self.token_budget >= 0 and (self.token_budget == 0 or m == 1),
                    ">= 0 (0: off), with learner.micro_batches = 1 (the budget decides the micro-batches)",
                ),
                ("token_bucket", self.token_bucket, self.token_bucket >= 1, ">= 1"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Rollout/learning overlap: ``sync`` (η = 0), ``n_step_off``, ``fully_async`` (bound η),
    or ``fixed_lag`` (exactly ``lag`` steps stale, sequential and deterministic: for studies)."""

    mode: Literal["sync", "n_step_off", "fully_async", "fixed_lag"] = "fully_async"
    max_staleness: int = 2  # η, in optimizer steps
    n_step: int = 1  # for n_step_off: rollouts run at most n batches ahead
    lag: int = 0  # for fixed_lag: step t trains on rollouts of policy version max(0, t − lag)

    def __post_init__(self) -> None:
        check_fields(
            "schedule",
            [
                ("max_staleness", self.max_staleness, self.max_staleness >= 0, ">= 0"),
                ("n_step", self.n_step, self.n_step >= 1, ">= 1"),
                ("lag", self.lag, self.lag >= 0, ">= 0"),
            ],
        )

    def eta(self, mini_batches: int) -> int:
        """The staleness bound in optimizer steps: 0 for ``sync``; for ``n_step_off``
        rollouts run ``n_step`` batches (of ``mini_batches`` steps) ahead."""
        if self.mode == "sync":
            return 0
        if self.mode == "n_step_off":
            return self.n_step * mini_batches
        if self.mode == "fixed_lag":
            return self.lag
        return self.max_staleness


@dataclasses.dataclass(frozen=True)
class StagesConfig:
    """Where the stages run (see :mod:`asyncopd_jax.pipeline.placement`, which decides it).

    Devices, for every placement: lists of this host's devices (``"0-3"``, ``"4,5"``; the
    order of ``jax.local_devices()``, e.g. TPU chips, GPUs, or virtual CPU devices). With
    ``threads`` each stage runs its computations on its own devices inside the learner's
    process (``""``: the learner's); with ``processes`` they are dealt out to the role's
    processes and made visible to each by the platform's mechanism (TPU chip variables,
    ``CUDA_VISIBLE_DEVICES``; ``""``: every device visible).

    Cores (``processes`` only) are Linux CPU lists dealt out the same way; each process is
    pinned to its share before JAX starts (so XLA sizes its thread pool to it). ``"auto"``
    splits this machine's cores by :func:`asyncopd_jax.pipeline.placement.plan_cores`;
    ``""`` leaves a stage unpinned.
    """

    # threads: every stage in the learner's process; processes: each rollout / scoring stage
    # in a process of its own (asyncopd_jax.pipeline.placement)
    placement: Literal["threads", "processes"] = "threads"
    rollouts: int = 1  # rollout stages: threads or processes (each samples, and scores when scoring_processes = 0)
    scoring_processes: int = 0  # processes: teacher-scoring processes; 0: each rollout process scores its groups
    snapshot_in_memory: bool = True  # threads: hand weights over in-process instead of through snapshot files
    # false: the learner starts none of them; they are started on other hosts
    # (launch/stage_host.sh, launch/tpu_pod.sh stages: e.g. a learner that holds every chip
    # of its TPU host) and the counts above only size the rollout groups
    start_processes: bool = True
    learner_cores: str = "auto"
    rollout_cores: str = "auto"
    scoring_cores: str = "auto"
    learner_devices: str = ""
    rollout_devices: str = ""
    scoring_devices: str = ""
    # How a rollout / scoring stage's devices form its mesh (the learner's: learner.mesh):
    # e.g. scoring_mesh: {data: 1, tensor: 4} splits an 8B teacher's heads, MLP and
    # vocabulary over 4 chips (asyncopd_jax.models.partitioning).
    rollout_mesh: MeshConfig = MeshConfig()
    scoring_mesh: MeshConfig = MeshConfig()
    rollout_niceness: int = 5  # lower CPU priority: where cores are shared the learner goes first
    snapshot_dir: str = "auto"  # "auto": /dev/shm/asyncopd-<run> (RAM) if there, else <run>/snapshots
    # How a snapshot is written: "safetensors" (one flat file; ~1 ms for the demo's student),
    # "orbax" (sharded; needed by a learner over several processes), "auto": the former for
    # one learner process, the latter for several.
    snapshot_format: Literal["auto", "orbax", "safetensors"] = "auto"
    restarts: int = 0  # times a stage process that died is restarted before the run stops
    startup_timeout: float = 600.0  # seconds a stage process waits for the first policy snapshot

    def __post_init__(self) -> None:
        check_fields(
            "stages",
            [
                ("rollouts", self.rollouts, self.rollouts >= 1, ">= 1"),
                ("scoring_processes", self.scoring_processes, self.scoring_processes >= 0, ">= 0"),
                ("restarts", self.restarts, self.restarts >= 0, ">= 0"),
                ("rollout_niceness", self.rollout_niceness, 0 <= self.rollout_niceness <= 19, "0 to 19"),
            ],
        )
        for role in ("learner", "rollout", "scoring"):
            for kind, allowed in (
                ("cores", "'auto', '' or a CPU list such as '0', '1-3', '0,2'"),
                ("devices", "'' or a device list such as '0', '4-7', '0,2'"),
            ):
                value = getattr(self, f"{role}_{kind}")
                if kind == "cores" and value == "auto":
                    continue
                try:
                    parse_id_list(value)
                except ValueError as err:
                    raise ConfigError(
                        f"stages.{role}_{kind} = {value!r} is invalid; allowed: {allowed} ({err})"
                    ) from None

    def devices(self, role: str) -> IdList:
        """``stages.<role>_devices`` as ids (``()``: the default, see above)."""
        return parse_id_list(getattr(self, f"{role}_devices"))

    def cores(self, role: str) -> IdList | None:
        """``stages.<role>_cores`` as ids (None: ``auto``; ``()``: unpinned)."""
        spec = getattr(self, f"{role}_cores")
        return None if spec == "auto" else parse_id_list(spec)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """JAX's multi-controller runtime for a learner that spans several processes or hosts.

    With ``initialize: true`` every learner process calls ``jax.distributed.initialize``
    before anything else touches JAX; the learner's mesh then covers the devices of all
    processes and each process feeds its own rows of every batch. On Cloud TPU VMs, SLURM
    and Open MPI the other fields may stay unset: JAX reads them from the environment
    (``JAX_COORDINATOR_ADDRESS`` is read too). Elsewhere give all three.
    """

    initialize: bool = False
    coordinator_address: str = ""  # "host:port" of process 0; "": detected from the environment
    num_processes: int = 0  # 0: detected from the environment
    process_id: int = -1  # -1: detected from the environment
    initialization_timeout: int = 300  # seconds to wait for every process to join

    def __post_init__(self) -> None:
        n, i = self.num_processes, self.process_id
        check_fields(
            "distributed",
            [
                ("num_processes", n, n >= 0, ">= 0 (0: from the environment)"),
                (
                    "process_id",
                    i,
                    i >= -1 and (n == 0 or i < n),
                    "-1 (from the environment) or 0 .. distributed.num_processes - 1",
                ),
            ],
        )

    @property
    def learner_processes(self) -> int | None:
        """The processes the learner spans where the config fixes their number: 1 without
        ``initialize``, else ``num_processes``; None: the environment tells at start."""
        if not self.initialize:
            return 1
        return self.num_processes or None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps
    eval_every: int = 25
    checkpoint_every: int = 25
    # Study diagnostics (asyncopd_jax.pipeline.diagnostics): exact KLs on a fixed probe set
    # every this many steps (0: off), over this many probe prompts.
    diagnostics_every: int = 0
    diagnostic_prompts: int = 64
    # Study diagnostic (asyncopd_jax.learner.update_geometry): per-module norm, rank-1 energy
    # and alignment of the weight update θ_t − θ_0 every this many steps (0: off).
    update_geometry_every: int = 0

    def __post_init__(self) -> None:
        check_fields(
            "train",
            [
                ("steps", self.steps, self.steps >= 1, ">= 1"),
                ("eval_every", self.eval_every, self.eval_every >= 1, ">= 1 (the last step is always evaluated)"),
                ("checkpoint_every", self.checkpoint_every, self.checkpoint_every >= 1, ">= 1 (and the last step)"),
                ("diagnostics_every", self.diagnostics_every, self.diagnostics_every >= 0, ">= 0 (0: off)"),
                ("diagnostic_prompts", self.diagnostic_prompts, self.diagnostic_prompts >= 1, ">= 1"),
                ("update_geometry_every", self.update_geometry_every, self.update_geometry_every >= 0, ">= 0 (0: off)"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    # "opd": distil from the teacher's scores (the estimator is a KL estimator);
    # "rl": reinforce from the task's rewards (see RLConfig; the estimator is a stabiliser).
    algorithm: Literal["opd", "rl"] = "opd"
    task: TaskConfig = TaskConfig()
    student: ModelSource = ModelSource()
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
    estimator: EstimatorConfig = EstimatorConfig()
    optim: OptimConfig = OptimConfig()
    learner: LearnerConfig = LearnerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    stages: StagesConfig = StagesConfig()
    distributed: DistributedConfig = DistributedConfig()
    train: TrainConfig = TrainConfig()
    rl: RLConfig = RLConfig()

    def __post_init__(self) -> None:
        _validate(self)

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
    def group_size(self) -> int:
        """Samples per rollout group: the batch split over the rollout stages (the whole
        batch per group when it does not split evenly)."""
        batch, stages = self.learner.batch_size, self.rollout_stages
        return batch // stages if batch % stages == 0 else batch


def _validate(cfg: RunConfig) -> None:
    """The checks that span sections, each naming the fields involved (each section has
    checked its own fields when it was built)."""
    spec = cfg.estimator.spec
    _validate_teacher(cfg)  # first: what the teacher cannot score, before the settings that make it
    for need in spec.needs:  # each id set the estimator reads, and the setting that makes it
        setting = ID_SOURCES[need].setting
        if setting.read(cfg) < 1:
            raise ConfigError(f"estimator.name = {cfg.estimator.name!r} needs {setting.name} >= 1")
    _validate_algorithm(cfg)
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
    if cfg.schedule.mode == "fixed_lag" and cfg.learner.mini_batches != 1:
        # One rollout batch per optimizer step, sampled in the learner's thread: with M
        # mini-batches the m-th would be k + m stale.
        raise ConfigError(
            f"learner.mini_batches = {cfg.learner.mini_batches} is invalid with schedule.mode = "
            "fixed_lag; allowed: 1 (every step then trains on exactly schedule.lag-stale rollouts)"
        )
    placement.validate(cfg)


def _validate_teacher(cfg: RunConfig) -> None:
    """The run's teachers, and what each served one can score
    (:data:`asyncopd_jax.teacher.served.SERVES`), asked up front: a run must not find out at
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
        serves = teacher.server.serves
        for need in cfg.estimator.spec.needs:
            source = ID_SOURCES[need]
            if need not in serves:
                usable = [name for name, spec in ESTIMATORS.items() if set(spec.needs) <= serves]
                raise ConfigError(
                    f"estimator.name = {cfg.estimator.name!r} needs {source.scores} (the teacher's log-probs of "
                    f"{source.ids}), which a {api} teacher cannot score; allowed: an in-process teacher "
                    f"({where}.path) or one of {', '.join(usable)}"
                )
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


# --- dict / YAML ⇄ dataclasses -----------------------------------------------------


# Fields that moved to another name: a config that still uses the old one is told the new.
MOVED = {
    "schedule.placement": "stages.placement",
    "schedule.rollout_workers": "stages.rollouts",
    "stages.rollout_processes": "stages.rollouts",
    "schedule.snapshot_in_memory": "stages.snapshot_in_memory",
    # the estimator's knobs, grouped by what reads them
    **{
        f"estimator.{old}": f"estimator.{new}"
        for old, new in {
            "mc_clip_eps": "mc.clip_eps",
            "mc_importance_sampling": "mc.importance_sampling",
            "control_variate": "forward_mc.control_variate",
            "topk_tail": "topk.tail",
            "ppo_clip_eps": "ppo.clip_eps",
            "dual_clip": "ppo.dual_clip",
            "behavior_weight_cap": "ppo.behavior_weight_cap",
            "behavior_weight_mode": "ppo.behavior_weight_mode",
            "behavior_weight_floor": "ppo.behavior_weight_floor",
            "gspo_clip_low": "gspo.clip_low",
            "gspo_clip_high": "gspo.clip_high",
            "tis_cap": "tis.cap",
            "m2po_budget": "m2po.budget",
            "second_moment_clip_budget": "second_moment_clip.budget",
            "second_moment_clip_min_low": "second_moment_clip.min_low",
            "second_moment_clip_min_high": "second_moment_clip.min_high",
            "entropy_coef": "regularisers.entropy_coef",
            "reference_kl_coef": "regularisers.reference_kl_coef",
            "reference_kl": "regularisers.reference_kl",
        }.items()
    },
}


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        moved = [where + u for u in unknown if where + u in MOVED]  # all of them: a config often has several
        if moved:
            raise ConfigError(f"config field {', '.join(f'{old} is now {MOVED[old]}' for old in moved)} (same values)")
        raise ConfigError(
            f"unknown config field {where}{unknown[0]}; allowed in {prefix or 'the top level'}: {', '.join(fields)}"
        )
    kwargs = {name: _coerce(hints[name], value, f"{prefix}.{name}" if prefix else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(prefix) else f"{prefix or 'config'}: {message}") from None


_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp: Any, value: Any, field: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, field)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, field)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{field} = {value!r} is invalid")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: an integer")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a number")
        return float(value)
    if origin is tuple:
        (item, *_) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a list")
        return tuple(_coerce(item, v, f"{field}[{i}]") for i, v in enumerate(value))
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a string")
        return value
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (for ``config.yaml``)."""
    return dataclasses.asdict(cfg)


# Fields a resumed run may change (``asyncopd train --resume DIR --set …``): how long it
# runs and what it logs, never what it computes.
SAFE_ON_RESUME = (
    "train.steps",
    "train.eval_every",
    "train.checkpoint_every",
    "train.diagnostics_every",
    "train.diagnostic_prompts",
    "train.update_geometry_every",
)


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): data}


def check_resume_changes(saved: RunConfig, resumed: RunConfig) -> None:
    """Raise a :class:`ConfigError` naming every field that ``resumed`` changes from the
    run's ``saved`` config, unless all of them are in :data:`SAFE_ON_RESUME`."""
    old, new = _flat(to_dict(saved)), _flat(to_dict(resumed))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in SAFE_ON_RESUME)
    if changed:
        diffs = ", ".join(f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in changed)
        raise ConfigError(
            f"--resume would change {diffs}: a resumed run must compute what it started computing; "
            f"allowed changes: {', '.join(SAFE_ON_RESUME)} (start a new run for anything else)"
        )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides (values parsed as YAML scalars) to a config mapping."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config (a path or a bundled config's name, see :mod:`asyncopd_jax.configs`;
    None: the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            path = configs.resolve(path)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path} must hold a mapping of config sections (name:, task:, …), not a {type(data).__name__}"
            )
    return _from_dict(RunConfig, apply_overrides(data, list(overrides)), "")


def with_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """``cfg`` with ``--set``-style overrides applied, validated as :func:`load_config` does."""
    return _from_dict(RunConfig, apply_overrides(to_dict(cfg), list(overrides)), "")


def save_config(cfg: RunConfig, path: str | Path) -> None:
    write_text_atomically(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
