"""Token sampling on the device, in llama.cpp's default order: repetition penalties first, then top-k,
top-p and min-p filter the temperature-1 distribution, then temperature scales what is left. Parameters
are traced arrays, so changing them per request compiles nothing; temperature <= 0 means greedy.

Penalties: OpenAI's presence and frequency penalties count the tokens generated so far in the request
(PenaltyState.counts_BV); llama.cpp's repeat_penalty covers the last repeat_last_n tokens of prompt and
output together (PenaltyState.recent_BW, a window of at most REPEAT_WINDOW). The state lives on the
device and is updated inside the jitted step with the sampled token, so nothing crosses to the host.
Zero penalties (repeat_penalty 1) leave the logits bit for bit as they were.

Logprobs are OpenAI's: log_softmax of the raw logits, the model's own distribution, before penalties,
temperature and filtering (llama.cpp's n_probs reports the sampling chain's output instead).

Shape legend: B batch, V vocab, W repeat window, N top logprobs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.core.errors import ConfigError

REPEAT_WINDOW = 256  # the longest repeat_last_n; llama.cpp's default is 64
TOP_LOGPROBS = 20  # alternatives computed per token (OpenAI's maximum); requests slice them on the host


@struct.dataclass
class SamplingParams:
    temperature_B: jax.Array
    top_p_B: jax.Array
    top_k_B: jax.Array  # <= 0: off
    min_p_B: jax.Array
    presence_B: jax.Array
    frequency_B: jax.Array
    repeat_B: jax.Array  # 1: off
    repeat_last_n_B: jax.Array  # int32, <= REPEAT_WINDOW

    @classmethod
    def make(cls, batch: int = 1, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, *, presence_penalty=0.0,
             frequency_penalty=0.0, repeat_penalty=1.0, repeat_last_n=64) -> "SamplingParams":
        validate_sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                          repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
        full = lambda v, dt: jnp.full((batch,), v, dt)  # noqa: E731
        f32, i32 = jnp.float32, jnp.int32
        return cls(full(temperature, f32), full(top_p, f32), full(top_k, i32), full(min_p, f32),
                   full(presence_penalty, f32), full(frequency_penalty, f32), full(repeat_penalty, f32),
                   full(repeat_last_n, i32))


def validate_sampling(*, temperature=None, top_p=None, top_k=None, min_p=None, presence_penalty=None,
                      frequency_penalty=None, repeat_penalty=None, repeat_last_n=None) -> None:
    """Reject values that would make sampling meaningless, saying what range is valid."""
    integer = lambda v: float(v).is_integer()  # noqa: E731
    checks = [
        ("temperature", temperature, lambda v: 0 <= v <= 100, "a number >= 0 (0 = greedy)"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", top_k, lambda v: integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
        ("min_p", min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("presence_penalty", presence_penalty, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 = off)"),
        ("frequency_penalty", frequency_penalty, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0 = off)"),
        ("repeat_penalty", repeat_penalty, lambda v: 0 < v <= 100, "a number in (0, 100] (1 = off)"),
        ("repeat_last_n", repeat_last_n, lambda v: integer(v) and 0 <= v <= REPEAT_WINDOW,
         f"an integer in [0, {REPEAT_WINDOW}] (0 = off)"),
    ]
    for name, value, ok, want in checks:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ConfigError(f"{name}={value!r} is invalid: it must be {want}.")


# -- penalties ----------------------------------------------------------------------------------------

@struct.dataclass
class PenaltyState:
    """What the penalties need to know of a request's tokens, one row per request."""

    counts_BV: jax.Array  # int32: how often each token was generated so far
    recent_BW: jax.Array  # int32: the last W tokens of prompt and output, oldest first; -1 where none yet

    @staticmethod
    def window(prompt_ids) -> np.ndarray:
        """int32 [1, W]: the prompt's last tokens as a request starts (the first sampled token sees them)."""
        out = np.full((1, REPEAT_WINDOW), -1, np.int32)
        tail = list(prompt_ids)[-REPEAT_WINDOW:]
        if tail:
            out[0, -len(tail):] = tail
        return out

    def push(self, tok_B: jax.Array, active_B: jax.Array | None = None) -> "PenaltyState":
        """Take in each row's sampled token (rows with active_B False keep their state)."""
        B = tok_B.shape[0]
        add = jnp.ones((B,), jnp.int32) if active_B is None else active_B.astype(jnp.int32)
        counts = self.counts_BV.at[jnp.arange(B), tok_B].add(add, mode="drop")
        recent = jnp.concatenate([self.recent_BW[:, 1:], tok_B[:, None].astype(jnp.int32)], axis=1)
        if active_B is not None:
            recent = jnp.where(active_B[:, None], recent, self.recent_BW)
        return PenaltyState(counts, recent)


def penalize(logits_BV: jax.Array, sp: SamplingParams, pen: PenaltyState) -> jax.Array:
    """llama.cpp's penalties sampler: repeat_penalty divides a positive logit (multiplies a negative one)
    of every token in the window, then logit -= frequency * count + presence * (count > 0). Rows whose
    penalties are off keep their logits untouched (a select, not arithmetic with zeros)."""
    B, V = logits_BV.shape
    W = pen.recent_BW.shape[-1]
    age_W = W - 1 - jnp.arange(W)
    in_window = (pen.recent_BW >= 0) & (age_W[None, :] < sp.repeat_last_n_B[:, None])
    ids_BW = jnp.where(in_window, pen.recent_BW, V)  # V is out of range: the scatter drops it
    seen_BV = jnp.zeros((B, V), jnp.int32).at[jnp.arange(B)[:, None], ids_BW].add(1, mode="drop") > 0
    rp = sp.repeat_B[:, None]
    repeated = jnp.where(logits_BV > 0, logits_BV / rp, logits_BV * rp)
    logits_BV = jnp.where(seen_BV & (rp != 1), repeated, logits_BV)
    counts_BV = pen.counts_BV
    freq, pres = sp.frequency_B[:, None], sp.presence_B[:, None]
    shifted = logits_BV - (freq * counts_BV.astype(jnp.float32) + pres * (counts_BV > 0))
    return jnp.where((counts_BV > 0) & ((freq != 0) | (pres != 0)), shifted, logits_BV)


# -- logprobs ----------------------------------------------------------------------------------------

@struct.dataclass
class Logprobs:
    token_B: jax.Array  # float32: the sampled token's log-probability
    top_ids_BN: jax.Array  # int32: the N most likely tokens, most likely first
    top_BN: jax.Array  # float32: their log-probabilities


def token_logprobs(logits_BV: jax.Array, tok_B: jax.Array, want: jax.Array | bool) -> Logprobs:
    """The model's log-probabilities (raw logits: no penalties, temperature or filtering) of the sampled
    tokens and the most likely ones. want traced: when no row asked, the branch that skips the
    vocabulary-wide softmax and top-k runs, and toggling it per request compiles nothing; a Python bool
    decides at trace time."""
    B, V = logits_BV.shape
    N = min(TOP_LOGPROBS, V)

    def compute() -> Logprobs:
        lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
        top_BN, top_ids_BN = jax.lax.top_k(lp_BV, N)
        return Logprobs(jnp.take_along_axis(lp_BV, tok_B[:, None], axis=-1)[:, 0], top_ids_BN.astype(jnp.int32),
                        top_BN)

    def skip() -> Logprobs:
        return Logprobs(jnp.zeros((B,), jnp.float32), jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32))

    if isinstance(want, bool):  # known when tracing (SamplingMode): no conditional in the program
        return compute() if want else skip()
    return jax.lax.cond(want, compute, skip)


class SamplingMode(NamedTuple):
    """Which sampling work a request needs, fixed when a program is traced instead of chosen by a
    conditional on the device. The device-side decode loop (model/decode.py) is compiled per mode: a
    conditional inside it could keep XLA from running the loop as one CUDA graph (a conditional whose
    branches cannot be captured is run from the host, with a device->host copy of its predicate)."""

    sample: bool  # some row has temperature > 0 (else greedy: argmax only, no vocabulary sort)
    penalties: bool  # some row has a presence, frequency or repeat penalty on
    logprobs: bool

    @classmethod
    def of(cls, sp_host: dict, logprobs: bool) -> "SamplingMode":
        """From a request's sampling arguments (the keywords of SamplingParams.make)."""
        return cls(sp_host["temperature"] > 0,
                   sp_host.get("presence_penalty", 0) != 0 or sp_host.get("frequency_penalty", 0) != 0
                   or (sp_host.get("repeat_penalty", 1) != 1 and sp_host.get("repeat_last_n", 64) > 0),
                   bool(logprobs))


def next_token(logits_BV: jax.Array, draw, sp: SamplingParams, pen: PenaltyState, want_logprobs: jax.Array,
               active_B: jax.Array | None = None, mode: SamplingMode | None = None,
               ) -> tuple[jax.Array, PenaltyState, Logprobs]:
    """One sampling step: penalties, then draw(logits) (sample or sample_rows with their keys), then the
    penalty state takes in the token. Returns (tokens int32 [B], new state, logprobs). With a mode the
    choices the conditionals make are made at trace time (want_logprobs and draw's greedy test are then
    ignored: draw should be built from the mode too, see sample)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if mode is not None:
        penalized_BV = penalize(logits_BV, sp, pen) if mode.penalties else logits_BV
        tok_B = draw(penalized_BV)
        return tok_B, pen.push(tok_B, active_B), token_logprobs(logits_BV, tok_B, mode.logprobs)
    on = jnp.any((sp.presence_B != 0) | (sp.frequency_B != 0) | ((sp.repeat_B != 1) & (sp.repeat_last_n_B > 0)))
    # with every row's penalties off the vocabulary-wide passes are skipped, not multiplied by zero
    penalized_BV = jax.lax.cond(on, lambda: penalize(logits_BV, sp, pen), lambda: logits_BV)
    tok_B = draw(penalized_BV)
    return tok_B, pen.push(tok_B, active_B), token_logprobs(logits_BV, tok_B, want_logprobs)


# -- drawing ---------------------------------------------------------------------------------------

def sample(logits_BV: jax.Array, key: jax.Array, sp: SamplingParams, mode: SamplingMode | None = None) -> jax.Array:
    """mode: decide greedy vs sampled at trace time (mode.sample False: every row greedy)."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if mode is not None:
        return jnp.where(sp.temperature_B <= 0, greedy_B, _draw(logits_BV, key, sp)) if mode.sample else greedy_B
    # sorting the vocabulary costs more than a small model's forward pass on CPU (~40 ms for 152k
    # entries): skip it when no row samples. Under vmap the branches become a select and both run.
    return jax.lax.cond(jnp.all(sp.temperature_B <= 0), lambda: greedy_B,
                        lambda: jnp.where(sp.temperature_B <= 0, greedy_B, _draw(logits_BV, key, sp)))


def _draw(logits_BV: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    V = logits_BV.shape[-1]
    order_BV = jnp.argsort(-logits_BV, axis=-1)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    rank = jnp.arange(V)[None, :]
    top_k = jnp.where(sp.top_k_B <= 0, V, sp.top_k_B)[:, None]
    keep = rank < top_k
    probs = jax.nn.softmax(jnp.where(keep, sorted_BV, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep = keep & ((jnp.cumsum(probs, axis=-1) - probs) < sp.top_p_B[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_BV, -jnp.inf), axis=-1)
    keep = keep & (probs >= sp.min_p_B[:, None] * probs[:, :1])

    temp = jnp.maximum(sp.temperature_B, 1e-6)[:, None]
    scaled = jnp.where(keep, sorted_BV / temp, -jnp.inf)
    choice_B = jax.random.categorical(key, scaled, axis=-1)
    return jnp.take_along_axis(order_BV, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, sp: SamplingParams) -> jax.Array:
    """Each row sampled with its own key (uint32 [B, 2]) exactly as sample() draws a batch of one, so a
    seeded request gives the same tokens alone or batched with others."""

    def one(logits_V, key, sp_row):
        return sample(logits_V[None], key, jax.tree.map(lambda a: a[None], sp_row))[0]

    greedy_B = jnp.argmax(logits_BV.astype(jnp.float32), axis=-1).astype(jnp.int32)
    return jax.lax.cond(jnp.all(sp.temperature_B <= 0), lambda: greedy_B,
                        lambda: jax.vmap(one)(logits_BV, keys_B, sp))
