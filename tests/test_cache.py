"""The data contracts: shape checks, pytree behaviour, and estimators by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asyncopd_jax.estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.estimator_eval import evaluate_estimator, required_ids, student_logprobs
from asyncopd_jax.estimator_registry import ESTIMATORS, EstimatorConfig, get_estimator

B, P, T, V, N, K = 2, 3, 5, 13, 4, 3


def _estimator(name: str, knobs: dict[str, object] | None = None) -> EstimatorConfig:
    """``EstimatorConfig(name)`` with ``knobs`` set by their path in the ``estimator`` section
    (``"ppo.clip_eps"``, ``"stabiliser_signal"``)."""
    config = EstimatorConfig(name)
    for path, value in (knobs or {}).items():
        group, _, field = path.rpartition(".")
        if group:
            value = dataclasses.replace(getattr(config, group), **{field: value})
            field = group
        config = dataclasses.replace(config, **{field: value})
    return config


def _knob_paths(cls: type = EstimatorConfig, prefix: str = "") -> set[str]:
    """Every knob of the ``estimator`` section, by its path."""
    paths = set()
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        sub = type(default) if dataclasses.is_dataclass(default) else None
        paths |= _knob_paths(sub, f"{prefix}{f.name}.") if sub else {prefix + f.name}
    return paths


def _world(seed: int = 0, teacher_equals_student: bool = False):
    """Student/behaviour/teacher logits [B, T, V] and a full batch + cache built from them."""
    rng = np.random.default_rng(seed)
    student = rng.normal(scale=1.5, size=(B, T, V)).astype(np.float32)
    behavior = (student + rng.normal(scale=0.5, size=(B, T, V))).astype(np.float32)
    teacher = student if teacher_equals_student else rng.normal(scale=1.5, size=(B, T, V)).astype(np.float32)
    k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
    tokens, token_mu = est.sample_candidates(k0, behavior, 1)
    cand, cand_mu = est.sample_candidates(k1, behavior, N)
    samples, _ = est.sample_candidates(k2, teacher, N)
    student_topk = jnp.argsort(-behavior, axis=-1)[..., :K]
    teacher_topk = jnp.argsort(-teacher, axis=-1)[..., :K]
    mask = np.ones((B, T), bool)
    mask[1, 3:] = False
    batch = RolloutBatch(
        prompt_tokens=jnp.ones((B, P), jnp.int32),
        prompt_mask=jnp.ones((B, P), bool),
        response_tokens=tokens[..., 0],
        response_mask=jnp.asarray(mask),
        behavior_logp=token_mu[..., 0],
        token_version=jnp.asarray([[3, 3, 4, 4, 5], [5, 5, 5, 0, 0]], jnp.int32),
        candidate_ids=cand,
        candidate_behavior_logp=cand_mu,
        student_topk_ids=student_topk,
        student_topk_behavior_logp=est.gather_logprobs(behavior, student_topk),
    )
    g = est.gather_logprobs
    cache = TeacherScoreCache(
        token_logp=g(teacher, batch.response_tokens),
        candidate_logp=g(teacher, cand),
        student_topk_logp=g(teacher, student_topk),
        topk_ids=teacher_topk,
        topk_logp=g(teacher, teacher_topk),
        sample_ids=samples,
        sample_logp=g(teacher, samples),
        hidden=jnp.asarray(teacher),  # as hidden states under an identity head: the logits themselves
    )
    return student, teacher, batch, cache


def test_shape_errors_name_the_field():
    _, _, batch, cache = _world()
    with pytest.raises(ValueError, match=r"RolloutBatch.behavior_logp must have shape \[2, 5\]"):
        dataclasses.replace(batch, behavior_logp=jnp.zeros((B, T + 1)))
    with pytest.raises(ValueError, match="RolloutBatch.candidate_behavior_logp must have shape"):
        dataclasses.replace(batch, candidate_behavior_logp=jnp.zeros((B, T)))
    with pytest.raises(ValueError, match="candidate_ids, candidate_behavior_logp go together"):
        dataclasses.replace(batch, candidate_behavior_logp=None)
    with pytest.raises(ValueError, match="disagree on the number of ids"):
        dataclasses.replace(cache, topk_logp=jnp.zeros((B, T, K + 1)))
    with pytest.raises(ValueError, match="prompt_tokens"):
        dataclasses.replace(batch, prompt_tokens=jnp.zeros((B + 1, P), jnp.int32))


def test_pytree_through_jit_and_vmap():
    _, _, batch, cache = _world()
    leaves = jax.tree_util.tree_leaves(batch)
    assert len(leaves) == 10  # every field of RolloutBatch is set
    doubled = jax.jit(lambda b: jax.tree_util.tree_map(lambda x: x * 2, b))(batch)
    assert isinstance(doubled, RolloutBatch)
    per_row = jax.vmap(lambda b: b.newest_version)(batch)  # validation is relative: vmap works
    np.testing.assert_array_equal(per_row, [5, 5])
    np.testing.assert_array_equal(batch.oldest_version, [3, 5])  # masked tokens ignored
    without = TeacherScoreCache(token_logp=cache.token_logp)
    assert len(jax.tree_util.tree_leaves(without)) == 1


def test_required_ids_and_one_fused_gather():
    student, _, batch, cache = _world(1)
    ids = required_ids("reverse_kl_mc", batch, cache)
    assert set(ids) == {"token", "candidates"}
    scored = student_logprobs(ids, lambda i: est.gather_logprobs(student, i))
    np.testing.assert_allclose(scored.token, est.gather_logprobs(student, batch.response_tokens), rtol=1e-6)
    np.testing.assert_allclose(scored.candidates, est.gather_logprobs(student, batch.candidate_ids), rtol=1e-6)
    with pytest.raises(ValueError, match="needs TeacherScoreCache.sample_ids"):
        required_ids("forward_kl_mc", batch, TeacherScoreCache(token_logp=cache.token_logp))
    with pytest.raises(ValueError, match="unknown estimator 'kl'; allowed: decoupled_ppo"):
        get_estimator("kl")


def _all_logprobs(student, batch, cache):
    ids = {
        "token": batch.response_tokens,
        "candidates": batch.candidate_ids,
        "student_topk": batch.student_topk_ids,
        "teacher_topk": cache.topk_ids,
        "teacher_samples": cache.sample_ids,
    }
    s = student_logprobs(ids, lambda i: est.gather_logprobs(student, i))
    # the exact KLs the learner takes from hidden states: here the logits, under identity heads
    eye = jnp.eye(V, dtype=jnp.float32)
    forward, reverse = est.dense_kls_from_hidden(
        jnp.asarray(student), eye, cache.hidden, eye, chunk_size=3, vocab_chunk=7, mask=batch.response_mask
    )
    return dataclasses.replace(s, forward_kl=forward, reverse_kl=reverse)


def test_named_estimators_match_the_functions_they_name():
    student, _, batch, cache = _world(2)
    s = _all_logprobs(student, batch, cache)
    direct = {
        "forward_kl_topk": est.forward_kl_topk(s.teacher_topk, cache.topk_logp),
        "forward_kl_mc": est.forward_kl_mc(s.teacher_samples, cache.sample_logp),
        "reverse_kl_topk": est.reverse_kl_topk(s.student_topk, cache.student_topk_logp),
        "reverse_kl_mc": est.reverse_kl_mc(s.candidates, batch.candidate_behavior_logp, cache.candidate_logp),
        "reverse_kl_mc_stale": est.reverse_kl_mc(
            s.candidates, batch.candidate_behavior_logp, cache.candidate_logp, recompute=False
        ),
        "reverse_kl_mc_loo": est.reverse_kl_mc_loo(s.candidates, batch.candidate_behavior_logp, cache.candidate_logp),
        "reverse_kl_hybrid": est.reverse_kl_hybrid(
            s.student_topk,
            cache.student_topk_logp,
            batch.student_topk_ids,
            s.candidates,
            batch.candidate_behavior_logp,
            cache.candidate_logp,
            batch.candidate_ids,
        ),
        "ppo_clip": est.ppo_clip_loss(s.token, batch.behavior_logp, cache.token_logp - batch.behavior_logp),
        "forward_kl_dense": est.forward_kl_dense(jnp.asarray(student), cache.hidden, mask=batch.response_mask),
        "reverse_kl_dense": est.reverse_kl_dense(jnp.asarray(student), cache.hidden, mask=batch.response_mask),
    }
    for name, want in direct.items():
        got, metrics = jax.jit(evaluate_estimator, static_argnums=0)(EstimatorConfig(name), batch, cache, s)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(metrics.means["loss"], est.token_mean(want, batch.response_mask), rtol=1e-6)


# The stale signal log μ − log q is not 0 at teacher = student (μ is an older student).
UNBIASED = sorted(n for n in ESTIMATORS if not n.endswith("_stale"))


@pytest.mark.parametrize("name", UNBIASED)
def test_every_named_estimator_is_zero_when_teacher_equals_student_and_alignment_matters(name):
    """Teacher = student (at the learner's own weights): 0 loss, 0 gradient. Shifting the
    teacher rows by one position (an off-by-one cache) must break that."""
    student, teacher, batch, cache = _world(3, teacher_equals_student=True)
    config = _estimator(name, {"forward_mc.control_variate": True, "stabiliser_signal": "recompute"})

    def loss(logits, cache):
        s = _all_logprobs(logits, batch, cache)
        values, _ = evaluate_estimator(config, batch, cache, s, proximal=s)
        return est.token_mean(values, batch.response_mask)

    value, grad = jax.value_and_grad(loss)(student, cache)
    np.testing.assert_allclose(value, 0.0, atol=1e-5)
    np.testing.assert_allclose(grad, 0.0, atol=1e-5)

    shifted = jnp.roll(jnp.asarray(teacher), 1, axis=1)  # row t now scores token t − 1
    _, _, _, shifted_cache = _world(3, teacher_equals_student=True)
    g = est.gather_logprobs
    shifted_cache = TeacherScoreCache(
        token_logp=g(shifted, batch.response_tokens),
        candidate_logp=g(shifted, batch.candidate_ids),
        student_topk_logp=g(shifted, batch.student_topk_ids),
        topk_ids=cache.topk_ids,
        topk_logp=g(shifted, cache.topk_ids),
        sample_ids=cache.sample_ids,
        sample_logp=g(shifted, cache.sample_ids),
        hidden=shifted,
    )
    _, grad = jax.value_and_grad(loss)(student, shifted_cache)
    assert np.abs(np.asarray(grad)).max() > 1e-3


def test_missing_inputs_are_clear_errors():
    student, _, batch, cache = _world(4)
    s = _all_logprobs(student, batch, cache)
    with pytest.raises(ValueError, match="needs proximal log-probs"):
        evaluate_estimator(EstimatorConfig("decoupled_ppo"), batch, cache, s)
    with pytest.raises(ValueError, match="needs StudentLogProbs.candidates"):
        evaluate_estimator(EstimatorConfig("reverse_kl_mc"), batch, cache, StudentLogProbs(token=s.token))
    for name in ("reverse_kl_pg", "ppo_clip"):  # distillation: every spec reads the teacher's scores
        with pytest.raises(ValueError, match=f"estimator '{name}' needs the teacher's scores"):
            evaluate_estimator(EstimatorConfig(name), batch, None, s)


def test_zero_grad_fraction_counts_the_tokens_ppo_clips():
    student, _, batch, cache = _world(5)
    s = _all_logprobs(student, batch, cache)
    ratio = np.exp(np.asarray(s.token, np.float64) - np.asarray(batch.behavior_logp))
    adv = np.asarray(cache.token_logp) - np.asarray(batch.behavior_logp)  # the stale signal
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    mask = np.asarray(batch.response_mask)
    assert 0 < clipped[mask].mean() < 1  # both kinds of token are there
    _, metrics = evaluate_estimator(EstimatorConfig("ppo_clip"), batch, cache, s)
    np.testing.assert_allclose(metrics.means["zero_grad_fraction"], clipped[mask].mean(), rtol=1e-6)
    _, metrics = evaluate_estimator(EstimatorConfig("reverse_kl_mc"), batch, cache, s)
    assert metrics.means["zero_grad_fraction"] == 0.0


def test_mc_importance_sampling_can_be_switched_off_by_name():
    student, _, batch, cache = _world(6)
    s = _all_logprobs(student, batch, cache)
    got, _ = evaluate_estimator(_estimator("reverse_kl_mc_stale", {"mc.importance_sampling": False}), batch, cache, s)
    want = est.reverse_kl_mc(
        s.candidates, batch.candidate_behavior_logp, cache.candidate_logp, recompute=False, importance_sampling=False
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with_is, _ = evaluate_estimator(EstimatorConfig("reverse_kl_mc_stale"), batch, cache, s)
    assert np.abs(np.asarray(got) - np.asarray(with_is)).max() > 1e-3


def _with_rl_advantages(batch: RolloutBatch, seed: int) -> tuple[RolloutBatch, np.ndarray]:
    """``batch`` carrying a per-response reward advantage ``[B, T]`` (as the reward stage sets it)."""
    per_response = np.random.default_rng(seed).normal(size=(B, 1)).astype(np.float32)
    advantages = np.broadcast_to(per_response, (B, T)).copy()
    return dataclasses.replace(batch, advantages=jnp.asarray(advantages)), advantages


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_rl_stabilisers_weight_the_reward_advantage_plus_beta_times_the_teacher_signal(beta):
    """Reward-driven RL: the stabilisers' advantage is the batch's reward advantage, plus
    β (log q − log μ) when distilling at once; without β no teacher cache is needed."""
    from tests.estimators import oracle

    student, _, batch, cache = _world(7)
    batch, advantages = _with_rl_advantages(batch, 7)
    s = _all_logprobs(student, batch, cache)
    proximal = jax.tree_util.tree_map(lambda x: x + 0.1, s)
    behavior, prox = np.asarray(batch.behavior_logp, np.float64), np.asarray(proximal.token, np.float64)
    signal = np.asarray(cache.token_logp, np.float64) - behavior
    adv = advantages + beta * signal
    got, metrics = evaluate_estimator(
        EstimatorConfig("decoupled_ppo"), batch, cache if beta else None, s, proximal=proximal, distill_coef=beta
    )
    weight = np.exp(prox - behavior)  # π_prox / μ, capped at 5 by the default behaviour-weight cap
    want = np.where(weight <= 5.0, weight * oracle.ppo_clip(np.asarray(s.token, np.float64), prox, adv, 0.8, 1.2), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert ("reverse_kl_signal" in metrics.means) == bool(beta)  # no teacher scores, no KL metric
    got, _ = evaluate_estimator(EstimatorConfig("ppo_clip"), batch, cache if beta else None, s, distill_coef=beta)
    np.testing.assert_allclose(
        got, oracle.ppo_clip(np.asarray(s.token, np.float64), behavior, adv, 0.8, 1.2), rtol=1e-5, atol=1e-6
    )


def test_rl_distillation_without_teacher_scores_is_a_clear_error():
    student, _, batch, cache = _world(8)
    batch, _ = _with_rl_advantages(batch, 8)
    s = _all_logprobs(student, batch, cache)
    with pytest.raises(ValueError, match="distill_coef = 0.5 needs the teacher's scores"):
        evaluate_estimator(EstimatorConfig("ppo_clip"), batch, None, s, distill_coef=0.5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_the_regularisers_are_added_to_every_estimator_by_name(kind):
    """``entropy_coef`` adds −c·H and ``reference_kl_coef`` β·k(π_θ, π_ref) to each token's
    loss, with the estimator ``reference_kl`` names; the metrics report the entropy and k3."""
    student, _, batch, cache = _world(7)
    s = _all_logprobs(student, batch, cache)
    s = dataclasses.replace(
        s, entropy=jnp.asarray(np.random.default_rng(8).uniform(0.5, 2.0, size=(B, T)), jnp.float32)
    )
    reference = (np.asarray(s.token) + np.random.default_rng(9).normal(scale=0.3, size=(B, T))).astype(np.float32)
    batch = dataclasses.replace(batch, reference_logp=jnp.asarray(reference))
    knobs = {"regularisers.entropy_coef": 0.1, "regularisers.reference_kl_coef": 0.5, "regularisers.reference_kl": kind}
    for name in ("forward_kl_topk", "ppo_clip"):
        base, base_metrics = evaluate_estimator(EstimatorConfig(name), batch, cache, s)
        got, metrics = evaluate_estimator(_estimator(name, knobs), batch, cache, s)
        np.testing.assert_allclose(
            got, base - 0.1 * s.entropy + 0.5 * est.reference_kl(s.token, reference, kind), rtol=1e-5, atol=1e-6
        )
        mask = np.asarray(batch.response_mask)
        np.testing.assert_allclose(metrics.means["entropy"], np.asarray(s.entropy)[mask].mean(), rtol=1e-6)
        d = np.asarray(s.token, np.float64) - reference
        np.testing.assert_allclose(metrics.means["reference_kl"], (np.exp(-d) - 1 + d)[mask].mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="reference_kl_coef = 0.5 needs RolloutBatch.reference_logp"):
        evaluate_estimator(_estimator("ppo_clip", knobs), dataclasses.replace(batch, reference_logp=None), cache, s)
    with pytest.raises(ValueError, match="entropy_coef = 0.1 needs StudentLogProbs.entropy"):
        evaluate_estimator(_estimator("ppo_clip", knobs), batch, cache, dataclasses.replace(s, entropy=None))


# knob of EstimatorConfig, by its path in the estimator section → (an estimator that reads it,
# its other knobs, a non-default value, a shift of log μ that puts tokens where the knob acts);
# seed 11's world, proximal log-probs π_θ + 0.3.
KNOB_READERS = {
    "mc.clip_eps": ("reverse_kl_mc", {}, 0.05, 0.0),
    "mc.importance_sampling": ("reverse_kl_mc", {}, False, 0.0),
    "topk.tail": ("forward_kl_topk", {}, False, 0.0),
    "forward_mc.control_variate": ("forward_kl_mc", {}, True, 0.0),
    "ppo.clip_eps": ("ppo_clip", {}, 0.01, 0.0),
    "ppo.dual_clip": ("ppo_clip", {"ppo.clip_eps": 0.01}, 1.01, 0.0),
    "ppo.behavior_weight_cap": ("decoupled_ppo", {}, 1.01, 0.0),
    "ppo.behavior_weight_mode": ("decoupled_ppo", {"ppo.behavior_weight_cap": 1.01}, "truncate", 0.0),
    "ppo.behavior_weight_floor": ("decoupled_ppo", {}, 0.99, 0.0),
    "gspo.clip_low": ("gspo", {}, 0.5, -0.5),  # sequence ratios below 1
    "gspo.clip_high": ("gspo", {}, 0.0, 0.5),  # ... and above 1
    "tis.cap": ("truncated_is", {}, 1.01, 0.0),
    "m2po.budget": ("m2po", {}, 1e-4, 0.0),
    "second_moment_clip.budget": ("second_moment_clip", {}, 10.0, 0.0),
    "second_moment_clip.min_low": ("second_moment_clip", {}, 0.01, 0.0),
    "second_moment_clip.min_high": ("second_moment_clip", {}, 0.01, 0.0),
    "stabiliser_signal": ("ppo_clip", {}, "recompute", 0.0),
}
# The knobs that do not change an estimator's per-token values, and where each is tested.
KNOBS_TESTED_ELSEWHERE = {
    "name": "every test here",
    "aggregation": "tests/learner/test_step.py::test_aggregation_modes_are_exact_over_micro_batches_and_packing",
    "regularisers.entropy_coef": "test_the_regularisers_are_added_to_every_estimator_by_name",
    "regularisers.reference_kl_coef": "test_the_regularisers_are_added_to_every_estimator_by_name",
    "regularisers.reference_kl": "test_the_regularisers_are_added_to_every_estimator_by_name",
    "check_inputs": "tests/learner/test_step.py::test_check_inputs_stops_a_step_fed_raw_logits",
}


@pytest.mark.parametrize("knob", list(KNOB_READERS))
def test_every_estimator_knob_reaches_the_estimator_that_reads_it(knob):
    """Each knob at a non-default value changes the per-token losses of an estimator that
    reads it: the adapter passes it on (a new knob must be added to one of the tables)."""
    assert set(KNOB_READERS) | set(KNOBS_TESTED_ELSEWHERE) == _knob_paths()
    student, _, batch, cache = _world(11)
    name, others, value, shift = KNOB_READERS[knob]
    batch = dataclasses.replace(batch, behavior_logp=batch.behavior_logp - shift)
    s = _all_logprobs(student, batch, cache)
    proximal = jax.tree_util.tree_map(lambda x: x + 0.3, s)
    default, _ = evaluate_estimator(_estimator(name, others), batch, cache, s, proximal=proximal)
    changed, _ = evaluate_estimator(_estimator(name, {**others, knob: value}), batch, cache, s, proximal=proximal)
    assert np.abs(np.asarray(changed) - np.asarray(default)).max() > 1e-4, knob


def test_a_trajectory_is_as_stale_as_its_oldest_student_token():
    """Environment tokens are context (``context_mask``), written by no policy: the versions
    at their slots do not count; a trajectory whose turns span a weight swap is dated by its
    oldest student token."""
    _, _, batch, _ = _world()
    response = np.asarray(batch.response_mask, bool)
    environment = np.zeros_like(response)
    environment[:, 1] = response[:, 1]  # slot 1 of each row: a tool's observation
    versions = np.where(environment, 0, np.asarray(batch.token_version))  # garbage where no policy wrote
    trajectory = dataclasses.replace(
        batch,
        response_mask=jnp.asarray(response & ~environment),
        environment_mask=jnp.asarray(environment),
        token_version=jnp.asarray(versions, jnp.int32),
    )
    np.testing.assert_array_equal(trajectory.context_mask, response)
    student = response & ~environment
    want = [np.asarray(batch.token_version)[row][student[row]].min() for row in range(student.shape[0])]
    np.testing.assert_array_equal(trajectory.oldest_version, want)
    assert min(want) > 0
    with pytest.raises(ValueError, match="environment_mask"):
        dataclasses.replace(batch, environment_mask=jnp.zeros((1, 1), bool))
