"""The partition rules at their edges: a parameter found through every kind of pytree key, a
mesh that lacks one of the three axes, no mesh at all.

Written for mutants of ``asyncopd_jax/models/partitioning.py`` that survived the sampled
mutation run of 2026-11-26 (docs/log/mutation-history.md, "Sampled scores of the newer areas (2026-11-26)").
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from asyncopd_jax.models.partitioning import MESH_AXES, constrain, logical_spec, mesh_context, parameter_axes

KEYS = {"DictKey": DictKey, "GetAttrKey": GetAttrKey, "flat": None}


def _path(kind: str, *names: str | int) -> tuple:
    """``names`` as a path of ``kind``: a dict's pytree path, a dataclass's or module's
    (attribute keys), or an nnx flat-state key (plain strings and ints)."""
    key = KEYS[kind]
    if key is None:
        return names
    return tuple(key(n) if isinstance(n, str) else SequenceKey(n) for n in names)


@pytest.mark.parametrize("kind", KEYS)
def test_a_parameter_is_named_by_the_end_of_its_path_whatever_its_keys(kind):
    """Bug guarded: a path's names read from one kind of key only (``_names`` asking a key
    for a misspelt attribute, ``"KEY"`` or ``"NAME"``): a parameter reached through
    attribute keys, or through dict keys, would go unnamed and be replicated whole on every
    device."""
    assert parameter_axes(_path(kind, "layers", 0, "self_attn", "q_proj", "kernel")) == ("embed", "heads")
    assert parameter_axes(_path(kind, "mu", "layers", 0, "mlp", "down_proj", "kernel", "value")) == ("mlp", "embed")
    assert parameter_axes(_path(kind, "layers", 0, "input_layernorm", "scale")) is None


def test_a_mesh_without_an_axis_splits_only_over_the_axes_it_has():
    """Bug guarded: a mesh axis the mesh lacks taken as present (``sizes.get(a, 2)``): the
    rule for ``batch`` (data, fsdp) then asks for the size of an ``fsdp`` axis that is not
    there, and ``heads`` (tensor) is split over a missing axis."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    assert logical_spec(("batch", "heads", "embed"), (4, 8, 6), mesh) == P("data")


def test_no_mesh_changes_nothing_not_even_a_mesh_already_set():
    """Bug guarded: ``mesh_context(None)`` entering ``jax.set_mesh(None)`` instead of doing
    nothing: that clears a mesh a caller has set (its layout constraints would vanish) and
    refuses to run inside a traced function."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 1, 2), MESH_AXES)
    with mesh_context(mesh), mesh_context(None):
        assert dict(jax.sharding.get_abstract_mesh().shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    with mesh_context(None):
        assert jax.sharding.get_abstract_mesh().empty

    def traced(x):
        with mesh_context(None):
            return constrain(x, ("batch", None)) + 1

    np.testing.assert_array_equal(jax.jit(traced)(np.ones((4, 2), np.float32)), np.full((4, 2), 2.0))


def test_constrain_lays_an_array_out_as_its_axes_say_under_a_mesh():
    """Bug guarded: ``constrain`` emitting a constraint with no layout
    (``with_sharding_constraint(x, None)``): a sharding constraint is still in the program
    (what ``test_constrain_applies_only_under_a_mesh`` looks for), but it lays out nothing,
    and the rows of the sampler's cache are no longer split over the batch axes."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), MESH_AXES)
    x = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8, 3, 4)
    with mesh_context(mesh):
        rows = jax.jit(lambda a: constrain(a * 2, ("batch", None, "act_heads")))(x)
    assert rows.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_array_equal(rows, x * 2)
