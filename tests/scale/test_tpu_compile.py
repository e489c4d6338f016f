"""Compiled by XLA's TPU compiler on this CPU machine (libtpu; nothing runs on a TPU): what a
step holds per chip, against bounds derived from its shapes.

Skipped where libtpu is not installed; CI installs it (``.ci/run``) and runs this file.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.scale.chips import get_topology, libtpu_available
from tests.models.test_remat import CONFIG, _loss
from tests.tpu_compiler import REASON

pytestmark = [pytest.mark.tpu_compiler, pytest.mark.skipif(not libtpu_available(), reason=REASON)]


def _on_one_chip(tree):
    chip = get_topology("v5e-4").devices[0]
    sharding = NamedSharding(Mesh(np.asarray([chip]), ("data",)), PartitionSpec())
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def test_rematerialising_each_layer_keeps_only_its_input_per_layer():
    """What 4 more layers add to the backward pass's temporaries on a v5e chip, 2 rows ×
    1,024 tokens: without remat each layer keeps its attention scores and probabilities
    ([2, 4, 1024, 1024] fp32, 32 MiB each) and its MLP activations; with "layer" it keeps
    its [2, 1024, 64] input (0.5 MiB) and one layer is recomputed at a time."""
    tokens = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    mask = jax.ShapeDtypeStruct((2, 1024), jnp.bool_)
    per_layer = {}
    for remat in ("none", "layer"):
        temp = []
        for layers in (2, 6):
            config = dataclasses.replace(CONFIG, num_hidden_layers=layers)
            graphdef, params = nnx.split(nnx.eval_shape(lambda c=config: Decoder(c, rngs=nnx.Rngs(0))))

            def grad(params, tokens, mask, graphdef=graphdef, remat=remat):
                return jax.grad(_loss(graphdef, remat, tokens, mask))(params)

            compiled = jax.jit(grad).lower(*_on_one_chip((params, tokens, mask))).compile()
            temp.append(compiled.memory_analysis().temp_size_in_bytes)
        per_layer[remat] = (temp[1] - temp[0]) / 4
    assert per_layer["none"] > 32 * 2**20, per_layer  # the scores at least: the test measures what it says
    assert per_layer["layer"] < 2 * 2**20, per_layer
