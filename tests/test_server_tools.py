"""Tool calls, the Responses API and the token endpoints (llama.cpp's /tokenize, /detokenize, /apply-template,
/props; OpenAI's input token count) on the real default model (Qwen2.5-Coder-0.5B-Instruct, its chat template
from the GGUF), driven by the official openai SDK (and httpx where no SDK has the call) against one
`strata-jax serve` process, with transformers' tokenizer of the same file as the reference.

The reported bug: the 0.5B model answers a get_weather request with a bare JSON object (no
<tool_call> tags), which came back as plain content. Every request is greedy, so the outputs are
the model's deterministic ones."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from test_server_openai import ServerProcess

pytestmark = pytest.mark.slow  # a real 0.5B model decoding on the CPU

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


@pytest.fixture(scope="module")
def server(qwen_gguf_path, tmp_path_factory):
    srv = ServerProcess(qwen_gguf_path, tmp_path_factory.mktemp("log") / "server.log")
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_family_is_chosen_at_load_and_logged(server):
    assert "tool calls: hermes format (the chat template wraps calls in <tool_call></tool_call>)" in server.output()


def test_get_weather_is_a_tool_call(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_get_weather_streamed(client):
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                                            stream=True)
    chunks = [ch for ch in stream if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""  # no markup leaks into content
    deltas = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_named_and_required(client):
    """A named function and "required" force a call (a grammar of the template's calls where llguidance is
    installed, else the call opener) even for a question the model would answer in prose."""
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                                       "parameters": {"type": "object", "properties": {
                                                           "city": {"type": "string"}}}}}]
    prose = [{"role": "user", "content": "Write a haiku about the sea."}]
    auto = client.chat.completions.create(model="m", messages=prose, tools=tools, temperature=0, max_tokens=16)
    assert auto.choices[0].finish_reason != "tool_calls" and "sea" in auto.choices[0].message.content.lower()
    named = client.chat.completions.create(model="m", messages=prose, tools=tools, temperature=0, max_tokens=24,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].finish_reason == "tool_calls"
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict)
    required = client.chat.completions.create(model="m", messages=prose, tools=TOOLS, temperature=0, max_tokens=24,
                                              tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    [call] = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


def test_anthropic_tool_choice_any_and_tool_force_a_tool_use(server):
    """Anthropic's tool_choice through its SDK: "any" and a named "tool" force a tool_use block (as OpenAI's
    "required" and named function do) for a question the model answers in prose under "auto"."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    tools.append({"name": "get_time", "description": "The time in a city",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
    prose = [{"role": "user", "content": "Write a haiku about the sea."}]
    t0 = {"temperature": 0}
    auto = c.messages.create(model="m", max_tokens=16, messages=prose, tools=tools, extra_body=t0)
    assert [b.type for b in auto.content] == ["text"] and auto.stop_reason != "tool_use"
    for choice, name in (({"type": "any", "disable_parallel_tool_use": True}, None),
                         ({"type": "tool", "name": "get_time"}, "get_time")):
        r = c.messages.create(model="m", max_tokens=32, messages=prose, tools=tools, tool_choice=choice,
                              extra_body=t0)
        assert r.stop_reason == "tool_use", r.content
        [use] = [b for b in r.content if b.type == "tool_use"]
        assert use.name == (name or use.name) and use.name in ("get_weather", "get_time")
        assert isinstance(use.input.get("city"), str), use.input  # the grammar follows input_schema
        with c.messages.stream(model="m", max_tokens=32, messages=prose, tools=tools, tool_choice=choice,
                               extra_body=t0) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[-1].input == use.input


def test_tool_choice_none_offers_no_tools(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=12)
    assert r.choices[0].finish_reason != "tool_calls" and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens < 60  # the template's tool prompt was not rendered


def test_responses_function_call_and_its_output(client):
    r = client.responses.create(model="m", input=ASK[0]["content"], tools=RESPONSES_TOOLS, temperature=0,
                                max_output_tokens=40)
    assert r.status == "completed" and r.object == "response"
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the call and its output go back as input items; the model answers from the tool's result
    follow = [{"role": "user", "content": ASK[0]["content"]},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 31, "sky": "sunny"}'}]
    answer = client.responses.create(model="m", input=follow, tools=RESPONSES_TOOLS, temperature=0,
                                     max_output_tokens=40)
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    assert "31" in answer.output_text or "sunny" in answer.output_text.lower(), answer.output_text


def test_responses_stream(client):
    with client.responses.stream(model="m", input=ASK[0]["content"], tools=RESPONSES_TOOLS, temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds  # the call is not streamed as text
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # plain text, instructions and max_output_tokens: the streamed text is the non-streamed response's
    kw = dict(model="m", instructions="You are a poet.", input="Describe the ocean at night.",
              temperature=0, max_output_tokens=6)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and whole.output_text
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.instructions == kw["instructions"]


def test_responses_tool_choice_required_and_named_force_calls(client):
    """The Responses API's tool_choice goes through the chat path: "required" and a named function force a
    function_call item for a question answered in prose under "auto"."""
    tools = RESPONSES_TOOLS + [{"type": "function", "name": "get_time", "description": "The time in a city",
                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}}]
    kw = dict(model="m", input="Write a haiku about the sea.", tools=tools, temperature=0, max_output_tokens=32)
    auto = client.responses.create(**kw)
    assert [o.type for o in auto.output] == ["message"] and auto.output_text
    for choice, name in (("required", None), ({"type": "function", "name": "get_time"}, "get_time")):
        r = client.responses.create(**kw, tool_choice=choice, parallel_tool_calls=False)
        assert r.status == "completed", r.output
        [call] = [o for o in r.output if o.type == "function_call"]
        assert call.name == (name or call.name) and call.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.arguments).get("city"), str), call.arguments


# -- the token endpoints ----------------------------------------------------------------------------------

TEXT = "Hi <|im_start|>user wörld 𝔘 🙂<|im_end|>\n"  # special tokens, a split character, an emoji


@pytest.fixture(scope="module")
def ref_tokenizer(qwen_gguf_path):
    transformers = pytest.importorskip("transformers")
    path = Path(qwen_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_type="qwen2")


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_matches_transformers(server, ref_tokenizer):
    ids = post(server, "/tokenize", {"content": TEXT}).json()["tokens"]
    assert ids == ref_tokenizer(TEXT, add_special_tokens=False).input_ids  # special tokens parsed (the default)
    plain = post(server, "/tokenize", {"content": TEXT, "parse_special": False}).json()["tokens"]
    assert plain == ref_tokenizer(TEXT, add_special_tokens=False, split_special_tokens=True).input_ids
    assert len(plain) > len(ids)
    mixed = post(server, "/tokenize", {"content": ["Hi", 151644, " there"]}).json()["tokens"]
    assert mixed == ref_tokenizer("Hi", add_special_tokens=False).input_ids + [151644] + \
        ref_tokenizer(" there", add_special_tokens=False).input_ids


def test_tokenize_with_pieces(server):
    """Each piece is the token's text, or its bytes where the token holds part of a character (𝔘 is four
    bytes over three tokens here); the pieces join to the text."""
    tokens = post(server, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    ids = post(server, "/tokenize", {"content": TEXT}).json()["tokens"]
    assert [t["id"] for t in tokens] == ids
    raw = [t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens]
    assert b"".join(raw) == TEXT.encode()
    split = [t["piece"] for t in tokens if isinstance(t["piece"], list)]
    assert split and all(isinstance(b, int) and 0 <= b < 256 for p in split for b in p)
    assert {"id": 151644, "piece": "<|im_start|>"} in tokens


def test_detokenize_round_trips_and_names_bad_ids(server, ref_tokenizer):
    ids = ref_tokenizer(TEXT, add_special_tokens=False).input_ids
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": TEXT}  # special tokens kept
    r = post(server, "/detokenize", {"tokens": [1, 10 ** 9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "1000000000" in r.text


def test_apply_template_matches_transformers(server, ref_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
    got = post(server, "/apply-template", {"messages": msgs, "tools": TOOLS}).json()["prompt"]
    assert got == ref_tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in got and got.endswith("<|im_start|>assistant\n")


def test_input_tokens_count_what_usage_counts(server, client):
    """OpenAI's count (official SDK) and llama.cpp's chat form equal the prompt_tokens a generation reports,
    and a prompt longer than the context (1,024 here) is counted, not refused."""
    n = client.responses.input_tokens.count(model="m", input="Write a haiku about the sea.",
                                            instructions="Be brief.").input_tokens
    used = client.responses.create(model="m", input="Write a haiku about the sea.", instructions="Be brief.",
                                   max_output_tokens=16, temperature=0).usage.input_tokens
    assert n == used
    body = {"messages": ASK, "tools": TOOLS}
    r = post(server, "/v1/chat/completions/input_tokens", body).json()
    prompt = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert r == {"object": "response.input_tokens", "input_tokens": prompt}
    long = post(server, "/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "sea " * 2000}]})
    assert long.json()["input_tokens"] > 2000


def test_props(server, qwen_gguf_path):
    from strata_jax.gguf.reader import GGUFFile
    props = httpx.get(server.url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == 1024 and props["total_slots"] == 1
    assert props["chat_template"] == GGUFFile(qwen_gguf_path).metadata["tokenizer.chat_template"]
    assert Path(props["model_path"]).resolve() == Path(qwen_gguf_path).resolve()
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8  # llama.cpp's, as /completion's


def test_completions_suffix_fills_the_middle(client, ref_tokenizer):
    """OpenAI's `suffix` (official SDK): the model writes the code between prompt and suffix, from the FIM
    prompt llama.cpp's /infill would give it (usage counts exactly that prompt)."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"
    r = client.completions.create(model="m", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0)
    assert r.choices[0].text.startswith("a + b"), r.choices[0].text
    enc = lambda s: ref_tokenizer(s, add_special_tokens=False, split_special_tokens=True).input_ids  # noqa: E731
    fim = ["<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    rep, sep, pre, suf, mid = ref_tokenizer.convert_tokens_to_ids(fim)
    layout = [rep, *enc("myproject\n"), sep, *enc("filename\n"), pre, *enc(prefix), suf, *enc(suffix), mid]
    assert r.usage.prompt_tokens == len(layout)
    streamed = client.completions.create(model="m", prompt=prefix, suffix=suffix, max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_llamacpp_infill(server, ref_tokenizer):
    """llama.cpp's /infill (what llama.vscode calls): the same middle and prompt as `suffix`, other files in the
    repository pattern before it, and n_predict 0 (the plugin's cache warm-up) answered without generating."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 6, "temperature": 0}
    out = post(server, "/infill", body).json()
    assert out["content"].startswith("a + b") and out["stop"] is True and out["tokens_predicted"] <= 6
    assert out["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def add")
    files = post(server, "/infill", {**body, "input_extra": [{"filename": "util.py", "text": "Z = 3\n"}]}).json()
    assert "<|file_sep|>util.py\nZ = 3\n<|file_sep|>filename\n" in files["prompt"]
    assert files["tokens_evaluated"] == out["tokens_evaluated"] + 1 + len(
        ref_tokenizer("util.py\nZ = 3\n", add_special_tokens=False).input_ids)
    warm = post(server, "/infill", {**body, "n_predict": 0}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    assert warm["tokens_evaluated"] == out["tokens_evaluated"]


def test_completions_echo_logprobs_match_transformers(client, server, qwen_gguf_path):
    """lm-eval's loglikelihood request (official SDK): the prompt as token ids, echo, logprobs=1, max_tokens=1;
    its tokens' logprobs are transformers' log-softmax of the same model's logits, and its top alternative
    the argmax (lm-eval's is_greedy)."""
    import torch
    from reference_models import hf_model_from_gguf

    ids = post(server, "/tokenize", {"content": "def is_even(n):\n    return n % 2 == 0\n"}).json()["tokens"]
    r = client.completions.create(model="m", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model_from_gguf(qwen_gguf_path)(torch.tensor([ids])).logits[0].float(), -1).numpy()
    want = [ref[j, ids[j + 1]] for j in range(len(ids) - 1)] + [ref[-1].max()]  # greedy: the last is the argmax
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    for j, top in enumerate(lp.top_logprobs[1: len(ids)]):
        best = max(top, key=top.get)
        assert top[best] == pytest.approx(ref[j].max(), abs=2e-3)
        assert (best == lp.tokens[j + 1]) == (int(ref[j].argmax()) == ids[j + 1])
    assert r.choices[0].text.startswith("def is_even(n):\n    return n % 2 == 0\n")
