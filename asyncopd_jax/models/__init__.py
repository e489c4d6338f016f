"""Flax NNX decoders (Llama / Qwen2 / Qwen3) loaded from local Hugging Face directories."""

from asyncopd_jax.models.config import SUPPORTED_MODEL_TYPES, DecoderConfig
from asyncopd_jax.models.decoder import Decoder, KVCache
from asyncopd_jax.models.hf_checkpoint import from_pretrained, head_digest, read_lm_head, save_pretrained
from asyncopd_jax.models.tokenizer import (
    check_same_vocabulary,
    encode_prompts,
    load_tokenizer,
    shared_vocab_size,
    vocabulary_differences,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "check_same_vocabulary",
    "encode_prompts",
    "from_pretrained",
    "head_digest",
    "read_lm_head",
    "load_tokenizer",
    "save_pretrained",
    "shared_vocab_size",
    "vocabulary_differences",
]
