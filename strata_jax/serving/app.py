"""The Starlette app: OpenAI-compatible routes (Chat Completions, Completions, Responses), and
Anthropic's Messages API, around an Engine; the web UI at / (static files under ui/) and its live
monitor stream, /v1/monitor/events.

Handlers validate (protocol.py, responses.py, anthropic.py), tokenize on a worker thread, enqueue a Job, and turn the
engine's events into one JSON response or an SSE stream. Nothing here touches JAX.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata_jax.core.units import fmt_bytes
from strata_jax.serving import anthropic, llamacpp
from strata_jax.serving.engine import Engine, Event, Job
from strata_jax.serving.metrics import CONTENT_TYPE, Metrics, endpoint_label
from strata_jax import __version__
from strata_jax.serving.protocol import (APIError, Envelope, GenRequest, _bool, bad, echo_logprobs, is_token_id,
                                         joined_logprobs, parse_chat, parse_completion, parse_completions, timings,
                                         usage)
from strata_jax.serving.responses import ResponseBuilder, parse_responses
from strata_jax.serving.responses import usage as responses_usage
from strata_jax.serving.tools import ToolCallStream, ToolParser

log = logging.getLogger("strata_jax")

MAX_BODY = 4 << 20  # the default --max-body
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
OPEN_PATHS = ("/health", "/")  # answered without an API key: load balancers and probes, the web UI's page
UI_DIR = Path(__file__).parent / "ui"
UI_PREFIX = "/ui/"  # the page's scripts and styles, public like the page (the API behind them is not)
DISCONNECT_POLL_S = 0.5
MONITOR_INTERVAL_S = (1.0, 0.25, 60.0)  # /v1/monitor/events: default, least and most seconds between events
MONITOR_MAX_COUNT = 1_000_000
MONITOR_PATH = "/v1/monitor/events"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JSON(Response):
    """Compact ASCII JSON: model output may hold any code point, and ASCII escapes always encode."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(e: APIError, path: str = "") -> Response:
    """The error in the envelope of the API that `path` belongs to (Anthropic's or OpenAI's)."""
    body = anthropic.error_body(e) if anthropic.is_anthropic_path(path) else e.body()
    return JSON(body, status_code=e.status, headers=e.headers)


def sse(obj: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""  # the Responses API names each event, as OpenAI's does
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenRequests:
    """HTTP requests being answered now, the monitor stream aside (it ends by itself on shutdown): a
    SIGTERM lets the server stop once this is 0 rather than wait out the whole grace period."""

    def __init__(self) -> None:
        self.n = 0


class Gate:
    """Pure ASGI middleware (so streaming is untouched): the API key check (OpenAI's Bearer header or
    Anthropic's x-api-key), per-request metrics and the count of open requests."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics: Metrics, open_requests: OpenRequests):
        self.app, self.metrics, self.open = app, metrics, open_requests
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.key):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, t0, status = endpoint_label(scope["path"]), time.perf_counter(), 500
        counted = scope["path"] != MONITOR_PATH
        self.open.n += counted

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            path = scope["path"]
            public = path in OPEN_PATHS or path.startswith(UI_PREFIX)
            if self.key is not None and not public and not self._authorized(scope):
                err = APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' (or "
                               "'x-api-key: <key>') with the key the server was started with (--api-key or "
                               "STRATA_JAX_API_KEY).", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err, scope["path"])(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.open.n -= counted
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


def _query_number(request: Request, name: str, default: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    """A query parameter as a number in [lo, hi] (an int when `integer`), or `default` when absent."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:
        kind = "an integer" if integer else "a number of seconds"
        raise bad(f"the query parameter {name}={raw[:40]!r} must be {kind} from {lo:g} to {hi:g}.", name)
    return value


def _piece_json(piece: bytes) -> str | list[int]:
    """A token's piece as llama.cpp's /tokenize gives it: the text, or its byte values where it is not whole
    UTF-8 (one byte of a character split across tokens)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes; the limit is {limit} ({fmt_bytes(limit)}): send a "
                    "smaller request, or restart the server with a larger --max-body.", code="request_too_large")


def _surrogate_at(obj: Any) -> str | None:
    """Where the first string (key or value) holding a lone UTF-16 surrogate is, e.g. "messages[0].content"."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str) and _SURROGATE.search(v):
            return where or "the body"
        if isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):
                    return f"the key {k.encode('utf-8', 'backslashreplace').decode()[:40]!r}"
                todo.append((f"{where}.{k}" if where else k, x))
        elif isinstance(v, list):
            todo += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return None


async def read_json(request: Request, limit: int = MAX_BODY) -> Any:
    """The body as JSON: at most `limit` bytes (refused from Content-Length before reading, else as soon
    as the stream passes it), strict UTF-8, and no lone surrogates (which json accepts as \\ud800 but no
    text can hold)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(f"over {limit}", limit)
        parts.append(part)
    raw = b"".join(parts)
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); send JSON "
                  "encoded as UTF-8.") from None
    try:
        body = json.loads(text.removeprefix("\ufeff"))
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON ({str(e)[:120]}); send a JSON object.") from None
    if _SURROGATE_ESCAPE.search(text) and (where := _surrogate_at(body)) is not None:
        raise bad(f"the request body has a lone UTF-16 surrogate escape (such as \\ud800) in {where}: JSON strings "
                  "must be valid Unicode; send the character itself or a complete surrogate pair.")
    return body


class Routes:
    def __init__(self, engine: Engine, metrics: Metrics, model_id: str, api_key: bool, max_body: int = MAX_BODY):
        self.engine, self.metrics, self.model_id, self.api_key = engine, metrics, model_id, api_key
        self.max_body = max_body
        self.created = int(time.time())

    # -- status ---------------------------------------------------------------------------------------
    def _status(self) -> str:
        e = self.engine
        status = {"ready": "ok", "idle": "loading", "loading": "loading"}.get(e.state, e.state)
        return "shutting_down" if e.draining and e.state == "ready" else status

    async def health(self, request: Request) -> Response:
        e = self.engine
        status = self._status()
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

    # -- token counts (OpenAI's input tokens; LlamaCppRoutes' token endpoints answer through _tokens_call too) ----
    async def _tokens_call(self, request: Request, work) -> Response:
        """Read the body, check that the model is ready and answer work(body) (run on a worker thread: it
        uses only the tokenizer) as JSON; bad input is a 400 naming the field."""
        try:
            body = await read_json(request, self.max_body)
            if not isinstance(body, dict):
                raise bad("the request body must be a JSON object.")
            self.engine.check_accepting()
            return JSON(await run_in_threadpool(work, body))
        except APIError as e:
            return error_response(e, request.url.path)
        except ClientDisconnect:
            return Response(status_code=499)

    async def chat_input_tokens(self, request: Request) -> Response:
        return await self._input_tokens(request, parse_chat)

    async def responses_input_tokens(self, request: Request) -> Response:
        return await self._input_tokens(request, lambda body: parse_responses(body)[0])

    async def _input_tokens(self, request: Request, parse) -> Response:
        """OpenAI's input token count (POST /v1/responses/input_tokens; llama.cpp's chat completions form too):
        the prompt's tokens as a generation would count them in usage, whether or not they fit the context."""
        def work(body: dict) -> dict:
            req = parse(body)
            parser, _ = self.engine.plan_tools(req)
            return {"object": "response.input_tokens",
                    "input_tokens": len(self.engine.tokenize(req, parser.prefix if parser else "", fit=False))}

        return await self._tokens_call(request, work)

    # -- the web UI and its monitor ------------------------------------------------------------------------
    async def ui(self, request: Request) -> Response:
        return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    def monitor_event(self) -> dict[str, Any]:
        """The engine's telemetry snapshot (serving/telemetry.py) with the server's state and the live queue."""
        e = self.engine
        return {**e.snapshot, "status": self._status(), "model": self.model_id, "queue_depth": e.queue_depth,
                "processing": e.processing, "parallel": e.parallel, "monitors": e.watchers}

    async def monitor(self, request: Request) -> Response:
        """GET /v1/monitor/events?interval=S&count=N: text/event-stream, one `data: <json>` event every S
        seconds (default 1), N events or until the client leaves or the server shuts down."""
        try:
            default, lo, hi = MONITOR_INTERVAL_S
            interval = _query_number(request, "interval", default, lo, hi)
            count = _query_number(request, "count", None, 1, MONITOR_MAX_COUNT, integer=True)
        except APIError as e:
            return error_response(e, request.url.path)
        return StreamingResponse(self._monitor_stream(request, interval, count), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    def _ending(self) -> bool:
        return self.engine.draining or self.engine.state in ("stopped", "error")

    async def _monitor_stream(self, request: Request, interval: float, count: int | None):
        e = self.engine
        e.watchers += 1  # the engine refreshes its snapshot while someone watches
        try:
            sent = 0
            while True:
                yield sse(self.monitor_event())
                sent += 1
                if (count is not None and sent >= count) or self._ending():  # the last event says why
                    return
                t_next = time.monotonic() + interval
                while (left := t_next - time.monotonic()) > 0 and not self._ending():
                    await asyncio.sleep(min(left, DISCONNECT_POLL_S))
                    # a shutdown may present itself as a disconnect: the ending event goes out first
                    if not self._ending() and await request.is_disconnected():
                        return
        finally:
            e.watchers -= 1

    # -- generation -------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.max_body)
            reqs = parse_completions(body)
        except APIError as e:
            return error_response(e, request.url.path)
        except ClientDisconnect:
            return Response(status_code=499)
        if len(reqs) == 1:
            return await self._generate(request, "completion", body)
        return await self._generate_batch(request, reqs)

    async def _generate_batch(self, request: Request, reqs: list[GenRequest]) -> Response:
        """Several prompts (OpenAI's batched completions): one job each, queued together, answered in one
        response whose choice i * n + j is prompt i's choice j and whose usage sums theirs."""
        t0, jobs = time.perf_counter(), []
        try:
            for req in reqs:
                self.engine.check_accepting()
                jobs.append(Job(req, await run_in_threadpool(self.engine.tokenize, req)))
        except APIError as e:
            return error_response(e, request.url.path)
        for job in jobs:
            self.engine.submit(job)
        env, out, use = Envelope("completion", self.model_id), None, None
        try:
            for i, job in enumerate(jobs):
                got = await self._gather_choices(request, job, await self._next(job, request), t0, job.req.n)
                if isinstance(got, Response):
                    return got
                texts, finals, n, ttft, lps, _ = got
                one_use, extra = self._account(job, env.endpoint, finals[0], 0 if job.req.scores_only else n, ttft)
                use = one_use if use is None else {k: _added(use[k], one_use[k]) for k in use}
                for j in range(job.req.n):
                    one = self._choice(job, env, texts[j], finals[j], lps[j], i * job.req.n + j, extra)
                    out = one if out is None else dict(out, choices=out["choices"] + one["choices"])
        finally:
            for job in jobs:
                job.cancel()  # a failed or abandoned batch stops the rest (a finished job ignores it)
        return JSON(dict(out, usage=use))

    async def _start(self, request: Request, parse, body: Any = None
                     ) -> tuple[GenRequest, Job, ToolParser | None, Event] | Response:
        """Validate, tokenize and queue a request (its body, read here unless given), and wait for its first
        event: (request, job, its tool-call parser, event), or the response when it ends before any output (an
        error, a disconnect)."""
        try:
            req = parse(await read_json(request, self.max_body) if body is None else body)
            self.engine.check_accepting()
            parser, req.constraint = self.engine.plan_tools(req)
            ids = await run_in_threadpool(self.engine.tokenize, req, parser.prefix if parser else "")
            job = Job(req, ids)
            self.engine.submit(job)
        except APIError as e:
            return error_response(e, request.url.path)
        except ClientDisconnect:  # gone before its body arrived: nothing to answer
            return Response(status_code=499)
        try:
            first = await self._next(job, request)
        except BaseException:
            job.cancel()
            raise
        if first is None:  # the client left while queued; it reads no answer
            return Response(status_code=499)
        if first.kind == "error":
            return error_response(first.error, request.url.path)
        return req, job, parser, first

    async def _generate(self, request: Request, endpoint: str, body: Any = None) -> Response:
        t0 = time.perf_counter()
        started = await self._start(request, parse_chat if endpoint == "chat" else parse_completion, body)
        if isinstance(started, Response):
            return started
        req, job, parser, first = started
        # any requested name is served by the one model, as llama.cpp's server does; the response names the
        # model that really answered (docs/design.md, "Model names"), never an echo of a name it does not serve
        env = Envelope(endpoint, self.model_id)
        if req.stream:
            return StreamingResponse(self._stream(job, req, env, first, t0, parser), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await self._collect(request, job, req, env, first, t0, parser)

    async def responses(self, request: Request) -> Response:
        t0 = time.perf_counter()
        echo: dict[str, Any] = {}

        def parse(body: Any) -> GenRequest:
            req, options = parse_responses(body)
            echo.update(options)
            return req

        started = await self._start(request, parse)
        if isinstance(started, Response):
            return started
        req, job, parser, first = started
        rb = ResponseBuilder(self.model_id, echo)  # the served model's name, whatever was asked (_generate)
        if req.stream:
            return StreamingResponse(self._responses_stream(job, rb, first, t0, parser),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        gathered = await self._gather_calls(request, job, first, t0, parser)
        if isinstance(gathered, Response):
            return gathered
        content, calls, ev, n, ttft = gathered
        text = content or ""
        use, extra = self._account(job, "responses", ev, n, ttft)
        return JSON(rb.final(text, calls, ev.chunk.finish_reason, self._responses_usage(use), extra))

    @staticmethod
    def _responses_usage(use: dict) -> dict:
        return responses_usage(use["prompt_tokens"], use["completion_tokens"],
                               use["prompt_tokens_details"]["cached_tokens"])

    async def _responses_stream(self, job: Job, rb: ResponseBuilder, ev: Event, t0: float,
                                parser: ToolParser | None):
        tools = ToolCallStream(parser) if parser is not None else None
        n, ttft = 0, None
        try:
            for e in rb.start():
                yield sse(e, e["type"])
            while True:
                if ev.kind == "error":
                    for e in rb.error(ev.error.body()):
                        yield sse(e, e["type"])
                    return
                ttft = ev.t - t0 if ttft is None else ttft
                n += len(ev.chunk.token_ids)
                text = tools.feed(ev.chunk.text) if tools else ev.chunk.text
                for e in rb.delta(text) if text else []:
                    yield sse(e, e["type"])
                if ev.kind == "final":
                    break
                ev = await job.events.get()
            calls: list[dict] = []
            if tools:
                rest, _, calls = tools.finish()  # the calls go out whole, after the message
                for e in rb.delta(rest) if rest else []:
                    yield sse(e, e["type"])
            use, extra = self._account(job, "responses", ev, n, ttft)
            for e in rb.finish(calls, ev.chunk.finish_reason, self._responses_usage(use), extra):
                yield sse(e, e["type"])
        finally:
            job.cancel()

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

    def _account(self, job: Job, endpoint: str, final: Event, n: int, ttft: float) -> tuple[dict, dict]:
        """usage and the llama.cpp-style extras (timings, expert_cache) of a finished job (final: its first
        choice's last event; n: the tokens of all its choices, the prompt counted once as OpenAI does);
        updates metrics."""
        t = final.chunk.timings or {}
        prompt_n, cached = len(job.prompt_ids), int(t.get("cache_n", 0) or 0)
        extra: dict[str, Any] = {"timings": timings(t)}
        if final.expert_cache:
            extra["expert_cache"] = final.expert_cache
        label = {"chat": "chat_completions", "completion": "completions"}.get(endpoint, endpoint)
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

    async def _gather(self, request: Request, job: Job, ev: Event | None,
                      t0: float) -> tuple[str, Event, int, float, list, list[int]] | Response:
        """A one-choice job's whole output: (text, the final event, tokens, time to first token, logprobs, the
        token ids), or the response when it ends otherwise."""
        got = await self._gather_choices(request, job, ev, t0, 1)
        if isinstance(got, Response):
            return got
        texts, finals, n, ttft, lps, ids = got
        return texts[0], finals[0], n, ttft, lps[0], ids[0]

    async def _gather_calls(self, request: Request, job: Job, ev: Event | None, t0: float,
                            parser: ToolParser | None) -> tuple[str | None, list, Event, int, float] | Response:
        """A one-choice job's output split by its tool-call parser: (content, tool calls, the final event,
        tokens, time to first token), or the response when it ends otherwise."""
        got = await self._gather(request, job, ev, t0)
        if isinstance(got, Response):
            return got
        text, ev, n, ttft, _, _ = got
        content, calls = parser.parse(parser.prefix + text) if parser is not None else (text, [])
        return content, calls, ev, n, ttft

    async def _gather_choices(self, request: Request, job: Job, ev: Event | None, t0: float,
                              n_choices: int) -> tuple[list[str], list[Event], int, float, list[list], list[list[int]]
                                                       ] | Response:
        """Every choice's whole output: (texts, final events, tokens of all choices, time to first token,
        logprobs, token ids), each list by choice index; or the response when the job ends otherwise."""
        parts: list[list[str]] = [[] for _ in range(n_choices)]
        lps: list[list] = [[] for _ in range(n_choices)]
        ids: list[list[int]] = [[] for _ in range(n_choices)]
        finals: dict[int, Event] = {}
        n, ttft = 0, None
        while True:
            if ev is None:
                return Response(status_code=499)
            if ev.kind == "error":
                job.cancel()  # its other choices stop too
                return error_response(ev.error, request.url.path)
            ttft = ev.t - t0 if ttft is None else ttft
            if ev.chunk.prompt_logprobs is not None:
                job.prompt_logprobs = ev.chunk.prompt_logprobs
            parts[ev.index].append(ev.chunk.text)
            lps[ev.index] += ev.chunk.logprobs or []
            ids[ev.index] += ev.chunk.token_ids
            n += len(ev.chunk.token_ids)
            if ev.kind == "final":
                finals[ev.index] = ev
                if len(finals) == n_choices:
                    return ["".join(p) for p in parts], [finals[i] for i in range(n_choices)], n, ttft, lps, ids
            ev = await self._next(job, request)

    async def _collect(self, request: Request, job: Job, req: GenRequest, env: Envelope, ev: Event | None,
                       t0: float, parser: ToolParser | None) -> Response:
        got = await self._gather_choices(request, job, ev, t0, req.n)
        if isinstance(got, Response):
            return got
        texts, finals, n, ttft, lps, _ = got
        use, extra = self._account(job, env.endpoint, finals[0], 0 if req.scores_only else n, ttft)
        out = None
        for i in range(req.n):
            one = self._choice(job, env, texts[i], finals[i], lps[i], i, extra, parser, use)
            out = one if out is None else dict(out, choices=out["choices"] + one["choices"])
        return JSON(out)

    def _choice(self, job: Job, env: Envelope, text: str, final: Event, lps: list, index: int, extra: dict,
                parser: ToolParser | None = None, use: dict | None = None) -> dict:
        """One choice's response object (its tool calls parsed, its echo and logprobs in place)."""
        req, finish, calls = job.req, final.chunk.finish_reason, []
        if req.scores_only:  # the prefill's one token is not part of the reply
            text, lps = "", []
        if parser is not None:
            text, calls = parser.parse(parser.prefix + text)
            finish = "tool_calls" if calls else finish
        lp = self._logprobs_of(job, env)(lps) if lps or not req.echo else None
        if req.echo:
            echoed, echoed_lp = self._echo(job)
            text, lp = echoed + text, joined_logprobs(echoed_lp, lp)
        return env.response(text, finish, use, extra, calls, logprobs=lp, index=index)

    def _echo(self, job: Job) -> tuple[str, dict | None]:
        """An echoed prompt: its text (as given, or its token ids' text) and, with logprobs, its logprobs."""
        m, p = self.engine.model, job.req.prompt
        text = p if isinstance(p, str) else m.detokenize(p)
        if not job.req.logprobs:
            return text, None
        return text, echo_logprobs(job.prompt_ids, job.prompt_logprobs or [], m.token_bytes)

    async def _stream(self, job: Job, req: GenRequest, env: Envelope, ev: Event, t0: float,
                      parser: ToolParser | None):
        """SSE chunks; with n > 1 the choices' chunks interleave, each with its index, and each choice
        ends with its own finish chunk (the last one carries timings, then the usage chunk). echo: each
        choice starts with the prompt's text (and its logprobs: the first event carries them)."""
        tools = [ToolCallStream(parser) if parser is not None else None for _ in range(req.n)]
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
            if req.echo:
                job.prompt_logprobs = ev.chunk.prompt_logprobs
                text, lp = self._echo(job)
                for i in range(req.n):
                    yield sse(env.chunk(text=text, logprobs=lp, index=i))
            while True:
                if ev.kind == "error":  # after the headers: an error event, as llama.cpp sends, then [DONE]
                    yield sse(ev.error.body())
                    yield "data: [DONE]\n\n"
                    return
                i, tool = ev.index, tools[ev.index]
                ttft = ev.t - t0 if ttft is None else ttft
                quiet = req.scores_only  # the one token a prefill gives is not part of the reply
                n += 0 if quiet else len(ev.chunk.token_ids)
                lps[i] += [] if quiet else ev.chunk.logprobs or []
                text = "" if quiet else tool.feed(ev.chunk.text) if tool else ev.chunk.text
                if text:
                    yield sse(env.chunk(text=text, logprobs=take_lps(i), index=i))
                for delta in tool.take_deltas() if tool else []:
                    yield sse(env.chunk(tool_calls=delta, logprobs=take_lps(i) if lps[i] else None, index=i))
                if ev.kind == "final":
                    finish = ev.chunk.finish_reason
                    if tool:
                        rest, deltas, calls = tool.finish()
                        if rest:
                            yield sse(env.chunk(text=rest, logprobs=take_lps(i), index=i))
                        for delta in deltas:
                            yield sse(env.chunk(tool_calls=delta, logprobs=take_lps(i) if lps[i] else None, index=i))
                        finish = "tool_calls" if calls else finish
                    if i == 0:
                        first_final = ev
                    finals += 1
                    if finals == req.n:
                        use, extra = self._account(job, env.endpoint, first_final or ev, n, ttft)
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


def _added(a: Any, b: Any) -> Any:
    """Two usage values summed (numbers, or objects of numbers such as prompt_tokens_details)."""
    return {k: _added(a[k], b[k]) for k in a} if isinstance(a, dict) else a + b


class AnthropicRoutes:
    """/v1/messages and /v1/messages/count_tokens over the same engine (wire format: anthropic.py)."""

    def __init__(self, routes: Routes):
        self.r = routes

    async def count_tokens(self, request: Request) -> Response:
        try:
            req = anthropic.parse_messages(await read_json(request, self.r.max_body), count_only=True)
            self.r.engine.check_accepting()
            ids = await run_in_threadpool(self.r.engine.tokenize, req)
        except APIError as e:
            return error_response(e, request.url.path)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSON({"input_tokens": len(ids)})

    async def messages(self, request: Request) -> Response:
        t0 = time.perf_counter()
        started = await self.r._start(request, anthropic.parse_messages)
        if isinstance(started, Response):
            return started
        req, job, parser, first = started
        env = Envelope("messages", self.r.model_id, id=anthropic.new_id())  # the served name, as _generate
        if req.stream:
            return StreamingResponse(self._stream(job, req, env, first, t0, parser), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        gathered = await self.r._gather_calls(request, job, first, t0, parser)
        if isinstance(gathered, Response):
            return gathered
        text, calls, ev, n, ttft = gathered
        blocks = anthropic.content_blocks(text, calls)
        reason = anthropic.stop_reason(ev.chunk.finish_reason, ev.chunk.stop_string, blocks)
        _, extra = self.r._account(job, env.endpoint, ev, n, ttft)
        use = anthropic.usage(len(job.prompt_ids), n, int((ev.chunk.timings or {}).get("cache_n", 0) or 0))
        return JSON(anthropic.message(env.id, env.model, blocks, reason,
                                      ev.chunk.stop_string if reason == "stop_sequence" else None, use, extra))

    async def _stream(self, job: Job, req: GenRequest, env: Envelope, ev: Event, t0: float,
                      parser: ToolParser | None):
        tools = ToolCallStream(parser) if parser is not None else None
        # the cache read is known once the request ends: message_delta's usage (cumulative) corrects it
        out = anthropic.MessageStream(env.id, env.model, len(job.prompt_ids), 0, tools=tools is not None)
        n, ttft = 0, None
        try:
            for e in out.start():
                yield e
            while True:
                if ev.kind == "error":  # after the headers: Anthropic's error event ends the stream
                    yield out.error(ev.error)
                    return
                ttft = ev.t - t0 if ttft is None else ttft
                n += len(ev.chunk.token_ids)
                for e in out.delta(tools.feed(ev.chunk.text) if tools else ev.chunk.text):
                    yield e
                if ev.kind == "final":
                    break
                ev = await job.events.get()
            rest, _, calls = tools.finish() if tools else ("", [], [])
            _, extra = self.r._account(job, env.endpoint, ev, n, ttft)
            out.cached_n = int((ev.chunk.timings or {}).get("cache_n", 0) or 0)
            events, _ = out.finish(rest, calls, ev.chunk.finish_reason, ev.chunk.stop_string, n, extra)
            for e in events:
                yield e
        finally:
            job.cancel()


class LlamaCppRoutes:
    """llama.cpp's own endpoints over the same engine: /completion and /infill (wire format: llamacpp.py), /props,
    /tokenize, /detokenize and /apply-template."""

    def __init__(self, routes: Routes):
        self.r = routes

    async def props(self, request: Request) -> Response:
        """GET /props: llama.cpp's server properties, the fields a client reads (context, slots, the chat
        template, the defaults a /completion or /infill request gets), without llama.cpp's per-slot internals."""
        try:
            self.r.engine.check_accepting()
        except APIError as e:
            return error_response(e, request.url.path)
        m = self.r.engine.model
        params = llamacpp.default_settings(m.ctx) | {"speculative.n_max": m.spec_max if m.spec else 0}
        return JSON({"default_generation_settings": {"n_ctx": m.ctx, "speculative": bool(m.spec), "params": params},
                     "total_slots": self.r.engine.parallel, "model_alias": self.r.model_id,
                     "model_path": m.gguf.path, "chat_template": m.tokenizer.chat_template or "",
                     "modalities": {"vision": False, "audio": False}, "build_info": f"strata-jax {__version__}",
                     "is_sleeping": False})

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize {content, add_special=false, parse_special=true, with_pieces=false}: {"tokens": ids},
        or [{"id", "piece"}] with pieces (a piece that is not whole UTF-8 comes as its byte values). content
        may mix strings and token ids, as llama.cpp's does."""
        def work(body: dict) -> dict:
            content = body.get("content")
            parts = content if isinstance(content, list) else [content]
            if not isinstance(content, (str, list)) or not all(isinstance(p, str) or is_token_id(p) for p in parts):
                raise bad("'content' must be the text to tokenize: a string, or an array of strings and token ids.",
                          "content")
            add, parse, pieces = (_bool(body, k, v) for k, v in (("add_special", False), ("parse_special", True),
                                                                 ("with_pieces", False)))
            m = self.r.engine.model
            ids: list[int] = []
            for i, p in enumerate(parts):  # special tokens (BOS) only before the first piece of text
                ids += [p] if not isinstance(p, str) else m.tokenize(p, add_special=add and i == 0,
                                                                     parse_special=parse)
            if not pieces:
                return {"tokens": ids}
            return {"tokens": [{"id": t, "piece": _piece_json(m.tokenizer.piece(t))} for t in ids]}

        return await self.r._tokens_call(request, work)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize {tokens}: {"content": the tokens' pieces joined, special tokens spelled out}."""
        def work(body: dict) -> dict:
            tokens, n = body.get("tokens", []), self.r.engine.model.config.vocab_size
            if not isinstance(tokens, list) or not all(is_token_id(t) for t in tokens):
                raise bad("'tokens' must be an array of token ids (integers).", "tokens")
            if outside := [t for t in tokens if not 0 <= t < n]:
                raise bad(f"token ids {outside[:5]} are outside the vocabulary [0, {n}).", "tokens")
            tok = self.r.engine.model.tokenizer
            return {"content": b"".join(tok.piece(t) for t in tokens).decode("utf-8", errors="replace")}

        return await self.r._tokens_call(request, work)

    async def apply_template(self, request: Request) -> Response:
        """POST /apply-template (a chat completions body): {"prompt": the text the chat template makes of it,
        as a chat request would be prompted, tools and a forced call's opening included}."""
        def work(body: dict) -> dict:
            req = parse_chat(body)
            parser, _ = self.r.engine.plan_tools(req)
            return {"prompt": self.r.engine.render(req, parser.prefix if parser else "")}

        return await self.r._tokens_call(request, work)

    async def completion(self, request: Request) -> Response:
        return await self._run(request, infill=False)

    async def infill(self, request: Request) -> Response:
        return await self._run(request, infill=True)

    async def _run(self, request: Request, infill: bool) -> Response:
        t0 = time.perf_counter()
        r = self.r
        try:
            body = await read_json(request, r.max_body)
            req = llamacpp.parse(body, infill=infill)
            if req.max_tokens == 0:  # n_predict 0: llama.cpp evaluates the prompt only; nothing comes back from it
                r.engine.check_accepting()
                ids = await run_in_threadpool(r.engine.tokenize, req)
                return JSON(self._final(req, body, ids, "", [], None, {}, {}))
        except APIError as e:
            return error_response(e, request.url.path)
        except ClientDisconnect:
            return Response(status_code=499)
        started = await r._start(request, lambda _: req, body)  # parsed above
        if isinstance(started, Response):
            return started
        req, job, _, first = started
        if req.stream:
            return StreamingResponse(self._stream(job, req, body, first, t0), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        got = await r._gather(request, job, first, t0)
        if isinstance(got, Response):
            return got
        text, ev, n, ttft, lps, ids = got
        _, extra = r._account(job, "llamacpp", ev, n, ttft)
        if req.logprobs:
            extra["completion_probabilities"] = llamacpp.probs(lps, r.engine.model.token_bytes)
        return JSON(self._final(req, body, job.prompt_ids, text, ids, ev, extra.pop("timings"), extra))

    def _final(self, req: GenRequest, body: Any, prompt_ids: list[int], text: str, ids: list[int], ev: Event | None,
               timings: dict, extra: dict, streamed: bool = False) -> dict:
        m = self.r.engine.model
        return llamacpp.final(model=self.r.model_id, text=text, ids=ids, show_ids=llamacpp.return_tokens(body),
                              prompt=m.tokenizer.decode(prompt_ids, skip_special=False), evaluated=len(prompt_ids),
                              cached=int(timings.get("cache_n", 0) or 0), n_ctx=m.ctx, req=req,
                              finish_reason=ev.chunk.finish_reason if ev else "length",
                              stop_string=ev.chunk.stop_string if ev else None, timings=timings, streamed=streamed,
                              extra=extra)

    async def _stream(self, job: Job, req: GenRequest, body: Any, ev: Event, t0: float):
        ids: list[int] = []
        text, ttft = "", None
        try:
            while True:
                if ev.kind == "error":  # after the headers: an error event ends the stream, as llama.cpp's does
                    yield sse(ev.error.body())
                    return
                ttft = ev.t - t0 if ttft is None else ttft
                ids += ev.chunk.token_ids
                text += ev.chunk.text
                if ev.chunk.text or ev.chunk.token_ids:
                    probs = llamacpp.probs(ev.chunk.logprobs or [], self.r.engine.model.token_bytes)
                    yield sse(llamacpp.chunk(ev.chunk.text, list(ev.chunk.token_ids), len(ids), len(job.prompt_ids),
                                             probs))
                if ev.kind == "final":
                    break
                ev = await job.events.get()
            _, extra = self.r._account(job, "llamacpp", ev, len(ids), ttft)
            yield sse(self._final(req, body, job.prompt_ids, text, ids, ev, extra.pop("timings"), extra, streamed=True))
        finally:
            job.cancel()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = (f"no endpoint {request.url.path}: use /v1/chat/completions, /v1/completions, /v1/responses, "
               "/v1/messages, /v1/models, /v1/monitor/events, /health, /metrics, llama.cpp's /completion, /infill, "
               "/props, /tokenize, /detokenize, /apply-template, or the web UI at /.")
    elif exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}."
    else:
        msg = str(exc.detail)
    return error_response(APIError(exc.status_code, msg, headers=dict(exc.headers or {})), request.url.path)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None, metrics: Metrics | None = None,
               max_body: int = MAX_BODY) -> Starlette:
    """The ASGI app. Its lifespan starts the engine (loading in the background) and shuts it down.
    max_body: the largest request body in bytes (larger ones get 413)."""
    metrics = metrics or Metrics()
    r = Routes(engine, metrics, model_id, api_key=bool(api_key), max_body=max_body)
    a = AnthropicRoutes(r)
    n = LlamaCppRoutes(r)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown)

    routes = [Route("/health", r.health), Route("/metrics", r.metrics_text), Route("/metrics.json", r.metrics_text),
              Route("/", r.ui), Mount(UI_PREFIX.rstrip("/"), StaticFiles(directory=UI_DIR)),
              Route(MONITOR_PATH, r.monitor), Route("/props", n.props),
              Route("/tokenize", n.tokenize, methods=["POST"]), Route("/detokenize", n.detokenize, methods=["POST"]),
              Route("/apply-template", n.apply_template, methods=["POST"]),
              Route("/completion", n.completion, methods=["POST"]), Route("/infill", n.infill, methods=["POST"])]
    for prefix in ("/v1", ""):  # llama.cpp answers without the /v1 prefix too
        routes += [Route(prefix + "/models", r.models),
                   Route(prefix + "/chat/completions", r.chat, methods=["POST"]),
                   Route(prefix + "/completions", r.completions, methods=["POST"]),
                   Route(prefix + "/responses", r.responses, methods=["POST"]),
                   Route(prefix + "/responses/input_tokens", r.responses_input_tokens, methods=["POST"]),
                   Route(prefix + "/chat/completions/input_tokens", r.chat_input_tokens, methods=["POST"]),
                   Route(prefix + "/messages", a.messages, methods=["POST"]),
                   Route(prefix + "/messages/count_tokens", a.count_tokens, methods=["POST"])]
    open_requests = OpenRequests()
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(Gate, api_key=api_key, metrics=metrics, open_requests=open_requests)],
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.engine, app.state.metrics, app.state.open_requests = engine, metrics, open_requests
    return app
