"""The learner's device mesh and sharding (``data × fsdp × tensor``; no ``pmap``).

* Batches are split along their leading (example) axis over ``data`` and ``fsdp`` (and
  replicated over ``tensor``, so the rows need not divide the whole mesh).
* Parameters and optimizer moments lie as the partition rules say
  (:mod:`asyncopd_jax.models.partitioning`): the ``embed`` dimension over ``fsdp``
  (FSDP), heads, MLP and vocabulary over ``tensor``. XLA inserts the all-gathers and
  reduce-scatters.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asyncopd_jax.config import MeshConfig
from asyncopd_jax.models.partitioning import MESH_AXES, parameter_shardings

BATCH_AXES = ("data", "fsdp")


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all); −1 for ``data`` or
    ``fsdp`` takes the remainder.

    With explicit sizes whose product is smaller than the device count, the first
    ``data · fsdp · tensor`` devices are used (e.g. all 1 for one device).
    """
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp, tensor = cfg.shape(len(devices))
    devices = devices[: cfg.devices_used(len(devices))]
    if data * fsdp * tensor != len(devices) or min(data, fsdp, tensor) < 1:
        raise ValueError(
            f"learner.mesh data={cfg.data} × fsdp={cfg.fsdp} × tensor={cfg.tensor} does not fit the "
            f"{len(devices)} devices (use -1 for data or fsdp to take the remaining devices)"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def state_shardings(tree, mesh: Mesh):
    """A NamedSharding per array leaf of ``tree`` (parameters, optimizer state), by the
    partition rules."""
    return parameter_shardings(tree, mesh)


def batch_shardings(tree, mesh: Mesh):
    """Split every array leaf's leading axis over ``(data, fsdp)``; scalars replicated."""

    def spec(x):
        return NamedSharding(mesh, PartitionSpec(BATCH_AXES) if np.ndim(x) else PartitionSpec())

    return jax.tree_util.tree_map(spec, tree)


def put(tree, shardings):
    """``tree`` on ``shardings`` (a pytree of them like ``tree``), copying only when some
    leaf lives elsewhere: ``jax.device_put`` of arrays already in place still costs ~10 µs
    a leaf, paid per mini-batch and per rollout group in the pipeline's hot path."""
    leaves, targets = jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)
    if all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, targets)):
        return tree
    return jax.device_put(tree, shardings)
