"""Tool calls in model output: one parser per chat-template family, chosen once at load from the
chat template (and the architecture), with a bare-JSON fallback whenever tools were given.

Families and the formats their templates teach the model:
  hermes       Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  qwen3_coder  Qwen3-Coder XML: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n</function>\\n
               </tool_call>`
  llama3       Llama 3.x JSON: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`
  harmony      gpt-oss: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, or
               the recipient before the channel (` to=functions.NAME<|channel|>commentary json<|message|>`)
  deepseek     DeepSeek V3/R1 (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
               <｜tool▁call▁end｜>`)
               and V3.1 (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`), inside
               `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`
  json         no tool format in the template: only the bare-JSON fallback
The fallback: the whole reply (optionally in a ```json fence) is one JSON object, or a list of them,
naming a declared tool: `{"name": ..., "arguments"|"parameters": {...}}`.

Only declared tool names become tool calls; anything else stays in the content. Pure functions: no
model, no HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from strata_jax.core.errors import ConfigError
from strata_jax.engine.constrained import JSON_OPTIONS  # response_format's compact JSON

FAMILIES = ("hermes", "qwen3_coder", "llama3", "harmony", "deepseek", "json")

# DeepSeek's markers use fullwidth bars and U+2581 (the template's own spelling)
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PYTHON_TAG = "<|python_tag|>"
H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
H_CALL = "<|call|>"
H_ENDS = ("<|end|>", H_CALL, "<|return|>")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# the markers a vocabulary may hold as single tokens (call_grammar allows the token or the text)
MARKERS = (TOOL_OPEN, TOOL_CLOSE, H_CHANNEL, H_CONSTRAIN, H_MESSAGE, H_CALL, DS_CALLS_BEGIN, DS_CALLS_END,
           DS_CALL_BEGIN, DS_CALL_END, DS_SEP)


@dataclasses.dataclass(frozen=True)
class Family:
    """A template family's tool-call format. openers: text that starts a call (a stream holds back
    from there); preserved: special tokens its calls are made of, which decoding must keep in the text;
    variant: "v3" | "v3.1" for deepseek."""

    name: str
    why: str
    variant: str = ""

    @property
    def openers(self) -> tuple[str, ...]:
        return {"hermes": (TOOL_OPEN,), "qwen3_coder": (TOOL_OPEN, "<function="), "llama3": (PYTHON_TAG,),
                "harmony": (H_CHANNEL, H_START, "to=functions."), "deepseek": (DS_CALLS_BEGIN, DS_CALL_BEGIN),
                "json": ()}[self.name]

    @property
    def preserved(self) -> tuple[str, ...]:
        return {"llama3": (PYTHON_TAG,), "harmony": (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, *H_ENDS),
                "deepseek": (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
                "hermes": (TOOL_OPEN, TOOL_CLOSE), "qwen3_coder": (TOOL_OPEN, TOOL_CLOSE)}.get(self.name, ())

    def forced_prefix(self, name: str | None, start: str = "") -> str:
        """The start of the reply that makes the model write a call: of `name`, or (None) of a tool it
        picks, whose name begins with `start` (what the declared names share). Appended to the prompt
        for tool_choice "required" or a named function."""
        n = name or start
        if self.name == "hermes":
            return '<tool_call>\n{"name": "' + (f'{n}", "arguments": ' if name else n)
        if self.name == "qwen3_coder":
            return "<tool_call>\n<function=" + (f"{n}>\n" if name else n)
        if self.name == "llama3":
            return '{"name": "' + (f'{n}", "parameters": ' if name else n)
        if self.name == "harmony":
            # after the generation prompt's `<|start|>assistant`, as gpt-oss's template writes a call
            return " to=functions." + (f"{n}<|channel|>commentary json<|message|>" if name else n)
        if self.name == "deepseek":
            head = DS_CALLS_BEGIN + DS_CALL_BEGIN + ("function" + DS_SEP if self.variant == "v3" else "")
            if not name:
                return head + n
            return head + (f"{n}\n```json\n" if self.variant == "v3" else f"{n}{DS_SEP}")
        return '{"name": "' + (f'{n}", "arguments": ' if name else n)


def detect_family(template: str | None, arch: str = "") -> Family:
    """The tool-call family of a chat template (the GGUF's tool_use template when it has one)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return Family("qwen3_coder", "the chat template teaches <function=...><parameter=...> XML calls")
    if H_CHANNEL in t or arch in ("gpt-oss", "gptoss"):
        return Family("harmony", "the chat template uses harmony channels (<|channel|>)" if H_CHANNEL in t
                      else f"architecture {arch}")
    if "tool▁call▁begin" in t:
        v3 = "tool['type'] + '<｜tool▁sep｜>'" in t or "tool['type']+'<｜tool▁sep｜>'" in t
        return Family("deepseek", "the chat template uses <｜tool▁call▁begin｜>", "v3" if v3 else "v3.1")
    if TOOL_OPEN in t:
        return Family("hermes", "the chat template wraps calls in <tool_call></tool_call>")
    if PYTHON_TAG in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return Family("llama3", "the chat template is Llama 3's (JSON calls with \"parameters\")")
    return Family("json", "the chat template has no tool-call format: bare JSON calls only" if t
                  else "no chat template: bare JSON calls only")


# -- parsing ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Found:
    """A call as written: its name, arguments (a JSON string or a value to serialize) and its raw text."""

    name: str
    arguments: Any
    raw: str


_DECODER = json.JSONDecoder()
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}  # an object with other keys is data, not a call


def _json_call(obj: Any, raw: str) -> Found | None:
    if isinstance(obj, dict) and obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # OpenAI's own shape, which small models sometimes echo
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not set(obj) <= _CALL_KEYS:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Found(obj["name"], args, raw)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes(text: str, tools: dict) -> list:
    out: list = []
    pos = 0
    for m in re.finditer(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|\Z)", text, re.S):
        # the block's JSON calls; a small model may run on into another call without closing the tag
        calls, end = _json_run(m.group(1), 0)
        if not calls:
            continue
        calls[0].raw = m.group(0)
        for c in calls[1:]:
            c.raw = ""
        leftover = m.group(1)[end:].strip()
        out += [text[pos:m.start()], *calls, leftover]
        pos = m.end()
    return out + [text[pos:]]


def _coder_value(v: str, schema: dict) -> Any:
    """A <parameter> value: text, or JSON for a parameter whose schema type is not a string."""
    v = v[1:] if v.startswith("\n") else v
    v = v[:-1] if v.endswith("\n") else v
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return v
    parsed = _loads(v.strip())
    return v if parsed is None else parsed


def _qwen3_coder(text: str, tools: dict) -> list:
    out: list = []
    pos = 0
    block = re.compile(r"(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>)?|\Z)", re.S)
    for m in block.finditer(text):
        name = m.group(1).strip()
        props = (tools.get(name) or {}).get("properties", {})
        params = re.finditer(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", m.group(2), re.S)
        args = {p.group(1).strip(): _coder_value(p.group(2), props.get(p.group(1).strip(), {})) for p in params}
        out += [text[pos:m.start()], Found(name, args, m.group(0))]
        pos = m.end()
    return out + [text[pos:]]


def _json_run(text: str, i: int) -> tuple[list[Found], int]:
    """JSON call objects from text[i:] (separated by whitespace, ';' or ','), and where they end."""
    calls = []
    while True:
        j = i
        while j < len(text) and text[j] in " \t\r\n;,":
            j += 1
        if j >= len(text) or text[j] not in "{[":
            return calls, i
        try:
            obj, end = _DECODER.raw_decode(text, j)
        except ValueError:
            return calls, i
        objs = obj if isinstance(obj, list) else [obj]
        found = [_json_call(o, text[j:end]) for o in objs]
        if not objs or any(f is None for f in found):
            return calls, i
        if len(found) > 1:  # a list: one raw text for the whole list, on its first call
            for f in found[1:]:
                f.raw = ""
        calls += found
        i = end


def _llama3(text: str, tools: dict) -> list:
    k = text.find(PYTHON_TAG)
    calls, end = _json_run(text, k + len(PYTHON_TAG)) if k >= 0 else ([], 0)
    if not calls:
        return [text]
    calls[0].raw = text[k:end]  # the tag and every call after it, on the first call
    for c in calls[1:]:
        c.raw = ""
    return [text[:k], *calls, text[end:]]


def _harmony(text: str, tools: dict) -> list:
    """gpt-oss messages: `[<|start|>assistant][ to=...]<|channel|>C[ to=functions.N][ <|constrain|>json]
    <|message|>BODY<|end|>|<|call|>|<|return|>`. Calls come from headers naming functions.N; the final
    channel's (or a channel-less message's) body is content; the analysis channel is dropped."""
    if H_MESSAGE not in text:
        return [text]
    out: list = []
    pos = 0
    ends = "|".join(re.escape(e) for e in H_ENDS)
    for m in re.finditer(r"((?:(?!" + ends + r"|" + re.escape(H_MESSAGE) + r").)*?)" + re.escape(H_MESSAGE)
                         + r"(.*?)(" + ends + r"|\Z)", text, re.S):
        header, body = m.group(1), m.group(2)
        to = re.search(r"to=functions\.([^\s<]+)", header)
        if to:
            out.append(Found(to.group(1), body.strip(), m.group(0)))
        elif "analysis" in header.partition(H_CHANNEL)[2].split(H_CONSTRAIN)[0]:
            pass  # reasoning, not content
        else:
            out.append(body)
        pos = m.end()
    return out + [text[pos:]]


def _deepseek(text: str, tools: dict) -> list:
    out: list = []
    pos = 0
    call = re.compile(re.escape(DS_CALL_BEGIN) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)(?:"
                      + re.escape(DS_CALL_END) + r"|\Z)", re.S)
    for m in call.finditer(text):
        kind, rest = m.group(1).strip(), m.group(2)
        if kind == "function":  # V3/R1: the name on the separator's line, then a fenced JSON block
            name, _, args = rest.partition("\n")
            args = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", args)
        else:
            name, args = kind, rest
        start = m.start()
        before = text[pos:start]
        if before.rstrip().endswith(DS_CALLS_BEGIN):
            start = text.rfind(DS_CALLS_BEGIN, pos, start)
        end = m.end()
        after = re.match(r"\s*" + re.escape(DS_CALLS_END), text[end:])
        end += after.end() if after else 0
        out += [text[pos:start], Found(name.strip(), args.strip(), text[start:end])]
        pos = end
    return out + [text[pos:]]


def _bare_json(text: str) -> list[Found] | None:
    """The whole reply as JSON calls (in a ```json fence or not), else None."""
    s = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", s, re.S)
    s = fence.group(1) if fence else s
    if not s or s[0] not in "{[":
        return None
    calls, end = _json_run(s, 0)
    return calls if calls and not s[end:].strip() else None


_PARSERS = {"hermes": _hermes, "qwen3_coder": _qwen3_coder, "llama3": _llama3, "harmony": _harmony,
            "deepseek": _deepseek, "json": lambda text, tools: [text]}


def _arguments(args: Any) -> str:
    """OpenAI's arguments string: a call written as text keeps its text (JSON or not)."""
    if isinstance(args, str):
        return args.strip() or "{}"
    return json.dumps(args, ensure_ascii=False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def marker_ids(tokenizer) -> dict[str, int]:
    """The MARKERS the vocabulary holds as single tokens: call_grammar's marker_ids."""
    if tokenizer is None:
        return {}
    ids = {t: tokenizer.token_to_id(t) for t in MARKERS}
    return {t: i for t, i in ids.items() if i is not None}


def call_grammar(family: str, tools: list[dict], name: str | None = None,
                 marker_ids: dict[str, int] | None = None) -> str:
    """Lark text of OpenAI's tool_choice "required" (one call or more of the given tools; one for the
    formats that take a single call) or a named function (one call of it), in this family's format, the
    arguments following each function's parameters schema (every family of FAMILIES has one). marker_ids:
    the vocabulary's own token for a marker (Qwen's <tool_call> is one token, which a text literal does
    not match): either form is allowed. What the parsers above read is what these write."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        known = ", ".join(repr(t["function"]["name"]) for t in tools)
        raise ConfigError(f"tool_choice names the function {name!r}, which is not in tools ({known}).")
    ids, NL = marker_ids or {}, "\n"

    def lit(text: str) -> str:
        return f"({json.dumps(text)} | <[{ids[text]}]>)" if text in ids else json.dumps(text)

    def js(schema: dict) -> str:
        return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}))

    def params(f: dict) -> dict:
        return f.get("parameters") or {"type": "object"}

    def call_object(args_key: str) -> str:
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", args_key],
                  "properties": {"name": {"const": f["name"]}, args_key: params(f)}} for f in fns]
        return js(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def per_function(rule: Callable[[int, dict], str]) -> str:
        alts = " | ".join(f"call{i}" for i in range(len(fns)))
        return f"call: {alts}\n" + "".join(f"call{i}: {rule(i, f)}\n" for i, f in enumerate(fns))

    more = "" if name is not None else ' ("\\n" call)*'
    if family == "hermes":
        return (f"start: call{more}\ncall: {lit(TOOL_OPEN)} \"\\n\" body \"\\n\" {lit(TOOL_CLOSE)}\n"
                f"body: {call_object('arguments')}\n")
    if family in ("json", "llama3"):  # one bare JSON object naming the tool (Llama 3: its "parameters")
        return f"start: body\nbody: {call_object('parameters' if family == 'llama3' else 'arguments')}\n"
    if family == "harmony":  # one message on the commentary channel addressed to the function
        return "start: call\n" + per_function(lambda i, f: (
            f"{lit(H_CHANNEL)} {json.dumps('commentary to=functions.' + f['name'] + ' ')} {lit(H_CONSTRAIN)} "
            f"\"json\" {lit(H_MESSAGE)} {js(params(f))} {lit(H_CALL)}"))
    if family == "deepseek":  # V3: the name after the separator, the arguments in a fenced JSON block
        return (f"start: {lit(DS_CALLS_BEGIN)} call{'' if name is not None else ' call*'} {lit(DS_CALLS_END)}\n"
                + per_function(lambda i, f: (
                    f"{lit(DS_CALL_BEGIN)} \"function\" {lit(DS_SEP)} {json.dumps(f['name'] + NL + '```json' + NL)} "
                    f"{js(params(f))} {json.dumps(NL + '```')} {lit(DS_CALL_END)}")))
    if family == "qwen3_coder":  # XML: a <parameter=...> per argument, text values, JSON for other types
        def xml_value(sch: dict) -> str:  # what _coder_value reads back: text for strings, else JSON
            if sch.get("enum") and all(isinstance(v, str) for v in sch["enum"]):
                return "(" + " | ".join(json.dumps(v) for v in sch["enum"]) + ")"
            return "/[^<\\n][^<]*/" if sch.get("type") in (None, "string") else js(sch)

        def xml(i: int, f: dict) -> str:
            props = params(f).get("properties") or {}
            need = set(params(f).get("required") or [])
            parts = [f"{lit(TOOL_OPEN)} {json.dumps(NL + '<function=' + f['name'] + '>' + NL)}"]
            for key, sch in props.items():
                head, tail = json.dumps(f"<parameter={key}>{NL}"), json.dumps(f"{NL}</parameter>{NL}")
                value = xml_value(sch if isinstance(sch, dict) else {})
                piece = f"{head} {value} {tail}"
                parts.append(piece if key in need else f"({piece})?")
            parts.append(f"{json.dumps('</function>' + NL)} {lit(TOOL_CLOSE)}")
            return " ".join(parts)
        return f"start: call{more}\n" + per_function(xml)
    raise ValueError(f"no call grammar for the tool-call family {family!r}")


class ToolParser:
    """Splits a reply into (content, tool calls) for one request: its family, declared tools, and
    parallel_tool_calls (False keeps the first call)."""

    def __init__(self, family: Family, tools: list[dict] | None, *, parallel: bool = True, prefix: str = ""):
        self.family, self.parallel, self.prefix = family, parallel, prefix
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool calls with arguments as JSON strings). Without calls the text comes back
        unchanged; with calls, content is the rest (None when empty)."""
        segments = _PARSERS[self.family.name](text, self.schemas)
        found = [s for s in segments if isinstance(s, Found)]
        if not any(f.name in self.schemas for f in found):
            bare = _bare_json(text)
            if bare and all(f.name in self.schemas for f in bare):
                segments, found = bare, bare
        calls, kept = [], []
        for s in segments:
            if not isinstance(s, Found):
                kept.append(s)
            elif s.name in self.schemas and (self.parallel or not calls):
                calls.append({"id": new_call_id(), "type": "function",
                              "function": {"name": s.name, "arguments": _arguments(s.arguments)}})
            elif s.name not in self.schemas:
                kept.append(s.raw)
        if not calls:  # a harmony reply's content is its final channel, calls or not
            return ("".join(kept).strip() if self.family.name == "harmony" and H_MESSAGE in text else text), []
        rest = "".join(kept).strip()
        return rest or None, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# the head of a JSON call (hermes, llama3, bare JSON): once it is whole, the arguments can stream
_LIVE_HEAD = re.compile(r'\s*(?:<tool_call>\s*|<\|python_tag\|>\s*)?(?:```(?:json)?\s*)?\[?\s*\{\s*"name"\s*:\s*'
                        r'"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object starting at text[start] ends (exclusive), or None while it is open."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclasses.dataclass
class _Live:
    """The first call while it streams: its id and name, where its arguments start, how far they were sent."""

    id: str
    name: str
    start: int
    sent: int
    end: int | None = None


class ToolCallStream:
    """Streams content while holding back anything that may be a call: from the first opener of the
    family on, and a reply that starts like JSON (the bare-JSON fallback) until it is clearly not. A
    JSON call (hermes, llama3, bare) streams live: its id, type and name once its head is whole, then
    its arguments as they arrive (take_deltas); the rest is parsed whole at the end. A forced prefix
    (tool_choice) is the reply's start."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text, self.emitted, self.held = parser.prefix, 0, False
        self.live: _Live | None = None
        self._deltas: list[list[dict]] = []

    def _maybe_json(self) -> bool:
        s = self.text.lstrip()
        return not s or s[0] in "{[" or "```".startswith(s[:3])

    def feed(self, piece: str) -> str:
        """The content that is safe to stream now."""
        self.text += piece
        if self.held or (self.emitted == 0 and self._maybe_json()):
            self._advance_live()
            return ""
        hits = [i for i in (self.text.find(o, self.emitted) for o in self.parser.family.openers) if i >= 0]
        if hits:
            self.held = True
            end = min(hits)
        else:
            tail = max((_partial_suffix(self.text[self.emitted:], o) for o in self.parser.family.openers), default=0)
            end = len(self.text) - tail
        out, self.emitted = self.text[self.emitted:end], max(end, self.emitted)
        if self.held:
            self._advance_live()
        return out

    def _advance_live(self) -> None:
        if self.live is None:
            m = _LIVE_HEAD.match(self.text, self.emitted)
            if m is None or m.group(1) not in self.parser.schemas:
                return
            self.live = _Live(new_call_id(), m.group(1), m.end(), m.end())
            self._deltas.append([{"index": 0, "id": self.live.id, "type": "function",
                                  "function": {"name": self.live.name, "arguments": ""}}])
        live = self.live
        if live.end is not None:
            return
        live.end = _json_end(self.text, live.start)
        upto = live.end if live.end is not None else len(self.text)
        if upto > live.sent:
            self._deltas.append([{"index": 0, "function": {"arguments": self.text[live.sent:upto]}}])
            live.sent = upto

    def take_deltas(self) -> list[list[dict]]:
        """The tool-call deltas ready to stream (OpenAI's shape), each a chunk's `tool_calls`."""
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> tuple[str, list[list[dict]], list[dict]]:
        """(content not yet streamed, the tool-call deltas not yet streamed, every tool call)."""
        content, calls = self.parser.parse(self.text[self.emitted:])
        live = self.live
        if live is None:
            return content or "", self.take_deltas() + call_deltas(calls), calls
        args = self.text[live.start:live.end if live.end is not None else len(self.text)]
        if calls and calls[0]["function"]["name"] == live.name:
            calls[0]["id"] = live.id
            if live.end is not None:  # the model's own text, as streamed (the same JSON value)
                calls[0]["function"]["arguments"] = args
        else:  # cut off before it was whole: the call as far as it was streamed
            calls.insert(0, {"id": live.id, "type": "function", "function": {"name": live.name, "arguments": args}})
            content = None
        deltas = self.take_deltas()
        rest = calls[0]["function"]["arguments"][live.sent - live.start:]
        if rest:
            deltas.append([{"index": 0, "function": {"arguments": rest}}])
        return content or "", deltas + call_deltas(calls[1:], first=1), calls


def call_deltas(calls: list[dict], first: int = 0) -> list[list[dict]]:
    """OpenAI's streamed tool-call deltas: per call, first its index, id, type and name (empty
    arguments), then its arguments; indices from `first`."""
    out = []
    for i, c in enumerate(calls, start=first):
        fn = c["function"]
        out.append([{"index": i, "id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}])
        if fn["arguments"]:
            out.append([{"index": i, "function": {"arguments": fn["arguments"]}}])
    return out
