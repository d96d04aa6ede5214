"""The engine: one thread that loads and owns the Model, and a bounded FIFO of jobs feeding it.

JAX state (the donated KV cache, expert slots, counters) is not thread-safe, so every call that
touches it (load, warm-up, generate_stream, stats) runs on the engine thread. HTTP handlers only
tokenize (the tokenizer is plain Python/Rust and safe to share), enqueue, and read events that the
engine posts into their asyncio loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from strata_jax.errors import StrataError
from strata_jax.serving.protocol import APIError, GenRequest, bad

log = logging.getLogger("strata_jax")

EXPERT_COUNTERS = ("lookups", "hits", "misses", "bytes_h2d", "prefill_streamed_experts")


@dataclasses.dataclass
class Event:
    """What the engine tells a waiting handler: "chunk" (streamed text), "final" (the last chunk, with
    timings and this request's expert-cache counters) or "error" (an APIError; nothing follows)."""

    kind: str
    chunk: Any = None  # GenerationChunk
    error: APIError | None = None
    expert_cache: dict[str, Any] | None = None
    t: float = dataclasses.field(default_factory=time.perf_counter)


class Job:
    """One generation request in flight: the validated request, its prompt ids, and the channel back."""

    def __init__(self, req: GenRequest, prompt_ids: list[int], loop: asyncio.AbstractEventLoop | None = None):
        self.req, self.prompt_ids = req, prompt_ids
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Ask the engine to skip this job or stop it before its next token."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class Engine:
    """Loads the model on its own thread (so /health answers at once), warms it up, then serves jobs
    one at a time in arrival order."""

    def __init__(self, loader: Callable[[], Any], *, queue_size: int = 64, warmup: bool = True,
                 on_load_error: Callable[[BaseException], None] | None = None):
        self._loader, self._warmup, self._on_load_error = loader, warmup, on_load_error
        self.queue_size = queue_size
        self._q: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.state = "idle"  # idle -> loading -> ready | error; stopped after shutdown
        self.model: Any = None
        self.load_error: str | None = None
        self.draining = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: Job | None = None
        self._last_expert: dict[str, int] = {}
        self._cache_kw = False
        # telemetry read on the engine thread after each job, for /metrics (never touch the model there)
        self.snapshot: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.state = "loading"
            self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
            self._thread.start()

    def begin_drain(self) -> None:
        """Refuse new work (503) while what is queued or running finishes."""
        self.draining = True

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop: fail queued jobs with 503, cancel the running one between tokens, join the thread."""
        self.draining = True
        self._stop.set()
        cur = self._current
        if cur is not None:
            cur.cancel()
        self._fail_pending()
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = "stopped"

    def wait_ready(self, timeout: float | None = None) -> bool:
        t_end = None if timeout is None else time.monotonic() + timeout
        while self.state in ("idle", "loading"):
            if t_end is not None and time.monotonic() > t_end:
                return False
            time.sleep(0.02)
        return self.state == "ready"

    # -- requests (called from the event loop / worker threads) ------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._q.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    def check_accepting(self) -> None:
        if self.draining or self._stop.is_set():
            raise APIError(503, "the server is shutting down and accepts no new requests.", code="shutting_down")
        if self.state in ("idle", "loading"):
            raise APIError(503, "the model is still loading; retry in a few seconds (GET /health says when it is "
                           "ready).", code="model_loading", headers={"Retry-After": "2"})
        if self.state != "ready":
            raise APIError(503, f"the model is not available: {self.load_error or self.state}.",
                           code="model_unavailable")

    def tokenize(self, req: GenRequest) -> list[int]:
        """The prompt's token ids (chat template applied), checked against the context. Runs on a
        worker thread: it uses only the tokenizer."""
        m = self.model
        kwargs = dict(req.template_kwargs)
        if req.tools:
            kwargs["tools"] = req.tools
        if req.reasoning_effort in ("none", "minimal"):
            templates = [m.tokenizer.chat_template or "", *getattr(m.tokenizer, "named_templates", {}).values()]
            if any("enable_thinking" in t for t in templates):
                kwargs.setdefault("enable_thinking", False)
        try:
            ids = m.prompt_tokens(req.prompt, **kwargs)
        except StrataError as e:
            raise bad(str(e), req.prompt_param) from None
        if not ids:
            raise bad(f"the {req.prompt_param} tokenize to nothing; give some text.", req.prompt_param)
        if len(ids) + 1 > m.ctx:
            raise bad(f"the prompt is {len(ids)} tokens, but the context is {m.ctx} tokens and must also hold at "
                      f"least one generated token: shorten the {req.prompt_param} or restart the server with a "
                      f"larger --ctx (the model was trained for {m.config.context_length}).", req.prompt_param,
                      code="context_length_exceeded")
        return ids

    def submit(self, job: Job) -> None:
        self.check_accepting()
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy: {self.queue_size} requests are already waiting. Retry "
                           "shortly.", code="queue_full", headers={"Retry-After": "1"}) from None

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            model = self._loader()
            self._cache_kw = "cache_prompt" in inspect.signature(model.generate_stream).parameters
            if self._warmup:
                self._warm(model)
        except BaseException as e:  # noqa: BLE001 - reported through /health and the callback
            self.load_error = str(e) if isinstance(e, StrataError) else f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.load_error)
            self.state = "error"
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        self.model = model
        self._last_expert = self._expert_counters(model)
        self.snapshot = {"kv_tokens": 0, "ctx": model.ctx, "expert": _summary(model.stats())}
        self.state = "ready"
        while not self._stop.is_set():
            try:
                job = self._q.get(timeout=0.25)  # a put wakes this at once; the timeout only bounds stop checks
            except queue.Empty:
                continue
            if job.cancelled:
                continue
            self._current = job
            try:
                self._serve(job)
            finally:
                self._current = None
        self._fail_pending()

    def _warm(self, model: Any) -> None:
        """Compile the decode step and the smallest prefill before the first request pays for it."""
        t0 = time.perf_counter()
        kw = {"cache_prompt": False} if self._cache_kw else {}
        for _ in model.generate_stream(model.tokenize("Hello") or [0], max_tokens=2, temperature=0.0, **kw):
            pass
        log.info("warm-up (compilation) took %.1f s", time.perf_counter() - t0)

    def _serve(self, job: Job) -> None:
        m, req = self.model, job.req
        kwargs = req.sampling()
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = m.ctx  # generate_stream caps it at what the context has left
        if self._cache_kw:
            kwargs["cache_prompt"] = req.cache_prompt
        n_gen = 0
        try:
            gen = m.generate_stream(job.prompt_ids, **kwargs)
            try:
                for chunk in gen:
                    n_gen += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        job.emit(Event("final", chunk, expert_cache=self._expert_delta(m)))
                        break
                    job.emit(Event("chunk", chunk))
                    if job.cancelled or self._stop.is_set():  # the client went away: stop before the next token
                        log.info("request cancelled after %d generated tokens", n_gen)
                        break
            finally:
                gen.close()
        except StrataError as e:
            job.emit(Event("error", error=bad(str(e))))
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            log.exception("generation failed")
            job.emit(Event("error", error=APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                                   code="engine_error")))
        finally:
            try:
                st = m.stats()
            except Exception:  # noqa: BLE001 - telemetry must not take the engine down
                st = {}
            if st:  # a cancelled or failed job still moved experts: keep the next request's delta its own
                self._last_expert = {k: int(st.get(k) or 0) for k in EXPERT_COUNTERS}
            self.snapshot = {"kv_tokens": len(job.prompt_ids) + n_gen, "ctx": m.ctx, "expert": _summary(st)}

    def _fail_pending(self) -> None:
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            job.emit(Event("error", error=APIError(503, "the server is shutting down; the request was not run.",
                                                   code="shutting_down")))

    # -- telemetry (engine thread only: stats() reads donated device state) ---------------------------
    @staticmethod
    def _expert_counters(m: Any) -> dict[str, int]:
        st = m.stats()
        return {k: int(st.get(k) or 0) for k in EXPERT_COUNTERS} if st else {}

    def _expert_delta(self, m: Any) -> dict[str, Any]:
        now = self._expert_counters(m)
        if not now:
            return {}
        d = {k: now[k] - self._last_expert.get(k, 0) for k in EXPERT_COUNTERS}
        d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else None
        self._last_expert = now
        return d


def _summary(st: dict[str, Any]) -> dict[str, Any]:
    keys = ("lookups", "hits", "misses", "hit_rate", "bytes_h2d", "expert_slots", "total_experts")
    return {k: st.get(k) for k in keys} if st else {}
