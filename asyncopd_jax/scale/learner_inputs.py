"""What ``asyncopd plan`` compiles the learner step on, as shapes: the models'
architectures (``config.json`` only), one step's batch as the rollout and scoring stages
make it, and the teachers' LM heads the learner holds for the exact KL from their hidden
states."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.config import ModelSource, RunConfig
from asyncopd_jax.learner.step import LearnerBatch, PolicyLoss, make_proximal_fn
from asyncopd_jax.models.config import DecoderConfig, read_hf_config
from asyncopd_jax.tasks.assets import resolve_model_path

if TYPE_CHECKING:  # the plan defines the shapes and imports this module
    from asyncopd_jax.scale.plan import Shapes

ARCHITECTURES = Path(__file__).parent / "architectures"  # config.json of models a plan may name


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


def hidden_teachers(cfg: RunConfig) -> list[DecoderConfig]:
    """The architectures of the teachers that ship hidden states (``payload: hidden``), in
    the run's order (their ``config.json``)."""
    return [
        architecture(source)[0]
        for source in cfg.teacher_sources
        if not source.served and source.scoring(cfg.scoring).payload == "hidden"
    ]


def teacher_heads(cfg: RunConfig, vocab_limit: int | None, mesh: Mesh) -> tuple[Any, ...]:
    """The teachers' LM heads the learner holds for an estimator that reads their hidden
    states, as shapes replicated on the learner's ``mesh`` (padded to the widest teacher's
    rows, as :class:`~asyncopd_jax.pipeline.learner_stage.LearnerStage` holds them); ()
    else."""
    if not cfg.estimator.spec.needs_teacher_hidden:
        return ()
    teachers = hidden_teachers(cfg)
    width = max(t.hidden_size for t in teachers)
    replicated = NamedSharding(mesh, PartitionSpec())
    return tuple(
        jax.ShapeDtypeStruct((width, vocab_limit or t.vocab_size), jnp.dtype(s.dtype), sharding=replicated)
        for t, s in zip(teachers, cfg.teacher_sources)
    )


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
        hidden = hidden_teachers(cfg)
        if hidden:  # the teachers' hidden states, padded to the widest; each row's teacher where several
            width = max(config.hidden_size for config in hidden)
            several = len(cfg.teacher_sources) > 1
            cache = dataclasses.replace(
                cache,
                hidden=a(b, t, width, dtype=jnp.dtype(cfg.scoring.hidden_dtype)),
                teacher_index=a(b, t, dtype=jnp.int32) if several else None,
            )
    batch = LearnerBatch(rollout=rollout, cache=cache)
    if not spec.needs_proximal:
        return batch
    if model is None:
        raise ValueError(f"estimator {spec.name!r} reads proximal log-probs: their shapes need the model")
    proximal = jax.eval_shape(make_proximal_fn(model[0], PolicyLoss.from_config(cfg)), model[1], batch)
    return dataclasses.replace(batch, proximal=proximal)
