"""The learner's exact KL from the teacher's hidden states (``estimator.name:
forward_kl_dense`` / ``reverse_kl_dense``, ``teacher.payload: hidden``): its loss and
gradient equal the dense estimators on the two models' full logits, on one device and
row-parallel over a mesh; the teacher's head is read alone from its checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax import estimators as est
from asyncopd_jax.config import MeshConfig
from asyncopd_jax.estimator_registry import EstimatorConfig
from asyncopd_jax.learner import LearnerBatch, PolicyLoss
from asyncopd_jax.learner.step import loss_model
from asyncopd_jax.models import Decoder, read_lm_head, save_pretrained
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.pipeline.devices import stage_mesh
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from tests.teacher.test_scorer import _hidden
from tests.tiny_models import tiny_config, tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16], [17], [18, 19, 20], [21, 22], [23]]


@pytest.fixture(scope="module")
def pair():
    student, teacher = tiny_decoder(0, scale=0.7), tiny_decoder(3, scale=0.9)
    graphdef, state = nnx.split(student)
    params = SamplingParams(temperature=0.8, max_new_tokens=7, chunk_steps=7, stop_token_ids=(38,))
    batch = Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(2))
    return student, teacher, batch


def _loss_and_grad(student, teacher, batch, name, mesh=None):
    scoring = ScoringParams(temperature=1.3, payload="hidden", chunk_size=4)
    cache = TeacherScorer(teacher, scoring).score(batch)
    # what the padding holds must not matter (a server's answer may hold NaN there)
    cache = dataclasses.replace(cache, hidden=jnp.where(batch.response_mask[..., None], cache.hidden, jnp.nan))
    loss = PolicyLoss(
        EstimatorConfig(name),
        temperature=0.8,
        chunk_size=5,
        teacher_head=teacher.lm_head_weight(),
        teacher_temperature=1.3,
    )
    graphdef, params = nnx.split(student)
    mini = LearnerBatch(batch, cache)
    denominator = jnp.sum(batch.response_mask).astype(jnp.float32)

    def objective(p):
        return loss(loss_model(graphdef, p, None), mini, denominator)[0]

    with mesh_context(mesh):
        return jax.jit(jax.value_and_grad(objective))(params)


def _oracle(student, teacher, batch, name):
    """The dense estimator on the full logits of both models, token mean."""
    dense = {"forward_kl_dense": est.forward_kl_dense, "reverse_kl_dense": est.reverse_kl_dense}[name]
    teacher_logits = _hidden(teacher, batch) @ teacher.lm_head_weight() / 1.3
    graphdef, params = nnx.split(student)

    def objective(p):
        model = nnx.merge(graphdef, p)
        per_token = dense(
            _hidden(model, batch) @ model.lm_head_weight() / 0.8, teacher_logits, mask=batch.response_mask
        )
        return est.token_mean(per_token, batch.response_mask)

    return jax.value_and_grad(objective)(params)


@pytest.mark.parametrize("name", ["forward_kl_dense", "reverse_kl_dense"])
def test_the_loss_and_gradient_equal_the_dense_estimator_on_full_logits(pair, name):
    student, teacher, batch = pair
    (loss, grads), (want, want_grads) = (
        _loss_and_grad(student, teacher, batch, name),
        _oracle(student, teacher, batch, name),
    )
    assert float(loss) > 0.05  # the two models differ
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for got, expected in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_row_parallel_on_a_mesh_gives_the_same_loss_and_gradient(pair):
    student, teacher, batch = pair
    mesh = stage_mesh(jax.devices()[:4], MeshConfig(data=2, fsdp=2))
    loss, grads = _loss_and_grad(student, teacher, batch, "forward_kl_dense")
    split_loss, split_grads = _loss_and_grad(student, teacher, batch, "forward_kl_dense", mesh)
    np.testing.assert_allclose(split_loss, loss, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(split_grads), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_the_teachers_head_is_read_alone_from_its_checkpoint(tmp_path, tied):
    model = Decoder(tiny_config(tied=tied), rngs=nnx.Rngs(4))
    save_pretrained(model, tmp_path)
    head = read_lm_head(tmp_path)
    np.testing.assert_array_equal(head, np.asarray(model.lm_head_weight()))
    np.testing.assert_array_equal(read_lm_head(tmp_path, vocab_limit=40), np.asarray(model.lm_head_weight())[:, :40])
