"""Anthropic Messages API wire format (/v1/messages, /v1/messages/count_tokens): request validation into
`GenRequest`, content blocks onto the chat template's messages (tool_use onto an assistant turn's
tool_calls, tool_result onto tool messages), and the response, stream events and error envelope.
Pure functions over JSON values, like protocol.py, whose field readers and tool-call parser it reuses.

`tool_choice` maps onto the chat path's: "any" is "required" and "tool" a named function (the template
is shown that tool only), both forcing a call as the engine's plan_tools does for OpenAI's requests;
`disable_parallel_tool_use` is `parallel_tool_calls: false`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from strata_jax.serving.protocol import APIError, GenRequest, _bool, _kind, _number, bad
from strata_jax.serving.tools import TOOL_CLOSE, TOOL_OPEN

PATHS = ("/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens")
MAX_STOP_SEQUENCES = 16  # each is searched for after every token
# Anthropic's error types by HTTP status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
_BLOCK_HELP = ("only text, tool_use (assistant) and tool_result (user) blocks can be used with this model, "
               "e.g. {\"type\": \"text\", \"text\": \"...\"}")


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/") in PATHS


def error_body(e: APIError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}: Anthropic's envelope for an APIError."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


# -- requests --------------------------------------------------------------------------------------

def _text_of(blocks: Any, where: str, param: str) -> str:
    """A string, or an array of text blocks joined by newlines (as protocol.py joins OpenAI's text parts)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or an array of text blocks, got {_kind(blocks)}.", param)
    texts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else _kind(b)
            raise bad(f"{where}[{j}] ({json.dumps(kind)[:40]}) must be a text block {{\"type\": \"text\", "
                      "\"text\": \"...\"}.", param)
        texts.append(b["text"])
    return "\n".join(texts)


def _user_turn(content: Any, i: int) -> list[dict]:
    """A user message as template messages: one tool message per tool_result, then the text (if any)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise bad(f"{where} must be a string or a non-empty array of content blocks, got {_kind(content)}.",
                  "messages")
    out, texts = [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            result = b.get("content", "")
            text = _text_of(result, f"{where}[{j}].content", "messages") if result is not None else ""
            if _bool(b, "is_error", False):
                text = "Error: " + text  # the template has no error flag; the model must still see it failed
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise bad(f"{where}[{j}] ({json.dumps(kind if kind else _kind(b))[:40]}) is not supported in a user "
                      f"message: {_BLOCK_HELP}; a tool_result needs a string 'tool_use_id'.", "messages")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content: Any, i: int) -> dict:
    """An assistant message: its text, and its tool_use blocks as tool_calls (arguments as objects, which
    the templates tojson)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content blocks, got {_kind(content)}.", "messages")
    texts, calls = [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and b["name"]
                    and isinstance(b.get("input", {}), dict)):
                raise bad(f"{where}[{j}] must be {{\"type\": \"tool_use\", \"id\": str, \"name\": str, \"input\": "
                          "{...}}.", "messages")
            calls.append({"type": "function", "id": b["id"],
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise bad(f"{where}[{j}] ({json.dumps(kind if kind else _kind(b))[:40]}) is not supported in an "
                      f"assistant message: {_BLOCK_HELP}.", "messages")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict) -> tuple[list[dict], str]:
    """The template's messages, and the prefill: a final assistant message's text, which the reply
    continues (and does not repeat)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' is required: a non-empty array of {\"role\": \"user\" | \"assistant\", \"content\": "
                  f"...}} objects, got {_kind(msgs)}{' (empty)' if msgs == [] else ''}.", "messages")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "'system'", "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else _kind(m)
            raise bad(f"messages[{i}] must be an object with role \"user\" or \"assistant\" (the system prompt "
                      f"goes in the top-level 'system'), got role {json.dumps(role)[:40]}.", "messages")
        if "content" not in m or m["content"] is None:
            raise bad(f"messages[{i}].content is required.", "messages")
        if m["role"] == "user":
            out += _user_turn(m["content"], i)
        else:
            out.append(_assistant_turn(m["content"], i))
    prefill = ""
    if out[-1]["role"] == "assistant":
        last = out.pop()
        if last.get("tool_calls"):
            raise bad("the last message is an assistant turn with tool_use blocks: send their tool_result blocks "
                      "in a user message after it.", "messages")
        if last["content"] != last["content"].rstrip():
            raise bad("the final assistant message (the prefill the reply continues) cannot end with whitespace.",
                      "messages")
        prefill = last["content"]
    if not any(m["role"] in ("user", "tool") for m in out):
        raise bad("'messages' has no user message; start the conversation with one.", "messages")
    return out, prefill


def _tools(body: dict) -> tuple[list[dict] | None, str | None, bool]:
    """Anthropic's tools as the OpenAI-style function tools the chat templates render, the chat path's
    tool_choice (None: auto, "required", or the one tool's name) and parallel_tool_calls."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    kinds = ("auto", "any", "tool", "none")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in kinds
                                   and (choice["type"] != "tool" or isinstance(choice.get("name"), str))
                                   and isinstance(choice.get("disable_parallel_tool_use", False), bool)):
        raise bad("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                  "{\"type\": \"tool\", \"name\": ...} (with an optional boolean 'disable_parallel_tool_use').",
                  "tool_choice")
    parallel = not (choice or {}).get("disable_parallel_tool_use", False)
    if tools is None:
        if choice is not None and choice["type"] in ("any", "tool"):
            raise bad(f"'tool_choice' {choice['type']!r} needs 'tools'.", "tool_choice")
        return None, None, parallel
    if not isinstance(tools, list):
        raise bad(f"'tools' must be an array of tools, got {_kind(tools)}.", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else _kind(t)
            raise bad(f"tools[{i}] has type {json.dumps(kind)[:40]}: only client tools ({{\"name\", \"description\", "
                      "\"input_schema\"}) are supported, not Anthropic's server tools.", "tools")
        if (not isinstance(t.get("name"), str) or not t["name"] or not isinstance(t.get("input_schema"), dict)
                or not isinstance(t.get("description", ""), (str, type(None)))):
            raise bad(f"tools[{i}] must be {{\"name\": str, \"description\": str, \"input_schema\": {{JSON schema}}}}.",
                      "tools")
        fn = {"name": t["name"]}  # in OpenAI's key order: templates render the dict as it is
        if t.get("description"):
            fn["description"] = t["description"]
        fn["parameters"] = t["input_schema"]
        out.append({"type": "function", "function": fn})
    if choice is not None and choice["type"] == "tool":
        out = [t for t in out if t["function"]["name"] == choice["name"]]
        if not out:
            raise bad(f"'tool_choice' names {choice['name']!r}, which is not in 'tools'.", "tool_choice")
    if (choice is not None and choice["type"] == "none") or not out:
        return None, None, parallel
    forced = {"any": "required", "tool": (choice or {}).get("name")}.get((choice or {}).get("type"))
    return out, forced, parallel


def parse_messages(body: Any, *, count_only: bool = False) -> GenRequest:
    """A /v1/messages body (count_only: a /v1/messages/count_tokens body, which has no max_tokens)."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_kind(model)}.", "model")
    req = GenRequest(endpoint="messages", prompt=[], model=model)
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad("'max_tokens' is required: the most tokens to generate, an integer >= 1.", "max_tokens")
        req.max_tokens = _number(body, "max_tokens", 0, 1, 2**31 - 1, integer=True)
        req.temperature = _number(body, "temperature", 1.0, 0, 1)
        req.top_p = _number(body, "top_p", 1.0, 0, 1, lo_open=True)
        req.top_k = _number(body, "top_k", 0, 0, 2**31 - 1, integer=True)
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad("'stop_sequences' must be an array of non-empty strings.", "stop_sequences")
            if len(stops) > MAX_STOP_SEQUENCES:
                raise bad(f"'stop_sequences' has {len(stops)} strings; at most {MAX_STOP_SEQUENCES} are allowed.",
                          "stop_sequences")
            req.stop = list(stops)
        req.stream = _bool(body, "stream", False)
    req.prompt, req.prefill = _messages(body)
    req.tools, req.tool_choice, req.parallel_tool_calls = _tools(body)
    if req.tool_choice is not None and req.prefill:
        raise bad("'tool_choice' {\"type\": \"any\"} or {\"type\": \"tool\"} forces the reply to start with a tool "
                  "call, which the assistant prefill (the last message) would start instead: drop one of them.",
                  "tool_choice")
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise bad("'thinking' must be {\"type\": \"disabled\"}, {\"type\": \"adaptive\"} or omitted.", "thinking")
        if thinking["type"] == "enabled":
            raise bad("extended thinking with a budget ('thinking': {\"type\": \"enabled\"}) is not supported yet; "
                      "omit it, or send {\"type\": \"adaptive\"} for the chat template's default.", "thinking")
        if thinking["type"] == "disabled":
            req.reasoning_effort = "none"  # turns enable_thinking off where the template has it
    return req


# -- responses --------------------------------------------------------------------------------------

def new_id() -> str:
    return "msg_" + secrets.token_hex(12)


def content_blocks(text: str | None, calls: list[dict], *, always_text: bool = True) -> list[dict]:
    """The text block (if there is text, or always_text and no calls) and a tool_use block per parsed
    call (tools.ToolParser's OpenAI calls). A call whose arguments are not a JSON object cannot be
    a tool_use: it stays in the text as the model wrote it."""
    uses, kept = [], text or ""
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]
        if not isinstance(args, dict):
            kept += TOOL_OPEN + json.dumps({"name": fn["name"], "arguments": args}) + TOOL_CLOSE
            continue
        uses.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": fn["name"],
                     "input": args})
    text_blocks = [{"type": "text", "text": kept}] if kept or (always_text and not uses) else []
    return text_blocks + uses


def stop_reason(finish: str | None, stop_string: str | None, blocks: list[dict]) -> str:
    if any(b["type"] == "tool_use" for b in blocks):
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string else "end_turn"


def usage(prompt_n: int, output_n: int, cached_n: int = 0) -> dict[str, int]:
    """As Anthropic counts: input_tokens are the prompt tokens not read from the (KV) cache."""
    return {"input_tokens": prompt_n - cached_n, "output_tokens": output_n, "cache_read_input_tokens": cached_n,
            "cache_creation_input_tokens": 0}


def message(msg_id: str, model: str, blocks: list[dict], reason: str | None, stop_sequence: str | None,
            use: dict, extra: dict | None = None) -> dict[str, Any]:
    out = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
           "stop_reason": reason, "stop_sequence": stop_sequence, "usage": use}
    out.update(extra or {})
    return out


def event(obj: dict) -> str:
    """One SSE event, named by its type as Anthropic's are."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


class MessageStream:
    """Anthropic's event sequence for one streamed message: message_start, content_block_start, ping,
    content_block_delta (text_delta), content_block_stop, tool_use blocks (one input_json_delta each),
    message_delta (stop_reason, usage), message_stop. With tools the text block opens on the first text
    (a reply that is only a tool call starts with its tool_use block), and ping follows message_start."""

    def __init__(self, msg_id: str, model: str, prompt_n: int, cached_n: int, *, tools: bool):
        self.id, self.model, self.tools = msg_id, model, tools
        self.prompt_n, self.cached_n = prompt_n, cached_n
        self.index, self.text_open, self.text = 0, False, ""

    def start(self) -> list[str]:
        head = message(self.id, self.model, [], None, None, usage(self.prompt_n, 0, self.cached_n))
        out = [event({"type": "message_start", "message": head})]
        if not self.tools:
            out.append(self._open_text())
        return out + [event({"type": "ping"})]

    def _open_text(self) -> str:
        self.text_open = True
        return event({"type": "content_block_start", "index": self.index, "content_block": {"type": "text",
                                                                                            "text": ""}})

    def delta(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.text_open else [self._open_text()]
        self.text += text
        return out + [event({"type": "content_block_delta", "index": self.index,
                             "delta": {"type": "text_delta", "text": text}})]

    def finish(self, rest: str, calls: list[dict], finish: str | None, stop_string: str | None, output_n: int,
               extra: dict | None = None) -> tuple[list[str], list[dict]]:
        """The closing events, and the message's content blocks (what the SDK's final message holds)."""
        out = self.delta(rest)
        blocks = content_blocks(self.text, calls, always_text=self.text_open or not calls)
        kept = blocks[0]["text"] if blocks and blocks[0]["type"] == "text" else ""
        out += self.delta(kept[len(self.text):])  # calls that could not be tool_use blocks, as text
        if not self.text_open and not calls:
            out.append(self._open_text())
        if self.text_open:
            out.append(event({"type": "content_block_stop", "index": self.index}))
            self.index += 1
        for b in blocks:
            if b["type"] != "tool_use":
                continue
            out.append(event({"type": "content_block_start", "index": self.index,
                              "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}))
            out.append(event({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}}))
            out.append(event({"type": "content_block_stop", "index": self.index}))
            self.index += 1
        reason = stop_reason(finish, stop_string, blocks)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_string
                                                    if reason == "stop_sequence" else None},
                 "usage": usage(self.prompt_n, output_n, self.cached_n)}
        delta.update(extra or {})
        out += [event(delta), event({"type": "message_stop"})]
        return out, blocks

    @staticmethod
    def error(e: APIError) -> str:
        return event(error_body(e))
