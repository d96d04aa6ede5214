"""The Starlette app: OpenAI-compatible routes around an Engine.

Handlers validate (protocol.py), tokenize on a worker thread, enqueue a Job, and turn the engine's
events into one JSON response or an SSE stream. Nothing here touches JAX.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata_jax.serving.engine import Engine, Event, Job
from strata_jax.serving.metrics import CONTENT_TYPE, Metrics, endpoint_label
from strata_jax.serving.protocol import (APIError, Envelope, GenRequest, ToolCallStream, bad, parse_chat,
                                         parse_completion, parse_tool_calls, timings, usage)

log = logging.getLogger("strata_jax")

MAX_BODY = 32 << 20
OPEN_PATHS = ("/health",)  # answered without an API key, for load balancers and probes
DISCONNECT_POLL_S = 0.5


class JSON(Response):
    """Compact ASCII JSON: model output may hold any code point, and ASCII escapes always encode."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(e: APIError) -> Response:
    return JSON(e.body(), status_code=e.status, headers=e.headers)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Gate:
    """Pure ASGI middleware (so streaming is untouched): the API key check and per-request metrics."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, t0, status = endpoint_label(scope["path"]), time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
                err = APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' with "
                               "the key the server was started with (--api-key or STRATA_JAX_API_KEY).",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"the request body is {len(raw)} bytes; the limit is {MAX_BODY}.")
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"the request body is not valid JSON ({str(e)[:120]}); send a JSON object.") from None


class Routes:
    def __init__(self, engine: Engine, metrics: Metrics, model_id: str, api_key: bool):
        self.engine, self.metrics, self.model_id, self.api_key = engine, metrics, model_id, api_key
        self.created = int(time.time())

    # -- status ---------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        e = self.engine
        status = {"ready": "ok", "idle": "loading", "loading": "loading"}.get(e.state, e.state)
        if e.draining and e.state == "ready":
            status = "shutting_down"
        body = {"status": status, "loaded": e.state == "ready", "model": self.model_id,
                "max_context": e.model.ctx if e.model is not None else None, "api_key": self.api_key,
                "queue_depth": e.queue_depth}
        if e.load_error:
            body["error"] = e.load_error
        return JSON(body, status_code=200 if status == "ok" else 503)

    async def models(self, request: Request) -> Response:
        m = self.engine.model
        entry: dict[str, Any] = {"id": self.model_id, "object": "model", "created": self.created,
                                 "owned_by": "strata-jax", "context_length": m.ctx if m is not None else None}
        if m is not None:
            cfg = m.config
            entry["meta"] = {"n_ctx": m.ctx, "n_ctx_train": cfg.context_length, "arch": cfg.arch,
                             "n_vocab": cfg.vocab_size, "moe": bool(cfg.is_moe)}
        return JSON({"object": "list", "data": [entry]})

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.refresh(self.engine)
        if request.query_params.get("format") == "json" or request.url.path.endswith(".json"):
            return JSON(self.metrics.as_json())
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    # -- generation -------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        t0 = time.perf_counter()
        try:
            body = await read_json(request)
            req = parse_chat(body) if endpoint == "chat" else parse_completion(body)
            self.engine.check_accepting()
            ids = await run_in_threadpool(self.engine.tokenize, req)
            job = Job(req, ids)
            self.engine.submit(job)
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:  # gone before its body arrived: nothing to answer
            return Response(status_code=499)
        env = Envelope(endpoint, req.model or self.model_id)
        try:
            first = await self._next(job, request)
        except BaseException:
            job.cancel()
            raise
        if first is None:  # the client left while queued; it reads no answer
            return Response(status_code=499)
        if first.kind == "error":
            return error_response(first.error)
        if req.stream:
            return StreamingResponse(self._stream(job, req, env, first, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, job, req, env, first, t0)

    async def _next(self, job: Job, request: Request) -> Event | None:
        """The job's next event, or None once the client has disconnected (the job is cancelled)."""
        get = asyncio.ensure_future(job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
                if done:
                    return get.result()
                if await request.is_disconnected():
                    job.cancel()
                    return None
        finally:
            if not get.done():
                get.cancel()

    def _account(self, job: Job, env: Envelope, final: Event, n: int, ttft: float) -> tuple[dict, dict]:
        """usage and the llama.cpp-style extras (timings, expert_cache) of a finished job (final: its first
        choice's last event; n: the tokens of all its choices, the prompt counted once as OpenAI does);
        updates metrics."""
        t = final.chunk.timings or {}
        prompt_n, cached = len(job.prompt_ids), int(t.get("cache_n", 0) or 0)
        extra: dict[str, Any] = {"timings": timings(t)}
        if final.expert_cache:
            extra["expert_cache"] = final.expert_cache
        label = "chat_completions" if env.endpoint == "chat" else "completions"
        self.metrics.observe_generation(label, prompt_n, n, cached, ttft, t)
        return usage(prompt_n, n, cached), extra

    def _logprobs_of(self, job: Job, env: Envelope):
        """entries -> the logprobs object of a response or chunk; None when the request asked for none."""
        if not job.req.logprobs:
            return lambda entries: None
        m, base, p = self.engine.model, 0, job.req.prompt
        if env.endpoint == "completion":  # text offsets count from the start of the prompt, as OpenAI's do
            base = len(p) if isinstance(p, str) else len(m.detokenize(p))
        return lambda entries: env.logprobs(entries, m.token_bytes, base)

    async def _collect(self, request: Request, job: Job, req: GenRequest, env: Envelope, ev: Event | None,
                       t0: float) -> Response:
        parts: list[list[str]] = [[] for _ in range(req.n)]  # per choice
        lps: list[list] = [[] for _ in range(req.n)]
        finals: dict[int, Event] = {}
        n, ttft = 0, None
        while True:
            if ev is None:
                return Response(status_code=499)
            if ev.kind == "error":
                job.cancel()
                return error_response(ev.error)
            ttft = ev.t - t0 if ttft is None else ttft
            parts[ev.index].append(ev.chunk.text)
            lps[ev.index] += ev.chunk.logprobs or []
            n += len(ev.chunk.token_ids)
            if ev.kind == "final":
                finals[ev.index] = ev
                if len(finals) == req.n:
                    break
            ev = await self._next(job, request)
        use, extra = self._account(job, env, finals[0], n, ttft)
        out = None
        for i in range(req.n):
            text, finish, calls = "".join(parts[i]), finals[i].chunk.finish_reason, []
            if req.tools:
                text, calls = parse_tool_calls(text)
                finish = "tool_calls" if calls else finish
            one = env.response(text, finish, use, extra, calls, logprobs=self._logprobs_of(job, env)(lps[i]), index=i)
            out = one if out is None else dict(out, choices=out["choices"] + one["choices"])
        return JSON(out)

    async def _stream(self, job: Job, req: GenRequest, env: Envelope, ev: Event, t0: float):
        """SSE chunks; with n > 1 the choices' chunks interleave, each with its index, and each choice
        ends with its own finish chunk (the last one carries timings, then the usage chunk)."""
        tools = [ToolCallStream() if req.tools else None for _ in range(req.n)]
        n, ttft, finals = 0, None, 0
        # per choice: logprobs of tokens whose text is not sent yet: they ride on the next chunk
        lps: list[list] = [[] for _ in range(req.n)]
        logprobs = self._logprobs_of(job, env)
        first_final: Event | None = None

        def take_lps(i: int) -> dict | None:
            out, lps[i] = logprobs(lps[i]), []
            return out

        try:
            if env.endpoint == "chat":
                for i in range(req.n):
                    yield sse(env.chunk(role=True, text="", index=i))
            while True:
                if ev.kind == "error":  # after the headers: an error event, as llama.cpp sends, then close
                    yield sse(ev.error.body())
                    return
                i, tool = ev.index, tools[ev.index]
                ttft = ev.t - t0 if ttft is None else ttft
                n += len(ev.chunk.token_ids)
                lps[i] += ev.chunk.logprobs or []
                text = tool.feed(ev.chunk.text) if tool else ev.chunk.text
                if text:
                    yield sse(env.chunk(text=text, logprobs=take_lps(i), index=i))
                if ev.kind == "final":
                    finish = ev.chunk.finish_reason
                    if tool:
                        rest, calls = tool.finish()
                        if rest:
                            yield sse(env.chunk(text=rest, logprobs=take_lps(i), index=i))
                        if calls:
                            yield sse(env.chunk(tool_calls=calls, logprobs=take_lps(i) if lps[i] else None, index=i))
                            finish = "tool_calls"
                    if i == 0:
                        first_final = ev
                    finals += 1
                    if finals == req.n:
                        use, extra = self._account(job, env, first_final or ev, n, ttft)
                        yield sse(env.chunk(finish=finish, extra=extra, logprobs=take_lps(i) if lps[i] else None,
                                            index=i))
                        break
                    yield sse(env.chunk(finish=finish, logprobs=take_lps(i) if lps[i] else None, index=i))
                ev = await job.events.get()
            if req.include_usage:
                yield sse(env.usage_chunk(use))
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a disconnect cancels the stream here; the engine stops before its next token


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = (f"no endpoint {request.url.path}: use /v1/chat/completions, /v1/completions, /v1/models, /health "
               "or /metrics.")
    elif exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}."
    else:
        msg = str(exc.detail)
    return error_response(APIError(exc.status_code, msg, headers=dict(exc.headers or {})))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None,
               metrics: Metrics | None = None) -> Starlette:
    """The ASGI app. Its lifespan starts the engine (loading in the background) and shuts it down."""
    metrics = metrics or Metrics()
    r = Routes(engine, metrics, model_id, api_key=bool(api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown)

    routes = [Route("/health", r.health), Route("/metrics", r.metrics_text), Route("/metrics.json", r.metrics_text)]
    for prefix in ("/v1", ""):  # llama.cpp answers without the /v1 prefix too
        routes += [Route(prefix + "/models", r.models),
                   Route(prefix + "/chat/completions", r.chat, methods=["POST"]),
                   Route(prefix + "/completions", r.completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(Gate, api_key=api_key, metrics=metrics)],
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.engine, app.state.metrics = engine, metrics
    return app
