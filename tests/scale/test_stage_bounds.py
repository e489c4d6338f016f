"""Every stage of the v5e-16 config, compiled by XLA's TPU compiler for a v5e 2×2 slice (4
chips) as ``asyncopd plan`` compiles it, at reduced depth: 2 layers at Qwen3-1.7B's widths
(the teacher: Qwen3-8B's), the whole 151,936-id vocabulary, 512 + 3,584-token sequences.
Each stage's per-chip peak must stay under a bound derived from its shapes: its weights and
optimizer state over the shards that hold them, the activations it keeps, its largest
transient, and a stated margin. A change that leaves the weights whole on every chip,
materialises ``[B, T, V]`` logits or a whole ``[S, S]`` of attention scores, or keeps every
head of the KV cache on every chip adds more than the margin and fails (docs/testing.md
has each mutation and its figure).

Skipped where libtpu is not installed; CI installs it (``.ci/run``) and runs this file.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncopd_jax.config import RunConfig, load_config
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.scale.chips import GIB, get_topology, libtpu_available
from asyncopd_jax.scale.learner_inputs import architecture
from asyncopd_jax.scale.plan import (
    Shapes,
    StageFigures,
    compile_learner_step,
    compile_sampler,
    compile_teacher_scoring,
)
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]

CHIPS = 4
P, T = 512, 3584  # prompt and response slots
S = P + T
SHAPES = Shapes(P, T, layers=2)
SAMPLER_ROWS = 64  # one rollout group, as the v5e-16 config samples it
TEACHER_ROWS = 16  # fewer than the config's 64, so that its weights weigh beside its activations
MARGIN = 0.35 * GIB  # what the compiler may add beyond the terms below (fusion buffers, copies)
SETS = [
    "learner.mesh={data: 1, fsdp: 4}",
    "learner.mini_batches=8",  # 8 rows per step: 2 per chip, as on the v5e-16
    "stages.rollout_mesh={data: 1, tensor: 4}",  # as the config's
    "stages.scoring_mesh={data: 1, tensor: 4}",
    # the bounds below are the static engine's dense cache (the continuous engine's pool is
    # held to its bytes by test_sampler_tpu.py and planned by --balance)
    "sampling.engine=static",
    "sampling.slots=0",
    "sampling.kv_pages=0",
]


def _cfg() -> RunConfig:
    return load_config("qwen3_1.7b_from_8b_v5e16", SETS)


def _models() -> tuple[DecoderConfig, DecoderConfig]:
    cfg = _cfg()
    return architecture(cfg.student, 2)[0], architecture(cfg.teacher, 2)[0]


def compile_stage(role: str) -> list[StageFigures]:
    """One stage of the config on the 4 chips, compiled as ``asyncopd plan`` compiles it
    (the sampler: its prefill, decode step and recompute)."""
    cfg, (student, teacher), chips = _cfg(), _models(), list(get_topology("v5e-4").devices)
    if role == "learner":
        figures = [compile_learner_step(cfg, student, chips, SHAPES)]
    elif role == "scoring":
        figures = [compile_teacher_scoring(cfg, teacher, chips, SHAPES, rows=TEACHER_ROWS)]
    else:
        figures = compile_sampler(cfg, student, chips, SHAPES, rows=SAMPLER_ROWS)
    assert not [f.error for f in figures if f.error], [f.error for f in figures]
    return figures


def _parameters(config: DecoderConfig) -> int:
    _, params = abstract_decoder(config, "float32")
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def learner_bound(config: DecoderConfig, rows: int, chunk: int) -> dict[str, float]:
    """Per chip, for ``rows`` rows per chip, FSDP over :data:`CHIPS`, bf16 compute over fp32
    master weights, each layer rematerialised, the LM head row-parallel."""
    n, h, i, v = CHIPS, config.hidden_size, config.intermediate_size, config.vocab_size
    weights = _parameters(config)
    return {
        # fp32 parameters, two AdamW moments and the gradient; the bf16 copy the step computes with
        "state / shards": (4 * 4 + 2) * weights / n,
        # row-parallel LM head: the (tied) head whole in bf16, its fp32 gradient on each chip
        "head whole": h * v * (2 + 4),
        # one chunk of [chunk, V] fp32 logits, probabilities and their gradient
        "logits chunk": 3 * chunk * v * 4,
        # each layer's input (bf16) kept; one layer's projections and MLP recomputed (fp32: an upper bound)
        "activations": config.num_hidden_layers * rows * S * h * 2 + rows * S * (4 * h + 3 * i) * 4,
    }


def sampler_bound(config: DecoderConfig, rows: int, chunk: int) -> dict[str, float]:
    """Per chip, ``rows`` rows on every chip, heads / MLP / vocabulary and the KV cache's
    key-value heads over ``tensor`` (:data:`CHIPS`), bf16 compute over fp32 weights."""
    n, layers, kv = CHIPS, config.num_hidden_layers, config.num_key_value_heads * config.head_dim
    return {
        "weights fp32 + bf16 copy / shards": _parameters(config) * (4 + 2) / n,
        "KV cache bf16 / shards": rows * S * layers * 2 * kv * 2 / n,
        # the embedding, split over the vocabulary, gathered whole (bf16) for the lookup
        "embedding whole": config.vocab_size * config.hidden_size * 2,
        "one chunk's scores": rows * config.num_attention_heads / n * chunk * S * 4,
        "records and logits": rows * (T * 64 + config.vocab_size * 4 * 3),
    }


def teacher_bound(config: DecoderConfig, rows: int, chunk: int) -> dict[str, float]:
    """Per chip, ``rows`` rows on every chip, heads / MLP / vocabulary over ``tensor``."""
    n, h, i, v = CHIPS, config.hidden_size, config.intermediate_size, config.vocab_size
    return {
        "weights bf16 / shards": _parameters(config) * 2 / n,
        # a layer's residual stream, its normed input and attention output (bf16, rows whole
        # on every chip: tensor splits heads, not rows) and its MLP's hidden units (split)
        "one layer's activations": rows * S * (4 * h * 2 + 3 * i // n * 2),
        "scoring chunk's logits": 3 * rows * chunk * v // n * 4,
    }


def check(stage: StageFigures, terms: dict[str, float]) -> None:
    bound = sum(terms.values()) + MARGIN
    detail = ", ".join(f"{k} {x / GIB:.2f}" for k, x in terms.items())
    assert stage.peak_bytes <= bound, (
        f"{stage.stage}: peak {stage.peak_bytes / GIB:.2f} GiB per chip over its bound {bound / GIB:.2f} "
        f"({detail}, margin {MARGIN / GIB:.2f})"
    )


def test_the_learner_step_holds_its_shards_and_one_layer():
    student, _ = _models()
    (step,) = compile_stage("learner")
    check(step, learner_bound(student, rows=2, chunk=512))


def test_the_sampler_holds_its_rows_cache_and_one_chunk():
    student, _ = _models()
    for stage in compile_stage("rollout"):  # prefill, decode, recompute
        check(stage, sampler_bound(student, rows=SAMPLER_ROWS, chunk=16))


def test_teacher_scoring_holds_its_shards_and_one_layer():
    _, teacher = _models()
    (scoring,) = compile_stage("scoring")
    check(scoring, teacher_bound(teacher, rows=TEACHER_ROWS, chunk=64))
