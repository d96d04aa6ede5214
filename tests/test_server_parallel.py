"""The server with --parallel N (continuous batching, in process through Starlette's TestClient):
concurrent requests are decoded together and each gets what it would get alone; conversations keep
their KV-cache slot between turns; cancellation, failures, back-pressure and metrics per request."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

import strata_jax
import strata_jax.engine.programs as programs
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.engine.session import Session
from strata_jax.serving.engine import Engine, Job
from strata_jax.serving.protocol import GenRequest
from test_server import CTX, MOE, MSGS, assert_error, chat, parse_sse, serving

OPEN = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)  # the server's (OpenAI's) sampling defaults


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", MOE)
    return strata_jax.load(path, ctx=CTX, expert_slots=8, expert_pools="shared")  # up to 4 rows x top-2 fit


@contextlib.contextmanager
def admission_gate(monkeypatch, engine_of, waiting: int):
    """Hold the first admission until `waiting` jobs are queued behind it (so the engine then admits
    them together), or until gate.release is set. gate.steps: the rows running at every decode step."""
    gate = SimpleNamespace(release=threading.Event(), entered=threading.Event(), steps=[])
    admit, step = Session.admit, Session.step

    def gated_admit(self, *a, **kw):
        gate.entered.set()
        deadline = time.monotonic() + 30
        while not gate.release.is_set() and engine_of().queue_depth < waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.release.set()
        return admit(self, *a, **kw)

    def spy_step(self):
        gate.steps.append(len(self.active_rows))
        return step(self)

    monkeypatch.setattr(Session, "admit", gated_admit)
    monkeypatch.setattr(Session, "step", spy_step)
    try:
        yield gate
    finally:
        gate.release.set()


def post_all(client, requests):
    results = [None] * len(requests)

    def one(i, path, body):
        results[i] = client.post(path, json=body)

    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_requests_batched_equal_alone(model, monkeypatch):
    msgs2 = [{"role": "user", "content": "tell me about the rain"}]
    requests = [  # (path, body, reference prompt, reference sampling)
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10, "temperature": 0}, MSGS, dict(temperature=0)),
        ("/v1/completions", {"prompt": "def fib(n):", "max_tokens": 14, "temperature": 0}, "def fib(n):",
         dict(temperature=0)),
        ("/v1/chat/completions", {"messages": msgs2, "max_tokens": 12, "seed": 7}, msgs2, dict(OPEN, seed=7)),
        ("/v1/completions", {"prompt": "Once upon", "max_tokens": 9, "seed": 3, "stream": True}, "Once upon",
         dict(OPEN, seed=3)),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "seed": 7, "top_k": 20, "stream": True}, MSGS,
         dict(OPEN, seed=7, top_k=20)),
    ]
    refs = [model.generate(p, max_tokens=b["max_tokens"], cache_prompt=False, **kw) for _, b, p, kw in requests]
    with serving(model, parallel=3) as c, admission_gate(monkeypatch, lambda: c.app.state.engine, 4) as gate:
        results = post_all(c, [(path, body) for path, body, _, _ in requests])
        for (path, body, _, _), r, ref in zip(requests, results, refs):
            assert r.status_code == 200, r.text
            if body.get("stream"):
                chunks = parse_sse(r.text)
                key = "delta" if "chat" in path else None
                text = "".join((ch["choices"][0].get(key, {}).get("content") or "") if key else
                               ch["choices"][0]["text"] for ch in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                body_json = r.json()
                choice = body_json["choices"][0]
                text, finish = choice["message"]["content"] if "chat" in path else choice["text"], \
                    choice["finish_reason"]
                assert body_json["usage"]["completion_tokens"] == len(ref.token_ids)
                assert body_json["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
                ex = body_json["expert_cache"]
                assert ex["lookups"] == ex["hits"] + ex["misses"] > 0
            assert (text, finish) == (ref.text, ref.finish_reason)
        assert gate.steps[0] == 3 and max(gate.steps) == 3  # three rows decoded together; the rest waited
        assert c.app.state.engine.processing == 0


def test_conversations_keep_their_slots(model):
    """A, B, then A's next turn: with 2 slots, A's turn reuses its whole first turn; with one KV cache
    (--parallel 1) B has overwritten it and only the shared template prefix is reused."""
    a1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    b1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what about the sea"}]
    cached = {}
    for parallel in (2, 1):
        with serving(model, parallel=parallel) as c:
            first = chat(c, messages=a1, max_tokens=6, temperature=0).json()
            assert chat(c, messages=b1, max_tokens=6, temperature=0).status_code == 200
            a2 = a1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "more"}]
            second = chat(c, messages=a2, max_tokens=6, temperature=0).json()
            assert second["choices"][0]["message"]["content"] == model.generate(a2, max_tokens=6, temperature=0).text
            cached[parallel] = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached[parallel] == second["timings"]["cache_n"]
    assert cached[2] >= first["usage"]["prompt_tokens"] > cached[1] > 0


def test_cancel_frees_the_row(model):
    engine = Engine(lambda: model, warmup=False, parallel=2)
    engine.start()
    assert engine.wait_ready(60)

    async def run():
        ids = model.tokenize("hello")
        long = Job(GenRequest("completion", ids, max_tokens=200, temperature=0), ids)
        other = Job(GenRequest("completion", ids, max_tokens=150, temperature=0), ids)
        engine.submit(long)
        engine.submit(other)
        assert (await asyncio.wait_for(long.events.get(), 30)).kind == "chunk"
        long.cancel()
        other.cancel()
        short = Job(GenRequest("completion", ids, max_tokens=3, temperature=0), ids)
        engine.submit(short)
        kinds = []
        while not kinds or kinds[-1] != "final":
            kinds.append((await asyncio.wait_for(short.events.get(), 30)).kind)
        for job in (long, other):
            seen = []
            while not job.events.empty():
                seen.append(job.events.get_nowait())
            assert all(e.kind == "chunk" for e in seen) and len(seen) < 100  # never reached its final event

    try:
        asyncio.run(run())
        assert engine.processing == 0 and engine.queue_depth == 0
    finally:
        engine.shutdown()
    assert engine.state == "stopped"


def test_failed_step_fails_the_running_requests_only(model, monkeypatch):
    decode, calls = programs.decode, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device on fire")
        return decode(*a, **kw)

    monkeypatch.setattr(programs, "decode_program", lambda xla_options=(): flaky)  # what a Session runs
    with serving(model, parallel=2) as c:
        r = chat(c, max_tokens=5, temperature=0)
        assert "device on fire" in assert_error(r, 500)["message"]
        ok = chat(c, max_tokens=5, temperature=0)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == model.generate(MSGS, max_tokens=5, temperature=0).text


def test_queue_full_and_metrics(model, monkeypatch):
    with serving(model, parallel=2, queue_size=1) as c, \
            admission_gate(monkeypatch, lambda: c.app.state.engine, 10**9) as gate:
        engine = c.app.state.engine
        results = []
        first = threading.Thread(target=lambda: results.append(chat(c, max_tokens=3)))
        first.start()
        assert gate.entered.wait(30)  # the engine took the first request and holds it at admission
        second = threading.Thread(target=lambda: results.append(chat(c, max_tokens=3)))
        second.start()
        for _ in range(500):
            if engine.queue_depth == 1:
                break
            time.sleep(0.01)
        assert assert_error(chat(c, max_tokens=2), 429)["code"] == "queue_full"
        gate.release.set()
        first.join(30)
        second.join(30)
        assert [r.status_code for r in results] == [200, 200]
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        assert fams["strata_kv_slots"].samples[0].value == 2
        assert fams["strata_kv_slots_in_use"].samples[0].value == 0
        assert fams["strata_requests_processing"].samples[0].value == 0
        assert 0 < fams["strata_kv_cache_usage_ratio"].samples[0].value <= 1
        total = {s.name: s.value for s in fams["strata_completion_tokens"].samples}
        assert total["strata_completion_tokens_total"] == sum(r.json()["usage"]["completion_tokens"] for r in results)
