"""Matmul FLOPs counted from the jaxpr, against the textbook count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.scale.flops import matmul_flops
from tests.tiny_models import tiny_config, tiny_decoder, tiny_moe_config


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


def test_a_mixture_of_experts_counts_its_active_experts_only():
    """A grouped matmul is 2 · M · K · N for its M rows (each meets one expert's [K, N], not
    all E); a Qwen3-MoE forward is the textbook count with the router's H · E and k experts'
    3 · H · I per sparse layer (layer 1 here; layer 0 is dense), forward and backward."""
    from asyncopd_jax.models.decoder import Decoder
    from asyncopd_jax.scale.flops import transformer_flops

    rows, weights, sizes = jnp.ones((7, 5)), jnp.ones((4, 5, 6)), jnp.array([2, 0, 4, 1], jnp.int32)
    assert matmul_flops(lambda x, w, g: jax.lax.ragged_dot(x, w, g), rows, weights, sizes) == 2 * 7 * 5 * 6

    config = tiny_moe_config(
        vocab_size=40, num_experts=8, num_experts_per_tok=3, decoder_sparse_step=2, tie_word_embeddings=True
    )
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    b, s = 2, 6
    tokens = jnp.ones((b, s), jnp.int32)
    counted = matmul_flops(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    h, q, kv = 16, 32, 16
    attention = h * q + 2 * h * kv + q * h
    weights_used = 2 * attention + 3 * h * 24 + (h * 8 + 3 * 3 * h * 12) + h * 40
    assert counted == b * (2 * weights_used * s + 2 * 2 * 2 * s * s * q)
    assert counted == transformer_flops(config, b, s, s, backward=False)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p).hidden_states(tokens) ** 2)  # noqa: E731
    assert matmul_flops(jax.grad(loss), params) == 3 * matmul_flops(loss, params)
