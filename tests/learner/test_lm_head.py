"""The row-parallel LM-head gather: the same log-probs, entropies and gradients as the plain
fused gather, on every mesh shape, with each device scanning only its own positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.config import MeshConfig
from asyncopd_jax.estimators import gather_logprobs_and_entropy_from_hidden
from asyncopd_jax.learner.lm_head import gather_on_mesh
from asyncopd_jax.learner.sharding import make_mesh

B, T, H, V, K = 8, 8, 16, 37, 3


def _problem(t: int = T):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(B, t, H)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(H, V)) / np.sqrt(H), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, size=(B, t, K)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, t, K)), jnp.float32)  # a loss that weighs every output
    return hidden, head, ids, weights


def _loss(gather):
    def loss(hidden, head, ids, weights):
        logp, entropy = gather(hidden, head, ids, 5, 0.8)
        return jnp.sum(logp * weights) + 0.3 * jnp.sum(entropy * weights[..., 0])

    return loss


@pytest.mark.parametrize(
    "data, fsdp, tensor",
    [(2, 2, 2), (1, 4, 2), (1, 1, 8), (8, 1, 1), (1, 2, 4)],
    ids=["all-three", "fsdp+tensor", "tensor-only", "data-only", "rows-split-positions-split"],
)
def test_row_parallel_gather_equals_the_plain_one(data, fsdp, tensor):
    hidden, head, ids, weights = _problem()
    want = jax.jit(jax.value_and_grad(_loss(gather_logprobs_and_entropy_from_hidden), argnums=(0, 1)))(
        hidden, head, ids, weights
    )
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(_loss(gather_on_mesh), argnums=(0, 1)))(hidden, head, ids, weights)
        hlo = jax.jit(_loss(gather_on_mesh)).lower(hidden, head, ids, weights).as_text()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w, name in zip(got[1], want[1], ("d hidden", "d head")):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    # each device scans only its own B·T / 8 = 8 positions: 2 chunks of 5 (the plain gather: 13)
    assert f"tensor<2x5x{H}xf32>" in hlo and f"tensor<13x5x{H}xf32>" not in hlo


def test_a_mesh_axis_that_splits_nothing_counts_its_positions_once():
    """12 positions on tensor = 8 and 8 rows on no batch axis: nothing is split, every
    device scans every position, and the head's gradient is still counted once (not summed
    over the 8 devices that hold the same positions)."""
    hidden, head, ids, weights = _problem(t=12)
    want = jax.grad(_loss(gather_logprobs_and_entropy_from_hidden), argnums=1)(hidden, head, ids, weights)
    with jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=1, tensor=8))):
        got = jax.jit(jax.grad(_loss(gather_on_mesh), argnums=1))(hidden, head, ids, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
