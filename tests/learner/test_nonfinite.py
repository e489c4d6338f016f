"""Faults in the learner: NaN / inf rows are dropped exactly; a non-finite step is not applied.

The oracle of row dropping is the batch with those rows deleted (NumPy): a train step on
the poisoned ``[B, T]`` batch must give the loss and the gradient of a train step on the
clean ``[B − d, T]`` batch without them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import StudentLogProbs
from asyncopd_jax.estimator_eval import evaluate_estimator, student_logprobs
from asyncopd_jax.estimator_registry import EstimatorConfig, ForwardMCConfig, RegularisersConfig
from asyncopd_jax.estimators import gather_logprobs_from_hidden, normalized_token_sum
from asyncopd_jax.learner import (
    LearnerBatch,
    PolicyLoss,
    create_train_state,
    drop_nonfinite_rows,
    make_packed_train_step,
    make_train_step,
    nonfinite_rows,
)
from asyncopd_jax.learner.faults import CACHE_FIELDS, ROLLOUT_FIELDS
from tests.learner.batches import make_learner_batch
from tests.tiny_models import tiny_decoder

BAD_ROWS = (1, 5)  # NaN in row 1, −inf in row 5

# A field of the batch, and an estimator whose loss reads it (so the fault is real).
FIELD_ESTIMATOR = {
    "behavior_logp": "ppo_clip",
    "candidate_behavior_logp": "reverse_kl_mc",
    "advantages": "ppo_clip",  # reward-driven RL: the stabilisers weigh the reward advantage
    "reference_logp": "ppo_clip",  # with a KL-to-reference term (FIELD_OPTIONS)
    "token_logp": "reverse_kl_pg",
    "candidate_logp": "reverse_kl_mc",
    "student_topk_logp": "reverse_kl_topk",
    "topk_logp": "forward_kl_topk",
    "sample_logp": "forward_kl_mc",
}
# forward_kl_mc's plain form has no gradient through log q: the k3 form has, so that a NaN
# left in a dropped row would leak (0 · NaN) into the gradient.
FIELD_OPTIONS = {
    "sample_logp": dict(forward_mc=ForwardMCConfig(control_variate=True)),
    "reference_logp": dict(regularisers=RegularisersConfig(reference_kl_coef=0.5)),
}


@pytest.fixture(scope="module")
def clean() -> LearnerBatch:
    """8 rows of uneven lengths (so some rows have padding), with RL advantages, reference
    log-probs ``[B, T]`` and teacher hidden states ``[B, T, H]`` attached so that every
    checked field is present."""
    batch = make_learner_batch()
    rng = np.random.default_rng(0)
    advantages = jnp.asarray(rng.normal(size=batch.rollout.response_tokens.shape), jnp.float32)
    reference = jnp.asarray(batch.rollout.behavior_logp + rng.normal(scale=0.3, size=advantages.shape), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(*advantages.shape, 2)), jnp.float32)
    return dataclasses.replace(
        batch,
        rollout=dataclasses.replace(batch.rollout, advantages=advantages, reference_logp=reference),
        cache=dataclasses.replace(batch.cache, hidden=hidden),
    )


@pytest.fixture(scope="module")
def student(clean) -> StudentLogProbs:
    """A student's log-probs on every id set of ``clean`` (token ``[B, T]``; candidates,
    student top-K, teacher top-K, teacher samples ``[B, T, K]``), from a tiny decoder."""
    model = tiny_decoder(2, scale=0.7)
    hidden, head = response_hidden(model, clean.rollout), model.lm_head_weight()
    r, c = clean.rollout, clean.cache
    ids = {
        "token": r.response_tokens,
        "candidates": r.candidate_ids,
        "student_topk": r.student_topk_ids,
        "teacher_topk": c.topk_ids,
        "teacher_samples": c.sample_ids,
    }
    return student_logprobs(ids, lambda i: gather_logprobs_from_hidden(hidden, head, i))


def _owner(field: str) -> str:
    return "rollout" if field in ROLLOUT_FIELDS else "cache"


def _set(batch: LearnerBatch, field: str, row: int, t: int, value: float) -> LearnerBatch:
    """``batch`` with ``field[row, t]`` (``[B, T]``) or ``field[row, t, 0]`` (``[B, T, K]``) = value."""
    owner = getattr(batch, _owner(field))
    array = np.array(getattr(owner, field))
    array[(row, t) + (0,) * (array.ndim - 2)] = value
    return dataclasses.replace(batch, **{_owner(field): dataclasses.replace(owner, **{field: jnp.asarray(array)})})


def _poison(batch: LearnerBatch, field: str) -> LearnerBatch:
    """NaN / −inf on the last real token of the rows in BAD_ROWS (the EOS is trained too),
    and +inf on a padding slot of another row, which must neither count nor leak."""
    mask = np.asarray(batch.rollout.response_mask)
    lengths = mask.sum(1)
    for row, value in zip(BAD_ROWS, (np.nan, -np.inf)):
        batch = _set(batch, field, row, int(lengths[row]) - 1, value)
    padded = next(r for r in range(len(lengths)) if r not in BAD_ROWS and lengths[r] < mask.shape[1])
    return _set(batch, field, padded, mask.shape[1] - 1, np.inf)


def _without_rows(batch: LearnerBatch, rows) -> LearnerBatch:
    """The NumPy oracle: every ``[B, ...]`` leaf with ``rows`` deleted."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(np.delete(np.asarray(x), rows, axis=0)), batch)


def test_the_row_mask_matches_numpy_and_ignores_padding_and_unread_fields(clean):
    """Random NaN / ±inf anywhere in every checked field: a row is flagged iff one lands on
    one of its real tokens. ``student_topk_behavior_logp`` = −inf (legitimate under top-k /
    top-p sampling) flags nothing."""
    rng = np.random.default_rng(1)
    mask = np.asarray(clean.rollout.response_mask)  # [B, T]
    batch, want = clean, np.zeros(mask.shape[0], bool)
    for field in ROLLOUT_FIELDS + CACHE_FIELDS:
        owner = getattr(batch, _owner(field))
        array = np.array(getattr(owner, field))  # [B, T] or [B, T, K]
        hit = rng.random(array.shape) < 0.005  # rare enough that some rows are spared
        array[hit] = rng.choice([np.nan, np.inf, -np.inf], size=int(hit.sum()))
        per_token = hit if hit.ndim == 2 else hit.any(-1)
        want |= (per_token & mask).any(1)
        batch = dataclasses.replace(batch, **{_owner(field): dataclasses.replace(owner, **{field: jnp.asarray(array)})})
    topk_mu = np.full(np.shape(clean.rollout.student_topk_behavior_logp), -np.inf, np.float32)
    batch = dataclasses.replace(
        batch, rollout=dataclasses.replace(batch.rollout, student_topk_behavior_logp=jnp.asarray(topk_mu))
    )
    assert 0 < want.sum() < len(want)  # the draw hit some rows and spared some
    np.testing.assert_array_equal(np.asarray(nonfinite_rows(batch)), want)

    cleaned, dropped = jax.jit(drop_nonfinite_rows)(batch)
    np.testing.assert_array_equal(np.asarray(dropped), want)
    np.testing.assert_array_equal(np.asarray(cleaned.rollout.response_mask), mask & ~want[:, None])
    for field in ROLLOUT_FIELDS + CACHE_FIELDS:  # finite values kept; no NaN left to leak through 0 · NaN
        raw = np.asarray(getattr(getattr(batch, _owner(field)), field))
        np.testing.assert_array_equal(
            np.asarray(getattr(getattr(cleaned, _owner(field)), field)),
            np.where(np.isfinite(raw), raw, 0),
            err_msg=field,
        )
    np.testing.assert_array_equal(np.asarray(cleaned.rollout.student_topk_behavior_logp), topk_mu)  # not read: as is


def _estimator_loss(config: EstimatorConfig, batch: LearnerBatch, student: StudentLogProbs):
    """Token-mean loss of the estimator and its gradient w.r.t. the student's
    log-probs (each ``[B, T]`` / ``[B, T, K]``), the learner's loss without the model."""

    def loss(s: StudentLogProbs):
        values, _ = evaluate_estimator(config, batch.rollout, batch.cache, s)
        mask = batch.rollout.response_mask
        return normalized_token_sum(values, mask, jnp.sum(mask))

    return jax.value_and_grad(loss)(student)


@pytest.mark.parametrize("field", list(FIELD_ESTIMATOR))
def test_dropping_nonfinite_rows_equals_deleting_them(clean, student, field):
    """A NaN / −inf in ``field`` on two rows (and a +inf on a padding slot of a third):
    after :func:`drop_nonfinite_rows`, the estimator's token-mean loss and its gradient on
    the kept rows equal those of the clean batch with the two rows deleted (NumPy), and
    the dropped rows get exactly zero gradient (no NaN leaks through ``0 · NaN``)."""
    config = EstimatorConfig(FIELD_ESTIMATOR[field], **FIELD_OPTIONS.get(field, {}))
    poisoned = _poison(clean, field)
    value, grads = _estimator_loss(config, poisoned, student)
    # the fault is real: without dropping, this estimator's loss or gradient is not finite
    assert not (np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads)))

    kept_batch, dropped = drop_nonfinite_rows(poisoned)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(dropped)), BAD_ROWS)
    got_value, got_grads = _estimator_loss(config, kept_batch, student)
    want_value, want_grads = _estimator_loss(
        config, _without_rows(clean, list(BAD_ROWS)), _without_rows(student, list(BAD_ROWS))
    )
    np.testing.assert_allclose(got_value, want_value, rtol=1e-6, atol=1e-7)
    kept = np.setdiff1d(np.arange(len(dropped)), BAD_ROWS)
    for got, want in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        got = np.asarray(got)
        np.testing.assert_allclose(got[kept], want, rtol=1e-5, atol=1e-8)
        np.testing.assert_array_equal(got[list(BAD_ROWS)], 0.0)


@pytest.fixture(scope="module")
def sgd_steps():
    """A plain and a packed jitted SGD step (lr 1: the parameter change is minus the
    gradient) on ``forward_kl_topk``, built once so that their compilations are shared."""
    graphdef, _ = nnx.split(tiny_decoder(0, scale=0.7))
    loss = PolicyLoss(EstimatorConfig("forward_kl_topk"))
    return {
        "plain": make_train_step(graphdef, optax.sgd(1.0), loss, micro_batches=2),
        "packed": make_packed_train_step(graphdef, optax.sgd(1.0), loss, token_budget=64),
    }


def _one_sgd_step(step, batch: LearnerBatch):
    """(loss, gradient as one flat vector, metrics) of one step from the same start."""
    _, state = create_train_state(tiny_decoder(0, scale=0.7), optax.sgd(1.0))
    before = jax.device_get(state.params)
    after, metrics = step(state, batch)
    grad = np.concatenate(
        [
            np.ravel(a - b)
            for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(jax.device_get(after.params)))
        ]
    )
    return float(metrics["loss"]), grad, jax.device_get(metrics)


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_the_train_step_drops_nonfinite_rows(clean, sgd_steps, kind):
    """The train step itself (2 micro-batches, or token-budget packing) on a batch with
    NaN / −inf teacher top-K log-probs in two rows: the loss and the parameter gradient of
    the clean batch with those rows' tokens masked out (same shapes: one compilation;
    masked out = deleted is the test above), ``nonfinite_rows`` = 2, ``tokens`` = the
    tokens kept. A token count or a micro-batch weight taken before the drop would differ."""
    mask = np.array(clean.rollout.response_mask)
    mask[list(BAD_ROWS)] = False
    oracle_batch = dataclasses.replace(
        clean, rollout=dataclasses.replace(clean.rollout, response_mask=jnp.asarray(mask))
    )
    got_loss, got_grad, metrics = _one_sgd_step(sgd_steps[kind], _poison(clean, "topk_logp"))
    want_loss, want_grad, oracle = _one_sgd_step(sgd_steps[kind], oracle_batch)
    assert int(metrics["nonfinite_rows"]) == len(BAD_ROWS) and int(oracle["nonfinite_rows"]) == 0
    assert float(metrics["tokens"]) == float(oracle["tokens"]) == mask.sum()  # the mean is over the tokens kept
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-8)


def test_a_nonfinite_step_leaves_the_state_unchanged(clean):
    """A NaN loss (a NaN weight) and an infinite update (learning rate = inf from the
    second step on, loss and gradient finite): parameters, optimizer state and step count
    come back as they went in; the metrics say which of loss / grad_norm / update_norm is
    not finite. A good step from the same start is applied."""
    # the learning-rate multiplier is inf once the schedule's count reaches 1: one
    # compilation serves the good step (count 0) and the infinite one (count set to 1)
    optimizer = optax.chain(optax.adam(1e-2), optax.scale_by_schedule(lambda n: jnp.where(n >= 1, jnp.inf, 1.0)))
    graphdef, start = create_train_state(tiny_decoder(0, scale=0.7), optimizer)
    step = make_train_step(graphdef, optimizer, PolicyLoss(EstimatorConfig("forward_kl_topk")))

    def copy_of(state):  # the step donates its input
        return jax.tree_util.tree_map(jnp.array, state)

    leaves, treedef = jax.tree_util.tree_flatten(start.params)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    nan_weight = dataclasses.replace(copy_of(start), params=jax.tree_util.tree_unflatten(treedef, leaves))
    adam, schedule = copy_of(start.opt_state)
    inf_lr = dataclasses.replace(
        copy_of(start), opt_state=(adam, schedule._replace(count=jnp.ones_like(schedule.count)))
    )

    for state, broken in ((nan_weight, "loss"), (inf_lr, "update_norm")):
        before = jax.device_get(state)
        after, metrics = step(state, clean)
        metrics, after = jax.device_get((metrics, after))
        assert not np.isfinite(metrics[broken]), (broken, metrics)
        if broken == "update_norm":  # the fault shows only in the update
            assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
        assert int(after.step) == 0
        for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before)):
            np.testing.assert_array_equal(a, b)  # NaN == NaN here: the injected weight stays as it was
    after, metrics = step(start, clean)
    assert int(after.step) == 1 and np.isfinite(float(metrics["update_norm"]))


def test_a_batch_with_every_row_dropped_does_not_move_the_weights(clean):
    """After one good Adam step the first moment is non-zero, so a zero gradient would
    still move the weights. A batch whose every row is non-finite has no token to learn
    from: parameters and moments stay, the step counts (the run goes on), ``update_norm``
    is 0 and ``nonfinite_rows`` is the batch size."""
    optimizer = optax.adam(1e-2)
    graphdef, state = create_train_state(tiny_decoder(0, scale=0.7), optimizer)
    step = make_train_step(graphdef, optimizer, PolicyLoss(EstimatorConfig("forward_kl_topk")))
    state, _ = step(state, clean)  # momentum now non-zero
    topk = np.array(clean.cache.topk_logp)
    topk[:, 0, 0] = np.nan  # every row's first token is a real one
    poisoned = dataclasses.replace(clean, cache=dataclasses.replace(clean.cache, topk_logp=jnp.asarray(topk)))
    before = jax.device_get(state)
    after, metrics = jax.device_get(step(state, poisoned))
    assert int(metrics["nonfinite_rows"]) == topk.shape[0] and float(metrics["tokens"]) == 0
    assert float(metrics["update_norm"]) == 0 and np.isfinite(float(metrics["loss"]))
    assert int(after.step) == int(before.step) + 1
    for a, b in zip(
        jax.tree_util.tree_leaves((after.params, after.opt_state)),
        jax.tree_util.tree_leaves((before.params, before.opt_state)),
    ):
        np.testing.assert_array_equal(a, b)


def test_a_span_cache_keeps_its_unmapped_minus_inf(clean):
    """A teacher of another tokenizer: −inf in the mapped top-K is an id no student token
    spells, a value; the row is kept and the −inf too. NaN there is still a fault."""
    spans = dataclasses.replace(clean, cache=dataclasses.replace(clean.cache, span_end=clean.rollout.response_mask))
    lengths = np.asarray(clean.rollout.response_mask).sum(1)
    unmapped = _set(spans, "topk_logp", 2, int(lengths[2]) - 1, -np.inf)
    cleaned, dropped = drop_nonfinite_rows(unmapped)
    assert not np.asarray(dropped).any()
    assert np.isneginf(np.asarray(cleaned.cache.topk_logp)[2, lengths[2] - 1, 0])
    _, dropped = drop_nonfinite_rows(_set(spans, "topk_logp", 2, int(lengths[2]) - 1, np.nan))
    np.testing.assert_array_equal(np.flatnonzero(dropped), [2])
    _, dropped = drop_nonfinite_rows(
        dataclasses.replace(unmapped, cache=dataclasses.replace(unmapped.cache, span_end=None))
    )
    np.testing.assert_array_equal(np.flatnonzero(dropped), [2])  # per token, −inf is a fault
