"""``asyncopd serve-teacher`` shipping the teacher's hidden states (``asyncopd.hidden``), its
binary answer (``asyncopd.encoding: npy``), and its LM head (``/v1/models``' digest,
``GET /v1/head``): the client's cache equals the in-process scorer's, the binary answer is
the base64 one's numbers exactly, and a learner gets the served head, from the server or a
local copy, only when its digest is the server's."""

from __future__ import annotations

import dataclasses

import httpx2
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.models import from_pretrained, head_digest, read_lm_head
from asyncopd_jax.npz import npz_arrays
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.wire import Row, ServerError, head_card, npz_choices, parse_asyncopd
from tests.teacher.test_server import ROUNDING, SETTINGS, TIMEOUT_S, assert_same_scores, running

TEACHER = resolve_model_path("builtin:teacher")


@pytest.fixture(scope="module")
def teacher():
    return from_pretrained(TEACHER)


@pytest.fixture(scope="module")
def served(teacher):
    scorer = BatchScorer(teacher, SETTINGS)
    with running(scorer) as (url, _, _):
        yield url, scorer


@pytest.fixture(scope="module")
def rollouts():
    """Answers of the student to 5 prompts (one answer cut short by the stop id)."""
    student = from_pretrained(resolve_model_path("builtin:student"))
    graphdef, state = nnx.split(student)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(1,))
    prompts = [[2, 5 + i, 12, 6 + i, 13] for i in range(5)]
    return Sampler(graphdef, params).generate(state, prompts, jax.random.key(1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_hidden_states_equal_the_in_process_scorers(served, teacher, rollouts, dtype):
    """Every field, hidden states included (padded with zeros to the run's width 160, in the
    dtype asked), as the in-process scorer fills it; the answer came as one binary body."""
    url, _ = served
    params = ScoringParams(topk=4, chunk_size=64, payload="hidden", hidden_dtype=dtype, hidden_width=160)
    client = ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=3), params, 32)
    remote, local = client.score(rollouts), TeacherScorer(teacher, params).score(rollouts)
    mask = np.asarray(rollouts.response_mask)
    assert remote.hidden.dtype == jnp.dtype(dtype) and remote.hidden.shape == (*mask.shape, 160)
    got, want = np.asarray(remote.hidden, np.float32)[mask], np.asarray(local.hidden, np.float32)[mask]
    assert not got[:, 128:].any() and np.abs(got[:, :128]).max() > 0.1  # the teacher's 128, then zeros
    # float32: the batch's other shape sums in another order (ROUNDING); bfloat16: that, and a tie
    # of the rounding to 8 bits flips at most one unit in the last place
    tolerance = ROUNDING if dtype == "float32" else 2**-7
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    for field in ("token_logp", "topk_logp"):
        assert_same_scores(np.asarray(getattr(remote, field))[mask], np.asarray(getattr(local, field))[mask])


def _post(url: str, body: dict) -> httpx2.Response:
    response = httpx2.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response


BODY = {
    "prompt": [[2, 5, 12, 6, 13, 7, 8, 9], [2, 6, 12, 7, 13, 9]],
    "prompt_logprobs": 3,
    "asyncopd": {"response_start": [5, 4], "num_samples": 2, "seed": 3, "hidden": "float32"},
}


def test_the_npy_answer_holds_the_base64_answers_numbers_exactly(served):
    url, _ = served
    as_npy = _post(url, {**BODY, "asyncopd": {**BODY["asyncopd"], "encoding": "npy"}})
    as_b64 = _post(url, {**BODY, "asyncopd": {**BODY["asyncopd"], "encoding": "base64"}})
    assert as_npy.headers["content-type"] == "application/octet-stream"
    arrays = npz_arrays(as_npy.content)
    assert sorted(arrays) == sorted(
        f"{i}/{k}"
        for i in range(2)
        for k in ("token_logprobs", "topk_ids", "topk_logprobs", "sample_ids", "sample_logprobs", "hidden_states")
    )
    rows = [Row(np.asarray(p[:s]), np.asarray(p[s:])) for p, s in zip(BODY["prompt"], [5, 4])]
    read = [parse_asyncopd(a, rows, 3, 2, 32, url, 128) for a in (npz_choices(arrays, url), as_b64.json())]
    for npy, b64 in zip(*read):
        for field in dataclasses.fields(npy):
            np.testing.assert_array_equal(getattr(npy, field.name), getattr(b64, field.name), err_msg=field.name)
    assert read[0][1].hidden.shape == (2, 128) and arrays["1/topk_ids"].dtype == np.int32


def test_bfloat16_hidden_states_are_half_the_bytes_of_float32_in_the_npy_answer(served):
    url, _ = served
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        arrays = npz_arrays(
            _post(url, {**BODY, "asyncopd": {**BODY["asyncopd"], "hidden": dtype, "encoding": "npy"}}).content
        )
        assert arrays["0/hidden_states"].dtype == jnp.dtype(dtype)
        sizes[dtype] = arrays["0/hidden_states"].nbytes
    assert sizes == {"float32": 3 * 128 * 4, "bfloat16": 3 * 128 * 2}


def test_the_card_states_the_heads_digest_and_v1_head_serves_that_head(served):
    url, _ = served
    card = head_card(httpx2.get(f"{url}/v1/models", timeout=TIMEOUT_S).json(), url)
    want = read_lm_head(TEACHER, None, "float32")
    assert (card.hidden_size, card.shape, card.dtype) == (128, (128, 32), "float32")
    assert card.sha256 == head_digest(want)
    served_head = npz_arrays(httpx2.get(f"{url}/v1/head", timeout=TIMEOUT_S).content)["head"]
    np.testing.assert_array_equal(served_head, want)


def test_a_learner_gets_the_served_head_only_under_the_servers_digest(served):
    """From the server or from a local copy (``teacher.head_path``): the same head; another
    checkpoint's head, or a head changed in transit, is refused in one line."""
    url, scorer = served
    client = ServedTeacher(ServerParams(url=url, api="asyncopd"), ScoringParams(), 32)
    want = read_lm_head(TEACHER, None, "float32")
    np.testing.assert_array_equal(client.head(), want)
    np.testing.assert_array_equal(client.head(str(TEACHER)), want)
    student = str(resolve_model_path("builtin:student"))
    with pytest.raises(ServerError, match=rf"teacher.head_path {student}: the LM head .* has digest .*a head_path of"):
        client.head(student)
    true_head = scorer.head
    scorer.head = lambda: true_head() + np.float32(1e-6)  # the card keeps the true digest
    try:
        with pytest.raises(ServerError, match=rf"{url}/v1/head: the LM head \[128, 32\] float32 has digest"):
            client.head()
    finally:
        scorer.head = true_head


def test_a_bfloat16_head_digest_is_of_its_bits():
    head = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert head_digest(head.astype(jnp.bfloat16)) != head_digest(head)
    assert head_digest(head.astype(jnp.bfloat16)) == head_digest(head.astype(jnp.bfloat16).copy())
    changed = head.astype(jnp.bfloat16)
    changed[2, 3] = 12  # one value, one bit pattern
    assert head_digest(changed) != head_digest(head.astype(jnp.bfloat16))


@pytest.mark.parametrize(
    "answer, says",
    [
        ({"0/token_logprobs": np.zeros(2, np.float32), "x": np.zeros(1)}, "answered an array named 'x'"),
        ({"0/hidden_states": np.zeros((2, 4), np.float32)}, "hidden_states is not [2, 8] floats"),
        ({"0/hidden_states": np.full((2, 8), np.inf, np.float32)}, "hidden_states holds a value that is not finite"),
        ({"0/hidden_states": np.zeros((2, 8), np.int32)}, "hidden_states is not [2, 8] floats"),
    ],
)
def test_a_bad_binary_answer_is_refused_naming_the_server(answer, says):
    scores = {"0/token_logprobs": np.zeros(2, np.float32), "0/topk_ids": np.zeros((2, 1), np.int32)}
    scores["0/topk_logprobs"] = np.zeros((2, 1), np.float32)
    rows = [Row(np.asarray([2, 3]), np.asarray([4, 5]))]
    with pytest.raises(ServerError, match="http://srv") as refused:
        parse_asyncopd(npz_choices({**scores, **answer}, "http://srv"), rows, 1, 0, 32, "http://srv", 8)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "card",
    [
        {"data": [{"id": "teacher"}]},  # vLLM's card: no head
        {
            "data": [
                {"asyncopd": {"hidden_size": 8, "head": {"shape": [4, 32], "dtype": "float32", "sha256": "0" * 64}}}
            ]
        },
        {"data": [{"asyncopd": {"hidden_size": 8, "head": {"shape": [8, 32], "dtype": "float32", "sha256": "no"}}}]},
    ],
)
def test_a_card_without_a_consistent_head_is_refused(card):
    with pytest.raises(ServerError, match="teacher server http://srv/v1/models"):
        head_card(card, "http://srv")
