"""The geometry of the weight updates: how large, how low-rank and how steady they are.

EffOPD (Cai et al., 2026) explains why extrapolating the weights works for on-policy
distillation: the update θ_t − θ_0 settles early on a stable, low-rank direction,
concentrated in the MLP. For every weight matrix that extrapolation moves
(:func:`asyncopd_jax.learner.extrapolation.is_movable`), with ``Δ = W_t − W_0``:

* ``relative_norm`` = ‖Δ‖_F / ‖W_0‖_F — where the update is concentrated;
* ``rank1_energy`` = σ₁(Δ)² / ‖Δ‖_F² — the share of the update's energy in its top
  singular direction (1: rank one; 1 / min(m, n) for an isotropic update);
* ``alignment`` = cos(W_t − W_s, W_s − W_0), the cosine between the update since the
  previous measurement (step s) and the cumulative update before it — near 1 when
  training keeps moving along the direction extrapolation would follow.

Diagnostic only (``train.update_geometry_every``); one SVD per matrix, so it costs
O(L · m · n · min(m, n)) per measurement.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from asyncopd_jax.learner.extrapolation import is_movable

PyTree = Any


def module_name(path: Any) -> str:
    """``layers.0.mlp.up_proj`` for the key path of ``…layers[0].mlp.up_proj.kernel``."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return ".".join(n for n in names if n not in ("kernel", "value"))


def matrix_geometry(
    initial: np.ndarray,
    previous: np.ndarray,
    current: np.ndarray,
) -> tuple[float, float | None, float | None]:
    """``(relative_norm, rank1_energy, alignment)`` of one weight matrix ``[in, out]`` (see
    the module docstring); None where a quantity is undefined (no update yet)."""
    w0, ws, wt = (np.asarray(x, np.float64) for x in (initial, previous, current))
    delta = wt - w0
    energy = float(np.sum(delta * delta))
    relative_norm = math.sqrt(energy) / max(float(np.linalg.norm(w0)), 1e-30)
    rank1 = float(np.linalg.svd(delta, compute_uv=False)[0] ** 2 / energy) if energy > 0 else None
    recent, before = (wt - ws).ravel(), (ws - w0).ravel()
    denom = float(np.linalg.norm(recent) * np.linalg.norm(before))
    alignment = float(recent @ before / denom) if denom > 0 else None
    return relative_norm, rank1, alignment


def update_geometry(initial: PyTree, previous: PyTree, current: PyTree) -> dict[str, list[float | None]]:
    """module name → ``[relative_norm, rank1_energy, alignment]`` for every movable 2-D
    weight of three parameter pytrees of the same structure (θ_0, θ_s, θ_t)."""
    out: dict[str, list[float | None]] = {}
    leaves = zip(*(jax.tree_util.tree_leaves_with_path(jax.device_get(t)) for t in (initial, previous, current)))
    for (path, w0), (_, ws), (_, wt) in leaves:
        if is_movable(path) and np.ndim(w0) == 2:
            out[module_name(path)] = [None if v is None else float(f"{v:.4g}") for v in matrix_geometry(w0, ws, wt)]
    return out


__all__ = ["matrix_geometry", "module_name", "update_geometry"]
