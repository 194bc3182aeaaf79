"""The OpenAI-compatible HTTP API over a speculative decoder (FastAPI).

    from redraft.infer import load_preset
    from redraft.serve import create_app
    app = create_app(load_preset("infer/decode-default.yaml"), model_name="default")
    # uvicorn.run(app) -- or redraft-serve, which also drains on SIGTERM

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events when ``stream`` is true), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

A request's life: parse and check the body (400 naming the field), tokenize (chat template for
chat), build ``SamplingParams`` (they check their own ranges), submit to the :class:`Scheduler`
(429/503), wait for admission (``engine.add`` may still answer 400: prompt longer than the
context...), then stream the decoder's events or collect them into one response. A client that
goes away has its row cancelled at the next step, streaming or not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from redraft.errors import ConfigError
from redraft.serve import protocol as P
from redraft.serve.metrics import Metrics
from redraft.serve.scheduler import Job, Scheduler

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


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


async def _next(job: Job, disconnect: asyncio.Future):
    """The job's next message, or None when the client disconnected first."""
    get = asyncio.ensure_future(job.queue.get())
    await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def create_app(decoder, model_name: str = "default", *, api_key: str | None = None, max_batch: int = 16,
               max_queue: int = 64, default_max_tokens: int = DEFAULT_MAX_TOKENS, warmup: bool = True,
               sampling_params=None) -> FastAPI:
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
    """
    if sampling_params is None:
        from redraft.infer import SamplingParams as sampling_params
    make_params = sampling_params.checked  # the decoding API's one place for these checks
    if default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens={default_max_tokens} must be >= 1.", param="default_max_tokens")
    context = getattr(decoder.target.model.config, "max_position_embeddings", None)  # None: unknown
    metrics = Metrics()
    sched = Scheduler(decoder, max_batch, max_queue, metrics, make_params=make_params, warmup=warmup)
    key = None if api_key is None else _digest(api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sched.start()
        await asyncio.to_thread(sched.ready.wait)
        if sched.failure is not None:
            raise RuntimeError(f"the decoder failed to start: {sched.failure!r}")
        yield
        await asyncio.to_thread(sched.stop)

    app = FastAPI(title="redraft-serve", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.scheduler, app.state.metrics = sched, metrics

    # ---------------------------------------------------------------- errors, in OpenAI's shape

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        outcome = {400: "invalid", 401: "unauthorized", 429: "rejected", 503: "rejected"}.get(exc.status)
        if outcome:
            metrics.outcome(outcome)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = P.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}.",
                         code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        metrics.outcome("error")
        return JSONResponse(P.APIError(500, f"internal error: {exc!r}").body(), status_code=500)

    # ---------------------------------------------------------------- auth

    async def check_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # sha256 first: compare_digest is constant-time only for inputs of equal length; it runs
        # whatever the scheme, so a reply's timing says nothing about the key
        match = hmac.compare_digest(_digest(given.strip()), key)
        if scheme.lower() != "bearer" or not match:
            raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    # ---------------------------------------------------------------- requests

    def params_for(body: P._Request, n_prompt: int, max_tokens_name: str = "max_tokens"):
        max_new = body.max_new_tokens
        if max_new is None:
            max_new = default_max_tokens if context is None else max(1, min(default_max_tokens, context - n_prompt))
        try:
            return make_params(max_new_tokens=max_new, temperature=0.0 if body.temperature is None else body.temperature,
                               top_p=1.0 if body.top_p is None else body.top_p, stop=body.stops, seed=body.seed)
        except ConfigError as exc:
            err = P.config_error(exc)
            if err.param == "max_tokens":
                err.param = max_tokens_name
            raise err from None

    def encode(x, param: str) -> list[int]:
        from jinja2.exceptions import TemplateError

        try:
            return decoder.encode(x)[0]  # encode normalises to a batch; this is one prompt
        except ConfigError as exc:
            raise P.APIError(400, f"{param}: {exc}", param=param) from None
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise P.APIError(400, f"{param}: the model's chat template rejected these messages ({exc}).",
                             param=param) from None

    async def run(request: Request, kind: str, body: P._Request, prompt_ids: list[int], params) -> Response:
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        sched.submit(job)
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            msg = await _next(job, disconnect)
            if msg is None:  # gone before it was admitted
                sched.cancel(job)
                return Response(status_code=499)
            if msg[0] == "error":
                raise msg[1]
            rid = P.new_id(kind)
            if body.stream:
                writer = P.ChunkWriter(kind, rid, model_name, body.include_usage)
                return EventStream(_sse(job, writer, len(prompt_ids)), on_close=lambda: sched.cancel(job))
            while True:
                msg = await _next(job, disconnect)
                if msg is None:
                    sched.cancel(job)
                    return Response(status_code=499)
                if msg[0] == "error":
                    raise msg[1]
                if msg[1].done:
                    return JSONResponse(P.response(kind, rid, model_name, msg[1].generation, len(prompt_ids)))
        finally:
            disconnect.cancel()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = P.parse_request(await request.body(), P.ChatRequest)
        body.check(model_name)
        ids = encode(body.chat(), "messages")
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await run(request, "chat", body, ids, params_for(body, len(ids), name))

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = P.parse_request(await request.body(), P.CompletionRequest)
        body.check(model_name)
        # token ids are checked (non-empty, in the vocabulary, within the context) by engine.add
        ids = list(body.prompt) if isinstance(body.prompt, list) else encode(body.prompt, "prompt")
        return await run(request, "completion", body, ids, params_for(body, len(ids)))

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [P.model_card(model_name, context)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise P.APIError(404, f"model {model_id!r} is not served here; this server serves {model_name!r}.",
                             param="model", code="model_not_found")
        return P.model_card(model_name, context)

    app.include_router(v1)

    # ---------------------------------------------------------------- operations

    @app.get("/health")
    async def health() -> JSONResponse:
        running, waiting = sched.counts()
        status = "ok" if sched.alive and not sched.draining else ("draining" if sched.alive else "failed")
        return JSONResponse({"status": status, "running": running, "waiting": waiting},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


async def _sse(job: Job, writer: P.ChunkWriter, prompt_tokens: int):
    """The chunks of one streamed request, ``data: [DONE]`` last; an error after the stream has
    started is sent as an ``{"error": ...}`` event (the status line is already out)."""
    if start := writer.start():
        yield start
    while True:
        kind, payload = await job.queue.get()
        if kind == "error":
            yield writer.error(payload)
            break
        if chunk := writer.delta(payload.text):
            yield chunk
        if payload.done:
            yield writer.finish(payload.generation, prompt_tokens)
            break
    yield writer.done()
