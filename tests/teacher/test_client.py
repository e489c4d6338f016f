"""The served-teacher client against a fake vLLM on a mock transport: what it asks, how it
reads the answer (checked against a NumPy teacher), its retries, its errors, its start-up
determinism check, and the config's refusals of what a served teacher cannot score.

The answers follow vLLM's documented ``/v1/completions`` ``prompt_logprobs`` format
(``asyncopd_jax/teacher/wire.py``); ``tests/teacher/test_vllm_server.py`` checks the same
client against a real vLLM server.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading

import httpx2
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import ConfigError, load_config
from asyncopd_jax.teacher import ScoringParams, wire
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.wire import ServerError

V = 32
URL = "http://teacher.test:8000"
# Rows of different prompt and answer lengths (left-padded prompts, right-padded answers).
PROMPTS = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12], [13, 14]]
ANSWERS = [[20, 21, 1], [22, 1], [23], [24, 25, 26, 27], [28, 29]]
T = 5


def oracle_logp(sequence: list[int]) -> np.ndarray:
    """``[len, V]`` the NumPy teacher: position i's log-probs (of token i given the tokens
    before it) depend on token i − 1 and on i; row 0 is unused (vLLM answers None there)."""
    table = np.sin(np.arange(V * V, dtype=np.float64).reshape(V, V) * 0.37) * 3.0
    out = np.zeros((len(sequence), V))
    for i in range(1, len(sequence)):
        logits = table[sequence[i - 1]] + 0.05 * i * np.cos(np.arange(V))
        out[i] = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    return out


def vllm_answer(body: dict, noise: float = 0.0) -> dict:
    """What vLLM answers ``body``: per row, None then ``{"<id>": {"logprob", "rank"}}`` with
    the top-K and the actual token."""
    k = body["prompt_logprobs"]
    choices = []
    for index, sequence in enumerate(body["prompt"]):
        logp = oracle_logp(sequence) + noise
        entries: list = [None]
        for i in range(1, len(sequence)):
            order = np.argsort(-logp[i], kind="stable")
            rank = {int(t): r + 1 for r, t in enumerate(order)}
            keep = [int(t) for t in order[:k]] + [sequence[i]]
            entries.append(
                {str(t): {"logprob": float(logp[i, t]), "rank": rank[t], "decoded_token": "x"} for t in keep}
            )
        choices.append({"index": index, "text": "", "prompt_logprobs": entries, "finish_reason": "length"})
    return {"id": "cmpl-1", "object": "text_completion", "model": "teacher", "choices": choices[::-1]}


def batch() -> RolloutBatch:
    p = max(map(len, PROMPTS))
    prompt = np.array([[0] * (p - len(x)) + x for x in PROMPTS], np.int32)
    response = np.array([x + [0] * (T - len(x)) for x in ANSWERS], np.int32)
    mask = np.array([[j < len(x) for j in range(T)] for x in ANSWERS])
    return RolloutBatch(
        prompt_tokens=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != 0),
        response_tokens=jnp.asarray(response),
        response_mask=jnp.asarray(mask),
        behavior_logp=jnp.zeros((len(PROMPTS), T)),
        token_version=jnp.zeros((len(PROMPTS), T), jnp.int32),
    )


class FakeServer:
    """A mock transport's handler: answers ``/v1/models`` and ``/v1/completions`` as vLLM,
    after the failures it is told to give, and records what it was asked."""

    def __init__(self, failures=(), noise_on_call: int | None = None, answer=vllm_answer, models=("teacher",)):
        self.failures = list(failures)  # each: an exception to raise or an httpx2.Response to return
        self.noise_on_call, self.answer, self.models = noise_on_call, answer, models
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        with self.lock:
            failure = self.failures.pop(0) if self.failures else None
        if isinstance(failure, Exception):
            raise failure
        if failure is not None:
            return failure
        if request.url.path == "/v1/models":
            return httpx2.Response(200, json={"object": "list", "data": [{"id": m} for m in self.models]})
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
            call = len(self.bodies)
        noise = 1e-2 if call == self.noise_on_call else 0.0
        return httpx2.Response(200, json=self.answer(body, noise) if noise else self.answer(body))


class FakeClock:
    """Time that passes only when the client sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def served(server: FakeServer, clock: FakeClock | None = None, topk: int = 4, **settings) -> ServedTeacher:
    settings = {"url": URL, "rows_per_request": 2, "in_flight": 3, "determinism_tolerance": -1.0, **settings}
    clock = clock or FakeClock()
    return ServedTeacher(
        ServerParams(**settings),
        ScoringParams(topk=topk),
        V,
        client=httpx2.Client(transport=httpx2.MockTransport(server)),
        sleep=clock.sleep,
        clock=clock,
    )


def test_the_cache_equals_the_numpy_teacher_at_each_response_position():
    server = FakeServer()
    cache = served(server, topk=4).score(batch())
    assert [len(b["prompt"]) for b in server.bodies] in ([2, 2, 1], [2, 1, 2], [1, 2, 2])  # 5 rows, 2 a request
    assert sorted(s for b in server.bodies for s in b["prompt"]) == sorted(p + a for p, a in zip(PROMPTS, ANSWERS))
    assert all(b["prompt_logprobs"] == 4 and b["model"] == "teacher" for b in server.bodies)
    for row, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        logp = oracle_logp(prompt + answer)[len(prompt) :]  # [t, V]: response position t's distribution
        t = len(answer)
        want_token = logp[np.arange(t), answer]
        want_ids = np.argsort(-logp, axis=1, kind="stable")[:, :4]
        np.testing.assert_allclose(cache.token_logp[row, :t], want_token, rtol=1e-6)
        np.testing.assert_array_equal(cache.topk_ids[row, :t], want_ids)
        np.testing.assert_allclose(cache.topk_logp[row, :t], np.take_along_axis(logp, want_ids, 1), rtol=1e-6)
        # past the answer's end: its last position repeated (finite values the mask leaves out)
        np.testing.assert_array_equal(cache.token_logp[row, t:], np.full(T - t, cache.token_logp[row, t - 1]))
        np.testing.assert_array_equal(cache.topk_ids[row, t:], np.broadcast_to(cache.topk_ids[row, t - 1], (T - t, 4)))
    assert cache.token_logp.dtype == np.float32 and cache.topk_ids.dtype == np.int32


def test_rows_per_request_defaults_to_serve_teachers_batch_and_to_8_for_vllm_and_sglang():
    """serve-teacher gets a group of up to its batch in one request (scored at the group's
    widths, the same numbers every run); vLLM / SGLang the reference's 8; a setting wins."""
    assert ServerParams(url=URL, api="asyncopd").request_rows == wire.BATCH_ROWS == 64
    assert ServerParams(url=URL, api="vllm").request_rows == 8
    assert ServerParams(url=URL, api="sglang").request_rows == 8
    assert ServerParams(url=URL, api="asyncopd", rows_per_request=3).request_rows == 3
    server = FakeServer()
    served(server, rows_per_request=None, api="vllm").score(batch())
    assert [len(b["prompt"]) for b in server.bodies] == [5]  # 5 rows ≤ 8: one request


def test_no_topk_asks_for_the_actual_tokens_only_and_bf16_storage_is_honoured():
    server = FakeServer()
    teacher = ServedTeacher(
        ServerParams(url=URL, determinism_tolerance=-1.0),
        ScoringParams(topk=0, store_dtype="bfloat16"),
        V,
        client=httpx2.Client(transport=httpx2.MockTransport(server)),
    )
    cache = teacher.score(batch())
    assert server.bodies[0]["prompt_logprobs"] == 0 and cache.topk_ids is None
    assert cache.token_logp.dtype == jnp.bfloat16


def test_requests_are_in_flight_at_once():
    """Three requests must be inside the server together to pass its barrier: a client that
    sent them one after another would time out there."""
    barrier = threading.Barrier(3, timeout=20)

    def answer(body, noise=0.0):
        barrier.wait()
        return vllm_answer(body, noise)

    served(FakeServer(answer=answer), in_flight=3).score(batch())


def test_a_server_that_fails_for_a_while_is_retried_with_backoff_and_retry_after():
    refused = httpx2.ConnectError("connection refused")
    busy = httpx2.Response(503, headers={"Retry-After": "7"}, json={"error": {"message": "queue full"}})
    server = FakeServer(failures=[refused, httpx2.ReadTimeout("slow"), busy, httpx2.Response(500, text="oops")])
    clock = FakeClock()
    teacher = served(server, clock, rows_per_request=8, in_flight=1, backoff=0.5)
    teacher._random = random.Random(5)
    draws = random.Random(5)
    teacher.score(batch())
    assert len(server.bodies) == 1
    assert teacher.stats.retries == 4 and teacher.stats.requests == 2  # /v1/models + one scoring
    # full jitter on a doubling scale (0.5, 1, 2, 4 s), but the 503's Retry-After (7 s) as said
    want = [0.5 * draws.random(), 1.0 * draws.random(), 7.0, 4.0 * draws.random()]
    assert clock.sleeps == pytest.approx(want)
    assert teacher.stats.wait_s == pytest.approx(sum(want))


@pytest.mark.parametrize(
    ("failure", "last"),
    [
        (httpx2.ConnectError("connection refused"), "ConnectError: connection refused"),
        (httpx2.Response(500, json={"error": {"message": "engine dead"}}), "HTTP 500: engine dead"),
        (httpx2.Response(503, headers={"Retry-After": "4"}, text="busy"), "HTTP 503: busy"),
    ],
)
def test_a_server_that_stays_down_or_failing_stops_the_run_with_one_line_naming_it(failure, last):
    server = FakeServer(failures=[failure] * 1000)
    clock = FakeClock()
    with pytest.raises(ServerError) as err:
        served(server, clock, give_up_after=30.0).score(batch())
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"teacher server {URL} failed /v1/models for 30 s")
    assert message.endswith(f"(teacher.server.give_up_after = 30); last: {last}")
    assert clock.now == pytest.approx(30.0)  # waited exactly the allowance, not a backoff past it


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (
            httpx2.Response(400, json={"error": {"message": "prompt too long"}}),
            "refused the request: HTTP 400: prompt too long",
        ),
        (httpx2.Response(200, content=b"{not json"), "answered with malformed JSON"),
        (httpx2.Response(200, json={"object": "list"}), "not a model list"),
    ],
)
def test_a_refused_or_garbled_answer_is_one_line_and_not_retried(failure, expected):
    server = FakeServer(failures=[failure])
    teacher = served(server)
    with pytest.raises(ServerError, match=expected) as err:
        teacher.score(batch())
    assert "\n" not in str(err.value) and URL in str(err.value)
    assert teacher.stats.retries == 0


def _garbled(change):
    def answer(body, noise=0.0):
        out = vllm_answer(body, noise)
        change(out)
        return out

    return answer


def _drop_position(out):
    out["choices"][0]["prompt_logprobs"].pop()


def _fewer_ids(out):
    entries = out["choices"][0]["prompt_logprobs"]
    entries[-1] = dict(list(entries[-1].items())[-2:])


def _without_actual_token(out):
    choice = sorted(out["choices"], key=lambda c: c["index"])[0]
    entries = choice["prompt_logprobs"]
    entries[-1] = dict(list(entries[-1].items())[:4]) if len(entries[-1]) > 4 else {"31": {"logprob": -9.0}}


def _positive(out):
    entry = out["choices"][0]["prompt_logprobs"][-1]
    next(iter(entry.values()))["logprob"] = 0.5


def _outside_vocabulary(out):
    entry = out["choices"][0]["prompt_logprobs"][-1]
    entry[str(V + 3)] = {"logprob": -20.0, "rank": 99}


def _row_missing(out):
    out["choices"].pop()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_drop_position, r"prompt_logprobs has \d+ positions; expected \d+ \(prompt \+ response\)"),
        (_fewer_ids, r"2 log-probs; asked for the top 4 \(K smaller than asked\)"),
        (_without_actual_token, "no log-prob for the actual token"),
        (_positive, r"log-prob 0.5 of id \d+ is not a log-prob"),
        (_outside_vocabulary, r"id 35 is outside the student's vocabulary \(0-31\)"),
        (_row_missing, "answered 1 rows for the 2 sent"),
    ],
)
def test_an_answer_that_is_not_what_was_asked_names_the_server_row_and_position(change, expected):
    with pytest.raises(ServerError, match=expected) as err:
        served(FakeServer(answer=_garbled(change)), in_flight=1).score(batch())
    assert "\n" not in str(err.value) and f"teacher server {URL}/v1/completions" in str(err.value)


def test_the_first_batch_is_scored_twice_and_a_nondeterministic_server_refused():
    with pytest.raises(ServerError, match=r"is not deterministic: .* differ by 0.01 in log-prob") as err:
        served(FakeServer(noise_on_call=4), rows_per_request=2, determinism_tolerance=1e-3).score(batch())
    assert "\n" not in str(err.value)
    server = FakeServer()
    teacher = served(server, rows_per_request=8, determinism_tolerance=1e-3)
    teacher.score(batch())
    teacher.score(batch())
    assert len(server.bodies) == 3  # the check's second scoring, then one a batch
    unchecked = FakeServer()
    served(unchecked, rows_per_request=8, determinism_tolerance=-1.0).score(batch())
    assert len(unchecked.bodies) == 1


def test_the_model_is_asked_of_the_server_unless_named():
    named = FakeServer(models=("a", "b"))
    served(named, model="b").score(batch())
    assert {b["model"] for b in named.bodies} == {"b"}
    with pytest.raises(ServerError, match=r"serves 2 models \(a, b\); name one in teacher.server.model"):
        served(FakeServer(models=("a", "b"))).score(batch())


# --- the config ---------------------------------------------------------------------------------

SERVED = ["teacher.path=''", f"teacher.server.url={URL}"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["estimator.name=reverse_kl_mc", "teacher.server.api=sglang"],
            "estimator.name = 'reverse_kl_mc' needs TeacherScoreCache.candidate_logp (the teacher's log-probs of "
            "RolloutBatch.candidate_ids), which a teacher.server.api = sglang teacher cannot score; allowed: an "
            "in-process teacher (teacher.path) or one of ",
        ),
        (
            ["estimator.name=forward_kl_topk", "scoring.topk=8", "scoring.num_samples=2"],
            "scoring.num_samples = 2 is invalid with teacher.server.api = vllm",
        ),
        (
            ["estimator.name=forward_kl_topk", "scoring.topk=8", "scoring.temperature=0.7"],
            "scoring.temperature = 0.7 is invalid with teacher.server.api = vllm",
        ),
        (
            ["estimator.name=forward_kl_topk", "scoring.topk=8", "teacher.path=builtin:teacher"],
            "teacher.path = 'builtin:teacher' and teacher.server.url = 'http://teacher.test:8000' are both set",
        ),
        (
            ["estimator.name=forward_kl_topk", "scoring.topk=8", "train.diagnostics_every=5"],
            "train.diagnostics_every = 5 needs one in-process teacher (teacher.path)",
        ),
        (["teacher.server.url=teacher:8000"], "teacher.server.url = 'teacher:8000' is invalid; allowed: http://"),
        (["teacher.server.in_flight=0"], "teacher.server.in_flight must be >= 1, got 0"),
    ],
)
def test_the_config_refuses_what_a_served_teacher_cannot_do(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("demo", [*SERVED, *overrides])
    assert expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_the_estimators_a_vllm_teacher_serves_are_accepted_and_listed():
    cfg = load_config("demo", [*SERVED, "estimator.name=forward_kl_topk", "scoring.topk=8"])
    assert cfg.teacher.served and cfg.teacher.server.url == URL
    # the student's ids: accepted here, the server's start-up probe decides (below)
    mc = load_config("demo", [*SERVED, "estimator.name=reverse_kl_mc", "sampling.num_candidates=4"])
    assert mc.teacher.server.may_serve > mc.teacher.server.serves
    with pytest.raises(ConfigError, match="sample_logp .* which a teacher.server.api = vllm teacher cannot score"):
        load_config("demo", [*SERVED, "estimator.name=forward_kl_mc", "scoring.num_samples=4"])


def test_the_docs_list_the_estimators_a_vllm_teacher_serves():
    """docs/teachers.md's table of teachers names what the config accepts, no more, no less."""
    from pathlib import Path

    from asyncopd_jax.estimator_registry import ESTIMATORS
    from asyncopd_jax.teacher.client import SERVES

    page = (Path(__file__).resolve().parents[2] / "docs" / "teachers.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| vLLM |"))
    listed = set(re.findall(r"`([a-z0-9_]+)`", row.split("the estimators that read only those:")[1]))
    servable = {
        n for n, spec in ESTIMATORS.items() if set(spec.needs) <= SERVES["vllm"] and not spec.needs_teacher_hidden
    }
    assert listed == servable


# --- SGLang's native /generate (its documented format: asyncopd_jax/teacher/wire.py) -------------


def sglang_answer(body: dict, noise: float = 0.0) -> list:
    """What SGLang answers ``body``: per row, ``meta_info.input_token_logprobs`` (one
    ``[logprob, id, text]`` per input position, logprob None at 0) and ``input_top_logprobs``
    (None at 0, then the top-K entries, best first)."""
    assert body["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0} and body["logprob_start_len"] == 0
    k = body["top_logprobs_num"]
    out = []
    for sequence in body["input_ids"]:
        logp = oracle_logp(sequence) + noise
        tokens: list = [[None, sequence[0], None]]
        tops: list = [None]
        for i in range(1, len(sequence)):
            tokens.append([float(logp[i, sequence[i]]), sequence[i], None])
            order = np.argsort(-logp[i], kind="stable")[:k]
            tops.append([[float(logp[i, t]), int(t), None] for t in order])
        meta = {"input_token_logprobs": tokens, "input_top_logprobs": tops, "output_token_logprobs": []}
        out.append({"text": "", "output_ids": [], "meta_info": meta})
    return out


def sglang(server: FakeServer, topk: int = 4) -> ServedTeacher:
    return served(server, topk=topk, api="sglang")


def test_sglang_scores_every_row_prefill_only_and_fills_the_cache_as_vllm():
    server = FakeServer(answer=sglang_answer)
    cache = sglang(server).score(batch())
    assert [len(b["input_ids"]) for b in server.bodies] in ([2, 2, 1], [2, 1, 2], [1, 2, 2])  # no /v1/models
    want = served(FakeServer(), topk=4).score(batch())  # the vLLM dialect, same NumPy teacher
    for field in ("token_logp", "topk_ids", "topk_logp"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, field)), np.asarray(getattr(want, field)), field)


def _garble(how: str):
    def answer(body, noise=0.0):
        out = sglang_answer(body)
        meta = out[0]["meta_info"]
        if how == "rows":
            return out[:-1]
        if how == "positions":
            meta["input_top_logprobs"] = meta["input_top_logprobs"][:-1]
        if how == "token":
            meta["input_token_logprobs"][-1][1] += 1
        if how == "k":
            meta["input_top_logprobs"][-1] = meta["input_top_logprobs"][-1][:2]
        if how == "positive":
            meta["input_token_logprobs"][-1][0] = 0.5
        if how == "no meta":
            del out[0]["meta_info"]
        return out

    return answer


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("rows", r"/generate answered 1 rows; expected a list of the 2 rows sent$"),
        ("positions", r"/generate, row 0: input_top_logprobs has \d+ positions; expected \d+ \(prompt \+ response\)$"),
        ("token", r"/generate, row 0, response position \d: input_token_logprobs names id \[\d+\], not the token \d+$"),
        ("k", r"/generate, row 0, response position \d: 2 log-probs; asked for the top 4 \(K smaller than asked\)$"),
        ("positive", r"/generate, row 0, response position \d: log-prob 0.5 of id \d+ is not a log-prob"),
        ("no meta", r"/generate, row 0: no meta_info.input_token_logprobs / input_top_logprobs$"),
    ],
)
def test_sglang_answers_that_are_not_what_was_asked_are_one_line_naming_row_and_position(how, expected):
    with pytest.raises(ServerError, match=rf"^teacher server {URL}{expected}") as err:
        sglang(FakeServer(answer=_garble(how))).score(batch())
    assert "\n" not in str(err.value)


def test_sglang_serves_what_vllm_serves_and_no_more():
    served_sglang = ["teacher.path=''", f"teacher.server.url={URL}", "teacher.server.api=sglang"]
    cfg = load_config("demo", served_sglang)
    assert cfg.teacher.server.api == "sglang"
    with pytest.raises(ConfigError, match=r"teacher.server.api = sglang teacher cannot score"):
        load_config("demo", [*served_sglang, "estimator.name=reverse_kl_mc", "sampling.num_candidates=4"])
    with pytest.raises(ConfigError, match=r"^scoring.temperature = 0.7 is invalid with teacher.server.api = sglang"):
        load_config("demo", [*served_sglang, "scoring.temperature=0.7"])
    # serve-teacher scores at its own temperature: the run's is sent, the server refuses another
    asyncopd = load_config("demo", [*SERVED, "teacher.server.api=asyncopd", "scoring.temperature=0.7"])
    assert asyncopd.scoring.temperature == 0.7


def _one_value_changed(answer: dict, row: int) -> dict:
    """``answer`` with the actual token's log-prob at the last position of row ``row`` lowered
    by 0.002."""
    positions = next(c for c in answer["choices"] if c["index"] == row)["prompt_logprobs"]
    entry = positions[-1][next(iter(positions[-1]))]
    entry["logprob"] -= 2e-3
    return answer


@pytest.mark.parametrize("row", [0, len(PROMPTS) - 1])
def test_one_value_of_one_row_changed_on_the_second_scoring_is_refused(row):
    """The start-up check compares every value of every row: the largest difference, not a
    mean or the first row, is held to the tolerance."""

    def answer(body: dict, noise: float = 0.0) -> dict:
        return _one_value_changed(vllm_answer(body), row) if noise else vllm_answer(body)

    server = FakeServer(answer=answer, noise_on_call=2)
    with pytest.raises(ServerError, match=r"is not deterministic: .* differ by 0.002 in log-prob"):
        served(server, rows_per_request=8, determinism_tolerance=1e-3).score(batch())


@settings(max_examples=200, deadline=None)
@given(
    t=st.integers(1, 6),
    field=st.sampled_from(["token_logp", "topk_logp", "candidate_logp", "student_topk_logp"]),
    where=st.integers(0, 10**6),
    change=st.floats(1e-6, 5.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_difference_of_two_scorings_is_their_largest_change(t, field, where, change, seed):
    rng = np.random.default_rng(seed)
    a = wire.RowScores(
        token_logp=-rng.random(t),
        topk_ids=rng.integers(0, 9, (t, 3)),
        topk_logp=-rng.random((t, 3)),
        candidate_logp=-rng.random((t, 2)),
        student_topk_logp=-rng.random((t, 4)),
    )
    values = getattr(a, field).copy()
    values.flat[where % values.size] -= change
    b = dataclasses.replace(a, **{field: values})
    assert wire.difference(a, b) == pytest.approx(change, rel=1e-9)
    assert wire.difference(b, a) == pytest.approx(change, rel=1e-9)
    assert wire.difference(a, a) == 0.0


# --- vLLM's per-position ids (prompt_logprob_token_ids) ---------------------------------------

#: What a vLLM without per-position id scoring answered, before the config's refusal moved to
#: the start-up probe (the config cannot know the server).
MC_REFUSAL = (
    "estimator.name = 'reverse_kl_mc' needs TeacherScoreCache.candidate_logp (the teacher's log-probs of "
    "RolloutBatch.candidate_ids), which a teacher.server.api = vllm teacher cannot score; allowed: an "
    "in-process teacher (teacher.path) or one of "
)


def _with_student_ids(b: RolloutBatch) -> RolloutBatch:
    """``b`` with 3 candidates and the student's top-2 at each position."""
    rng = np.random.default_rng(0)
    candidates, topk = rng.integers(0, V, (len(PROMPTS), T, 3)), rng.integers(0, V, (len(PROMPTS), T, 2))
    return dataclasses.replace(
        b,
        candidate_ids=jnp.asarray(candidates, jnp.int32),
        candidate_behavior_logp=jnp.zeros(candidates.shape),
        student_topk_ids=jnp.asarray(topk, jnp.int32),
        student_topk_behavior_logp=jnp.zeros(topk.shape),
    )


def test_vllm_scores_the_students_ids_per_position_one_request_a_row():
    """A vLLM with ``prompt_logprob_token_ids`` (a fake written from its documented format:
    ``tests/teacher/test_vllm_candidates.py``): the probe passes, and every row's candidates,
    top-K, token and teacher top-K equal the NumPy teacher's."""
    from tests.teacher.test_vllm_candidates import answer as generate_answer

    server = FakeServer(answer=generate_answer)
    teacher = served(server, topk=4, api="vllm", model="teacher")
    teacher.probe_ids(1 + 3 + 2)
    rollouts = _with_student_ids(batch())
    cache = teacher.score(rollouts)
    assert sum("token_ids" in body for body in server.bodies) == 1 + len(PROMPTS)  # the probe, then a row each
    for i, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS)):
        logp = oracle_logp(prompt + answer)[len(prompt) :]  # [t, V]: response position k's
        t = np.arange(len(answer))[:, None]
        for ids, scores in (
            (rollouts.candidate_ids, cache.candidate_logp),
            (rollouts.student_topk_ids, cache.student_topk_logp),
        ):
            np.testing.assert_allclose(
                np.asarray(scores)[i, : len(answer)], logp[t, np.asarray(ids)[i, : len(answer)]], atol=1e-6
            )
        np.testing.assert_allclose(np.asarray(cache.token_logp)[i, : len(answer)], logp[t[:, 0], answer], atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(cache.topk_logp)[i, : len(answer)], -np.sort(-logp, axis=1)[:, :4], atol=1e-6
        )


@pytest.mark.parametrize(
    "failure, says",
    [
        (httpx2.Response(404, json={"detail": "Not Found"}), "refused the request: HTTP 404: Not Found"),
        (httpx2.Response(403, json={"error": {"message": "Scale-out endpoints are disabled"}}), "HTTP 403"),
        (httpx2.Response(200, json={"choices": []}), "answered no prompt_token_id_logprobs"),
    ],
)
def test_a_vllm_that_cannot_score_the_students_ids_is_refused_at_start_up_as_the_config_was(failure, says):
    from asyncopd_jax.pipeline.scoring_stage import probe_ids

    cfg = load_config("demo", [*SERVED, "estimator.name=reverse_kl_mc", "sampling.num_candidates=4"])
    teacher = served(FakeServer(failures=[failure]), api="vllm", model="teacher")
    with pytest.raises(ConfigError) as refused:
        probe_ids(cfg, cfg.teacher, teacher)
    message = str(refused.value)
    assert message.startswith(MC_REFUSAL) and "; its start-up probe: teacher server" in message, message
    usable = message.split("or one of ")[1].split("; its start-up probe")[0].split(", ")
    assert "forward_kl_topk" in usable and "reverse_kl_mc" not in usable and "reverse_kl_topk" not in usable
    assert says in message and "serve it with VLLM_USE_V2_MODEL_RUNNER=1 and vllm serve --enable-scale-out" in message
    assert "--max-logprobs 5 " in message  # the token and 4 candidates a position


def test_a_run_with_a_vllm_that_cannot_score_the_students_ids_stops_at_start_up(tmp_path):
    """The probe is wired into the scoring stage: a whole run's start against a server on
    loopback that has no ``/inference/v1/generate`` (vLLM started without
    ``--enable-scale-out``) stops with the refusal, before any step."""
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from asyncopd_jax.pipeline.trainer import Trainer
    from tests.teacher.vllm_server import free_port

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": "teacher"}]})

    port = free_port()
    app = Starlette(routes=[Route("/v1/models", models)])  # everything else: 404 {"detail": "Not Found"}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    sets = ["teacher.path=''", f"teacher.server.url={url}", "estimator.name=reverse_kl_mc", "sampling.num_candidates=4"]
    cfg = load_config("demo", [*sets, f"output_dir={tmp_path}", "train.steps=2"])
    try:
        with pytest.raises(ConfigError, match=rf"^{re.escape(MC_REFUSAL)}.*; its start-up probe: teacher server {url}"):
            Trainer(cfg, progress=False).run()
    finally:
        server.should_exit = True
        thread.join(30)
    assert not list(tmp_path.glob("*/metrics.jsonl")) or not (tmp_path / "demo" / "metrics.jsonl").read_text()
