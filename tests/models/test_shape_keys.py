"""A model built as shapes with :func:`shape_keys` has the weights (paths, shapes, dtypes,
variable types) that ``nnx.Rngs`` gives, dense, mixture of experts and with adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from asyncopd_jax.models import Decoder
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.lora import LoRAParams, add_adapters
from tests.tiny_models import tiny_config, tiny_moe_config


def _layout(state: nnx.State) -> dict:
    return {path: (type(v).__name__, v.shape, v.dtype) for path, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("config", [tiny_config(), tiny_moe_config()], ids=["dense", "moe"])
@pytest.mark.parametrize("rank", [0, 3])
def test_shapes_built_from_shape_keys_are_those_of_nnx_rngs(config, rank):
    lora = LoRAParams(rank=rank, targets=("q_proj", "o_proj"))

    def with_rngs() -> Decoder:
        return add_adapters(Decoder(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), lora, nnx.Rngs(0))

    want = _layout(nnx.state(nnx.eval_shape(with_rngs)))
    _, got = abstract_decoder(config, "bfloat16", lora=lora)
    assert _layout(got) == want
    assert any(kind == "LoRAParam" for kind, _, _ in want.values()) == bool(rank)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(got))  # nothing allocated
