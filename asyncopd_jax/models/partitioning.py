"""How the decoder's arrays lie on a device mesh: one table of logical axes, one of rules.

Every parameter's dimensions have *logical* names (what the dimension is: ``embed``,
``heads``, ``mlp``, ``vocab``, …), looked up by the end of the parameter's path, so the
optimizer's moments (whose paths end the same way) follow their parameters. One rules table
maps logical names to *mesh* axes (MaxText's ``logical_axis_rules``). Every stage's mesh
has the same three axes:

* ``data``: batch rows (data parallelism);
* ``fsdp``: batch rows too, and the parameters' ``embed`` dimension (ZeRO-3 / FSDP: XLA
  gathers a layer's weights before it runs and reduce-scatters their gradients after);
* ``tensor``: attention heads, the MLP's hidden units and the vocabulary (Megatron tensor
  parallelism: no weight is ever whole on one device, and batch rows need not divide it).

A mixture of experts' experts split over ``fsdp`` (expert parallelism: a device holds whole
experts, and the tokens, split over fsdp as rows, are sent to them: :mod:`asyncopd_jax.models.moe`).

A dimension is split only where the mesh axes' sizes divide it; otherwise it is replicated
(the demo's 61-token vocabulary on a 2-way ``tensor`` axis). Axes of size 1 change nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Logical = tuple[str | None, ...]

#: The logical axes of each parameter, by the end of its path (biases and norms follow).
PARAMETER_AXES: dict[tuple[str, ...], Logical] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),  # [V, H]
    ("lm_head", "kernel"): ("embed", "vocab"),  # [H, V]
    ("q_proj", "kernel"): ("embed", "heads"),  # [H, N_q·D]
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),  # [H, N_kv·D]
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"),  # [N_q·D, H]
    ("gate_proj", "kernel"): ("embed", "mlp"),  # [H, I]
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "embed"),  # [I, H]
    # a mixture of experts (models/moe.py): the router, and the experts' stacked weights
    ("gate", "kernel"): ("embed", None),  # [H, E]
    ("experts", "gate_proj"): ("expert", "embed", "mlp"),  # [E, H, I]
    ("experts", "up_proj"): ("expert", "embed", "mlp"),
    ("experts", "down_proj"): ("expert", "mlp", "embed"),  # [E, I, H]
}

#: A LoRA adapter (models/lora.py) lies as its projection's kernel ``[in, out]`` does:
#: ``lora_a [in, r]`` split as ``in``, ``lora_b [r, out]`` as ``out``; the rank is never split.
ADAPTERS: dict[str, Any] = {
    "lora_a": lambda kernel: (kernel[0], None),
    "lora_b": lambda kernel: (None, kernel[1]),
}

#: Logical axis → the mesh axes it is split over (absent: replicated). Activations name
#: their dimensions too: ``batch`` rows, ``act_heads`` (a head dimension of q, k, v and the
#: KV cache), ``positions`` (the sequence positions of the learner's LM-head gather, which
#: splits them over ``tensor`` as well: :mod:`asyncopd_jax.learner.lm_head`).
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "act_heads": ("tensor",),
    "positions": ("tensor",),
    # expert parallelism: the devices that split the batch over fsdp hold E / fsdp whole
    # experts each (their embed dimension, fsdp being taken, is not split) and the tokens
    # travel to their experts by all-to-all (models/moe.py), where FSDP would all-gather
    # every expert's weights for every layer; an expert's MLP width still splits over tensor
    "expert": ("fsdp",),
}


def mesh_axes(name: str, mesh: Mesh | Any) -> tuple[str, ...]:
    """The axes of ``mesh`` (more than one device each) that :data:`RULES` split the logical
    axis ``name`` over, whatever a dimension's size."""
    sizes = dict(mesh.shape)
    return tuple(a for a in RULES.get(name, ()) if sizes.get(a, 1) > 1)


def _names(path: Sequence[Any]) -> tuple[str, ...]:
    """A path's named keys as strings: a pytree path (``DictKey``, ``GetAttrKey``, …) or
    an ``nnx`` flat-state key (plain strings and ints)."""
    names = (key if isinstance(key, str) else getattr(key, "key", getattr(key, "name", None)) for key in path)
    return tuple(name for name in names if isinstance(name, str))


def parameter_axes(path: Sequence[Any]) -> Logical | None:
    """The logical axes of the parameter at ``path`` (a pytree path of the model's state or
    of an optimizer state holding it), None for one the table does not name (norms,
    counters: replicated)."""
    names = _names(path)
    for end in range(len(names), 1, -1):  # the path may go on: (..., "q_proj", "kernel", "value")
        module, leaf = names[end - 2 : end]
        if leaf in ADAPTERS and (module, "kernel") in PARAMETER_AXES:
            return ADAPTERS[leaf](PARAMETER_AXES[module, "kernel"])
        axes = PARAMETER_AXES.get((module, leaf))
        if axes is not None:
            return axes
    return None


def logical_spec(axes: Logical, shape: Sequence[int], mesh: Mesh | Any) -> PartitionSpec:
    """``axes`` (one logical name or None per dimension of ``shape``) → a PartitionSpec on
    ``mesh`` (a Mesh or an AbstractMesh): each dimension over the mesh axes :data:`RULES`
    give it that ``mesh`` has, with more than one device, and whose sizes divide it; a mesh
    axis is used at most once."""
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(axes, shape):
        split = tuple(a for a in mesh_axes(name, mesh) if a not in used) if name else ()
        if split and size % math.prod(sizes[a] for a in split) == 0:
            used.update(split)
            spec.append(split[0] if len(split) == 1 else split)
        else:
            spec.append(None)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def parameter_spec(path: Sequence[Any], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Where the parameter (or optimizer moment) at ``path`` lies on ``mesh``."""
    axes = parameter_axes(path)
    return PartitionSpec() if axes is None or len(axes) != len(shape) else logical_spec(axes, shape, mesh)


def parameter_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array of ``tree`` (parameters, optimizer state, by path)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, parameter_spec(path, np.shape(x), mesh)), tree
    )


def mesh_context(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """``jax.set_mesh(mesh)`` (nothing for no mesh): jit a stage's functions inside it, so
    that :func:`constrain` and the Pallas kernels' ``shard_map`` see the stage's mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def constrain(x: jax.Array, axes: Logical) -> jax.Array:
    """``x`` constrained to the layout ``axes`` name, on the mesh being traced under
    (``jax.set_mesh``); unchanged when there is none (one device, tests, the CPU demo)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))


def target_platform() -> str:
    """Where the computation being traced will run: the platform of the context mesh's
    devices (a plan compiles for TPU chips on a CPU host, whose default backend is "cpu"),
    else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()
