"""The models a stage holds, loaded from local directories (``builtin:NAME`` or a Hugging
Face layout): straight into their shards on a stage's mesh (by the partition rules; no
whole copy on any device first), or the student's graph alone (shapes, no weights) for a
stage that receives the policy's weights from the learner."""

from __future__ import annotations

from typing import Any

from flax import nnx
from jax.sharding import Mesh

from asyncopd_jax.config import ModelSource, RunConfig
from asyncopd_jax.models import Decoder, from_pretrained, load_tokenizer
from asyncopd_jax.models.attention import resolve_implementation
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.lora import NO_ADAPTERS, add_adapters
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.snapshots import as_published
from asyncopd_jax.tasks.assets import resolve_model_path


def load_model(source: ModelSource, vocab_limit: int | None, mesh: Mesh) -> Decoder:
    """A model loaded straight into its shards on ``mesh`` (by the partition rules; no
    whole copy on any device first)."""
    model = from_pretrained(resolve_model_path(source.path), dtype=source.dtype, mesh=mesh)
    model.vocab_limit = vocab_limit
    model.attention = resolve_implementation(source.attention, mesh.devices.flat[0].platform)
    return model


def load_student(cfg: RunConfig, vocab_limit: int | None, mesh: Mesh) -> Decoder:
    """The student the learner starts from: its weights (:func:`load_model`) and, where
    ``student.lora`` has a rank, fresh adapters on them (seeded by the run's seed)."""
    return add_adapters(load_model(cfg.student, vocab_limit, mesh), cfg.student.lora, nnx.Rngs(cfg.seed))


def student_graph(cfg: RunConfig, models: RunModels) -> tuple[nnx.GraphDef, Any]:
    """The student's graph and abstract parameters (shapes and dtypes; nothing allocated):
    what a rollout stage needs to receive the policy's weights, in the published dtype."""
    graphdef, abstract = abstract_decoder(
        models.student_config, cfg.published_dtype, models.vocab_limit, lora=cfg.student.lora
    )
    return graphdef, as_published(abstract, cfg.published_dtype)  # a LoRA student's fp32 adapters too


def sampler_graph(cfg: RunConfig, models: RunModels) -> nnx.GraphDef:
    """The graph a rollout stage decodes with: the student's, without its adapters when they
    are merged at the swap."""
    lora = NO_ADAPTERS if cfg.student.lora.merged_at_swap else cfg.student.lora
    return abstract_decoder(models.student_config, cfg.published_dtype, models.vocab_limit, lora=lora)[0]


def load_model_and_tokenizer(path: str, dtype: str) -> tuple[nnx.Module, Any]:
    """A model (on the default device) and its tokenizer, from a directory or ``builtin:NAME``."""
    directory = resolve_model_path(path)
    return from_pretrained(directory, dtype=dtype), load_tokenizer(directory)
