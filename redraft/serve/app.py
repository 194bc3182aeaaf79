"""The OpenAI-compatible HTTP API over a speculative decoder (FastAPI).

    from redraft.infer import load_preset
    from redraft.serve import create_app
    app = create_app(load_preset("infer/decode-default.yaml"), model_name="default")
    # uvicorn.run(app) -- or redraft-serve, which also drains on SIGTERM

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when ``stream`` is true), ``GET /v1/models``, ``GET|HEAD /health``, ``GET /metrics``.

A request's life: read the body (413 past ``max_request_bytes``); on a worker thread, parse and
check it (400 naming the field), tokenize (chat template for chat) and build one job per choice
with its ``SamplingParams`` (:class:`~redraft.serve.choices.JobBuilder`); submit them together
to the :class:`Scheduler` (429/503), wait for admission (``engine.add`` may still answer 400:
prompt longer than the context...), then stream the decoder's events (choices interleaved) or
collect them into one response. A client that goes away has its rows cancelled at the next
step, streaming or not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from redraft.errors import ConfigError
from redraft.serve import protocol as P
from redraft.serve.choices import FanIn, JobBuilder
from redraft.serve.metrics import Metrics
from redraft.serve.scheduler import Scheduler

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a full 128k-token context as JSON token ids is ~1 MB


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class EventStream(StreamingResponse):
    """A server-sent-event response that calls ``on_close`` however it ends (finished, client
    gone, server shutting down): Starlette cancels the body iterator when the client
    disconnects, and this is the one place that always runs afterwards."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 naming ``limit`` as soon as it is known to be larger (from
    ``Content-Length`` before reading, else while reading: a huge body is never held whole)."""

    def too_large(size: str) -> P.APIError:
        return P.APIError(
            413,
            f"the request body is {size} bytes; this server takes at most {limit} bytes "
            f"(redraft-serve --max-request-bytes).",
            code="request_too_large",
        )

    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise too_large(length)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    decoder,
    model_name: str = "default",
    *,
    api_key: str | None = None,
    max_batch: int = 16,
    max_queue: int = 64,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    warmup: bool = True,
    sampling_params=None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    cors_origins: tuple[str, ...] | list[str] = (),
    compute=None,
) -> FastAPI:
    """The server app over ``decoder`` (a ``SpeculativeDecoder``; anything with ``engine()``,
    ``encode()`` and ``target.model.config.max_position_embeddings`` will do).

    Args:
        model_name: the id ``/v1/models`` lists and requests must name (or omit).
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``
            (compared in constant time); ``/health`` and ``/metrics`` stay open.
        max_batch, max_queue: rows decoding at once, requests waiting beyond them (then 429).
        default_max_tokens: new tokens when a request gives no ``max_tokens`` (capped by the context).
        warmup: run a short generation before accepting requests.
        sampling_params: the ``SamplingParams`` class (default ``redraft.infer.SamplingParams``).
        max_request_bytes: a larger request body is answered 413 (before it is read, when its
            ``Content-Length`` says so).
        cors_origins: origins a browser may call the API from (``["*"]``: any); empty: no CORS
            headers, and preflight ``OPTIONS`` requests get 405.
        compute: the :class:`~redraft.serve.scheduler.ComputeThread` ``decoder`` was loaded on:
            the decode loop runs there (default: a thread of its own; see that class for why a
            server should load its decoder on it).
    """
    if sampling_params is None:
        from redraft.infer import SamplingParams as sampling_params
    make_params = sampling_params.checked  # the decoding API's one place for these checks
    _check_limits(default_max_tokens, max_request_bytes)
    context = getattr(decoder.target.model.config, "max_position_embeddings", None)  # None: unknown
    tok = getattr(decoder.target, "tokenizer", None)
    token_text = (lambda t: tok.decode([t])) if tok is not None else str  # the tokens of logprobs
    metrics = Metrics()
    sched = Scheduler(
        decoder,
        max_batch,
        max_queue,
        metrics,
        make_params=make_params,
        warmup=warmup,
        compute=compute,
    )
    metrics.bind(
        sched.counts
    )  # batch size and queue depth: the scheduler's counts, as /health reports them
    build = JobBuilder(
        decoder, model_name, make_params, default_max_tokens, context, max_batch + max_queue
    )
    key = None if api_key is None else _digest(api_key)
    app = FastAPI(
        title="redraft-serve",
        lifespan=_lifespan(sched),
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.scheduler, app.state.metrics = sched, metrics
    if cors_origins:
        _add_cors(app, cors_origins)

    _add_error_handlers(app, metrics)
    app.include_router(
        _v1_router(sched, build, model_name, context, key, max_request_bytes, token_text)
    )
    _add_operations(app, sched, metrics)
    return app


def _check_limits(default_max_tokens: int, max_request_bytes: int) -> None:
    """Raise ConfigError unless both limits are at least 1."""
    if default_max_tokens < 1:
        raise ConfigError(
            f"default_max_tokens={default_max_tokens} must be >= 1.", param="default_max_tokens"
        )
    if max_request_bytes < 1:
        raise ConfigError(
            f"max_request_bytes={max_request_bytes} must be >= 1.", param="max_request_bytes"
        )


def _lifespan(sched: Scheduler):
    """The app's lifespan: the scheduler started (its decoder ready) before the first request,
    stopped after the last."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sched.start()
        await asyncio.to_thread(sched.ready.wait)
        if sched.failure is not None:
            raise RuntimeError(f"the decoder failed to start: {sched.failure!r}")
        yield
        await asyncio.to_thread(sched.stop)

    return lifespan


def _add_cors(app: FastAPI, cors_origins) -> None:
    """CORS headers for ``cors_origins`` (preflight requests answered)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors_origins),
        allow_methods=["GET", "POST", "HEAD"],
        allow_headers=["*"],
        max_age=600,
    )


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error in OpenAI's shape; each counted by outcome (a 500 also logged with its traceback)."""

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        outcome = {
            400: "invalid",
            413: "invalid",
            401: "unauthorized",
            429: "rejected",
            503: "rejected",
        }.get(exc.status)
        if outcome:
            metrics.outcome(outcome)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = P.APIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}.",
            code=str(exc.status_code),
        )
        return JSONResponse(
            err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # closed while sending its body
        metrics.outcome("cancelled")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        metrics.outcome("error")
        return JSONResponse(P.APIError(500, f"internal error: {exc!r}").body(), status_code=500)


def _v1_router(
    sched: Scheduler,
    build: JobBuilder,
    model_name: str,
    context,
    key,
    max_request_bytes: int,
    token_text,
) -> APIRouter:
    """``/v1``: the API key check, chat and text completions, the model list."""

    async def check_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # sha256 first: compare_digest is constant-time only for inputs of equal length; it runs
        # whatever the scheme, so a reply's timing says nothing about the key
        match = hmac.compare_digest(_digest(given.strip()), key)
        if scheme.lower() != "bearer" or not match:
            raise P.APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    # ---------------------------------------------------------------- requests

    async def handle(request: Request, kind: str) -> Response:
        raw = await read_body(request, max_request_bytes)
        body, lengths, jobs = await asyncio.to_thread(build, raw, kind, asyncio.get_running_loop())
        sched.submit(*jobs)
        fan, disconnect = FanIn(jobs), asyncio.ensure_future(_disconnected(request))
        streaming = False
        try:
            early = await _admitted(fan, disconnect)  # events that came before the last admission
            if early is None:  # gone before it was admitted
                return Response(status_code=499)
            rid = P.new_id(kind)
            if body.stream:
                writer = P.ChunkWriter(kind, rid, model_name, body.include_usage, token_text)
                streaming = True
                return EventStream(
                    _sse(fan, early, writer, sum(lengths)), on_close=lambda: _close(sched, fan)
                )
            gens = await _collect(fan, early, disconnect)
            if gens is None:
                return Response(status_code=499)
            return JSONResponse(P.response(kind, rid, model_name, gens, sum(lengths), token_text))
        finally:
            disconnect.cancel()
            if not streaming:
                _close(sched, fan)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [P.model_card(model_name, context)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise P.APIError(
                404,
                f"model {model_id!r} is not served here; this server serves {model_name!r}.",
                param="model",
                code="model_not_found",
            )
        return P.model_card(model_name, context)

    return v1


def _add_operations(app: FastAPI, sched: Scheduler, metrics: Metrics) -> None:
    """``/health`` (GET and HEAD) and ``/metrics``."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        running, waiting = sched.counts()
        status = (
            "ok"
            if sched.alive and not sched.draining
            else ("draining" if sched.alive else "failed")
        )
        return JSONResponse(
            {"status": status, "running": running, "waiting": waiting},
            status_code=200 if status == "ok" else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)


def _close(sched: Scheduler, fan: FanIn) -> None:
    """However a request ends: its unfinished choices leave the batch (a no-op for finished ones)."""
    fan.close()
    for job in fan.jobs:
        sched.cancel(job)


async def _admitted(fan: FanIn, disconnect: asyncio.Future) -> list | None:
    """Wait until every choice is admitted; returns the events that arrived meanwhile, or None
    if the client went away. The first choice refused (prompt too long...) raises its error."""
    early, admitted = [], 0
    while admitted < len(fan.jobs):
        msg = await fan.next(disconnect)
        if msg is None:
            return None
        kind, payload = msg[1]
        if kind == "error":
            raise payload
        if kind == "admitted":
            admitted += 1
        else:
            early.append(msg)
    return early


async def _collect(fan: FanIn, early: list, disconnect: asyncio.Future) -> list | None:
    """The finished generation of every choice, in index order; None if the client went away."""
    gens: dict = {}
    pending = list(early)
    while len(gens) < len(fan.jobs):
        msg = pending.pop(0) if pending else await fan.next(disconnect)
        if msg is None:
            return None
        i, (kind, payload) = msg
        if kind == "error":
            raise payload
        if payload.done:
            gens[i] = payload.generation
    return [gens[i] for i in range(len(fan.jobs))]


async def _sse(fan: FanIn, early: list, writer: P.ChunkWriter, prompt_tokens: int):
    """The chunks of one streamed request (every choice interleaved, each with its index),
    ``data: [DONE]`` last; an error after the stream has started is sent as an
    ``{"error": ...}`` event (the status line is already out)."""
    if start := writer.start(len(fan.jobs)):
        yield start
    gens: dict = {}
    pending = list(early)
    while len(gens) < len(fan.jobs):
        i, (kind, payload) = pending.pop(0) if pending else await fan.queue.get()
        if kind == "error":
            yield writer.error(payload)
            break
        if chunk := writer.delta(payload.text, i, getattr(payload, "logprobs", None)):
            yield chunk
        if payload.done:
            gens[i] = payload.generation
            yield writer.finish(payload.generation, i)
    else:
        if writer.include_usage:
            yield writer.usage([gens[i] for i in range(len(gens))], prompt_tokens)
    yield writer.done()
