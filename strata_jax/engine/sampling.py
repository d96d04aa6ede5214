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

Constrained decoding: a per-row vocab bitmask (computed on the host by a grammar matcher) sets the
logits of disallowed tokens to -inf after the penalties, before the draw; an all-ones mask is a no-op.

Shape legend: strata_jax/core/shapes.py; the letter that differs here: N top logprobs (not tokens of a step).
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
                      frequency_penalty=None, repeat_penalty=None, repeat_last_n=None, names=None) -> None:
    """Reject values that would make sampling meaningless, saying what range is valid. names: what the
    errors call each value where not its keyword (the CLI's flags: {"top_p": "--top-p"})."""
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
            shown = f"{names[name]} {value!r}" if names and name in names else f"{name}={value!r}"
            raise ConfigError(f"{shown} is invalid: it must be {want}.")


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


def token_logprobs(logits_BV: jax.Array, tok_B: jax.Array) -> Logprobs:
    """The model's log-probabilities (raw logits: no penalties, temperature or filtering) of the sampled
    tokens and the most likely ones."""
    N = min(TOP_LOGPROBS, logits_BV.shape[-1])
    lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_BN, top_ids_BN = jax.lax.top_k(lp_BV, N)
    return Logprobs(jnp.take_along_axis(lp_BV, tok_B[:, None], axis=-1)[:, 0], top_ids_BN.astype(jnp.int32), top_BN)


def no_logprobs(B: int, V: int) -> Logprobs:
    N = min(TOP_LOGPROBS, V)
    return Logprobs(jnp.zeros((B,), jnp.float32), jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32))


class SamplingMode(NamedTuple):
    """Which sampling work a program does: the union over the rows it serves. Rows' parameters stay
    traced values (a greedy row in a sampling program is a select, not a branch); the mode only prunes
    work no row needs. Python bools decide when the program is traced, so no conditional sits in the
    device-side decode loop (one that XLA cannot capture keeps the loop out of a CUDA graph and copies
    its predicate to the host); traced bools (the prefill's first token) choose with a conditional, so
    one program serves every request."""

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

    def __or__(self, other: "SamplingMode") -> "SamplingMode":  # type: ignore[override]
        return SamplingMode(*(a or b for a, b in zip(self, other)))


GREEDY = SamplingMode(False, False, False)


def _choose(flag, on, off):
    """on() if flag else off(): at trace time for a Python bool, by a conditional for a traced one."""
    if isinstance(flag, (bool, np.bool_)):
        return on() if flag else off()
    return jax.lax.cond(flag, on, off)


ALL_ALLOWED = -1  # a bitmask word with every bit set (int32): no token of its 32 masked


def allowed_mask(V: int, batch: int = 1) -> np.ndarray:
    """int32 [batch, Vw]: a bitmask that allows every token (the unconstrained rows' mask)."""
    return np.full((batch, (V + 31) // 32), ALL_ALLOWED, np.int32)


def apply_mask(logits_BV: jax.Array, allowed_BVw: jax.Array) -> jax.Array:
    """Disallowed tokens' logits to -inf: bit t % 32 of word t // 32 of a row's bitmask allows token t."""
    V = logits_BV.shape[-1]
    t_V = jnp.arange(V)
    bits_BV = (allowed_BVw[:, t_V >> 5].astype(jnp.uint32) >> (t_V & 31).astype(jnp.uint32)) & 1
    return jnp.where(bits_BV.astype(bool), logits_BV, -jnp.inf)


def next_token(logits_BV: jax.Array, keys_B2: jax.Array, sp: SamplingParams, pen: PenaltyState, mode: SamplingMode,
               active_B: jax.Array | None = None,
               allowed_BVw: jax.Array | None = None) -> tuple[jax.Array, PenaltyState, Logprobs]:
    """One sampling step for every row: penalties, then each row drawn with its own key (uint32 [B, 2],
    already folded with the row's step), then the penalty state takes in the token (rows with active_B
    False keep theirs). allowed_BVw: each row's bitmask of allowed tokens (apply_mask), or None.
    Without mode.penalties the state is left as it is: no row served reads it (a
    row's penalties are on for its whole request, and then so is the mode of every call serving it).
    Returns (tokens int32 [B], new state, logprobs: zeros unless mode.logprobs)."""
    logits_BV = logits_BV.astype(jnp.float32)
    penalized_BV = _choose(mode.penalties, lambda: penalize(logits_BV, sp, pen), lambda: logits_BV)
    if allowed_BVw is not None:
        penalized_BV = apply_mask(penalized_BV, allowed_BVw)
    tok_B = sample(penalized_BV, keys_B2, sp, mode)
    lp = _choose(mode.logprobs, lambda: token_logprobs(logits_BV, tok_B), lambda: no_logprobs(*logits_BV.shape))
    return tok_B, _choose(mode.penalties, lambda: pen.push(tok_B, active_B), lambda: pen), lp


# -- drawing ---------------------------------------------------------------------------------------

def sample(logits_BV: jax.Array, keys_B2: jax.Array, sp: SamplingParams, mode: SamplingMode) -> jax.Array:
    """Each row drawn with its own key as a batch of one, so a seeded request gives the same tokens alone
    or batched with others; greedy rows (temperature <= 0) take the argmax."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def one(logits_V, key, sp_row):
        return _draw(logits_V[None], key, jax.tree.map(lambda a: a[None], sp_row))[0]

    return _choose(mode.sample, lambda: jnp.where(sp.temperature_B <= 0, greedy_B, jax.vmap(one)(logits_BV, keys_B2, sp)),
                   lambda: greedy_B)


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


# -- speculative acceptance -------------------------------------------------------------------------

def accept_drafts(logits_TV: jax.Array, drafts_T: jax.Array, n_drafts, key_2: jax.Array, step, left,
                  sp: SamplingParams, pen: PenaltyState, mode: SamplingMode):
    """Speculative sampling of one row with a deterministic drafter (q one-hot at each draft): position j's
    logits follow drafts d_1..d_j, and its token x_j is drawn exactly as next_token draws the row's
    (step + j)-th token (key folded with step + j, penalties having taken in x_0..x_{j-1}). d_{j+1} is
    accepted while x_j == d_{j+1}: it is accepted with probability p_j(d_{j+1}), and a rejection emits
    x_j, distributed as p_j with d_{j+1} removed and renormalized (the residual max(p - q, 0)), so the
    output keeps the target distribution; the token after the last accepted draft is the bonus. Greedy
    rows draw the argmax, which is plain greedy verification. drafts_T: int32 [T - 1] (padding past
    n_drafts); left: tokens the row may still emit (penalties take in only those). Returns (tokens int32
    [T], drafts accepted, new penalty state, logprobs stacked over T [T, 1, ...])."""
    T = logits_TV.shape[0]
    drafts_T = jnp.concatenate([drafts_T.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])  # none after the last

    def position(carry, x):
        pen, emitted = carry  # emitted: every draft before position j was accepted, so x_j is output
        j, logits_V, d = x
        key = jax.random.fold_in(key_2, step + j)
        tok_1, pen, lp = next_token(logits_V[None], key[None], sp, pen, mode, (emitted & (j < left))[None])
        accepted = emitted & (j < n_drafts) & (tok_1[0] == d)
        return (pen, accepted), (tok_1[0], accepted, lp)

    (pen, _), (tok_T, acc_T, lp) = jax.lax.scan(position, (pen, jnp.bool_(True)), (jnp.arange(T), logits_TV, drafts_T))
    return tok_T, jnp.sum(acc_T.astype(jnp.int32)), pen, lp
