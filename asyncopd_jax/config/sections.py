"""The sections of a run's configuration, each a frozen dataclass that checks its own
fields when it is built (its ``__post_init__``): an unknown field names itself and the
allowed fields, a bad value names the field and the allowed values."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from asyncopd_jax.config_checks import ConfigError, IdList, StorageLocation, check_fields, parse_id_list
from asyncopd_jax.environments.latency import Latency
from asyncopd_jax.environments.toolbox import TOOL_NAMES
from asyncopd_jax.models.lora import LoRAParams
from asyncopd_jax.teacher.client import ServerParams
from asyncopd_jax.teacher.prompts import TeacherPrompt
from asyncopd_jax.teacher.scorer import ScoringParams


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What the student answers: the built-in synthetic task (``arith``) or a user's file
    (``dataset``: :mod:`asyncopd_jax.tasks.dataset_task`)."""

    name: Literal["arith", "tools", "dataset"] = "arith"
    difficulty: int = 3  # arith: operands per problem (lengths = long_tailed: the fewest)
    max_value: int = 99  # arith: operands are drawn from [0, max_value]
    # arith: "fixed" gives every problem `difficulty` operands; "long_tailed" draws each problem's
    # count k from difficulty to max_operands with P(k) ∝ (k − difficulty + 1) ** −tail_exponent
    # (asyncopd_jax.tasks.arith: answers of 10 to 494 tokens, median 16, at the defaults and difficulty 2)
    lengths: Literal["fixed", "long_tailed"] = "fixed"
    max_operands: int = 40  # arith, lengths = long_tailed: the most operands a problem has
    tail_exponent: float = 2.0  # arith, lengths = long_tailed: the Zipf exponent (0: uniform counts)
    path: StorageLocation = ""  # dataset: a .jsonl or .parquet file (here or in a bucket), one example per line / row
    prompt_field: str = "prompt"  # dataset: the field holding the prompt (dots reach into nested objects)
    answer_field: str = "answer"  # dataset: the reference answer ("" for none: distillation needs none)
    eval_fraction: float = 0.05  # dataset: share of the examples held out (fixed by prompt hash)
    # tools (asyncopd_jax.tasks.tool_arith): a·b + c with the calculator, operands in [10, max_value]
    max_turns: int = 4  # tools: student turns an episode may take (then it ends)
    # tools: how SFT trajectories call: one call, two (the product, then the sum), or none (the
    # answer written at once: a teacher without tools)
    tool_habit: Literal["whole", "steps", "none"] = "whole"
    tools: bool = True  # tools: the calculator answers calls (False: single-turn, a call ends the answer)
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
                ("max_turns", self.max_turns, self.max_turns >= 1, ">= 1"),
            ],
        )
        if self.name == "dataset" and not self.path:
            raise ConfigError("task.path = '' is invalid with task.name = dataset; allowed: a .jsonl or .parquet file")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model directory in the Hugging Face layout; ``builtin:NAME`` for a shipped one."""

    path: StorageLocation = ""  # a directory here or in a bucket (copied to this host once: storage/local_copy.py)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # How whole-sequence attention is computed (the learner, the teacher's scoring): "auto"
    # is Pallas splash attention on TPU, a pure-JAX flash attention on GPU, the plain one on
    # CPU (asyncopd_jax.models.attention); the long-sequence ones never hold [S, S] scores.
    attention: Literal["auto", "xla", "blockwise", "splash"] = "auto"


@dataclasses.dataclass(frozen=True)
class StudentSource(ModelSource):
    """The student: its starting weights, and (``lora.rank`` > 0) the LoRA adapters the
    learner trains on them instead of the whole model (:mod:`asyncopd_jax.models.lora`)."""

    lora: LoRAParams = LoRAParams()


TEACHER_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a teacher's name is part of its metrics' names


@dataclasses.dataclass(frozen=True)
class TeacherSource(ModelSource):
    """A teacher: a model directory scored in one of our processes (``path``), or a server
    that scores it (``server.url``: :mod:`asyncopd_jax.teacher.client`), not both.

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
    tokenizer: StorageLocation = ""
    # What it ships to the learner (None: scoring.payload): "scores", the score cache;
    # "hidden", its final hidden states too, for the exact KL over the whole vocabulary
    # (estimator forward_kl_dense / reverse_kl_dense; the learner holds its LM head).
    payload: Literal["scores", "hidden"] | None = None
    # With payload hidden and a served teacher: a local copy of its checkpoint (at least
    # config.json and the tensor of its LM head) the learner reads the head from ('' : fetched
    # once from the server's GET /v1/head); either is checked against the server's digest.
    head_path: StorageLocation = ""
    # A teacher of another tokenizer: how its scores reach the student's tokens. "spans":
    # compared on the text spans both tokenizations share (asyncopd_jax.teacher.cross_tokenizer);
    # "byte_prefix": the student's own top-K ids at each position, each given the teacher's
    # probability that the continuation starts with its bytes (asyncopd_jax.teacher.byte_prefix_teacher).
    mapping: Literal["spans", "byte_prefix"] = "spans"
    # With mapping byte_prefix: how many of the K ids scored at a position (sampling.student_topk)
    # are the student tokens that start the teacher's most likely next tokens (each one's longest
    # student prefix), ahead of the student's own top ids; 0: the student's top-K alone.
    from_teacher: int = 0

    def __post_init__(self) -> None:
        if not TEACHER_NAME.fullmatch(self.name):
            raise ValueError(f"teacher name {self.name!r} is invalid; allowed: letters, digits, '_' and '-'")
        if not self.weight > 0:
            raise ValueError(f"teacher {self.name!r}: weight = {self.weight!r} is invalid; allowed: > 0")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"teacher {self.name!r}: temperature = {self.temperature!r} is invalid; allowed: > 0")
        if self.from_teacher < 0 or (self.from_teacher and self.mapping != "byte_prefix"):
            raise ValueError(
                f"teacher {self.name!r}: from_teacher = {self.from_teacher!r} is invalid with mapping = "
                f"{self.mapping}; allowed: >= 0 with mapping = byte_prefix, else 0"
            )

    def scoring(self, run: ScoringParams) -> ScoringParams:
        """The run's scoring settings with this teacher's own temperature and payload."""
        own: dict[str, Any] = {"temperature": self.temperature, "payload": self.payload}
        return dataclasses.replace(run, **{k: v for k, v in own.items() if v is not None})

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

    def shape(self, count: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` over ``count`` devices: −1 takes the remainder."""
        rest = count // self.tensor
        fsdp = rest // max(self.data, 1) if self.fsdp == -1 else self.fsdp
        data = rest // max(fsdp, 1) if self.data == -1 else self.data
        return data, fsdp, self.tensor

    def devices_used(self, count: int) -> int:
        """How many of ``count`` devices the mesh takes (the first ones): fewer when explicit
        sizes multiply to less (e.g. 1 of 8 for ``data: 1``), else all of them."""
        data, fsdp, tensor = self.shape(count)
        explicit = self.data != -1 and self.fsdp != -1
        return data * fsdp * tensor if explicit and 0 < data * fsdp * tensor < count else count


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


@dataclasses.dataclass(frozen=True)
class EnvironmentConfig:
    """How a multi-turn task's environments run (``task.name = tools``): a pool of worker
    threads beside the decode loop (:class:`~asyncopd_jax.environments.EnvironmentPool`)."""

    workers: int = 8  # environment steps at once
    timeout_s: float = 30.0  # a step still running after this is answered with a timeout observation
    max_output: int = 4096  # characters (or ids) an observation keeps; past them it is cut, saying so
    # a latency added to every step, as a slow tool would take (studies, benchmarks): its median
    # seconds (0: none), fixed or lognormal about the median with σ latency_sigma
    # (asyncopd_jax.environments.latency)
    latency_s: float = 0.0
    latency_law: Literal["fixed", "lognormal"] = "fixed"
    latency_sigma: float = 1.0
    # task.name = dataset: the built-in tools its answers may call in the model's own format
    # (Qwen3's <tool_call> JSON, through its chat template): calculator, python (the sandbox);
    # none: single-turn. The built-in tool task brings its own calculator (task.tools).
    tools: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(
            "environment",
            [
                ("workers", self.workers, self.workers >= 1, ">= 1"),
                ("timeout_s", self.timeout_s, self.timeout_s > 0, "> 0"),
                ("max_output", self.max_output, self.max_output >= 1, ">= 1"),
                ("latency_s", self.latency_s, self.latency_s >= 0, ">= 0"),
                ("latency_sigma", self.latency_sigma, self.latency_sigma > 0, "> 0"),
                (
                    "tools",
                    list(self.tools),
                    set(self.tools) <= set(TOOL_NAMES) and len(set(self.tools)) == len(self.tools),
                    f"distinct names among {', '.join(TOOL_NAMES)}",
                ),
            ],
        )

    @property
    def latency(self) -> Latency:
        """The added step latency's law."""
        return Latency(self.latency_s, self.latency_law, self.latency_sigma)


@dataclasses.dataclass(frozen=True)
class StagesConfig:
    """Where the stages run (see :mod:`asyncopd_jax.pipeline.layout`, which decides it).

    Devices, for every placement: lists of this host's devices (``"0-3"``, ``"4,5"``; the
    order of ``jax.local_devices()``, e.g. TPU chips, GPUs, or virtual CPU devices). With
    ``threads`` each stage runs its computations on its own devices inside the learner's
    process (``""``: the learner's); with ``processes`` they are dealt out to the role's
    processes and made visible to each by the platform's mechanism (TPU chip variables,
    ``CUDA_VISIBLE_DEVICES``, the XLA:CPU device count; ``""``: every device visible, one on
    a CPU). :func:`asyncopd_jax.pipeline.layout.device_ids` is the one place that decides.

    Cores (``processes`` only) are Linux CPU lists dealt out the same way; each process is
    pinned to its share before JAX starts (so XLA sizes its thread pool to it). ``"auto"``
    splits this machine's cores by :func:`asyncopd_jax.pipeline.layout.plan_cores`;
    ``""`` leaves a stage unpinned.
    """

    # threads: every stage in the learner's process; processes: each rollout / scoring stage
    # in a process of its own (asyncopd_jax.pipeline.layout)
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
    # "auto": /dev/shm/asyncopd-<run> (RAM) if there, else <run>/snapshots (a run in a bucket: <run>/snapshots there)
    snapshot_dir: StorageLocation = "auto"
    # How a snapshot is written: "safetensors" (one flat file; ~1 ms for the demo's student;
    # one learner process only), "orbax" (sharded: each learner process writes its shards),
    # "objects" (versions and sparse deltas between them as objects, each load checked by a
    # digest: the format for a bucket, docs/storage.md), "auto": objects in a bucket, else
    # safetensors for one learner process, orbax for several.
    snapshot_format: Literal["auto", "orbax", "safetensors", "objects"] = "auto"
    # objects: a full version every this many versions, sparse deltas in between (1: no deltas)
    snapshot_full_every: int = 10
    # The dtype of the weights the learner publishes to the samplers, whatever the placement:
    # "auto" is student.dtype (the master copy); "bfloat16" from float32 master weights halves
    # each version and makes sparse deltas pay (most bf16 elements are unchanged by a step,
    # docs/storage.md); the samplers then run on the bf16-rounded weights.
    snapshot_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    restarts: int = 0  # times a stage process that died is restarted before the run stops
    startup_timeout: float = 600.0  # seconds a stage process waits for the first policy snapshot

    def __post_init__(self) -> None:
        check_fields(
            "stages",
            [
                ("rollouts", self.rollouts, self.rollouts >= 1, ">= 1"),
                ("snapshot_full_every", self.snapshot_full_every, self.snapshot_full_every >= 1, ">= 1"),
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
    # seconds without a process's heartbeat before the others stop (a lost host ends the
    # learner, which resumes from its last checkpoint, instead of leaving it waiting)
    heartbeat_timeout: int = 100

    def __post_init__(self) -> None:
        n, i = self.num_processes, self.process_id
        check_fields(
            "distributed",
            [
                ("num_processes", n, n >= 0, ">= 0 (0: from the environment)"),
                ("heartbeat_timeout", self.heartbeat_timeout, self.heartbeat_timeout > 0, "> 0"),
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
class EvalConfig:
    """How the held-out set is evaluated every ``train.eval_every`` steps (and at the last).

    ``inline``: the learner stops while the current weights are evaluated; the step's
    record carries ``eval_accuracy``. ``background``: a copy of the weights of the version
    just published is evaluated on a worker thread while learning goes on; the result is
    a record of its own, ``{"step": v, "eval_accuracy", "eval_version": v, …}``, written
    when it is ready (metrics.jsonl is then not in step order). The learner waits for it
    only at a checkpoint (a resumed run has every evaluation the checkpoint covers), at
    the end, or when the evaluation before it is still running (one runs, one waits).
    Both evaluate the learner's weights (not the published dtype): the same version gives
    the same figure in either mode."""

    mode: Literal["inline", "background"] = "inline"


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where the run's metrics go (asyncopd_jax.tracking). ``metrics.jsonl`` is always
    written; the others (each an extra: tensorboard, wandb, mlflow) get the same records
    under grouped names (``train/…``, ``teacher/NAME/…``, ``rollout/…``, ``eval/…``,
    ``system/…``). A sink that fails is warned about once; the run goes on."""

    sinks: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...] = ("jsonl",)
    project: str = "asyncopd"  # the W&B project and the MLflow experiment
    # W&B: "auto" logs online where a key is set up (WANDB_API_KEY or `wandb login`), else offline
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    # MLflow: "" = a SQLite store in the run directory (<run>/mlflow.db)
    mlflow_tracking_uri: str = ""
    # answers in a table of samples (prompt, answer, per-token teacher KL) at each evaluation,
    # for the sinks that show one (0: none)
    samples: int = 4

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"logging.samples = {self.samples} is invalid; allowed: >= 0 (0: no table)")
        if "jsonl" not in self.sinks:
            raise ValueError(f"logging.sinks = {list(self.sinks)!r} is invalid; allowed: a list with jsonl (always on)")
