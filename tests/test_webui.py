"""The web UI at / and its monitor stream, /v1/monitor/events: the stream over plain HTTP against a real
`strata-jax serve` process (fields, live rates during a generation, agreement with /metrics.json, its
end on SIGTERM), and the page in a real headless Chromium (Debian's /usr/bin/chromium driven by
playwright): the API key from the settings, a streamed answer, Stop, the monitor's figures moving.

STRATA_JAX_SCREENSHOT=docs/webui.png makes the browser test save the page there (dark theme)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from strata_jax.dev.synthetic import write_synthetic_gguf
from test_server import DENSE, serving
from test_server_openai import KEY, SPEC, ServerProcess, consume_in_thread

import strata_jax

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 12000  # greedy tokens the synthetic model does not end early (~15 s alone on the 2-core CPU): one to stop


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def server(moe_path, tmp_path_factory):
    srv = ServerProcess(moe_path, tmp_path_factory.mktemp("log") / "server.log", "--ctx", "16384",
                        "--conversation-cache-mib", "64", api_key=KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def monitor_events(url: str, *, headers=AUTH, timeout: float = 30, **params):
    """The monitor stream's events as dicts, as they arrive (every event is one `data: <json>` line)."""
    with httpx.stream("GET", url + "/v1/monitor/events", params=params, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                yield json.loads(line[len("data: "):])


def metric(metrics: dict, family: str, **labels) -> float:
    return next(s["value"] for s in metrics[family]["samples"] if s["labels"] == labels)


# -- the stream over HTTP ---------------------------------------------------------------------------------

def test_monitor_events_fields_live_rates_and_metrics(server):
    events = list(monitor_events(server.url, interval=0.3, count=4))
    times = [ev["time"] for ev in events]  # when the engine took the snapshot: refreshed while watched
    assert len(events) == 4 and times == sorted(times) and times[-1] > times[0]
    ev = events[-1]
    assert ev["status"] == "ok" and ev["model"] == "moe" and ev["parallel"] == 1 and ev["ctx"] == 16384
    mem = ev["memory"]
    assert mem["dense"] > 0 and mem["experts"] > 0 and mem["kv"] > 0
    assert mem["total"] == mem["dense"] + mem["experts"] + mem["kv"]
    ex = ev["expert"]
    assert ex["expert_slots"] == 8 and ex["total_experts"] == SPEC.n_layers * SPEC.n_experts and ex["resident"] is False
    assert len(ex["per_layer_hit_rate"]) == len(ex["per_layer_lookups"]) == SPEC.n_layers
    assert sum(ex["per_layer_lookups"]) == ex["lookups"] == ex["hits"] + ex["misses"]
    # each layer's rate is its hits over its lookups: weighted by them, they give the total hits
    assert round(sum(h * n for h, n in zip(ex["per_layer_hit_rate"], ex["per_layer_lookups"]))) == ex["hits"]
    assert all(0 <= h <= 1 for h in ex["per_layer_hit_rate"])

    # a long generation: the watched engine refreshes between decode calls, so the rates move while it runs
    done = threading.Event()

    def generate():
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    return  # closing the stream cancels the request

    t = threading.Thread(target=generate)
    t.start()
    try:
        live = None
        for ev in monitor_events(server.url, interval=0.25, count=80):
            if ev["processing"] == 1 and (ev["decode_tokens_per_second"] or 0) > 0 and ev["expert"]["lookups"] > \
                    ex["lookups"] and (ev["expert"]["h2d_MB_per_s"] or 0) > 0:
                live = ev
                break
        assert live is not None, "the monitor never showed the running generation"
        assert live["tokens_generated"] > 0 and live["kv_tokens"] > 0
        assert 0 <= live["expert"]["hit_rate_recent"] <= 1
    finally:
        done.set()
        t.join(30)
    for ev in monitor_events(server.url, interval=0.25, count=40):  # the cancelled request frees its row,
        if ev["processing"] == 0 and ev["decode_tokens_per_second"] == 0:  # and the idle engine's rates fall to 0
            break
    assert ev["processing"] == 0 and ev["decode_tokens_per_second"] == 0 and ev["expert"]["h2d_MB_per_s"] == 0

    # idle: an event and /metrics.json read the same snapshot
    ev = next(monitor_events(server.url, count=1))
    m = httpx.get(server.url + "/metrics.json", headers=AUTH).json()
    ex = ev["expert"]
    assert metric(m, "strata_expert_cache_lookups") == ex["lookups"]
    assert metric(m, "strata_expert_cache_misses") == ex["misses"]
    assert metric(m, "strata_expert_cache_bytes_h2d") == ex["bytes_h2d"]
    assert metric(m, "strata_expert_cache_hit_rate") == pytest.approx(ex["hit_rate"])
    assert metric(m, "strata_kv_cache_tokens") == ev["kv_tokens"] > 0
    assert metric(m, "strata_queue_depth") == ev["queue_depth"] == 0
    for use in ("dense", "experts", "kv"):
        assert metric(m, "strata_device_memory_bytes", use=use) == ev["memory"][use]


def test_monitor_stream_ends_when_the_client_leaves(server):
    watching = monitor_events(server.url, interval=0.25)
    assert next(watching)["monitors"] == 1
    seen = []
    for ev in monitor_events(server.url, interval=0.25, count=20):
        seen.append(ev["monitors"])
        if len(seen) == 2:
            watching.close()  # the first client hangs up: its stream ends and stops counting
        if ev["monitors"] == 1 and len(seen) > 2:
            break
    assert seen[0] == 2 and seen[-1] == 1, seen


def test_monitor_events_auth_and_bad_parameters(server):
    r = httpx.get(server.url + "/v1/monitor/events", params={"count": 1})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    for params in ({"interval": "0.01"}, {"interval": "soon"}, {"interval": "nan"}, {"count": "0"},
                   {"count": "1.5"}):
        r = httpx.get(server.url + "/v1/monitor/events", params=params, headers=AUTH)
        assert r.status_code == 400, params
        err = r.json()["error"]
        assert err["param"] == next(iter(params)) and "must be" in err["message"]
    # the page and its files are public: the page asks for the key
    for path in ("/", "/ui/app.js", "/ui/style.css"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/ui/missing.js").status_code == 404


def test_dense_model_has_no_expert_figures(tmp_path):
    path = write_synthetic_gguf(tmp_path / "dense.gguf", DENSE)
    with serving(strata_jax.load(path, ctx=128)) as c:
        with c.stream("GET", "/v1/monitor/events", params={"count": 1}) as r:
            ev = json.loads(next(line for line in r.iter_lines() if line)[len("data: "):])
        assert ev["expert"] is None and ev["memory"]["experts"] == 0 and ev["memory"]["dense"] > 0


def test_monitor_stream_ends_on_sigterm(moe_path, tmp_path):
    srv = ServerProcess(moe_path, tmp_path / "server.log", "--shutdown-timeout", "5")
    try:
        srv.wait_ready()
        t, started, seen, errors = consume_in_thread(lambda: monitor_events(srv.url, headers={}, interval=0.25))
        assert started.wait(30)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        t.join(10)
        assert not t.is_alive()
        # it ends on its own, with an event saying why, well before uvicorn's graceful-shutdown limit (10 s)
        assert seen[-1]["status"] == "shutting_down", (seen[-2:], errors, srv.output()[-3000:])
        assert srv.proc.wait(20) == 0, srv.output()
        assert time.monotonic() - t_sig < 8  # the process too, with margin for a loaded machine
    finally:
        srv.stop()


# -- the page in a real browser -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(f"{CHROMIUM} is missing in CI: .ci/run installs Debian's chromium package")
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (the web UI test drives Debian's Chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def text(page, selector: str) -> str:
    return page.inner_text(selector).strip()


def chat_post(request) -> bool:
    return request.method == "POST" and request.url.endswith("/v1/chat/completions")


def set_field(page, selector: str, value) -> None:
    page.fill(selector, str(value))
    page.dispatch_event(selector, "change")


def test_webui_chat_stop_and_live_monitor(server, browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")

    # the server wants a key: the monitor says so until the settings have it (kept in localStorage)
    page.wait_for_function("document.getElementById('m-live').textContent.includes('API key')")
    assert page.is_visible("#api_key")  # the settings open by themselves when a key is needed
    set_field(page, "#api_key", KEY)
    page.wait_for_function("document.getElementById('m-live').textContent === 'live'")
    assert json.loads(page.evaluate("localStorage.getItem('strata-jax-ui')"))["api_key"] == KEY
    page.wait_for_function("document.getElementById('m-lookups').textContent !== '0'")
    before = {k: text(page, "#m-" + k) for k in ("lookups", "generated", "finished", "decode-last", "bytes")}

    # a message, its streamed answer, and the monitor's figures moving
    set_field(page, "#system", "Be brief.")
    set_field(page, "#temperature", 0)  # greedy: the synthetic model's answers are the same on every run
    set_field(page, "#max_tokens", 48)
    set_field(page, "#top_p", 0.5)
    page.fill("#input", "Hello there")
    with page.expect_request(chat_post) as sent:  # the settings are what the request carries
        page.click("#send")
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["stream"]) == (0, 0.5, 48, True)
    assert sent.value.headers["authorization"] == f"Bearer {KEY}"
    page.wait_for_function("document.querySelector('.msg.assistant .body').textContent.length > 0")
    page.wait_for_selector(".msg.assistant[data-finish='length'], .msg.assistant[data-finish='stop']")
    answer = page.locator(".msg.assistant").first
    assert text(page, ".msg.user") == "Hello there" and answer.inner_text().strip()
    assert "tokens" in answer.locator(".meta").inner_text()
    page.wait_for_function(f"document.getElementById('m-finished').textContent !== {before['finished']!r}")
    page.wait_for_function(f"document.getElementById('m-lookups').textContent !== {before['lookups']!r}")
    after = {k: text(page, "#m-" + k) for k in before}
    assert int(after["lookups"]) > int(before["lookups"]) and int(after["generated"]) > int(before["generated"])
    assert after["decode-last"] != "-" and float(after["decode-last"]) > 0 and after["bytes"] != before["bytes"]
    assert text(page, "#m-hit").endswith("%") and page.locator("#m-layers span").count() == SPEC.n_layers
    assert not page.is_visible("#m-dense")
    page.wait_for_function("document.getElementById('m-conv').textContent.startsWith('RAM ')")
    assert text(page, "#m-conv-hits").endswith("restored") and "of 64 MiB" in text(page, "#m-conv")

    # Stop ends a long generation: the stream is aborted, the server frees the row
    set_field(page, "#max_tokens", LONG)
    cancelled = server.output().count("request cancelled after")
    page.fill("#input", "Tell me a long story")
    with page.expect_request(chat_post) as sent:
        page.click("#send")
    body = sent.value.post_data_json
    assert body["max_tokens"] == LONG and body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][1] == {"role": "user", "content": "Hello there"} and body["messages"][2]["content"]
    page.wait_for_function("document.getElementById('m-processing').textContent === '1'")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1].textContent.length > 20")
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    if shot := os.environ.get("STRATA_JAX_SCREENSHOT"):  # mid-generation: the monitor at work
        page.click("#settings summary")
        page.wait_for_timeout(1500)
        page.screenshot(path=shot)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-finish='stopped']", timeout=5000)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    stopped = page.locator(".msg.assistant").nth(1)
    n = len(stopped.inner_text())
    page.wait_for_function("document.getElementById('m-processing').textContent === '0'", timeout=10000)
    assert len(stopped.inner_text()) == n and "stopped" in stopped.locator(".meta").inner_text()
    deadline = time.monotonic() + 10
    while server.output().count("request cancelled after") == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.output().count("request cancelled after") == cancelled + 1
    assert not errors, errors
    context.close()


def test_markdown_renderer_escapes_html(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/")
    render = "(s) => window.strataUI.renderMarkdown(s)"
    html = page.evaluate(render, "<img src=x onerror=alert(1)> **bold** *it* `<b>code</b>`\n\n- a\n- b\n\n"
                                 "```python\nif a < b: print('<script>')\n```")
    assert "<img" not in html and "<script>" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "<em>it</em>" in html and "<code>&lt;b&gt;code&lt;/b&gt;</code>" in html
    assert "<ul><li>a</li><li>b</li></ul>" in html
    assert '<pre><code class="language-python">if a &lt; b: print(&#39;&lt;script&gt;&#39;)</code></pre>' in html
    # a fence still streaming (not closed yet) is code up to the end
    html = page.evaluate(render, "x\n```\ncode *not italic*")
    assert html.startswith("<p>x</p>") and html.endswith("<pre><code>code *not italic*</code></pre></div>")
    # ... and one just opened, with no code yet, draws no empty box
    for src in ("x\n```", "x\n```python\n", "x\n```\n\n"):
        assert page.evaluate(render, src) == "<p>x</p>", src
    assert 'class="copy"' in page.evaluate(render, "```\n```")  # a closed block is a block, even empty
    page.close()


DEFAULT_MODEL_ID = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"  # the longest name the header usually shows


def test_empty_chat_hint_code_copy_button_and_narrow_header(server, browser):
    """The empty chat says what to do and hides once there is a message (Clear brings it back); a code
    block's Copy button puts exactly its code on the clipboard; at 400 px the header stays one line."""
    context = browser.new_context(viewport={"width": 400, "height": 800}, color_scheme="light")
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent !== '-'")
    assert page.is_visible("#hint") and "Enter sends" in text(page, "#hint")

    code = "def f(xs):\n    return [x for x in xs if x < 3]  # <not html>"
    page.evaluate("(s) => window.strataUI.addMessage('assistant', s)", f"Here:\n\n```python\n{code}\n```\n\nDone.")
    assert not page.is_visible("#hint")
    button = page.locator(".msg.assistant .code button.copy")
    assert button.count() == 1 and button.is_visible()
    button.click()
    page.wait_for_function("document.querySelector('button.copy').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == code

    # the header: brand, model and status on one line, a long model name cut short with its full name as title
    page.evaluate("(name) => { const m = document.getElementById('model'); m.textContent = name; m.title = name; }",
                  DEFAULT_MODEL_ID * 2)
    tops = page.evaluate("[...document.querySelector('header').children].map(e => e.getBoundingClientRect().top)")
    assert max(tops) - min(tops) < 4, tops
    assert page.evaluate("(() => { const h = document.querySelector('header'); return h.scrollWidth <= h.clientWidth; })()")
    assert page.evaluate("(() => { const m = document.getElementById('model'); return m.scrollWidth > m.clientWidth; })()")
    if shot := os.environ.get("STRATA_JAX_SCREENSHOT_NARROW"):
        page.screenshot(path=shot)

    page.evaluate("document.getElementById('settings').open = true")  # open already when a key is needed
    page.click("#clear")
    assert page.is_visible("#hint") and page.locator(".msg").count() == 0
    assert not errors, errors
    context.close()
