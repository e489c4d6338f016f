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
from asyncopd_jax.estimator_registry import EstimatorConfig, RegularisersConfig
from asyncopd_jax.learner import LearnerBatch, PolicyLoss
from asyncopd_jax.learner.step import loss_model
from asyncopd_jax.models import Decoder, read_lm_head, save_pretrained
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.pipeline.devices import stage_mesh
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.teacher import Scorers, ScoringParams, TeacherScorer
from asyncopd_jax.teacher.routing import TeacherRoute
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


#: Qwen3's vocabulary (151,936 ids): many vocabulary blocks of the learner's pass, the last
#: one partial (151,936 = 18 × 8,192 + 4,480).
QWEN3_VOCAB = 151_936


def _peaked(model: Decoder, seed: int) -> Decoder:
    """``model`` with an N(0, 0.5²) embedding (its tied head): a fan-in scaled one over
    151,936 rows gives near-uniform logits, and no KL to measure."""
    embedding = model.embed_tokens.embedding
    embedding[...] = 0.5 * jax.random.normal(jax.random.key(seed), embedding[...].shape)
    return model


@pytest.fixture(scope="module")
def qwen3_vocab_pair():
    """A student and a teacher with Qwen3's vocabulary (at the tiny widths: short length)."""
    student = _peaked(tiny_decoder(0, scale=0.7, vocab=QWEN3_VOCAB), 10)
    teacher = _peaked(tiny_decoder(3, scale=0.9, vocab=QWEN3_VOCAB), 11)
    graphdef, state = nnx.split(student)
    params = SamplingParams(temperature=0.8, max_new_tokens=5, chunk_steps=5, stop_token_ids=(38,))
    batch = Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(2))
    return student, teacher, batch


def _loss_and_grad(student, teacher, batch, name, mesh=None, entropy_coef=0.0):
    scoring = ScoringParams(temperature=1.3, payload="hidden", chunk_size=4)
    cache = TeacherScorer(teacher, scoring).score(batch)
    # what the padding holds must not matter (a server's answer may hold NaN there)
    cache = dataclasses.replace(cache, hidden=jnp.where(batch.response_mask[..., None], cache.hidden, jnp.nan))
    loss = PolicyLoss(
        EstimatorConfig(name, regularisers=RegularisersConfig(entropy_coef=entropy_coef)),
        temperature=0.8,
        chunk_size=5,
        teacher_heads=(teacher.lm_head_weight(),),
        teacher_temperatures=(1.3,),
    )
    graphdef, params = nnx.split(student)
    mini = LearnerBatch(batch, cache)
    denominator = jnp.sum(batch.response_mask).astype(jnp.float32)

    def objective(p):
        return loss(loss_model(graphdef, p, None), mini, denominator)[0]

    with mesh_context(mesh):
        return jax.jit(jax.value_and_grad(objective))(params)


def _oracle(student, teacher, batch, name, entropy_coef=0.0):
    """The dense estimator on the full logits of both models (minus ``entropy_coef`` times
    the student's entropy), token mean."""
    dense = {"forward_kl_dense": est.forward_kl_dense, "reverse_kl_dense": est.reverse_kl_dense}[name]
    teacher_logits = _hidden(teacher, batch) @ teacher.lm_head_weight() / 1.3
    graphdef, params = nnx.split(student)

    def objective(p):
        model = nnx.merge(graphdef, p)
        logits = _hidden(model, batch) @ model.lm_head_weight() / 0.8
        per_token = dense(logits, teacher_logits, mask=batch.response_mask)
        logp = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return est.token_mean(per_token - entropy_coef * entropy, batch.response_mask)

    return jax.value_and_grad(objective)(params)


# the Qwen3 vocabulary's ~30 s of CPU go to CI's second step (-m extended)
@pytest.mark.parametrize("models", ["pair", pytest.param("qwen3_vocab_pair", marks=pytest.mark.extended)])
@pytest.mark.parametrize("name", ["forward_kl_dense", "reverse_kl_dense"])
def test_the_loss_and_gradient_equal_the_dense_estimator_on_full_logits(request, models, name):
    student, teacher, batch = request.getfixturevalue(models)
    (loss, grads), (want, want_grads) = (
        _loss_and_grad(student, teacher, batch, name),
        _oracle(student, teacher, batch, name),
    )
    assert float(loss) > 0.05  # the two models differ
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for got, expected in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["forward_kl_dense", "reverse_kl_dense"])
def test_the_entropy_bonus_adds_to_the_exact_kl(pair, name):
    """``estimator.regularisers`` compose with the dense estimators: −c · H(π_θ) a token."""
    student, teacher, batch = pair
    (loss, grads), (want, want_grads) = (
        _loss_and_grad(student, teacher, batch, name, entropy_coef=0.3),
        _oracle(student, teacher, batch, name, entropy_coef=0.3),
    )
    plain, _ = _oracle(student, teacher, batch, name)
    assert abs(float(want) - float(plain)) > 0.1  # the bonus shows
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


def test_two_teachers_of_different_widths_each_teach_their_own_rows(pair):
    """Rows routed to two teachers (hidden sizes 32 and 48, temperatures 1.3 and 0.9): the
    cache holds both widths padded to 48 and each row's teacher; the loss and gradient are
    the dense estimator against each row's own teacher."""
    student, teacher_a, batch = pair
    teacher_b = Decoder(dataclasses.replace(tiny_config(), hidden_size=48, intermediate_size=96), rngs=nnx.Rngs(7))
    route = TeacherRoute(teacher=np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32))
    scorers = Scorers(
        {
            "a": TeacherScorer(teacher_a, ScoringParams(temperature=1.3, payload="hidden", hidden_width=48)),
            "b": TeacherScorer(teacher_b, ScoringParams(temperature=0.9, payload="hidden", hidden_width=48)),
        }
    )
    cache = scorers.score(batch, jax.random.key(0), route).cache
    assert cache.hidden.shape[-1] == 48 and not np.asarray(cache.hidden)[route.teacher == 0][..., 32:].any()
    np.testing.assert_array_equal(np.asarray(cache.teacher_index)[:, 0], route.teacher)
    head_a = jnp.pad(teacher_a.lm_head_weight(), ((0, 16), (0, 0)))  # zero rows up to the cache's width
    loss = PolicyLoss(
        EstimatorConfig("reverse_kl_dense"),
        temperature=0.8,
        chunk_size=5,
        teacher_heads=(head_a, teacher_b.lm_head_weight()),
        teacher_temperatures=(1.3, 0.9),
    )
    graphdef, params = nnx.split(student)
    mini, total = LearnerBatch(batch, cache), jnp.sum(batch.response_mask).astype(jnp.float32)
    got, got_grads = jax.value_and_grad(lambda p: loss(loss_model(graphdef, p, None), mini, total)[0])(params)

    rows_b = jnp.asarray(route.teacher == 1)[:, None, None]
    teacher_logits = jnp.where(
        rows_b,
        _hidden(teacher_b, batch) @ teacher_b.lm_head_weight() / 0.9,
        _hidden(teacher_a, batch) @ teacher_a.lm_head_weight() / 1.3,
    )

    def oracle(p):
        model = nnx.merge(graphdef, p)
        z = _hidden(model, batch) @ model.lm_head_weight() / 0.8
        return est.token_mean(est.reverse_kl_dense(z, teacher_logits, mask=batch.response_mask), batch.response_mask)

    want, want_grads = jax.value_and_grad(oracle)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)
