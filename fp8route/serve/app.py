"""The routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every refusal is an APIError answered in OpenAI's error body. A request waits for its first step's
text before its response starts, so an engine failure on that step is still a real 500 and a
streamed response never opens for a request that cannot run. A client that goes away is noticed
while its request waits (non-streaming: the connection is watched; streaming: Starlette cancels the
stream), and leaving the engine's stream aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from fp8route.engine.async_llm import EngineError
from fp8route.serve.errors import APIError, from_validation
from fp8route.serve.metrics import Metrics
from fp8route.serve.protocol import ChatCompletionRequest, CompletionRequest
from fp8route.serve.responses import Formats, batch_response, collect, sse
from fp8route.serve.serving import Job, Piece, Serving

log = logging.getLogger("fp8route")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class _EventStream(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette stops iterating a stream whose client left without closing it: close it now,
            # which aborts the request, rather than whenever the generator is garbage-collected.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """work's result, or ClientGone (with work cancelled) if the client leaves first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def read_request(request: Request, model: type[M], limit: int) -> M:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(
            413, f"the request body is {length} bytes, over this server's limit of {limit} (--max-request-bytes)"
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over this server's limit of {limit} bytes (--max-request-bytes)")
    try:
        data = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError included
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got a JSON {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def engine_failure(exc: EngineError) -> APIError:
    return APIError(500, str(exc), code="engine_error")


def build_app(serving: Serving, *, api_key: str | None, max_request_bytes: int) -> FastAPI:
    """The server's app over serving: error bodies, the /v1 routes behind the API key, the probes."""
    app = FastAPI(title="fp8route", docs_url=None, redoc_url=None, openapi_url=None)
    _handle_errors(app, serving.metrics)
    app.include_router(_v1_routes(serving, _authorizer(api_key), max_request_bytes))
    _add_probes(app, serving)
    return app


def _handle_errors(app: FastAPI, metrics: Metrics) -> None:
    """Every error, ours, Starlette's or unexpected, answered in OpenAI's error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500 or exc.status == 503:
            metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        what = f"{request.method} {request.url.path}"
        message = {404: f"no route {what}; the API is under /v1", 405: f"{what}: method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answers; the client gets the exception's name in one line.
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}".splitlines()[0], code="internal_error")
        return JSONResponse(error.body(), status_code=500)


def _authorizer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that refuses a request without the server's key (None: every request passes)."""

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the server's key",
                code="invalid_api_key",
            )  # fmt: skip

    return authorize


def _v1_routes(serving: Serving, authorize: Callable[[Request], Awaitable[None]], max_request_bytes: int) -> APIRouter:
    """/v1/models, /v1/completions and /v1/chat/completions, each behind authorize."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models().model_dump())

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_request(request, CompletionRequest, max_request_bytes)
        prompts = body.prompts
        if len(prompts) > 1:
            if body.stream:
                raise APIError(
                    400, f"'prompt' holds {len(prompts)} prompts and a stream answers one: send them one per "
                    "request, or set 'stream' to false", param="prompt",
                )  # fmt: skip
            return await _answer_batch(serving, request, body)
        job = serving.completion_job(body, prompts[0])
        echo = serving.prompt_text(prompts[0]) if body.echo else None
        formats = Formats(job, body.model, False, body.continuous_usage, serving.token_text, echo)
        return await _answer(serving, request, job, formats, body.stream, body.include_usage)

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_request(request, ChatCompletionRequest, max_request_bytes)
        job = serving.chat_job(body)
        formats = Formats(job, body.model, True, body.continuous_usage, serving.token_text)
        return await _answer(serving, request, job, formats, body.stream, body.include_usage)

    return v1


async def _answer_batch(serving: Serving, request: Request, body: CompletionRequest) -> Response:
    """One response for a batch of prompts: prompt p's samples are choices p * n ... p * n + n - 1."""
    jobs: list[Job] = []
    try:
        for prompt in body.prompts:
            jobs.append(serving.completion_job(body, prompt))
    except APIError:
        for job in jobs:
            serving.release(job, "aborted")
        raise
    streams = [serving.pieces(job) for job in jobs]
    try:
        answers = await until_disconnect(request, asyncio.gather(*(collect(s) for s in streams)))
    except EngineError as exc:
        raise engine_failure(exc) from None
    except ClientGone:
        return Response(status_code=499)
    finally:
        for stream, job in zip(streams, jobs, strict=True):
            await stream.aclose()  # type: ignore[attr-defined]
            serving.release(job, "aborted")
    return JSONResponse(batch_response(serving, body, jobs, answers).model_dump())


async def _answer(
    serving: Serving, request: Request, job: Job, formats: Formats, stream: bool, include_usage: bool
) -> Response:
    """One job's response: whole, or an event stream opened once its first piece is in."""
    pieces = serving.pieces(job)
    streaming = False
    try:
        if not stream:
            whole = await until_disconnect(request, collect(pieces))
            return JSONResponse(formats.whole(whole).model_dump())
        first = await until_disconnect(request, anext(pieces))
        streaming = True
        events = _events(formats, first, pieces, include_usage)
        return _EventStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    except EngineError as exc:
        raise engine_failure(exc) from None
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    finally:
        if not streaming:  # a generator cancelled before it started has no finally of its own to run
            await pieces.aclose()  # type: ignore[attr-defined]
            serving.release(job, "aborted")


def _add_probes(app: FastAPI, serving: Serving) -> None:
    """/health (503 while draining or once the engine has stopped) and /metrics (Prometheus)."""

    @app.get("/health")
    async def health() -> Response:
        down = None
        if serving.draining:
            down = APIError(503, "the server is shutting down", code="shutting_down")
        elif not serving.engine.alive:
            down = APIError(503, "the engine thread has stopped; restart the server", code="engine_stopped")
        return JSONResponse(down.body(), status_code=503) if down else JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _events(
    formats: Formats, first: Piece, pieces: AsyncIterator[Piece], include_usage: bool
) -> AsyncIterator[str]:
    last = first
    try:
        yield formats.event(first)
        async for piece in pieces:
            last = piece
            yield formats.event(piece)
        if include_usage:
            yield sse(formats.usage_chunk(last))
    except EngineError as exc:  # the response has started: the error goes in the stream, as vLLM's does
        yield sse(engine_failure(exc).body())
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
