"""The partition rules: every parameter's logical axes, and their mesh axes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from asyncopd_jax.config import MeshConfig, ModelSource, OptimConfig
from asyncopd_jax.learner import make_mesh, make_optimizer
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.partitioning import (
    PARAMETER_AXES,
    constrain,
    logical_spec,
    mesh_context,
    parameter_axes,
    parameter_shardings,
)
from asyncopd_jax.scale.learner_inputs import architecture


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))


def test_logical_spec_splits_what_divides_and_uses_each_mesh_axis_once(mesh):
    assert logical_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert logical_spec(("embed", "mlp"), (63, 128), mesh) == P(None, "tensor")  # 63 rows: not over 2
    assert logical_spec(("vocab", "embed"), (61, 64), mesh) == P(None, "fsdp")  # 61 ids: not over 4
    assert logical_spec(("heads", "kv_heads"), (8, 8), mesh) == P("tensor")  # tensor already taken
    assert logical_spec(("batch", None, None), (4, 3, 5), mesh) == P("fsdp")  # data has size 1
    assert logical_spec((None, "unknown"), (4, 4), mesh) == P()


def test_every_weight_of_a_real_model_is_split_over_both_axes(mesh):
    """Qwen3-1.7B's shapes: each matrix split over fsdp and tensor (1/8 of it per device),
    norms replicated; the optimizer's moments follow their parameters by path."""
    config, _ = architecture(ModelSource(path="/nowhere/Qwen3-1.7B"))
    _, params = abstract_decoder(config, "float32")
    shardings = parameter_shardings(params, mesh)
    for (path, x), (_, sharding) in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_flatten_with_path(shardings)[0]
    ):
        spec = tuple(sharding.spec)
        if x.ndim == 2:
            assert set(spec) == {"fsdp", "tensor"}, (jax.tree_util.keystr(path), spec)
        else:
            assert not any(spec), (jax.tree_util.keystr(path), spec)
    moments = jax.eval_shape(make_optimizer(OptimConfig(), 10).init, params)
    specs = {
        jax.tree_util.keystr(p): s.spec
        for p, s in jax.tree_util.tree_flatten_with_path(parameter_shardings(moments, mesh))[0]
    }
    mu = next(spec for key, spec in specs.items() if "mu" in key and "q_proj" in key and "kernel" in key)
    assert mu == P("fsdp", "tensor")


def test_every_table_entry_names_a_parameter_of_the_decoder():
    _, params = abstract_decoder(architecture(ModelSource(path="/nowhere/Qwen3-0.6B"))[0], "float32")
    named = {parameter_axes(path) is not None for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert named == {True, False}  # norms are not in the table
    found = {
        key
        for key in PARAMETER_AXES
        for path, _ in nnx.to_flat_state(params)
        if tuple(str(k) for k in path)[-2:] == key
    }
    # tied embeddings (no lm_head), no biases and no experts in Qwen3: the rest are named
    moe = {("gate", "kernel"), ("experts", "gate_proj"), ("experts", "up_proj"), ("experts", "down_proj")}
    assert found == {k for k in PARAMETER_AXES if k[-1] != "bias" and k[0] != "lm_head" and k not in moe}
    assert {path[-2:] for path, _ in nnx.to_flat_state(_moe_params()) if parameter_axes(path)} >= moe


def _moe_params(experts: int = 8):
    import dataclasses

    dense, _ = architecture(ModelSource(path="/nowhere/Qwen3-0.6B"))
    config = dataclasses.replace(
        dense, model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=256
    )
    return abstract_decoder(config, "float32")[1]


def test_the_experts_split_over_fsdp_whole_each_and_the_router_over_fsdp(mesh):
    """[E, H, I] / [E, I, H]: E over fsdp (expert parallelism: a device holds whole experts,
    their H not split) and I over tensor; the router [H, E] over fsdp. Where fsdp does not
    divide E, each expert is laid out as a dense MLP (H over fsdp)."""

    def specs(params):
        return {
            tuple(str(k) for k in path)[-2:]: tuple(s.spec)
            for path, s in nnx.to_flat_state(parameter_shardings(params, mesh))
            if "layers" in path and path[1] == 0
        }

    split = specs(_moe_params())
    assert split[("experts", "gate_proj")] == ("fsdp", None, "tensor")
    assert split[("experts", "down_proj")] == ("fsdp", "tensor")
    assert split[("gate", "kernel")] == ("fsdp",)
    dense = specs(_moe_params(experts=7))
    assert dense[("experts", "gate_proj")] == (None, "fsdp", "tensor")
    assert dense[("experts", "down_proj")] == (None, "tensor", "fsdp")


def test_constrain_applies_only_under_a_mesh(mesh):
    x = np.ones((4, 3, 8), np.float32)
    jaxpr = jax.make_jaxpr(lambda a: constrain(a, ("batch", None, None)))(x)
    assert "sharding_constraint" not in str(jaxpr)
    with mesh_context(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):
        jaxpr = jax.make_jaxpr(lambda a: constrain(a, ("batch", None, None)))(x)
    assert "sharding_constraint" in str(jaxpr)
