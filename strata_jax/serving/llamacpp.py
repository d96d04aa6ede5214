"""llama.cpp's own completion API (not OpenAI's), the model for this server's extensions: POST /completion and
POST /infill (code between a prefix and a suffix, as editor plugins such as llama.vscode ask for it), their
request fields with llama.cpp's defaults, and its response and stream format (tools/server/README.md of
llama.cpp). Pure functions over JSON values, like protocol.py, whose field readers they reuse.

Sampling llama.cpp has and this engine does not (Mirostat, DRY, XTC, typical, dynamic temperature, probabilities
after the sampling chain) is refused unless it is at its "off" value; fields about slots, timing limits and
progress reports are accepted and change nothing here.
"""

from __future__ import annotations

from typing import Any

from strata_jax.serving.protocol import (MAX_TOP_LOGPROBS, GenRequest, _bool, _common, _kind, _number, bad,
                                         is_token_id)

# llama.cpp's sampling defaults for these endpoints (OpenAI's routes keep OpenAI's)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
# its samplers this engine does not have, each with the value that turns it off
_OFF = {"mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "typical_p": 1.0, "dynatemp_range": 0.0,
        "post_sampling_probs": False}


def parse(body: Any, *, infill: bool = False) -> GenRequest:
    """A /completion body (prompt: text or token ids), or with `infill` an /infill body (input_prefix,
    input_suffix, input_extra files, prompt after the prefix). n_predict 0 (llama.cpp: evaluate the prompt only)
    is max_tokens 0: the caller answers it without generating."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_kind(body)}.")
    for name, off in _OFF.items():
        if body.get(name) not in (None, off):
            raise bad(f"'{name}' is not supported by this server (no such sampler here); omit it or set it to {off}.",
                      name)
    b = {k: v for k, v in body.items() if k not in ("n", "max_completion_tokens", "stream_options")}
    for k, v in DEFAULTS.items():
        b[k] = v if b.get(k) is None else b[k]
    if b.get("logit_bias") in ([], {}):
        b.pop("logit_bias")
    if b.get("seed") == -1:  # llama.cpp's "random"
        b.pop("seed")
    n_predict = b.pop("n_predict", None)
    n_predict = b.pop("max_tokens", None) if n_predict is None else n_predict
    if n_predict is not None and (not is_token_id(n_predict) or n_predict < -1):
        raise bad(f"'n_predict' must be an integer: -1 (until the context is full or the model stops), 0 (the prompt "
                  f"only) or a token count, got {n_predict!r}.", "n_predict")
    stop = b.get("stop")
    if stop == []:
        b.pop("stop")
    common = _common(b)
    common["max_tokens"] = None if n_predict in (None, -1) else n_predict
    req = GenRequest(endpoint="completion", prompt="", **common)
    req.top_logprobs = _number(body, "n_probs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    req.logprobs = req.top_logprobs > 0
    if infill:
        _infill_fields(body, req)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(is_token_id(t) for t in p):
            req.prompt = p
        elif isinstance(p, str) and p:
            req.prompt = p
        else:
            raise bad(f"'prompt' must be a non-empty string or array of token ids, got {_kind(p)}; several prompts, "
                      "or strings mixed with token ids, are not supported yet.", "prompt")
    return req


def _infill_fields(body: dict, req: GenRequest) -> None:
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise bad(f"'{name}' is required: the code {'before' if name == 'input_prefix' else 'after'} the gap, as a "
                      f"string (got {_kind(body.get(name))}).", name)
    extra = body.get("input_extra") or []
    if not isinstance(extra, list) or not all(
            isinstance(c, dict) and isinstance(c.get("text"), str) and isinstance(c.get("filename", ""), str)
            for c in extra):
        raise bad("'input_extra' must be an array of {\"filename\": string, \"text\": string}: other files the code "
                  "sees.", "input_extra")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise bad(f"'prompt' (text after the prefix) must be a string, got {_kind(prompt)}.", "prompt")
    req.endpoint, req.prompt, req.suffix = "infill", body["input_prefix"], body["input_suffix"]
    req.infill_extra, req.infill_prompt = list(extra), prompt


def settings(req: GenRequest, n_ctx: int) -> dict[str, Any]:
    """generation_settings: what the request runs with (llama.cpp's names)."""
    return {"n_ctx": n_ctx, "n_predict": -1 if req.max_tokens is None else req.max_tokens,
            "seed": -1 if req.seed is None else req.seed, "temperature": req.temperature, "top_k": req.top_k,
            "top_p": req.top_p, "min_p": req.min_p, "repeat_penalty": req.repeat_penalty,
            "repeat_last_n": req.repeat_last_n, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "stop": list(req.stop), "stream": req.stream,
            "cache_prompt": req.cache_prompt, "grammar": req.constraint or ""}


def default_settings(n_ctx: int) -> dict[str, Any]:
    """The settings of a request that sets nothing (GET /props' default_generation_settings.params)."""
    return settings(parse({"prompt": "-"}), n_ctx)


def stop_type(finish_reason: str | None, stop_string: str | None) -> str:
    if finish_reason is None:
        return "none"
    if stop_string:
        return "word"
    return "limit" if finish_reason == "length" else "eos"


def probs(entries: list, token_bytes) -> list[dict[str, Any]]:
    """completion_probabilities (n_probs) for the engine's TokenLogprob entries: each generated token and the
    n_probs most likely at its step, by id, text, bytes and log-probability."""
    def one(tid: int, logprob: float) -> dict[str, Any]:
        b = token_bytes(tid)
        return {"id": tid, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b), "logprob": logprob}

    return [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]


def chunk(content: str, tokens: list[int], predicted: int, evaluated: int,
          probs_: list[dict] | None = None) -> dict[str, Any]:
    """One streamed piece (`data: {...}`; llama.cpp sends no [DONE])."""
    out = {"index": 0, "content": content, "tokens": tokens, "stop": False, "id_slot": 0,
           "tokens_predicted": predicted, "tokens_evaluated": evaluated}
    return out | {"completion_probabilities": probs_} if probs_ else out


def final(*, model: str, text: str, ids: list[int], show_ids: bool, prompt: str, evaluated: int, cached: int,
          n_ctx: int, req: GenRequest, finish_reason: str | None, stop_string: str | None, timings: dict[str, Any],
          streamed: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole response to text (ids: its tokens, listed when show_ids: return_tokens), or, streamed, the
    stream's last event: the same fields with the text already sent."""
    return {"index": 0, "content": "" if streamed else text, "tokens": [] if streamed or not show_ids else ids,
            "id_slot": 0, "stop": True, "model": model, "tokens_predicted": len(ids), "tokens_evaluated": evaluated,
            "generation_settings": settings(req, n_ctx), "prompt": prompt, "has_new_line": "\n" in text,
            "truncated": evaluated + len(ids) >= n_ctx, "stop_type": stop_type(finish_reason, stop_string),
            "stopping_word": stop_string or "", "tokens_cached": cached, "timings": timings, **(extra or {})}


def return_tokens(body: Any) -> bool:
    return isinstance(body, dict) and _bool(body, "return_tokens", False)
