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
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.scale.chips import get_topology, libtpu_available
from asyncopd_jax.scale.plan import ARCHITECTURES
from tests.sampling.test_sharded_sampler import cache_bytes
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]

ROWS, PROMPT_SLOTS, RESPONSE = 16, 512, 3584


def test_the_recompute_on_a_v5e_chip_holds_one_kv_cache():
    """Qwen3-1.7B's layers (2 of them), bf16, 16 rows × (512 + 3,584) slots on a v5e 2×2
    slice, rows over data = 4: each chip's quarter of the cache (128 MiB) is donated to the
    recompute, which rewrites it in place: its temporaries (chunks of 16 slots: [4, 16, 16,
    4096] fp32 scores, 16 MiB) hold less than that quarter; the one-shot prefill it replaced
    held a second one and [4, 16, 4096, 4096] scores."""
    config, _ = read_hf_config(ARCHITECTURES / "Qwen3-1.7B")
    config = dataclasses.replace(config, num_hidden_layers=2)
    mesh = make_mesh(MeshConfig(data=4), list(get_topology("v5e-4").devices))
    graphdef, abstract = abstract_decoder(config, "bfloat16")
    abstract = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, parameter_shardings(abstract, mesh)
    )
    sampler = Sampler(graphdef, SamplingParams(max_new_tokens=RESPONSE, recompute_chunk=16), mesh=mesh)
    memory = sampler.lower(abstract, ROWS, PROMPT_SLOTS)["recompute"].compile().memory_analysis()
    per_chip = cache_bytes(config, ROWS, PROMPT_SLOTS + RESPONSE, "bfloat16") // 4
    assert memory.alias_size_in_bytes >= per_chip, (memory.alias_size_in_bytes, per_chip)
    assert memory.temp_size_in_bytes < per_chip, (memory.temp_size_in_bytes, per_chip)
