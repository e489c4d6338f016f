"""Mixed precision (``learner.compute_dtype``): bf16 compute over fp32 master weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.config import EstimatorConfig, OptimConfig
from asyncopd_jax.learner import (
    PolicyLoss,
    create_train_state,
    make_optimizer,
    make_proximal_fn,
    make_train_step,
)
from asyncopd_jax.learner.step import loss_model
from tests.learner.batches import make_learner_batch
from tests.tiny_models import tiny_decoder


def _step(compute_dtype):
    loss = PolicyLoss(EstimatorConfig("reverse_kl_mc"), compute_dtype=compute_dtype)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, schedule="constant"), 10)
    graphdef, state = create_train_state(tiny_decoder(0, scale=0.7), optimizer)
    state, metrics = make_train_step(graphdef, optimizer, loss)(state, make_learner_batch())
    return jax.device_get(state), jax.device_get(metrics)


def test_bf16_compute_keeps_fp32_master_weights_and_moments():
    fp32_state, fp32 = _step(None)
    bf16_state, bf16 = _step("bfloat16")
    for leaf in jax.tree_util.tree_leaves((bf16_state.params, bf16_state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    # the loss was computed in bf16: close to the fp32 one, and not equal to it
    assert abs(bf16["loss"] - fp32["loss"]) <= 2e-2 * abs(fp32["loss"])
    assert bf16["loss"] != fp32["loss"]


def test_a_bf16_model_computes_in_bf16_and_returns_fp32_logits():
    graphdef, params = nnx.split(tiny_decoder(0))
    model = loss_model(graphdef, params, "bfloat16")
    tokens = jnp.ones((2, 5), jnp.int32)
    assert model.compute_dtype == jnp.bfloat16
    assert model.hidden_states(tokens).dtype == jnp.bfloat16
    assert model(tokens).dtype == jnp.float32
    assert loss_model(graphdef, params, None).hidden_states(tokens).dtype == jnp.float32


def test_proximal_log_probs_are_taken_in_the_compute_dtype():
    """π_prox and π_θ must be equal before the batch's first step (importance ratio 1):
    both in bf16 when the loss computes in bf16."""
    loss = PolicyLoss(EstimatorConfig("decoupled_ppo"), compute_dtype="bfloat16")
    graphdef, params = nnx.split(tiny_decoder(0, scale=0.7))
    batch = make_learner_batch()
    proximal = make_proximal_fn(graphdef, loss)(params, batch)
    student = jax.jit(lambda p, b: loss.student(loss_model(graphdef, p, "bfloat16"), b))(params, batch)
    fp32 = jax.jit(lambda p, b: loss.student(loss_model(graphdef, p, None), b))(params, batch)
    np.testing.assert_array_equal(np.asarray(proximal.token), np.asarray(student.token))
    assert not np.array_equal(np.asarray(proximal.token), np.asarray(fp32.token))
