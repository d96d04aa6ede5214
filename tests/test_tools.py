"""Tool-call parsing (strata_jax/serving/tools.py) against real chat templates from llama.cpp's
collection (models/templates in the pinned llama-cpp-python sdist): each template's family is
detected, and the assistant turn the template itself renders for a call (the format the model was
trained to write) parses back into that call. Plus the outputs models write beyond what a template
renders (harmony's analysis channel, Qwen3's think block, a bare JSON object), declared names only,
parallel_tool_calls, and streaming without markup in the content."""

from __future__ import annotations

import copy
import json

import pytest

import reference_models
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.gguf.reader import GGUFFile
from strata_jax.gguf.tokenizer import GGUFTokenizer
from strata_jax.serving.engine import Engine
from strata_jax.serving.protocol import APIError, parse_chat
from strata_jax.serving.tools import ToolCallStream, ToolParser, call_deltas, detect_family

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
ARGS = {"city": "Paris", "days": 3}
# llama.cpp's template file -> (family, variant)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", ""),
    "Qwen-Qwen3-0.6B": ("hermes", ""),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", ""),
    "Qwen3-Coder": ("qwen3_coder", ""),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", ""),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3", ""),
    "openai-gpt-oss-120b": ("harmony", ""),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek", "v3.1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek", "v3"),
    "google-gemma-2-2b-it": ("json", ""),
}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<end_of_turn>")


def parser(family="hermes", tools=TOOLS, **kw) -> ToolParser:
    fam = family if not isinstance(family, str) else detect_family({"hermes": "<tool_call>", "json": ""}[family])
    return ToolParser(fam, tools, **kw)


def only_call(content_calls, name="get_weather", args=ARGS):
    content, calls = content_calls
    assert [c["function"]["name"] for c in calls] == [name], content_calls
    assert json.loads(calls[0]["function"]["arguments"]) == args
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    return content


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small GGUF vocabulary (with <|im_end|> as a special token); templates are swapped in per test."""
    path = write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tok.gguf", SyntheticSpec(
        arch="qwen2", n_layers=1, d_model=64, head_dim=32, ffn_dim=64, vocab_size=512, qtype="Q8_0"))
    return GGUFTokenizer.from_metadata(GGUFFile(path).metadata)


def rendered_reply(tokenizer, template: str) -> str:
    """The assistant turn the template renders for a get_weather call, from its generation prompt on,
    without the end-of-turn token (a stop token, so never in the generated text)."""
    tok = copy.copy(tokenizer)
    tok.chat_template, tok.named_templates, tok._compiled = template, {}, {}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}
    prompt = tok.apply_chat_template(user, True, tools=TOOLS)
    full = tok.apply_chat_template(user + [turn], False, tools=TOOLS)
    i = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    i -= full[:i].endswith("<")  # a special token that the prompt and the turn both start
    reply = full[i:]
    cut = min([reply.find(e) for e in END_OF_TURN if e in reply] or [len(reply)])
    return reply[:cut]


@pytest.mark.slow  # llama.cpp's templates come from the pinned sdist (downloaded once, cached)
@pytest.mark.parametrize("name", TEMPLATES)
def test_real_templates_detected_and_their_calls_parse(tokenizer, name):
    template = reference_models.chat_template(name)
    family = detect_family(template)
    assert (family.name, family.variant) == TEMPLATES[name], family
    reply = rendered_reply(tokenizer, template)
    if family.name == "json":  # gemma-2's template renders no calls: the model can only answer in JSON
        assert "get_weather" not in reply
        reply = json.dumps({"name": "get_weather", "arguments": ARGS})
    content = only_call(ToolParser(family, TOOLS).parse(reply))
    assert content is None or "get_weather" not in content, content
    # a stream holds the call back whole and yields no markup as content
    stream = ToolCallStream(ToolParser(family, TOOLS))
    streamed = "".join(stream.feed(reply[k:k + 3]) for k in range(0, len(reply), 3))
    rest, _, calls = stream.finish()
    assert "get_weather" not in streamed + rest and [c["function"]["name"] for c in calls] == ["get_weather"]
    if family.name == "harmony":  # <|call|> is an end-of-generation token: the text may stop before it
        only_call(ToolParser(family, TOOLS).parse(reply.removesuffix("<|call|>")))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (fam, _) in TEMPLATES.items() if fam != "json"])
def test_forced_prefix_is_the_templates_own_opening(tokenizer, name):
    """tool_choice "required" / a named function starts the reply as the template starts a call."""
    template = reference_models.chat_template(name)
    family, reply = detect_family(template), rendered_reply(tokenizer, template)
    assert family.forced_prefix("get_weather") in reply and family.forced_prefix(None) in reply
    k = reply.index(family.forced_prefix("get_weather"))
    only_call(ToolParser(family, TOOLS, prefix=family.forced_prefix("get_weather")).parse(reply[k:]))


def test_model_outputs_beyond_the_rendered_turn():
    harmony = detect_family("<|channel|>")
    # gpt-oss reasons in the analysis channel first, then calls; recipient in the channel header
    text = ("<|channel|>analysis<|message|>The user wants the weather in Paris. Use get_weather.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris", "days": 3}')
    assert only_call(ToolParser(harmony, TOOLS).parse(text)) is None
    final = ("<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
             "Hello! How can I help?")
    assert ToolParser(harmony, TOOLS).parse(final) == ("Hello! How can I help?", [])
    # Qwen3 thinks first; Llama 3.1 may put <|python_tag|> before the JSON
    qwen3 = '<think>\nThe user asks about Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
            '{"city": "Paris", "days": 3}}\n</tool_call>'
    assert only_call(parser().parse(qwen3)) == "<think>\nThe user asks about Paris.\n</think>"
    llama = detect_family("<|python_tag|>")
    assert only_call(ToolParser(llama, TOOLS).parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}')) is None
    # Qwen3-Coder: a non-string parameter is JSON, per the schema; a string stays text
    coder = detect_family("<function=x><parameter=y>")
    content, calls = ToolParser(coder, TOOLS).parse(
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n<parameter=days>\n"
        "3\n</parameter>\n</function>\n</tool_call>")
    assert content == "I'll check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "3", "days": 3}


def test_run_on_call_and_forced_prefixes(monkeypatch):
    """What the 0.5B default model wrote after a named function's prefix: the call, then another one
    it never finished, without the closing tag. (Without llguidance a forced call is this prefix; with
    it, a grammar: test_forced_call_takes_the_grammar_with_llguidance.)"""
    from strata_jax.engine import constrained
    monkeypatch.setattr(constrained, "available", lambda: False)
    hermes = detect_family("<tool_call>")
    prefix = hermes.forced_prefix("get_time")
    out = ' {"city": "sea"}}\n{"name": "get_weather", "arguments":  {"city": "sea"}'
    content = only_call(ToolParser(hermes, TOOLS, prefix=prefix).parse(prefix + out), "get_time", {"city": "sea"})
    assert content == '{"name": "get_weather", "arguments":  {"city": "sea"}'
    engine = Engine(lambda: None)
    engine.tool_family = hermes
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"})
    assert engine.plan_tools(req)[0].prefix == '<tool_call>\n{"name": "get_'  # what both names start with
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS[:1], "tool_choice": "required"})
    assert engine.plan_tools(req)[0].prefix == hermes.forced_prefix("get_weather")  # the only tool
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "auto"})
    assert engine.plan_tools(req)[0].prefix == ""


def test_forced_call_takes_the_grammar_with_llguidance(monkeypatch):
    """With llguidance, "required" / a named function is a grammar of the family's calls (what each writes
    is in tests/test_constrained.py), not a prefix; without it, the family's opener starts the reply."""
    pytest.importorskip("llguidance")
    from strata_jax.engine import constrained

    for fam, mark in (("<tool_call>", "<tool_call>"), ("", '"arguments"'), ("<|python_tag|>", '"parameters"'),
                      ("<|channel|>", "commentary to=functions.get_time"), ("<｜tool▁call▁begin｜>", "```json"),
                      ("<function=><parameter=", "<function=get_time>")):
        engine = Engine(lambda: None)
        engine.tool_family = detect_family(fam)
        req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        parser, constraint = engine.plan_tools(req)
        assert parser.prefix == "" and "get_time" in constraint and req.constraint is None, fam
        assert mark in constraint or json.dumps(mark)[1:-1] in constraint, (fam, constraint[:300])
    monkeypatch.setattr(constrained, "available", lambda: False)  # no llguidance: the opener, no grammar
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"})
    parser, constraint = engine.plan_tools(req)
    assert parser.prefix and constraint is None
    monkeypatch.undo()
    # tool_choice auto leaves the request's own constraint as it is; a forced call refuses one
    rf = {"type": "json_object"}
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "response_format": rf})
    assert req.constraint is not None and engine.plan_tools(req)[1] == req.constraint
    with pytest.raises(APIError, match="give only one of them") as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required",
                    "response_format": rf})
    assert e.value.param == "tool_choice"


def test_bare_json_fallback_in_every_family():
    """What the 0.5B default model writes for a get_weather question: the JSON without the tags."""
    bare = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    for fam in ("<tool_call>", "<|python_tag|>", "<|channel|>", "<｜tool▁call▁begin｜>", "",
                "<function=><parameter="):
        assert only_call(ToolParser(detect_family(fam), TOOLS).parse(bare)) is None
    assert only_call(parser("json").parse("```json\n" + bare + "\n```")) is None
    content, calls = parser("json").parse(f'[{bare}, {{"name": "get_time", "arguments": {{"tz": "CET"}}}}]')
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    # not a call: prose around it, or a JSON object that names no declared tool
    assert parser("json").parse("Try " + bare) == ("Try " + bare, [])
    assert parser("json").parse('{"name": "Paris"}') == ('{"name": "Paris"}', [])


def test_only_declared_tools_and_parallel_tool_calls():
    text = ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    content, calls = parser().parse(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert content == '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'  # left as the model wrote it
    assert len({c["id"] for c in calls}) == 2
    content, calls = parser(parallel=False).parse(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parser(tools=None).parse(text) == (text, [])
    assert parser().parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    # cut off before the closing tag (max_tokens): still a call when its JSON is whole
    only_call(parser().parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'))


def streamed(stream: ToolCallStream, pieces) -> tuple[str, list[list[dict]], str, list[dict]]:
    """(content streamed, tool-call deltas streamed, content and deltas at the end, the calls)."""
    content, deltas = "", []
    for p in pieces:
        content += stream.feed(p)
        deltas += stream.take_deltas()
    rest, last, calls = stream.finish()
    return content, deltas + last, rest, calls


def test_stream_holds_back_only_what_may_be_a_call():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    content, deltas, rest, calls = streamed(ToolCallStream(parser()), text)
    assert content == "Sure. " and rest == "" and calls[0]["function"]["name"] == "get_weather"
    s = ToolCallStream(parser())
    assert s.feed("a <tool") == "a " and s.feed("s>") == "<tools>" and s.finish() == ("", [], [])
    s = ToolCallStream(parser("json"))  # a reply that starts like JSON waits for the end
    assert s.feed('[{"name": "get_time", ') == "" and s.feed('"tz": 1}]') == "" and s.finish()[0] == '[{"name": ' \
        '"get_time", "tz": 1}]'
    s = ToolCallStream(parser("json"))
    assert s.feed("  Hello") == "  Hello" and s.finish() == ("", [], [])


def test_stream_arguments_arrive_as_they_are_written():
    """OpenAI's delta shape: index, id, type and name once the call's head is whole, then the arguments
    in pieces as the model writes them; a second call follows whole."""
    pieces = ["<tool_call>\n", '{"name": "get_', 'weather", "arguments": ', '{"city": ', '"Par', 'is", "days": 3}',
              "}\n</tool_call>\n", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>']
    s = ToolCallStream(parser())
    seen = []
    for p in pieces:
        assert s.feed(p) == ""
        seen.append(s.take_deltas())
    assert seen[:3] == [[], [], []]  # the head is whole once its arguments' "{" arrives
    head = seen[3][0][0]
    assert head == {"index": 0, "id": head["id"], "type": "function", "function": {"name": "get_weather",
                                                                                    "arguments": ""}}
    assert [d[-1][0]["function"]["arguments"] for d in seen[3:6]] == ['{"city": ', '"Par', 'is", "days": 3}']
    assert seen[6:] == [[], []]  # the wrapper's closing brace and tag are not arguments
    rest, last, calls = s.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[0]["id"] == head["id"] and json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert [d[0]["index"] for d in last] == [1, 1] and last[0][0]["function"] == {"name": "get_time", "arguments": ""}
    # a bare JSON call streams live too; one cut off (max_tokens) ends as far as it was streamed
    content, deltas, rest, calls = streamed(ToolCallStream(parser("json")), ['{"name": "get_weather", "arguments": ',
                                                                             '{"city": "Pa'])
    assert content == rest == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert "".join(d[0]["function"]["arguments"] for d in deltas) == '{"city": "Pa'
    # parallel_tool_calls false: the second call is dropped
    _, deltas, _, calls = streamed(ToolCallStream(parser(parallel=False)), "".join(pieces))
    assert len(calls) == 1 and {d[0]["index"] for d in deltas} == {0}
    assert call_deltas(calls)[0][0]["function"]["arguments"] == ""


def test_special_tokens_kept_for_the_parser(tokenizer):
    """A family's markers that the vocabulary marks special are dropped from decoded text unless kept."""
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("hi", add_special=False) + [im_end]
    assert "".join(tokenizer.stream_decoder().push(i) for i in ids) == "hi"
    kept = tokenizer.stream_decoder(keep=[im_end])
    assert "".join(kept.push(i) for i in ids) == "hi<|im_end|>"
