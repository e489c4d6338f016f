"""Matmul FLOPs of a JAX function, counted from its jaxpr (nothing is compiled or run).

XLA's ``cost_analysis()`` counts a loop's body once whatever its trip count (the LM-head
gather runs ``T / chunk`` chunks in a ``lax.map``; gradient accumulation scans the
micro-batches) and counts nothing inside a Pallas kernel, so its FLOPs for a train step
are a fraction of the work. Here every ``dot_general`` is counted at ``2 · batch · M · N · K``
(a ``ragged_dot_general``, a mixture of experts' grouped matmul, at ``2 · M · N · K`` for its
M rows: each row is multiplied by one group's ``[K, N]``, the active experts' FLOPs)
and multiplied by the trip count of each ``scan`` around it; the branches of a ``cond``
count their most expensive one. Elementwise work (softmax, norms, the optimizer) is
left out: it is a few percent of a transformer's FLOPs, and MFU conventions leave it out too.

The count is of the whole (unsharded) computation: divide by the devices for a per-chip
figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.extend import core as jex_core


def _dot_flops(eqn: Any) -> int:
    """``2 · batch · M · N · K`` of one ``dot_general``."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    batch = math.prod(lhs[i] for i in lhs_batch)
    contract = math.prod(lhs[i] for i in lhs_contract)
    m = math.prod(d for i, d in enumerate(lhs) if i not in (*lhs_batch, *lhs_contract))
    n = math.prod(d for i, d in enumerate(rhs) if i not in (*rhs_batch, *rhs_contract))
    return 2 * batch * m * n * contract


def _ragged_dot_flops(eqn: Any) -> int:
    """``2 · M · N · K`` of one ``ragged_dot_general`` (lhs ``[M, K]`` ragged over M, rhs
    ``[G, K, N]``): each of the M rows meets one group's matrix, not all G."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers.dot_dimension_numbers
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    skip = (*rhs_batch, *rhs_contract, *numbers.rhs_group_dimensions)
    rows = math.prod(d for i, d in enumerate(lhs) if i not in lhs_contract)  # batch dims included
    contract = math.prod(lhs[i] for i in lhs_contract)
    n = math.prod(d for i, d in enumerate(rhs) if i not in skip)
    return 2 * rows * n * contract


def _subjaxprs(value: Any) -> Iterable[Any]:
    """The jaxprs in an equation's parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _subjaxprs(item)


def jaxpr_matmul_flops(jaxpr: Any) -> int:
    """Matmul FLOPs of ``jaxpr`` (a Jaxpr or ClosedJaxpr), loops multiplied out."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            total += _dot_flops(eqn)
            continue
        if eqn.primitive.name == "ragged_dot_general":
            total += _ragged_dot_flops(eqn)
            continue
        if eqn.primitive.name == "cond":  # one branch runs: count the most expensive
            total += max(jaxpr_matmul_flops(b) for b in eqn.params["branches"])
            continue
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                total += times * jaxpr_matmul_flops(sub)
    return total


def matmul_flops(fn: Callable, *args: Any) -> int:
    """Matmul FLOPs of one call ``fn(*args)`` (``args`` may be ``ShapeDtypeStruct``)."""
    return jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args))


def transformer_flops(config: Any, rows: int, tokens: int, head_tokens: int, backward: bool) -> int:
    """The textbook count of a decoder pass over ``rows × tokens``: 2 FLOPs per matmul
    weight per token (the LM head only on the ``head_tokens`` it is applied to), plus
    attention's ``2 · 2 · S² · N_q · D`` per layer and row (scores and weighted sum over the
    whole ``[S, S]``, as :func:`jaxpr_matmul_flops` counts the plain implementation); three
    times that with the backward pass (the "6 · P · tokens" rule). A mixture-of-experts
    layer counts its active weights: the router's ``H · E`` and ``k`` experts' ``3 · H · I``."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attention = h * q + 2 * h * kv + q * h
    dense = 3 * h * config.intermediate_size
    sparse = h * config.num_experts + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
    weights = sum(
        attention + (sparse if config.is_sparse(layer) else dense) for layer in range(config.num_hidden_layers)
    )
    forward = rows * (
        2 * weights * tokens
        + 2 * h * config.vocab_size * head_tokens
        + config.num_hidden_layers * 4 * tokens * tokens * q
    )
    return 3 * forward if backward else forward
