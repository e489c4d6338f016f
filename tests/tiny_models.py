"""Small random decoders with non-trivial (peaked, varied) output distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.models import Decoder, DecoderConfig
from asyncopd_jax.models.lora import LoRAParams, adapters, add_adapters
from asyncopd_jax.sampling import SamplingParams


def tiny_config(family: str = "qwen3", vocab: int = 61, tied: bool = True) -> DecoderConfig:
    return DecoderConfig(
        model_type=family,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        eos_token_id=2,
        pad_token_id=0,
    )


def tiny_moe_config(**fields) -> DecoderConfig:
    """A tiny Qwen3-MoE: 2 layers of 6 experts, 2 a token (``fields`` override)."""
    base = dict(
        model_type="qwen3_moe",
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
    )
    return DecoderConfig(**{**base, **fields})


def tiny_decoder(seed: int = 0, family: str = "qwen3", vocab: int = 61, scale: float = 1.0) -> Decoder:
    """A decoder whose weights have fan-in scaled variance (×``scale``), so logits differ
    clearly between positions instead of the near-uniform output of a 0.02 init."""
    model = Decoder(tiny_config(family, vocab), rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1000), 64))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var[...]
        if value.ndim == 2:
            var[...] = jax.random.normal(next(keys), value.shape) * scale / jnp.sqrt(value.shape[0])
    return model


def tiny_lora_decoder(params: LoRAParams, seed: int = 0) -> Decoder:
    """:func:`tiny_decoder` with adapters (``params``) whose B is random: a fresh B is zero,
    which would give A no gradient and hide a wrong A."""
    model = add_adapters(tiny_decoder(seed, scale=0.7), params, nnx.Rngs(seed))
    for i, (_, module) in enumerate(adapters(model)):
        module.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(100 + i), module.lora_b.shape)
    return model


def slot_sampling(engine: str = "continuous") -> SamplingParams:
    """Sampling for ``tiny_decoder(0, scale=0.7)`` whose answers (stop tokens 51 and 54)
    end after a few to 12 tokens, over 3 slots with pages of 4 tokens and 2-step chunks:
    slots finish at different times and are refilled, the last ones drain beside idle ones."""
    return SamplingParams(
        temperature=0.8,
        max_new_tokens=12,
        num_candidates=2,
        stop_token_ids=(51, 54),
        chunk_steps=2,
        engine=engine,
        slots=3,
        page_size=4,
    )
