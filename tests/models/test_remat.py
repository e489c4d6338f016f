"""Rematerialisation (``learner.remat``): the same gradients. (Less memory kept per layer is
checked on XLA's TPU compiler, tests/scale/test_tpu_compile.py: XLA:CPU's memory analysis
reports the same temporaries with and without ``jax.checkpoint``.)"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import jax
import jax.ad_checkpoint as ad_checkpoint
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


def _dots(jaxpr, batched: bool) -> int:
    """dot_general equations in ``jaxpr`` and every jaxpr inside it: with batch dimensions
    (attention's scores and mixing) or without (a weight matmul, forward or transposed)."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (_, (lhs_batch, _)) = eqn.params["dimension_numbers"]
            count += bool(lhs_batch) == batched
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _dots(inner, batched)
    return count


def _remat_figures(remat: str) -> tuple[int, int, int]:
    """(bytes the backward keeps from the forward, weight matmuls, batched matmuls) of one
    gradient of the loss under ``remat``."""
    graphdef, params = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
    loss = _loss(graphdef, remat, *_inputs(2, 12))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # one line per residual: "f32[2,12,64] from …"
        ad_checkpoint.print_saved_residuals(loss, params)
    kept = 0
    for line in printed.getvalue().splitlines():
        bits, dims = re.match(r"[a-z]+(\d*)\[([\d,]*)\]", line).group(1, 2)  # bool[…]: a byte each
        kept += (int(bits or 8) // 8) * math.prod(int(d) for d in dims.split(",") if d)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    return kept, _dots(jaxpr, batched=False), _dots(jaxpr, batched=True)


def test_each_remat_policy_keeps_and_recomputes_what_it_says():
    """``layer`` keeps least and recomputes every matmul of a layer; ``dots`` keeps less than
    ``none`` and recomputes no weight matmul, only attention's batched ones."""
    none, layer, dots = (_remat_figures(r) for r in ("none", "layer", "dots"))
    assert layer[0] < dots[0] < none[0], (layer, dots, none)
    assert dots[1] == none[1] < layer[1], (none, dots, layer)  # no weight matmul run twice under dots
    assert none[2] < dots[2] == layer[2], (none, dots, layer)  # attention's scores are recomputed
