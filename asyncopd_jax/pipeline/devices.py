"""A stage's devices and mesh in this process: the layout's device decision
(:func:`~asyncopd_jax.pipeline.layout.local_device_ids`) mapped onto the JAX devices this
process sees, in one place, and the arrays a stage moves onto its mesh.

A stage's mesh has the axes ``data × fsdp × tensor`` over its devices
(``learner.mesh``, ``stages.rollout_mesh``, ``stages.scoring_mesh``; default: all on
``data``, the models replicated); its models lie there as
:mod:`asyncopd_jax.models.partitioning` says.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from asyncopd_jax.config import MeshConfig
from asyncopd_jax.learner.sharding import make_mesh, put
from asyncopd_jax.models.partitioning import logical_spec
from asyncopd_jax.pipeline.layout import Layout, StagePlan, local_device_ids


def stage_devices(layout: Layout, plan: StagePlan, multi_process: bool = False) -> list[jax.Device]:
    """The devices ``plan`` computes on: :func:`~asyncopd_jax.pipeline.layout.local_device_ids`
    over this process's devices. A learner over several processes (``multi_process``) is one
    global mesh over every process's devices, each process contributing what its launcher
    made visible to it."""
    if multi_process:
        return jax.devices()
    local = jax.local_devices()
    return [local[i] for i in local_device_ids(layout, plan, len(local), jax.default_backend())]


def stage_mesh(devices: list[jax.Device], mesh: MeshConfig | None = None) -> Mesh:
    """A stage's ``(data, fsdp, tensor)`` mesh over its devices, shaped as ``mesh`` says
    (``stages.rollout_mesh``, ``stages.scoring_mesh``; default: every device on ``data``)."""
    return make_mesh(mesh or MeshConfig(), devices)


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """``tree``'s arrays on ``mesh``: rows split over the mesh's batch axes where they
    divide, else replicated (a device-to-device copy when they live elsewhere)."""

    def sharding(x: Any) -> NamedSharding:
        axes = ("batch",) + (None,) * (np.ndim(x) - 1) if np.ndim(x) else ()
        return NamedSharding(mesh, logical_spec(axes, np.shape(x), mesh))

    return put(tree, jax.tree_util.tree_map(sharding, tree))


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """``abstract``'s shapes and dtypes, placed by ``shardings`` (restores land there)."""
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
