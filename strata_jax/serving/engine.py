"""The engine: one thread that loads and owns the Model, and a bounded FIFO of jobs feeding it.

JAX state (the donated KV cache, expert slots, counters) is not thread-safe, so every call that
touches it (load, warm-up, generation, stats) runs on the engine thread. HTTP handlers only
tokenize (the tokenizer is plain Python/Rust and safe to share), enqueue, and read events that the
engine posts into their asyncio loop with call_soon_threadsafe.

The engine runs a Session of `parallel` rows (engine/session.py; one row is Model.generate_stream's
own session): between decode calls it admits queued jobs into free rows (each admission prefills its
row), then a call decodes up to decode_chunk tokens for every running job; a finished or cancelled job
frees its row at once. A job with n > 1 choices runs each in a row of its own, admitted one after
another (before new jobs); a choice admitted while another is running shares its prefilled prompt (the
KV row is copied, Session.fork), one admitted after another finished finds the prompt in the prefix
cache. Choice i > 0 of a seeded job samples with a seed of its own derived from (seed, i). A job's
expert-cache counters are the engine's totals over the job's lifetime, so with several rows they include the concurrent jobs' lookups and transfers (the experts a step
fetches are shared by all its rows).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from strata_jax.core.errors import ConfigError, StrataError
from strata_jax.engine import constrained
from strata_jax.engine.config import check_option
from strata_jax.serving.protocol import APIError, GenRequest, bad
from strata_jax.serving.telemetry import Telemetry
from strata_jax.serving.tools import Family, ToolParser, call_grammar, detect_family, marker_ids

log = logging.getLogger("strata_jax")

SNAPSHOT_PERIOD_S = 0.5  # how often a watched engine refreshes its snapshot
EXPERT_COUNTERS = ("lookups", "hits", "misses", "bytes_h2d", "prefill_streamed_experts", "prefetched",
                   "transfer_stall_seconds", "cold_experts")


@dataclasses.dataclass
class Event:
    """What the engine tells a waiting handler: "chunk" (streamed text), "final" (the last chunk, with
    timings and this request's expert-cache counters) or "error" (an APIError; nothing follows)."""

    kind: str
    chunk: Any = None  # GenerationChunk
    error: APIError | None = None
    expert_cache: dict[str, Any] | None = None
    t: float = dataclasses.field(default_factory=time.perf_counter)
    index: int = 0  # the choice it belongs to (n > 1)


class Job:
    """One generation request in flight: the validated request, its prompt ids, and the channel back."""

    def __init__(self, req: GenRequest, prompt_ids: list[int], loop: asyncio.AbstractEventLoop | None = None):
        self.req, self.prompt_ids = req, prompt_ids
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self.expert_base: dict[str, int] = {}  # the engine's expert counters when the job started (batched)
        self.admitted = 0  # choices admitted so far (of req.n)
        self.prompt_logprobs: list | None = None  # echo with logprobs: the prompt's TokenLogprobs, once they came

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
    """Loads the model on its own thread (so /health answers at once), warms it up, then serves jobs in
    arrival order: one at a time, or up to `parallel` at once in a batch."""

    def __init__(self, loader: Callable[[], Any], *, queue_size: int = 64, warmup: bool = True,
                 parallel: int = 1, on_load_error: Callable[[BaseException], None] | None = None):
        self._loader, self._warmup, self._on_load_error = loader, warmup, on_load_error
        self.parallel = check_option("parallel", parallel)
        self.queue_size = queue_size
        self._q: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.state = "idle"  # idle -> loading -> ready | error; stopped after shutdown
        self.model: Any = None
        self.load_error: str | None = None
        self.draining = False
        self.drain_until = 0.0  # time.monotonic() when the shutdown grace period ends
        self._stop = threading.Event()
        self._end_running = threading.Event()
        self._thread: threading.Thread | None = None
        self._active: dict[int, Job] = {}  # session row -> its job
        self.tool_family: Family | None = None  # the chat template's tool-call format, chosen at load
        self._keep_ids: tuple[int, ...] = ()  # the special tokens that format is written in
        self._index: dict[int, int] = {}  # session row -> the choice of its job it runs
        self._more: collections.deque[Job] = collections.deque()  # jobs with choices still to admit
        # telemetry read on the engine thread after each job, for /metrics and the monitor (never touch the
        # model there); while `watchers` > 0 (live monitor streams) it is also refreshed every SNAPSHOT_PERIOD_S
        self.snapshot: dict[str, Any] = {}
        self.telemetry = Telemetry()
        self.watchers = 0
        self._t_snapshot = 0.0

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self.state = "loading"
            self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
            self._thread.start()

    def begin_drain(self, grace: float = 0.0) -> None:
        """Refuse new work (503 with Retry-After) while what is queued or running finishes, for up to
        `grace` seconds."""
        self.drain_until = time.monotonic() + grace
        self.draining = True

    def end_running(self) -> None:
        """End every running and queued job with a 503 error event (the shutdown grace period is over);
        the engine thread does it before its next step, so each stream gets its closing events."""
        self._end_running.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop: fail queued jobs with 503, end the running ones between steps (each with an error event),
        join the thread."""
        self.draining = True
        self._end_running.set()
        self._stop.set()
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
        return self.processing > 0

    @property
    def processing(self) -> int:
        """Jobs running now (each holds a KV-cache row when batched)."""
        return len(self._active)

    def check_accepting(self) -> None:
        if self.draining or self._stop.is_set():
            # by then this process has stopped: a restarted server (or another replica) takes the retry
            retry = max(1, math.ceil(self.drain_until - time.monotonic()))
            raise APIError(503, f"the server is shutting down and accepts no new requests; retry in {retry} s "
                           "(on a restarted server or another replica).", code="shutting_down",
                           headers={"Retry-After": str(retry)})
        if self.state in ("idle", "loading"):
            raise APIError(503, "the model is still loading; retry in a few seconds (GET /health says when it is "
                           "ready).", code="model_loading", headers={"Retry-After": "2"})
        if self.state != "ready":
            raise APIError(503, f"the model is not available: {self.load_error or self.state}.",
                           code="model_unavailable")

    def plan_tools(self, req: GenRequest) -> tuple[ToolParser | None, str | None]:
        """(the request's tool-call parser, None without tools; the constraint it runs under: req.constraint,
        or the grammar of the tool call it must make). tool_choice "required" or a named function makes the
        reply a grammar of the family's calls; without llguidance it starts the reply with the family's call
        opener (and the name) instead: the model continues a call, nothing constrains what it writes in it."""
        if not req.tools:
            return None, req.constraint
        family = self.tool_family or detect_family(None)
        names = [t["function"]["name"] for t in req.tools]
        prefix, constraint = "", req.constraint
        forced = req.tool_choice not in (None, "auto", "none")
        if forced and constrained.available():
            # a grammar of the family's calls whose arguments follow the schemas: a call that must happen,
            # names only from the declared tools, arguments that parse (serving/tools.py call_grammar).
            # parse_chat refuses a forced call with a constraint of its own.
            try:
                lark = call_grammar(family.name, req.tools, None if req.tool_choice == "required" else req.tool_choice,
                                    marker_ids(getattr(self.model, "tokenizer", None)))
                constraint = constrained.lark_grammar(lark, "a tool's parameters are not a usable JSON schema "
                                                            "for tool_choice")
            except ConfigError as e:
                raise bad(str(e), "tool_choice") from None
        elif req.tool_choice == "required":  # one tool: that one; several: the start their names share
            prefix = family.forced_prefix(names[0] if len(names) == 1 else None, os.path.commonprefix(names))
        elif req.tool_choice not in (None, "auto"):
            prefix = family.forced_prefix(req.tool_choice)
        return ToolParser(family, req.tools, parallel=req.parallel_tool_calls, prefix=prefix), constraint

    def _template_kwargs(self, req: GenRequest, response_prefix: str) -> dict[str, Any]:
        """What the chat template is rendered with for `req`: its own arguments, its tools, the reply's start,
        and thinking off where the request asks for no reasoning and the template knows the switch."""
        m = self.model
        kwargs = dict(req.template_kwargs)
        if req.tools:
            kwargs["tools"] = req.tools
        if response_prefix:
            kwargs["response_prefix"] = response_prefix
        if req.reasoning_effort in ("none", "minimal"):
            templates = [m.tokenizer.chat_template or "", *getattr(m.tokenizer, "named_templates", {}).values()]
            if any("enable_thinking" in t for t in templates):
                kwargs.setdefault("enable_thinking", False)
        return kwargs

    def render(self, req: GenRequest, response_prefix: str = "") -> str:
        """The prompt text of a chat request (llama.cpp's /apply-template): what tokenize tokenizes."""
        try:
            return self.model.chat_text(req.prompt, **self._template_kwargs(req, response_prefix))
        except StrataError as e:
            raise bad(str(e), req.prompt_param) from None

    def tokenize(self, req: GenRequest, response_prefix: str = "", *, fit: bool = True) -> list[int]:
        """The prompt's token ids (chat template applied, then response_prefix: the start of the reply),
        checked against the context unless `fit` is False (a count). Runs on a worker thread: it uses only
        the tokenizer."""
        m = self.model
        try:
            if req.suffix is not None:
                try:
                    ids = m.infill_tokens(req.prompt, req.suffix, extra=req.infill_extra, prompt=req.infill_prompt,
                                          n_predict=req.max_tokens or -1)
                except StrataError as e:
                    raise bad(str(e), req.suffix_param) from None
            else:
                ids = m.prompt_tokens(req.prompt, **self._template_kwargs(req, response_prefix))
            if req.prefill:  # after the generation prompt, so the reply continues it
                ids += m.tokenize(req.prefill, add_special=False)
        except StrataError as e:
            raise bad(str(e), req.prompt_param) from None
        if not ids:
            raise bad(f"the {req.prompt_param} tokenize to nothing; give some text.", req.prompt_param)
        if fit and len(ids) + 1 > m.ctx:
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
            from strata_jax.engine.session import Session

            session = model.session() if self.parallel == 1 else Session(model, self.parallel)
            if self._warmup:
                self._warm(session)
            model.wait_loaded()  # ready means every expert is in
        except BaseException as e:  # noqa: BLE001 - reported through /health and the callback
            self.load_error = str(e) if isinstance(e, StrataError) else f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.load_error)
            self.state = "error"
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        self.model = model
        self._choose_tool_family(model)
        self._snapshot(session)
        self.state = "ready"
        while not self._stop.is_set():
            if self._end_running.is_set():  # the shutdown grace period is over: nothing more runs
                self._end_all(session)
                self._stop.wait(0.25)
                continue
            while session.free_rows:  # admit between calls; with nothing running, wait for work
                if self._more:  # a running job's next choice goes before new jobs
                    job = self._more.popleft()
                else:
                    try:
                        job = self._q.get_nowait() if self._active else self._q.get(timeout=0.25)
                    except queue.Empty:
                        break
                if not job.cancelled:
                    self._admit(session, job)
            self._reap_cancelled(session)
            if self._active:
                self._step(session)
            self._tick(session)
        self._end_all(session)
        self._save_expert_cache(model)

    def _save_expert_cache(self, model: Any) -> None:
        """On a clean shutdown, the expert cache's state for the next start (--expert-cache-state)."""
        config = getattr(model, "engine_config", None)
        if getattr(config, "expert_cache_state", None) is None:
            return
        try:
            model.save_expert_cache()
        except Exception as e:  # noqa: BLE001 - the server still stops; the next start is cold
            log.error("expert cache state not saved: %s: %s", type(e).__name__, e)

    def _end_all(self, session: Any) -> None:
        """Stop the running jobs (an error event each) and fail the queued ones."""
        if self._active:
            log.info("shutting down: stopping %d running request(s)", len(self._active))
        for row, job in list(self._active.items()):
            n = session.release(row)
            job.emit(Event("error", error=APIError(503, f"the server is shutting down; the request was stopped "
                                                   f"after {n} generated tokens.", code="shutting_down")))
        stopped = set(map(id, self._active.values()))
        self._active.clear()
        for job in self._more:  # choices never admitted: their job hears it unless a running choice told it
            if id(job) not in stopped:
                job.emit(Event("error", error=APIError(503, "the server is shutting down; the request was not "
                                                       "finished.", code="shutting_down")))
        self._more.clear()
        self._fail_pending()

    def _choose_tool_family(self, model: Any) -> None:
        tok = model.tokenizer
        template = getattr(tok, "named_templates", {}).get("tool_use") or tok.chat_template
        self.tool_family = f = detect_family(template, model.config.arch)
        ids = [tok.token_to_id(t) for t in f.preserved]
        self._keep_ids = tuple(i for i in ids if i is not None and i in tok.special_ids)
        log.info("tool calls: %s format (%s)%s; bare JSON naming a declared tool is a call too", f.name, f.why,
                 f", keeping {len(self._keep_ids)} special tokens in the output" if self._keep_ids else "")

    def _warm(self, session: Any) -> None:
        """Compile the programs before the first request pays for it: the smallest prefill and the decode
        call, greedy and sampled (the decode loop is compiled per sampling mode; penalties and logprobs
        compile their modes on first use)."""
        t0 = time.perf_counter()
        ids = session.model.tokenize("Hello") or [0]
        for temperature in (0.0, 0.8):
            session.admit(ids, max_tokens=3, temperature=temperature, seed=0, cache_prompt=False)
            while session.active_rows:
                session.step()
        log.info("warm-up (compilation) took %.1f s", time.perf_counter() - t0)

    def _admit(self, session: Any, job: Job) -> None:
        m, req = self.model, job.req
        index = job.admitted
        job.admitted += 1
        if job.admitted < req.n:
            self._more.append(job)
        kwargs = req.sampling()
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = m.ctx  # admit caps it at what the context has left
        kwargs["max_tokens"] = max(kwargs["max_tokens"], 1)  # 0 (req.scores_only): the prefill's token, left out
        if index:
            kwargs["seed"] = choice_seed(kwargs["seed"], index)
            sibling = next((r for r, j in self._active.items() if j is job), None)
            if sibling is not None and req.cache_prompt:
                session.fork(sibling)  # the prompt's KV for this choice: only its last token is prefilled
        else:
            job.expert_base = self._expert_counters(m)
        try:
            row, chunks = session.admit(job.prompt_ids, cache_prompt=req.cache_prompt,
                                        keep_special=self._keep_ids if req.tools else (), **kwargs)
        except StrataError as e:
            job.emit(Event("error", error=bad(str(e)), index=index))
            job.cancel()  # its other choices stop too: the request has failed
            return self._fail_lost_rows(session)
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            log.exception("prefill failed")
            job.emit(Event("error", error=_engine_error(e), index=index))
            job.cancel()
            return self._fail_lost_rows(session)
        self._active[row], self._index[row] = job, index
        self._deliver(session, row, chunks)
        self._snapshot(session)

    def _step(self, session: Any) -> None:
        try:
            out = session.step()
        except Exception as e:  # noqa: BLE001 - the running requests fail, the server goes on
            log.exception("batched decode step failed")
            return self._fail_lost_rows(session, e)
        for row, chunks in out.items():
            self._deliver(session, row, chunks)

    def _deliver(self, session: Any, row: int, chunks: list[Any]) -> None:
        job, index = self._active[row], self._index[row]
        for chunk in chunks:
            self.telemetry.delivered(len(chunk.token_ids))
            if chunk.finish_reason is None:
                job.emit(Event("chunk", chunk, index=index))
                continue
            del self._active[row]
            self.telemetry.finished(chunk.timings)
            self._snapshot(session)  # before the last event: a scrape right after the response counts the request
            job.emit(Event("final", chunk, expert_cache=self._expert_since(self.model, job.expert_base), index=index))

    def _reap_cancelled(self, session: Any) -> None:
        """Free the rows of jobs whose clients went away, before their next token."""
        for row, job in list(self._active.items()):
            if job.cancelled:
                n = session.release(row)
                del self._active[row]
                log.info("request cancelled after %d generated tokens", n)
                self._snapshot(session)

    def _fail_lost_rows(self, session: Any, e: BaseException | None = None) -> None:
        """After a failed step: fail the jobs whose rows the session dropped (all of them when a step
        consumed the donated cache)."""
        alive = set(session.active_rows)
        for row, job in list(self._active.items()):
            if row not in alive:
                del self._active[row]
                job.cancel()
                job.emit(Event("error", index=self._index[row], error=_engine_error(e) if e is not None else
                               APIError(500, "generation failed: another request's step failed and took the KV "
                                        "cache with it; retry.", code="engine_error")))
        self._snapshot(session)

    def _tick(self, session: Any) -> None:
        """Refresh the snapshot while a monitor watches: reading the expert counters waits for the decode
        call queued ahead, so it happens once per period, never per step."""
        if self.watchers > 0 and time.perf_counter() - self._t_snapshot >= SNAPSHOT_PERIOD_S:
            self._snapshot(session)

    def _snapshot(self, session: Any) -> None:
        m = self.model
        try:
            st, memory = m.stats(), m.device_memory(session)
        except Exception:  # noqa: BLE001 - telemetry must not take the engine down
            st, memory = {}, {}
        self._t_snapshot = time.perf_counter()
        self.snapshot = self.telemetry.snapshot(stats=st, memory=memory, kv_tokens=session.tokens_held(),
                                                ctx=m.ctx * self.parallel, queue_depth=self.queue_depth,
                                                processing=self.processing, parallel=self.parallel)
        conv = getattr(m, "conversation_cache", None)
        if conv is not None:
            self.snapshot["conversation"] = conv.summary()

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
    def _expert_counters(m: Any) -> dict[str, float]:
        st = m.stats()
        return {k: st.get(k) or 0 for k in EXPERT_COUNTERS} if st else {}

    def _expert_since(self, m: Any, base: dict[str, int]) -> dict[str, Any]:
        now = self._expert_counters(m)
        if not now:
            return {}
        d: dict[str, Any] = {k: now[k] - base.get(k, 0) for k in EXPERT_COUNTERS}
        d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else None
        return d


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a seeded request (choice 0 keeps the request's own): distinct per
    choice, the same on every run."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B1) % 2**32  # the golden-ratio step spreads consecutive choices


def _engine_error(e: BaseException) -> APIError:
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", code="engine_error")

