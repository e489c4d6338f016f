"""The sampler compiled by XLA's TPU compiler on this CPU machine (libtpu; nothing runs on a
TPU): the weight swap's recompute rewrites the KV cache in place, on a real-width model.

Skipped where libtpu is not installed; CI installs it (``.ci/run``).
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from asyncopd_jax.config import MeshConfig
from asyncopd_jax.learner.sharding import make_mesh
from asyncopd_jax.models.config import read_hf_config
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.partitioning import parameter_shardings
from asyncopd_jax.sampling import ContinuousSampler, Sampler, SamplingParams
from asyncopd_jax.scale.chips import get_topology, libtpu_available
from asyncopd_jax.scale.learner_inputs import ARCHITECTURES
from tests.sampling.test_sharded_sampler import cache_bytes
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]

ROWS, PROMPT_SLOTS, RESPONSE = 16, 512, 3584


def _qwen3_1_7b_on_a_v5e_2x2(mesh_config: MeshConfig):
    """Qwen3-1.7B's widths, 2 layers, bf16: its config, a mesh of a v5e 2×2's chips, and the
    model's graph and weights (shapes only) placed on it by the partition rules."""
    config, _ = read_hf_config(ARCHITECTURES / "Qwen3-1.7B")
    config = dataclasses.replace(config, num_hidden_layers=2)
    mesh = make_mesh(mesh_config, list(get_topology("v5e-4").devices))
    graphdef, abstract = abstract_decoder(config, "bfloat16")
    abstract = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, parameter_shardings(abstract, mesh)
    )
    return config, mesh, graphdef, abstract


def test_the_recompute_on_a_v5e_chip_holds_one_kv_cache():
    """Qwen3-1.7B's layers (2 of them), bf16, 16 rows × (512 + 3,584) slots on a v5e 2×2
    slice, rows over data = 4: each chip's quarter of the cache (128 MiB) is donated to the
    recompute, which rewrites it in place: its temporaries (chunks of 16 slots: [4, 16, 16,
    4096] fp32 scores, 16 MiB) hold less than that quarter; the one-shot prefill it replaced
    held a second one and [4, 16, 4096, 4096] scores."""
    config, mesh, graphdef, abstract = _qwen3_1_7b_on_a_v5e_2x2(MeshConfig(data=4))
    sampler = Sampler(graphdef, SamplingParams(max_new_tokens=RESPONSE, recompute_chunk=16), mesh=mesh)
    memory = sampler.lower(abstract, ROWS, PROMPT_SLOTS)["recompute"].compile().memory_analysis()
    per_chip = cache_bytes(config, ROWS, PROMPT_SLOTS + RESPONSE, "bfloat16") // 4
    assert memory.alias_size_in_bytes >= per_chip, (memory.alias_size_in_bytes, per_chip)
    assert memory.temp_size_in_bytes < per_chip, (memory.temp_size_in_bytes, per_chip)


def test_the_continuous_engine_compiles_the_ragged_paged_kernel_for_v5e_chips():
    """The continuous engine on a v5e 2×2 slice, heads over tensor = 4, at Qwen3-1.7B's widths
    (2 layers, bf16): 64 slots of 512 + 3,584 tokens over a pool of half the dense cache's
    pages. Its decode step runs the Pallas ragged paged attention kernel (one per chip, under
    shard_map) and is given the pool in place: each chip holds its quarter of the pool's
    heads, donated (aliased), and half what a dense cache of 64 × 4,096 slots would take."""
    config, mesh, graphdef, abstract = _qwen3_1_7b_on_a_v5e_2x2(MeshConfig(tensor=4))
    slots, pages_per_sequence = 64, (PROMPT_SLOTS + RESPONSE) // 16
    params = SamplingParams(
        max_new_tokens=RESPONSE,
        recompute_chunk=16,
        engine="continuous",
        slots=slots,
        kv_pages=slots * pages_per_sequence // 2,
    )
    engine = ContinuousSampler(graphdef, params, mesh=mesh)
    assert engine.implementation == "ragged"
    decode = engine.lower(abstract, slots, PROMPT_SLOTS)["decode"]
    assert "ragged_paged_attention" in decode.as_text()
    memory = decode.compile().memory_analysis()
    dense_per_chip = cache_bytes(config, slots, PROMPT_SLOTS + RESPONSE, "bfloat16") // 4
    carry = jax.eval_shape(
        lambda s: engine.empty(s, slots, PROMPT_SLOTS, engine.pool_pages(slots, PROMPT_SLOTS)), abstract
    )
    pool_per_chip = sum(x.size * x.dtype.itemsize for x in carry.slots.cache.pages) // 4
    rest = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(carry)) - 4 * pool_per_chip  # whole
    assert abs(pool_per_chip / dense_per_chip - 0.5) < 0.01, (pool_per_chip, dense_per_chip)
    # the carry, donated: the pool's quarter and the records, logits and slot state (whole);
    # within 64 KiB (the chip's padding of small arrays: 1.7 KiB here)
    donated = pool_per_chip + rest
    assert abs(memory.alias_size_in_bytes - donated) < 2**16, (memory.alias_size_in_bytes, pool_per_chip, rest)
