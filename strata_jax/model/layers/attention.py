"""Attention as pure functions: RoPE (linear, YaRN), GQA attention over a KV cache (whole, or in blocks
with a run-time trip count), gpt-oss's sliding window and sinks, and the hybrid family's gated attention.
The shared pieces (projections, RMSNorm, linear) are in basic.py.

Shape legend: strata_jax/core/shapes.py
RoPE angles, attention scores and softmax run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
import numpy as np

from strata_jax.core import layer_ref
from strata_jax.core.qtensor import QTensor
from strata_jax.model import kvquant
from strata_jax.model.config import ModelConfig
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import Projections, linear, project, rms_norm


@struct.dataclass
class AttnParams:
    norm_D: jax.Array
    qkv: Projections  # q [H*Dh, D], k [K*Dh, D], v [K*Dh, D]
    wo: QTensor  # [D, H*Dh]
    q_norm: jax.Array | None  # [Dh] per head (qwen3) or [H*Dh] over all heads (olmoe)
    k_norm: jax.Array | None
    sinks_H: jax.Array | None = None  # gpt-oss: a learned logit per head in the softmax's denominator
    wo_bias_D: jax.Array | None = None  # gpt-oss: the output projection's bias


@struct.dataclass
class GatedAttnParams:
    """qwen4exp's full attention: attn_q holds per head Dh query rows then Dh gate rows (HF's q_proj
    viewed as [H, 2 * Dh], which the converter keeps), so `qkv`'s first output is [H * 2 * Dh]."""

    qkv: Projections  # q+gate [H*2*Dh, D], k [K*Dh, D], v [K*Dh, D]
    wo: QTensor  # [D, H*Dh]
    q_norm: jax.Array  # [Dh], (1 + w) folded in by the converter
    k_norm: jax.Array
    indexer: Any  # model/layers/qsa.py's QSAParams, or None where the layer's compress ratio is 0


def rope_freqs(cfg: ModelConfig) -> tuple[jax.Array, float]:
    """The rotary pairs' inverse frequencies (float32 [rope_dim / 2]) and the magnitude cos and sin are
    scaled by (cfg.rope_scaling; cfg: anything with rope_dim, rope_theta, rope_style: QSA's dims, which
    are unscaled, too). Linear: every frequency divided by the factor. YaRN, ggml's rope_yarn: the dims
    past the correction range (ggml_rope_yarn_corr_dims: the slow frequencies) are divided by the factor,
    those before it kept, a linear ramp between (mixed by ext_factor), its ends truncated to whole dims as
    llama.cpp does (transformers' truncate=True); the magnitude is 1 + 0.1 ln(factor), which llama.cpp
    cancels for deepseek2 when the file has a log multiplier (its kq scale takes the mscale instead:
    attn_mscale)."""
    n = cfg.rope_dim
    y = getattr(cfg, "rope_scaling", None)
    if y is None:
        return cfg.rope_theta ** (-jnp.arange(0, n, 2, dtype=jnp.float32) / n), 1.0
    inv_freq = cfg.rope_theta ** (-np.arange(0, n, 2, dtype=np.float64) / n)  # [n/2], a trace-time constant
    if y.kind == "linear":
        return jnp.asarray((inv_freq / y.factor).astype(np.float32)), 1.0

    def corr_dim(n_rot: float) -> float:
        return n * math.log(y.orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = max(0.0, math.floor(corr_dim(y.beta_fast))), min(n - 1.0, math.ceil(corr_dim(y.beta_slow)))
    ramp = 1.0 - np.clip((np.arange(n // 2) - low) / max(0.001, high - low), 0.0, 1.0)
    mix = ramp * y.ext_factor  # 1: the original frequency (extrapolated), 0: divided by the factor
    inv_freq = inv_freq * ((1.0 - mix) / y.factor + mix)
    return jnp.asarray(inv_freq.astype(np.float32)), 1.0 if y.log_mul else 1.0 + 0.1 * math.log(y.factor)


def attn_mscale(cfg: ModelConfig) -> float:
    """What llama.cpp's deepseek2 graph multiplies the kq scale by (squared): the rope magnitude times
    1 + 0.1 log_mul ln(factor) (HF's yarn_get_mscale(factor, mscale_all_dim)); 1 without YaRN."""
    y = cfg.rope_scaling
    if y is None or y.kind != "yarn":
        return 1.0
    return rope_freqs(cfg)[1] * (1.0 + 0.1 * y.log_mul * math.log(y.factor))


def rope(x_BTHDh: jax.Array, pos_BT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotary embedding in llama.cpp's two layouts: "normal" rotates consecutive pairs (2i, 2i+1),
    "neox" rotates (i, i + n/2). Only the first `rope_dim` dims rotate (partial rotary); frequencies
    and magnitude from rope_freqs (linear, YaRN)."""
    n = cfg.rope_dim
    inv_freq, magnitude = rope_freqs(cfg)
    ang = pos_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, n/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    x = x_BTHDh.astype(jnp.float32)
    rot, rest = x[..., :n], x[..., n:]
    if cfg.rope_style == "neox":
        a, b = rot[..., : n // 2], rot[..., n // 2 :]
        rot = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([rot, rest], axis=-1).astype(x_BTHDh.dtype)


def attention(
    p: AttnParams,
    x_BTD: jax.Array,
    pos_BT: jax.Array,
    k_LBSKDh: jax.Array,
    v_LBSKDh: jax.Array,
    layer: int | layer_ref.LayerRef,
    cfg: ModelConfig,
    kernels: Kernels,
    attn_len: int | None = None,
    attn_block: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal GQA attention for `layer` (an int, or a LayerRef in a scanned run). The new keys/values are scattered straight into the whole
    (donated) cache at `pos_BT` — one in-place update, never a copy of a layer's cache — then every
    query attends to cache positions <= its own; stale entries past a sequence's end are masked.
    attn_len (static): attend over the first attn_len cache positions only, a power-of-two bucket above
    the furthest position, so a short sequence does not pay for the whole context. attn_block (static):
    instead, attend over the first attn_len positions in blocks of attn_block with a trip count set at
    run time by the furthest position (`attend_blocked`), so one program serves every span. gpt-oss:
    the layers in cfg.swa_layers see the last cfg.sliding_window positions only, the heads' sinks
    (p.sinks_H) join the softmax, the output projection has a bias."""
    B, T, _ = x_BTD.shape
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = project(x_BTD, p.qkv, kernels)
    if cfg.qk_norm == "full":  # olmoe: one norm over all heads
        q = rms_norm(q, p.q_norm, cfg.rms_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_eps)
    q = q.reshape(B, T, H, Dh)
    k = k.reshape(B, T, K, Dh)
    v = v.reshape(B, T, K, Dh)
    if cfg.qk_norm == "head":  # qwen3: per-head norm before RoPE
        q = rms_norm(q, p.q_norm, cfg.rms_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_eps)
    q = rope(q, pos_BT, cfg)
    k = rope(k, pos_BT, cfg)
    window = cfg.sliding_window if layer_ref.first(layer) in cfg.swa_layers else 0  # alike in a run
    out, k_LBSKDh, v_LBSKDh = attend(q, k, v, pos_BT, k_LBSKDh, v_LBSKDh, layer_ref.value(layer), attn_len, attn_block=attn_block,
                                     window=window, sinks_H=p.sinks_H)
    return linear(out.astype(x_BTD.dtype), p.wo, kernels, p.wo_bias_D), k_LBSKDh, v_LBSKDh


# Up to this many queries per row (decode steps, verify passes) attention is products and sums, not a
# matrix product: on the GPU a matrix product is a library call, and one reading a slice of the stacked
# KV cache at a scanned layer's traced index becomes a loop-dependent dynamic-slice fusion, which keeps
# the whole layer scan out of XLA's command buffers (the host then walks the loop, docs/benchmarks.md).
# A few queries' attention is a read of the cache either way.
FEW_QUERIES = 8


def _scores(q_BTKGD: jax.Array, k_BSKD: jax.Array) -> jax.Array:
    """float32 [B, K, G, T, S]: each query head's dot product with each key of its KV head."""
    if q_BTKGD.shape[1] <= FEW_QUERIES:  # products and a sum: one fusion reading k in place
        q_e = jnp.moveaxis(q_BTKGD, 1, 3)[:, :, :, :, None, :].astype(jnp.float32)  # [B, K, G, T, 1, D]
        return jnp.sum(q_e * jnp.moveaxis(k_BSKD, 2, 1)[:, :, None, None].astype(jnp.float32), axis=-1)
    return jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)


def _weighted(p_BKGTS: jax.Array, v_BSKD: jax.Array) -> jax.Array:
    """float32 [B, K, G, T, D]: the values weighted by p, summed over positions."""
    if p_BKGTS.shape[3] <= FEW_QUERIES:
        v_e = jnp.moveaxis(v_BSKD, 2, 1)[:, :, None, None].astype(jnp.float32)  # [B, K, 1, 1, S, D]
        return jnp.sum(p_BKGTS[..., None].astype(jnp.float32) * v_e, axis=-2)
    return jnp.einsum("bkgts,bskd->bkgtd", p_BKGTS, v_BSKD, preferred_element_type=jnp.float32)


def _visible(s_S, pos_BT, window: int):
    """bool [B, T, S]: the cache positions s_S each query may attend to: causal, and with a sliding
    window only the last `window` (the query's own included: pos - s < window, llama.cpp's
    LLAMA_SWA_TYPE_STANDARD and transformers' sliding mask)."""
    mask_BTS = s_S[None, None, :] <= pos_BT[:, :, None]
    if window:
        mask_BTS = mask_BTS & (s_S[None, None, :] > pos_BT[:, :, None] - window)
    return mask_BTS


def attend_keys(q_BTHDh, k_BSKDh, v_BSKDo, pos_BT, scale: float, select_BTS: jax.Array | None = None,
                window: int = 0, sinks_H: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention of q over keys and values at positions 0..S-1 (query t sees positions <=
    pos_BT[t]; select_BTS: also only those selected; window: a sliding window, _visible). sinks_H: per
    head a logit that joins the softmax's denominator and multiplies no value (gpt-oss). Heads' outputs
    [B, T, H * Do] in float32."""
    B, T, H, Dh = q_BTHDh.shape
    S, K = k_BSKDh.shape[1], k_BSKDh.shape[2]
    q = q_BTHDh.reshape(B, T, K, H // K, Dh)
    scores = _scores(q, k_BSKDh) * scale
    mask_BTS = _visible(jnp.arange(S), pos_BT, window)
    if select_BTS is not None:
        mask_BTS = mask_BTS & select_BTS[:, :, :S]
    scores = jnp.where(mask_BTS[:, None, None], scores, -jnp.inf)
    if sinks_H is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKDo.dtype)
    else:  # the sink as one more column of the softmax, dropped after it
        sink = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, K, H // K, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v_BSKDo.dtype)
    return jnp.moveaxis(_weighted(probs, v_BSKDo), 3, 1).reshape(B, T, -1)


def attend(q_BTHDh, k_BTKDh, v_BTKDh, pos_BT, k_LBSKDh, v_LBSKDh, layer, attn_len: int | None,
           select_BTS: jax.Array | None = None, attn_block: int | None = None, *, scale: float | None = None,
           v_dim: int | None = None, window: int = 0, sinks_H: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Scatter the new keys/values into KV layer `layer` (an int or a traced int32) of the (donated) cache at pos_BT (quantized
    where the cache is, model/kvquant.py), then causal GQA attention over its first attn_len positions
    (see `attention`; attn_block: blocked, see `attend_blocked`). select_BTS (bool): the cache positions
    each query may attend to besides causality (QSA's selected blocks). scale: of the scores (default
    1 / sqrt(Dh)). With v_LBSKDh None (and v_BTKDh None) there is no value cache: each key's first v_dim
    dims are its value (MLA's latent). window, sinks_H: see `attend_keys`. Returns the heads' outputs
    [B, T, H * Do] in float32 and the caches."""
    Dh = q_BTHDh.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(Dh)) if scale is None else scale
    S = min(attn_len or k_LBSKDh.shape[2], k_LBSKDh.shape[2])
    new = None  # READ_BEFORE_WRITE: the step's entries as stored, merged into what is read of the old cache
    if READ_BEFORE_WRITE and q_BTHDh.shape[1] <= FEW_QUERIES:
        new = (kvquant.stored(k_BTKDh, k_LBSKDh, q_BTHDh.dtype),
               None if v_LBSKDh is None else kvquant.stored(v_BTKDh, v_LBSKDh, q_BTHDh.dtype))
    k_new = kvquant.write(k_LBSKDh, layer, pos_BT, k_BTKDh)
    v_new = None if v_LBSKDh is None else kvquant.write(v_LBSKDh, layer, pos_BT, v_BTKDh)
    k_src, v_src = (k_LBSKDh, v_LBSKDh) if new is not None else (k_new, v_new)
    if attn_block:
        out = attend_blocked(q_BTHDh, k_src, v_src, pos_BT, layer, S, attn_block, select_BTS, scale=scale,
                             v_dim=v_dim, window=window, sinks_H=sinks_H, new=new)
        return out, k_new, v_new
    s_S = jnp.arange(S)
    # what a streamed cache brings over: no position past the furthest query, only QSA's selected blocks
    upto = jnp.max(jnp.where(pos_BT < k_LBSKDh.shape[2], pos_BT, 0)) + 1
    want = None if select_BTS is None else jnp.any(select_BTS[:, :, :S], axis=1)
    k_att = _merged(kvquant.read(k_src, layer, 0, S, q_BTHDh.dtype, upto, want), new, 0, pos_BT, s_S)
    v_att = (k_att[..., :v_dim] if v_src is None
             else _merged(kvquant.read(v_src, layer, 0, S, q_BTHDh.dtype, upto, want), new, 1, pos_BT, s_S))
    return attend_keys(q_BTHDh, k_att, v_att, pos_BT, scale, select_BTS, window, sinks_H), k_new, v_new


# On, few-query attention reads the cache as it was before the step's scatter and merges the step's entries
# in (a one-hot sum over the queries): in qseed's decode, a read of the buffer the scatter just wrote became a
# plain slice copy that keeps the layer loop out of XLA:GPU's command buffers. Off until a sitting shows that
# copy gone on qseed (docs/benchmarks.md, "What keeps the scanned loops out"); slice_probe.py's kv:before.
READ_BEFORE_WRITE = False


def _merged(blk_BSKD: jax.Array, new, i: int, pos_BT: jax.Array, s_S: jax.Array) -> jax.Array:
    """The block with each position s that a query writes (pos_BT[b, t] == s) holding that query's entry
    new[i] (i: 0 keys, 1 values); the block as read where new is None."""
    if new is None:
        return blk_BSKD
    new_BTKD = new[i]
    hit_BTS = pos_BT[:, :, None] == s_S[None, None, :]
    put_BSKD = jnp.einsum("bts,btkd->bskd", hit_BTS.astype(jnp.float32), new_BTKD.astype(jnp.float32))
    return jnp.where(jnp.any(hit_BTS, axis=1)[:, :, None, None], put_BSKD.astype(blk_BSKD.dtype), blk_BSKD)


def attend_blocked(q_BTHDh, k_LBSKDh, v_LBSKDh, pos_BT, layer, S: int, block: int,
                   select_BTS: jax.Array | None = None, *, scale: float | None = None,
                   v_dim: int | None = None, window: int = 0, sinks_H: jax.Array | None = None,
                   new: tuple[jax.Array, jax.Array | None] | None = None) -> jax.Array:
    """Causal GQA attention of q over cache layer `layer`'s first S positions (keys already written, or,
    with `new`, the step's keys and values as the cache stores them, merged into each block it reads),
    `block` positions at a time with an online softmax (float32 running max, sum and output), for as
    many blocks as reach the furthest position below S in pos_BT: the trip count is a run-time value, so
    the program does not depend on the span. A query at or past S (an idle row) extends no loop; the
    blocks it is given are all it sees. With a sliding window the loop starts at the block of the
    earliest position any query still sees; sinks start the running max and sum (exp(sink - sink) = 1).
    scale, v_dim and v_LBSKDh None: see `attend`. Heads' outputs [B, T, H * Do] in float32."""
    B, T, H, Dh = q_BTHDh.shape
    _, _, _, K, _ = k_LBSKDh.shape
    G = H // K
    Do = v_dim if v_LBSKDh is None else v_LBSKDh.shape[-1]
    block = min(block, S)
    q = q_BTHDh.reshape(B, T, K, G, Dh)
    scale = 1.0 / jnp.sqrt(jnp.float32(Dh)) if scale is None else scale
    reach = jnp.max(jnp.where(pos_BT < S, pos_BT, 0))
    n_blocks = reach // block + 1
    first = 0
    if window:
        earliest = jnp.min(jnp.where(pos_BT < S, pos_BT, reach)) - window + 1
        first = jnp.minimum(jnp.maximum(earliest, 0) // block, n_blocks - 1)

    def body(j, carry):
        m_BKGT, l_BKGT, acc_BKGTDo = carry
        lo = j * block
        # the last block ends at S (a dynamic slice never reads past it): positions below lo, which the
        # block before covered, are masked out of it
        at = jnp.minimum(lo, S - block)
        # a quantized cache is dequantized here, one block at a time
        sel_BTS = None if select_BTS is None else jax.lax.dynamic_slice_in_dim(select_BTS, at, block, axis=2)
        want = None if sel_BTS is None else jnp.any(sel_BTS, axis=1)  # a streamed cache reads only these
        k_blk = kvquant.read(k_LBSKDh, layer, at, block, q.dtype, reach + 1, want)
        s_S = at + jnp.arange(block)
        k_blk = _merged(k_blk, new, 0, pos_BT, s_S)
        v_blk = (k_blk[..., :Do] if v_LBSKDh is None
                 else _merged(kvquant.read(v_LBSKDh, layer, at, block, q.dtype, reach + 1, want), new, 1, pos_BT,
                              s_S))
        mask_BTS = _visible(s_S, pos_BT, window) & (s_S >= lo)[None, None, :]
        if sel_BTS is not None:
            mask_BTS = mask_BTS & sel_BTS
        scores = _scores(q, k_blk) * scale
        scores = jnp.where(mask_BTS[:, None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m_BKGT, jnp.max(scores, axis=-1))
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, not nan
        p = jnp.exp(scores - m_ref[..., None])
        corr = jnp.exp(m_BKGT - m_ref)
        l_BKGT = l_BKGT * corr + jnp.sum(p, axis=-1)
        pv = _weighted(p.astype(v_blk.dtype), v_blk)
        return m_new, l_BKGT, acc_BKGTDo * corr[..., None] + pv

    if sinks_H is None:
        m0, l0 = jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32)
    else:
        m0 = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, K, G, 1), (B, K, G, T))
        l0 = jnp.ones((B, K, G, T), jnp.float32)
    init = (m0, l0, jnp.zeros((B, K, G, T, Do), jnp.float32))
    _, l_BKGT, acc_BKGTDo = jax.lax.fori_loop(first, n_blocks, body, init)
    out = acc_BKGTDo / l_BKGT[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H * Do)


def gated_attention(
    p: GatedAttnParams,
    x_BTD: jax.Array,
    pos_BT: jax.Array,
    k_LBSKDh: jax.Array,
    v_LBSKDh: jax.Array,
    kv_layer: int,
    cfg: ModelConfig,
    kernels: Kernels,
    attn_len: int | None = None,
    select_BTS: jax.Array | None = None,
    attn_block: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The hybrid family's full attention (transformers' Qwen3_5Attention, Qwen3NextAttention): q and an
    output gate from one projection (per head Dh query values then Dh gate values), per-head q/k RMSNorm,
    partial neox RoPE over the first rope_dim dims, GQA over the cache, then out * sigmoid(gate) and the
    output projection. The rope is the interleaved mrope of rope.dimension_sections with all three position
    ids equal (text), which makes every section the same rope: one neox rope of rope_dim dims."""
    B, T, _ = x_BTD.shape
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qg, k, v = project(x_BTD, p.qkv, kernels)
    qg = qg.reshape(B, T, H, 2, Dh)
    q, gate = qg[:, :, :, 0], qg[:, :, :, 1].reshape(B, T, H * Dh)
    q = rms_norm(q, p.q_norm, cfg.rms_eps)
    k = rms_norm(k.reshape(B, T, K, Dh), p.k_norm, cfg.rms_eps)
    q = rope(q, pos_BT, cfg)
    k = rope(k, pos_BT, cfg)
    out, k_LBSKDh, v_LBSKDh = attend(q, k, v.reshape(B, T, K, Dh), pos_BT, k_LBSKDh, v_LBSKDh, kv_layer, attn_len,
                                     select_BTS, attn_block)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
    return linear(out.astype(x_BTD.dtype), p.wo, kernels), k_LBSKDh, v_LBSKDh
