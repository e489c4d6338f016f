"""Teacher scoring on real rollouts: alignment (with a negative control), chunking, precision."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.alignment import response_aligned
from asyncopd_jax.estimator_eval import evaluate_estimator, required_ids, student_logprobs
from asyncopd_jax.estimator_registry import EstimatorConfig, ForwardMCConfig
from asyncopd_jax.estimators import gather_logprobs_from_hidden
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.teacher import ReferenceScorer, Scorers, ScoringParams, TeacherScorer, score_hidden
from asyncopd_jax.teacher.scorer import scored_columns
from tests.tiny_models import tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
ESTIMATORS = ["reverse_kl_mc", "reverse_kl_pg", "reverse_kl_topk", "forward_kl_topk", "forward_kl_mc"]


@pytest.fixture(scope="module")
def world():
    """Rollouts in which row 0 ends with a stop ("EOS") token before the length limit."""
    model = tiny_decoder(0, scale=0.7)
    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=9, num_candidates=8, student_topk=6, chunk_steps=4)
    free = Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(1))
    eos = int(free.response_tokens[0, 4])  # draws depend only on (key, step): same prefix below
    params = dataclasses.replace(params, stop_token_ids=(eos,))
    batch = Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(1))
    length = int(batch.response_mask[0].sum())
    assert length < 9 and int(batch.response_tokens[0, length - 1]) == eos
    return model, batch


def _hidden(model, batch, prompt_slots=None):
    ids = jnp.concatenate([batch.prompt_tokens, batch.response_tokens], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    p = batch.prompt_tokens.shape[1] if prompt_slots is None else prompt_slots
    return response_aligned(model.hidden_states(ids, attention_mask=mask), p, batch.response_tokens.shape[1])


def _losses(model, batch, cache):
    """Per-token values of each estimator with the student = the sampling model = the teacher."""
    hidden, head = _hidden(model, batch), model.lm_head_weight()
    out = {}
    for name in ESTIMATORS:
        ids = required_ids(name, batch, cache)
        student = student_logprobs(ids, lambda i: gather_logprobs_from_hidden(hidden, head, i, chunk_size=4))
        values, _ = evaluate_estimator(
            EstimatorConfig(name, forward_mc=ForwardMCConfig(control_variate=True)), batch, cache, student
        )
        out[name] = np.asarray(values)
    return out


def test_teacher_equals_student_gives_zero_kl_and_a_shifted_cache_does_not(world):
    model, batch = world
    params = ScoringParams(topk=6, num_samples=8, chunk_size=4)
    cache = TeacherScorer(model, params).score(batch, jax.random.key(2))
    mask = np.asarray(batch.response_mask)
    for name, values in _losses(model, batch, cache).items():
        np.testing.assert_allclose(values[mask], 0.0, atol=1e-5, err_msg=name)

    # Negative control: teacher rows one position late (row t scores token t + 1's context).
    shifted_hidden = _hidden(model, batch, prompt_slots=batch.prompt_tokens.shape[1] + 1)
    shifted = score_hidden(shifted_hidden, model.lm_head_weight(), batch, jax.random.key(2), params)
    for name, values in _losses(model, batch, shifted).items():
        assert np.abs(values[mask]).mean() > 5e-3, name  # 500× the tolerance above
        assert np.abs(values[:, 0]).max() > 1e-3, name  # the first response token is scored too
        eos_at = int(mask[0].sum()) - 1
        assert abs(values[0, eos_at]) > 1e-4, name  # and so is the final stop token


def test_first_and_last_tokens_are_scored_from_the_right_positions(world):
    model, batch = world
    cache = TeacherScorer(model, ScoringParams(chunk_size=5)).score(batch)
    ids = jnp.concatenate([batch.prompt_tokens, batch.response_tokens], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.response_mask], axis=1)
    logp = np.asarray(jax.nn.log_softmax(model(ids, attention_mask=mask), axis=-1))
    p = batch.prompt_tokens.shape[1]
    tokens, resp_mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
    for row in range(len(PROMPTS)):
        last = int(resp_mask[row].sum()) - 1  # row 0: the stop token
        for t in (0, last):  # first response token: from the last prompt position
            want = logp[row, p - 1 + t, tokens[row, t]]
            np.testing.assert_allclose(cache.token_logp[row, t], want, atol=1e-5)


def test_chunk_size_does_not_change_scores(world):
    model, batch = world
    a = TeacherScorer(model, ScoringParams(topk=3, num_samples=2, chunk_size=2)).score(batch, jax.random.key(3))
    b = TeacherScorer(model, ScoringParams(topk=3, num_samples=2, chunk_size=64)).score(batch, jax.random.key(3))
    for field in ("token_logp", "candidate_logp", "student_topk_logp", "topk_logp"):
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), atol=1e-6, err_msg=field)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_allclose(
        a.sample_logp,
        np.take_along_axis(
            np.asarray(jax.nn.log_softmax(_hidden(model, batch) @ model.lm_head_weight(), axis=-1)),
            np.asarray(a.sample_ids),
            -1,
        ),
        atol=1e-5,
    )


def test_bf16_storage_error_is_within_bf16_rounding(world):
    model, batch = world
    fp32 = TeacherScorer(model, ScoringParams(topk=6, chunk_size=4)).score(batch)
    bf16 = TeacherScorer(model, ScoringParams(topk=6, chunk_size=4, store_dtype="bfloat16")).score(batch)
    assert bf16.topk_logp.dtype == jnp.bfloat16 and bf16.topk_ids.dtype == jnp.int32
    exact, rounded = np.asarray(fp32.topk_logp), np.asarray(bf16.topk_logp, np.float32)
    # bf16 keeps 8 significant bits: round-to-nearest has relative error ≤ 2^-8.
    assert np.all(np.abs(rounded - exact) <= np.abs(exact) * 2.0**-8 + 1e-7)
    assert np.abs(rounded - exact).max() > 0  # it really was rounded


def test_scoring_params_errors():
    with pytest.raises(ValueError, match="scoring.store_dtype = 'float16' is invalid; allowed: float32, bfloat16"):
        ScoringParams(store_dtype="float16")


@pytest.mark.parametrize(
    "data, fsdp, tensor, moe",
    [
        (1, 1, 4, False),
        # the dense teacher on the three-axis mesh in CI's extended step: the mixture of experts'
        # case below splits its dense parts (embeddings, attention) over the same mesh here
        pytest.param(2, 2, 2, False, marks=pytest.mark.extended),
        (1, 8, 1, True),
        (2, 2, 2, True),
    ],
)
def test_a_sharded_teacher_scores_as_one_device_does(data, fsdp, tensor, moe):
    """The teacher's heads, MLP and vocabulary split over ``tensor`` (and its embed
    dimension over ``fsdp``; a mixture of experts' experts over ``fsdp``, expert-parallel),
    rows over what divides them: the same cache (to fp32 rounding)."""
    from asyncopd_jax.config import MeshConfig
    from asyncopd_jax.learner import make_mesh
    from asyncopd_jax.models.decoder import Decoder
    from asyncopd_jax.models.partitioning import mesh_context, parameter_shardings
    from tests.tiny_models import tiny_moe_config

    # 64 ids: the vocabulary divides the tensor axis; 8 experts: they divide the fsdp axis
    config = tiny_moe_config(vocab_size=64, num_experts=8, num_experts_per_tok=2)
    teacher = Decoder(config, rngs=nnx.Rngs(1)) if moe else tiny_decoder(1, vocab=64, scale=0.7)
    graphdef, state = nnx.split(teacher)
    params = SamplingParams(max_new_tokens=7, num_candidates=4, student_topk=3)
    prompts = PROMPTS + [[3, 4]]  # 4 rows
    student_graph, student_state = nnx.split(tiny_decoder(0, vocab=64, scale=0.7))
    batch = Sampler(student_graph, params).generate(student_state, prompts, jax.random.key(2))
    scoring = ScoringParams(topk=5, num_samples=3, chunk_size=4)
    key = jax.random.key(3)
    expected = TeacherScorer(teacher, scoring).score(batch, key)

    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    sharded = nnx.merge(graphdef, jax.device_put(state, parameter_shardings(state, mesh)))
    if moe:  # each device holds 8 / fsdp whole experts
        experts = sharded.layers[0].mlp.experts.up_proj[...]
        assert experts.addressable_shards[0].data.shape[0] == 8 // fsdp
    else:
        kernel = sharded.layers[0].mlp.up_proj.kernel[...]
        assert "tensor" in tuple(kernel.sharding.spec) and kernel.addressable_shards[0].data.shape[1] == 64 // tensor
    with mesh_context(mesh):
        got = TeacherScorer(sharded, scoring).score(batch, key)
    for name in ("token_logp", "candidate_logp", "student_topk_logp", "topk_logp", "sample_logp"):
        np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=1e-5, atol=1e-5, err_msg=name)
    for name in ("topk_ids", "sample_ids"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)


def _pad_responses(batch, t: int):
    """``batch`` with its responses padded (mask off) to ``t`` columns."""
    fields = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if value is not None and not f.name.startswith("prompt_"):
            width = [(0, 0), (0, t - value.shape[1])] + [(0, 0)] * (value.ndim - 2)
            value = jnp.pad(value, width)
        fields[f.name] = value
    return type(batch)(**fields)


def test_the_scoring_stage_scores_only_the_columns_answers_reach():
    """Answers of at most 9 tokens in 64 columns: the stage scores 16 (a power of two, whole
    chunks of 4), and every answer token's scores (teacher samples included) and reference
    log-prob equal scoring all 64; the columns past hold finite copies."""
    model = tiny_decoder(0, scale=0.7)
    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=9, num_candidates=4, student_topk=3)
    batch = _pad_responses(Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(1)), 64)
    teacher = TeacherScorer(tiny_decoder(1, scale=0.7), ScoringParams(topk=3, num_samples=2, chunk_size=4))
    reference = ReferenceScorer(tiny_decoder(2, scale=0.7))
    key = jax.random.key(5)
    whole = teacher.score(batch, key), reference.score(batch)
    widths = []
    score = teacher.score
    teacher.score = lambda b, k: widths.append(b.response_tokens.shape[1]) or score(b, k)  # type: ignore[method-assign]
    result = Scorers({"teacher": teacher}, reference).score(batch, key)
    scored, cache = result.batch, result.cache
    assert widths == [16]
    assert [scored_columns(9, 64, 4), scored_columns(3, 64, 8), scored_columns(9, 12, 16)] == [16, 8, 12]
    mask = np.asarray(batch.response_mask)
    for field in dataclasses.fields(cache):
        got, want = getattr(cache, field.name), getattr(whole[0], field.name)
        if got is None:
            continue
        assert got.shape == want.shape and np.isfinite(np.asarray(got, np.float32)).all(), field.name
        np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5, err_msg=field.name)
    np.testing.assert_allclose(np.asarray(scored.reference_logp)[mask], np.asarray(whole[1])[mask], atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_hidden_payload_is_what_the_teachers_head_reads(world, dtype):
    """``payload: hidden``: the cache also holds the teacher's final hidden states at the
    response positions, in ``hidden_dtype``; the scores are those of ``payload: scores``."""
    model, batch = world
    teacher = tiny_decoder(3, scale=0.9)
    plain = TeacherScorer(teacher, ScoringParams(topk=4, chunk_size=4)).score(batch)
    params = ScoringParams(topk=4, chunk_size=4, payload="hidden", hidden_dtype=dtype)
    cache = TeacherScorer(teacher, params).score(batch)
    want = _hidden(teacher, batch)  # [B, T, H], row t predicts response token t
    assert cache.hidden is not None and cache.hidden.dtype == jnp.dtype(dtype) and cache.hidden.shape == want.shape
    np.testing.assert_allclose(np.asarray(cache.hidden, np.float32), want, rtol=1e-2 if dtype == "bfloat16" else 1e-6)
    assert plain.hidden is None
    for name in ("token_logp", "topk_ids", "topk_logp"):
        np.testing.assert_array_equal(getattr(cache, name), getattr(plain, name))
    with pytest.raises(ValueError, match="scoring.payload = 'logits' is invalid; allowed: scores, hidden"):
        ScoringParams(payload="logits")
