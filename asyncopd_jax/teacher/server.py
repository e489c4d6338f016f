"""``asyncopd serve-teacher``: a teacher model behind an HTTP server that the scoring stage
of any run (``teacher.server.api: asyncopd``) or any vLLM client can score through.

An ASGI app (Starlette, served by uvicorn: the stack under vLLM's and SGLang's servers):

* ``GET /health``: 200 once the teacher is loaded.
* ``GET /v1/models``: the one model, OpenAI-style; its card's ``"asyncopd"`` states the
  rows one request may hold, the hidden size, and the LM head's shape, dtype and digest.
* ``GET /v1/head``: the LM head ``[H, V]``, an ``.npz`` body (:mod:`asyncopd_jax.npz`)
  holding ``head``: what a learner applying the teacher's head to its hidden states fetches
  once, and checks against the card's digest.
* ``POST /v1/completions``: vLLM's body and answer, plus the extension that scores ids
  the student chose and returns hidden states (:mod:`asyncopd_jax.teacher.batch_scorer`).
* ``POST /v1/byte_prefix``: the teacher's side of a run's ``teacher.mapping: byte_prefix``
  (:mod:`asyncopd_jax.teacher.prefix_wire`), where the model's directory has its tokenizer;
  one request at a time, beside the batches.

Concurrent requests are scored together. A request's rows join a queue; one batcher task
takes the queued requests whose rows can share a batch (:attr:`Request.signature`), up to
``max_rows`` rows, waiting at most ``max_wait_ms`` for more once it has one, and scores
them with one jitted call on a worker thread (the event loop keeps accepting meanwhile).
The queue holds at most ``queue_rows`` rows: past it a request is answered 503 with
``Retry-After: 1``. A malformed request is answered 400, one too large 413, each with a
one-line JSON error (``{"error": {"message", "type", "code"}}``, as vLLM answers).

Shutdown (SIGTERM, Ctrl-C): uvicorn stops accepting connections and waits for the
requests in flight, which the batcher still scores and answers; then the app's lifespan
ends and the batcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from asyncopd_jax.models import Decoder
from asyncopd_jax.npz import npz_bytes
from asyncopd_jax.teacher import prefix_wire
from asyncopd_jax.teacher.batch_scorer import BadRequest, BatchScorer, Request, ServerSettings, answer, parse_request
from asyncopd_jax.teacher.prefix_trees import PrefixTrees

#: The media type of a binary answer (an ``.npz`` archive).
BINARY = "application/octet-stream"


@dataclasses.dataclass(eq=False)  # one waiting request: equal only to itself (the queue removes it by identity)
class _Pending:
    request: Request
    done: asyncio.Future


class Batcher:
    """The queue of parsed requests and the task that scores them in batches."""

    def __init__(self, scorer: BatchScorer, settings: ServerSettings):
        self.scorer, self.settings = scorer, settings
        self.queue: list[_Pending] = []
        self.queued_rows = 0
        self.batches = 0  # scored so far (for /health and tests)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def full(self, rows: int) -> bool:
        """Whether ``rows`` more rows would pass the queue's bound."""
        return self.queued_rows + rows > self.settings.queue_rows

    async def score(self, request: Request) -> list:
        """The request's scores, once a batch has scored its rows."""
        assert self._wake is not None, "Batcher.start() was not called"
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self.queue.append(pending)
        self.queued_rows += len(request.rows)
        self._wake.set()
        return await pending.done

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                deadline = loop.time() + self.settings.max_wait_ms / 1e3
                while self._rows_like(self.queue[0]) < self.settings.max_rows and loop.time() < deadline:
                    await asyncio.sleep(min(1e-3, max(deadline - loop.time(), 0)))
                taken = self._take()
                rows = [row for p in taken for row in p.request.rows]
                first = taken[0].request
                try:
                    scores = await asyncio.to_thread(
                        self.scorer.score,
                        rows,
                        first.num_samples,
                        first.seed,
                        max(p.request.topk for p in taken),
                        _widest([p.request.pad_to for p in taken]),
                        first.hidden,
                    )
                except Exception as err:  # a failure of the scoring itself: every waiter learns it
                    for p in taken:
                        if not p.done.done():
                            p.done.set_exception(err)
                    continue
                finally:
                    self.queued_rows -= len(rows)
                self.batches += 1
                start = 0
                for p in taken:
                    n = len(p.request.rows)
                    if not p.done.done():  # its client may have gone
                        p.done.set_result(scores[start : start + n])
                    start += n

    def _rows_like(self, head: _Pending) -> int:
        """Rows queued that could share a batch with ``head``."""
        return sum(len(p.request.rows) for p in self.queue if p.request.signature == head.request.signature)

    def _take(self) -> list[_Pending]:
        """The queue's first request and those after it that can join its batch, up to
        ``max_rows`` rows (a request's rows stay together; the first is always taken)."""
        signature = self.queue[0].request.signature
        taken: list[_Pending] = []
        rows = 0
        for p in list(self.queue):
            n = len(p.request.rows)
            if p.request.signature == signature and (not taken or rows + n <= self.settings.max_rows):
                taken.append(p)
                rows += n
                self.queue.remove(p)
        return taken


def make_app(scorer: BatchScorer, settings: ServerSettings, trees: PrefixTrees | None = None) -> Any:
    """The ASGI app serving ``scorer`` (and ``trees``: ``/v1/byte_prefix``; None: refused)."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    batcher = Batcher(scorer, settings)
    one_tree_call = asyncio.Lock()  # PrefixTrees keeps one batch's forward: one call at a time

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        kind = {400: "BadRequestError", 413: "RequestTooLarge", 503: "ServiceUnavailable"}.get(status, "Error")
        body = {"error": {"message": " ".join(message.split()), "type": kind, "code": status}}
        return JSONResponse(body, status_code=status, headers=headers)

    async def health(_: HttpRequest) -> JSONResponse:
        return JSONResponse({"status": "ok", "batches": batcher.batches, "queued_rows": batcher.queued_rows})

    async def models(_: HttpRequest) -> JSONResponse:
        card = {
            "id": settings.model_name,
            "object": "model",
            "owned_by": "asyncopd",
            "max_model_len": scorer.context,
            "asyncopd": {
                "max_request_rows": settings.max_request_rows,  # the client's default request size
                "hidden_size": scorer.hidden_size,
                "head": scorer.head_card,
            },
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def head(_: HttpRequest) -> Response:
        data = await asyncio.to_thread(lambda: npz_bytes({"head": scorer.head()}))
        return Response(data, media_type=BINARY)

    async def body_of(http: HttpRequest) -> bytes:
        """The request's body, else a 413 :class:`BadRequest` past ``max_body_bytes``."""
        size = http.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > settings.max_body_bytes:
            raise BadRequest(f"the body has {size} bytes; at most {settings.max_body_bytes}", 413)
        raw = bytearray()
        async for chunk in http.stream():  # a chunked body has no length to check first
            raw += chunk
            if len(raw) > settings.max_body_bytes:
                raise BadRequest(f"the body has more than {settings.max_body_bytes} bytes", 413)
        return bytes(raw)

    async def completions(http: HttpRequest) -> Response:
        try:
            request = parse_request(strict_json(await body_of(http)), settings, scorer.vocab_size, scorer.context)
        except BadRequest as err:
            return error(err.status, str(err))
        if batcher.full(len(request.rows)):
            return error(503, f"the queue holds {batcher.queued_rows} rows; retry", {"Retry-After": "1"})
        scores = await batcher.score(request)
        body = answer(request, scores, settings.model_name)
        return Response(body, media_type=BINARY) if isinstance(body, bytes) else JSONResponse(body)

    async def byte_prefix(http: HttpRequest) -> Response:
        try:
            raw = await body_of(http)
            if trees is None:
                raise BadRequest(
                    f"{prefix_wire.PATH}: this server has no tokenizer of its model (serve a model directory that "
                    "holds one, or builtin:NAME)"
                )
            request = prefix_wire.parse_prefix_request(
                strict_json(raw),
                settings.model_name,
                settings.temperature,
                settings.max_request_rows,
                scorer.vocab_size,
                scorer.context,
            )
        except BadRequest as err:
            return error(err.status, str(err))
        async with one_tree_call:
            data = await asyncio.to_thread(prefix_wire.answer, trees, request)
        return Response(data, media_type=BINARY)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/head", head),
            Route("/v1/completions", completions, methods=["POST"]),
            Route(prefix_wire.PATH, byte_prefix, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.batcher = batcher
    return app


def strict_json(raw: bytes) -> Any:
    """The body's JSON value, else a :class:`BadRequest`: malformed JSON or text that is not
    UTF-8, ``NaN`` / ``Infinity`` (not JSON, though Python's parser takes them), or nesting
    deeper than the parser's recursion allows."""

    def refuse(constant: str) -> None:
        raise BadRequest(f"malformed JSON: {constant} is not a JSON value")

    try:
        return json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    except BadRequest:
        raise
    except ValueError as err:  # json's JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"malformed JSON: {err}") from None


def serve(scorer: BatchScorer, settings: ServerSettings, host: str, port: int, trees: PrefixTrees | None) -> None:
    """Serve until SIGTERM / Ctrl-C; the requests in flight are answered first."""
    import uvicorn

    app = make_app(scorer, settings, trees)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)


def prefix_trees(model: Decoder, path: str, temperature: float) -> PrefixTrees | None:
    """The byte-prefix trees of ``model``, whose directory is ``path`` (None where it holds
    no tokenizer: ``/v1/byte_prefix`` is then refused)."""
    from asyncopd_jax.models import load_tokenizer
    from asyncopd_jax.models.token_bytes import token_bytes
    from asyncopd_jax.tasks.assets import resolve_model_path

    try:
        tokenizer = load_tokenizer(resolve_model_path(path))
    except (OSError, ValueError):
        return None
    return PrefixTrees(model, token_bytes(tokenizer), temperature)


def _widest(widths: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The widths a batch of requests is padded to: the largest each asked (None: any of them
    asked none, and the powers of two serve all)."""
    if any(w is None for w in widths):
        return None
    return max(w[0] for w in widths if w), max(w[1] for w in widths if w)
