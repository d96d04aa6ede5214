"""Gated DeltaNet linear attention: qwen4exp's `linear_attention` layers (Qwen3.5 / Qwen3-Next's GDN).

Per row, token t and value head h (everything after the input projections in float32):
  c_t  = silu(causal depthwise conv over the last Kc inputs of x W_qkv)  ->  q, k (Hk heads), v (Hv heads)
  q, k = l2norm(q), l2norm(k) of key head h % Hk; q scaled by Dk^-1/2
  b    = sigmoid(x W_beta);   g = ssm_a * softplus(x W_alpha + ssm_dt)   (log decay, <= 0)
  S    = exp(g) S;   S += k (b (v - S^T k))^T;   o = S^T q                (S: [Dk, Dv] per head)
  y    = W_out (rms_norm(o) * ssm_norm * act(x W_gate))                   (act: sigmoid or silu)

Tensors are taken exactly as llama.cpp's converter writes them (conversion/qwen.py: Qwen3NextModel and
_LinearAttentionVReorderBase.modify_tensors): ssm_a = -exp(A_log), ssm_dt.bias = dt_bias, ssm_conv1d
squeezed to [Cc, Kc], ssm_norm as is (no "+1": that rule skips linear_attn.norm). Where Hv > Hk the value
heads are reordered from HF's grouped order (head j*R + r reads key head j) to the tiled order ggml
broadcasts (head r*Hk + j reads key head j) in attn_qkv's v rows, attn_gate, ssm_beta, ssm_alpha,
ssm_a, ssm_dt, ssm_conv1d's v channels and ssm_out's columns; so here a key head serves value heads
h % Hk == j (a tile, not HF's repeat_interleave), and the state's value heads are in that order too.

Two forms of the recurrence, equal up to float rounding: T > 1 (prefill) runs the chunked parallel form
(chunks of `chunk_size` tokens, the sequence padded inside to a whole number of chunks: the WY/UT form
of transformers' torch_chunk_gated_delta_rule); T == 1 (decode) runs one recurrent step.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.qtensor import QTensor
from strata_jax.model.dims import DeltaNetDims
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import linear, rms_norm

_HIGHEST = jax.lax.Precision.HIGHEST  # the recurrence accumulates over the sequence: no TF32 products


@struct.dataclass
class DeltaNetParams:
    """One layer's tensors, named after their GGUF names (`blk.{i}.<field>`), in the GGUF's layout."""

    attn_qkv: QTensor  # [Cc, D]: q (Hk*Dk), k (Hk*Dk), v (Hv*Dv, tiled head order) rows
    attn_gate: QTensor  # [Hv*Dv, D]: z, the output gate
    ssm_beta: QTensor  # [Hv, D]
    ssm_alpha: QTensor  # [Hv, D]
    ssm_conv1d_CcKc: jax.Array  # float32; tap Kc-1 multiplies the current token
    ssm_dt_Hv: jax.Array  # float32, the tensor `ssm_dt.bias` (HF dt_bias)
    ssm_a_Hv: jax.Array  # float32, -exp(A_log)
    ssm_norm_Dv: jax.Array  # float32, shared by every value head
    ssm_out: QTensor  # [D, Hv*Dv]


def load_params(qtensor: Callable[[str, tuple[int, ...]], QTensor],
                f32: Callable[[str, tuple[int, ...]], jax.Array], layer: int, dims: DeltaNetDims) -> DeltaNetParams:
    """The layer's params through a loader's shape-checked getters: `qtensor(name, shape)` for matrices
    (kept in their GGML blocks) and `f32(name, shape)` for small tensors, i.e. model/weights.py's
    WeightLoader.qtensor and WeightLoader.f32. Shapes are numpy order (GGUF ne reversed)."""
    p, d = f"blk.{layer}.", dims
    return DeltaNetParams(
        attn_qkv=qtensor(p + "attn_qkv.weight", (d.conv_channels, d.d_model)),
        attn_gate=qtensor(p + "attn_gate.weight", (d.value_dim, d.d_model)),
        ssm_beta=qtensor(p + "ssm_beta.weight", (d.n_v_heads, d.d_model)),
        ssm_alpha=qtensor(p + "ssm_alpha.weight", (d.n_v_heads, d.d_model)),
        ssm_conv1d_CcKc=f32(p + "ssm_conv1d.weight", (d.conv_channels, d.conv_kernel)),
        ssm_dt_Hv=f32(p + "ssm_dt.bias", (d.n_v_heads,)),
        ssm_a_Hv=f32(p + "ssm_a", (d.n_v_heads,)),  # no ".weight": the converter maps the bare A_log
        ssm_norm_Dv=f32(p + "ssm_norm.weight", (d.v_head_dim,)),
        ssm_out=qtensor(p + "ssm_out.weight", (d.d_model, d.value_dim)),
    )


@struct.dataclass
class DeltaNetState:
    """One layer's recurrent state per row, fixed shape, float32. A row that starts a new sequence must
    be zeroed by the caller first (`zeros`, `reset_rows`): `apply` always continues from what it gets."""

    conv_BKcCc: jax.Array  # the last Kc-1 inputs of the short conv (x W_qkv before the conv), oldest first
    ssm_BHvDkDv: jax.Array  # the delta-rule state S, value heads in the GGUF's order (dims.v_head_order)

    @classmethod
    def zeros(cls, B: int, dims: DeltaNetDims) -> "DeltaNetState":
        return cls(jnp.zeros((B, dims.conv_kernel - 1, dims.conv_channels), jnp.float32),
                   jnp.zeros((B, dims.n_v_heads, dims.k_head_dim, dims.v_head_dim), jnp.float32))


def reset_rows(state: DeltaNetState, fresh_B: jax.Array) -> DeltaNetState:
    """Zero the rows where fresh_B is true (a row whose sequence restarts), keep the others."""
    return jax.tree.map(lambda a: jnp.where(fresh_B.reshape((-1,) + (1,) * (a.ndim - 1)), 0.0, a), state)


@struct.dataclass
class DeltaNetTape:
    """What a pass of T tokens wrote into one layer's state, enough to stop it after any prefix of them
    (`rewind`: a speculative pass whose later drafts were rejected), float32. The delta rule is linear in S:
    S_n = exp(c_n) S_0 + sum_{t < n} exp(c_n - c_t) k_t delta_t^T, with delta_t the token's write."""

    qkv_BTCc: jax.Array  # the short conv's inputs (x W_qkv)
    k_BTHvDk: jax.Array  # the l2-normed keys, per value head
    delta_BTHvDv: jax.Array  # each token's write: b (v - (exp(g) S)^T k)
    decay_BTHv: jax.Array  # c_t: log decay from the pass's start through token t (cumsum of g)

    @classmethod
    def zeros(cls, B: int, T: int, dims: DeltaNetDims) -> "DeltaNetTape":
        z = lambda *s: jnp.zeros((B, T, *s), jnp.float32)  # noqa: E731
        return cls(z(dims.conv_channels), z(dims.n_v_heads, dims.k_head_dim), z(dims.n_v_heads, dims.v_head_dim),
                   z(dims.n_v_heads))


def rewind(before: DeltaNetState, tape: DeltaNetTape, n_B: jax.Array) -> DeltaNetState:
    """The state after only the first n_B of the taped pass's tokens, from the state before the pass: the
    closed form of DeltaNetTape, no weights read (equal to `apply` on those tokens up to float rounding)."""
    B, T = tape.decay_BTHv.shape[:2]
    n_B = jnp.clip(n_B.astype(jnp.int32), 0, T)
    c_BTHv = jnp.concatenate([jnp.zeros_like(tape.decay_BTHv[:, :1]), tape.decay_BTHv], axis=1)  # c_0 = 0
    c_BHv = jnp.take_along_axis(c_BTHv, n_B[:, None, None], axis=1)[:, 0]
    kept_BT1 = (jnp.arange(T)[None, :] < n_B[:, None])[..., None]
    # masked before exp: a token past n has c_t < c_n, whose difference could overflow
    w_BTHv = jnp.where(kept_BT1, jnp.exp(jnp.where(kept_BT1, c_BHv[:, None] - tape.decay_BTHv, 0.0)), 0.0)
    S = (before.ssm_BHvDkDv * jnp.exp(c_BHv)[:, :, None, None]
         + jnp.einsum("bth,bthk,bthv->bhkv", w_BTHv, tape.k_BTHvDk, tape.delta_BTHvDv, precision=_HIGHEST))
    Kc1 = before.conv_BKcCc.shape[1]
    xin = jnp.concatenate([before.conv_BKcCc, tape.qkv_BTCc], axis=1)  # [B, Kc-1+T, Cc]
    conv = jnp.take_along_axis(xin, (n_B[:, None] + jnp.arange(Kc1)[None, :])[:, :, None], axis=1)
    return DeltaNetState(conv, S)


def _short_conv(x_BTCc: jax.Array, conv_BKcCc: jax.Array, w_CcKc: jax.Array,
                n_valid_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv of the state's Kc-1 inputs followed by x (no activation), and the new state:
    the last Kc-1 inputs up to each row's last valid token (the old state's tail where n_valid < Kc-1)."""
    T, Kc = x_BTCc.shape[1], w_CcKc.shape[1]
    xin = jnp.concatenate([conv_BKcCc, x_BTCc], axis=1)  # [B, Kc-1+T, Cc]
    y = sum(xin[:, j:j + T] * w_CcKc[:, j] for j in range(Kc))
    idx_BKc = n_valid_B[:, None] + jnp.arange(Kc - 1)[None, :]
    return y, jnp.take_along_axis(xin, idx_BKc[:, :, None], axis=1)


def _l2norm(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _step(q_BHvDk, k_BHvDk, v_BHvDv, g_BHv, b_BHv, S_BHvDkDv):
    """One token of the gated delta rule (the recurrent form)."""
    S = S_BHvDkDv * jnp.exp(g_BHv)[:, :, None, None]
    pred_BHvDv = jnp.einsum("bhk,bhkv->bhv", k_BHvDk, S, precision=_HIGHEST)
    delta_BHvDv = (v_BHvDv - pred_BHvDv) * b_BHv[:, :, None]
    S = S + k_BHvDk[:, :, :, None] * delta_BHvDv[:, :, None, :]
    return jnp.einsum("bhk,bhkv->bhv", q_BHvDk, S, precision=_HIGHEST), S, delta_BHvDv


def _chunked(q_BTHvDk, k_BTHvDk, v_BTHvDv, g_BTHv, b_BTHv, S_BHvDkDv, chunk: int):
    """The gated delta rule over T tokens, C at a time (outputs, final state, each token's write): within a
    chunk the C rank-one updates collapse (UT transform) into a unit lower-triangular solve; a scan carries S from chunk to chunk. The pad at
    the end has b = g = 0 and k = v = 0: it neither decays nor writes S."""
    B, T, Hv, _ = q_BTHvDk.shape
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T

    def chunks(a):  # [B, T, Hv, ...] -> [n, B, Hv, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, n, C, *a.shape[2:]), (1, 2), (0, 3))

    q, k, v, g, b = (chunks(a) for a in (q_BTHvDk, k_BTHvDk, v_BTHvDv, g_BTHv, b_BTHv))
    cum = jnp.cumsum(g, axis=-1)  # [n, B, Hv, C]: log decay from the chunk's start through token i
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    # decay from token j to token i (j <= i); masked before exp so nothing overflows
    L = jnp.where(i >= j, jnp.exp(jnp.where(i >= j, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    kb, vb = k * b[..., None], v * b[..., None]
    A = jnp.where(i > j, jnp.einsum("...id,...jd->...ij", kb, k, precision=_HIGHEST) * L, 0.0)
    M = A + jnp.eye(C, dtype=A.dtype)  # unit lower triangular
    solve = lambda rhs: jax.lax.linalg.triangular_solve(M, rhs, left_side=True, lower=True, unit_diagonal=True)
    u = solve(vb)  # what the chunk writes, before subtracting what the incoming state already predicts
    w = solve(kb * jnp.exp(cum)[..., None])  # the keys through which the incoming state is read
    attn = jnp.einsum("...id,...jd->...ij", q, k, precision=_HIGHEST) * L
    q_in = q * jnp.exp(cum)[..., None]
    k_out = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    decay = jnp.exp(cum[..., -1])[..., None, None]  # [n, B, Hv, 1, 1]

    def body(S, xs):
        u_c, w_c, q_c, k_c, attn_c, d_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, S, precision=_HIGHEST)
        o = (jnp.einsum("bhck,bhkv->bhcv", q_c, S, precision=_HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", attn_c, v_new, precision=_HIGHEST))
        S = S * d_c + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new, precision=_HIGHEST)
        return S, (o, v_new)

    S, (o, v_new) = jax.lax.scan(body, S_BHvDkDv, (u, w, q_in, k_out, attn, decay))
    unchunk = lambda a: jnp.moveaxis(a, (0, 3), (1, 2)).reshape(B, n * C, Hv, -1)[:, :T]  # noqa: E731
    return unchunk(o), S, unchunk(v_new)  # v_new: each token's write into S (DeltaNetTape.delta)


def apply(p: DeltaNetParams, x_BTD: jax.Array, state: DeltaNetState, *, n_valid_B: jax.Array,
          dims: DeltaNetDims, kernels: Kernels, tape: bool = False):
    """The layer on T tokens of each of B rows, continuing from `state`. Tokens at t >= n_valid_B[b] are
    bucket padding: computed (their outputs are meaningless) but they leave the state as the row's last
    valid token left it (b = g = 0 makes their delta-rule updates no-ops; the conv state ends at the last
    valid input). n_valid_B = 0 leaves a row's state untouched. A row starting a new sequence must come
    in zeroed (reset_rows): nothing here knows where a sequence begins. Static: dims, kernels, and T
    (T == 1 takes the recurrent step, T > 1 the chunked form). Returns (y, state), and with `tape` (static)
    the pass's DeltaNetTape last."""
    d = dims
    B, T, _ = x_BTD.shape
    Hk, Hv, Dk, Dv = d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim
    f32 = jnp.float32
    n_valid_B = jnp.clip(n_valid_B.astype(jnp.int32), 0, T)
    valid_BT = jnp.arange(T)[None, :] < n_valid_B[:, None]

    qkv = linear(x_BTD, p.attn_qkv, kernels).astype(f32)
    z = linear(x_BTD, p.attn_gate, kernels).astype(f32).reshape(B, T, Hv, Dv)
    beta = jax.nn.sigmoid(linear(x_BTD, p.ssm_beta, kernels).astype(f32))
    alpha = linear(x_BTD, p.ssm_alpha, kernels).astype(f32)
    g = p.ssm_a_Hv * jax.nn.softplus(alpha + p.ssm_dt_Hv)
    beta = jnp.where(valid_BT[:, :, None], beta, 0.0)
    g = jnp.where(valid_BT[:, :, None], g, 0.0)

    conv, conv_state = _short_conv(qkv, state.conv_BKcCc, p.ssm_conv1d_CcKc, n_valid_B)
    conv = jax.nn.silu(conv)
    q = conv[..., :d.key_dim].reshape(B, T, Hk, Dk)
    k = conv[..., d.key_dim:2 * d.key_dim].reshape(B, T, Hk, Dk)
    v = conv[..., 2 * d.key_dim:].reshape(B, T, Hv, Dv)
    q = _l2norm(q, d.l2_eps) * (Dk ** -0.5)
    k = _l2norm(k, d.l2_eps)
    if d.v_head_order == "grouped":  # value head h reads key head h // (Hv / Hk)
        q, k = jnp.repeat(q, Hv // Hk, axis=2), jnp.repeat(k, Hv // Hk, axis=2)
    else:  # value head h reads key head h % Hk (the tiled order)
        q, k = jnp.tile(q, (1, 1, Hv // Hk, 1)), jnp.tile(k, (1, 1, Hv // Hk, 1))

    if T == 1:
        o, S, delta = _step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.ssm_BHvDkDv)
        o, delta = o[:, None], delta[:, None]
    else:
        o, S, delta = _chunked(q, k, v, g, beta, state.ssm_BHvDkDv, d.chunk_size)

    act = jax.nn.sigmoid if d.output_gate == "sigmoid" else jax.nn.silu
    o = rms_norm(o, p.ssm_norm_Dv, d.rms_eps) * act(z)
    y = linear(o.reshape(B, T, Hv * Dv).astype(x_BTD.dtype), p.ssm_out, kernels)
    if tape:
        return y, DeltaNetState(conv_state, S), DeltaNetTape(qkv, k, delta, jnp.cumsum(g, axis=1))
    return y, DeltaNetState(conv_state, S)
