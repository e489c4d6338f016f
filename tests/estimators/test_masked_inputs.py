"""Padded positions reach neither the loss nor the gradients (issue 36).

A train step (``jax.jit`` + ``jax.grad``) whose log-prob inputs hold NaN at the padded
positions (``mask == 0``) must give the loss and the gradients of the same step on clean
inputs: for every estimator of the registry, called standalone (the pure function with the
mask that the reduction gets) and through :func:`evaluate_estimator`, and for the public
losses that are not in the registry. Without the "double where" the loss was right (the
reduction drops masked values) but every gradient was NaN: ``0 · ∂f(NaN) = NaN`` in the
estimator's backward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asyncopd_jax.estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.estimator_eval import evaluate_estimator, required_ids, student_logprobs
from asyncopd_jax.estimator_registry import ESTIMATORS, EstimatorConfig, RegularisersConfig
from tests.estimators.oracle import log_softmax

B, T, V, H, K, N = 4, 5, 11, 3, 4, 3
LENGTHS = np.array([5, 3, 1, 0])  # ragged rows, one of them empty
MASK = np.arange(T)[None, :] < LENGTHS[:, None]  # [B, T]
PAD = ~MASK

# The log-prob inputs besides the student's (their names in the data below).
LOGPROB_FIELDS = (
    "behavior_logp",
    "proximal_logp",
    "reference_logp",
    "token_logp",
    "candidate_behavior_logp",
    "candidate_logp",
    "student_topk_behavior_logp",
    "student_topk_logp",
    "topk_logp",
    "sample_logp",
    "teacher_logits",
)
ID_FIELDS = ("tokens", "candidate_ids", "student_topk_ids", "topk_ids", "sample_ids")


def _data(poisoned: bool, pad_id: int = 0) -> dict[str, np.ndarray]:
    """One batch; ``poisoned``: NaN at the padded positions of every log-prob input (the
    student's too: ``student_nan`` is added to its log-probs) and ``pad_id`` as the ids
    there (0, as this project's samplers pad, or out of range)."""
    rng = np.random.default_rng(0)
    teacher_logits = rng.normal(scale=2.0, size=(B, T, V))
    behavior_logits = rng.normal(scale=2.0, size=(B, T, V))
    proximal_logits = behavior_logits + rng.normal(scale=0.3, size=(B, T, V))
    reference_logits = rng.normal(scale=2.0, size=(B, T, V))
    lq, lmu, lprox, lref = (
        log_softmax(x) for x in (teacher_logits, behavior_logits, proximal_logits, reference_logits)
    )
    ids = {
        "tokens": rng.integers(0, V, size=(B, T)),
        "candidate_ids": rng.integers(0, V, size=(B, T, N)),
        "student_topk_ids": np.argsort(-behavior_logits, axis=-1)[..., :K],
        "topk_ids": np.argsort(-teacher_logits, axis=-1)[..., :K],
        "sample_ids": rng.integers(0, V, size=(B, T, N)),
    }

    def take(logp, name):
        picked = ids[name][..., None] if ids[name].ndim == 2 else ids[name]
        out = np.take_along_axis(logp, picked, axis=-1)
        return out[..., 0] if ids[name].ndim == 2 else out

    data = {
        "teacher_logits": teacher_logits,
        "behavior_logp": take(lmu, "tokens"),
        "proximal_logp": take(lprox, "tokens"),
        "reference_logp": take(lref, "tokens"),
        "token_logp": take(lq, "tokens"),
        "candidate_behavior_logp": take(lmu, "candidate_ids"),
        "candidate_logp": take(lq, "candidate_ids"),
        "student_topk_behavior_logp": take(lmu, "student_topk_ids"),
        "student_topk_logp": take(lq, "student_topk_ids"),
        "topk_logp": take(lq, "topk_ids"),
        "sample_logp": take(lq, "sample_ids"),
        "student_nan": np.zeros((B, T)),
    }
    data = {k: v.astype(np.float32) for k, v in data.items()}
    if poisoned:
        for name in (*LOGPROB_FIELDS, "student_nan"):
            pad = PAD.reshape(PAD.shape + (1,) * (data[name].ndim - 2))
            data[name] = np.where(pad, np.float32(np.nan), data[name])
        for name in ID_FIELDS:
            pad = PAD.reshape(PAD.shape + (1,) * (ids[name].ndim - 2))
            ids[name] = np.where(pad, pad_id, ids[name])
    return {**data, **{k: v.astype(np.int32) for k, v in ids.items()}}


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    return {
        "features": jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32),  # not trained, a fixed input
        "w": jnp.asarray(rng.normal(size=(H, V)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(V,)), jnp.float32),
    }


def _logits(params) -> jax.Array:
    features = jax.lax.stop_gradient(params["features"])
    return jnp.einsum("bth,hv->btv", features, params["w"]) + params["b"]


def _student_gather(params, d) -> Callable[[jax.Array], jax.Array]:
    """``[B, T, n]`` ids → the student's log-probs on them, NaN at the padded positions of
    the poisoned batch (its ids are out of range there, and ``student_nan`` is added)."""
    logits = _logits(params)
    return lambda ids: est.gather_logprobs(logits, ids) + d["student_nan"][..., None]


def _student(params, d) -> dict[str, jax.Array]:
    gather = _student_gather(params, d)
    out = {
        "candidates": gather(d["candidate_ids"]),
        "student_topk": gather(d["student_topk_ids"]),
        "teacher_topk": gather(d["topk_ids"]),
        "teacher_samples": gather(d["sample_ids"]),
        "token": gather(d["tokens"][..., None])[..., 0],
    }
    return out


# name → (student log-probs, data, stale reward advantage, mask) → per-token values [B, T],
# each the standalone call of the pure function the registry's adapter makes.
Standalone = Callable[[dict, dict, jax.Array, np.ndarray], jax.Array]


def _candidates(s, d):
    return s["candidates"], d["candidate_behavior_logp"], d["candidate_logp"]


def _emitted(s, d):
    return s["token"][..., None], d["behavior_logp"][..., None], d["token_logp"][..., None]


REGISTRY_STANDALONE: dict[str, Standalone] = {
    # the registry's dense estimators read the KL the learner computes from hidden states
    # (dense_kls_from_hidden, tested against these in tests/estimators/test_dense_from_hidden.py)
    "forward_kl_dense": lambda s, d, a, m: est.forward_kl_dense(s["logits"], d["teacher_logits"], mask=m),
    "reverse_kl_dense": lambda s, d, a, m: est.reverse_kl_dense(s["logits"], d["teacher_logits"], mask=m),
    "forward_kl_topk": lambda s, d, a, m: est.forward_kl_topk(s["teacher_topk"], d["topk_logp"], mask=m),
    "forward_kl_topk_renormalized": lambda s, d, a, m: est.forward_kl_topk_renormalized(
        s["teacher_topk"], d["topk_logp"], mask=m
    ),
    "forward_kl_mc": lambda s, d, a, m: est.forward_kl_mc(s["teacher_samples"], d["sample_logp"], mask=m),
    "reverse_kl_topk": lambda s, d, a, m: est.reverse_kl_topk(s["student_topk"], d["student_topk_logp"], mask=m),
    "reverse_kl_mc": lambda s, d, a, m: est.reverse_kl_mc(*_candidates(s, d), mask=m),
    "reverse_kl_mc_loo": lambda s, d, a, m: est.reverse_kl_mc_loo(*_candidates(s, d), mask=m),
    "reverse_kl_hybrid": lambda s, d, a, m: est.reverse_kl_hybrid(
        s["student_topk"],
        d["student_topk_logp"],
        d["student_topk_ids"],
        *_candidates(s, d),
        d["candidate_ids"],
        mask=m,
    ),
    "reverse_kl_mc_stale": lambda s, d, a, m: est.reverse_kl_mc(*_candidates(s, d), recompute=False, mask=m),
    "reverse_kl_pg": lambda s, d, a, m: est.reverse_kl_mc(*_emitted(s, d), mask=m),
    "reverse_kl_pg_stale": lambda s, d, a, m: est.reverse_kl_mc(*_emitted(s, d), recompute=False, mask=m),
    "ppo_clip": lambda s, d, a, m: est.ppo_clip_loss(s["token"], d["behavior_logp"], a, mask=m),
    "decoupled_ppo": lambda s, d, a, m: est.decoupled_ppo_loss(
        s["token"], d["proximal_logp"], d["behavior_logp"], a, mask=m
    ),
    "gspo": lambda s, d, a, m: est.gspo_loss(s["token"], d["behavior_logp"], a, m, clip_eps=0.2),
    "gspo_token": lambda s, d, a, m: est.gspo_loss(s["token"], d["behavior_logp"], a, m, clip_eps=0.2, level="token"),
    "truncated_is": lambda s, d, a, m: est.truncated_is_loss(s["token"], d["behavior_logp"], a, mask=m),
    "m2po": lambda s, d, a, m: est.m2po_loss(s["token"], d["behavior_logp"], a, m, second_moment_budget=0.5),
    "second_moment_clip": lambda s, d, a, m: est.second_moment_clip_loss(s["token"], d["behavior_logp"], a, m),
}

# Public losses and variants the registry does not name (or names with other settings).
OTHER_STANDALONE: dict[str, Standalone] = {
    "forward_kl_topk_no_tail": lambda s, d, a, m: est.forward_kl_topk(
        s["teacher_topk"], d["topk_logp"], tail=False, mask=m
    ),
    "reverse_kl_topk_no_tail": lambda s, d, a, m: est.reverse_kl_topk(
        s["student_topk"], d["student_topk_logp"], tail=False, mask=m
    ),
    # the k3 form differentiates through log q: a NaN teacher leaked into its gradient
    "forward_kl_mc_control_variate": lambda s, d, a, m: est.forward_kl_mc(
        s["teacher_samples"], d["sample_logp"], control_variate=True, mask=m
    ),
    "reverse_kl_mc_clipped": lambda s, d, a, m: est.reverse_kl_mc(*_candidates(s, d), clip_eps=0.2, mask=m),
    "reverse_kl_mc_no_is": lambda s, d, a, m: est.reverse_kl_mc(*_candidates(s, d), importance_sampling=False, mask=m),
    "ppo_clip_dual_clip": lambda s, d, a, m: est.ppo_clip_loss(
        s["token"], d["behavior_logp"], a, dual_clip=3.0, mask=m
    ),
    # [B, T, N] candidates with the [B, T] mask, broadcast over N
    "ppo_clip_on_candidates": lambda s, d, a, m: jnp.mean(
        est.ppo_clip_loss(
            s["candidates"],
            d["candidate_behavior_logp"],
            jax.lax.stop_gradient(d["candidate_logp"] - s["candidates"]),
            mask=m,
        ),
        axis=-1,
    ),
    "decoupled_ppo_truncate": lambda s, d, a, m: est.decoupled_ppo_loss(
        s["token"], d["proximal_logp"], d["behavior_logp"], a, behavior_weight_mode="truncate", mask=m
    ),
    "reference_kl_k1": lambda s, d, a, m: est.reference_kl(s["token"], d["reference_logp"], "k1", mask=m),
    "reference_kl_k2": lambda s, d, a, m: est.reference_kl(s["token"], d["reference_logp"], "k2", mask=m),
    "reference_kl_k3": lambda s, d, a, m: est.reference_kl(s["token"], d["reference_logp"], "k3", mask=m),
}


def test_every_registry_estimator_has_a_standalone_case():
    assert set(REGISTRY_STANDALONE) == set(ESTIMATORS)


def _standalone_step(fn: Standalone, mask):
    """A user's jitted train step: the loss of one estimator, masked in both places."""

    def loss(params, d):
        s = _student(params, d)
        s["logits"] = _logits(params) + d["student_nan"][..., None]
        advantage = jax.lax.stop_gradient(d["token_logp"] - d["behavior_logp"])  # the stale reward
        return est.aggregate(fn(s, d, advantage, mask), mask, "seq-mean-token-mean")

    return jax.jit(jax.value_and_grad(loss))


def _assert_same(poisoned, clean):
    for got, want in zip(jax.tree_util.tree_leaves(poisoned), jax.tree_util.tree_leaves(clean)):
        assert np.all(np.isfinite(got)), "NaN or inf leaked from a padded position"
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted({**REGISTRY_STANDALONE, **OTHER_STANDALONE}))
def test_nan_at_padded_positions_leaves_a_standalone_train_step_unchanged(name):
    fn = {**REGISTRY_STANDALONE, **OTHER_STANDALONE}[name]
    step = _standalone_step(fn, MASK)
    params = _params()
    clean_loss, clean_grads = step(params, _data(poisoned=False))
    loss, grads = step(params, _data(poisoned=True))
    _assert_same((loss, grads["w"], grads["b"]), (clean_loss, clean_grads["w"], clean_grads["b"]))
    assert np.any(np.asarray(clean_grads["w"]) != 0)  # the valid tokens do train


@pytest.mark.parametrize("pad_id", [-1, V])
def test_out_of_range_ids_at_padded_positions_are_harmless(pad_id):
    """Padding ids outside the vocabulary: their log-probs are NaN (not a wrapped id's), which
    the masked estimator keeps out of the loss and the gradients like any other NaN."""
    step = _standalone_step(REGISTRY_STANDALONE["reverse_kl_hybrid"], MASK)
    params = _params()
    _assert_same(step(params, _data(poisoned=True, pad_id=pad_id)), step(params, _data(poisoned=False)))


def test_a_list_mask_works_as_well():
    """Any array-like: the same step with the mask as nested Python lists."""
    fn = REGISTRY_STANDALONE["reverse_kl_mc"]
    params, d = _params(), _data(poisoned=True)
    _, want = _standalone_step(fn, MASK)(params, d)
    _, got = _standalone_step(fn, MASK.astype(int).tolist())(params, d)
    _assert_same(got, want)


def _registry_inputs(d: dict, name: str, params) -> tuple:
    batch = RolloutBatch(
        prompt_tokens=jnp.zeros((B, 2), jnp.int32),
        prompt_mask=jnp.ones((B, 2), bool),
        response_tokens=d["tokens"],
        response_mask=MASK,
        behavior_logp=d["behavior_logp"],
        token_version=jnp.zeros((B, T), jnp.int32),
        candidate_ids=d["candidate_ids"],
        candidate_behavior_logp=d["candidate_behavior_logp"],
        student_topk_ids=d["student_topk_ids"],
        student_topk_behavior_logp=d["student_topk_behavior_logp"],
        reference_logp=d["reference_logp"],
    )
    cache = TeacherScoreCache(
        token_logp=d["token_logp"],
        candidate_logp=d["candidate_logp"],
        student_topk_logp=d["student_topk_logp"],
        topk_ids=d["topk_ids"],
        topk_logp=d["topk_logp"],
        sample_ids=d["sample_ids"],
        sample_logp=d["sample_logp"],
    )
    student = student_logprobs(required_ids(name, batch, cache), _student_gather(params, d))
    if ESTIMATORS[name].needs_teacher_hidden:  # the learner's exact KLs (from hidden states; here from logits)
        logits = _logits(params) + d["student_nan"][..., None]
        cache = dataclasses.replace(cache, hidden=d["teacher_logits"])  # what the learner would read them from
        student = dataclasses.replace(
            student,
            forward_kl=est.forward_kl_dense(logits, d["teacher_logits"], mask=MASK),
            reverse_kl=est.reverse_kl_dense(logits, d["teacher_logits"], mask=MASK),
        )
    proximal = StudentLogProbs(token=d["proximal_logp"])
    return batch, cache, student, proximal


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_nan_at_padded_positions_leaves_the_registry_evaluation_unchanged(name):
    """The trainer's path: :func:`evaluate_estimator` (with a KL-to-reference term) on a
    cache and a rollout that hold NaN at their padded positions."""
    config = EstimatorConfig(name, regularisers=RegularisersConfig(reference_kl_coef=0.1))

    def loss(params, d):
        batch, cache, student, proximal = _registry_inputs(d, name, params)
        values, metrics = evaluate_estimator(config, batch, cache, student, proximal=proximal)
        return est.aggregate(values, batch.response_mask, config.aggregation), metrics

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    params = _params()
    (clean_loss, clean_metrics), clean_grads = step(params, _data(poisoned=False))
    (got_loss, metrics), grads = step(params, _data(poisoned=True))
    _assert_same((got_loss, grads["w"], grads["b"]), (clean_loss, clean_grads["w"], clean_grads["b"]))
    _assert_same(metrics, clean_metrics)
