"""Hostile input to ``asyncopd serve-teacher`` and to the client that reads servers' answers.

The server is thrown random and hostile JSON (huge and negative ids, floats and booleans
where ids go, wrong types, deep nesting, huge arrays, ``NaN`` / ``Infinity``): it never
answers 5xx, it answers 200 exactly to the bodies that :func:`documented_status`, a
validator written here from the API the module docstring of
:mod:`asyncopd_jax.teacher.batch_scorer` documents, accepts, and it is healthy after.
The client's parsers, given hostile answers, return checked arrays or raise a
:class:`~asyncopd_jax.teacher.wire.ServerError`, nothing else."""

from __future__ import annotations

import copy
import dataclasses
import json

import httpx2
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncopd_jax.models import from_pretrained
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from asyncopd_jax.teacher.wire import Row, ServerError, parse_asyncopd, parse_vllm
from tests.teacher.test_server import SETTINGS, running

V, CONTEXT = 32, 128  # the shipped teacher's vocabulary and context
LIMITS = dataclasses.replace(SETTINGS, max_body_bytes=1 << 16)
TIMEOUT = httpx2.Timeout(60.0)  # explicit: a loaded machine must not turn a slow answer into a failure
EXTENSION_FIELDS = {
    "response_start",
    "candidate_ids",
    "student_topk_ids",
    "num_samples",
    "seed",
    "hidden",
    "encoding",
    "pad_to",
}


def documented_status(raw: bytes) -> int:
    """200 for a body the documented API accepts, else 400 (the 413 cases included: the
    test asks only that a refused body is not answered 200 or 5xx)."""
    try:
        body = json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, RecursionError):
        return 400
    return 200 if len(raw) <= LIMITS.max_body_bytes and _valid(body) else 400


def _is_id(v) -> bool:
    return type(v) is int and 0 <= v < V


def _int_in(v, low: int, high: int) -> bool:
    return type(v) is int and low <= v <= high


def _valid(body) -> bool:
    if not isinstance(body, dict):
        return False
    if body.get("model") not in (None, LIMITS.model_name):
        return False
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return False
    rows = [prompt] if all(type(v) is int for v in prompt) else prompt
    if len(rows) > LIMITS.max_request_rows:
        return False
    if not all(isinstance(r, list) and 0 < len(r) <= CONTEXT and all(map(_is_id, r)) for r in rows):
        return False
    if not _int_in(body.get("prompt_logprobs"), 0, LIMITS.max_topk):
        return False
    temperature = body.get("temperature")
    if temperature is not None and not (type(temperature) in (int, float) and temperature == LIMITS.temperature):
        return False
    ext = body.get("asyncopd")
    if ext is None:
        return True
    if not isinstance(ext, dict):
        return False
    ext = {k: v for k, v in ext.items() if v is not None}
    if set(ext) - EXTENSION_FIELDS:
        return False
    starts = ext.get("response_start", [1] * len(rows))
    if not (isinstance(starts, list) and len(starts) == len(rows)):
        return False
    if not all(_int_in(s, 1, len(r)) for s, r in zip(starts, rows)):
        return False
    lengths = [len(r) - s for r, s in zip(rows, starts)]
    for field in ("candidate_ids", "student_topk_ids"):
        if field not in ext:
            continue
        per_row = ext[field]
        if not (isinstance(per_row, list) and len(per_row) == len(rows)):
            return False
        widths = set()
        for lists, t in zip(per_row, lengths):
            if not (isinstance(lists, list) and len(lists) == t and t > 0):
                return False
            for ids in lists:
                if not (isinstance(ids, list) and all(map(_is_id, ids))):
                    return False
                widths.add(len(ids))
        if len(widths) != 1 or not 1 <= widths.pop() <= 1024:
            return False
    if not _int_in(ext.get("num_samples", 0), 0, 1024) or not _int_in(ext.get("seed", 0), 0, 2**32 - 1):
        return False
    if ext.get("encoding", "json") not in ("json", "base64", "npy"):
        return False
    if ext.get("hidden") not in (None, "float32", "bfloat16"):
        return False
    pad_to = ext.get("pad_to")
    if pad_to is not None:
        if not (isinstance(pad_to, list) and len(pad_to) == 2 and all(type(w) is int for w in pad_to)):
            return False
        if pad_to[0] < max(starts) or pad_to[1] < max(lengths) or sum(pad_to) > CONTEXT:
            return False
    return True


# --- the bodies -------------------------------------------------------------------------------

ROWS = [[2, 5, 12, 6, 13, 3], [2, 7, 12, 8, 13]]
BASES = [
    {"prompt": ROWS, "prompt_logprobs": 2},
    {
        "model": "teacher",
        "prompt": ROWS,
        "prompt_logprobs": 3,
        "temperature": 1.0,
        "asyncopd": {
            "response_start": [2, 2],
            "candidate_ids": [[[1, 4]] * 4, [[3, 0]] * 3],
            "student_topk_ids": [[[5]] * 4, [[6]] * 3],
            "num_samples": 2,
            "seed": 7,
            "encoding": "base64",
            "pad_to": [4, 4],
        },
    },
    {
        "prompt": ROWS,
        "prompt_logprobs": 1,
        "asyncopd": {"response_start": [3, 1], "hidden": "bfloat16", "encoding": "npy"},
    },
]
#: Where a mutation lands: a field, or an element inside one.
PLACES = [
    ("prompt",),
    ("prompt", 0),
    ("prompt", 0, 2),
    ("prompt", 1, 0),
    ("prompt_logprobs",),
    ("temperature",),
    ("model",),
    ("asyncopd",),
    ("bogus",),
    *(("asyncopd", field) for field in sorted(EXTENSION_FIELDS | {"bogus"})),
    ("asyncopd", "response_start", 0),
    ("asyncopd", "candidate_ids", 0),
    ("asyncopd", "candidate_ids", 0, 1),
    ("asyncopd", "candidate_ids", 1, 2, 0),
    ("asyncopd", "student_topk_ids", 0, 0, 0),
    ("asyncopd", "pad_to", 1),
]
EDGE_INTS = [0, 1, 2, V - 1, V, -1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30]
HOSTILE = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1.5, 1.0, -0.0, True, False, None, "", "1", "base64", "json", "npy", "bfloat16", "teacher"]),
    st.text(max_size=4),
    st.lists(st.integers(-2, V + 2), max_size=6),
    st.lists(st.lists(st.integers(-1, V), max_size=3), max_size=5),
    st.lists(st.sampled_from([0, 1, 1.5, True, None, "x", 2**64]), min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2),
    st.just([0] * 20_000),  # past the body limit
    st.just([[1] * 200]),  # past the context
)


def _has(node, key) -> bool:
    return (isinstance(node, dict) and isinstance(key, str)) or (
        isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)
    )


def _place(body: dict, place: tuple, value) -> None:
    """Set ``body`` at ``place`` to a copy of ``value`` where the path exists (else leave it):
    a copy, so that no value is placed inside itself (``st.just`` draws one object)."""
    value, node = copy.deepcopy(value), body
    for key in place[:-1]:
        if not (_has(node, key) and (isinstance(node, list) or key in node)):
            return
        node = node[key]
    if _has(node, place[-1]):
        node[place[-1]] = value


@st.composite
def hostile_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "random", "deep", "constant"]))
    if kind == "random":
        leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4))
        nest = lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner)  # noqa: E731
        value = draw(st.recursive(leaves, nest))
        return json.dumps(value, allow_nan=True).encode()
    body = copy.deepcopy(draw(st.sampled_from(BASES)))
    if kind == "deep":
        depth = draw(st.sampled_from([50, 5_000, 100_000]))
        text = json.dumps(body)
        return text.replace('"prompt_logprobs"', '"x": ' + "[" * depth + "]" * depth + ', "prompt_logprobs"').encode()
    if kind == "constant":
        text = json.dumps(body)
        constant = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        return text.replace('"prompt_logprobs": ', f'"temperature": {constant}, "prompt_logprobs": ').encode()
    for _ in range(draw(st.integers(1, 3))):
        _place(body, draw(st.sampled_from(PLACES)), draw(HOSTILE))
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def limited_server():
    scorer = BatchScorer(from_pretrained(resolve_model_path("builtin:teacher")), LIMITS)
    with running(scorer, LIMITS) as (url, _, _), httpx2.Client(base_url=url, timeout=TIMEOUT) as client:
        yield client


def test_every_documented_base_body_is_scored(limited_server):
    for base in BASES:
        raw = json.dumps(base).encode()
        assert documented_status(raw) == 200
        response = limited_server.post("/v1/completions", content=raw)
        assert response.status_code == 200, response.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=hostile_bodies())
def test_hostile_bodies_are_never_a_5xx_and_200_only_when_documented(limited_server, raw):
    response = limited_server.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (response.status_code, response.text[:300], raw[:300])
    expected = documented_status(raw)
    if expected == 200:
        assert response.status_code == 200, (response.text[:300], raw[:300])
    else:
        assert response.status_code in (400, 413), (response.status_code, raw[:300])
        message = response.json()["error"]["message"]
        assert message and "\n" not in message


#: A value of each hostile kind, put in every place of every base body by the sweep below.
SWEEP = [True, False, 1.5, 2.0, -1, V, 2**63, 2**64, -(2**70), None, "1", [], [[]], {}, {"a": 1}]


def test_every_hostile_value_in_every_place_is_answered_as_documented(limited_server):
    """The sweep that the random bodies above sample: each kind of value in each place."""
    wrong = []
    for base in BASES:
        for place in PLACES:
            for value in SWEEP:
                body = copy.deepcopy(base)
                _place(body, place, value)
                raw = json.dumps(body).encode()
                status = limited_server.post("/v1/completions", content=raw).status_code
                if status >= 500 or (status == 200) != (documented_status(raw) == 200):
                    wrong.append((place, value, status))
    assert not wrong, wrong[:20]


def test_the_server_is_healthy_after_the_hostile_bodies(limited_server):
    assert limited_server.get("/health").json()["status"] == "ok"
    first = limited_server.post("/v1/completions", json=BASES[0]).json()
    again = limited_server.post("/v1/completions", json=BASES[0]).json()
    assert first == again


def test_a_chunked_body_past_the_limit_is_answered_413(limited_server):
    def chunks():  # no content-length: the server counts as it reads
        yield b'{"prompt": [['
        for _ in range(200):
            yield b"1," * 200
        yield b'1]], "prompt_logprobs": 1}'

    response = limited_server.post("/v1/completions", content=chunks())
    assert response.status_code == 413, response.text
    assert f"more than {LIMITS.max_body_bytes} bytes" in response.json()["error"]["message"]


# --- the client's reading of answers ------------------------------------------------------------

SENT = [Row(np.array([2, 5]), np.array([12, 6, 13]), np.array([[1, 4]] * 3), np.array([[5]] * 3))]


def _good_asyncopd() -> dict:
    t = 3
    scores = {
        "token_logprobs": [-0.5] * t,
        "topk_ids": [[1, 2]] * t,
        "topk_logprobs": [[-0.1, -2.0]] * t,
        "candidate_logprobs": [[-1.0, -3.0]] * t,
        "student_topk_logprobs": [[-0.7]] * t,
        "sample_ids": [[3]] * t,
        "sample_logprobs": [[-0.2]] * t,
    }
    return {"choices": [{"index": 0, "asyncopd": scores}]}


def _good_vllm() -> dict:
    positions = [None, {"5": {"logprob": -1.0}}] + [
        {str(tok): {"logprob": -0.5}, "30": {"logprob": -0.1}, "31": {"logprob": -3.0}} for tok in (12, 6, 13)
    ]
    return {"choices": [{"index": 0, "prompt_logprobs": positions}]}


ANSWER_PLACES = [
    ("choices",),
    ("choices", 0),
    ("choices", 0, "index"),
    ("choices", 0, "asyncopd"),
    *(
        ("choices", 0, "asyncopd", key, *rest)
        for key in ("token_logprobs", "topk_ids", "topk_logprobs", "candidate_logprobs", "sample_ids")
        for rest in ((), (0,), (1, 0))
    ),
    ("choices", 0, "prompt_logprobs"),
    ("choices", 0, "prompt_logprobs", 2),
    ("choices", 0, "prompt_logprobs", 2, "12"),
    ("choices", 0, "prompt_logprobs", 3, "6", "logprob"),
    ("choices", 0, "prompt_logprobs", 4, "30"),
]


def _checked(scores) -> None:
    """What a parser returns holds log-probs ≤ 0 (no NaN) and ids in the vocabulary, at the sent shapes."""
    for row in scores:
        assert row.token_logp.shape == (3,) and row.topk_ids.shape == (3, 2)
        for ids in (row.topk_ids, row.sample_ids):
            if ids is not None:
                assert ids.dtype == np.int64 and ((ids >= 0) & (ids < V)).all()
        for logp in (row.token_logp, row.topk_logp, row.candidate_logp, row.student_topk_logp, row.sample_logp):
            if logp is not None:
                assert logp.dtype == np.float64 and not np.isnan(logp).any() and (logp <= 0).all()


@settings(max_examples=300, deadline=None)
@given(
    api=st.sampled_from(["asyncopd", "vllm"]),
    places=st.lists(st.sampled_from(ANSWER_PLACES), min_size=1, max_size=3),
    values=st.lists(HOSTILE, min_size=3, max_size=3),
)
# found by this test (2026-11-28): a string the server sent, newline and all, in the error
@example(api="asyncopd", places=[("choices", 0, "asyncopd")], values=["\n", "\n", "\n"])
def test_the_client_reads_a_hostile_answer_or_names_the_server(api, places, values):
    answer = _good_asyncopd() if api == "asyncopd" else _good_vllm()
    for place, value in zip(places, values):
        _place(answer, place, value)
    try:
        if api == "asyncopd":
            scores = parse_asyncopd(answer, SENT, 2, 1, V, "http://x")
        else:
            scores = parse_vllm(answer, SENT, 2, V, "http://x")
    except ServerError as err:
        assert "http://x" in str(err) and "\n" not in str(err)
    else:
        _checked(scores)


def test_an_answer_with_floats_or_booleans_for_ids_is_refused():
    for bad in (1.5, True, 2.0):
        answer = _good_asyncopd()
        answer["choices"][0]["asyncopd"]["topk_ids"][1] = [bad, 1]
        with pytest.raises(ServerError, match="topk_ids is not \\[3, 2\\] integers"):
            parse_asyncopd(answer, SENT, 2, 1, V, "http://x")


def test_answers_with_rows_out_of_order_or_repeated_are_refused():
    two = [SENT[0], SENT[0]]
    good = _good_asyncopd()["choices"][0]["asyncopd"]
    answers = {
        "repeated": {"choices": [{"index": 0, "asyncopd": good}, {"index": 0, "asyncopd": good}]},
        "a float index": {"choices": [{"index": 0.0, "asyncopd": good}, {"index": 1, "asyncopd": good}]},
    }
    for answer in answers.values():
        with pytest.raises(ServerError, match="choices of index"):
            parse_asyncopd(answer, two, 2, 1, V, "http://x")
    swapped = {"choices": [{"index": 1, "asyncopd": good}, {"index": 0, "asyncopd": good}]}
    assert len(parse_asyncopd(swapped, two, 2, 1, V, "http://x")) == 2


def test_huge_values_are_refused_not_overflowed():
    answer = _good_asyncopd()
    answer["choices"][0]["asyncopd"]["sample_ids"] = [[2**64]] * 3
    with pytest.raises(ServerError, match="sample_ids is not"):
        parse_asyncopd(answer, SENT, 2, 1, V, "http://x")
