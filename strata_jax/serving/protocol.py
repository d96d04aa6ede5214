"""OpenAI wire format: request validation into `GenRequest`, and response and
stream-chunk builders. Pure functions over JSON values: no model, no HTTP, no JAX.

Every invalid request raises `APIError` (status 4xx) with a message that names the field and says
what to send instead; nothing here may raise anything else on bad input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from typing import Any

from strata_jax import __version__
from strata_jax.core.errors import ConfigError
from strata_jax.engine.constrained import request_grammar

FINGERPRINT = f"strata-jax-{__version__}"
MAX_STOP = 4
MAX_CHOICES = 16  # n: each choice holds a KV row while it runs (with --parallel 1 they run one after another)
MAX_PROMPTS = 64  # completions' batched prompts: each is a request of its own, queued together
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit; engine/sampling.py's TOP_LOGPROBS)
MAX_LEGACY_LOGPROBS = 5  # completions' logprobs
REPEAT_WINDOW = 256  # the longest repeat_last_n (engine/sampling.py's REPEAT_WINDOW)
ROLES = ("system", "developer", "user", "assistant", "tool")
# set by the server itself, or parameter names of Model.prompt_tokens / apply_chat_template
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "tools", "add_generation_prompt", "prompt_or_messages", "self",
                                    "response_prefix"})
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "unavailable_error"}


class APIError(Exception):
    """An error answered as OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclasses.dataclass
class GenRequest:
    """A validated generation request, endpoint-independent."""

    endpoint: str  # "chat" | "completion" | "messages" (Anthropic's) | "responses" (the Responses API's input)
    #                | "infill" (llama.cpp's: prompt is input_prefix, suffix input_suffix)
    prompt: str | list[int] | list[dict]  # text or token ids (completion), messages (chat)
    model: str | None = None
    max_tokens: int | None = None  # None: until the context is full, as llama.cpp
    temperature: float = 1.0  # OpenAI's defaults, not the CLI's
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] | None = None  # rendered through the chat template; output parsed for tool calls
    tool_choice: str | None = None  # "auto" | "required" | a function's name (None: auto)
    parallel_tool_calls: bool = True  # False: at most one call is returned
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    reasoning_effort: str | None = None
    cache_prompt: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0  # llama.cpp's, as are repeat_last_n, top_k and min_p
    repeat_last_n: int = 64
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token: chat's top_logprobs, completions' integer logprobs
    prefill: str = ""  # text the reply starts with (Anthropic's final assistant message): generation continues it
    n: int = 1  # choices, each sampled from the same prompt
    constraint: str | None = None  # llguidance grammar (response_format, grammar or json_schema)
    spec_max: int | None = None  # drafted tokens per verify pass at most (llama.cpp's speculative.n_max)
    suffix: str | None = None  # fill in the middle (completion): the text after the gap; prompt is the text before
    infill_extra: list[dict] = dataclasses.field(default_factory=list)  # other files ({"filename", "text"})
    infill_prompt: str = ""  # text the infill continues after the prefix (llama.cpp's /infill prompt)
    echo: bool = False  # completion: the reply starts with the prompt (and its tokens' logprobs, with logprobs)

    @property
    def prompt_param(self) -> str:
        return {"completion": "prompt", "responses": "input", "infill": "input_prefix"}.get(self.endpoint, "messages")

    @property
    def suffix_param(self) -> str:
        return "input_suffix" if self.endpoint == "infill" else "suffix"

    def sampling(self) -> dict[str, Any]:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    min_p=self.min_p, seed=self.seed, stop=self.stop or None, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repeat_penalty=self.repeat_penalty,
                    repeat_last_n=self.repeat_last_n, logprobs=self.logprobs, top_logprobs=self.top_logprobs,
                    constraint=self.constraint, spec_max=self.spec_max, prompt_logprobs=self.echo and self.logprobs)

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs only, nothing generated (the engine samples
        the one token a prefill always gives, and the reply leaves it out)."""
        return self.echo and self.max_tokens == 0


# -- field readers -----------------------------------------------------------------------------------

def _kind(v: Any) -> str:
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False,
            integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    want = f"{'an integer' if integer else 'a number'} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise bad(f"'{name}' must be {want}, got {_kind(v)}: {json.dumps(v)[:60]}.", name)
    if v < lo or v > hi or (lo_open and v == lo):  # before any float(): JSON integers can be huge
        raise bad(f"'{name}'={str(v)[:40]} is out of range: it must be {want}.", name)
    if integer and isinstance(v, float) and not v.is_integer():
        raise bad(f"'{name}' must be an integer, got {v!r}.", name)
    return int(v) if integer else float(v)


def is_token_id(v: Any) -> bool:
    """An integer that is not a bool (JSON's true is not token 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {_kind(v)}.", name)
    return v


def _common(body: Any, zero_tokens: bool = False) -> dict[str, Any]:
    """Fields shared by both endpoints: sampling, limits, stop, streaming, unsupported features.
    zero_tokens: max_tokens may be 0 (completions' echo: the prompt scored, nothing generated)."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_kind(model)}.", "model")
    out: dict[str, Any] = {"model": model, "n": _number(body, "n", 1, 1, MAX_CHOICES, integer=True)}
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(limit_name) is not None:
        out["max_tokens"] = _number(body, limit_name, 0, 0 if zero_tokens else 1, 2**31 - 1, integer=True)
    out["temperature"] = _number(body, "temperature", 1.0, 0, 100)
    out["top_p"] = _number(body, "top_p", 1.0, 0, 1, lo_open=True)
    out["top_k"] = _number(body, "top_k", 0, 0, 2**31 - 1, integer=True)
    out["min_p"] = _number(body, "min_p", 0.0, 0, 1)
    if body.get("seed") is not None:
        # the PRNG key uses the low 32 bits; any int64 is accepted as OpenAI does
        out["seed"] = _number(body, "seed", 0, -(2**63), 2**63 - 1, integer=True) % 2**32
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("'stop' must be a non-empty string or an array of up to 4 non-empty strings.", "stop")
        if len(stops) > MAX_STOP:
            raise bad(f"'stop' has {len(stops)} strings; at most {MAX_STOP} are allowed.", "stop")
        out["stop"] = list(stops)
    out["stream"] = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"'stream_options' must be an object like {{\"include_usage\": true}}, got {_kind(so)}.",
                      "stream_options")
        out["include_usage"] = _bool(so, "include_usage", False)
    out["cache_prompt"] = _bool(body, "cache_prompt", True)
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = _number(body, name, 0.0, -2, 2)
    out["repeat_penalty"] = _number(body, "repeat_penalty", 1.0, 0, 100, lo_open=True)
    # llama.cpp's -1 (the whole context) has no equivalent: the window is bounded on the device
    out["repeat_last_n"] = _number(body, "repeat_last_n", 64, 0, REPEAT_WINDOW, integer=True)
    lb = body.get("logit_bias")
    if lb is not None and not (isinstance(lb, dict) and not lb):
        raise bad("'logit_bias' is not supported yet; omit it.", "logit_bias")
    out["constraint"] = _constraint(body)
    # llama.cpp's per-request draft cap (0: no speculation for this request); the server's --spec-max bounds it
    out["spec_max"] = _number(body, "speculative.n_max", None, 0, 64, integer=True)
    return out


def _constraint(body: dict) -> str | None:
    """OpenAI's response_format, or llama.cpp's grammar (GBNF) / json_schema, as a validated grammar."""
    rf = body.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise bad(f"'response_format' must be an object like {{\"type\": \"json_object\"}}, got {_kind(rf)}.",
                  "response_format")
    fields = {"response_format": rf, "grammar": body.get("grammar"), "json_schema": body.get("json_schema")}
    param = next((k for k, v in fields.items() if v is not None and v != {"type": "text"}), None)
    try:
        return request_grammar(**fields)
    except ConfigError as e:
        raise bad(str(e), param) from None


# -- chat ------------------------------------------------------------------------------------------

def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise bad(f"{where}[{j}] is not supported ({json.dumps(kind)[:40]}): only text parts "
                          "{\"type\": \"text\", \"text\": \"...\"} can be used with this model.", "messages")
            texts.append(part["text"])
        return "\n".join(texts)  # as llama.cpp joins typed text parts
    raise bad(f"{where} must be a string or an array of text parts, got {_kind(c)}.", "messages")


def _tool_calls_in(m: dict, i: int) -> list[dict]:
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be an array, got {_kind(calls)}.", "messages")
    out = []
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"arguments\": ...}}.", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # chat templates expect an object (they tojson it); keep text that is not JSON
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(tc.get("id"), str):
            call["id"] = tc["id"]
        out.append(call)
    return out


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required: an array of {\"role\": ..., \"content\": ...} objects.", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad(f"'messages' must be a non-empty array of message objects, got {_kind(msgs)}"
                  f"{' (empty)' if msgs == [] else ''}.", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content', got {_kind(m)}.", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role={json.dumps(role)[:40]} is not a known role; use one of "
                      f"{', '.join(ROLES)}.", "messages")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        if m.get("tool_calls") is not None and role == "assistant":
            msg["tool_calls"] = _tool_calls_in(m, i)
        if msg["content"] is None:
            if role != "assistant":
                raise bad(f"messages[{i}].content is required for role {role!r}.", "messages")
            msg["content"] = ""  # templates concatenate content; an assistant turn with only tool calls has none
        for key in ("name", "tool_call_id", "reasoning_content"):
            if key in m and m[key] is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key} must be a string, got {_kind(m[key])}.", "messages")
                msg[key] = m[key]
        out.append(msg)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, str | None]:
    """(the tools offered to the template, the tool_choice: "auto", "required" or a function's name)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}.", "tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' asks for a tool call but no 'tools' were given; send the function tools "
                      "too.", "tool_choice")
        return None, None
    if not isinstance(tools, list):
        raise bad(f"'tools' must be an array of function tools, got {_kind(tools)}.", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), (dict, type(None)))
                or not isinstance(fn.get("description", ""), (str, type(None)))):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                      "\"description\": str, \"parameters\": {JSON schema}}}}.", "tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"'tool_choice' names the function {name!r}, which is not among the 'tools' "
                      f"({', '.join(t['function']['name'] for t in tools)}).", "tool_choice")
        choice = name
    if choice == "none" or not tools:
        return None, None  # the model is told about no tools and nothing is parsed as a call
    return tools, choice


def parse_chat(body: Any) -> GenRequest:
    req = GenRequest(endpoint="chat", prompt=[], **_common(body))
    req.prompt = _messages(body)
    req.tools, req.tool_choice = _tools(body)
    req.parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    if req.tools and req.tool_choice not in (None, "auto") and req.constraint is not None:
        raise bad("tool_choice forces a tool call, which response_format/grammar/json_schema would constrain too: "
                  "give only one of them.", "tool_choice")
    req.logprobs = _bool(body, "logprobs", False)
    req.top_logprobs = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    if req.top_logprobs and not req.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true (it says how many alternatives each token's logprobs "
                  "list).", "top_logprobs")
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise bad(f"'reasoning_effort' must be a string such as \"none\", \"low\" or \"high\", got {_kind(effort)}.",
                  "reasoning_effort")
    req.reasoning_effort = effort
    tk = body.get("chat_template_kwargs")  # llama.cpp's extension, e.g. {"enable_thinking": false}
    if tk is not None:
        if not isinstance(tk, dict):
            raise bad(f"'chat_template_kwargs' must be an object, got {_kind(tk)}.", "chat_template_kwargs")
        req.template_kwargs = {k: v for k, v in tk.items() if k.isidentifier() and k not in RESERVED_TEMPLATE_KEYS}
    return req


def parse_completions(body: Any) -> list[GenRequest]:
    """A completions body as one request per prompt: OpenAI's `prompt` may be an array of texts or of token
    arrays, whose choices come back in one response (choice index = prompt index * n + choice)."""
    p = body.get("prompt") if isinstance(body, dict) else None
    if not (isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p)):
        return [parse_completion(body)]
    if len(p) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(p)} prompts; at most {MAX_PROMPTS} per request.", "prompt")
    if _bool(body, "stream", False):
        raise bad(f"'prompt' holds {len(p)} prompts: several prompts are answered whole, not streamed; send them "
                  "without 'stream' or one per request.", "stream")
    reqs = []
    for i, one in enumerate(p):
        try:
            reqs.append(parse_completion(dict(body, prompt=one)))
        except APIError as e:
            if e.param == "prompt":
                raise bad(f"prompt {i}: {e.message}", "prompt") from None
            raise
    return reqs


def parse_completion(body: Any) -> GenRequest:
    echo = isinstance(body, dict) and _bool(body, "echo", False)
    req = GenRequest(endpoint="completion", prompt="", echo=echo, **_common(body, zero_tokens=echo))
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    suffix = body.get("suffix")
    if suffix not in (None, ""):  # fill in the middle: the prompt is the text before the gap, suffix after it
        if not isinstance(suffix, str) or not isinstance(p, str):
            raise bad("'suffix' (fill-in-the-middle) needs 'prompt' and 'suffix' as text: the code before and after "
                      "the gap.", "suffix")
        req.suffix = suffix
    if isinstance(p, str):
        if not p and req.suffix is None:  # an infill may start at the very beginning
            raise bad("'prompt' is empty; give some text or token ids.", "prompt")
    elif isinstance(p, list) and p and all(is_token_id(t) for t in p):
        pass
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise bad(f"'prompt' holds {len(p)} prompts; parse_completions takes a batch.", "prompt")
    else:
        raise bad(f"'prompt' must be a non-empty string or array of token ids, got {_kind(p)}"
                  f"{' (empty)' if p == [] else ''}.", "prompt")
    req.prompt = p
    if echo and req.suffix is not None:
        raise bad("'echo' cannot be used with 'suffix': a fill-in-the-middle reply is the gap's text only.", "echo")
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' must be 1 (or omitted).", "best_of")
    lp = body.get("logprobs")
    if lp is not None and lp is not False:  # the legacy form: an integer, how many alternatives (0 counts)
        req.logprobs = True
        req.top_logprobs = _number(body, "logprobs", 0, 0, MAX_LEGACY_LOGPROBS, integer=True)
    return req


# -- logprobs --------------------------------------------------------------------------------------

def token_text(b: bytes) -> str:
    """A token's text; a token whose bytes are not whole UTF-8 (part of a multi-byte character) is spelled
    as OpenAI spells it, "bytes:\\xe2\\x80", and its `bytes` still hold the raw values."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def chat_logprobs(entries: list, token_bytes) -> list[dict]:
    """OpenAI's chat `logprobs.content` items for TokenLogprob entries (token_id, logprob, top);
    token_bytes(id) -> the token's raw bytes."""

    def one(tid: int, logprob: float) -> dict:
        b = token_bytes(tid)
        return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}

    return [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top]) for e in entries]


def completion_logprobs(entries: list, token_bytes, base_offset: int) -> dict:
    """The legacy completions `logprobs` object. top_logprobs holds the requested alternatives plus the
    sampled token (so up to logprobs + 1 entries, as OpenAI documents); text_offset counts characters from
    the start of the prompt (base_offset: its length), as OpenAI's does without echo."""
    text = lambda tid: token_text(token_bytes(tid))  # noqa: E731
    tops = []
    for e in entries:
        top = {text(t): v for t, v in e.top}
        top.setdefault(text(e.token_id), e.logprob)
        tops.append(top)
    return {"tokens": [text(e.token_id) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [base_offset + e.offset for e in entries]}


def echo_logprobs(prompt_ids: list[int], entries: list, token_bytes) -> dict:
    """The legacy completions `logprobs` of an echoed prompt: its first token has none (null, as OpenAI's),
    the others their TokenLogprob entries (offsets from the start of the prompt)."""
    rest = completion_logprobs(entries, token_bytes, 0)
    return {"tokens": [token_text(token_bytes(prompt_ids[0]))] + rest["tokens"],
            "token_logprobs": [None] + rest["token_logprobs"], "top_logprobs": [None] + rest["top_logprobs"],
            "text_offset": [0] + rest["text_offset"]}


def joined_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two legacy completions `logprobs` objects, one after the other (an echoed prompt's, the reply's)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] for k in a}


# -- responses --------------------------------------------------------------------------------------

def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_n: int, completion_n: int, cached_n: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_n, "completion_tokens": completion_n, "total_tokens": prompt_n + completion_n,
            "prompt_tokens_details": {"cached_tokens": cached_n}}


TIMING_KEYS = ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
               "cache_n")


SPEC_TIMING_KEYS = ("draft_n", "draft_n_accepted", "draft_passes")  # speculative decoding on: llama.cpp's, and the passes


def timings(t: dict[str, Any] | None) -> dict[str, Any]:
    t = t or {}
    return {k: t.get(k, 0) for k in TIMING_KEYS} | {k: t[k] for k in SPEC_TIMING_KEYS if k in t}


@dataclasses.dataclass
class Envelope:
    """What every response and chunk of one request shares."""

    endpoint: str
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.endpoint)
        self.created = self.created or int(time.time())

    def _base(self, stream: bool) -> dict[str, Any]:
        if self.endpoint == "chat":
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def logprobs(self, entries: list, token_bytes, base_offset: int = 0) -> dict:
        """The choice's logprobs object for TokenLogprob entries, in this endpoint's format."""
        if self.endpoint == "chat":
            return {"content": chat_logprobs(entries, token_bytes), "refusal": None}
        return completion_logprobs(entries, token_bytes, base_offset)

    def response(self, text: str, finish: str, use: dict, extra: dict, tool_calls: list | None = None,
                 logprobs: dict | None = None, index: int = 0) -> dict:
        """logprobs: the choice's logprobs object (chat: {"content": [...], "refusal": None}), or None.
        index: the choice's (n > 1 joins the choices of several responses)."""
        out = self._base(False)
        if self.endpoint == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            choice = {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out.update(choices=[choice], usage=use, **extra)
        return out

    def chunk(self, *, text: str | None = None, role: bool = False, tool_calls: list | None = None,
              finish: str | None = None, extra: dict | None = None, logprobs: dict | None = None,
              index: int = 0) -> dict:
        out = self._base(True)
        if self.endpoint == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:  # tools.call_deltas: each with its index
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        out["choices"] = [choice]
        out.update(extra or {})
        return out

    def usage_chunk(self, use: dict) -> dict:
        out = self._base(True)
        out.update(choices=[], usage=use)
        return out
