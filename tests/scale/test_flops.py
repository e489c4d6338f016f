"""Matmul FLOPs counted from the jaxpr, against the textbook count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.scale.flops import matmul_flops
from tests.tiny_models import tiny_config, tiny_decoder


def test_a_matmul_and_a_scan_of_them():
    a, b = jnp.ones((3, 4, 5)), jnp.ones((5, 6))
    assert matmul_flops(lambda x, y: x @ y, a, b) == 2 * 3 * 4 * 5 * 6
    scanned = lambda x, y: jax.lax.scan(lambda c, xi: (c, xi @ y), 0, x)[1]  # noqa: E731
    assert matmul_flops(scanned, a, b) == 2 * 3 * 4 * 5 * 6  # 3 trips of [4, 5] @ [5, 6]
    batched = lambda x: jnp.einsum("bij,bjk->bik", x, x.transpose(0, 2, 1))  # noqa: E731
    assert matmul_flops(batched, a) == 2 * 3 * 4 * 4 * 5


def test_the_decoder_forward_is_two_flops_per_weight_per_token_plus_attention():
    """2 · (matmul weights) · tokens for the projections and the tied LM head, and
    2 · 2 · S² · N_q · D per layer for the scores and the weighted sum (the whole [S, S];
    causality is not subtracted), for B rows of S tokens."""
    c = tiny_config()
    graphdef, params = nnx.split(tiny_decoder(0))
    b, s = 3, 10
    tokens = jnp.ones((b, s), jnp.int32)
    counted = matmul_flops(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size
    weights = c.num_hidden_layers * per_layer + h * c.vocab_size
    attention = c.num_hidden_layers * 2 * 2 * s * s * q
    assert counted == b * (2 * weights * s + attention)


def test_the_backward_pass_doubles_the_matmuls_and_remat_recomputes_the_forward():
    graphdef, params = nnx.split(tiny_decoder(0))
    tokens = jnp.ones((2, 8), jnp.int32)

    def loss(remat):
        return lambda p: jnp.sum(nnx.merge(graphdef, p).hidden_states(tokens, remat=remat) ** 2)

    forward = matmul_flops(loss("none"), params)
    assert matmul_flops(jax.grad(loss("none")), params) == 3 * forward
    # rematerialised: the backward pass recomputes (most of) each layer's forward first
    assert 3.5 * forward < matmul_flops(jax.grad(loss("layer")), params) <= 4 * forward
