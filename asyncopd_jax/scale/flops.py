"""Matmul FLOPs of a JAX function, counted from its jaxpr (nothing is compiled or run).

XLA's ``cost_analysis()`` counts a loop's body once whatever its trip count (the LM-head
gather runs ``T / chunk`` chunks in a ``lax.map``; gradient accumulation scans the
micro-batches) and counts nothing inside a Pallas kernel, so its FLOPs for a train step
are a fraction of the work. Here every ``dot_general`` is counted at ``2 · batch · M · N · K``
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
    times that with the backward pass (the "6 · P · tokens" rule)."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    forward = rows * (
        2 * config.num_hidden_layers * layer * tokens
        + 2 * h * config.vocab_size * head_tokens
        + config.num_hidden_layers * 4 * tokens * tokens * q
    )
    return 3 * forward if backward else forward
