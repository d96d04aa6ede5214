"""Constrained decoding (llguidance) and n > 1 choices.

References: llguidance's own numpy mask application (the device's apply_mask), a host-side greedy loop
over Model.logits masked by llguidance's matcher (a constrained row decoded on the device, alone and
batched beside an unconstrained one with 4-step chunks), jsonschema for the default model's output
(slow), the openai SDK for n=2 (whole and streamed)."""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest

llg = pytest.importorskip("llguidance")
from llguidance.numpy import apply_token_bitmask_inplace  # noqa: E402

import strata_jax  # noqa: E402
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402
from strata_jax.engine.constrained import Constraint, llg_tokenizer, request_grammar  # noqa: E402
from strata_jax.engine.sampling import apply_mask  # noqa: E402
from strata_jax.engine.session import Session  # noqa: E402
from strata_jax.serving.app import create_app  # noqa: E402
from strata_jax.serving.engine import Engine  # noqa: E402

DENSE = SyntheticSpec(arch="qwen2", n_layers=1, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0",
                      seed=5)
GBNF = 'root ::= word (" " word)* "."\nword ::= [a-e]+'
GBNF_RE = re.compile(r"[a-e]+( [a-e]+)*( |\.)?")  # a reply cut by max_tokens may end before a word
PROMPT = "the tea is hot and the rain is there"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("constrained") / "dense.gguf", DENSE)
    return strata_jax.load(path, ctx=128, decode_chunk=4)  # 4 decode steps per call, as a GPU's 16


@pytest.fixture(scope="module")
def session(moe):
    return Session(moe, 2)  # every test here runs 2 rows (the server's too): one set of programs compiles


def alone(s, prompt, **kw):
    """One request through session s: (token ids, text, finish reason)."""
    row, chunks = s.admit(prompt, cache_prompt=False, **kw)
    chunks = list(chunks)
    while row in s.active_rows:
        chunks += s.step().get(row, [])
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason


def masked_greedy(s, prompt, grammar, max_tokens, ff=0):
    """The reference: greedy over the model's own logits with llguidance's mask applied by llguidance;
    ff: before each sampled token, up to ff of the tokens llguidance forces (a decode call's share)."""
    model = s.model
    ids = model.prompt_tokens(prompt)
    m = llg.LLMatcher(llg_tokenizer(model.tokenizer, model.config.vocab_size), grammar)
    out = []
    stops = model.tokenizer.stop_ids
    sampled = 0
    while len(out) < max_tokens:
        if sampled and ff:  # the prefill's first token is sampled; each decode call may then fast-forward
            forced = m.compute_ff_tokens()[: min(ff, max_tokens - len(out) - 1)]
            assert m.consume_tokens(forced)
            out += forced
        sampled += 1
        logits = s.logits(ids + out)[-1:].copy()
        mask = np.empty((1, (logits.shape[1] + 31) // 32), np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        apply_token_bitmask_inplace(logits, mask)
        tok = int(np.argmax(logits[0]))
        if tok in stops:
            break
        out.append(tok)
        assert m.consume_token(tok)
        if m.is_stopped():
            break
    return out


def test_apply_mask_equals_llguidance():
    rng = np.random.default_rng(0)
    for V in (512, 1000):  # a whole and a partial last word
        logits = rng.normal(size=(3, V)).astype(np.float32)
        mask = rng.integers(-2**31, 2**31, size=(3, (V + 31) // 32), dtype=np.int64).astype(np.int32)
        want = logits.copy()
        apply_token_bitmask_inplace(want, mask)
        np.testing.assert_array_equal(np.asarray(apply_mask(logits, mask)), want)


def test_constrained_row_equals_host_masked_greedy_alone_and_batched(session):
    s, grammar = session, request_grammar(grammar=GBNF)
    want = masked_greedy(s, PROMPT, grammar, 12)
    free, free_text, _ = alone(s, PROMPT, max_tokens=12, temperature=0)
    assert not GBNF_RE.fullmatch(free_text)  # unconstrained, this model writes something else
    ids, text, _ = alone(s, PROMPT, max_tokens=12, temperature=0, constraint=grammar)
    assert ids == want and GBNF_RE.fullmatch(text), text
    # beside an unconstrained row decoding 4 tokens per call: neither disturbs the other
    rows = {}
    r0, c0 = s.admit(PROMPT, max_tokens=12, temperature=0, constraint=grammar, cache_prompt=False)
    r1, c1 = s.admit(PROMPT, max_tokens=12, temperature=0, cache_prompt=False)
    rows[r0], rows[r1] = list(c0), list(c1)
    most = 0
    while s.active_rows:
        for r, chunks in s.step().items():
            rows[r] += chunks
            if r == r1:
                most = max(most, sum(len(c.token_ids) for c in chunks))
    ids = lambda r: [t for c in rows[r] for t in c.token_ids]  # noqa: E731
    assert ids(r0) == want and ids(r1) == free
    assert most > 1  # the unconstrained row kept its multi-token chunks


UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
        "additionalProperties": False}


def test_forced_tokens_are_fed_in_one_call(session):
    """The tokens a JSON schema forces ('{"unit": "', 'elsius"}') go through the model in the call that
    samples the next free token: fewer calls than tokens, the same tokens as the host-side reference."""
    s, grammar = session, request_grammar(json_schema=UNIT)
    want = masked_greedy(s, PROMPT, grammar, 20, ff=s.decode_chunk - 1)
    calls = s.model.host.chunks
    ids, text, finish = alone(s, PROMPT, max_tokens=20, temperature=0, constraint=grammar)
    assert ids == want and finish == "stop" and json.loads(text)["unit"] in ("celsius", "fahrenheit"), text
    assert s.model.host.chunks - calls < len(ids) - 1  # decode calls: the first token came from the prefill
    # a forced token's logprob is the model's own for it (not the draw's it replaced)
    row, chunks = s.admit(PROMPT, max_tokens=20, temperature=0, constraint=grammar, logprobs=True, cache_prompt=False)
    chunks = list(chunks)
    while row in s.active_rows:
        chunks += s.step().get(row, [])
    lps = [e for c in chunks for e in c.logprobs or []]
    prompt = s.model.prompt_tokens(PROMPT)
    logits = s.logits(prompt + ids)[len(prompt) - 1:-1]
    want_lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    assert [e.token_id for e in lps] == ids
    np.testing.assert_allclose([e.logprob for e in lps], want_lp[np.arange(len(ids)), ids], atol=1e-4)


def test_json_object_on_synthetic_model_parses(session):
    grammar = request_grammar(response_format={"type": "json_object"})
    ids, text, finish = alone(session, PROMPT, max_tokens=40, temperature=0.8, seed=1, constraint=grammar)
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # cut off: still a prefix llguidance accepts
        tok = session.model.tokenizer
        m = llg.LLMatcher(llg_tokenizer(tok, session.model.config.vocab_size), grammar)
        assert m.consume_tokens(ids) and text.startswith("{")


def test_bad_constraints_are_refused_before_running(moe):  # Model.generate's own arguments
    with pytest.raises(strata_jax.StrataError, match="GBNF"):
        moe.generate(PROMPT, max_tokens=2, grammar="root ::= nowhere")
    with pytest.raises(strata_jax.StrataError, match="only one"):
        moe.generate(PROMPT, max_tokens=2, grammar=GBNF, json_schema={"type": "object"})
    with pytest.raises(strata_jax.StrataError, match="json_object"):
        moe.generate(PROMPT, max_tokens=2, response_format={"type": "yaml"})


def test_fork_shares_the_prompt_and_equals_a_fresh_prefill(session):
    s = session
    ref, _, _ = alone(s, PROMPT, max_tokens=6, temperature=0.9, seed=7)
    r0, _ = s.admit(PROMPT, max_tokens=6, temperature=0.9, seed=3, cache_prompt=False)
    dst = s.fork(r0)
    assert dst is not None and dst != r0
    r1, chunks = s.admit(PROMPT, max_tokens=6, temperature=0.9, seed=7)
    got = list(chunks)
    while r1 in s.active_rows:
        got += s.step().get(r1, [])
    assert r1 == dst and got[-1].timings["cache_n"] == len(s.model.prompt_tokens(PROMPT)) - 1
    assert [t for c in got for t in c.token_ids] == ref
    s.release(r0)


# -- the server: n > 1 through the openai SDK (in process) -----------------------------------------------

@pytest.fixture(scope="module")
def sdk(moe):
    from starlette.testclient import TestClient

    engine = Engine(lambda: moe, warmup=False, parallel=2)  # choice 1 shares choice 0's prefill (Session.fork)
    with TestClient(create_app(engine, model_id="moe")) as tc:
        assert engine.wait_ready(60)
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)


MSGS = [{"role": "user", "content": "hello there"}]


def test_n2_choices_differ_are_reproducible_and_usage_counts_the_prompt_once(sdk):
    kw = dict(model="m", messages=MSGS, max_tokens=6, temperature=1.0, seed=11, n=2)
    a, b = sdk.chat.completions.create(**kw), sdk.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1] and texts == [c.message.content for c in b.choices]
    assert texts[0] != texts[1]
    one = sdk.chat.completions.create(**dict(kw, n=1))
    assert one.choices[0].message.content == texts[0]  # choice 0 is the request's own seed
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert a.usage.completion_tokens == 12 and a.usage.total_tokens == a.usage.prompt_tokens + 12
    stream = sdk.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    parts, finish = ["", ""], [None, None]
    for ch in stream:
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = ch.usage
    assert parts == texts and finish == ["length", "length"] and usage.completion_tokens == 12
    ckw = dict(model="m", prompt="once upon", max_tokens=4, seed=5, n=2, temperature=1.0)
    comp = sdk.completions.create(**ckw)
    assert [c.index for c in comp.choices] == [0, 1] and comp.usage.completion_tokens == 8
    parts, finish = ["", ""], [None, None]
    for ch in sdk.completions.create(**ckw, stream=True, stream_options={"include_usage": True}):
        for c in ch.choices:
            parts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = ch.usage
    assert parts == [c.text for c in comp.choices] and finish == ["length", "length"]
    assert usage.completion_tokens == 8 and usage.prompt_tokens == comp.usage.prompt_tokens


def test_n2_choices_each_keep_the_constraint_and_the_forced_call(sdk):
    """n > 1 with a constraint: every choice follows the schema (each row runs its own matcher); with a
    forced tool call: every choice is that call, its arguments following the tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"enum": [1, 2, 3]}}}  # short, so a random model finishes it in max_tokens
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=24, temperature=1.0, seed=3, n=2,
                                    response_format=rf)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    t = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=1.0, seed=4, n=2,
                                    tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}})
    for c in t.choices:
        assert c.finish_reason == "tool_calls" and [x.function.name for x in c.message.tool_calls] == ["get_time"]
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                            CLOCK["function"]["parameters"])


def test_grammar_and_json_schema_fields_through_the_server(sdk):
    r = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=10, temperature=0,
                                    extra_body={"grammar": GBNF})
    assert GBNF_RE.fullmatch(r.choices[0].message.content), r.choices[0].message.content
    s = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=10, temperature=0, stream=True,
                                    extra_body={"grammar": GBNF})
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format" and "nonsense" in e.value.body["message"]


CITY = {"type": "object", "additionalProperties": False, "required": ["unit", "city"],
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "city": {"type": "string", "maxLength": 6}}}


def test_llamacpp_json_schema_field_validates_on_chat_and_completions(sdk):
    """llama.cpp's top-level json_schema field (no response_format): the synthetic model never writes JSON
    by itself, so a reply that parses and validates shows the schema decoded it; greedy and sampled, chat
    (whole and streamed) and /v1/completions (which takes grammar too)."""
    jsonschema = pytest.importorskip("jsonschema")
    js = {"json_schema": CITY}
    r = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=0, extra_body=js)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)
    s = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=0, stream=True, extra_body=js)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == text
    free = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    for seed in (1, 2):
        sampled = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=40, temperature=1, seed=seed,
                                              extra_body=js).choices[0].message.content
        jsonschema.validate(json.loads(sampled), CITY)
    c = sdk.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=js)
    assert c.choices[0].finish_reason == "stop", c.choices[0].text
    jsonschema.validate(json.loads(c.choices[0].text), CITY)
    g = sdk.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"grammar": GBNF})
    assert GBNF_RE.fullmatch(g.choices[0].text), g.choices[0].text
    free = sdk.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    assert not GBNF_RE.fullmatch(free), free  # unconstrained, the same prompt writes something else


# -- the default model: JSON that parses and validates (slow: the real 0.5B model) ----------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    return strata_jax.load(qwen_gguf_path, ctx=512)


def random_constrained_text(tok, grammar: str, seed: int = 0, max_tokens: int = 64) -> str:
    """Draw uniformly among the tokens llguidance allows until the grammar ends; our tokenizer's text."""
    m = llg.LLMatcher(llg_tokenizer(tok, tok.vocab_size), grammar)
    rng, out = np.random.default_rng(seed), []
    for _ in range(max_tokens):
        mask = np.empty((1, (tok.vocab_size + 31) // 32), np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: tok.vocab_size])
        t = int(rng.choice(allowed))
        if t in tok.stop_ids:
            break
        out.append(t)
        assert m.consume_token(t)
        if m.is_stopped():
            break
    return tok.decode(out)


@pytest.mark.slow  # a 262k-token vocabulary read twice (~15 s)
def test_llguidance_reads_our_sentencepiece_vocabulary(gemma_gguf_path):
    """The bridge (our GGUF tokenizer's JSON into llguidance): any allowed path decodes, by our own
    tokenizer, to text the grammar matches (bytes, multi-byte characters, newlines)."""
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.gguf.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(GGUFFile(gemma_gguf_path).metadata)
    grammar = request_grammar(grammar='root ::= "Hello, w\u00f6rld!\\n  ok" [0-9] [ \u00e9]{1,3}')
    for seed in range(3):
        assert re.fullmatch("Hello, w\u00f6rld!\n  ok[0-9][ \u00e9]{1,3}", random_constrained_text(tok, grammar, seed))


@pytest.mark.slow
def test_default_model_json_schema_and_json_object_validate(qwen):
    jsonschema = pytest.importorskip("jsonschema")
    from starlette.testclient import TestClient

    ask = [{"role": "user", "content": "Describe Ada Lovelace as a JSON object."}]
    engine = Engine(lambda: qwen, warmup=False)
    with TestClient(create_app(engine, model_id="qwen")) as tc:
        assert engine.wait_ready(120)
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        r = c.chat.completions.create(model="m", messages=ask, max_tokens=80, temperature=0, response_format=rf)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        obj = json.loads(r.choices[0].message.content)
        jsonschema.validate(obj, PERSON)
        s = c.chat.completions.create(model="m", messages=ask, max_tokens=80, temperature=0, response_format=rf,
                                      stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == r.choices[0].message.content
        short = [{"role": "user", "content": "Return a JSON object with the keys name and year for Ada Lovelace."}]
        o = c.chat.completions.create(model="m", messages=short, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object"})
        text = o.choices[0].message.content
        assert o.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    free = qwen.generate(ask, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):  # unconstrained, the model wraps its JSON in a markdown fence
        json.loads(free.text)


def test_constraint_mask_allows_stop_ids_only_where_the_grammar_may_end(moe):
    c = Constraint(request_grammar(grammar='root ::= "a" "b"?'), moe.tokenizer, moe.config.vocab_size)
    bits = lambda: np.unpackbits(c.mask().view(np.uint8), bitorder="little")[: moe.config.vocab_size]  # noqa: E731
    stops = sorted(moe.tokenizer.stop_ids)
    assert not bits()[stops].any()
    c.take(moe.tokenizer.token_to_id("a"))
    assert bits()[stops].all() and not c.done


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}


def test_tool_choice_required_and_named_force_calls(sdk):
    jsonschema = pytest.importorskip("jsonschema")
    free = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=80, temperature=0, tools=[WEATHER, CLOCK])
    assert not free.choices[0].message.tool_calls  # this model calls nothing unforced
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        r = sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=80, temperature=0,
                                        tools=[WEATHER, CLOCK], tool_choice=choice)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
        for call in calls:
            assert call.function.name in names
            params = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), params)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="m", messages=MSGS, max_tokens=2, tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "get_weather" in e.value.body["message"]


FAMILY_TEMPLATES = {"hermes": "<tool_call>", "json": "", "llama3": "<|python_tag|>", "harmony": "<|channel|>",
                    "deepseek": "<｜tool▁call▁begin｜>", "qwen3_coder": "<function=><parameter="}


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_forced_call_grammar_yields_calls_the_familys_parser_reads(qwen_gguf_path, family):
    """A forced call in each template family's format: whatever path its grammar allows (random allowed
    tokens, through a real tokenizer) is read by that family's parser as exactly one call of the named
    tool, with arguments that follow its schema (a typed parameter too, for the XML format)."""
    jsonschema = pytest.importorskip("jsonschema")
    from strata_jax.engine.constrained import lark_grammar
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.gguf.tokenizer import GGUFTokenizer
    from strata_jax.serving.tools import ToolParser, call_grammar, detect_family, marker_ids

    fam = detect_family(FAMILY_TEMPLATES[family])
    assert fam.name == family
    tok = GGUFTokenizer.from_metadata(GGUFFile(qwen_gguf_path).metadata)
    tools = [WEATHER, CLOCK]
    grammar = lark_grammar(call_grammar(family, tools, "get_weather", marker_ids(tok)), "test")
    parser = ToolParser(fam, tools)
    schema = WEATHER["function"]["parameters"]
    for seed in range(3):
        text = random_constrained_text(tok, grammar, seed, max_tokens=160)
        content, calls = parser.parse(text)
        assert [c["function"]["name"] for c in calls] == ["get_weather"], text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
