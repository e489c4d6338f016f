"""The AsyncOPD paper's teacher, Qwen3-30B-A3B, scored on 4 TPU v5e chips as ``asyncopd
plan`` compiles it, at reduced depth (2 layers at its real widths: 128 experts of 768, 8 a
token, H 2,048, the whole 151,936-id vocabulary), 512 + 3,584-token rows. Its experts split
over the chips' fsdp axis (expert parallelism): each chip holds 32 whole experts and the
tokens travel to them. The per-chip peak must stay under a bound from its shapes; a change
that leaves every expert on every chip takes the peak from 1.47 to 3.48 GiB a chip against a
bound of 1.89, and fails (docs/testing.md).

Skipped where libtpu is not installed; CI installs it (``.ci/run``) and runs this file.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.moe import EXPERT_CHUNK_TOKENS
from asyncopd_jax.scale.chips import GIB, get_topology, libtpu_available
from asyncopd_jax.scale.learner_inputs import architecture
from asyncopd_jax.scale.plan import Shapes, compile_teacher_scoring
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]

CHIPS = 4
P, T = 512, 3584
S = P + T
ROWS = 4  # one row a chip
CHUNK = 64  # the config's scoring.chunk_size
MARGIN = 0.5 * GIB  # what the compiler may add beyond the terms below (fusion buffers, copies)


def teacher() -> DecoderConfig:
    cfg = load_config("qwen3_1.7b_from_30b_a3b_v6e8")
    return architecture(cfg.teacher, 2)[0]


def bound(config: DecoderConfig) -> dict[str, float]:
    """Per chip: the bf16 weights over the 4 (experts whole, 32 a chip; the rest FSDP), one
    layer's activations of its row, the exchange's buffers and one chunk's logits."""
    n, h, v, k = CHIPS, config.hidden_size, config.vocab_size, config.num_experts_per_tok
    _, params = abstract_decoder(config, "bfloat16")
    weights = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    tokens = ROWS // n * S  # a chip's
    rows = n * min(EXPERT_CHUNK_TOKENS, tokens) * k  # D·c·k rows an exchange's buffers hold
    return {
        "weights bf16 / shards": weights * 2 / n,
        # the residual stream, its normed input, q / k / v and the attention's output (bf16)
        "one layer's activations": tokens * 6 * h * 2,
        # send, received, out and returned [D, c·k, H]; the experts' hidden units [D·c·k, I] ×3
        "exchange buffers": rows * (4 * h + 3 * config.moe_intermediate_size) * 2,
        "scoring chunk's logits": 3 * ROWS // n * CHUNK * v * 4,
    }


def test_an_expert_parallel_teacher_holds_its_experts_shards_and_one_layer():
    config, chips = teacher(), list(get_topology("v5e-4").devices)
    cfg = load_config(
        "qwen3_1.7b_from_30b_a3b_v6e8", ["stages.scoring_mesh={data: 1, fsdp: 4, tensor: 1}", "scoring.chunk_size=64"]
    )
    figures = compile_teacher_scoring(cfg, config, chips, Shapes(P, T, layers=2), rows=ROWS)
    assert figures.error is None, figures.error
    terms = bound(config)
    limit = sum(terms.values()) + MARGIN
    detail = ", ".join(f"{name} {x / GIB:.2f}" for name, x in terms.items())
    assert figures.peak_bytes <= limit, (
        f"teacher scoring: peak {figures.peak_bytes / GIB:.2f} GiB per chip over its bound {limit / GIB:.2f} "
        f"({detail}, margin {MARGIN / GIB:.2f})"
    )
    assert figures.interconnect_bytes > 0  # the all-to-alls are in its roofline


def test_the_compiled_teacher_sends_only_routed_rows():
    """XLA:TPU takes jax.lax.ragged_all_to_all: the teacher's forward on 4 v5e chips (fsdp 4,
    32 experts a chip, 2 layers at Qwen3-30B-A3B's widths) sends its rows by ragged
    all-to-alls, there and back, and no all-to-all of rows: its one plain all-to-all carries
    each chip's int32 counts (docs/scaling.md: the ragged path has not run on hardware)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncopd_jax.config import MeshConfig
    from asyncopd_jax.learner import make_mesh
    from asyncopd_jax.models.partitioning import mesh_context, parameter_shardings
    from asyncopd_jax.pipeline.devices import with_shardings

    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(get_topology("v5e-4").devices))
    graphdef, params = abstract_decoder(teacher(), "bfloat16")
    tokens = jax.ShapeDtypeStruct((4, 512), np.int32, sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    with mesh_context(mesh):
        hlo = forward.lower(with_shardings(params, parameter_shardings(params, mesh)), tokens).compile().as_text()
    # the exchange's collectives: those of the shard_map (the partitioner adds an all-to-all
    # of its own for the embedding's gather)
    exchange = [line.split("=", 1)[1].lstrip() for line in hlo.splitlines() if "shard_map" in line]
    ragged = [line for line in exchange if " ragged-all-to-all(" in line]
    plain = [line for line in exchange if " all-to-all(" in line]
    assert len(ragged) >= 2 and all(line.startswith("bf16[") for line in ragged), ragged  # there and back
    assert plain and all(line.startswith("s32[") for line in plain), plain
