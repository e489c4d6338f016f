"""Environment tokens of a multi-turn trajectory (``RolloutBatch.environment_mask``): context
for the student, outside every loss, gradient and denominator; the same in the plain train
step, with token-budget packing and sharded over a (data, fsdp) mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from asyncopd_jax.config import EstimatorConfig, MeshConfig
from asyncopd_jax.learner import PolicyLoss, create_train_state, make_packed_train_step, make_train_step
from asyncopd_jax.learner.sharding import make_mesh
from tests.learner.batches import make_learner_batch
from tests.learner.test_nonfinite import _one_sgd_step
from tests.tiny_models import tiny_decoder

ENVIRONMENT = slice(1, 5)  # response slots 1–4 of every row long enough: a tool's observation


MESH = MeshConfig(data=4, fsdp=2)  # the 8 virtual CPU devices (tests/conftest.py)


@pytest.fixture(scope="module")
def steps():
    graphdef, _ = nnx.split(tiny_decoder(0, scale=0.7))
    loss = PolicyLoss(EstimatorConfig("forward_kl_topk"))
    mesh = make_mesh(MESH)
    _, sharded_state = create_train_state(tiny_decoder(0, scale=0.7), optax.sgd(1.0), mesh)
    return {
        "plain": make_train_step(graphdef, optax.sgd(1.0), loss, micro_batches=2),
        # bucket 1: each micro-batch trimmed to its own longest trajectory, not rounded up to all the slots
        "packed": make_packed_train_step(graphdef, optax.sgd(1.0), loss, token_budget=64, bucket=1),
        # the learner's rows and parameters over a (data 4, fsdp 2) mesh, as a multi-device learner runs
        "sharded": make_train_step(
            graphdef, optax.sgd(1.0), loss, micro_batches=2, mesh=mesh, state_example=sharded_state
        ),
    }


def _one_step(steps, kind: str, batch):
    """(loss, flat gradient, metrics) of one SGD step of ``kind`` from the same start."""
    if kind != "sharded":
        return _one_sgd_step(steps[kind], batch)
    _, state = create_train_state(tiny_decoder(0, scale=0.7), optax.sgd(1.0), make_mesh(MESH))
    before = jax.device_get(state.params)
    after, metrics = steps[kind](state, batch)
    leaves = zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(jax.device_get(after.params)))
    return float(metrics["loss"]), np.concatenate([np.ravel(a - b) for a, b in leaves]), jax.device_get(metrics)


def _trajectories():
    """The learner batch with slots 1–4 of each row of ≥ 6 tokens written by an environment."""
    batch = make_learner_batch()
    mask = np.array(batch.rollout.response_mask)
    environment = np.zeros_like(mask)
    long = mask.sum(1) >= 6
    environment[long, ENVIRONMENT] = True
    mask[long, ENVIRONMENT] = False
    assert environment.sum() >= 4
    rollout = dataclasses.replace(
        batch.rollout, response_mask=jnp.asarray(mask), environment_mask=jnp.asarray(environment)
    )
    return dataclasses.replace(batch, rollout=rollout), environment


@pytest.mark.parametrize("kind", ["plain", "packed", "sharded"])
def test_environment_tokens_are_outside_the_loss_and_its_denominator(steps, kind):
    """Scores and behaviour log-probs at environment slots set to other (finite) values change
    neither the loss nor the gradient by a bit; the token mean is over the student's tokens."""
    batch, environment = _trajectories()
    cache = batch.cache
    noisy = dataclasses.replace(
        cache,
        topk_logp=jnp.where(jnp.asarray(environment)[..., None], cache.topk_logp - 3.0, cache.topk_logp),
        token_logp=jnp.where(jnp.asarray(environment), cache.token_logp - 5.0, cache.token_logp),
    )
    rollout = dataclasses.replace(
        batch.rollout,
        behavior_logp=jnp.where(
            jnp.asarray(environment), batch.rollout.behavior_logp - 2.0, batch.rollout.behavior_logp
        ),
    )
    loss, grad, metrics = _one_step(steps, kind, batch)
    noisy_loss, noisy_grad, _ = _one_step(steps, kind, dataclasses.replace(batch, cache=noisy, rollout=rollout))
    assert noisy_loss == loss and np.array_equal(noisy_grad, grad)
    assert float(metrics["tokens"]) == float(np.asarray(batch.rollout.response_mask).sum())


@pytest.mark.parametrize("kind", ["plain", "packed", "sharded"])
def test_environment_tokens_are_context(steps, kind):
    """The same student tokens with the environment's tokens taken out of the context (the
    slots masked as padding) or replaced by other ids train differently: the student reads them."""
    batch, environment = _trajectories()
    loss, grad, _ = _one_step(steps, kind, batch)
    unseen = dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout, environment_mask=None))
    ids = np.array(batch.rollout.response_tokens)
    ids[environment.astype(bool)] = (ids[environment.astype(bool)] + 7) % 61
    other = dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout, response_tokens=jnp.asarray(ids)))
    for changed in (unseen, other):
        changed_loss, changed_grad, _ = _one_step(steps, kind, changed)
        assert abs(changed_loss - loss) > 1e-4 and not np.allclose(changed_grad, grad)


def test_packing_keeps_a_trajectorys_tokens_after_its_environments(steps):
    """Token-budget packing trims each micro-batch to its longest trajectory, environment
    tokens counted: the packed step is the plain one."""
    batch, _ = _trajectories()
    plain_loss, plain_grad, _ = _one_sgd_step(steps["plain"], batch)
    packed_loss, packed_grad, _ = _one_sgd_step(steps["packed"], batch)
    np.testing.assert_allclose(packed_loss, plain_loss, rtol=1e-5)
    np.testing.assert_allclose(packed_grad, plain_grad, rtol=1e-4, atol=1e-7)


def test_the_teacher_scores_a_trajectory_with_its_environment_tokens_as_context():
    """In-process (columns scored up to the longest trajectory, environment tokens counted:
    ``chunk_size`` 1 scores no column past it) and the rows a served teacher is sent."""
    from asyncopd_jax.teacher import ScoringParams, TeacherScorer
    from asyncopd_jax.teacher.client import _rows
    from asyncopd_jax.teacher.scorer import Scorers

    batch, _ = _trajectories()
    as_response = dataclasses.replace(batch.rollout, response_mask=batch.rollout.context_mask, environment_mask=None)
    scorer = TeacherScorer(tiny_decoder(1, scale=0.7), ScoringParams(topk=4, chunk_size=1))
    got = Scorers({"t": scorer}).score(batch.rollout, jax.random.key(0)).cache
    want = Scorers({"t": scorer}).score(as_response, jax.random.key(0)).cache
    student = np.asarray(batch.rollout.response_mask, bool)
    np.testing.assert_allclose(np.asarray(got.token_logp)[student], np.asarray(want.token_logp)[student], atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.topk_logp)[student], np.asarray(want.topk_logp)[student], atol=1e-6)
    sent, whole = _rows(batch.rollout), _rows(as_response)
    assert all(np.array_equal(a.response, b.response) for a, b in zip(sent, whole, strict=True))
