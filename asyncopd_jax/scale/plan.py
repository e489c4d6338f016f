"""``asyncopd plan``: every stage of a run compiled ahead of time at its real shapes, on the
devices it is placed on, by the compiler of the chips it will run on.

Nothing is allocated: parameters, optimizer state and batches are ``ShapeDtypeStruct``
placed by the same shardings the run uses, and ``jax.jit(f).lower(...).compile()`` returns
the executable's memory analysis (per chip: arguments, outputs, temporaries) and cost
analysis (per chip: FLOPs, bytes accessed). From those a stage's roofline time per call is
``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)``: a lower bound, reached by no real
program, that ranks the stages and says how many chips each needs.

Shapes: B rows per call, P prompt slots, T response slots, S = P + T, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.config import ModelSource, RunConfig
from asyncopd_jax.learner.optimizer import make_optimizer
from asyncopd_jax.learner.sharding import batch_shardings, make_mesh, state_shardings
from asyncopd_jax.learner.step import (
    LearnerBatch,
    PolicyLoss,
    TrainState,
    jit_train_step,
    make_proximal_fn,
    train_step_function,
)
from asyncopd_jax.models.config import DecoderConfig, read_hf_config
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.pipeline.placement import parse_id_list
from asyncopd_jax.pipeline.stage import with_shardings
from asyncopd_jax.scale.chips import GIB, Chip, Topology
from asyncopd_jax.tasks.assets import resolve_model_path

ARCHITECTURES = Path(__file__).parent / "architectures"  # config.json of models a plan may name


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
    flops: float = 0.0  # per chip
    bytes_accessed: float = 0.0  # per chip
    error: str | None = None

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to an argument + temporaries: the most this call holds."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def roofline_seconds(self, chip: Chip) -> float:
        return max(self.flops / chip.peak_flops, self.bytes_accessed / chip.hbm_bytes_per_s)


def architecture(source: ModelSource, layers: int | None = None) -> tuple[DecoderConfig, str]:
    """A model's config (``config.json`` only; no weights are read) and where it came from.

    A path that does not exist here but names a model whose config ships with asyncopd
    (``/models/Qwen3-8B`` → ``Qwen3-8B``) uses that config, so a plan can be made on a
    machine that has none of the weights."""
    directory = resolve_model_path(source.path)
    if not (directory / "config.json").is_file() and (ARCHITECTURES / directory.name / "config.json").is_file():
        directory = ARCHITECTURES / directory.name
    config, _ = read_hf_config(directory)
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    return config, str(directory / "config.json")


def abstract_learner_batch(
    cfg: RunConfig, rows: int, shapes: Shapes, model: tuple[nnx.GraphDef, nnx.State] | None = None
) -> LearnerBatch:
    """The shapes of one optimizer step's batch as the rollout and scoring stages make it
    (the optional fields the config turns on, as :class:`RolloutBatch` and
    :class:`TeacherScoreCache` document them), with the proximal log-probs the learner
    computes where the estimator reads them (of ``model``: graph and abstract parameters)."""
    b, p, t = rows, shapes.prompt_tokens, shapes.response_tokens

    def a(*shape: int, dtype: Any = jnp.float32) -> Any:  # a ShapeDtypeStruct standing for an Array
        return jax.ShapeDtypeStruct(shape, dtype)

    def ids_and_logp(n: int) -> tuple[Any, Any]:
        return (a(b, t, n, dtype=jnp.int32), a(b, t, n)) if n else (None, None)

    n, k = cfg.sampling.num_candidates, cfg.sampling.student_topk
    candidate_ids, candidate_logp = ids_and_logp(n)
    topk_ids, topk_logp = ids_and_logp(k)
    rollout = RolloutBatch(
        prompt_tokens=a(b, p, dtype=jnp.int32),
        prompt_mask=a(b, p, dtype=jnp.bool_),
        response_tokens=a(b, t, dtype=jnp.int32),
        response_mask=a(b, t, dtype=jnp.bool_),
        behavior_logp=a(b, t),
        token_version=a(b, t, dtype=jnp.int32),
        candidate_ids=candidate_ids,
        candidate_behavior_logp=candidate_logp,
        student_topk_ids=topk_ids,
        student_topk_behavior_logp=topk_logp,
        advantages=a(b, t) if cfg.algorithm == "rl" else None,
        reference_logp=a(b, t) if cfg.reference.path else None,
    )
    spec = cfg.estimator.spec
    cache = None
    if spec.needs_teacher_scores(rl=cfg.algorithm == "rl", distill_coef=cfg.rl.distill_coef):
        store = jnp.dtype(cfg.scoring.store_dtype)
        teacher_topk = ids_and_logp(cfg.scoring.topk)
        samples = ids_and_logp(cfg.scoring.num_samples)
        cache = TeacherScoreCache(
            token_logp=a(b, t, dtype=store),
            candidate_logp=a(b, t, n, dtype=store) if n else None,
            student_topk_logp=a(b, t, k, dtype=store) if k else None,
            topk_ids=teacher_topk[0],
            topk_logp=None if teacher_topk[1] is None else a(b, t, cfg.scoring.topk, dtype=store),
            sample_ids=samples[0],
            sample_logp=None if samples[1] is None else a(b, t, cfg.scoring.num_samples, dtype=store),
        )
    batch = LearnerBatch(rollout=rollout, cache=cache)
    if not spec.needs_proximal:
        return batch
    if model is None:
        raise ValueError(f"estimator {spec.name!r} reads proximal log-probs: their shapes need the model")
    proximal = jax.eval_shape(make_proximal_fn(model[0], PolicyLoss.from_config(cfg)), model[1], batch)
    return dataclasses.replace(batch, proximal=proximal)


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


def stage_device_ids(spec: str, count: int, default: range) -> list[int]:
    """A stage's devices on the topology: ``stages.<role>_devices`` or ``default``."""
    ids = list(parse_id_list(spec)) if spec else list(default)
    if ids and max(ids) >= count:
        raise ValueError(f"stages devices {spec!r} name device {max(ids)}; the topology has {count} (0-{count - 1})")
    return ids


def compile_learner_step(
    cfg: RunConfig, config: DecoderConfig, devices: list, shapes: Shapes, vocab_limit: int | None = None
) -> StageFigures:
    """One optimizer step of ``learner.batch_size / learner.mini_batches`` rows, on the
    learner's mesh (``learner.mesh`` over ``devices``), as the run jits it."""
    mesh = make_mesh(cfg.learner.mesh, devices)
    graphdef, params = abstract_decoder(config, cfg.student.dtype, vocab_limit)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    state = jax.eval_shape(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)), params)
    rows = cfg.learner.batch_size // cfg.learner.mini_batches
    batch = abstract_learner_batch(cfg, rows, shapes, (graphdef, params))
    step = train_step_function(
        graphdef, optimizer, PolicyLoss.from_config(cfg), micro_batches=cfg.learner.micro_batches
    )
    jitted = jit_train_step(step, mesh, state_example=state)  # as make_train_step jits it for the run
    lowered = jitted.lower(
        with_shardings(state, state_shardings(state, mesh)), with_shardings(batch, batch_shardings(batch, mesh))
    )
    tokens = rows * (shapes.prompt_tokens + shapes.response_tokens)
    return _figures("learner step", len(mesh.devices.flat), rows, tokens, lowered)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every stage's figures on one topology."""

    topology: Topology
    shapes: Shapes
    stages: list[StageFigures]
    sources: dict[str, str]  # model → the config.json it was read from


def make_plan(cfg: RunConfig, topology: Topology, shapes: Shapes) -> Plan:
    """Compile every stage of ``cfg`` on ``topology`` (see the module docstring)."""
    student, student_source = architecture(cfg.student, shapes.layers)
    sources = {"student": student_source}
    vocab_limit = None
    if cfg.teacher.path:
        teacher, sources["teacher"] = architecture(cfg.teacher, shapes.layers)
        if teacher.vocab_size != student.vocab_size:  # the ids both embed (a run asks the tokenizer)
            vocab_limit = min(teacher.vocab_size, student.vocab_size)
    count = len(topology.devices)
    learner_ids = stage_device_ids(cfg.stages.learner_devices, count, range(count))
    learner = compile_learner_step(cfg, student, [topology.devices[i] for i in learner_ids], shapes, vocab_limit)
    return Plan(topology, shapes, [learner], sources)


def format_plan(plan: Plan) -> str:
    """The plan as a table, one row per stage, per chip."""
    chip = plan.topology.chip
    lines = [
        f"topology {plan.topology.name}: {len(plan.topology.devices)} × {chip.name} "
        f"({chip.hbm_bytes / GIB:.2f} GiB, {chip.peak_flops / 1e12:.0f} TFLOP/s, "
        f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s), compiled by {plan.topology.compiler}",
        f"shapes: {plan.shapes.prompt_tokens} prompt + {plan.shapes.response_tokens} response tokens"
        + (f", {plan.shapes.layers} layers (reduced)" if plan.shapes.layers else ""),
        *(f"{name}: {source}" for name, source in plan.sources.items()),
        "",
        f"{'stage':<16}{'chips':>6}{'rows':>6}{'args GiB':>10}{'temp GiB':>10}{'peak GiB':>10}{'of HBM':>8}"
        f"{'TFLOP':>9}{'roofline s':>12}",
    ]
    for s in plan.stages:
        if s.error:
            lines.append(f"{s.stage:<16}{s.devices:>6}{s.rows:>6}  does not compile: {s.error}")
            continue
        lines.append(
            f"{s.stage:<16}{s.devices:>6}{s.rows:>6}{s.argument_bytes / GIB:>10.2f}{s.temp_bytes / GIB:>10.2f}"
            f"{s.peak_bytes / GIB:>10.2f}{s.peak_bytes / chip.hbm_bytes:>8.0%}{s.flops / 1e12:>9.1f}"
            f"{s.roofline_seconds(chip):>12.3f}"
        )
    return "\n".join(lines)
