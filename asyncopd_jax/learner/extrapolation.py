"""EffOPD: extrapolate the weights along the update direction, accepted only if a probe improves.

On-policy distillation updates settle early on a stable, low-rank direction (Cai et al.,
2026). EffOPD exploits it: keep an anchor θ_a (the starting student); at optimizer steps
1, 2, 4, 8, … (after the normal update) take the update since the anchor, D = θ_t − θ_a,
and try θ_a + 3D, θ_a + 5D, … in order on a small held-out probe. Keep going while the
probe score strictly improves; on the first candidate that does not, stop and keep the
best point so far (θ_t itself if no candidate beat it: a rollback to the exact previous
weights). The best point becomes both the new weights and the new anchor.

Only attention and MLP projection weights move (:func:`is_movable`); embeddings, norms and
the LM head keep their θ_t values, and the optimizer's moments are not touched.

A LoRA student (:mod:`asyncopd_jax.models.lora`) is extrapolated on its adapters ``A`` and
``B``, not on ``ΔW = s·A B``: the base never moves, so θ is the adapters. With δA, δB the
changes since the anchor, the two differ only at second order in them:
``(A + f·δA)(B + f·δB) = AB + f·(δA B + A δB) + f²·δA δB`` against
``AB + f·(δA B + A δB + δA δB)``. And only A and B keep the weights a rank-r adapter that a
version can ship as such; ``ΔW`` extrapolated needs rank 2r in general. Weights such a
student trains whole beside its adapters (``student.lora.modules_to_save``: the embedding,
the norms) follow the rule above and keep their θ_t values.

The functions here are pure functions of parameter pytrees; the probe is any
``score(params) -> float`` (higher is better), so the search is testable on toy problems
and the learner supplies the real probe (accuracy of sampled answers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
DEFAULT_FACTORS = (3, 5, 7, 9, 11)  # θ_a + (2j + 1)·D, j = 1 … 5
_MOVABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_checkpoint_step(step: int) -> bool:
    """Whether optimizer step ``step`` (1-based) is an extrapolation point: 1, 2, 4, 8, …"""
    return step >= 1 and step & (step - 1) == 0


def is_movable(path: Sequence[Any]) -> bool:
    """Whether the parameter at ``path`` (a pytree key path) is an attention or MLP
    projection weight or bias, the only parameters extrapolation moves."""
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    return bool(names & set(_MOVABLE))


def extrapolate(anchor: PyTree, current: PyTree, factor: float) -> PyTree:
    """``anchor + factor · (current − anchor)`` on movable leaves, ``current`` elsewhere.

    Computed in fp32 and cast back to each leaf's dtype (bf16 weights do not lose the
    small difference ``current − anchor`` to rounding before it is scaled)."""

    def one(path, a, c):
        if not is_movable(path):
            return c
        moved = a.astype(jnp.float32) + factor * (c.astype(jnp.float32) - a.astype(jnp.float32))
        return moved.astype(c.dtype)

    return jax.tree_util.tree_map_with_path(one, anchor, current)


@dataclasses.dataclass(frozen=True)
class Jump:
    """One extrapolation search: the probe score of θ_t and of each candidate tried, and
    the factor kept (1 = rollback to θ_t)."""

    step: int
    base_score: float
    tried: tuple[tuple[float, float], ...]  # (factor, score) in the order tried
    accepted_factor: float

    @property
    def accepted(self) -> bool:
        return self.accepted_factor != 1

    def metrics(self) -> dict[str, float]:
        return {
            "extrapolation_factor": float(self.accepted_factor),
            "extrapolation_base_score": self.base_score,
            "extrapolation_best_score": max([self.base_score, *(s for _, s in self.tried)]),
            "extrapolation_candidates": float(len(self.tried)),
        }


def search(
    anchor: PyTree,
    current: PyTree,
    score: Callable[[PyTree], float],
    *,
    step: int = 0,
    factors: Sequence[float] = DEFAULT_FACTORS,
) -> tuple[PyTree, Jump]:
    """The best of θ_t and ``extrapolate(anchor, current, f)`` for ``f`` in ``factors``,
    trying them in order while the probe strictly improves. Returns (params, the record)."""
    best, best_score = current, float(score(current))
    best_factor: float = 1
    base, tried = best_score, []
    for factor in factors:
        candidate = extrapolate(anchor, current, factor)
        value = float(score(candidate))
        tried.append((float(factor), value))
        if not value > best_score:  # not a strict improvement (NaN included): stop here
            break
        best, best_score, best_factor = candidate, value, factor
    return best, Jump(step, base, tuple(tried), best_factor)


class Extrapolator:
    """The anchor and the schedule around :func:`search` for a training loop.

    ``after_update(step, params, score)`` returns the parameters to continue from (the
    accepted extrapolation or ``params`` unchanged) and the search's record, or
    ``(params, None)`` at steps that are not extrapolation points.
    """

    def __init__(self, initial_params: PyTree, factors: Sequence[float] = DEFAULT_FACTORS):
        if not factors or any(f <= 1 for f in factors):
            raise ValueError(f"extrapolation factors must be > 1 (got {tuple(factors)})")
        self.anchor = _copy(initial_params)
        self.factors = tuple(factors)

    def after_update(self, step: int, params: PyTree, score: Callable[[PyTree], float]) -> tuple[PyTree, Jump | None]:
        if not is_checkpoint_step(step):
            return params, None
        best, jump = search(self.anchor, params, score, step=step, factors=self.factors)
        self.anchor = _copy(best)  # re-anchor at the point kept
        return best, jump


def _copy(tree: PyTree) -> PyTree:
    """A copy with its own buffers: the learner donates its parameters to the next train
    step, which would delete an anchor that merely referenced them."""
    return jax.tree_util.tree_map(jnp.copy, tree)


__all__ = ["DEFAULT_FACTORS", "Extrapolator", "Jump", "extrapolate", "is_checkpoint_step", "is_movable", "search"]
