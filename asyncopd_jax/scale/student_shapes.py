"""The student as a plan sees it (shapes only, nothing allocated): as the learner trains it,
as the weights channel delivers it to a rollout stage, and as that stage decodes with it.

These differ for a LoRA student only: the learner and the channel hold its adapters beside
the base, and a sampler that merges them at the swap (``student.lora.sampler: merged``)
decodes a plain model while it keeps the base and adapters to merge the next version from
(``pipeline/adapter_snapshots.py``).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from asyncopd_jax.config import RunConfig
from asyncopd_jax.models.attention import Implementation
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.lora import NO_ADAPTERS
from asyncopd_jax.models.partitioning import parameter_shardings
from asyncopd_jax.pipeline.devices import stage_mesh, with_shardings
from asyncopd_jax.pipeline.snapshots import as_published
from asyncopd_jax.scale.swaps import bytes_per_device


def student_decoder(
    cfg: RunConfig,
    config: DecoderConfig,
    dtype: str,
    vocab_limit: int | None = None,
    attention: Implementation = "xla",
    decoded: bool = False,
) -> tuple[nnx.GraphDef, Any]:
    """The student's graph and parameters as shapes, with its LoRA adapters
    (``student.lora``), as the learner trains them and the channel delivers them;
    ``decoded``: as the sampler decodes with them (a plain model where it merges them at
    the swap)."""
    lora = NO_ADAPTERS if decoded and cfg.student.lora.merged_at_swap else cfg.student.lora
    return abstract_decoder(config, dtype, vocab_limit, attention, lora=lora)


def published_student(
    cfg: RunConfig, config: DecoderConfig, vocab_limit: int | None = None, decoded: bool = False
) -> tuple[nnx.GraphDef, Any]:
    """The student as the channel ships it: every floating weight in the published dtype
    (``stages.snapshot_dtype``; a LoRA student's fp32 adapters too, as the trainer casts them)."""
    graphdef, params = student_decoder(cfg, config, cfg.published_dtype, vocab_limit, decoded=decoded)
    return graphdef, as_published(params, cfg.published_dtype)


def received_weights(cfg: RunConfig, config: DecoderConfig, devices: list, vocab_limit: int | None = None) -> Any:
    """The student's parameters as a rollout stage receives them (the published dtype, with a
    LoRA student's adapters, placed by the partition rules on ``stages.rollout_mesh`` over
    ``devices``): shapes only."""
    mesh = stage_mesh(devices, cfg.stages.rollout_mesh)
    _, params = published_student(cfg, config, vocab_limit)
    return with_shardings(params, parameter_shardings(params, mesh))


def sampler_weights(cfg: RunConfig, config: DecoderConfig, devices: list, vocab_limit: int | None = None) -> Any:
    """The student's parameters as a rollout stage decodes with them: those it receives, or
    merged into a plain model (``student.lora.sampler: merged``); shapes only."""
    if not cfg.student.lora.merged_at_swap:
        return received_weights(cfg, config, devices, vocab_limit)
    mesh = stage_mesh(devices, cfg.stages.rollout_mesh)
    _, params = published_student(cfg, config, vocab_limit, decoded=True)
    return with_shardings(params, parameter_shardings(params, mesh))


def resident_bytes(cfg: RunConfig, config: DecoderConfig, devices: list, vocab_limit: int | None = None) -> int:
    """What a rollout stage's chip holds of the weights beside its calls' arguments: where it
    merges a LoRA student's adapters at the swap, the base and adapters it merges each
    version from (0 otherwise: its calls take the weights it receives)."""
    if not cfg.student.lora.merged_at_swap:
        return 0
    return bytes_per_device(received_weights(cfg, config, devices, vocab_limit))
