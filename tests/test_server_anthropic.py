"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the official anthropic
SDK against a live uvicorn on 127.0.0.1 (in this process, sharing one small synthetic model), and the
server's robustness on every endpoint: hostile bodies, the body-size limit, SIGTERM during streams, a
port in use. The tool_use round trip renders through the default model's real (Qwen) chat template."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

import anthropic
import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strata_jax
from strata_jax.cli import main
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.model import Model
from strata_jax.engine.streaming import GenerationChunk
from strata_jax.serving.anthropic import parse_messages
from strata_jax.serving.app import create_app
from strata_jax.serving.engine import Engine

from test_server import POISON, assert_poison_refused, wire
from test_server_openai import ServerProcess, free_port

SPEC = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                     vocab_size=512, qtype="Q8_0")
CTX = 512
KEY = "anthropic-test-key"
MAX_BODY = 64 << 10  # small, so a body over the limit is quick to send
USER = [{"role": "user", "content": "hello there"}]
T0 = {"extra_body": {"temperature": 0}}  # greedy; this SDK has no sampling arguments, the API still takes them
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]
VALID = {"/v1/chat/completions": {"messages": USER, "max_tokens": 2},
         "/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/responses": {"input": "hi", "max_output_tokens": 2},
         "/v1/messages": {"model": "m", "messages": USER, "max_tokens": 2},
         "/v1/messages/count_tokens": {"model": "m", "messages": USER}}


@contextlib.contextmanager
def live(model, **app_options):
    """The app under a real uvicorn on a free loopback port, in a thread; yields its URL."""
    engine = Engine(lambda: model, warmup=False)
    app = create_app(engine, model_id="moe", api_key=KEY, max_body=MAX_BODY, **app_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not (server.started and engine.state == "ready"):
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def model(moe_path):
    return strata_jax.load(moe_path, ctx=CTX, expert_slots=8)


@pytest.fixture(scope="module")
def url(model):
    with live(model) as u:
        yield u


@pytest.fixture
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def raw(url, path, body=None, *, content=None, headers=None):
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}
    return httpx.post(url + path, json=body, content=content, headers=h, timeout=60)


def events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; every event's name is its data's type, as Anthropic's are."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        ev = json.loads(data[len("data: "):])
        assert ev["type"] == name[len("event: "):]
        out.append((ev["type"], ev))
    return out


def assert_anthropic_error(r, status, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


# -- the SDK ------------------------------------------------------------------------------------------

def test_create_matches_model_generate_with_anthropic_usage(client, model):
    r = client.messages.create(model="claude-x", max_tokens=8, system="Be brief.", messages=USER, **T0)
    msgs = [{"role": "system", "content": "Be brief."}, *USER]
    ref = model.generate(msgs, max_tokens=8, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == "moe" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref.text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert r.stop_sequence is None
    u = r.usage  # Anthropic counts input_tokens without the tokens read from the cache
    assert u.input_tokens + u.cache_read_input_tokens == len(model.prompt_tokens(msgs))
    assert u.output_tokens == len(ref.token_ids) and u.cache_creation_input_tokens == 0
    again = client.messages.create(model="m", max_tokens=8, system="Be brief.", messages=USER, **T0)
    assert again.content[0].text == ref.text and again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(model.prompt_tokens(msgs))


def test_system_blocks_and_multi_turn_render_as_chat_messages(client, model):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "text", "text": "how"}, {"type": "text", "text": "are you"}]}]
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}]
    ref = [{"role": "system", "content": "You are terse.\nAnswer in French."}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "how\nare you"}]
    n = client.messages.count_tokens(model="m", system=system, messages=turns).input_tokens
    assert n == len(model.prompt_tokens(ref))
    assert client.messages.count_tokens(model="m", messages=turns).input_tokens == len(model.prompt_tokens(ref[1:]))
    r = client.messages.create(model="m", max_tokens=6, system=system, messages=turns, **T0)
    assert r.content[0].text == model.generate(ref, max_tokens=6, temperature=0).text
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n


def test_assistant_prefill_is_continued(client, model):
    prefill = "Sure, here"
    turns = USER + [{"role": "assistant", "content": prefill}]
    ids = model.tokenize(model.tokenizer.apply_chat_template(USER, add_generation_prompt=True) + prefill,
                         add_special=False)  # the template's prompt, then the prefill, as one text
    assert client.messages.count_tokens(model="m", messages=turns).input_tokens == len(ids)
    r = client.messages.create(model="m", max_tokens=6, messages=turns, **T0)
    assert r.content[0].text == model.generate(ids, max_tokens=6, temperature=0).text  # the continuation only
    assert r.content[0].text != client.messages.create(model="m", max_tokens=6, messages=USER, **T0).content[0].text


def test_stream_text_and_final_message(client, url):
    want = client.messages.create(model="m", max_tokens=10, messages=USER, **T0)
    with client.messages.stream(model="m", max_tokens=10, messages=USER, **T0) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == want.content[0].text
    assert final.stop_reason == want.stop_reason and final.usage.output_tokens == want.usage.output_tokens
    assert final.id.startswith("msg_") and final.model == "moe"  # the served id
    r = raw(url, "/v1/messages", {"model": "m", "max_tokens": 10, "messages": USER, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    names = [n for n, _ in evs]
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and deltas
    assert set(deltas) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert evs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for n, e in evs if n == "content_block_delta") == want.content[0].text
    assert all(e["delta"]["type"] == "text_delta" and e["index"] == 0 for n, e in evs if n == "content_block_delta")
    md = evs[-2][1]
    assert md["delta"] == {"stop_reason": want.stop_reason, "stop_sequence": None}
    assert md["usage"]["output_tokens"] == want.usage.output_tokens


def test_stop_sequences(client):
    text = client.messages.create(model="m", max_tokens=16, messages=USER, **T0).content[0].text
    stop = text[4:6]
    want = text[: text.find(stop)]
    r = client.messages.create(model="m", max_tokens=16, messages=USER, **T0,
                               stop_sequences=["\x00never", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop and r.content[0].text == want
    with client.messages.stream(model="m", max_tokens=16, messages=USER, **T0, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == want
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    r = client.messages.create(model="m", max_tokens=3, messages=USER, **T0, stop_sequences=["\x00never"])
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 3


def test_sampling_is_reproducible_and_within_anthropic_ranges(client, url):
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 20}
    r = client.messages.create(model="m", max_tokens=8, messages=USER, extra_body=sampled)
    assert r.usage.output_tokens >= 1 and r.stop_reason in ("end_turn", "max_tokens")
    for bad in ({"temperature": 1.5}, {"top_p": 0}, {"top_k": -1}, {"top_k": 2.5}):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="m", max_tokens=4, messages=USER, extra_body=bad)
        assert e.value.body["error"]["type"] == "invalid_request_error" and next(iter(bad)) in e.value.message


# -- tools, through the default model's chat template ---------------------------------------------------

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                   "parameters": WEATHER["input_schema"]}}


class Scripted:
    """The synthetic model under the default model's tokenizer and chat template: prompts render as
    Qwen2.5's do (recorded in .prompts), and every request answers the next scripted text."""

    def __init__(self, model, tokenizer, scripts):
        self._m, self.tokenizer, self.scripts, self.prompts = model, tokenizer, list(scripts), []

    def __getattr__(self, name):
        return getattr(self._m, name)

    def tokenize(self, text, add_special=True):
        return self.tokenizer.encode(text, add_special=add_special)

    def prompt_tokens(self, prompt, **kw):
        return Model.prompt_tokens(self, prompt, **kw)

    def chat_text(self, messages, **kw):
        return Model.chat_text(self, messages, **kw)

    def session(self):
        outer = self

        class Session:
            def __getattr__(self, name):
                return getattr(outer._m.session(), name)

            def admit(self, ids, **kw):
                outer.prompts.append(list(ids))
                *pieces, last = outer.scripts.pop(0)
                return 0, [GenerationChunk(p, [1]) for p in pieces] + [
                    GenerationChunk(last, [1], "stop", {"predicted_n": len(pieces) + 1}, list(ids))]

        return Session()


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from strata_jax.dev.default_model import default_model_path
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.gguf.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_metadata(GGUFFile(default_model_path()).metadata)


def test_tool_use_round_trip(model, qwen_tokenizer):
    call = ["Checking.", ' <tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    scripted = Scripted(model, qwen_tokenizer, [call, call, ["It is ", "sunny in Oslo."]])
    with live(scripted) as u:
        c = anthropic.Anthropic(base_url=u, api_key=KEY, max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        r = c.messages.create(model="m", max_tokens=64, messages=ask, tools=[WEATHER])
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
        assert r.content[0].text == "Checking."
        use = r.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id.startswith("toolu_")
        assert scripted.prompts[0] == Model.prompt_tokens(scripted, ask, tools=[OPENAI_WEATHER])
        with c.messages.stream(model="m", max_tokens=64, messages=ask, tools=[WEATHER]) as s:
            assert "".join(s.text_stream) == "Checking. "
            final = s.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Oslo"}
        # the result goes back as a tool_result block; the template sees OpenAI-style tool messages
        turns = ask + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": [{"type": "text", "text": "21 C, sunny"}]},
                                                    {"type": "text", "text": "Thanks!"}]}]
        done = c.messages.create(model="m", max_tokens=64, messages=turns, tools=[WEATHER])
        assert done.stop_reason == "end_turn" and done.content[0].text == "It is sunny in Oslo."
    ref = ask + [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "id": use.id, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 C, sunny"}, {"role": "user", "content": "Thanks!"}]
    assert scripted.prompts[2] == Model.prompt_tokens(scripted, ref, tools=[OPENAI_WEATHER])
    prompt = qwen_tokenizer.decode(scripted.prompts[2], skip_special=False)
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt and '"city": "Oslo"' in prompt
    assert "get_weather" in qwen_tokenizer.decode(scripted.prompts[0], skip_special=False)


def test_tool_choice_none_and_tool(model, qwen_tokenizer):
    call = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>']
    other = dict(WEATHER, name="get_time")
    scripted = Scripted(model, qwen_tokenizer, [call, call, call])
    with live(scripted) as u:
        c = anthropic.Anthropic(base_url=u, api_key=KEY, max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Weather?"}]
        r = c.messages.create(model="m", max_tokens=64, messages=ask, tools=[WEATHER], tool_choice={"type": "none"})
        assert r.stop_reason == "end_turn" and "<tool_call>" in r.content[0].text  # no tools: plain text
        assert "get_weather" not in qwen_tokenizer.decode(scripted.prompts[0], skip_special=False)
        r = c.messages.create(model="m", max_tokens=64, messages=ask, tools=[other, WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"})
        assert [b.type for b in r.content] == ["tool_use"] and r.stop_reason == "tool_use"
        shown = qwen_tokenizer.decode(scripted.prompts[1], skip_special=False)
        assert "get_weather" in shown and "get_time" not in shown
        body = {"model": "m", "max_tokens": 64, "messages": ask, "tools": [WEATHER], "stream": True}
        evs = events(raw(u, "/v1/messages", body).text)  # a reply that is only a call: its block is index 0
        assert [n for n, _ in evs] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop"]
        block = evs[2][1]["content_block"]
        assert evs[2][1]["index"] == 0 and block["type"] == "tool_use" and block["input"] == {}
        assert json.loads(evs[3][1]["delta"]["partial_json"]) == {"city": "Oslo"}
        assert evs[3][1]["delta"]["type"] == "input_json_delta" and evs[5][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_maps_onto_the_chat_paths():
    """any / tool force a call as OpenAI's "required" / a named function do (the engine's plan_tools reads
    req.tool_choice); disable_parallel_tool_use is parallel_tool_calls false."""
    other = dict(WEATHER, name="get_time")
    cases = [(None, None, True), ({"type": "auto"}, None, True), ({"type": "any"}, "required", True),
             ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, "get_time", False),
             ({"type": "auto", "disable_parallel_tool_use": True}, None, False)]
    for choice, want, parallel in cases:
        body = {"messages": USER, "max_tokens": 4, "tools": [WEATHER, other]}
        req = parse_messages(body if choice is None else {**body, "tool_choice": choice})
        assert (req.tool_choice, req.parallel_tool_calls) == (want, parallel), choice
    none = parse_messages({"messages": USER, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "none"}})
    assert none.tools is None and none.tool_choice is None


# -- auth and errors ------------------------------------------------------------------------------------

def test_auth(url):
    assert anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0).messages.count_tokens(
        model="m", messages=USER).input_tokens > 0  # Authorization: Bearer
    for kw in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=url, max_retries=0, **kw).messages.create(model="m", max_tokens=2,
                                                                                    messages=USER)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", json=VALID["/v1/messages"], headers={"anthropic-version": "2023-06-01"},
                   timeout=60)
    assert "x-api-key" in assert_anthropic_error(r, 401, "authentication_error")  # no key at all
    r = httpx.post(url + "/v1/chat/completions", json=VALID["/v1/chat/completions"], headers={"x-api-key": KEY},
                   timeout=60)
    assert r.status_code == 200  # x-api-key works on the OpenAI endpoints too
    r = httpx.post(url + "/v1/chat/completions", json=VALID["/v1/chat/completions"], timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's envelope there


BAD = [
    ({"messages": USER}, "max_tokens"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 4}, "messages"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "system"),
    ({"messages": [{"role": "user"}], "max_tokens": 4}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
    ({"messages": [{"role": "user", "content": 7}], "max_tokens": 4}, "content"),
    ({"messages": USER + [{"role": "assistant", "content": "Sure "}], "max_tokens": 4}, "whitespace"),
    ({"messages": [{"role": "assistant", "content": "Sure"}], "max_tokens": 4}, "no user message"),
    ({"messages": USER, "max_tokens": 4, "system": 5}, "system"),
    ({"messages": USER, "max_tokens": 4, "stop_sequences": "x"}, "stop_sequences"),
    ({"messages": USER, "max_tokens": 4, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": USER, "max_tokens": 4, "stream": "yes"}, "stream"),
    ({"messages": USER, "max_tokens": 4, "tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": USER, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "server tools"),
    ({"messages": USER, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": USER, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "'x'"),
    ({"messages": USER, "max_tokens": 4, "tools": [WEATHER],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}}, "disable_parallel_tool_use"),
    ({"messages": USER + [{"role": "assistant", "content": "Sure"}], "max_tokens": 4, "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "prefill"),
    ({"messages": USER, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": USER, "max_tokens": 4, "model": 3}, "model"),
]


@pytest.mark.parametrize("body,needle", BAD, ids=[n for _, n in BAD])
def test_bad_requests_are_anthropic_errors(url, body, needle):
    assert needle in assert_anthropic_error(raw(url, "/v1/messages", body), 400)


def test_sdk_errors_and_http_conventions(client, url):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi " * 600}])
    assert "context" in e.value.message and e.value.body["type"] == "error"
    assert_anthropic_error(httpx.get(url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60), 405)
    r = raw(url, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": USER},
            headers={"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"})
    assert r.status_code == 200 and r.json()["type"] == "message"


def _shape(obj):
    """The keys of a JSON reply, recursively (lists by their first item): what an SDK parses."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shape(obj[0])] if obj else []
    return type(obj).__name__


def _pick_text(v):
    """The generated text (or token count, or model list) of a reply, ids aside."""
    if isinstance(v, list):
        return [_pick_text(x) for x in v]
    if isinstance(v, dict):
        return {k: _pick_text(x) for k, x in v.items() if k not in ("id", "created", "created_at")}
    return v


@pytest.mark.parametrize("path", ["/models", "/chat/completions", "/completions", "/responses", "/messages",
                                  "/messages/count_tokens"])
def test_unprefixed_aliases_answer_as_v1(url, path):
    """llama.cpp's paths without /v1: the same reply as the /v1 route (greedy, so the same text too)."""
    if path == "/models":
        alias, v1 = (httpx.get(url + p, headers={"x-api-key": KEY}, timeout=60) for p in (path, "/v1" + path))
    else:
        body = {**VALID["/v1" + path], "temperature": 0}
        alias, v1 = raw(url, path, body), raw(url, "/v1" + path, body)
    assert alias.status_code == v1.status_code == 200, alias.text
    a, b = alias.json(), v1.json()
    assert _shape(a) == _shape(b)
    for key in ("choices", "output", "content", "input_tokens", "data"):
        if key in b:
            assert _pick_text(a[key]) == _pick_text(b[key])


# -- robustness on every endpoint ------------------------------------------------------------------------

HOSTILE = {
    "invalid utf-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}], "prompt": "\xc3(", "max_tokens": 2}',
    "lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "prompt": "\\udfff", "max_tokens": 2}',
    "surrogate key": b'{"\\ud83d": 1, "messages": [], "prompt": "x"}',
    "not json": b'{"messages": [',
    "not an object": b'[1, 2, 3]',
    "wrong types": b'{"messages": {"role": "user"}, "prompt": {"a": 1}, "max_tokens": [2]}',
    "nested": b"[" * 50000 + b"]" * 50000,
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_hostile_bodies_are_4xx_and_the_server_stays_up(url, endpoint):
    for name, body in HOSTILE.items():
        r = raw(url, endpoint, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"], name
        if name == "invalid utf-8":
            assert "UTF-8" in err["message"]
        if name.startswith(("lone", "surrogate")):
            assert "surrogate" in err["message"]
        if "messages" in endpoint:
            assert r.json()["type"] == "error"
    pair = {**VALID[endpoint]}  # a complete surrogate pair is one character, and fine
    text = "\\ud83d\\ude00 hi"
    body = json.dumps(pair).replace('"hello there"', f'"{text}"').replace('"hi"', f'"{text}"').encode()
    assert raw(url, endpoint, content=body, headers={"content-type": "application/json"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_body_limit_is_413(url, endpoint):
    big = dict(VALID[endpoint], pad="x" * MAX_BODY)
    r = raw(url, endpoint, big)  # refused from Content-Length before the body is read
    assert r.status_code == 413 and "--max-body" in r.text
    chunks = (json.dumps(big)[i:i + 8192].encode() for i in range(0, MAX_BODY + 200, 8192))
    r = raw(url, endpoint, content=chunks, headers={"content-type": "application/json"})  # chunked: no length
    assert r.status_code == 413 and "--max-body" in r.text
    if "messages" in endpoint:
        assert r.json()["error"]["type"] == "request_too_large"
    assert raw(url, endpoint, VALID[endpoint]).status_code == 200


JSONV = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=6), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                                max_size=3),
                     max_leaves=6)
_TEXT = st.text(min_size=1, max_size=8)
_BLOCK = st.sampled_from(["text", "tool_use", "tool_result", "image"]).flatmap(
    lambda t: st.fixed_dictionaries({"type": st.just(t)}, optional={"text": _TEXT, "id": _TEXT, "name": _TEXT,
                                                                   "input": JSONV, "tool_use_id": _TEXT,
                                                                   "content": _TEXT | JSONV}))
FIELDS = {"model": _TEXT, "max_tokens": st.integers(1, 4), "system": _TEXT | st.lists(_BLOCK, max_size=2),
          "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                      "content": _TEXT | st.lists(_BLOCK, min_size=1, max_size=3)}),
                               min_size=1, max_size=3),
          "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
          "stop_sequences": st.lists(_TEXT, max_size=3), "stream": st.booleans(),
          "tools": st.just([WEATHER]), "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"},
                                                                       {"type": "any"}]),
          "thinking": st.just({"type": "disabled"}), "metadata": st.just({"user_id": "u"})}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.fixed_dictionaries({}, optional=FIELDS),
       corrupt=st.dictionaries(st.sampled_from(sorted(FIELDS)), JSONV, max_size=2), poison=POISON)
def test_fuzz_messages_never_5xx(url, fields, corrupt, poison):
    body = {"messages": USER, "max_tokens": 2, **fields, **corrupt}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4
    r = raw(url, "/v1/messages", content=wire(body, poison), headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if poison:
        assert_poison_refused(r, poison, lambda r: assert_anthropic_error(r, 400))
        assert httpx.get(url + "/health").status_code == 200
        return
    if r.status_code >= 400:
        assert_anthropic_error(r, r.status_code)
    elif body.get("stream") is True:
        assert events(r.text)[-1][0] == "message_stop"
    else:
        assert r.json()["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")


# -- the serve process ----------------------------------------------------------------------------------

def test_port_in_use_is_refused_before_loading(moe_path, capsys, monkeypatch):
    def never(*a, **k):
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(strata_jax, "load", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        assert main(["serve", "--model", str(moe_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "--port" in err
    assert time.perf_counter() - t0 < 5
    assert main(["serve", "--model", str(moe_path), "--max-body", "lots"]) == 2
    assert "--max-body" in capsys.readouterr().err


# streams that outlast the grace period on a fast machine: greedy, this random model loops on these without
# a stop id for 16,000 tokens (~12 s alone on the 2-core machine; "hello" stops after ~1,200)
LONG = 16000
LONG_OPENAI = {"/v1/completions": {"prompt": "the", "max_tokens": LONG},
               "/v1/chat/completions": {"messages": USER, "max_tokens": LONG},
               "/v1/responses": {"input": USER, "max_output_tokens": LONG}}
STARTED = ('"text":"', '"delta":{"content":"', "event: response.output_text.delta", "content_block_start")


@pytest.mark.parametrize("openai_path", list(LONG_OPENAI))
def test_sigterm_ends_open_streams_after_the_grace_period(moe_path, tmp_path, openai_path):
    """Two streams longer than the grace period (one of OpenAI's endpoints and Anthropic's) and a short
    one that fits in it: SIGTERM lets the short one finish, then ends the long ones with an error event
    (chat and completions: then [DONE]; responses: then response.failed, its terminal event) and the
    process exits 0 without a traceback. Meanwhile the server still listens: a new request gets 503 with
    Retry-After, not a refused connection."""
    grace = 2.0
    srv = ServerProcess(moe_path, tmp_path / "server.log", "--shutdown-grace", str(grace), "--parallel", "3",
                        "--ctx", "16384", "--expert-pools", "shared", "--expert-slots", "16", "--no-warmup")
    lines: dict[str, list[str]] = {"openai": [], "anthropic": [], "short": []}
    started = {k: threading.Event() for k in lines}
    bodies = {"openai": (openai_path, {**LONG_OPENAI[openai_path], "temperature": 0, "stream": True}),
              "anthropic": ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": LONG, "temperature": 0,
                                             "stream": True}),
              "short": ("/v1/completions", {"prompt": "hi", "max_tokens": 12, "temperature": 0, "stream": True})}

    def stream(name):
        path, body = bodies[name]
        with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines[name].append(line)
                if any(mark in line for mark in STARTED):
                    started[name].set()
        started[name].set()

    try:
        t0 = time.monotonic()
        srv.wait_ready()
        print(f"ready after {time.monotonic() - t0:.1f} s")
        threads = {k: threading.Thread(target=stream, args=(k,)) for k in ("openai", "anthropic")}
        for t in threads.values():
            t.start()
        assert started["openai"].wait(60) and started["anthropic"].wait(60)
        threads["short"] = threading.Thread(target=stream, args=("short",))
        threads["short"].start()
        assert started["short"].wait(30)
        print(f"streaming after {time.monotonic() - t0:.1f} s")
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # during the grace period the server still listens: a new request gets 503 with Retry-After
        while httpx.get(srv.url + "/health", timeout=5).status_code == 200 and time.monotonic() - t_sig < 5:
            time.sleep(0.05)
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        assert 1 <= int(late.headers["retry-after"]) <= grace + 1
        assert srv.proc.wait(30) == 0, srv.output()
        for t in threads.values():
            t.join(10)
            assert not t.is_alive()
        assert grace <= time.monotonic() - t_sig < grace + 10
    finally:
        srv.stop()
    short = [json.loads(x[6:]) for x in lines["short"] if x.startswith("data: {")]
    assert lines["short"][-1] == "data: [DONE]" and short[-1]["choices"][0]["finish_reason"] == "length"
    openai_data = [x for x in lines["openai"] if x.startswith("data: ")]
    if openai_path == "/v1/responses":  # named events, no [DONE]
        kinds = [x for x in lines["openai"] if x.startswith("event: ")]
        assert kinds[0] == "event: response.created" and kinds[-2:] == ["event: error", "event: response.failed"]
        err, failed = (json.loads(x[6:]) for x in openai_data[-2:])
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
        r = failed["response"]
        assert r["status"] == "failed" and r["error"] == {"code": "shutting_down", "message": err["message"]}
        assert r["output"][0]["status"] == "incomplete" and r["output"][0]["content"][0]["text"]
        assert [json.loads(x[6:])["sequence_number"] for x in openai_data] == list(range(len(openai_data)))
    else:
        assert openai_data[-1] == "data: [DONE]", openai_data[-3:]
        err = json.loads(openai_data[-2][6:])["error"]
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
        text = [json.loads(x[6:])["choices"][0] for x in openai_data[:-2]]
        assert all(c["finish_reason"] is None for c in text)  # cut, not finished
        assert "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in text)
    anthropic_events = [x for x in lines["anthropic"] if x.startswith("event: ")]
    assert anthropic_events[0] == "event: message_start" and anthropic_events[-1] == "event: error"
    last = json.loads([x for x in lines["anthropic"] if x.startswith("data: ")][-1][6:])
    assert last["type"] == "error" and "shutting down" in last["error"]["message"]
    log = srv.output()
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "stopping 2 running request(s)" in log
