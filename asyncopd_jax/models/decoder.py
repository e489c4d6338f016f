"""The Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder in Flax NNX, with a functional KV cache.

Two paths share the layers' weights: :meth:`Decoder.forward` writes tokens into KV-cache
slots ``[write_slot, write_slot + S)``, where they attend, causally by slot, to every valid
slot at or before their own (the sampler's prefill and decode); :meth:`Decoder.hidden_states`
runs a whole sequence with no cache (the learner, the teacher), its attention computed by an
implementation of :mod:`asyncopd_jax.models.attention` that never holds a whole sequence's
``[S, S]`` scores where the sequence is long.

A decoder computes in its weights' dtype (:attr:`Decoder.compute_dtype`): bf16 weights
cast from fp32 master weights give a bf16 forward (mixed precision).

Shapes: B batch, S tokens in this call, C cache slots, H hidden, V vocabulary,
``N_q`` query heads, ``N_kv`` key/value heads, ``G = N_q / N_kv``, D head dim.
Module and parameter names follow Hugging Face, so checkpoint names map one to one
(``kernel`` is stored ``[in, out]``, the transpose of a torch ``weight``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.models.attention import Implementation, causal_attention
from asyncopd_jax.models.config import DecoderConfig, rope_inverse_frequencies
from asyncopd_jax.models.lora import NO_ADAPTERS, LoRAParams, add_adapters
from asyncopd_jax.models.moe import SparseMoE
from asyncopd_jax.models.paged_attention import PagedImplementation, PagedKVCache, PagedWrite, paged_attention
from asyncopd_jax.models.partitioning import constrain
from asyncopd_jax.models.shape_keys import shape_keys

Array = jax.Array

Remat = Literal["none", "layer", "dots"]
# What a layer keeps for the backward pass (``jax.checkpoint`` policies): everything
# ("none": no rematerialisation); only its input ("layer": the whole layer is recomputed,
# the least memory); the outputs of its weight matmuls ("dots": attention scores, softmax and
# the MLP's activation are recomputed, the matmuls against weights are not).
REMAT_POLICIES = {
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values ``[B, N_kv, C, D]`` and which slots hold a real token ``[B, C]``.

    Heads-major, as attention reads them: stored ``[B, C, N_kv, D]``, XLA:TPU copies each
    layer's keys and values into this layout inside the decode loop, a second cache's worth
    of temporaries (the prefill's chunks have a limit of their own:
    :attr:`~asyncopd_jax.sampling.SamplingParams.recompute_chunk`)."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    valid: Array

    @classmethod
    def empty(cls, config: DecoderConfig, batch: int, slots: int, dtype: jnp.dtype) -> KVCache:
        shape = (batch, config.num_key_value_heads, slots, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
        return cls(keys=zeros, values=zeros, valid=jnp.zeros((batch, slots), bool))

    @property
    def slots(self) -> int:
        return self.valid.shape[1]


def _dense(cfg_in: int, cfg_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    # dtype=None: compute in the dtype of the weights given (see Decoder.compute_dtype)
    return nnx.Linear(
        cfg_in,
        cfg_out,
        use_bias=bias,
        dtype=None,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """``y = w · x / sqrt(mean(x²) + ε)``, normalised in fp32 (as transformers does)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding, "rotate half" layout: ``x·cos + rotate_half(x)·sin``.

    Args:
      x: ``[B, S, N, D]``.
      cos, sin: ``[B, S, D]`` fp32.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, :, None] + rotated.astype(jnp.float32) * sin[:, :, None]
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = _dense(c.hidden_size, c.num_attention_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.k_proj = _dense(c.hidden_size, c.num_key_value_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.v_proj = _dense(c.hidden_size, c.num_key_value_heads * c.head_dim, c.qkv_bias, dtype, rngs)
        self.o_proj = _dense(c.num_attention_heads * c.head_dim, c.hidden_size, c.o_proj_bias, dtype, rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.qk_norm = c.qk_norm

    def _qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """``x [B, S, H]`` → rotated ``q [B, S, N_q, D]``, ``k [B, S, N_kv, D]`` and ``v [B, S, N_kv, D]``."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def over_sequence(
        self, x: Array, cos: Array, sin: Array, segment_ids: Array, implementation: Implementation
    ) -> Array:
        """Causal attention over the whole sequence ``x [B, S, H]`` → ``[B, S, H]``, no cache:
        tokens attend earlier tokens of their own segment (``segment_ids [B, S]``; padding is
        its own segment), computed by ``implementation`` (:func:`causal_attention`: the
        long-sequence ones never hold a whole ``[S, S]`` of fp32 scores)."""
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = causal_attention(q, k, v, segment_ids, implementation=implementation)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim).astype(x.dtype))

    def __call__(
        self, x: Array, cos: Array, sin: Array, keys: Array, values: Array, mask: Array, write_slot: Array
    ) -> tuple[Array, Array, Array]:
        """``x [B, S, H]`` → output ``[B, S, H]`` and the updated ``keys, values [B, N_kv, C, D]``.

        ``mask [B, S, C]`` says which cache slots each query may attend to.
        """
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        heads_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, S, N_kv, D] → [B, N_kv, S, D]
        keys = jax.lax.dynamic_update_slice_in_dim(keys, heads_major(k).astype(keys.dtype), write_slot, axis=2)
        values = jax.lax.dynamic_update_slice_in_dim(values, heads_major(v).astype(values.dtype), write_slot, axis=2)

        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, s, self.num_kv_heads, groups, self.head_dim)
        # read in the compute dtype: a cache narrower than it (sampling.kv_dtype) rounds
        # what is stored, not the arithmetic
        cached_keys, cached_values = keys.astype(q.dtype), values.astype(q.dtype)
        scores = jnp.einsum("bskgd,bkcd->bkgsc", q, cached_keys, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(self.head_dim))
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cached_values.dtype)
        out = jnp.einsum("bkgsc,bkcd->bskgd", probs, cached_values).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out.astype(x.dtype)), keys, values

    def paged(
        self, x: Array, cos: Array, sin: Array, pages: Array, where: PagedWrite, implementation: PagedImplementation
    ) -> tuple[Array, Array]:
        """``x [S, Q, H]`` → output ``[S, Q, H]`` and the layer's updated pages: the new
        tokens' keys and values written into a paged cache, then attention over each
        sequence's tokens (:func:`~asyncopd_jax.models.paged_attention.paged_attention`)."""
        s, q_len, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out, pages = paged_attention(q, k, v, pages, where, implementation=implementation)
        return self.o_proj(out.reshape(s, q_len, self.num_heads * self.head_dim).astype(x.dtype)), pages


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        self.gate_proj = _dense(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, rngs)
        self.up_proj = _dense(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype, rngs)
        self.down_proj = _dense(c.intermediate_size, c.hidden_size, c.mlp_bias, dtype, rngs)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; the MLP of a
    sparse layer (:meth:`DecoderConfig.is_sparse`) is a mixture of experts."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs, index: int):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype, rngs) if config.is_sparse(index) else MLP(config, dtype, rngs)
        )

    def __call__(self, x, cos, sin, keys, values, mask, write_slot):
        attn, keys, values = self.self_attn(self.input_layernorm(x), cos, sin, keys, values, mask, write_slot)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values

    def paged(self, x, cos, sin, pages, where: PagedWrite, implementation: PagedImplementation):
        """The block over a paged KV cache (:meth:`Attention.paged`)."""
        attn, pages = self.self_attn.paged(self.input_layernorm(x), cos, sin, pages, where, implementation)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), pages

    def over_sequence(self, x, cos, sin, segment_ids, implementation: Implementation):
        """The block over a whole sequence, no cache (:meth:`Attention.over_sequence`)."""
        x = x + self.self_attn.over_sequence(self.input_layernorm(x), cos, sin, segment_ids, implementation)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rematerialised(layer: DecoderLayer, remat: Remat, method: str, **static):
    """``layer``'s ``method`` with ``static`` keyword arguments bound, keeping for the
    backward pass what ``remat`` says (the layer's weights are arguments of the
    checkpointed function, so their gradients flow)."""
    if remat == "none":
        return functools.partial(getattr(layer, method), **static)
    graphdef, state = nnx.split(layer)

    @functools.partial(jax.checkpoint, policy=REMAT_POLICIES[remat])
    def call(state, *args):
        return getattr(nnx.merge(graphdef, state), method)(*args, **static)

    return functools.partial(call, state)


class Decoder(nnx.Module):
    """A causal language model of the Llama / Qwen2 / Qwen3 / Qwen3-MoE family.

    ``model(input_ids)`` returns fp32 logits ``[B, S, V]``; row s is the distribution of
    token s + 1. Use :meth:`forward` for the KV-cache path and :meth:`hidden_states` +
    :meth:`lm_head_weight` for the fused log-prob gather.

    ``vocab_limit`` (default None: all ``config.vocab_size`` rows) narrows the output to
    the first ``vocab_limit`` ids: a teacher and a student that share one tokenizer but pad
    their embeddings to different sizes (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064) are
    compared over the ids both have, so ``V`` is the same on both sides. The softmax over
    the narrower output is the model's distribution conditioned on a real token (the
    padding rows are never a tokenizer's output). Set it before splitting the model.
    """

    vocab_limit: int | None = None
    # How whole-sequence attention is computed (hidden_states: the learner, the teacher):
    # an implementation of asyncopd_jax.models.attention, which the stage that holds the
    # model resolves for its devices' platform. The KV-cache path (forward) always uses
    # the plain one: a decode step's scores are [S=1, C].
    attention: Implementation = "xla"

    def __init__(self, config: DecoderConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=None,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _dense(config.hidden_size, config.vocab_size, False, dtype, rngs)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The dtype the model computes in: its weights' (``dtype`` is the dtype it was built
        with). Mixed precision casts fp32 master weights to bf16 before merging them into a
        model, and the whole forward follows; logits and softmax statistics stay fp32."""
        return self.embed_tokens.embedding[...].dtype

    # --- the KV-cache forward -------------------------------------------------------

    def forward(
        self,
        tokens: Array,
        positions: Array,
        token_valid: Array,
        cache: KVCache,
        write_slot: Array | int,
    ) -> tuple[Array, KVCache]:
        """Run ``tokens [B, S]`` written into cache slots ``[write_slot, write_slot + S)``.

        Args:
          tokens: ``[B, S]`` int ids.
          positions: ``[B, S]`` int RoPE positions.
          token_valid: ``[B, S]`` bool; False marks padding, which no query attends to.
          cache: the cache to write into (``C ≥ write_slot + S`` slots).
          write_slot: first slot written (scalar, may be traced).

        Returns:
          ``(hidden [B, S, H] after the final norm, updated cache)``.
        """
        b, s = tokens.shape
        write_slot = jnp.asarray(write_slot, jnp.int32)
        valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, token_valid.astype(bool), write_slot, axis=1)
        query_slots = write_slot + jnp.arange(s)
        causal = jnp.arange(cache.slots)[None, :] <= query_slots[:, None]  # [S, C]
        mask = causal[None] & valid[:, None, :]  # [B, S, C]

        cos, sin = self._rope_tables(positions)
        x = self._embed(tokens)
        keys, values = [], []
        for layer, k, v in zip(self.layers, cache.keys, cache.values):
            x, k, v = layer(x, cos, sin, k, v, mask, write_slot)
            keys.append(k)
            values.append(v)
        return self.norm(x), KVCache(tuple(keys), tuple(values), valid)

    def forward_paged(
        self, tokens: Array, cache: PagedKVCache, where: PagedWrite, implementation: PagedImplementation = "reference"
    ) -> tuple[Array, PagedKVCache]:
        """Run ``tokens [S, Q]`` of ``S`` sequences, written into a paged cache at token
        positions ``where.start .. where.start + where.count − 1`` (rows past ``count`` are
        padding); a sequence's token ``j`` has RoPE position ``j`` (a sequence starts at
        position 0, no left padding).

        Returns:
          ``(hidden [S, Q, H] after the final norm, updated cache)``.
        """
        positions = where.start[:, None] + jnp.arange(tokens.shape[1])[None]
        cos, sin = self._rope_tables(positions)
        x = self._embed(tokens)
        pages = []
        for layer, layer_pages in zip(self.layers, cache.pages):
            x, layer_pages = layer.paged(x, cos, sin, layer_pages, where, implementation)
            pages.append(layer_pages)
        return self.norm(x), PagedKVCache(tuple(pages))

    def hidden_states(
        self,
        tokens: Array,
        positions: Array | None = None,
        attention_mask: Array | None = None,
        remat: Remat = "none",
    ) -> Array:
        """Final hidden states ``[B, S, H]`` of a plain causal forward.

        ``attention_mask [B, S]`` (1 = real token) excludes padding from attention;
        ``positions`` default to ``cumsum(mask) − 1`` (left padding gets the positions a
        single unpadded sequence would have); ``remat``: what each layer keeps for a
        backward pass (:data:`REMAT_POLICIES`).
        """
        b, s = tokens.shape
        mask = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
        cos, sin = self._rope_tables(positions)
        # padding is segment 0, real tokens segment 1: a real token never attends padding
        # (and a padding query, whose output nothing reads, attends only padding)
        segment_ids = mask.astype(jnp.int32)
        x = self._embed(tokens)
        for layer in self.layers:
            # rows over (data, fsdp) between layers, whatever a layer's weights' layout
            x = constrain(x, ("batch", None, None))
            x = _rematerialised(layer, remat, "over_sequence", implementation=self.attention)(x, cos, sin, segment_ids)
        return self.norm(x)

    def _embed(self, tokens: Array) -> Array:
        """``tokens [B, S]`` → ``[B, S, H]`` in the embedding's own dtype (``nnx.Embed`` would
        cast to the dtype it was built with, undoing mixed precision's cast)."""
        return jnp.take(self.embed_tokens.embedding[...], tokens, axis=0)

    def _rope_tables(self, positions: Array) -> tuple[Array, Array]:
        """``positions [B, S]`` → RoPE ``cos, sin [B, S, D]`` (fp32)."""
        inv_freq = jnp.asarray(rope_inverse_frequencies(self.config))
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles), jnp.sin(angles)

    def lm_head_weight(self) -> Array:
        """``[H, V]`` output projection (the embedding's transpose when tied), V =
        ``vocab_limit`` or ``config.vocab_size``."""
        head = self.embed_tokens.embedding[...].T if self.config.tie_word_embeddings else self.lm_head.kernel[...]
        return head if self.vocab_limit is None else head[:, : self.vocab_limit]

    def logits(self, hidden: Array) -> Array:
        """``[..., H]`` hidden states → fp32 logits ``[..., V]``."""
        return jnp.dot(hidden, self.lm_head_weight(), preferred_element_type=jnp.float32)

    def __call__(self, input_ids: Array, positions: Array | None = None, attention_mask: Array | None = None) -> Array:
        """``[B, S]`` ids → fp32 logits ``[B, S, V]`` (causal; see :meth:`hidden_states`)."""
        return self.logits(self.hidden_states(input_ids, positions, attention_mask))


def cast_floating(state: Any, dtype: str | None) -> Any:
    """``state``'s floating-point arrays in ``dtype`` (None: unchanged); a decoder merged
    from them computes in that dtype (:attr:`Decoder.compute_dtype`): mixed precision."""
    if dtype is None:
        return state
    to = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def abstract_decoder(
    config: DecoderConfig,
    dtype: jnp.dtype | str,
    vocab_limit: int | None = None,
    attention: Implementation = "xla",
    lora: LoRAParams = NO_ADAPTERS,
) -> tuple[nnx.GraphDef, nnx.State]:
    """A decoder's graph and parameters as shapes and dtypes (nothing allocated): what a
    stage needs to receive weights into, or a plan to compile at; with ``lora``'s adapters
    (:mod:`asyncopd_jax.models.lora`) where it has a rank."""

    def build() -> Decoder:
        return add_adapters(Decoder(config, dtype=jnp.dtype(dtype), rngs=shape_keys()), lora, shape_keys())

    model = nnx.eval_shape(build)
    model.vocab_limit = vocab_limit
    model.attention = attention
    return nnx.split(model)
