"""The learner's device mesh and sharding rules (``data × fsdp``; no ``pmap``).

* Batches are split along their leading (example) axis over both mesh axes.
* Parameters and optimizer moments are sharded FSDP-style: each array's largest axis
  that the ``fsdp`` size divides is split over ``fsdp``; everything else is replicated.
  XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.config import MeshConfig

BATCH_AXES = ("data", "fsdp")


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A ``(data, fsdp)`` mesh over ``devices`` (default: all); −1 takes the remainder.

    With explicit sizes whose product is smaller than the device count, the first
    ``data · fsdp`` devices are used (e.g. ``data: 1, fsdp: 1`` for one device).
    """
    devices = list(jax.devices() if devices is None else devices)
    fsdp = len(devices) // max(cfg.data, 1) if cfg.fsdp == -1 else cfg.fsdp
    data = len(devices) // fsdp if cfg.data == -1 else cfg.data
    if 0 < data * fsdp < len(devices) and cfg.data != -1 and cfg.fsdp != -1:
        devices = devices[: data * fsdp]
    if data * fsdp != len(devices) or data < 1 or fsdp < 1:
        raise ValueError(
            f"learner.mesh data={cfg.data} × fsdp={cfg.fsdp} does not fit the {len(devices)} devices "
            "(use -1 for one axis to take the remaining devices)"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp), ("data", "fsdp"))


def param_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Shard the largest axis divisible by ``fsdp`` over ``fsdp``; replicate otherwise."""
    if fsdp == 1 or not shape:
        return PartitionSpec()
    candidates = [axis for axis in np.argsort(shape)[::-1] if shape[axis] % fsdp == 0]
    if not candidates:
        return PartitionSpec()
    spec: list[str | None] = [None] * len(shape)
    spec[int(candidates[0])] = "fsdp"
    return PartitionSpec(*spec)


def state_shardings(tree, mesh: Mesh):
    """A NamedSharding per array leaf of ``tree`` (parameters, optimizer state)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, param_spec(tuple(np.shape(x)), fsdp)), tree)


def batch_shardings(tree, mesh: Mesh):
    """Split every array leaf's leading axis over ``(data, fsdp)``; scalars replicated."""

    def spec(x):
        return NamedSharding(mesh, PartitionSpec(BATCH_AXES) if np.ndim(x) else PartitionSpec())

    return jax.tree_util.tree_map(spec, tree)
