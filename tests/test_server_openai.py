"""A real `strata-jax serve` process on 127.0.0.1 driven by the official openai SDK: sync, streaming
and async clients, tools, errors as SDK exceptions, a bounded load test, client disconnects and
SIGTERM. All traffic stays on the loopback; every loop and wait is bounded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

SPEC = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                     vocab_size=512, qtype="Q8_0")
KEY = "test-key"
MSGS = [{"role": "user", "content": "hello there"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m strata_jax.cli serve` in a subprocess, its output in a log file."""

    def __init__(self, model_path, log_path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "STRATA_JAX_API_KEY"}
        if api_key:
            env["STRATA_JAX_API_KEY"] = api_key  # the environment route for the key
        cmd = [sys.executable, "-m", "strata_jax.cli", "serve", "--model", str(model_path), "--port", str(self.port),
               "--ctx", "1024", "--expert-slots", "8", *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"server not ready after {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def server(moe_path, tmp_path_factory):
    srv = ServerProcess(moe_path, tmp_path_factory.mktemp("log") / "server.log", api_key=KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def parallel_server(moe_path, tmp_path_factory):
    srv = ServerProcess(moe_path, tmp_path_factory.mktemp("log") / "server4.log", "--parallel", "4",
                        "--expert-pools", "shared", api_key=KEY)  # 4 rows x top-2 fill the 8 shared slots
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_sync_chat_completions_and_models(client):
    # a name the server does not serve is answered by the model it does, and the response says which
    r = client.chat.completions.create(model="whatever", messages=MSGS, max_tokens=8, temperature=0)
    served = [m.id for m in client.models.list().data]
    assert r.object == "chat.completion" and [r.model] == served
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5
    models = client.models.list()
    assert [m.id for m in models.data] == ["moe"]


def test_an_unknown_model_name_is_served_under_the_real_name(client):
    served = client.models.list().data[0].id
    assert served != "gpt-4o"  # the name asked for below is not the one served
    c = client.completions.create(model="gpt-4o", prompt="Once upon a time", max_tokens=3, temperature=0)
    stream = client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=3, temperature=0, stream=True)
    r = client.responses.create(model="gpt-4o", input="hello", max_output_tokens=3, temperature=0)
    assert c.model == r.model == served and {ch.model for ch in stream} == {served}


def test_streaming(client):
    full = client.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    comp = list(client.completions.create(model="m", prompt="abc", max_tokens=4, temperature=0, stream=True))
    assert comp[-1].choices[0].finish_reason == "length"


def test_logprobs_and_penalties(client):
    """The SDK parses chat logprobs (whole and streamed) and the legacy completions logprobs."""
    r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.2,
                                       extra_body={"repeat_penalty": 1.1, "cache_prompt": False})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item in content:
        assert isinstance(item.token, str) and item.logprob <= 0 and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    stream = client.chat.completions.create(model="m", messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.2,
                                            stream=True, extra_body={"repeat_penalty": 1.1, "cache_prompt": False})
    streamed = [i for ch in stream if ch.choices and ch.choices[0].logprobs for i in ch.choices[0].logprobs.content]
    assert [(i.token, i.bytes, [t.token for t in i.top_logprobs]) for i in streamed] == \
        [(i.token, i.bytes, [t.token for t in i.top_logprobs]) for i in content]
    c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == len("Once upon a time") and all(len(t) == 2 for t in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"


def test_async_client(server):
    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            rs = await asyncio.gather(*(ac.chat.completions.create(model="m", messages=MSGS, max_tokens=4, seed=i)
                                        for i in range(4)))
            stream = await ac.chat.completions.create(model="m", messages=MSGS, max_tokens=4, temperature=0,
                                                      stream=True)
            parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        finally:
            await ac.close()
        return rs, parts

    rs, parts = asyncio.run(run())
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in rs) and parts


def test_tools_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model="m", messages=MSGS, tools=tools, tool_choice="auto", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_errors_are_sdk_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="m", prompt="hello " * 2000, max_tokens=2)
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model="m", messages=MSGS, max_tokens=2)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # open without a key


def test_load_8_clients_100_requests(client):
    def one(i):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"request {i}"}],
                                           max_tokens=4, temperature=0.7, seed=i)
        return time.perf_counter() - t0, r

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100), timeout=240))
    wall = time.perf_counter() - t0
    lat = sorted(t for t, _ in results)
    tokens = sum(r.usage.completion_tokens for _, r in results)
    for _, r in results:
        assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
        assert 1 <= r.usage.completion_tokens <= 4 or r.choices[0].finish_reason == "stop"
    print(f"\n100 requests, 8 clients: {wall:.1f} s, {100 / wall:.1f} req/s, {tokens / wall:.0f} tok/s, "
          f"p50 {statistics.median(lat) * 1e3:.0f} ms, p95 {lat[94] * 1e3:.0f} ms")


def _stream_one_event_then_close(http, server, headers, max_tokens):
    body = {"prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with http.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")


def _wait_for_cancel_log(server):
    deadline = time.monotonic() + 10
    while "request cancelled after" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "request cancelled after" in server.output()


def test_disconnect_cancels_generation(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http:
        _stream_one_event_then_close(http, server, headers, 1000)
        # the stream is closed after one event; the next request must not wait for 1000 tokens
        t0 = time.perf_counter()
        done = http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
        assert done.status_code == 200 and time.perf_counter() - t0 < 10
    _wait_for_cancel_log(server)


def consume_in_thread(items):
    """Run the generator function `items` in a thread, keeping what it yields in `seen` and the httpx error
    that ends it early (a stream cut by the server) in `errors`; `started` is set at the first item (or
    at the end). Returns (thread, started, seen, errors)."""
    seen: list = []
    errors: list[Exception] = []
    started = threading.Event()

    def run():
        try:
            for item in items():
                seen.append(item)
                started.set()
        except httpx.HTTPError as e:
            errors.append(e)
        started.set()

    t = threading.Thread(target=run)
    t.start()
    return t, started, seen, errors


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_sigterm_exits_cleanly(moe_path, tmp_path, parallel):
    srv = ServerProcess(moe_path, tmp_path / "server.log", "--shutdown-timeout", "5", "--parallel", parallel)
    try:
        srv.wait_ready()
        def stream():
            body = {"prompt": "hello", "max_tokens": 600, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                yield from r.iter_lines()

        t, started, seen, errors = consume_in_thread(stream)  # a cut stream is acceptable, as long as it ends
        assert started.wait(30)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0, srv.output()
        assert time.monotonic() - t_sig < 15
        t.join(10)
        assert not t.is_alive()
        assert "data: [DONE]" in seen or errors  # finished, or cleanly cut
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()


def test_second_sigterm_ends_the_grace_period_at_once(moe_path, tmp_path):
    """The first SIGTERM leaves a long grace period for a running stream (the server still answers, 503);
    a second one ends the stream with its error event and the process exits 0, long before the grace
    period would have."""
    grace = 120
    srv = ServerProcess(moe_path, tmp_path / "server.log", "--shutdown-grace", str(grace), "--ctx", "16384")
    try:
        srv.wait_ready()

        def stream():  # ~15 s of greedy tokens alone on the 2-core CPU: still running at the second signal
            body = {"prompt": "hello", "max_tokens": 12000, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                yield from r.iter_lines()

        t, started, seen, errors = consume_in_thread(stream)
        assert started.wait(30)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health", timeout=5).json()["status"] == "shutting_down"
        assert srv.proc.poll() is None  # draining, the stream still running
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.output()
        assert time.monotonic() - t_sig < grace / 2
        t.join(10)
        assert not t.is_alive() and not errors, errors
        lines = [x for x in seen if x]
        assert lines[-1] == "data: [DONE]" and '"shutting_down"' in lines[-2], lines[-3:]
    finally:
        srv.stop()


def test_parallel_server_concurrent_clients_match_one_at_a_time(server, parallel_server):
    """8 requests from 4 concurrent clients against --parallel 4: every text equals what the --parallel 1
    server gives the same request alone (greedy and seeded), and the batch really ran them together."""
    requests = [dict(messages=[{"role": "user", "content": f"tell me about {w}"}], max_tokens=16,
                     **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i}))
                for i, w in enumerate(["rain", "tea", "stairs", "a note", "the sea", "hot days", "x", "y z"])]

    def ask(srv, body):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        t0 = time.perf_counter()
        r = c.chat.completions.create(model="m", **body)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens, \
            time.perf_counter() - t0

    alone = [ask(server, b) for b in requests]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda b: ask(parallel_server, b), requests, timeout=240))
    wall = time.perf_counter() - t0
    assert [r[:3] for r in batched] == [r[:3] for r in alone]
    metrics = httpx.get(parallel_server.url + "/metrics.json", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=10).json()
    gauge = {f: metrics[f]["samples"][0]["value"] for f in ("strata_kv_slots", "strata_kv_slots_in_use")}
    assert gauge == {"strata_kv_slots": 4, "strata_kv_slots_in_use": 0}
    tokens = sum(r[2] for r in batched)
    print(f"\n8 requests, 4 clients, --parallel 4: {wall:.2f} s, {tokens / wall:.0f} tok/s; one at a time: "
          f"{sum(r[3] for r in alone):.2f} s")


def test_parallel_server_disconnect_frees_the_slot(parallel_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http:
        _stream_one_event_then_close(http, parallel_server, headers, 900)
        _wait_for_cancel_log(parallel_server)
        in_use = http.get(parallel_server.url + "/metrics.json", headers=headers).json()["strata_kv_slots_in_use"]
        assert in_use["samples"][0]["value"] == 0
