"""Rematerialisation (``learner.remat``): the same gradients. (Less memory kept per layer is
checked on XLA's TPU compiler, tests/scale/test_tpu_compile.py: XLA:CPU's memory analysis
reports the same temporaries with and without ``jax.checkpoint``.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.models.decoder import Decoder
from tests.tiny_models import tiny_config

# tiny_config's family and vocabulary, wider and deeper: 4 layers, 4 heads of 16
CONFIG = dataclasses.replace(
    tiny_config(vocab=64), hidden_size=64, intermediate_size=192, num_hidden_layers=4, head_dim=16
)


def _loss(graphdef, remat, tokens, mask):
    def loss(params):
        hidden = nnx.merge(graphdef, params).hidden_states(tokens, attention_mask=mask, remat=remat)
        return jnp.mean(hidden**2)

    return loss


def _inputs(batch: int, length: int):
    tokens = jax.random.randint(jax.random.key(1), (batch, length), 0, CONFIG.vocab_size)
    mask = jnp.ones((batch, length), bool).at[0, : length // 4].set(False)  # a left-padded row
    return tokens, mask


@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_rematerialised_gradients_equal_the_plain_ones(remat):
    graphdef, params = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
    tokens, mask = _inputs(2, 12)
    plain = jax.grad(_loss(graphdef, "none", tokens, mask))(params)
    got = jax.grad(_loss(graphdef, remat, tokens, mask))(params)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
