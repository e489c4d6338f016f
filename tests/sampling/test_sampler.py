"""Both engines (the static sampler and the continuous-batching one): exactness of what
they record, determinism, interruption. The continuous engine runs with 2 slots for the 3
prompts, so the third prompt enters a slot another answer left."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from asyncopd_jax.models import Decoder
from asyncopd_jax.sampling import Sampler, SamplingParams, make_sampler, run_stream, sampling_logprobs
from tests.tiny_models import tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12]]  # different lengths: left padding matters


def teacher_forced_logits(model: Decoder, batch) -> np.ndarray:
    """``[B, T, V]`` logits for each response position, from one plain forward."""
    ids = jnp.concatenate([batch.prompt_tokens, batch.response_tokens], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    logits = model(ids, attention_mask=mask)
    p = batch.prompt_tokens.shape[1]
    return np.asarray(logits[:, p - 1 : -1])  # row t predicts response token t


ENGINES = ["static", "continuous"]
# Where the continuous engine's case follows from fast tests of its own (it answers as the
# static engine does with the same keys, tests/sampling/test_engines_agree.py, and a swap to
# identical weights changes no answer of a stream, test_engine.py), that case runs in the
# end-to-end step (-m e2e): each costs ~10-20 s of compiles, the README command's margin.
ENGINES_CONTINUOUS_E2E = ["static", pytest.param("continuous", marks=pytest.mark.e2e)]


def _engine(params: SamplingParams, engine: str) -> SamplingParams:
    """``params`` for ``engine``: the continuous one with 2 slots and pages of 4 tokens."""
    if engine == "static":
        return params
    return dataclasses.replace(params, engine="continuous", slots=2, page_size=4)


def _sample(model, params, prompts=PROMPTS, seed=0, engine="static", **kwargs):
    graphdef, state = nnx.split(model)
    return make_sampler(graphdef, _engine(params, engine)).generate(state, prompts, jax.random.key(seed), **kwargs)


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_equals_argmax_teacher_forcing(engine):
    model = tiny_decoder(0)
    batch = _sample(model, SamplingParams(temperature=0.0, max_new_tokens=12, chunk_steps=5), engine=engine)
    forced = teacher_forced_logits(model, batch)
    mask = np.asarray(batch.response_mask)
    assert mask.all()
    np.testing.assert_array_equal(np.asarray(batch.response_tokens), forced.argmax(-1))
    assert len(np.unique(np.asarray(batch.response_tokens))) > 3  # a non-degenerate model
    np.testing.assert_array_equal(batch.behavior_logp, 0.0)  # a point mass


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bf16_kv_cache_under_fp32_compute_rounds_the_cache_only(engine):
    """sampling.kv_dtype=bfloat16 over an fp32 student: the cache is bf16, the weights and
    the records fp32, and the behaviour log-probs are within bf16 rounding of the fp32
    learner's on the same tokens (a plain forward), not equal to them."""
    model = tiny_decoder(1)
    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, chunk_steps=4, kv_dtype="bfloat16")
    sampler = make_sampler(graphdef, _engine(params, engine))
    stream = sampler.open_stream(state, version=0, prompt_slots=5, slots=sampler.decode_rows(3))
    stream.submit(None, PROMPTS, jax.random.split(jax.random.key(2), 3))
    ((_, batch),) = run_stream(stream)
    cache = stream.carry.cache if engine == "static" else stream.carry.slots.cache
    arrays = cache.keys + cache.values if engine == "static" else cache.pages
    assert {x.dtype for x in arrays} == {jnp.dtype(jnp.bfloat16)}
    assert batch.behavior_logp.dtype == jnp.float32
    assert {x.dtype for x in jax.tree_util.tree_leaves(state)} == {jnp.dtype(jnp.float32)}
    forced = jax.nn.log_softmax(teacher_forced_logits(model, batch), axis=-1)
    learner = np.take_along_axis(forced, np.asarray(batch.response_tokens)[..., None], axis=-1)[..., 0]
    mask = np.asarray(batch.response_mask)
    gap = np.abs(np.asarray(batch.behavior_logp) - learner)[mask]
    assert 1e-5 < gap.max() < 0.05, gap.max()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("temperature", [pytest.param(1.0, marks=pytest.mark.extended), 0.7])  # 1.0: CI's second step
def test_behaviour_logprobs_are_those_of_the_sampling_distribution(temperature, engine):
    model = tiny_decoder(1)
    params = SamplingParams(temperature=temperature, max_new_tokens=10, num_candidates=6, student_topk=4, chunk_steps=4)
    batch = _sample(model, params, seed=3, engine=engine)
    forced = teacher_forced_logits(model, batch)
    want = jax.nn.log_softmax(forced / temperature, axis=-1)
    mask = np.asarray(batch.response_mask)
    got_tok = np.asarray(batch.behavior_logp)
    want_tok = np.take_along_axis(np.asarray(want), np.asarray(batch.response_tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(got_tok[mask], want_tok[mask], atol=2e-5)
    want_cand = np.take_along_axis(np.asarray(want), np.asarray(batch.candidate_ids), -1)
    np.testing.assert_allclose(np.asarray(batch.candidate_behavior_logp)[mask], want_cand[mask], atol=2e-5)
    want_topk = np.argsort(-forced, axis=-1)[..., :4]
    np.testing.assert_array_equal(np.sort(np.asarray(batch.student_topk_ids), -1)[mask], np.sort(want_topk, -1)[mask])
    want_topk_logp = np.take_along_axis(np.asarray(want), np.asarray(batch.student_topk_ids), -1)
    np.testing.assert_allclose(np.asarray(batch.student_topk_behavior_logp)[mask], want_topk_logp[mask], atol=2e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_candidate_frequencies_match_probabilities(engine):
    """Chi-square on 96 rows × 64 candidates drawn at the first response position."""
    model = tiny_decoder(2, scale=0.5)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, num_candidates=64)
    prompts = [[5, 6, 7]] * 96
    batch = _sample(model, params, prompts=prompts, seed=4, engine=engine)
    logits = np.asarray(model(jnp.asarray([[5, 6, 7]]))[0, -1], np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(batch.candidate_ids).ravel(), minlength=len(probs))
    expected = probs * counts.sum()
    big = expected >= 5  # pool the rare ids into one bin, as chi-square requires
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    assert big.sum() > 10
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_stop_tokens_end_responses_and_the_loop_exits_early():
    model = tiny_decoder(0)
    free = _sample(model, SamplingParams(temperature=0.0, max_new_tokens=12))
    stop = int(free.response_tokens[0, 3])  # a token row 0 emits at step 3 under greedy decoding
    graphdef, state = nnx.split(model)
    sampler = Sampler(
        graphdef, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,), chunk_steps=4)
    )
    batch = sampler.generate(state, PROMPTS, jax.random.key(0))
    tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(np.asarray(free.response_tokens[row]) == stop)
        length = hits[0] + 1 if len(hits) else 12
        assert mask[row].sum() == length and mask[row, :length].all()  # the stop token is included
        np.testing.assert_array_equal(tokens[row, :length], np.asarray(free.response_tokens[row, :length]))
        assert (tokens[row, length:] == 0).all()
    single = sampler.generate(state, [PROMPTS[0]], jax.random.key(0))
    first_stop = int(np.flatnonzero(np.asarray(free.response_tokens[0]) == stop)[0]) + 1  # ≤ 4
    assert int(single.response_mask.sum()) == first_stop
    assert sampler.last_steps == first_stop  # no decode step after every row stopped


@pytest.mark.parametrize("engine", ENGINES_CONTINUOUS_E2E)
def test_deterministic_under_a_seed(engine):
    model = tiny_decoder(3)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, num_candidates=3, chunk_steps=3)
    a, b, c = (_sample(model, params, seed=s, engine=engine) for s in (7, 7, 8))
    for x, y in [(a.response_tokens, b.response_tokens), (a.candidate_ids, b.candidate_ids)]:
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.candidate_ids, c.candidate_ids)
    # Chunking does not change the draws either.
    d = _sample(
        model, SamplingParams(temperature=1.0, max_new_tokens=8, num_candidates=3, chunk_steps=8), seed=7, engine=engine
    )
    np.testing.assert_array_equal(a.response_tokens, d.response_tokens)


@pytest.mark.parametrize("engine", ENGINES_CONTINUOUS_E2E)
def test_swapping_in_identical_weights_changes_nothing_but_the_version(engine):
    model = tiny_decoder(4)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, num_candidates=2, chunk_steps=4)
    plain = _sample(model, params, seed=5, engine=engine)
    _, state = nnx.split(model)
    swaps = []

    def source(version):
        swaps.append(version)
        return (version + 1, state) if version < 2 else None

    swapped = _sample(model, params, seed=5, weight_source=source, engine=engine)
    # polled between chunks: after the swaps to versions 1 and 2, on version 2 while chunks
    # remain in flight (the continuous engine's third prompt decodes on; a stream reads a
    # chunk only after it has dispatched the next, so it polls while its last one runs)
    assert swaps[:2] == [0, 1] and set(swaps[2:]) == {2}
    np.testing.assert_array_equal(swapped.response_tokens, plain.response_tokens)
    np.testing.assert_array_equal(swapped.candidate_ids, plain.candidate_ids)
    np.testing.assert_allclose(swapped.behavior_logp, plain.behavior_logp, atol=1e-5)
    np.testing.assert_array_equal(swapped.token_version[0], [0] * 4 + [1] * 4 + [2] * 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_swapping_different_weights_records_versions_and_recomputes_the_cache(engine):
    old, new = tiny_decoder(5), tiny_decoder(6)
    # A swap after 3 steps: the recompute covers a 4-slot prefix whose last slot is unwritten.
    params = SamplingParams(temperature=0.0, max_new_tokens=10, chunk_steps=3)
    _, new_state = nnx.split(new)
    batch = _sample(old, params, weight_source=lambda v: (7, new_state) if v == 0 else None, engine=engine)
    versions = np.asarray(batch.token_version)
    swapped = np.where(np.arange(10) < 3, 0, 7)
    # the continuous engine's third prompt enters a slot after the swap: all of it on version 7
    want = [swapped, swapped, swapped if engine == "static" else np.full(10, 7)]
    np.testing.assert_array_equal(versions, want)
    tokens = np.asarray(batch.response_tokens)
    # Each token is the argmax of the weights that sampled it, on the full prefix: after the
    # swap the cache must hold the new weights' keys and values for the old tokens too.
    by_old, by_new = teacher_forced_logits(old, batch).argmax(-1), teacher_forced_logits(new, batch).argmax(-1)
    np.testing.assert_array_equal(tokens[versions == 0], by_old[versions == 0])
    np.testing.assert_array_equal(tokens[versions == 7], by_new[versions == 7])
    assert not np.array_equal(tokens[versions == 7], by_old[versions == 7])
    np.testing.assert_array_equal(batch.oldest_version, [0, 0, 0 if engine == "static" else 7])
    np.testing.assert_array_equal(batch.newest_version, [7, 7, 7])


@pytest.mark.parametrize("engine", ENGINES)
def test_top_k_top_p_truncation(engine):
    model = tiny_decoder(7, scale=0.5)
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=8)
    batch = _sample(model, params, seed=1, engine=engine)
    forced = teacher_forced_logits(model, batch)
    want = np.asarray(sampling_logprobs(jnp.asarray(forced), params))
    tokens = np.asarray(batch.response_tokens)
    rank = np.argsort(np.argsort(-forced, -1), -1)
    assert (np.take_along_axis(rank, tokens[..., None], -1) < 5).all()
    np.testing.assert_allclose(batch.behavior_logp, np.take_along_axis(want, tokens[..., None], -1)[..., 0], atol=2e-5)
    # The truncated distribution is normalised and keeps at most 5 ids.
    np.testing.assert_allclose(np.exp(want).sum(-1), 1.0, atol=1e-5)
    assert (np.isfinite(want).sum(-1) <= 5).all()


def test_sampling_params_errors_name_the_field():
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="allow_truncated_mc"):
        SamplingParams(top_p=0.9, num_candidates=4)
    SamplingParams(top_p=0.9, num_candidates=4, allow_truncated_mc=True)
    with pytest.raises(ValueError, match="greedy decoding has no distribution"):
        SamplingParams(temperature=0.0, num_candidates=4)
    with pytest.raises(ValueError, match="sampling.recompute_chunk"):
        SamplingParams(recompute_chunk=0)
    with pytest.raises(ValueError, match="sampling.compute_dtype"):
        SamplingParams(compute_dtype="float16")  # type: ignore[arg-type]
