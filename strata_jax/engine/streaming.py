"""What a generation streams: text chunks with the token ids (and logprobs) behind them, held back while
they may still become a stop string or are part of a UTF-8 character, and llama.cpp's timings.

`TextStream` is the text side of one request, fed one sampled token at a time:
a Session feeds one per row, so stop ids, stop strings, held-back text, logprob offsets and
max_tokens behave the same alone and batched.

Shape legend: strata_jax/core/shapes.py; the letter that differs here: N top logprobs.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits: see engine/sampling.py) and the
    most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob) of the top_logprobs most likely tokens, most likely first
    offset: int  # where the token's text starts in the generated text (characters)


def token_logprob(lp: Any, row: int, token_id: int, n_top: int, offset: int) -> TokenLogprob:
    """One row of a step's host-side Logprobs as a TokenLogprob with n_top alternatives."""
    ids, vals = lp.top_ids_BN[row, :n_top].tolist(), lp.top_BN[row, :n_top].tolist()
    return TokenLogprob(int(token_id), float(lp.token_B[row]), list(zip(ids, vals)), offset)


@dataclasses.dataclass
class GenerationChunk:
    """One streamed piece: new text and the token ids behind it. The last chunk carries finish_reason
    ("stop" or "length") and timings."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    timings: dict[str, float] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    stop_string: str | None = None  # on the last chunk: the stop string that ended it (Anthropic reports it)
    # prompt_logprobs: on a chunk of its own ahead of the first token's, every prompt token's after the first
    # (its offset is its text's start in the prompt's)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    timings: dict[str, float]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # generate(prompt_logprobs=True, logprobs=True)


@dataclasses.dataclass
class TextStream:
    """Sampled token ids in, chunks out. `decoder` is the tokenizer's stream decoder; `logprobs`: the
    chunks carry a TokenLogprob per token."""

    stops: list[str]
    max_tokens: int
    decoder: Any
    logprobs: bool = False
    text: str = ""  # all generated text
    emitted: int = 0  # how much of it has been streamed
    generated: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)  # ids whose text is still held back
    pending_lp: list[TokenLogprob] = dataclasses.field(default_factory=list)  # their logprobs
    stop_string: str | None = None  # the stop string that ended the request, once one has

    def push(self, tok: int, stop_ids, tok_lp: TokenLogprob | None = None) -> tuple[list[GenerationChunk], str | None]:
        """Take in a sampled token: the chunks to stream now, and the finish reason once the request is
        done ("stop": a stop id or string; "length": max_tokens reached). tok_lp: its logprobs (the offset
        is filled in here)."""
        if tok in stop_ids:
            return [], "stop"
        self.generated.append(tok)
        self.pending.append(tok)
        if tok_lp is not None:
            self.pending_lp.append(dataclasses.replace(tok_lp, offset=len(self.text)))
        self.text += self.decoder.push(tok)
        hit = _find_stop(self.text, self.stops, self.emitted)
        if hit is not None:
            self.text, self.stop_string = self.text[:hit[0]], hit[1]
            return [], "stop"
        out = []
        safe = len(self.text) - _stop_prefix_len(self.text[self.emitted:], self.stops)
        if safe > self.emitted:
            out.append(GenerationChunk(self.text[self.emitted:safe], self.pending, logprobs=self._lp()))
            self.emitted, self.pending, self.pending_lp = safe, [], []
        if len(self.generated) >= self.max_tokens:
            self.text += self.decoder.flush()
            return out, "length"
        return out, None

    def last(self, finish: str, timings: dict[str, float], prompt_token_ids: list[int]) -> GenerationChunk:
        """The final chunk: whatever text was held back, the finish reason and the timings."""
        return GenerationChunk(self.text[self.emitted:], self.pending, finish_reason=finish, timings=timings,
                               prompt_token_ids=prompt_token_ids, logprobs=self._lp(), stop_string=self.stop_string)

    def _lp(self) -> list[TokenLogprob] | None:
        return self.pending_lp if self.logprobs else None


def request_timings(n_prompt: int, n_cached: int, t_prefill: float, n_dec: int, t1: float, t_steady: float,
                    t_end: float, n_before_steady: int = 2) -> dict[str, float]:
    """A request's timings in llama.cpp's names: prompt_n counts the prompt tokens actually run, cache_n
    the reused ones; decode runs from t1 (after prefill) to t_end. decode_per_second is the steady state:
    the tokens after the first n_before_steady over the time from t_steady (Model: once the first decode
    call, which may compile, has been launched; only the prefill's token comes before)."""
    t_decode = t_end - t1
    return {
        "prompt_n": n_prompt,
        "prompt_ms": t_prefill * 1e3,
        "prompt_per_second": n_prompt / max(t_prefill, 1e-9),
        "cache_n": n_cached,
        "predicted_n": n_dec,
        "predicted_ms": t_decode * 1e3,
        "predicted_per_second": (n_dec - 1) / t_decode if n_dec > 1 and t_decode > 0 else 0.0,
        "decode_per_second": (n_dec - n_before_steady) / max(t_end - t_steady, 1e-9)
        if n_dec > n_before_steady else 0.0,
    }


def kv_cells(first: int, end: int, resident: int) -> tuple[int, int]:
    """(cache cells the tokens at positions first .. end - 1 attend to, how many of them lie below `resident`,
    on the device): a token at p reads positions 0 .. p (--kv-resident's VRAM hit rate)."""
    def total(n: int) -> int:  # sum of p + 1 for p < n
        return n * (n + 1) // 2

    def near(n: int) -> int:  # sum of min(p + 1, resident) for p < n
        m = min(n, resident)
        return total(m) + (n - m) * resident

    return total(end) - total(first), near(end) - near(first)


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """(where, which): the earliest stop string in text, searching from `start`, the yielded boundary
    (a stop string cannot begin in text already yielded, since we hold back possible beginnings)."""
    hits = [(i, s) for s, i in ((s, text.find(s, start)) for s in stops) if i >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None


def _stop_prefix_len(tail: str, stops: list[str]) -> int:
    """Length of the longest suffix of `tail` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(tail)), best, -1):
            if tail.endswith(s[:n]):
                best = n
                break
    return best
