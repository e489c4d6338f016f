"""The mixture-of-experts MLP of Qwen3-MoE: a router sends each token to ``k`` of ``E``
SwiGLU experts and sums their outputs, weighted by the router's probabilities.

Per token ``x [H]``::

    p       = softmax(x · W_router)                  [E]   (fp32, as transformers does)
    top, ids = the k largest of p (ties: the lower expert id first)
    w       = top / Σ top   if norm_topk_prob, else top
    y       = Σ_j w_j · down_ids[j](silu(gate_ids[j](x)) · up_ids[j](x))

The experts run as grouped matmuls (:func:`jax.lax.ragged_dot`): the ``T·k`` (token,
expert) assignments are sorted by expert, each expert multiplies its contiguous run of
rows, and the rows go back to their tokens. That is ``T·k·3·H·I`` multiply-adds, the
active experts' FLOPs (``k/E`` of running every expert on every token, the dense
formulation: 8/128 for Qwen3-30B-A3B), and ``[T·k, I]`` of activations. TPU and GPU compile
it to a grouped matmul; XLA:CPU has none and JAX lowers it there to a dense matmul over
every expert with the other experts' rows masked to zero (``E×`` the FLOPs): the CPU is for
the small models of the built-in task, which the plan's TPU figures do not come from.

Shapes: T tokens (the batch's rows and positions, flattened), H hidden, E experts, k
experts per token, I an expert's width (``moe_intermediate_size``). Parameter names follow
Hugging Face's checkpoints: ``mlp.gate`` is the router; the experts' weights are stacked
over E (``experts.gate_proj [E, H, I]``), where a checkpoint stores one tensor per expert
(``mlp.experts.{e}.gate_proj.weight [I, H]``; :mod:`asyncopd_jax.models.hf_checkpoint`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.models.config import DecoderConfig

Array = jax.Array


def route(logits: Array, k: int, normalise: bool) -> tuple[Array, Array]:
    """The router's choice for each token.

    Args:
      logits: ``[T, E]`` router logits.
      k: experts per token.
      normalise: divide the chosen probabilities by their sum (``norm_topk_prob``).

    Returns:
      ``(weights [T, k] fp32, experts [T, k] int32)``, the most probable expert first; of
      equal probabilities the lower expert id (:func:`jax.lax.top_k`'s order, and
      ``torch.topk``'s on the CPU).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """``E`` SwiGLU MLPs, their weights stacked on a leading expert axis."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))  # [E, H, I]
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))  # [E, H, I]
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))  # [E, I, H]

    def __call__(self, x: Array, weights: Array, experts: Array) -> Array:
        """``x [T, H]``, each token's ``experts [T, k]`` and ``weights [T, k]`` → ``[T, H]``."""
        t, k = experts.shape
        flat = experts.reshape(-1)  # [T·k]: assignment a is token a // k's j = a % k-th choice
        order = jnp.argsort(flat, stable=True)  # the assignments grouped by expert
        sizes = jnp.bincount(flat, length=self.gate_proj.shape[0]).astype(jnp.int32)  # [E] rows per expert
        rows = jnp.take(x, order // k, axis=0)  # [T·k, H]
        gate = jax.lax.ragged_dot(rows, self.gate_proj[...], sizes)
        up = jax.lax.ragged_dot(rows, self.up_proj[...], sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down_proj[...], sizes)  # [T·k, H]
        # back to (token, choice) order, then each token's k outputs weighted and summed (the
        # weights in the compute dtype, as transformers multiplies them)
        back = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)
        return jnp.sum(back * weights.astype(x.dtype)[..., None], axis=1)


class SparseMoE(nnx.Module):
    """The MLP of a sparse layer: ``mlp.gate`` (the router, no bias) and ``mlp.experts``."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = nnx.Linear(
            config.hidden_size,
            config.num_experts,
            use_bias=False,
            dtype=None,
            param_dtype=dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.experts = Experts(config, dtype, rngs)
        self.k, self.normalise = config.num_experts_per_tok, config.norm_topk_prob

    def router_logits(self, x: Array) -> Array:
        """``x [..., H]`` → ``[..., E]`` in the compute dtype (transformers' ``F.linear``)."""
        return self.gate(x)

    def __call__(self, x: Array) -> Array:
        """``x [..., H]`` → ``[..., H]``."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.router_logits(flat), self.k, self.normalise)
        return self.experts(flat, weights, experts).reshape(x.shape)
