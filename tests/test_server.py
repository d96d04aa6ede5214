"""The OpenAI-compatible app in process (Starlette TestClient) around small synthetic GGUF models:
endpoints, streaming, usage arithmetic, sampling semantics, auth, back-pressure, cancellation, error
JSON for every kind of bad input (including a hypothesis fuzz), tool-call parsing and metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import strata_jax
from strata_jax.cli import build_parser, main
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.core.errors import StrataError
from strata_jax.engine.streaming import GenerationChunk
from strata_jax.serving.app import create_app
from strata_jax.serving.engine import Engine, Job
from strata_jax.serving.protocol import GenRequest, parse_chat, token_text
from strata_jax.serving.responses import parse_responses
from strata_jax.serving.tools import detect_family
from strata_jax.serving.server import check_options, model_id

MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0")
DENSE = SyntheticSpec(arch="qwen2", n_layers=1, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0")
CTX = 256
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "moe.gguf", MOE)


@pytest.fixture(scope="module")
def model(moe_path):
    return strata_jax.load(moe_path, ctx=CTX, expert_slots=8)  # half the experts: misses happen


@contextlib.contextmanager
def serving(model_or_loader, *, api_key=None, queue_size=64, wait=True, parallel=1):
    loader = model_or_loader if callable(model_or_loader) else (lambda: model_or_loader)
    engine = Engine(loader, queue_size=queue_size, warmup=False, parallel=parallel)
    app = create_app(engine, model_id="moe", api_key=api_key)
    with TestClient(app) as client:
        if wait:
            assert engine.wait_ready(60)
        yield client


@pytest.fixture(scope="module")
def client(model):
    with serving(model) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MSGS, **body})


def parse_sse(text: str) -> list[dict]:
    """Every event is `data: <json>` and the last is `data: [DONE]`."""
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text[-200:]
    out = []
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev, ev
        out.append(json.loads(ev[len("data: "):]))
    return out


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# -- status endpoints ----------------------------------------------------------------------------------

def test_health_while_loading_then_ready(model):
    gate = threading.Event()

    def slow_loader():
        gate.wait(30)
        return model

    with serving(slow_loader, wait=False) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.json()["loaded"] is False
        err = assert_error(chat(c, max_tokens=2), 503)
        assert err["code"] == "model_loading" and "Retry-After" in chat(c, max_tokens=2).headers
        for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]}),
                           ("/apply-template", {"messages": MSGS}), ("/v1/responses/input_tokens", {"input": "hi"})):
            assert assert_error(c.post(path, json=body), 503)["code"] == "model_loading"  # the tokenizer comes with it
        assert assert_error(c.get("/props"), 503)["code"] == "model_loading"
        gate.set()
        for _ in range(300):
            if (r := c.get("/health")).status_code == 200:
                break
            time.sleep(0.02)
        assert r.json() == {"status": "ok", "loaded": True, "model": "moe", "max_context": CTX, "api_key": False,
                            "queue_depth": 0}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": ["a", True]}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "a", "parse_special": 1}, "parse_special"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/apply-template", {}, "messages"),
    ("/v1/chat/completions/input_tokens", {"messages": "hi"}, "messages"),
    ("/tokenize", [1, 2], None),
    ("/v1/completions", {"prompt": "def f():", "suffix": "\n", "max_tokens": 2}, "suffix"),  # no FIM tokens
    ("/v1/completions", {"prompt": [1, 2], "suffix": "\n", "max_tokens": 2}, "suffix"),
    ("/v1/completions", {"prompt": "a", "suffix": 3, "max_tokens": 2}, "suffix"),
])
def test_token_and_infill_requests_name_bad_input(client, path, body, param):
    err = assert_error(client.post(path, json=body), 400, param)
    assert err["message"]


def test_token_endpoints_round_trip(client, model):
    ids = client.post("/tokenize", json={"content": "hello there", "add_special": True}).json()["tokens"]
    assert ids == model.tokenize("hello there", add_special=True)
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"].endswith("hello there")
    prompt = client.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
    n = client.post("/v1/chat/completions/input_tokens", json={"messages": MSGS}).json()["input_tokens"]
    assert n == len(model.prompt_tokens(MSGS)) and model.tokenize(prompt, add_special=False)[-3:] == \
        model.prompt_tokens(MSGS)[-3:]


# -- llama.cpp's /completion and /infill ------------------------------------------------------------------

def test_llamacpp_completion_is_the_openai_completion_in_llamacpps_format(client, model):
    greedy = {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0}
    ref = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 6, **greedy}).json()
    r = client.post("/completion", json={"prompt": "hello there", "n_predict": 6, "return_tokens": True, **greedy})
    out = r.json()
    assert out["content"] == ref["choices"][0]["text"] and out["stop"] is True and out["model"] == "moe"
    assert out["tokens_predicted"] == len(out["tokens"]) == ref["usage"]["completion_tokens"]
    assert out["tokens_evaluated"] == ref["usage"]["prompt_tokens"] == len(model.tokenize("hello there"))
    assert out["stop_type"] == {"length": "limit", "stop": "eos"}[ref["choices"][0]["finish_reason"]]
    assert out["prompt"] == model.tokenizer.decode(model.tokenize("hello there"), skip_special=False)
    assert out["generation_settings"]["n_predict"] == 6 and out["timings"]["predicted_n"] == out["tokens_predicted"]
    assert client.post("/completion", json={"prompt": "hello there", "n_predict": 6, **greedy}).json()["tokens"] == []
    # streamed: the same text and ids in pieces, then a last event with stop and the whole request's figures
    events = [json.loads(e[len("data: "):]) for e in client.post(
        "/completion", json={"prompt": "hello there", "n_predict": 6, "stream": True, **greedy}).text.split("\n\n")
        if e]
    *pieces, last = events
    assert "".join(e["content"] for e in pieces) == out["content"] and not any(e["stop"] for e in pieces)
    assert [t for e in pieces for t in e["tokens"]] == out["tokens"]
    assert last["stop"] is True and last["content"] == "" and last["tokens_predicted"] == out["tokens_predicted"]


def test_llamacpp_completion_stops_on_a_word_and_takes_llamacpps_defaults(client):
    greedy = {"temperature": 0, "n_predict": 8}
    text = client.post("/completion", json={"prompt": [1, 2, 3], **greedy}).json()["content"]
    word = text[2:5]
    out = client.post("/completion", json={"prompt": [1, 2, 3], "stop": [word], **greedy}).json()
    assert out["stop_type"] == "word" and out["stopping_word"] == word and out["content"] == text[:text.index(word)]
    settings = client.post("/completion", json={"prompt": "hi", "n_predict": 1}).json()["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"]) == (0.8, 40, 0.95, 0.05)
    only = client.post("/completion", json={"prompt": "hello", "n_predict": 0}).json()  # the prompt only
    assert only["tokens_predicted"] == 0 and only["tokens_evaluated"] > 0 and only["content"] == ""


def test_llamacpp_n_probs(client):
    """n_probs: each generated token with the most likely n at its step, the log-probabilities the OpenAI route
    reports for the same greedy completion; streamed, each piece carries its own."""
    greedy = {"prompt": "hello there", "temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0}
    out = client.post("/completion", json={**greedy, "n_predict": 5, "n_probs": 3, "return_tokens": True}).json()
    ref = client.post("/v1/completions", json={**greedy, "max_tokens": 5, "logprobs": 3}).json()["choices"][0]
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"] and len(probs) == out["tokens_predicted"]
    assert [p["logprob"] for p in probs] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-6)
    for p in probs:
        top = [t["logprob"] for t in p["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True) and p["top_logprobs"][0]["id"] == p["id"]
        assert bytes(p["bytes"]).decode("utf-8", errors="ignore") == p["token"]
    events = [json.loads(e[len("data: "):]) for e in client.post(
        "/completion", json={**greedy, "n_predict": 5, "n_probs": 3, "stream": True}).text.split("\n\n") if e]
    assert [p for e in events[:-1] for p in e["completion_probabilities"]] == probs
    assert_error(client.post("/completion", json={**greedy, "n_probs": 3, "post_sampling_probs": True}), 400,
                 "post_sampling_probs")


@pytest.mark.parametrize("path, body, param", [
    ("/completion", {"prompt": "a", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "a", "dry_multiplier": 0.8}, "dry_multiplier"),
    ("/completion", {"prompt": "a", "n_predict": "ten"}, "n_predict"),
    ("/completion", {"prompt": ["a", 3]}, "prompt"),
    ("/completion", {}, "prompt"),
    ("/infill", {"input_suffix": "b"}, "input_prefix"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]}, "input_extra"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b"}, "input_suffix"),  # this model has no FIM tokens
])
def test_llamacpp_requests_name_bad_input(client, path, body, param):
    assert_error(client.post(path, json=body), 400, param)


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    m = body["data"][0]
    assert m["id"] == "moe" and m["object"] == "model" and m["context_length"] == CTX
    assert m["meta"]["n_ctx_train"] == MOE.context_length
    ns = argparse.Namespace(alias=None, model="/x/y/Qwen3-30B-A3B-Q4_K_M.gguf")
    assert model_id(ns) == "Qwen3-30B-A3B-Q4_K_M"
    assert model_id(argparse.Namespace(alias="qwen", model="/x/y.gguf")) == "qwen"


# -- generation ---------------------------------------------------------------------------------------------

def test_chat_usage_and_reproducible_sampling(client, model):
    r = chat(client, max_tokens=12, seed=7, cache_prompt=False)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "moe" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    ref = model.generate(MSGS, max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=7,
                         cache_prompt=False)  # OpenAI's defaults
    assert choice["message"]["content"] == ref.text
    assert u["prompt_tokens"] == len(model.prompt_tokens(MSGS))
    assert u["completion_tokens"] == len(ref.token_ids) == body["timings"]["predicted_n"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert set(body["timings"]) == {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                                    "predicted_per_second", "cache_n"}
    ex = body["expert_cache"]
    assert ex["lookups"] == ex["hits"] + ex["misses"] > 0 and ex["bytes_h2d"] > 0
    assert ex["misses"] == 0 or 0 < ex["transfer_stall_seconds"] < body["timings"]["prompt_ms"] / 1e3 + \
        body["timings"]["predicted_ms"] / 1e3 + 1  # measured fetch cost x fetched experts: a share of the request
    # same seed, same text (prompt cache on or off); another seed, other text
    again = chat(client, max_tokens=12, seed=7).json()
    assert again["choices"][0]["message"]["content"] == ref.text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["timings"]["cache_n"] > 0
    other = chat(client, max_tokens=12, seed=8).json()["choices"][0]["message"]["content"]
    assert other != ref.text


def test_greedy_matches_model_generate(client, model):
    body = chat(client, max_tokens=10, temperature=0).json()
    assert body["choices"][0]["message"]["content"] == model.generate(MSGS, max_tokens=10, temperature=0).text
    r = client.post("/v1/completions", json={"prompt": "def fib(n):", "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["text"] == model.generate("def fib(n):", max_tokens=6, temperature=0).text
    assert r.json()["object"] == "text_completion"


def test_chat_stream_matches_non_stream(client):
    full = chat(client, max_tokens=10, seed=3).json()
    r = chat(client, max_tokens=10, seed=3, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(r.text)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "usage" not in chunks[-1] and "timings" in chunks[-1]


def test_decode_chunks_serve_the_same(moe_path, client):
    """A GPU decodes 16 steps per jitted call by default: served in 4-step calls, the same requests give
    the same choices and usage, streamed or not, greedy or seeded, with a stop string and a length cut
    that fall inside a chunk."""
    greedy = chat(client, max_tokens=12, temperature=0).json()["choices"][0]["message"]["content"]
    stop = greedy[5:7]
    bodies = [dict(max_tokens=12, temperature=0), dict(max_tokens=10, seed=3, temperature=0.8),
              dict(max_tokens=12, temperature=0, stop=stop), dict(max_tokens=6, temperature=0)]
    chunked = strata_jax.load(moe_path, ctx=CTX, expert_slots=8, decode_chunk=4)
    with serving(chunked) as c4:
        for body in bodies:
            a, b = chat(client, **body).json(), chat(c4, **body).json()
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: each server's history
            assert a["choices"] == b["choices"], body
            assert [a["usage"][k] for k in counts] == [b["usage"][k] for k in counts], body
            streamed = parse_sse(chat(c4, stream=True, **body).text)
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == \
                a["choices"][0]["message"]["content"]
            assert streamed[-1]["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert chunked.decode_chunk == 4 and chunked.host_timing()["decode_calls"] < chunked.host_timing()["decode_steps"]


def test_stream_include_usage(client):
    r = chat(client, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = parse_sse(r.text)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions(client, model):
    r = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 4, "temperature": 0})
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(model.prompt_tokens("Once upon"))
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    ids = model.tokenize("Once upon")
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == body["choices"][0]["text"]
    s = client.post("/v1/completions",
                    json={"prompt": ["Once upon"], "max_tokens": 4, "temperature": 0, "stream": True})
    chunks = parse_sse(s.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_length(client):
    text = chat(client, max_tokens=12, temperature=0).json()["choices"][0]["message"]["content"]
    stop = text[4:6]
    want = text[: text.find(stop)]
    for s in (stop, [stop, "\x00never"]):
        body = chat(client, max_tokens=12, temperature=0, stop=s).json()
        assert body["choices"][0]["message"]["content"] == want
        assert body["choices"][0]["finish_reason"] == "stop"
    body = chat(client, max_completion_tokens=3, temperature=0).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


def test_content_parts_tools_and_reasoning_effort_accepted(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    body = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == len(model.prompt_tokens([{"role": "user", "content": "hello\nthere"}]))
    tools = TOOLS
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": tools, "tool_choice": "auto",
                                                   "max_tokens": 2, "reasoning_effort": "none"})
    assert r.status_code == 200, r.text


# -- logprobs and penalties -------------------------------------------------------------------------------

def _lp_items(model, entries):
    """The chat logprobs items Model's TokenLogprob entries should become."""
    def one(tid, v):
        b = model.token_bytes(tid)
        return {"token": token_text(b), "logprob": pytest.approx(v, abs=1e-5), "bytes": list(b)}
    return [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top]) for e in entries]


def test_chat_logprobs(client, model):
    body = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, cache_prompt=False).json()
    ref = model.generate(MSGS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    assert lp["content"] == _lp_items(model, ref.logprobs) and len(lp["content"]) == 8
    if not set(ref.token_ids) & model.tokenizer.special_ids:  # the bytes spell the text
        text = bytes(b for item in lp["content"] for b in item["bytes"]).decode(errors="replace")
        assert text == body["choices"][0]["message"]["content"]
    plain = chat(client, max_tokens=3, temperature=0, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert [i["top_logprobs"] for i in plain] == [[]] * 3
    assert [i["logprob"] for i in plain] == pytest.approx([i["logprob"] for i in lp["content"][:3]], abs=1e-5)
    assert chat(client, max_tokens=2).json()["choices"][0]["logprobs"] is None
    # streamed: each content chunk carries its tokens' logprobs; together they are the whole list
    chunks = parse_sse(chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True,
                            cache_prompt=False).text)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk has no tokens
    items = [i for c in chunks if c["choices"][0]["logprobs"] for i in c["choices"][0]["logprobs"]["content"]]
    assert items == lp["content"]
    assert all(c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["delta"].get("content"))


def test_completion_logprobs_legacy_format(client, model):
    prompt = "Once upon"
    for n in (0, 2, 5):
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                     "logprobs": n}).json()
        ref = model.generate(prompt, max_tokens=6, temperature=0, logprobs=True, top_logprobs=n)
        lp = body["choices"][0]["logprobs"]
        text = lambda t: token_text(model.token_bytes(t))  # noqa: E731
        assert lp["tokens"] == [text(e.token_id) for e in ref.logprobs]
        assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
        assert lp["text_offset"] == [len(prompt) + e.offset for e in ref.logprobs]  # from the prompt's start
        for top, e, tok in zip(lp["top_logprobs"], ref.logprobs, lp["tokens"]):
            # the n most likely and the sampled token (greedy: among them, so exactly n, or 1 for n=0)
            assert top == pytest.approx({text(t): v for t, v in e.top} | {tok: e.logprob}, abs=1e-5)
            assert len(top) == max(n, 1)
    by_ids = client.post("/v1/completions", json={"prompt": model.tokenize(prompt, add_special=False),
                                                   "max_tokens": 2, "temperature": 0, "logprobs": 1}).json()
    assert by_ids["choices"][0]["logprobs"]["text_offset"][0] == len(prompt)
    chunks = parse_sse(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                            "logprobs": 5, "stream": True}).text)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]
    off = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "logprobs": False}).json()
    assert off["choices"][0]["logprobs"] is None


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_completion_echo_scores_the_prompt(client, model):
    """echo (OpenAI's legacy completions, what lm-eval's loglikelihood reads): the reply starts with the prompt,
    its first token's logprob null and every other one's the model's log-probability given the tokens before
    it (Model.logits), with alternatives; max_tokens 0 scores the prompt alone; streamed == whole."""
    prompt = "Once upon a time there was"
    ids = model.prompt_tokens(prompt)
    ref = _log_softmax(model.logits(ids))
    text = lambda t: token_text(model.token_bytes(t))  # noqa: E731
    for max_tokens in (0, 3):
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "echo": True, "logprobs": 2}).json()
        choice, gen = body["choices"][0], model.generate(prompt, max_tokens=3, temperature=0, logprobs=True)
        assert choice["text"] == prompt + (gen.text if max_tokens else "")
        assert body["usage"] == dict(body["usage"], prompt_tokens=len(ids), completion_tokens=max_tokens)
        lp = choice["logprobs"]
        assert lp["tokens"][: len(ids)] == [text(t) for t in ids] and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [ref[j, ids[j + 1]] for j in range(len(ids) - 1)] + [e.logprob for e in gen.logprobs][:max_tokens]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        for j, top in enumerate(lp["top_logprobs"][1: len(ids)]):
            best = np.argsort(-ref[j])[:2]
            assert top == pytest.approx({text(t): ref[j, t] for t in best} | {lp["tokens"][j + 1]: want[j]},
                                        abs=1e-4)
        assert lp["text_offset"][: len(ids)] == [len("".join(lp["tokens"][:j])) for j in range(len(ids))]
        assert lp["text_offset"][len(ids):] == [len(prompt) + e.offset for e in gen.logprobs][:max_tokens]
        chunks = parse_sse(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                                "temperature": 0, "echo": True, "logprobs": 2,
                                                                "stream": True}).text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        assert sum((s["token_logprobs"] for s in streamed), []) == lp["token_logprobs"]
    plain = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0,
                                                  "echo": True}).json()["choices"][0]
    assert plain["text"] == model.detokenize(ids) + model.generate(prompt, max_tokens=2, temperature=0).text
    assert plain["logprobs"] is None


def test_completions_batched_prompts(client, model):
    """OpenAI's array of prompts (texts or token arrays): one response, choice i * n + j being prompt i's
    choice j, each what the prompt alone gives; usage sums the prompts; echo per prompt; a streamed batch
    and an oversized one are refused by name."""
    prompts = ["Once upon", model.tokenize("hello there", add_special=False), "The tea"]
    body = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "temperature": 0, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    alone = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 3, "temperature": 0}).json()
             for p in prompts]
    for i, a in enumerate(alone):
        assert [c["text"] for c in body["choices"][2 * i: 2 * i + 2]] == [a["choices"][0]["text"]] * 2
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 6 * 3
    echoed = client.post("/v1/completions", json={"prompt": prompts[::2], "max_tokens": 0, "echo": True,
                                                   "logprobs": 1}).json()
    assert [c["text"] for c in echoed["choices"]] == prompts[::2]
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in echoed["choices"])
    assert echoed["usage"]["completion_tokens"] == 0
    assert_error(client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True}), 400, "stream")
    assert_error(client.post("/v1/completions", json={"prompt": ["a"] * 65}), 400, "prompt")
    err = assert_error(client.post("/v1/completions", json={"prompt": ["a", "", "b"]}), 400, "prompt")
    assert err["message"].startswith("prompt 1:")


def test_penalties_through_the_server(client, model):
    for pen in (dict(presence_penalty=2.0), dict(frequency_penalty=1.5, presence_penalty=-0.5),
                dict(repeat_penalty=1.8, repeat_last_n=16)):
        body = chat(client, max_tokens=12, temperature=0, **pen).json()
        ref = model.generate(MSGS, max_tokens=12, temperature=0, **pen)
        assert body["choices"][0]["message"]["content"] == ref.text
        r = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8, "temperature": 0, **pen})
        assert r.json()["choices"][0]["text"] == model.generate("hello there", max_tokens=8, temperature=0, **pen).text


def test_batched_server_logprobs_and_penalties(client, model):
    reqs = [dict(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, presence_penalty=1.0),
            dict(max_tokens=8, seed=3, frequency_penalty=0.5), dict(max_tokens=6, temperature=0, logprobs=True)]
    alone = [chat(client, **r).json()["choices"][0] for r in reqs]
    with serving(model, parallel=2) as c:
        results = [None] * len(reqs)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, chat(c, **reqs[i]).json()))
                   for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)  # a loaded machine compiles the batched programs slowly
    for got, want in zip(results, alone):
        got = got["choices"][0]
        assert got["message"] == want["message"]
        if want["logprobs"] is None:
            assert got["logprobs"] is None
        else:
            assert got["logprobs"]["content"] == [
                dict(i, logprob=pytest.approx(i["logprob"], abs=1e-5),
                     top_logprobs=[dict(t, logprob=pytest.approx(t["logprob"], abs=1e-5)) for t in i["top_logprobs"]])
                for i in want["logprobs"]["content"]]


def test_dense_model_has_no_expert_cache(tmp_path):
    m = strata_jax.load(write_synthetic_gguf(tmp_path / "dense.gguf", DENSE), ctx=64)
    with serving(m) as c:
        body = chat(c, max_tokens=3, temperature=0).json()  # greedy: an unseeded sample may end early
        assert "expert_cache" not in body and body["usage"]["completion_tokens"] == 3
        assert c.get("/health").json()["max_context"] == 64


# -- errors ----------------------------------------------------------------------------------------------

BAD = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": MSGS, "n": 0}, "n"),
    ({"messages": MSGS, "n": 17}, "n"),
    ({"messages": MSGS, "n": "2"}, "n"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "temperature": -1}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "top_k": 1.5}, "top_k"),
    ({"messages": MSGS, "min_p": 2}, "min_p"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "seed": "x"}, "seed"),
    ({"messages": MSGS, "seed": 10**400}, "seed"),
    ({"messages": MSGS, "top_k": 10**30}, "top_k"),
    ({"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSGS, "stop": ""}, "stop"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MSGS, "tool_choice": 3}, "tool_choice"),
    ({"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSGS, "response_format": "json"}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format"),
    ({"messages": MSGS, "json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema"),
    ({"messages": MSGS, "json_schema": [1]}, "json_schema"),
    ({"messages": MSGS, "grammar": "root ::= undefined_rule"}, "grammar"),
    ({"messages": MSGS, "grammar": 'root ::= "a'}, "grammar"),
    ({"messages": MSGS, "grammar": ""}, "grammar"),
    ({"messages": MSGS, "grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MSGS, "logprobs": "yes"}, "logprobs"),
    ({"messages": MSGS, "logprobs": 2}, "logprobs"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),  # OpenAI: top_logprobs needs logprobs true
    ({"messages": MSGS, "logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSGS, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": MSGS, "presence_penalty": -2.01}, "presence_penalty"),
    ({"messages": MSGS, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": MSGS, "frequency_penalty": "high"}, "frequency_penalty"),
    ({"messages": MSGS, "repeat_penalty": -1.1}, "repeat_penalty"),
    ({"messages": MSGS, "repeat_penalty": 0}, "repeat_penalty"),
    ({"messages": MSGS, "repeat_last_n": -1}, "repeat_last_n"),
    ({"messages": MSGS, "repeat_last_n": 257}, "repeat_last_n"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_chat_requests_are_400(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("logprobs", [True, 6, -1, 1.5, "2", [1]])
def test_bad_completion_logprobs_are_400(client, logprobs):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": logprobs})
    assert "integer" in assert_error(r, 400, "logprobs")["message"]


@pytest.mark.parametrize("body,param", [({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                                        ({"prompt": "hi", "echo": "yes"}, "echo"),
                                        ({"prompt": "def f(", "suffix": "\n", "echo": True}, "echo"),
                                        ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens")])
def test_bad_completion_echo_requests_are_400(client, body, param):
    assert_error(client.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("prompt", ["", [], [1, "x"], ["a", ""], ["a", [1, "x"]], {"p": 1}, [10**9], None])
def test_bad_completion_prompts_are_400(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}), 400, "prompt")


def test_malformed_bodies_and_routes(client):
    for raw in (b"{bad", b"", b"[1, 2]", b"\xff\xfe", b"[" * 100000):
        assert_error(client.post("/v1/chat/completions", content=raw), 400)
    assert_error(client.get("/v1/chat/completions"), 405)
    assert_error(client.get("/v2/nothing"), 404)


def test_prompt_longer_than_context(client):
    err = assert_error(chat(client, messages=[{"role": "user", "content": "hello " * 400}]), 400, "messages")
    assert err["code"] == "context_length_exceeded" and f"context is {CTX} tokens" in err["message"]
    assert "--ctx" in err["message"]


JSONV = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
                     | st.text(max_size=8), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                                max_size=3),
                     max_leaves=6)
_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
_MSG = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT})
VALID = {  # plausible values, so that many fuzzed requests get through validation and run
    "model": _TEXT, "messages": st.lists(_MSG, min_size=1, max_size=3),
    "prompt": _TEXT | st.lists(st.integers(0, 511), min_size=1, max_size=8),
    "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100), "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1), "stop": _TEXT | st.lists(_TEXT, max_size=4), "n": st.just(1),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "reasoning_effort": st.sampled_from(["none", "low", "high"]), "cache_prompt": st.booleans(),
    "logprobs": st.booleans() | st.integers(0, 5), "top_logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repeat_penalty": st.floats(0.5, 2),
    "repeat_last_n": st.integers(0, 256), "response_format": st.just({"type": "text"}), "echo": st.booleans(),
    "chat_template_kwargs": st.just({"enable_thinking": False}),
}


# Poison for a fuzzed body: a lone surrogate escape (json.dumps writes a lone surrogate str as "\udXXX")
# or bytes that are not UTF-8, put at the start of one of the body's strings. st.text never draws either.
_LONE = st.characters(categories=["Cs"]).map(lambda c: json.dumps(c)[1:-1].encode())
# any bytes, then a lead byte (0xc0-0xff) that the next byte, ASCII, does not continue: never UTF-8
_NOT_UTF8 = st.sampled_from([b"\xff", b"\xc3(", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"]) | st.tuples(
    st.binary(max_size=3), st.integers(0xC0, 0xFF)).map(lambda t: t[0] + bytes([t[1]]))
POISON = st.sampled_from([None, None, None, None, "surrogate", "UTF-8"]).flatmap(
    lambda kind: st.just(None) if kind is None else st.tuples(
        st.just(kind), _LONE if kind == "surrogate" else _NOT_UTF8, st.integers(0, 10**6)))


def wire(body, poison=None) -> bytes:
    """The body as JSON (json.dumps: NaN and Infinity go over the wire too), poisoned when asked: the junk goes
    right after the opening quote of one of its strings (key or value), so the JSON around it stays well formed."""
    text = json.dumps(body).encode()  # ASCII: non-ASCII characters are escaped
    if poison is None:
        return text
    _, junk, spot = poison
    starts, inside, i = [], False, 0
    while i < len(text):
        c = text[i:i + 1]
        if inside and c == b"\\":
            i += 2
            continue
        if c == b'"':
            inside = not inside
            if inside:
                starts.append(i + 1)
        i += 1
    at = starts[spot % len(starts)]
    return text[:at] + junk + text[at:]


def assert_poison_refused(r, poison, message=lambda r: r.json()["error"]["message"]):
    """A poisoned body is a 400 that names the problem (a lone surrogate is checked after UTF-8)."""
    assert r.status_code == 400, (poison, r.status_code, r.text)
    assert poison[0] in message(r), (poison, r.text)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       fields=st.fixed_dictionaries({}, optional=VALID),
       corrupt=st.dictionaries(st.sampled_from(sorted(VALID)), JSONV, max_size=2), keep_valid=st.booleans(),
       poison=POISON)
def test_fuzz_never_5xx(client, endpoint, fields, corrupt, keep_valid, poison):
    body = {"max_tokens": 3, **({"messages": MSGS, "prompt": "hi"} if keep_valid else {}), **fields, **corrupt}
    for limit in ("max_tokens", "max_completion_tokens"):  # keep the fuzz fast; ranges have their own tests
        if isinstance(body.get(limit), int) and body[limit] > 8:
            body[limit] = 8
    r = client.post(endpoint, content=wire(body, poison))
    event(f"status {r.status_code}" + (f" ({poison[0]})" if poison else ""))
    assert r.status_code < 500, r.text
    if poison:
        assert_poison_refused(r, poison)
        assert client.get("/health").status_code == 200
        return
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    elif body.get("stream") is True:
        parse_sse(r.text)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


# -- auth, back-pressure, failures, cancellation -----------------------------------------------------------

def test_api_key(model):
    with serving(model, api_key="sekrit") as c:
        assert c.get("/health").json()["api_key"] is True
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            for r in (c.get("/v1/models", headers=headers), c.get("/metrics", headers=headers),
                      c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, headers=headers)):
                assert assert_error(r, 401)["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer sekrit"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, headers=ok).status_code == 200


class Wrapped:
    """The real model whose session is scripted: an admission blocks on a gate, fails once, or emits
    fixed text."""

    def __init__(self, model, *, gate=None, fail=0, script=None):
        self._m, self.gate, self.fail, self.script = model, gate, fail, script

    def __getattr__(self, name):
        return getattr(self._m, name)

    def session(self):
        return ScriptedSession(self, self._m.session())


class ScriptedSession:
    def __init__(self, wrapped, session):
        self.model, self._s = wrapped, session

    def __getattr__(self, name):
        return getattr(self._s, name)

    def admit(self, ids, **kw):
        w = self.model
        if w.gate is not None:
            assert w.gate.wait(30)
        if w.fail:
            w.fail -= 1
            raise RuntimeError("device on fire")
        if w.script is None:
            return self._s.admit(ids, **kw)
        chunks = [GenerationChunk(piece, [1]) for piece in w.script[:-1]]
        return 0, chunks + [GenerationChunk(w.script[-1], [1], "stop", {"predicted_n": len(w.script)}, list(ids))]


def test_queue_full_is_429(model):
    gate = threading.Event()
    with serving(Wrapped(model, gate=gate), queue_size=1) as c:
        engine = c.app.state.engine
        results = []
        threads = [threading.Thread(target=lambda: results.append(chat(c, max_tokens=2))) for _ in range(2)]
        threads[0].start()
        for _ in range(500):  # the first request is running (blocked), the second waits in the queue
            if engine.busy:
                break
            time.sleep(0.01)
        threads[1].start()
        for _ in range(500):
            if engine.queue_depth == 1:
                break
            time.sleep(0.01)
        assert c.get("/health").json()["queue_depth"] == 1
        r = chat(c, max_tokens=2)
        err = assert_error(r, 429)
        assert err["code"] == "queue_full" and r.headers["Retry-After"] == "1"
        gate.set()
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]


def test_engine_failure_is_500_for_that_request_only(model):
    with serving(Wrapped(model, fail=1)) as c:
        err = assert_error(chat(c, max_tokens=2), 500)
        assert "device on fire" in err["message"]
        assert chat(c, max_tokens=2).status_code == 200
        assert c.get("/health").status_code == 200


def test_cancel_stops_generation_between_tokens(model):
    engine = Engine(lambda: model, warmup=False)
    engine.start()
    assert engine.wait_ready(60)

    async def run():
        ids = model.tokenize("hello")
        long = Job(GenRequest("completion", ids, max_tokens=200, temperature=0), ids)
        engine.submit(long)
        ev = await asyncio.wait_for(long.events.get(), 30)
        assert ev.kind == "chunk"
        long.cancel()
        short = Job(GenRequest("completion", ids, max_tokens=3, temperature=0), ids)
        engine.submit(short)
        kinds = []
        while not kinds or kinds[-1] != "final":
            kinds.append((await asyncio.wait_for(short.events.get(), 30)).kind)
        seen = []
        while not long.events.empty():
            seen.append(long.events.get_nowait())
        assert all(e.kind == "chunk" for e in seen) and len(seen) < 150  # never reached its final event

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine.state == "stopped"


def test_draining_refuses_new_work(model):
    with serving(model) as c:
        c.app.state.engine.begin_drain(30)  # what SIGTERM does before uvicorn's graceful shutdown
        r = chat(c, max_tokens=2)
        assert assert_error(r, 503)["code"] == "shutting_down"
        assert 1 <= int(r.headers["retry-after"]) <= 30  # the grace period left, at least a second
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "shutting_down"


def test_reasoning_effort_none_turns_thinking_off(model):
    seen = {}

    class Thinking(Wrapped):
        tokenizer = SimpleNamespace(chat_template="{% if enable_thinking %}<think>{% endif %}", named_templates={})

        def prompt_tokens(self, prompt, **kw):
            seen.clear()
            seen.update(kw)
            return [1, 2, 3]

    engine = Engine(lambda: None)
    engine.model = Thinking(model)
    assert engine.tokenize(parse_chat({"messages": MSGS, "reasoning_effort": "none"})) == [1, 2, 3]
    assert seen == {"enable_thinking": False}
    engine.tokenize(parse_chat({"messages": MSGS, "reasoning_effort": "high", "tools": TOOLS}))
    assert seen == {"tools": TOOLS}


# -- tool calls -----------------------------------------------------------------------------------------

def test_tool_calls_end_to_end(model):
    script = ["I will", " call it. <tool_", 'call>{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}</tool_call>']
    tools = TOOLS
    with serving(Wrapped(model, script=script)) as c:
        engine = c.app.state.engine
        assert engine.tool_family.name == "json"  # the synthetic template teaches no tool format
        assert chat(c, tools=tools).json()["choices"][0]["finish_reason"] == "stop"  # so tags are content
        engine.tool_family = detect_family("... <tool_call>\n{...}\n</tool_call> ...")  # as a Qwen template's
        body = chat(c, tools=tools).json()
        msg = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "I will call it."
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
        chunks = parse_sse(chat(c, tools=tools, stream=True).text)
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        assert "".join(d.get("content", "") for d in deltas) == "I will call it. "
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                            "function": {"name": "get_weather", "arguments": ""}}
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # without tools (or tool_choice "none") the same text is plain content
        plain = chat(c, tools=tools, tool_choice="none").json()["choices"][0]
        assert plain["finish_reason"] == "stop" and "<tool_call>" in plain["message"]["content"]


# -- the Responses API ---------------------------------------------------------------------------------------

def sdk(client) -> openai.OpenAI:
    """The official SDK over the in-process app (TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def test_responses_match_chat_and_stream(client):
    o = sdk(client)
    r = o.responses.create(model="m", instructions="Be brief.", input="hello there", max_output_tokens=4,
                           temperature=0)
    same = chat(client, max_tokens=4, temperature=0).json()  # MSGS: the same system and user turns
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "moe"  # the served id, not the name asked
    assert r.output_text == same["choices"][0]["message"]["content"] and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (same["usage"]["prompt_tokens"], 4)
    assert r.usage.total_tokens == r.usage.input_tokens + 4 and r.instructions == "Be brief."
    events = list(o.responses.create(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}], max_output_tokens=4,
        temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output[0].content[0].text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.response.id for e in events if hasattr(e, "response")} == {events[0].response.id}


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({}, "input"), ({"input": []}, "input"), ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "instructions": 3}, "instructions"),
])
def test_responses_bad_input(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(client).responses.create(model="m", **body)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_responses_items_become_chat_turns():
    req, _ = parse_responses({"instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
    assert req.prompt == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}, "id": "call_1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}, {"role": "assistant", "content": "Sunny."}]
    assert req.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert (req.tool_choice, req.parallel_tool_calls) == ("get_weather", False)


def test_responses_function_calls(model):
    script = ["Let me check. ", '<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n</tool_call>']
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    with serving(Wrapped(model, script=script)) as c:
        c.app.state.engine.tool_family = detect_family("<tool_call>")
        o = sdk(c)
        r = o.responses.create(model="m", input="Weather in Oslo?", tools=tools)
        assert [item.type for item in r.output] == ["message", "function_call"] and r.status == "completed"
        assert r.output_text == "Let me check."
        call = r.output[1]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
        assert call.call_id.startswith("call_") and call.status == "completed"
        with o.responses.stream(model="m", input="Weather in Oslo?", tools=tools) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check. "
        args = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(args) == 1 and json.loads(args[0].delta) == {"city": "Oslo"} and args[0].output_index == 1
        assert [i.type for i in final.output] == ["message", "function_call"] and final.output[1].name == "get_weather"
        assert events[-1].type == "response.completed"
        # without tools the same text is the message
        plain = o.responses.create(model="m", input="Weather in Oslo?")
        assert [i.type for i in plain.output] == ["message"] and "<tool_call>" in plain.output_text


RESPONSES_VALID = {
    "input": _TEXT | st.lists(_MSG, min_size=1, max_size=3), "instructions": _TEXT,
    "max_output_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "stream": st.booleans(), "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "tools": st.just([{"type": "function", "name": "f", "parameters": {}}]), "parallel_tool_calls": st.booleans(),
    "metadata": st.just({"k": "v"}), "store": st.booleans(), "reasoning": st.just({"effort": "low"}),
}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=st.fixed_dictionaries({}, optional=RESPONSES_VALID),
       corrupt=st.dictionaries(st.sampled_from(sorted(RESPONSES_VALID)), JSONV, max_size=2), poison=POISON)
def test_responses_fuzz_never_5xx(client, fields, corrupt, poison):
    body = {"input": "hi", "max_output_tokens": 3, **fields, **corrupt}
    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] > 8:
        body["max_output_tokens"] = 8
    r = client.post("/v1/responses", content=wire(body, poison))
    assert r.status_code < 500, r.text
    if poison:
        assert_poison_refused(r, poison)
        assert client.get("/health").status_code == 200
        return
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    elif body.get("stream") is True:
        assert r.text.startswith("event: response.created\ndata: ")
    else:
        assert r.json()["status"] in ("completed", "incomplete")


# -- metrics and CLI -----------------------------------------------------------------------------------------

def test_metrics(model):
    with serving(model) as c:
        # sampled (no seed): a request may end early on an end-of-text token, so count what was served
        served = sum(chat(c, max_tokens=2).json()["usage"]["completion_tokens"] for _ in range(3))
        assert_error(chat(c, n=0), 400)
        text = c.get("/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        reqs = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["strata_requests"].samples
                if s.name == "strata_requests_total"}
        assert reqs[("chat_completions", "200")] == 3 and reqs[("chat_completions", "400")] == 1
        total = {s.name: s.value for s in fams["strata_completion_tokens"].samples}
        assert total["strata_completion_tokens_total"] == served > 0
        ttft = {s.name: s.value for s in fams["strata_time_to_first_token_seconds"].samples}
        assert ttft["strata_time_to_first_token_seconds_count"] == 3
        assert 0 < fams["strata_expert_cache_hit_rate"].samples[0].value <= 1
        assert fams["strata_kv_cache_tokens"].samples[0].value > 0
        assert fams["strata_kv_slots"].samples[0].value == 1 and fams["strata_kv_slots_in_use"].samples[0].value == 0
        as_json = c.get("/metrics?format=json").json()
        plain = {n for n in fams if not n.endswith("_created")}  # the text parser splits these off
        assert set(as_json) == plain == set(c.get("/metrics.json").json())
        assert {"name": "strata_requests_total", "labels": {"endpoint": "chat_completions", "status": "200"},
                "value": 3.0} in as_json["strata_requests"]["samples"]


def test_metrics_kv_streaming(moe_path):
    """--kv-resident: /metrics carries the share of the KV cells finished requests attended to that were read
    from VRAM (none without streaming)."""
    streamed = strata_jax.load(moe_path, ctx=CTX, expert_slots=8, kv_resident=16)
    with serving(streamed) as c:
        for _ in range(2):
            chat(c, max_tokens=4, messages=[{"role": "user", "content": "tell me a long story " * 4}])
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        hit = fams["strata_kv_vram_hit_ratio"].samples[0].value
        assert 0 < hit < 1 and hit == pytest.approx(streamed.kv_stats()["kv_vram_hit"])


def test_serve_refuses_unsafe_or_invalid_options(moe_path, capsys, monkeypatch):
    monkeypatch.delenv("STRATA_JAX_API_KEY", raising=False)
    assert main(["serve", "--model", str(moe_path), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", str(moe_path), "--parallel", bad])
        assert e.value.code == 2 and "--parallel must be" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--parallel", "1"])
    args.parallel = 0
    with pytest.raises(StrataError, match="--parallel 0 is invalid"):
        check_options(args)
    with pytest.raises(StrataError, match="parallel=0 is invalid"):
        Engine(lambda: None, parallel=0)
    assert main(["serve", "--model", str(moe_path) + ".missing"]) == 2
    assert "no such file" in capsys.readouterr().err
