"""``asyncopd serve-teacher`` on loopback (uvicorn in a thread of the test): its scores equal
the in-process scorer's for every field of the cache, concurrent requests are batched,
bad and oversized requests are refused in one line, a full queue answers 503, a slow server
is retried by the client, and shutdown answers the requests in flight."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import threading
import time

import httpx2
import jax
import numpy as np
import pytest
import uvicorn
from flax import nnx

from asyncopd_jax.models import from_pretrained
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from asyncopd_jax.teacher.batch_scorer import BatchScorer, ServerSettings, parse_request
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.server import make_app
from asyncopd_jax.teacher.wire import ServerError
from tests.teacher.vllm_server import free_port

#: Every request a test sends waits this long at most: explicit, so that a loaded machine
#: (a scoring compile, another job on the cores) never fails a test by httpx's 5 s default.
TIMEOUT_S = 120


def post(url: str, **kwargs) -> httpx2.Response:
    return httpx2.post(url, timeout=TIMEOUT_S, **kwargs)


#: How far two scorings of the same row may differ when the server batched it with other
#: rows: another batch shape is another compiled program, which sums the same float32 terms
#: (hidden 128, vocabulary 32, 4 layers) in another order. The rounding seen is ~1.5e-5 at
#: most; 2^-13 (1.2e-4, relative above 1) bounds it with room, and a wrong row or position
#: differs by more than 1e-2.
ROUNDING = 2**-13


def assert_same_scores(got, want, **kwargs) -> None:
    np.testing.assert_allclose(got, want, rtol=ROUNDING, atol=ROUNDING, **kwargs)


SETTINGS = ServerSettings(max_topk=8, max_rows=8, max_wait_ms=20, queue_rows=12, max_request_rows=8)


@contextlib.contextmanager
def running(scorer: BatchScorer, settings: ServerSettings = SETTINGS, trees=None):
    """The app on a free loopback port, served by uvicorn in a thread; yields (url, app, server)."""
    app = make_app(scorer, settings, trees)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app, server
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def teacher():
    return from_pretrained(resolve_model_path("builtin:teacher"))


@pytest.fixture(scope="module")
def served_teacher(teacher):
    with running(BatchScorer(teacher, SETTINGS)) as (url, app, _):
        yield url, app


@pytest.fixture(scope="module")
def rollouts():
    """Answers of the student to 6 prompts, with 3 candidates and the student's top-2 per position."""
    student = from_pretrained(resolve_model_path("builtin:student"))
    graphdef, state = nnx.split(student)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, num_candidates=3, student_topk=2, stop_token_ids=(1,))
    prompts = [[2, 5 + i, 12, 6 + i, 13] for i in range(6)]
    return Sampler(graphdef, params).generate(state, prompts, jax.random.key(0))


def _served_equals_in_process(url: str, teacher, rollouts) -> None:
    """The server at ``url`` fills every field of the cache as ``teacher`` in process does."""
    params = ScoringParams(topk=8, chunk_size=64)
    remote = ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=4), params, 32).score(rollouts)
    local = TeacherScorer(teacher, params).score(rollouts)
    mask = np.asarray(rollouts.response_mask)
    for field in ("token_logp", "topk_logp", "candidate_logp", "student_topk_logp"):
        got, want = np.asarray(getattr(remote, field))[mask], np.asarray(getattr(local, field))[mask]
        assert_same_scores(got, want, err_msg=field)
    np.testing.assert_array_equal(np.asarray(remote.topk_ids)[mask], np.asarray(local.topk_ids)[mask])


def test_every_field_equals_the_in_process_scorer(served_teacher, teacher, rollouts):
    _served_equals_in_process(served_teacher[0], teacher, rollouts)


def test_the_clients_default_request_holds_no_more_rows_than_the_server_takes(teacher, rollouts):
    """A server started with --max-request-rows 4 states it in its /v1/models card; a client
    at the default request size (64 rows) sends the 6 rows as two requests, not one that
    the server answers 413. A size set explicitly is sent as set (and refused by name)."""
    settings = dataclasses.replace(SETTINGS, max_request_rows=4)
    params = ScoringParams(topk=8, chunk_size=64)
    with running(BatchScorer(teacher, settings), settings) as (url, _, _):
        client = ServedTeacher(ServerParams(url=url, api="asyncopd", determinism_tolerance=-1.0), params, 32)
        remote = client.score(rollouts)
        assert client.last_requests == 2
        with pytest.raises(ServerError, match="HTTP 413: 6 prompts in one request; at most 4"):
            ServedTeacher(ServerParams(url=url, api="asyncopd", rows_per_request=6), params, 32).score(rollouts)
    mask = np.asarray(rollouts.response_mask)
    local = TeacherScorer(teacher, params).score(rollouts)
    assert_same_scores(np.asarray(remote.token_logp)[mask], np.asarray(local.token_logp)[mask])


def test_teacher_samples_are_scored_by_the_teacher(served_teacher, rollouts):
    """The ids the server samples carry their own log-probs: scored again as candidates they
    give the same values; and they follow the teacher (its top id is drawn most)."""
    url, _ = served_teacher
    sampled = ServedTeacher(ServerParams(url=url, api="asyncopd"), ScoringParams(topk=1, num_samples=4), 32).score(
        rollouts, jax.random.key(3)
    )
    as_candidates = dataclasses.replace(
        rollouts, candidate_ids=sampled.sample_ids, candidate_behavior_logp=np.zeros(sampled.sample_ids.shape)
    )
    rescored = ServedTeacher(ServerParams(url=url, api="asyncopd"), ScoringParams(topk=1), 32).score(as_candidates)
    mask = np.asarray(rollouts.response_mask)
    assert_same_scores(np.asarray(rescored.candidate_logp)[mask], np.asarray(sampled.sample_logp)[mask])
    top = np.asarray(sampled.topk_ids)[..., 0][mask]
    assert np.mean(np.asarray(sampled.sample_ids)[mask] == top[:, None]) > 0.5


def test_concurrent_clients_are_batched_and_each_gets_its_own_rows(served_teacher):
    url, app = served_teacher
    sequences = [[2, 5 + i, 12, 6 + i, 13, 3] for i in range(8)]
    alone = [post(f"{url}/v1/completions", json={"prompt": [s], "prompt_logprobs": 2}).json() for s in sequences]
    barrier = threading.Barrier(8, timeout=30)
    answers: list = [None] * 8
    before = app.state.batcher.batches

    def client(i: int) -> None:
        barrier.wait()
        answers[i] = post(f"{url}/v1/completions", json={"prompt": [sequences[i]], "prompt_logprobs": 2}).json()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got, want in zip(answers, alone):  # each client its own rows; batching changes values by rounding only
        got_positions = got["choices"][0]["prompt_logprobs"]
        want_positions = want["choices"][0]["prompt_logprobs"]
        assert len(got_positions) == len(want_positions) == 6
        for g, w in zip(got_positions[1:], want_positions[1:]):
            assert g.keys() == w.keys()
            for k in g:  # batched with other rows: the same values up to rounding (ROUNDING)
                assert_same_scores(g[k]["logprob"], w[k]["logprob"])
    assert app.state.batcher.batches - before < 8  # some requests shared a batch


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "malformed JSON"),
        ({"prompt": "2 + 2", "prompt_logprobs": 2}, "prompt must be a non-empty list of token-id lists"),
        (
            {"prompt": [[2, 99]], "prompt_logprobs": 2},
            "prompt[0] holds 99 at position 1; allowed: token ids, integers from 0 to 31",
        ),
        ({"prompt": [[2, 3]], "prompt_logprobs": 9}, "prompt_logprobs must be an integer from 0 to 8, got 9"),
        ({"prompt": [[2, 3]], "prompt_logprobs": 2, "temperature": 0.7}, "scores at temperature 1 only"),
        ({"prompt": [[2, 3]], "prompt_logprobs": 2, "model": "gpt"}, "model 'gpt' is not served here"),
        ({"prompt": [[2, 3]], "prompt_logprobs": 2, "asyncopd": {"seeds": 1}}, "asyncopd.seeds is not a field"),
        (
            {"prompt": [[2, 3, 4]], "prompt_logprobs": 2, "asyncopd": {"response_start": [5]}},
            "asyncopd.response_start[0] must be an integer from 1 to 3, got 5",
        ),
        (
            {
                "prompt": [[2, 3, 4]],
                "prompt_logprobs": 2,
                "asyncopd": {"response_start": [1], "candidate_ids": [[[1]]]},
            },
            "asyncopd.candidate_ids[0] must hold 2 lists (one per response position) of the same number of ids",
        ),
        (
            {"prompt": [[2, 3, 4]], "prompt_logprobs": 2, "asyncopd": {"encoding": "msgpack"}},
            "asyncopd.encoding must be one of json, base64, npy, got 'msgpack'",
        ),
        (
            {"prompt": [[2, 3, 4]], "prompt_logprobs": 2, "asyncopd": {"response_start": [2], "pad_to": [1, 4]}},
            "asyncopd.pad_to must be [prompt, response] widths of at least [2, 1] (the longest prompt and response "
            "sent) and at most 128 together, got [1, 4]",
        ),
        (
            {"prompt": [[2, 3, 4]], "prompt_logprobs": 2, "asyncopd": {"pad_to": [64, 65]}},
            "asyncopd.pad_to must be [prompt, response] widths",
        ),
    ],
)
def test_a_bad_request_is_answered_400_in_one_line(served_teacher, body, says):
    url, _ = served_teacher
    send = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = post(f"{url}/v1/completions", **send)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert says in message and "\n" not in message, message


def test_an_oversized_request_is_answered_413(served_teacher):
    url, _ = served_teacher
    too_many = post(f"{url}/v1/completions", json={"prompt": [[2, 3]] * 9, "prompt_logprobs": 1})
    too_long = post(f"{url}/v1/completions", json={"prompt": [[2] * 129], "prompt_logprobs": 1})
    assert (too_many.status_code, too_long.status_code) == (413, 413)
    assert "9 prompts in one request; at most 8" in too_many.json()["error"]["message"]
    assert "prompt[0] has 129 tokens; the model's context is 128" in too_long.json()["error"]["message"]


def test_a_body_past_the_limit_is_answered_413(teacher):
    with running(BatchScorer(teacher, SETTINGS), dataclasses.replace(SETTINGS, max_body_bytes=1000)) as (url, _, _):
        response = post(f"{url}/v1/completions", content=b"[" + b"1," * 1000 + b"1]")
    assert response.status_code == 413 and "at most 1000" in response.json()["error"]["message"]


class Gated(BatchScorer):
    """A scorer whose batches wait for ``gate`` (a slow or stuck teacher)."""

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.gate = threading.Event()

    def score(self, *args, **kwargs):
        assert self.gate.wait(60)
        return super().score(*args, **kwargs)


def test_a_full_queue_is_answered_503_with_retry_after_and_the_rest_is_scored(teacher):
    scorer = Gated(teacher, SETTINGS)
    with running(scorer) as (url, app, _):
        results: list = []
        body = {"prompt": [[2, 3, 4]] * 4, "prompt_logprobs": 1}
        first = [
            threading.Thread(target=lambda: results.append(post(f"{url}/v1/completions", json=body))) for _ in range(3)
        ]
        for t in first:
            t.start()
        deadline = time.monotonic() + 30
        while app.state.batcher.queued_rows < 12:  # the queue's bound: 12 rows
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "the queue holds 12 rows; retry" in refused.json()["error"]["message"]
        scorer.gate.set()
        for t in first:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200, 200]


def test_a_client_retries_a_request_that_timed_out_on_a_slow_server(teacher, rollouts):
    scorer = Gated(teacher, SETTINGS)
    with running(scorer) as (url, _, _):
        threading.Timer(1.5, scorer.gate.set).start()  # stuck for 1.5 s, then fast
        client = ServedTeacher(
            ServerParams(url=url, api="asyncopd", timeout=0.5, backoff=0.1, rows_per_request=8),
            ScoringParams(topk=2),
            32,
        )
        cache = client.score(rollouts)
    assert client.stats.retries >= 1 and client.stats.wait_s > 0
    assert np.isfinite(np.asarray(cache.token_logp)).all()


def test_shutdown_answers_the_requests_in_flight(teacher):
    scorer = Gated(teacher, SETTINGS)
    with running(scorer) as (url, app, server):
        results: list = []
        thread = threading.Thread(
            target=lambda: results.append(
                post(f"{url}/v1/completions", json={"prompt": [[2, 3, 4]], "prompt_logprobs": 1})
            )
        )
        thread.start()
        deadline = time.monotonic() + 30
        while app.state.batcher.queued_rows < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.should_exit = True  # what SIGTERM does
        time.sleep(0.2)
        scorer.gate.set()
        thread.join(60)
    assert [r.status_code for r in results] == [200]
    assert set(results[0].json()["choices"][0]["prompt_logprobs"][1]) >= {"3"}


def test_requests_that_cannot_share_a_batch_are_scored_apart(teacher):
    """Queued together, a request with 2 candidates per position, one with 3 and one with
    none are each answered in full (a batch holds one count of ids per position)."""
    scorer = Gated(teacher, SETTINGS)
    bodies = [
        {
            "prompt": [[2, 3, 4, 5]],
            "prompt_logprobs": 1,
            "asyncopd": {"response_start": [2], "candidate_ids": [[[1, 2, 3][:n]] * 2]}
            if n
            else {"response_start": [2]},
        }
        for n in (2, 3, 0)
    ]
    with running(scorer) as (url, app, _):
        results: list = [None] * 3

        def send(i: int) -> None:
            results[i] = post(f"{url}/v1/completions", json=bodies[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while app.state.batcher.queued_rows < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        scorer.gate.set()
        for t in threads:
            t.join(60)
    assert [r.status_code for r in results] == [200, 200, 200]
    widths = [np.shape(r.json()["choices"][0]["asyncopd"].get("candidate_logprobs", [[]] * 2)) for r in results]
    assert widths == [(2, 2), (2, 3), (2, 0)]


def test_a_run_at_the_servers_temperature_gets_its_scores_and_one_at_another_a_400(teacher, rollouts):
    """``serve-teacher --temperature 0.7``: a client at 0.7 gets the in-process scorer's
    scores at 0.7; a client at 1.0 is refused in one line naming the server's temperature."""
    settings = dataclasses.replace(SETTINGS, temperature=0.7)
    params = ScoringParams(topk=4, temperature=0.7, chunk_size=64)
    with running(BatchScorer(teacher, settings), settings) as (url, _, _):
        server = ServerParams(url=url, api="asyncopd")
        remote = ServedTeacher(server, params, 32).score(rollouts)
        with pytest.raises(ServerError, match=r"HTTP 400: .*this server scores at temperature 0.7 only"):
            ServedTeacher(server, dataclasses.replace(params, temperature=1.0), 32).score(rollouts)
    local = TeacherScorer(teacher, params).score(rollouts)
    mask = np.asarray(rollouts.response_mask)
    for field in ("token_logp", "topk_logp", "candidate_logp"):
        assert_same_scores(np.asarray(getattr(remote, field))[mask], np.asarray(getattr(local, field))[mask])


def test_base64_arrays_are_the_json_numbers_exactly_and_pad_to_sets_the_scored_widths(served_teacher, teacher):
    """The extension's ``encoding: base64`` answers each array as its float32 / int32 bytes:
    decoded, the same numbers as the JSON lists; ``pad_to`` scores at the widths asked
    (the batch the scorer runs has them), with the same values as powers of two."""
    url, _ = served_teacher
    body = {
        "prompt": [[2, 5, 12, 6, 13, 7, 8, 9], [2, 6, 12, 7, 13, 9]],
        "prompt_logprobs": 3,
        "asyncopd": {"response_start": [5, 5]},
    }
    as_json = post(f"{url}/v1/completions", json=body).json()["choices"]
    as_bytes = post(
        f"{url}/v1/completions", json={**body, "asyncopd": {**body["asyncopd"], "encoding": "base64"}}
    ).json()["choices"]
    for j, b in zip(as_json, as_bytes):
        for key, value in j["asyncopd"].items():
            encoded = b["asyncopd"][key]
            assert encoded["dtype"] == ("<i4" if key.endswith("ids") else "<f4")
            decoded = np.frombuffer(base64.b64decode(encoded["data"]), encoded["dtype"]).reshape(encoded["shape"])
            np.testing.assert_array_equal(decoded, np.asarray(value, decoded.dtype), err_msg=key)
    widths = []
    scorer = BatchScorer(teacher, SETTINGS)
    function = scorer._function

    def spy(num_samples, k, hidden=None):
        score = function(num_samples, k, hidden)
        return lambda state, batch, key: (
            widths.append((batch.prompt_tokens.shape[1], batch.response_tokens.shape[1])) or score(state, batch, key)
        )

    scorer._function = spy
    rows = parse_request(body, SETTINGS, 32, 128).rows
    padded, bucketed = scorer.score(rows, 0, 0, 3, pad_to=(6, 5)), scorer.score(rows, 0, 0, 3)
    assert widths == [(6, 5), (8, 4)]  # as asked; else powers of two (5 prompt tokens, 3 answer tokens)
    for p, q in zip(padded, bucketed):
        for key in p:
            assert_same_scores(p[key], q[key], err_msg=key)


def test_a_mixture_of_experts_teacher_is_served_as_it_scores_in_process(rollouts):
    """builtin:teacher_moe (8 experts a layer, 2 a token) behind the server: the scores of the
    in-process scorer."""
    moe = from_pretrained(resolve_model_path("builtin:teacher_moe"))
    assert moe.config.num_experts == 8
    with running(BatchScorer(moe, SETTINGS)) as (url, _, _):
        _served_equals_in_process(url, moe, rollouts)


class _RowIds:
    """A scorer that answers each row with its first id, once ``gate`` opens."""

    def __init__(self):
        self.gate, self.called = threading.Event(), threading.Event()

    def score(self, rows, *args):
        self.called.set()
        assert self.gate.wait(60)
        return [{"first_id": int(row.ids[0])} for row in rows]


def test_a_client_gone_from_a_batch_leaves_each_other_client_its_own_rows():
    """Three requests share a batch; the second's client goes (its request cancelled) while
    the batch is scored: the first and third get their own rows, and the queue empties."""
    import asyncio

    from asyncopd_jax.teacher.batch_scorer import Request, Row
    from asyncopd_jax.teacher.server import Batcher

    def request(first_id: int, rows: int) -> Request:
        return Request([Row(np.array([first_id + r, 3]), 1) for r in range(rows)], 1, 0, 0, extension=False)

    async def scenario():
        scorer = _RowIds()
        batcher = Batcher(scorer, dataclasses.replace(SETTINGS, max_rows=6, max_wait_ms=5_000))
        batcher.start()
        try:
            tasks = [asyncio.create_task(batcher.score(request(i, rows))) for i, rows in ((10, 1), (20, 2), (30, 3))]
            while not scorer.called.is_set():
                await asyncio.sleep(0.01)
            tasks[1].cancel()
            scorer.gate.set()
            first, third = await tasks[0], await tasks[2]
            return first, third, batcher.queued_rows
        finally:
            await batcher.stop()

    first, third, queued = asyncio.run(scenario())
    assert [s["first_id"] for s in first] == [10]
    assert [s["first_id"] for s in third] == [30, 31, 32]
    assert queued == 0
