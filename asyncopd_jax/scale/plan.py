"""``asyncopd plan``: every stage of a run compiled ahead of time at its real shapes, on the
devices it is placed on, by the compiler of the chips it will run on.

Nothing is allocated: parameters, optimizer state and batches are ``ShapeDtypeStruct``
placed by the same shardings the run uses, and ``jax.jit(f).lower(...).compile()`` returns
the executable's memory analysis (per chip: arguments, outputs, temporaries) and cost
analysis (per chip: FLOPs, bytes accessed). From those a stage's roofline time per call is
``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)``: a lower bound, reached by no real
program, that ranks the stages and says how many chips each needs.

Shapes: B rows per call, P prompt slots, T response slots, S = P + T, V vocabulary. The
plan as printed: :mod:`asyncopd_jax.scale.report`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.config import RunConfig, TeacherSource
from asyncopd_jax.learner.optimizer import run_optimizer
from asyncopd_jax.learner.sharding import batch_shardings, make_mesh, state_shardings
from asyncopd_jax.learner.step import (
    LearnerBatch,
    PolicyLoss,
    TrainState,
    initial_state,
    jit_train_step,
    train_step_function,
)
from asyncopd_jax.models.attention import resolve_implementation
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import Remat, abstract_decoder, cast_floating
from asyncopd_jax.models.moe import ExchangeBytes, exchange_bytes, expert_layout, routed_exchange
from asyncopd_jax.models.partitioning import mesh_context, parameter_shardings
from asyncopd_jax.pipeline.devices import stage_mesh, with_shardings
from asyncopd_jax.pipeline.layout import Layout, Role, device_ids, plan_layout
from asyncopd_jax.sampling import Engine, SamplingParams, make_sampler
from asyncopd_jax.scale.balance import Answers, DecodeBytes, RolloutCost, rollout_seconds
from asyncopd_jax.scale.chips import GIB, Chip, Topology
from asyncopd_jax.scale.flops import matmul_flops, transformer_flops
from asyncopd_jax.scale.learner_inputs import abstract_learner_batch, architecture, hidden_teachers, teacher_heads
from asyncopd_jax.scale.student_shapes import (
    published_student,
    received_weights,
    resident_bytes,
    sampler_weights,
    student_decoder,
)
from asyncopd_jax.scale.swaps import DEFAULT_STORAGE_BYTES_PER_S, SwapFigures, bytes_per_device, swap_figures
from asyncopd_jax.teacher.scorer import teacher_score_function


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sequence shapes a plan compiles at, and an optional layer count (a reduced
    compile: the real widths and vocabulary, fewer layers; CI's tests)."""

    prompt_tokens: int = 512
    response_tokens: int = 3584
    layers: int | None = None


@dataclasses.dataclass(frozen=True)
class StageFigures:
    """What the compiler says of one stage's jitted call, per chip.

    ``error`` holds the compiler's first line where the stage does not compile (a
    ``RESOURCE_EXHAUSTED`` when it does not fit the chip)."""

    stage: str
    devices: int
    rows: int
    tokens: int  # tokens processed per call, all chips together
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    flops: float = 0.0  # per chip, as XLA's cost analysis counts them (a loop's body once)
    bytes_accessed: float = 0.0  # per chip, likewise
    error: str | None = None
    # Matmul FLOPs per chip counted from the jaxpr (asyncopd_jax.scale.flops): the work as
    # configured (rematerialisation's recomputation included), the model's own (no
    # recomputation: what MFU counts), and the textbook 2 (6 with a backward pass) ·
    # weights · tokens + attention, which the model's count should match.
    executed_flops: float = 0.0
    model_flops: float = 0.0
    textbook_flops: float = 0.0
    # Bytes one chip sends over its links per call where the program exchanges activations
    # (a mixture of experts' all-to-alls: models/moe.py's exchange_bytes); 0: none counted.
    # At uniform routing (in the roofline), and where one chip holds every token's experts.
    interconnect_bytes: float = 0.0
    interconnect_worst_bytes: float = 0.0
    # held on the chip beside the call's arguments (a sampler merging a LoRA student's
    # versions: the base and adapters it merges from)
    resident_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to an argument + temporaries (+ what the stage holds
        beside the call): the most this call holds."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.resident_bytes

    def roofline_seconds(self, chip: Chip) -> float:
        """``max(FLOPs / peak, bytes / bandwidth, link bytes / link bandwidth)``: the executed
        matmul FLOPs where counted (the compiler's otherwise), the compiler's bytes (a lower
        bound: loops once), the bytes sent to other chips at one direction's rate."""
        flops = max(self.executed_flops, self.flops)
        return max(
            flops / chip.peak_flops,
            self.bytes_accessed / chip.hbm_bytes_per_s,
            self.interconnect_bytes / chip.copy_bytes_per_s,
        )

    def mfu(self, chip: Chip) -> float:
        """Model-FLOPs utilisation if the call ran at its roofline time."""
        seconds = self.roofline_seconds(chip)
        return self.model_flops / (seconds * chip.peak_flops) if seconds else 0.0


def _figures(stage: str, devices: int, rows: int, tokens: int, lowered: Any) -> StageFigures:
    """Compile ``lowered`` and read its analyses; a compile that fails is a figure too."""
    try:
        compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the plan's answer
        return StageFigures(stage, devices, rows, tokens, error=str(err).strip().splitlines()[0][:300])
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return StageFigures(
        stage,
        devices,
        rows,
        tokens,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def target_platform(devices: list) -> str:
    """The platform a plan compiles for: the devices' own (TPU chips), or ``gpu`` where
    XLA:CPU devices stand in for GPUs (``attention: auto`` then resolves as on the GPUs)."""
    platform = devices[0].platform
    return "gpu" if platform == "cpu" else platform


def abstract_train_state(cfg: RunConfig, params: Any) -> TrainState:
    """The learner's state (parameters, optimizer state, step) as shapes: as the run makes it
    (:func:`~asyncopd_jax.learner.step.initial_state`: a LoRA student's moments are its
    adapters' alone)."""
    optimizer = run_optimizer(cfg)
    return jax.eval_shape(lambda p: initial_state(p, optimizer), params)


def learner_state_bytes(cfg: RunConfig, config: DecoderConfig, devices: list, vocab_limit: int | None = None) -> int:
    """The learner's state (parameters, optimizer state) on its busiest chip of ``learner.mesh``
    over ``devices``: shapes placed by the run's shardings, nothing compiled. A lower bound of
    the step's peak, which rules a chip count out before a compile would."""
    mesh = make_mesh(cfg.learner.mesh, devices)
    _, params = student_decoder(cfg, config, cfg.student.dtype, vocab_limit)
    state = abstract_train_state(cfg, params)
    return bytes_per_device(with_shardings(state, state_shardings(state, mesh)))


def teacher_weight_bytes(
    cfg: RunConfig, source: TeacherSource, config: DecoderConfig, devices: list, vocab_limit: int | None = None
) -> int:
    """A teacher's weights on its busiest chip of ``stages.scoring_mesh`` over ``devices``
    (as :func:`learner_state_bytes`: a lower bound of its scoring's peak)."""
    mesh = stage_mesh(devices, cfg.stages.scoring_mesh)
    _, params = abstract_decoder(config, source.dtype, vocab_limit)
    return bytes_per_device(with_shardings(params, parameter_shardings(params, mesh)))


def compile_learner_step(
    cfg: RunConfig, config: DecoderConfig, devices: list, shapes: Shapes, vocab_limit: int | None = None
) -> StageFigures:
    """One optimizer step of ``learner.batch_size / learner.mini_batches`` rows, on the
    learner's mesh (``learner.mesh`` over ``devices``), as the run jits it."""
    mesh = make_mesh(cfg.learner.mesh, devices)
    attention = resolve_implementation(cfg.student.attention, target_platform(devices))
    graphdef, params = student_decoder(cfg, config, cfg.student.dtype, vocab_limit, attention)
    optimizer = run_optimizer(cfg)
    state = abstract_train_state(cfg, params)
    rows = cfg.learner.batch_size // cfg.learner.mini_batches
    batch = abstract_learner_batch(cfg, rows, shapes, (graphdef, params))
    loss = PolicyLoss.from_config(cfg)
    heads = teacher_heads(cfg, vocab_limit, mesh)  # the teachers' heads: arguments here, not constants

    def step_on(graph: nnx.GraphDef, remat: Remat) -> Callable:
        def step(state: TrainState, batch: LearnerBatch, heads: tuple) -> Any:
            with_heads = dataclasses.replace(PolicyLoss.from_config(cfg, heads), remat=remat)
            function = train_step_function(
                graph, optimizer, with_heads, micro_batches=cfg.learner.micro_batches, dropout_seed=cfg.dropout_seed
            )
            return function(state, batch)

        return step

    jitted = jit_train_step(step_on(graphdef, loss.remat), mesh, state_example=state)  # as the run jits it
    with mesh_context(mesh):
        lowered = jitted.lower(
            with_shardings(state, state_shardings(state, mesh)),
            with_shardings(batch, batch_shardings(batch, mesh)),
            heads,
        )
    tokens = rows * (shapes.prompt_tokens + shapes.response_tokens)
    figures = _figures("learner step", len(mesh.devices.flat), rows, tokens, lowered)

    # the work, counted on the plain attention (a Pallas kernel's dots are not in the jaxpr)
    plain, _ = student_decoder(cfg, config, cfg.student.dtype, vocab_limit, "xla")

    def counted(remat: Remat) -> float:
        return matmul_flops(step_on(plain, remat), state, batch, heads) / len(devices)

    head = dataclasses.replace(config, vocab_size=vocab_limit or config.vocab_size)
    textbook = transformer_flops(
        head, rows, shapes.prompt_tokens + shapes.response_tokens, shapes.response_tokens, backward=True
    )
    return dataclasses.replace(
        figures,
        executed_flops=counted(loss.remat),
        model_flops=counted("none"),
        textbook_flops=textbook / len(devices),
    )


def compile_teacher_scoring(
    cfg: RunConfig,
    config: DecoderConfig,
    devices: list,
    shapes: Shapes,
    rows: int,
    vocab_limit: int | None = None,
    source: TeacherSource | None = None,
    stage: str = "teacher scoring",
) -> StageFigures:
    """Teacher ``source``'s (default: ``cfg.teacher``) scoring of one rollout group of
    ``rows``, on the scoring stage's mesh (``stages.scoring_mesh`` over ``devices``), as
    :class:`TeacherScorer` jits it."""
    source = source or cfg.teacher
    mesh = stage_mesh(devices, cfg.stages.scoring_mesh)
    attention = resolve_implementation(source.attention, target_platform(devices))
    graphdef, params = abstract_decoder(config, source.dtype, vocab_limit, attention)
    batch = abstract_learner_batch(cfg, rows, shapes).rollout
    key = jax.eval_shape(lambda: jax.random.key(0))
    scoring = source.scoring(cfg.scoring)
    score = jax.jit(teacher_score_function(graphdef, scoring))
    with mesh_context(mesh):
        lowered = score.lower(
            with_shardings(params, parameter_shardings(params, mesh)),
            with_shardings(batch, batch_shardings(batch, mesh)),
            with_shardings(key, NamedSharding(mesh, PartitionSpec())),
        )
    tokens = rows * (shapes.prompt_tokens + shapes.response_tokens)
    figures = _figures(stage, len(mesh.devices.flat), rows, tokens, lowered)
    plain, _ = abstract_decoder(config, source.dtype, vocab_limit, "xla")
    counted = matmul_flops(teacher_score_function(plain, scoring), params, batch, key) / len(devices)
    head = dataclasses.replace(config, vocab_size=vocab_limit or config.vocab_size)
    textbook = transformer_flops(
        head, rows, shapes.prompt_tokens + shapes.response_tokens, shapes.response_tokens, backward=False
    )
    exchange = teacher_exchange_bytes(config, mesh, tokens, jnp.dtype(source.dtype).itemsize)
    return dataclasses.replace(
        figures,
        executed_flops=counted,
        model_flops=counted,
        textbook_flops=textbook / len(devices),
        interconnect_bytes=exchange.uniform,
        interconnect_worst_bytes=exchange.worst,
    )


def teacher_exchange_bytes(config: DecoderConfig, mesh: Mesh, tokens: int, itemsize: int) -> ExchangeBytes:
    """What one chip of ``mesh`` sends to the others in a forward of ``tokens`` tokens (all
    chips together) of a mixture of experts split over it: :func:`~asyncopd_jax.models.moe.exchange_bytes`
    at its share of the tokens, by the exchange the chips' platform runs
    (:func:`~asyncopd_jax.models.moe.routed_exchange`: routed rows on TPU and GPU chips,
    where a GPU plan's XLA:CPU proxy compiles the padded one); 0 for a dense model or
    experts not split."""
    layout = None
    if config.num_experts:
        layout = expert_layout((config.num_experts, config.hidden_size, config.moe_intermediate_size), mesh)
    if layout is None:
        return ExchangeBytes(0.0, 0.0)
    routed = routed_exchange(target_platform(list(mesh.devices.flat)))
    return exchange_bytes(config, -(-tokens // layout.shards), layout.devices, itemsize, routed)


def rollout_sampling(cfg: RunConfig, shapes: Shapes) -> SamplingParams:
    """The rollout engine's sampling parameters at the planned answer length."""
    return dataclasses.replace(cfg.sampling, max_new_tokens=shapes.response_tokens)


def rollout_engine(
    cfg: RunConfig, config: DecoderConfig, shapes: Shapes, mesh: Mesh | None = None, vocab_limit: int | None = None
) -> Engine:
    """The rollout stage's engine at the planned answer length, on ``mesh`` (None: the
    default device), for what it says of itself: its programs' shapes, its cost."""
    graphdef, _ = student_decoder(cfg, config, cfg.student.dtype, vocab_limit, decoded=True)
    return make_sampler(graphdef, rollout_sampling(cfg, shapes), mesh=mesh)


def sampler_work(config: DecoderConfig, rows: int, shapes: Shapes) -> dict[str, int]:
    """The sampler's FLOPs per call of ``rows`` rows, by the textbook (its loops hide them from
    both the compiler, which counts a loop's body once, and a count of its jaxpr): a forward
    over the tokens written, the LM head on each row's next token only; a decode step's
    attention reads all P + T slots of its row's cache. ``config``: at the vocabulary used."""
    p, t = shapes.prompt_tokens, shapes.response_tokens
    q = config.num_attention_heads * config.head_dim
    return {
        "prefill": transformer_flops(config, rows, p, 1, backward=False),
        "decode": transformer_flops(config, rows, 1, 1, backward=False)
        + rows * config.num_hidden_layers * 4 * (p + t) * q,
        "recompute": transformer_flops(config, rows, p + t, 1, backward=False),
    }


def compile_sampler(
    cfg: RunConfig, config: DecoderConfig, devices: list, shapes: Shapes, rows: int, vocab_limit: int | None = None
) -> list[StageFigures]:
    """The rollout stage's sampler on its mesh (``stages.rollout_mesh`` over ``devices``),
    for one group of ``rows`` prompts: prefill, one decode step (a chunk of
    ``sampling.chunk_steps`` steps compiled, its figures per step: the compiler counts a
    loop's body once) and the KV cache's rewrite after a weight swap, each holding the
    weights as the rollout stage decodes with them (the published dtype, by the partition
    rules), beside what it holds to merge a LoRA student's versions (:func:`resident_bytes`)."""
    mesh = stage_mesh(devices, cfg.stages.rollout_mesh)
    graphdef, _ = student_decoder(cfg, config, cfg.published_dtype, vocab_limit, decoded=True)
    sampling = rollout_sampling(cfg, shapes)
    weights = sampler_weights(cfg, config, devices, vocab_limit)
    resident = resident_bytes(cfg, config, devices, vocab_limit)
    # the rows one decode call holds: the group's (static), or ``sampling.slots`` over the
    # paged pool (continuous: its prefill admits a whole set of slots at once, the worst
    # case, and its decode reads every page of the longest sequence)
    engine = make_sampler(graphdef, sampling, mesh=mesh)
    rows = engine.decode_rows(rows)
    lowered = engine.lower(weights, rows, shapes.prompt_tokens)
    n, p, t = len(mesh.devices.flat), shapes.prompt_tokens, shapes.response_tokens
    head = dataclasses.replace(config, vocab_size=vocab_limit or config.vocab_size)
    work = sampler_work(head, rows, shapes)
    tokens = {"prefill": rows * p, "decode": rows, "recompute": rows * (p + t)}
    figures = []
    for name, low in lowered.items():
        f = _figures(f"sampler {name}", n, rows, tokens[name], low)
        flops = work[name] / n
        f = dataclasses.replace(f, executed_flops=flops, model_flops=flops, textbook_flops=flops)
        figures.append(dataclasses.replace(f, resident_bytes=resident))
    return figures


def decode_bytes(
    cfg: RunConfig, config: DecoderConfig, devices: list, shapes: Shapes, vocab_limit: int | None = None
) -> DecodeBytes | None:
    """What one decode step reads per chip of the rollout stage on ``devices``, where the
    engine models its steps from it (:meth:`~asyncopd_jax.sampling.Engine.decode_cache`;
    None where it does not): the weights in ``sampling.compute_dtype`` and the KV cache per
    token, as the engine's own carry places them (shapes only: nothing compiled or allocated)."""
    engine = rollout_engine(cfg, config, shapes, stage_mesh(devices, cfg.stages.rollout_mesh), vocab_limit)
    weights = sampler_weights(cfg, config, devices, vocab_limit)
    cache = engine.decode_cache(weights, cfg.group_size, shapes.prompt_tokens)
    if cache is None:
        return None
    pool, tokens = cache
    computed = jax.tree_util.tree_map(
        lambda x, c: jax.ShapeDtypeStruct(x.shape, c.dtype, sharding=x.sharding),
        weights,
        jax.eval_shape(lambda w: cast_floating(w, cfg.sampling.compute_dtype), weights),
    )
    return DecodeBytes(weights=bytes_per_device(computed), kv_per_token=bytes_per_device(pool) / tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every stage's figures on one topology."""

    topology: Topology
    shapes: Shapes
    stages: list[StageFigures]
    sources: dict[str, str]  # model → the config.json it was read from
    balance: dict[str, float] = dataclasses.field(default_factory=dict)  # stage → roofline s per rollout batch
    notes: list[str] = dataclasses.field(default_factory=list)  # what the per-stage rows leave out
    answers: Answers | None = None  # the answer lengths the balance assumes
    rollout: RolloutCost | None = None  # one sampler's share of the balance, split
    swap: SwapFigures | None = None  # one published version's cost


@dataclasses.dataclass(frozen=True)
class Models:
    """The architectures a plan compiles: the student, each in-process teacher (its source,
    architecture and stage name), the ids both embed, and where each came from."""

    student: DecoderConfig
    teachers: list[tuple[TeacherSource, DecoderConfig, str]]
    vocab_limit: int | None
    sources: dict[str, str]

    def scoring_shares(self, cfg: RunConfig) -> dict[str, float]:
        """Each teacher's share of a group's rows (its mixture weight, or equal shares)."""
        weights = {s.name: s.weight if cfg.routing.by == "mixture" else 1.0 for s in cfg.teacher_sources}
        return {name: w / sum(weights.values()) for name, w in weights.items()}


def read_models(cfg: RunConfig, shapes: Shapes) -> Models:
    """``cfg``'s student and teachers (their ``config.json`` only; served teachers are
    named, not planned), at ``shapes.layers`` where set."""
    student, student_source = architecture(cfg.student, shapes.layers)
    sources = {"student": student_source}
    vocab_limit = None
    several = len(cfg.teacher_sources) > 1
    in_process: list[tuple[TeacherSource, DecoderConfig, str]] = []
    for source in cfg.teacher_sources:
        name = f"teacher {source.name}" if several else "teacher"
        if source.served:  # on the server's own hardware: nothing of it runs on these chips
            sources[name] = f"external, served at {source.server.url} (not planned on these chips)"
            continue
        teacher, sources[name] = architecture(source, shapes.layers)
        in_process.append((source, teacher, f"scoring {source.name}" if several else "teacher scoring"))
        if teacher.vocab_size != student.vocab_size:  # the ids both embed (a run asks the tokenizer)
            limit = min(teacher.vocab_size, student.vocab_size)
            vocab_limit = limit if vocab_limit is None else min(vocab_limit, limit)
    if several:
        sources["routing"] = (
            "each teacher scores its weight's share of the rows"
            if cfg.routing.by == "mixture"
            else f"by the dataset's {cfg.routing.field!r}: equal shares assumed"
        )
    return Models(student, in_process, vocab_limit, sources)


def layout_of(cfg: RunConfig) -> Layout:
    """Where each stage of ``cfg`` runs, as the run itself would place it."""
    return plan_layout(cfg, run_path=Path(cfg.output_dir) / cfg.name, available_cores=())


def hidden_payload_notes(
    cfg: RunConfig, shapes: Shapes, vocab_limit: int | None, learner_chips: int, chip: Chip
) -> list[str]:
    """What the teachers' hidden states (``payload: hidden``) cost besides the stages' own
    figures: their bytes per batch from scoring to the learner, against the top-K scores',
    and the heads the learner holds and their FLOPs (both inside the learner step's
    figures: the learner applies each teacher's head to every row of the batch, once in the
    forward pass and again in the backward, which recomputes each block's logits, rows split
    over its ``learner_chips``)."""
    hidden = hidden_teachers(cfg)
    if not hidden:
        return []
    width = max(config.hidden_size for config in hidden)
    tokens = cfg.learner.batch_size * shapes.response_tokens
    payload = tokens * width * jnp.dtype(cfg.scoring.hidden_dtype).itemsize
    k = cfg.scoring.topk or 1
    topk = tokens * k * (4 + jnp.dtype(cfg.scoring.store_dtype).itemsize)  # int32 ids + log q
    heads = sum(
        width * (vocab_limit or config.vocab_size) * jnp.dtype(source.dtype).itemsize
        for config, source in zip(hidden, cfg.teacher_sources)
    )
    flops = sum(2 * 2 * tokens * width * (vocab_limit or config.vocab_size) for config in hidden)
    per_chip = flops / learner_chips
    return [
        f"the teachers' hidden states: {payload / 2**20:.2f} MiB per batch from scoring to the learner ({width} "
        f"a position in {cfg.scoring.hidden_dtype}; a top-{k} cache: {topk / 2**20:.2f} MiB); the learner holds "
        f"their heads, {heads / GIB:.2f} GiB on every learner chip, and applies them at {flops / 1e12:.2f} TFLOP "
        f"per batch ({per_chip / 1e12:.2f} a learner chip: {per_chip / chip.peak_flops * 1e3:.1f} ms at "
        f"{chip.name}'s peak), in its step's figures"
    ]


def make_plan(
    cfg: RunConfig,
    topology: Topology,
    shapes: Shapes,
    mean_response_tokens: float | None = None,
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S,
) -> Plan:
    """Compile every stage of ``cfg`` on ``topology`` (see the module docstring), and balance
    them per rollout batch (:mod:`asyncopd_jax.scale.balance`) with answers of
    ``mean_response_tokens`` expected (None: every answer to the limit) and a weight swap per
    published version (:mod:`asyncopd_jax.scale.swaps`; ``storage_bytes_per_s``: the storage
    route's rate)."""
    answers = Answers(shapes.prompt_tokens, shapes.response_tokens, mean_response_tokens or shapes.response_tokens)
    models = read_models(cfg, shapes)
    student, vocab_limit, in_process = models.student, models.vocab_limit, models.teachers
    sources = dict(models.sources)
    count = len(topology.devices)
    chips = topology.chip

    # where each stage runs on the topology's chips, as the run itself would place it
    layout = layout_of(cfg)

    def devices_of(role: Role) -> list:
        """The first ``role`` stage's chips (each of the role's stages holds as many)."""
        return [topology.devices[i] for i in device_ids(layout, layout.of_role(role)[0], count, topology.platform)]

    learner = compile_learner_step(cfg, student, devices_of("learner"), shapes, vocab_limit)
    rollouts = len(layout.of_role("rollout"))
    group = layout.group_size
    groups = cfg.learner.batch_size // group  # rollout groups per batch
    sampler = compile_sampler(cfg, student, devices_of("rollout"), shapes, group, vocab_limit)
    engine = rollout_engine(cfg, student, shapes)  # what the engine says of its cost and programs
    held = decode_bytes(cfg, student, devices_of("rollout"), shapes, vocab_limit)
    _, published = published_student(cfg, student, vocab_limit)
    swap = swap_figures(
        layout.snapshots,
        published,
        received_weights(cfg, student, devices_of("rollout"), vocab_limit),
        learner_chips=len(devices_of("learner")),
        samplers=rollouts,
        chip=chips,
        storage_bytes_per_s=storage_bytes_per_s,
        merge=cfg.student.lora.merged_at_swap,
    )
    prefill, decode, recompute = (f.roofline_seconds(chips) for f in sampler)
    rollout = rollout_seconds(
        cfg,
        engine,
        dataclasses.replace(student, vocab_size=vocab_limit or student.vocab_size),
        answers,
        samplers=rollouts,
        rows=sampler[1].rows,
        chips=sampler[1].devices,
        prefill=prefill,
        decode=decode,
        recompute=recompute,
        held=held,
        swap=swap,
        chip=chips,
    )
    balance = {  # a stage that does not compile has no time (NaN)
        "rollout": rollout.total,
        "learning": cfg.learner.mini_batches * learner.roofline_seconds(chips) + swap.publish_seconds,
    }
    if any(s.error for s in sampler):
        balance["rollout"] = float("nan")
    if learner.error:
        balance["learning"] = float("nan")
    stages = [learner, *sampler]
    if in_process and cfg.needs_teacher_scores:
        scorers = len(layout.of_role("scoring"))  # one per scoring process, or per rollout process that scores
        shares = models.scoring_shares(cfg)
        seconds = 0.0
        for source, teacher, stage in in_process:
            scoring = compile_teacher_scoring(
                cfg, teacher, devices_of("scoring"), shapes, group, vocab_limit, source, stage
            )
            stages.append(scoring)
            # a teacher scores its share of each group's rows: that share of a whole group's time
            seconds += float("nan") if scoring.error else shares[source.name] * scoring.roofline_seconds(chips)
        balance["scoring"] = -(-groups // scorers) * seconds
    programs = engine.program_shapes(group, shapes.prompt_tokens)
    notes = [
        f"the rollout engine ({cfg.sampling.engine}) compiles {sum(map(len, programs.values()))} programs at most "
        f"for these shapes: " + ", ".join(f"{name} {len(listed)}" for name, listed in programs.items())
    ]
    notes += hidden_payload_notes(cfg, shapes, vocab_limit, len(devices_of("learner")), chips)
    shared = [f for f in stages if f.stage.startswith("scoring ") and not f.error]
    if len(shared) > 1:  # each row counts its own teacher's weights; all of them lie on the scoring chips
        inputs = sum(f.argument_bytes for f in shared)
        peak = inputs + max(f.temp_bytes for f in shared)
        notes.append(
            f"the {len(shared)} teachers share the scoring chips: weights and inputs {inputs / GIB:.2f} GiB + the "
            f"largest scoring's temporaries = {peak / GIB:.2f} GiB per chip ({peak / chips.hbm_bytes:.0%} of HBM)"
        )
    return Plan(topology, shapes, stages, sources, balance, notes, answers, rollout, swap)
