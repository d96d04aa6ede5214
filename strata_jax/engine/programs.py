"""The engine's jitted programs over a session of B rows: `prefill` (one chunk of one row's prompt, then that
row's first token) and `decode` (up to n_max tokens for every live row, the loop on the device); for
speculative decoding `verify` (one row's drafts in one pass) and `mtp_draft` (its MTP block's drafts).

Why a loop on the device: a decode step of a 48-layer MoE is ~1,600 kernels; launched from the host one
step at a time, the launch costs as much as the step. `decode` runs a `while_loop` whose body is one
whole step (forward, sampling, per-row stop test); with XLA's WHILE/CONDITIONAL command buffers
(runtime.py) the loop is one CUDA graph and the host launches once per chunk. Sampling choices are
static (SamplingMode) so the body holds no conditional that could keep it out of the graph.

Every row carries its own state on the device (RowState): last token, position, step count, tokens
left, whether it is live, its PRNG key, sampling parameters and penalty state. A row stops on the device
when it samples a stop id or runs out of tokens; a row that is not live computes at an out-of-range
position (its cache writes are dropped) and keeps its state. Stop strings are text, found by the host,
which then marks the row dead in the next call's `alive_B` and drops what a queued call produced.

Constrained rows (a grammar: engine/constrained.py) need the host's next mask after every sampled
token, so a decode call given `constraint` (each row's forced tokens, the bitmask of its next sampled
token, and its step cap) runs such a row through the tokens the grammar forces (fed without sampling)
and one masked sampled step (cap = forced + 1), or not at all (cap 0: its last token is still on its
way to the host), while the other rows (no forced tokens, all-ones mask, cap n_max) keep the whole
chunk. A capped row stays live.

The expert provider (core/experts.py) travels split: its changing part (slot pools, cache state,
counters) is donated with the KV cache and the rows; its fixed part (the host store) is an argument of
its own, never donated. So does a streamed KV cache (--kv-resident): its host part is `kv_host`
(KVCache.split_host), which forward joins where attention reads and writes, and no program returns.

Shape legend: strata_jax/core/shapes.py (here N: the steps of a decode chunk, n_max).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.experts import join_provider, split_provider
from strata_jax.model import mtp
from strata_jax.model.forward import KVCache, forward
from strata_jax.model.hybrid import rewind
from strata_jax.model.runs import masked_put, masked_take
from strata_jax.engine.sampling import (Logprobs, PenaltyState, SamplingMode, SamplingParams, accept_drafts,
                                       next_token, no_logprobs, token_logprobs)

STEP_STATIC = ("cfg", "dtype", "kernels", "attn_len", "attn_block")  # both programs' static arguments
STEP_DONATE = ("kv", "experts", "rows")  # and their donated state, updated in place


@struct.dataclass
class RowState:
    """Every row's decode state, on the device (donated: updated in place)."""

    tok_B: jax.Array  # int32: the last sampled token, the next step's input
    pos_B: jax.Array  # int32: the cache position it goes to (in decode, the cache length once not live)
    step_B: jax.Array  # int32: tokens the row's request has generated (the PRNG fold-in index of the next)
    left_B: jax.Array  # int32: tokens it may still generate
    live_B: jax.Array  # bool: decoding (no stop id sampled, tokens left)
    key_B2: jax.Array  # uint32: the request's PRNG key
    sp: SamplingParams
    pen: PenaltyState

    @classmethod
    def zeros(cls, B: int, V: int, W: int) -> "RowState":
        i32 = functools.partial(jnp.zeros, (B,), jnp.int32)
        sp = jax.tree.map(lambda a: jnp.broadcast_to(a, (B,)), SamplingParams.make(1))  # defaults: penalties off
        return cls(i32(), i32(), i32(), i32(), jnp.zeros((B,), bool), jnp.zeros((B, 2), jnp.uint32), sp,
                   PenaltyState(jnp.zeros((B, V), jnp.int32), jnp.full((B, W), -1, jnp.int32)))


@struct.dataclass
class RowStart:
    """What a new request brings to its row (batch 1, built on the host)."""

    key_2: jax.Array  # uint32: its PRNG key
    sp: SamplingParams  # its sampling parameters, batch 1
    recent_1W: jax.Array  # int32: the prompt's tail, for the repeat penalty
    max_tokens: jax.Array  # int32: tokens to generate at most, the first included (0: prefill only)
    mode_3: jax.Array  # bool: its SamplingMode (sample, penalties, logprobs), chosen by conditionals here
    allowed_1Vw: jax.Array  # int32: the bitmask of tokens its first token may be (all ones: unconstrained)


@struct.dataclass
class PrefillOut:
    logits: jax.Array  # float32 [1, T, V] with all_logits, else [1, V]: the chunk's last valid token
    tok_1: jax.Array  # int32: the first token, sampled from the last logits
    logprobs: Logprobs  # its logprobs (zeros unless mode.logprobs)
    mtp_logits: jax.Array | None = None  # with all_logits and an MTP state: the MTP block's, [1, T, V]


@struct.dataclass
class ChunkOut:
    tokens_NB: jax.Array  # int32: each step's sampled token per row; row b's first n_B[b] are valid
    n_B: jax.Array  # int32: tokens each row produced in this call
    routed_NMBk: jax.Array  # int32: each step's routed experts per MoE layer and row
    logprobs: Logprobs | None  # fields stacked over N (mode.logprobs), else None


def stop_array(stop_ids) -> jax.Array:
    """int32 [I]: the stop ids padded with -1 to a power of two (>= 4), so their count rarely recompiles."""
    ids = sorted(int(t) for t in stop_ids)
    n = max(4, 1 << max(len(ids) - 1, 0).bit_length())
    return jnp.asarray(ids + [-1] * (n - len(ids)), jnp.int32)


def _is_stop(tok_B, stop_St):
    return jnp.any(tok_B[:, None] == stop_St[None, :], axis=1)


def _set_row(tree, row, value, axis: int = 0):
    """Write a batch-1 pytree into row `row` of a batch-B pytree of the same structure (batch on `axis`)."""
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v.astype(a.dtype), row, axis=axis),
                        tree, value)


def _row_forward(params, experts, fixed, kv: KVCache, rows: RowState, row, tokens_1T, start_1, n_valid_1, *, cfg,
                 dtype, kernels, all_logits, attn_len, attn_block, forced, tape=False, kv_host=None):
    """forward on row `row` alone (prefill's and verify's shared part). Returns (logits, kv, experts' donated
    part, routed, h): h is the hidden state after the output norm at every position when the cache keeps
    an MTP state (for mtp.process), else None; with `tape` (forward's) also the row's recurrent state
    before the pass and the tape."""
    B = rows.tok_B.shape[0]
    # the row is sliced out of the donated cache, run at batch 1 and written back in place
    row_kv = kv if B == 1 else kv.take_row(row)
    before = row_kv.rec
    hidden = kv.mtp is not None
    out = forward(params, join_provider(experts, fixed), row_kv.join_host(kv_host), tokens_1T, start_1, n_valid_1,
                  cfg=cfg, dtype=dtype,
                  kernels=kernels, all_logits=all_logits, attn_len=attn_len, attn_block=attn_block, forced_MNk=forced,
                  tape=tape, hidden=hidden)
    logits, row_kv, experts, routed = out[:4]
    kv = row_kv if B == 1 else kv.put_row(row, row_kv)
    h = out[-1] if hidden else None
    if tape:
        return logits, kv, split_provider(experts)[0], routed, h, (before, out[4])
    return logits, kv, split_provider(experts)[0], routed, h


def _mtp_of_row(kv: KVCache, row):
    """Row `row` of the cache's MTP state (its leaves have the batch on axis 1), and what puts one back."""
    B = kv.mtp.h_1BD.shape[1]
    take = lambda a: a if B == 1 else jax.lax.dynamic_slice_in_dim(a, row, 1, axis=1)  # noqa: E731
    return jax.tree.map(take, kv.mtp), lambda st: kv.replace(mtp=st if B == 1 else _set_row(kv.mtp, row, st, axis=1))


def _mtp_row(params, kv: KVCache, row, tokens_1T, h_1TD, start_1, n_valid_1, keep_1, *, cfg, dtype, kernels,
             attn_len, attn_block, all_logits=False):
    """mtp.process on row `row` of the cache's MTP state (a no-op without one). Returns (kv, its logits or None)."""
    if kv.mtp is None:
        return kv, None
    st, put = _mtp_of_row(kv, row)
    logits, st = mtp.process(params, st, tokens_1T, h_1TD, start_1, n_valid_1, keep_1, cfg=cfg, dtype=dtype,
                             kernels=kernels, attn_len=attn_len, attn_block=attn_block, all_logits=all_logits)
    return put(st), logits


@functools.partial(jax.jit, static_argnames=STEP_STATIC + ("n",), donate_argnames=("kv",))
def mtp_draft(params, kv: KVCache, rows: RowState, row, *, cfg, dtype, kernels, attn_len, n: int, attn_block=None):
    """n greedy MTP drafts [n] for row `row` after its last token (model/mtp.py draft); returns (drafts, kv)."""
    st, put = _mtp_of_row(kv, row)
    one = lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1)  # noqa: E731
    drafts_1N, st = mtp.draft(params, st, one(rows.tok_B), one(rows.pos_B), n, cfg=cfg, dtype=dtype, kernels=kernels,
                              attn_len=attn_len, attn_block=attn_block)
    return drafts_1N[0], put(st)


@functools.partial(jax.jit, donate_argnames=("kv",))
def copy_row(kv: KVCache, src, dst) -> KVCache:
    """The cache with row dst a copy of row src (in place: kv is donated)."""
    return kv.put_row(dst, kv.take_row(src))


def prefill(params, experts, fixed, kv: KVCache, rows: RowState, row, tokens_1T, start_1, n_valid_1, req: RowStart,
            stop_St, *, cfg, dtype, kernels, attn_len, all_logits: bool, attn_block=None,
            forced=None, kv_host=None):
    """One prefill chunk of row `row` (its tokens at cache positions start_1..), then the row's first token
    sampled from the chunk's last logits and the row's state set from `req`. A prompt of several chunks
    runs this once per chunk; the last chunk's state is the one that counts. forced: int32 [M, T, k]
    routed experts to replay (see forward). Returns (PrefillOut, kv, experts, routed [M, T, k], rows)."""
    logits, kv, experts, routed, h = _row_forward(params, experts, fixed, kv, rows, row, tokens_1T, start_1, n_valid_1,
                                                  cfg=cfg, dtype=dtype, kernels=kernels, all_logits=all_logits,
                                                  attn_len=attn_len, attn_block=attn_block, forced=forced,
                                                  kv_host=kv_host)
    kv, mtp_logits = _mtp_row(params, kv, row, tokens_1T, h, start_1, n_valid_1, n_valid_1 - 1, cfg=cfg, dtype=dtype,
                              kernels=kernels, attn_len=attn_len, attn_block=attn_block, all_logits=all_logits)
    last_1V = logits[:, n_valid_1[0] - 1] if all_logits else logits
    pen = PenaltyState(jnp.zeros(last_1V.shape, jnp.int32), req.recent_1W)
    mode = SamplingMode(*(req.mode_3[i] for i in range(3)))  # traced: one program for every request
    tok_1, pen, lp = next_token(last_1V, jax.random.fold_in(req.key_2, 0)[None], req.sp, pen, mode,
                                allowed_BVw=req.allowed_1Vw)
    left_1 = req.max_tokens.reshape(1) - 1
    state = RowState(tok_1, start_1 + n_valid_1, jnp.ones((1,), jnp.int32), left_1,
                     ~_is_stop(tok_1, stop_St) & (left_1 > 0), req.key_2[None], req.sp, pen)
    rows = _set_row(rows, row, state)
    return PrefillOut(logits, tok_1, lp, mtp_logits), kv, experts, routed, rows


_prefill = prefill


@functools.cache
def prefill_program(xla_options: tuple[tuple[str, object], ...] = ()):
    """`prefill` jitted with XLA debug options of its own (engine/config.py xla_options_from_env("prefill"))."""
    return jax.jit(_prefill, static_argnames=STEP_STATIC + ("all_logits",), donate_argnames=STEP_DONATE,
                   compiler_options=dict(xla_options) or None)


prefill = prefill_program(())  # the key a session without options asks for


def decode(params, experts, fixed, kv: KVCache, rows: RowState, alive_B, stop_St, limit, *, cfg, dtype, kernels,
           attn_len, mode: SamplingMode, n_max: int, attn_block=None, forced=None, constraint=None, kv_host=None):
    """Up to min(limit, n_max) decode steps for every row that is live and alive_B (the host's view: a
    released row or one that hit a stop string is not); the loop ends early once no row is live. n_max 1
    is one plain step with neither loop nor conditional. forced (int32 [N, M, B, k]): step i replays
    forced[i] as the routed experts. constraint (allowed_BVw int32 bitmasks, cap_B int32, ff_BN int32
    forced tokens, n_ff_B int32 how many): step i gives a row its forced token while i < n_ff_B, masks
    its logits with its bitmask at i == n_ff_B, and runs only the rows with i < cap_B (see the module
    docstring). Returns (ChunkOut, kv, experts, routed, rows), the order of prefill's
    outputs (routed is in the ChunkOut; its place holds None)."""
    B = rows.tok_B.shape[0]
    M, K = len(cfg.moe_layers), max(cfg.n_experts_used, 1)
    ctx = kv.length
    live0 = rows.live_B & alive_B
    # a row that is not live runs at position ctx, past the cache: its writes are dropped. Its position is
    # carried that way rather than masked in the step, where XLA recomputes the mask in every layer
    rows = dataclasses.replace(rows, live_B=live0, pos_B=jnp.where(live0, rows.pos_B, ctx))

    def step(carry):
        i, r, kv, experts, out = carry
        live, pos_B = r.live_B, r.pos_B
        allowed = None
        if constraint is not None:  # a capped row computes past the cache, as a row that is not live
            allowed_BVw, cap_B, ff_BN, n_ff_B = constraint
            live = live & (i < cap_B)
            pos_B = jnp.where(live, pos_B, ctx)
            allowed = jnp.where((i == n_ff_B)[:, None], allowed_BVw, -1)
        # a row that is not live has, with recurrent layers, no valid token: its state stays as it is
        n_valid_B = live.astype(jnp.int32) if cfg.has_recurrent_state else jnp.ones_like(pos_B)
        logits_BV, kv, experts, routed_MBk, *h = forward(
            params, join_provider(experts, fixed), kv.join_host(kv_host), r.tok_B[:, None], pos_B, n_valid_B, cfg=cfg,
            dtype=dtype, kernels=kernels, attn_len=attn_len, attn_block=attn_block,
            forced_MNk=None if forced is None else masked_take(forced, i), hidden=kv.mtp is not None)
        experts = split_provider(experts)[0]  # the loop carries only the donated part
        if kv.mtp is not None:  # the MTP block's cache follows every token (a row that is not live keeps its state)
            kv = kv.replace(mtp=mtp.process(params, kv.mtp, r.tok_B[:, None], h[0], pos_B, live.astype(jnp.int32),
                                            jnp.zeros_like(pos_B), cfg=cfg, dtype=dtype, kernels=kernels,
                                            attn_len=attn_len, attn_block=attn_block)[1])
        keys_B2 = jax.vmap(jax.random.fold_in)(r.key_B2, r.step_B)
        tok_B, pen, lp = next_token(logits_BV, keys_B2, r.sp, r.pen, mode, live, allowed)
        if constraint is not None:  # a forced token replaces the draw; penalties and logprobs take it instead
            ff_B = masked_take(ff_BN.T, i)
            tok_B = jnp.where(i < n_ff_B, ff_B, tok_B)
            pen = r.pen.push(tok_B, live) if mode.penalties else pen
            lp = token_logprobs(logits_BV, tok_B) if mode.logprobs else lp
        tok_B = jnp.where(live, tok_B, r.tok_B)
        inc = live.astype(jnp.int32)
        left = r.left_B - inc
        live_next = live & ~_is_stop(tok_B, stop_St) & (left > 0)
        pos_next = jnp.where(live_next, r.pos_B + inc, ctx)
        if constraint is not None:  # a row past its cap keeps its state for the next call
            held = r.live_B & ~live
            live_next, pos_next = live_next | held, jnp.where(held, r.pos_B, pos_next)
        r = RowState(tok_B, pos_next, r.step_B + inc, left, live_next, r.key_B2, r.sp, pen)
        put = lambda a, v: masked_put(a, i, v)  # noqa: E731 - step i's row of each output stack
        out = ChunkOut(put(out.tokens_NB, tok_B), out.n_B + inc, put(out.routed_NMBk, routed_MBk),
                       None if out.logprobs is None else jax.tree.map(put, out.logprobs, lp))
        return i + 1, r, kv, experts, out

    lp0 = jax.tree.map(lambda a: jnp.zeros((n_max, *a.shape), a.dtype), no_logprobs(B, cfg.vocab_size)) \
        if mode.logprobs else None
    out0 = ChunkOut(jnp.zeros((n_max, B), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((n_max, M, B, K), jnp.int32),
                    lp0)
    carry = (jnp.int32(0), rows, kv, experts, out0)
    if n_max == 1:  # a plain step: no loop, and no conditional to skip it (see the module docstring)
        carry = step(carry)
    else:
        running = (lambda c: c[1].live_B) if constraint is None else (lambda c: c[1].live_B & (c[0] < constraint[1]))
        carry = jax.lax.while_loop(lambda c: (c[0] < limit) & jnp.any(running(c)), step, carry)
    _, rows, kv, experts, out = carry
    return out, kv, experts, None, rows


_decode = decode


@functools.cache
def decode_program(xla_options: tuple[tuple[str, object], ...] = ()):
    """`decode` jitted with XLA debug options of its own (engine/config.py xla_options_from_env): a setting
    such as unrolling the layer scan inside the CUDA graph can suit this program and break prefill's."""
    return jax.jit(_decode, static_argnames=STEP_STATIC + ("mode", "n_max"), donate_argnames=STEP_DONATE,
                   compiler_options=dict(xla_options) or None)


decode = decode_program(())


@struct.dataclass
class VerifyOut:
    tokens_T: jax.Array  # int32: the token drawn after each position of [last, d1..dk]: accepted drafts, then the bonus
    n_emit: jax.Array  # int32 scalar: tokens the pass produced (accepted drafts + the bonus, capped by tokens left)
    n_acc: jax.Array  # int32 scalar: drafts accepted (n_emit may cut them shorter)
    logprobs: Logprobs | None  # fields [T, 1, ...] (mode.logprobs), else None
    next_drafts: jax.Array | None = None  # with draft_next: the MTP block's drafts after the pass's last token


@functools.partial(jax.jit, static_argnames=STEP_STATIC + ("mode", "draft_next"), donate_argnames=STEP_DONATE)
def verify(params, experts, fixed, kv: KVCache, rows: RowState, row, tokens_1T, n_valid_1, stop_St, *, cfg, dtype,
           kernels, attn_len, mode: SamplingMode, attn_block=None, forced=None, accept_n=None, draft_next: int = 0,
           kv_host=None):
    """A speculative pass of row `row`: tokens_1T = [its last token, drafts d1..dk, padding] (k + 1 =
    n_valid_1) at the row's position, all logits; sampling.accept_drafts draws the token after each
    position as decode would (the argmax for a greedy row) and accepts the longest prefix of drafts equal
    to those draws, plus the token drawn after it, so the output keeps the distribution of plain decode
    (greedy: its very tokens). The row's state moves to the accepted position: the cache entries written
    for rejected drafts lie past it, where attention never reads (it masks by position) and the next
    steps overwrite them. A model's recurrent state (DeltaNet, QSA, PLE) cannot be left past the position:
    the pass tapes what its recurrent parts wrote and hybrid.rewind stops them after the accepted tokens.
    No constrained rows (their mask needs the host). draft_next (static; an MTP state in the cache): also
    draft that many tokens after the pass's last one with the MTP block (as mtp_draft would, one call less
    per pass; attn_len must reach draft_next positions further). accept_n (int32, benchmarks only: bench/spec.py):
    accept exactly this many drafts whatever the draws, their tokens emitted as drafted, so a pass's cost
    can be timed at a chosen acceptance on random weights. Returns (VerifyOut, kv, experts, routed [M, T, k],
    rows)."""
    T = tokens_1T.shape[1]
    start_1 = jax.lax.dynamic_slice_in_dim(rows.pos_B, row, 1)
    tape = cfg.has_recurrent_state
    logits_1TV, kv, experts, routed, h, *taped = _row_forward(
        params, experts, fixed, kv, rows, row, tokens_1T, start_1, n_valid_1, cfg=cfg, dtype=dtype, kernels=kernels,
        all_logits=True, attn_len=attn_len, attn_block=attn_block, forced=forced, tape=tape, kv_host=kv_host)
    r = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1), rows)
    left = r.left_B[0]
    tokens_T, n_acc, pen, lp = accept_drafts(logits_1TV[0], tokens_1T[0, 1:], n_valid_1[0] - 1, r.key_B2[0],
                                             r.step_B[0], left, r.sp, r.pen, mode)
    if accept_n is not None:
        n_acc = jnp.minimum(accept_n, n_valid_1[0] - 1)
        tokens_T = jnp.where(jnp.arange(T) < n_acc, jnp.concatenate([tokens_1T[0, 1:], tokens_T[-1:]]), tokens_T)
    n_emit = jnp.minimum(n_acc + 1, left)
    # the MTP block's cache over the pass; the hidden state kept is the last emitted token's input's
    kv, _ = _mtp_row(params, kv, row, tokens_1T, h, start_1, n_valid_1, jnp.maximum(n_emit - 1, 0).reshape(1),
                     cfg=cfg, dtype=dtype, kernels=kernels, attn_len=attn_len, attn_block=attn_block)
    if tape:  # the row's recurrent state after its last token and the accepted drafts only
        before, taped = taped[0]
        after = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, row, 1, axis=1), kv.rec)
        # a pass that kept every token it fed (all drafts accepted) is already there: its own state, as computed
        rec = jax.lax.cond(n_emit < n_valid_1[0],
                           lambda: rewind(cfg, before, after, taped, tokens_1T, start_1, n_emit.reshape(1)),
                           lambda: after)
        kv = kv.replace(rec=_set_row(kv.rec, row, rec, axis=1))  # rec's leaves are [L, B, ...]
    stopped = jnp.any(jnp.isin(tokens_T, stop_St) & (jnp.arange(T) < n_emit))
    one = lambda a: a.reshape(1)  # noqa: E731
    state = dataclasses.replace(
        r, tok_B=one(tokens_T[jnp.maximum(n_emit - 1, 0)]), pos_B=start_1 + n_emit, step_B=r.step_B + n_emit,
        left_B=r.left_B - n_emit, live_B=r.live_B & ~stopped & (left - n_emit > 0), pen=pen)
    rows = _set_row(rows, row, state)
    nxt = None
    if draft_next and kv.mtp is not None:
        st, put = _mtp_of_row(kv, row)
        nxt, st = mtp.draft(params, st, state.tok_B, state.pos_B, draft_next, cfg=cfg, dtype=dtype, kernels=kernels,
                            attn_len=attn_len, attn_block=attn_block)
        kv, nxt = put(st), nxt[0]
    return (VerifyOut(tokens_T, n_emit, n_acc, lp if mode.logprobs else None, nxt), kv, experts, routed, rows)
