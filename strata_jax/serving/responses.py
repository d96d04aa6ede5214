"""OpenAI's Responses API (`POST /v1/responses`): the request read into the chat path's `GenRequest`
(input items become chat messages), and the response object and stream events built from what the
engine generated. Pure functions over JSON values: no model, no HTTP.

Nothing is stored: `previous_response_id`, `conversation` and `background` are refused (send the
whole conversation as `input`), and `store` is accepted but reported false.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from strata_jax.serving.protocol import (FINGERPRINT, GenRequest, _bool, _kind, _number, bad, parse_chat)

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# sampling options passed on to the chat path as they are (llama.cpp's extensions among them)
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "presence_penalty",
           "frequency_penalty", "repeat_penalty", "repeat_last_n", "cache_prompt", "chat_template_kwargs",
           "parallel_tool_calls")
_REFUSED = {"previous_response_id": "this server stores no responses; send the whole conversation as 'input'",
            "conversation": "this server stores no conversations; send the whole conversation as 'input'",
            "background": "background responses are not supported; omit it or send false",
            "prompt": "stored prompt templates are not supported; send 'input' and 'instructions'"}


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (as the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of input_text parts, got {_kind(content)}.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}] is not supported ({json.dumps(kind if kind else _kind(part))[:40]}): only text "
                      "parts {\"type\": \"input_text\", \"text\": \"...\"} can be used with this model.", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad(f"'instructions' must be a string, got {_kind(instructions)}.", "instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' is required: a string, or a non-empty array of message, function_call and "
                  "function_call_output items.", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object, got {_kind(item)}.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad(f"{where}.role={json.dumps(role)[:40]} is not a known role; use one of "
                          f"{', '.join(_ROLES)}.", "input")
            out.append({"role": role, "content": _text(item.get("content"), where + ".content")})
        elif kind == "function_call":
            for key in ("name", "arguments", "call_id"):
                if not isinstance(item.get(key), str):
                    raise bad(f"{where} (a function_call) needs '{key}' as a string.", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where} (a function_call_output) needs 'call_id' as a string.", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(output, where + ".output") if not isinstance(output, str) else output})
        elif kind == "reasoning":
            continue  # a previous turn's reasoning: chat templates drop it from history too
        else:
            raise bad(f"{where} has type {json.dumps(kind)[:40]}, which is not supported: use message, "
                      "function_call or function_call_output items.", "input")
    return out


def _tools(body: dict) -> tuple[list[dict] | None, Any]:
    """Responses' flat function tools and tool_choice in the chat path's shape."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad(f"'tools' must be an array of function tools, got {_kind(tools)}.", "tools")
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else _kind(t)
                raise bad(f"tools[{i}] ({json.dumps(kind)[:40]}) is not supported: only function tools "
                          "{\"type\": \"function\", \"name\": ..., \"parameters\": {...}} can be used.", "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"name\": ...}.", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return chat_tools, choice


def parse_responses(body: Any) -> tuple[GenRequest, dict]:
    """(the request for the engine, the options a Response object echoes)."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}.")
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False):
            raise bad(f"'{key}' is not supported: {why}.", key)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'text.format' supports only {\"type\": \"text\"} so far (no JSON schemas yet).", "text")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("'top_logprobs' is not supported on /v1/responses yet; use /v1/chat/completions with "
                  "logprobs.", "top_logprobs")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    chat["messages"] = _messages(body)
    chat["tools"], chat["tool_choice"] = _tools(body)
    effort = body.get("reasoning")
    if isinstance(effort, dict) and effort.get("effort") is not None:
        chat["reasoning_effort"] = effort["effort"]
    req = parse_chat(chat)
    req.endpoint = "responses"
    if body.get("max_output_tokens") is not None:
        req.max_tokens = _number(body, "max_output_tokens", 0, 1, 2**31 - 1, integer=True)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad(f"'metadata' must be an object of strings, got {_kind(metadata)}.", "metadata")
    echo = {"instructions": body.get("instructions"), "max_output_tokens": req.max_tokens,
            "metadata": metadata or {}, "parallel_tool_calls": _bool(body, "parallel_tool_calls", True),
            "temperature": req.temperature, "top_p": req.top_p, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "truncation": body.get("truncation") or "disabled",
            "user": body.get("user")}
    return req, echo


def usage(prompt_n: int, output_n: int, cached_n: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt_n, "input_tokens_details": {"cached_tokens": cached_n, "cache_write_tokens": 0},
            "output_tokens": output_n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_n + output_n}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    """A chat-style tool call (tools.ToolParser) as a function_call output item."""
    fn = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments}


class ResponseBuilder:
    """One response: its id, the echoed options, the final object and (streamed) its events in order."""

    def __init__(self, model: str, echo: dict[str, Any]):
        self.id, self.model, self.echo = "resp_" + secrets.token_hex(12), model, echo
        self.msg_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.seq = 0
        self.text_open = False  # the message item and its text part have been announced
        self.text = ""

    def response(self, status: str, output: list[dict], use: dict | None = None,
                 extra: dict | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "completed_at": int(time.time()) if status == "completed" else None, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "model": self.model, "output": output, "store": False, "text": {"format": {"type": "text"}},
               "reasoning": {"effort": None, "summary": None}, "usage": use, "system_fingerprint": FINGERPRINT,
               **self.echo}
        out.update(extra or {})
        return out

    def final(self, text: str, calls: list[dict], finish: str, use: dict, extra: dict) -> dict[str, Any]:
        """The finished response: its message (when there is text, or nothing else) and function calls.
        A reply cut off by max_output_tokens is "incomplete", unless it made calls."""
        status = "incomplete" if finish == "length" and not calls else "completed"
        output = [message_item(self.msg_id, text, "incomplete" if status == "incomplete" else "completed")
                  ] if text or not calls or self.text_open else []
        output += [function_call_item(c) for c in calls]
        return self.response(status, output, use, extra)

    # -- stream events ------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        r = self.response("in_progress", [])
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def delta(self, piece: str) -> list[dict]:
        out = []
        if not self.text_open:
            self.text_open = True
            out += [self.event("response.output_item.added", output_index=0,
                               item=message_item(self.msg_id, "", "in_progress")),
                    self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                               part=output_text(""))]
        self.text += piece
        out.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                              delta=piece, logprobs=[]))
        return out

    def finish(self, calls: list[dict], finish: str, use: dict, extra: dict) -> list[dict]:
        """The closing events: the message's done events, each call's added / arguments / done events, and
        response.completed (or response.incomplete) with the final object."""
        final = self.final(self.text, calls, finish, use, extra)
        out: list[dict] = []
        if not self.text_open and not calls:
            out += self.delta("")  # every response has its message, even an empty one
        index = 0
        if self.text_open:
            msg = final["output"][0]
            out += [self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                               part=output_text(self.text)),
                    self.event("response.output_item.done", output_index=0, item=msg)]
            index = 1
        for i, call in enumerate(calls, start=index):
            item = function_call_item(call)
            out += [self.event("response.output_item.added", output_index=i,
                               item=function_call_item(call, "in_progress", "")),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=i, item=item)]
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=final))
        return out

    def error(self, body: dict) -> list[dict]:
        """A stream that fails after its headers: an error event, then response.failed, the terminal event
        that OpenAI's SDK takes as the final response (status "failed", what was written so far)."""
        err = body.get("error", {})
        output = [message_item(self.msg_id, self.text, "incomplete")] if self.text_open else []
        failed = self.response("failed", output, extra={"error": {"code": err.get("code"),
                                                                  "message": err.get("message")}})
        return [self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param")),
                self.event("response.failed", response=failed)]
