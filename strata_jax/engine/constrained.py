"""Constrained decoding with llguidance: grammars from OpenAI's response_format and llama.cpp's `grammar`
(GBNF) and `json_schema`, and the per-request matcher that gives each next token's allowed set.

A grammar is compiled to llguidance's form and validated (without a model) when the request is
checked, so a bad schema or GBNF is refused before anything runs. The Session then keeps one
`Constraint` per constrained request: its bitmask (int32 words, 32 tokens each: the device's
`allowed_BVw`) is computed on the host after every token and applied to the logits on the device
before sampling (engine/sampling.py apply_mask). Where the grammar may end, the tokenizer's stop ids are
allowed; once it can take nothing more the request ends with finish_reason "stop".

llguidance is an optional dependency (the `constrained` extra); without it a constrained request is
refused with the install command.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from strata_jax.core.errors import ConfigError

log = logging.getLogger("strata_jax")

INSTALL = "pip install 'strata-jax[constrained]' (llguidance)"
# JSON as the model writes it: flexible whitespace would let a greedy model emit newlines without end
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # GGUFTokenizer -> LLTokenizer
_lock = threading.Lock()


def available() -> bool:
    """Whether llguidance can be imported (constrained decoding is possible)."""
    try:
        _llg()
    except ConfigError:
        return False
    return True


def _llg():
    try:
        import llguidance
    except ImportError:
        raise ConfigError(f"constrained decoding (a grammar, json_schema or response_format) needs llguidance: "
                          f"{INSTALL}.") from None
    return llguidance


def json_schema_grammar(schema: Any, what: str = "json_schema") -> str:
    """The llguidance grammar of a JSON schema (a dict, or True for any JSON value), validated."""
    llg = _llg()
    if not isinstance(schema, (dict, bool)):
        raise ConfigError(f"{what} must be a JSON schema object, got {type(schema).__name__}.")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {},
                                                         overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{what} is not a usable JSON schema: {e}.") from None
    return _validated(grammar, f"{what} is not a usable JSON schema")


def gbnf_grammar(text: Any, what: str = "grammar") -> str:
    """The llguidance grammar of a GBNF (llama.cpp's) or Lark grammar text, validated."""
    llg = _llg()
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} must be a non-empty GBNF grammar string (e.g. 'root ::= \"yes\" | \"no\"').")
    try:
        grammar = llg.grammar_from("grammar", text)
    except ValueError as e:
        raise ConfigError(f"{what} is not a valid GBNF grammar: {e}") from None
    return _validated(grammar, f"{what} is not a valid GBNF grammar")


def _validated(grammar: str, problem: str) -> str:
    err = _llg().LLMatcher.validate_grammar(grammar)
    if err:
        raise ConfigError(f"{problem}: {err.strip()}")
    return grammar


def response_format_grammar(rf: Any) -> str | None:
    """OpenAI's response_format: None for {"type": "text"}; json_object (any JSON object) and json_schema
    ({"json_schema": {"name", "schema", "strict"}}) give a grammar. Raises ConfigError naming what to fix."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp also takes a schema here
        return json_schema_grammar(rf.get("schema", {"type": "object"}), "response_format.schema")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConfigError("response_format {\"type\": \"json_schema\"} needs \"json_schema\": {\"name\": ..., "
                              "\"schema\": {...}, \"strict\": true}.")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise ConfigError(f"response_format type {json.dumps(kind)[:40]} is not supported: use \"text\", "
                      "\"json_object\" or \"json_schema\".")


def request_grammar(response_format: Any = None, grammar: Any = None, json_schema: Any = None) -> str | None:
    """The llguidance grammar of a request's constraint: OpenAI's response_format, llama.cpp's grammar
    (GBNF) or json_schema; None when unconstrained. More than one of them is refused."""
    given = [name for name, v in (("response_format", response_format if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text") else None),
        ("grammar", grammar), ("json_schema", json_schema)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both constrain the output: give only one of them.")
    if grammar is not None:
        return gbnf_grammar(grammar)
    if json_schema is not None:
        return json_schema_grammar(json_schema)
    return response_format_grammar(response_format)


def lark_grammar(lark: str, problem: str) -> str:
    """An llguidance grammar from Lark text (its `%json {schema}` rules take JSON_OPTIONS under
    "x-guidance" for the same compact JSON as response_format's), validated: a ConfigError names
    `problem` otherwise."""
    return _validated(_llg().LLMatcher.grammar_from_lark(lark), problem)


def llg_tokenizer(tokenizer, vocab_size: int):
    """The llguidance tokenizer of a GGUF tokenizer (its HF-tokenizers JSON), made once per tokenizer; the
    stop ids are its end tokens."""
    with _lock:
        lt = _tokenizers.get(tokenizer)
        if lt is None or lt.vocab_size != vocab_size:
            t0 = time.perf_counter()
            lt = _llg().LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.stop_ids))
            _tokenizers[tokenizer] = lt
            log.info("constrained decoding: llguidance tokenizer of %d tokens built in %.1f s", vocab_size,
                     time.perf_counter() - t0)
        return lt


class Constraint:
    """One request's grammar state: the mask of its next token, and the tokens it has taken."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        llg = _llg()
        self._matcher = llg.LLMatcher(llg_tokenizer(tokenizer, vocab_size), grammar, log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"the grammar cannot be used with this model's vocabulary: {self._matcher.get_error()}")
        self._stops = sorted(tokenizer.stop_ids)
        self._ahead: collections.deque[int] = collections.deque()  # forced tokens taken before they come back
        self._words = (vocab_size + 31) // 32
        self.mask_s = 0.0  # host seconds spent computing masks (telemetry)
        self.masks = 0

    @property
    def done(self) -> bool:
        """The grammar takes nothing more: the request ends here."""
        return self._matcher.is_stopped() and not self._ahead

    def mask(self) -> np.ndarray:
        """int32 [1, Vw]: the tokens allowed next (stop ids where the grammar may end)."""
        t0 = time.perf_counter()
        out = np.empty((1, self._words), np.int32)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._matcher.is_error():  # nothing can follow: let a stop id end the request
            out[:] = 0
        if self._matcher.is_error() or self._matcher.is_accepting():
            flat = out.view(np.uint32).reshape(-1)
            for t in self._stops:
                flat[t >> 5] |= np.uint32(1 << (t & 31))
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return out

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (llguidance's fast-forward), taken now: the device
        feeds them without sampling, and mask() is then the bitmask of the token after them."""
        ff = self._matcher.compute_ff_tokens()[:max(limit, 0)]
        if ff and self._matcher.consume_tokens(ff):
            self._ahead.extend(ff)
            return ff
        return []

    def take(self, token: int) -> None:
        """Advance past a sampled token (a stop id ends the request instead); forced ones are taken."""
        if self._ahead:
            want = self._ahead.popleft()
            if token != want:
                log.warning("constrained decoding: forced token %d came back as %d", want, token)
            return
        if token not in self._stops and not self._matcher.consume_token(token):
            log.warning("constrained decoding: token %d was refused by the grammar (%s)", token,
                        self._matcher.get_error())
