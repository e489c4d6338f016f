"""Span estimators (cross-tokenizer) against NumPy oracles, and equal to the per-token
estimators, values and gradients, when every token is a span (identical tokenizers)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax import estimators as est
from asyncopd_jax.estimator_eval import evaluate_estimator
from asyncopd_jax.estimator_registry import (
    CROSS_TOKENIZER_ESTIMATORS,
    ESTIMATORS,
    EstimatorConfig,
    check_cross_tokenizer,
)
from asyncopd_jax.estimators.spans import (
    forward_kl_topk_spans,
    reverse_kl_spans,
    span_starts,
    span_sums,
)
from tests.test_cache import B, T, _all_logprobs, _estimator, _world


def random_spans(rng: np.random.Generator, b: int, t: int, lengths: np.ndarray) -> np.ndarray:
    """``[B, T]`` bool span ends over each row's first ``lengths[b]`` tokens; a row may end
    with tokens in no span (a cut answer)."""
    ends = rng.random((b, t)) < 0.45
    for row, n in enumerate(lengths):
        ends[row, n:] = False
        if n and rng.random() < 0.7:
            ends[row, n - 1] = True
    return ends


def oracle_spans(ends: np.ndarray) -> list[list[list[int]]]:
    """Each row's spans as lists of token positions (those of closed spans only)."""
    rows = []
    for row in ends:
        spans, current = [], []
        for t, end in enumerate(row):
            current.append(t)
            if end:
                spans.append(current)
                current = []
        rows.append(spans)
    return rows


def test_span_sums_and_starts_match_the_oracle():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ends = random_spans(rng, 3, 9, rng.integers(0, 10, size=3))
        x = rng.normal(size=(3, 9)).astype(np.float32)
        want_sums, want_starts = np.zeros_like(x), np.zeros(x.shape, bool)
        for b, spans in enumerate(oracle_spans(ends)):
            for span in spans:
                want_sums[b, span[-1]] = x[b, span].sum()
                want_starts[b, span[0]] = True
        np.testing.assert_allclose(span_sums(jnp.asarray(x), ends), want_sums, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(span_starts(ends), want_starts)
        # d(Σ weights · sums)/dx_t: the weight of t's span end (0 for a token in no span)
        weights = rng.normal(size=x.shape).astype(np.float32)
        grad = jax.grad(lambda v: jnp.sum(weights * span_sums(v, ends)))(jnp.asarray(x))
        want = np.zeros_like(x)
        for b, spans in enumerate(oracle_spans(ends)):
            for span in spans:
                want[b, span] = weights[b, span[-1]]
        np.testing.assert_allclose(grad, want, rtol=1e-6)


def test_reverse_kl_spans_matches_the_oracle():
    rng = np.random.default_rng(1)
    b, t = 3, 8
    lengths = np.array([8, 5, 3])
    mask = np.arange(t)[None] < lengths[:, None]
    ends = random_spans(rng, b, t, lengths)
    student = -rng.random((b, t)).astype(np.float32) * 2
    behavior = student + rng.normal(scale=0.3, size=(b, t)).astype(np.float32)
    teacher = np.where(ends, -rng.random((b, t)) * 4, 0.0).astype(np.float32)  # log q of each span, on its end

    def loss(s):
        return jnp.sum(reverse_kl_spans(s, behavior, teacher, ends, mask=mask))

    value = reverse_kl_spans(jnp.asarray(student), behavior, teacher, ends, mask=mask)
    grad = jax.grad(loss)(jnp.asarray(student))
    want_value, want_grad = np.zeros((b, t)), np.zeros((b, t))
    for row, spans in enumerate(oracle_spans(ends & mask)):
        for span in spans:
            pi, mu, q = student[row, span].sum(), behavior[row, span].sum(), teacher[row, span[-1]]
            rho = np.exp(pi - mu)
            want_value[row, span[-1]] = rho * (pi - q)  # L = −sg[log q − log π]·ρ
            want_grad[row, span] = rho * (pi - q)  # ∂L/∂log π(y_t) = ρ (log π − log q), each token of the span
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_forward_kl_topk_spans_puts_unmapped_mass_in_the_tail():
    rng = np.random.default_rng(2)
    b, t, k, v = 2, 6, 3, 7
    ends = np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], bool)
    student_logits = rng.normal(size=(b, t, v))
    teacher_logits = rng.normal(size=(b, t, v))
    s_all = np.log(np.exp(student_logits) / np.exp(student_logits).sum(-1, keepdims=True))
    q_all = np.log(np.exp(teacher_logits) / np.exp(teacher_logits).sum(-1, keepdims=True))
    ids = np.argsort(-q_all, axis=-1)[..., :k]
    teacher = np.take_along_axis(q_all, ids, -1)
    unmapped = rng.random((b, t, k)) < 0.35
    unmapped[0, 3] = True  # a start where nothing maps: no term, no NaN
    teacher = np.where(unmapped, -np.inf, teacher).astype(np.float32)
    student = np.take_along_axis(s_all, ids, -1).astype(np.float32)
    got = forward_kl_topk_spans(jnp.asarray(student), teacher, ends, tail=True)
    want = np.zeros((b, t))
    for row, spans in enumerate(oracle_spans(ends)):
        for span in spans:
            start, mapped = span[0], ~unmapped[row, span[0]]
            if not mapped.any():
                continue
            q, p = np.exp(teacher[row, start][mapped]), np.exp(student[row, start][mapped])
            want[row, start] = (q * np.log(q / p)).sum() + (1 - q.sum()) * np.log((1 - q.sum()) / (1 - p.sum()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda s: jnp.sum(forward_kl_topk_spans(s, teacher, ends)))(jnp.asarray(student))
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[0, 3].any()
    assert not np.asarray(grad)[unmapped].any()  # an unmapped id's student log-prob is out of the support


@pytest.mark.parametrize("recompute, importance_sampling, clip_eps", [(True, True, None), (False, True, 0.2)])
def test_every_token_a_span_equals_the_per_token_forms(recompute, importance_sampling, clip_eps):
    rng = np.random.default_rng(3)
    b, t, k = 3, 7, 4
    mask = np.arange(t)[None] < np.array([[7], [4], [1]])
    student = jnp.asarray(-rng.random((b, t)) * 3, jnp.float32)
    behavior = student + rng.normal(scale=0.4, size=(b, t)).astype(np.float32)
    teacher = jnp.asarray(-rng.random((b, t)) * 3, jnp.float32)
    knobs = dict(recompute=recompute, importance_sampling=importance_sampling, clip_eps=clip_eps)

    def spans(s):
        return reverse_kl_spans(s, behavior, teacher, mask, mask=mask, **knobs)

    def tokens(s):
        return est.reverse_kl_mc(s[..., None], behavior[..., None], teacher[..., None], mask=mask, **knobs)

    np.testing.assert_allclose(spans(student), tokens(student), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda s: spans(s).sum())(student), jax.grad(lambda s: tokens(s).sum())(student), atol=1e-6
    )
    topk_student = jnp.asarray(np.log(rng.dirichlet(np.ones(k + 2), size=(b, t))[..., :k]), jnp.float32)
    topk_teacher = jnp.asarray(np.log(rng.dirichlet(np.ones(k + 2), size=(b, t))[..., :k]), jnp.float32)

    def forward_spans(s):
        return forward_kl_topk_spans(s, topk_teacher, mask, mask=mask)

    def forward_tokens(s):
        return est.forward_kl_topk(s, topk_teacher, mask=mask)

    np.testing.assert_allclose(forward_spans(topk_student), forward_tokens(topk_student), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda s: forward_spans(s).sum())(topk_student),
        jax.grad(lambda s: forward_tokens(s).sum())(topk_student),
        atol=1e-6,
    )


KNOBS = {"stabiliser_signal": "recompute", "mc.clip_eps": 0.2}


# three kinds in the fast suite (the sampled signal, a stabiliser with the proximal policy, the
# mapped top-K); the others are the same property at more settings: CI's second step
FAST = ("reverse_kl_pg", "decoupled_ppo", "forward_kl_topk")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.extended) for n in CROSS_TOKENIZER_ESTIMATORS]
)
def test_by_name_every_token_a_span_equals_per_token(name):
    """The learner's path (evaluate_estimator) with a span cache whose spans are the tokens:
    values, metrics and the gradient to the student's logits within 1e-6 of the per-token
    cache's."""
    student, _, batch, cache = _world(7)
    per_span = dataclasses.replace(cache, span_end=batch.response_mask)
    proximal = _all_logprobs(student + 0.1, batch, cache)
    config = _estimator(name, KNOBS)

    def loss(logits, c):
        values, metrics = evaluate_estimator(config, batch, c, _all_logprobs(logits, batch, c), proximal=proximal)
        return est.token_mean(values, batch.response_mask), (values, metrics)

    (_, (want, want_metrics)), want_grad = jax.value_and_grad(loss, has_aux=True)(student, cache)
    (_, (got, got_metrics)), got_grad = jax.value_and_grad(loss, has_aux=True)(student, per_span)
    mask = np.asarray(batch.response_mask)  # the reduction drops padding's values (the span form zeroes them)
    np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(want_grad)).max() > 1e-3  # the comparison is not of zeros
    for key, value in want_metrics.means.items():
        np.testing.assert_allclose(got_metrics.means[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def _cross_world(seed: int):
    """A batch, a span cache (spans of 1 to 3 tokens; the teacher's log q of each span on its
    end; its mapped top-K with unmapped entries at −inf, −inf off the starts) and the
    student's logits."""
    student, _, batch, cache = _world(seed)
    rng = np.random.default_rng(seed)
    ends = random_spans(rng, B, T, np.asarray(batch.response_mask).sum(1))
    ends[np.arange(B), np.asarray(batch.response_mask).sum(1) - 1] = True  # every token in a span
    starts = np.asarray(span_starts(ends))
    topk = np.where(starts[..., None] & (rng.random(cache.topk_logp.shape) < 0.75), cache.topk_logp, -np.inf)
    span_q = np.where(ends, -rng.random((B, T)) * 3, 0.0).astype(np.float32)
    span_cache = dataclasses.replace(
        cache, token_logp=jnp.asarray(span_q), topk_logp=jnp.asarray(topk, jnp.float32), span_end=jnp.asarray(ends)
    )
    return student, batch, span_cache


@pytest.mark.parametrize("name", ["reverse_kl_pg", "reverse_kl_pg_stale", "forward_kl_topk"])
def test_by_name_with_spans_equals_the_span_functions(name):
    student, batch, cache = _cross_world(8)
    s = _all_logprobs(student, batch, cache)
    got, metrics = evaluate_estimator(EstimatorConfig(name), batch, cache, s)
    mask = batch.response_mask
    if name == "forward_kl_topk":
        want = forward_kl_topk_spans(s.teacher_topk, cache.topk_logp, cache.span_end, mask=mask)
    else:
        want = reverse_kl_spans(
            s.token, batch.behavior_logp, cache.token_logp, cache.span_end, recompute=name == "reverse_kl_pg", mask=mask
        )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    signal = span_sums(s.token, cache.span_end) - cache.token_logp
    np.testing.assert_allclose(
        metrics.means["reverse_kl_signal"], est.token_mean(jnp.where(cache.span_end, signal, 0.0), mask), rtol=1e-6
    )
    grad = jax.grad(
        lambda logits: est.token_mean(
            evaluate_estimator(EstimatorConfig(name), batch, cache, _all_logprobs(logits, batch, cache))[0], mask
        )
    )(student)
    assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).max() > 1e-4


def test_decoupled_ppo_by_name_weighs_each_span_by_its_proximal_and_behaviour_ratios():
    """Recompute (the proximal policy) and importance weights per span: decoupled PPO on the
    span sums of log π_θ, log π_prox and log μ, with the stale signal log q − log μ of each span."""
    student, batch, cache = _cross_world(10)
    s, proximal = _all_logprobs(student, batch, cache), _all_logprobs(student + 0.2, batch, cache)
    got, _ = evaluate_estimator(EstimatorConfig("decoupled_ppo"), batch, cache, s, proximal=proximal)
    ends = cache.span_end & batch.response_mask
    mu = span_sums(batch.behavior_logp, ends)
    want = est.decoupled_ppo_loss(span_sums(s.token, ends), span_sums(proximal.token, ends), mu, cache.token_logp - mu)
    np.testing.assert_allclose(got, jnp.where(ends, want, 0.0), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got)).max() > 1e-3


@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - set(CROSS_TOKENIZER_ESTIMATORS)))
def test_estimators_that_cannot_cross_tokenizers_are_refused(name):
    student, batch, cache = _cross_world(9)
    with pytest.raises(ValueError, match=f"estimator '{name}' cannot compare the student with teacher 'big'"):
        check_cross_tokenizer(name, "big")
    with pytest.raises(ValueError, match="cannot compare the student"):
        evaluate_estimator(
            _estimator(name),
            batch,
            cache,
            _all_logprobs(student, batch, cache),
            proximal=_all_logprobs(student, batch, cache),
        )
