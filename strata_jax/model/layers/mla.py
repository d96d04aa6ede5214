"""deepseek2's multi-head latent attention (transformers' DeepseekV3Attention, llama.cpp's deepseek2
graph), over a cache of latents.

Every head's keys and values come from one per-token latent c (kv_lora_rank, RMS-normed) and one rotated
key k_pe (rope_dim) shared by all heads: k_h = [k_b[h] @ c | k_pe], v_h = v_b[h] @ c. The cache holds
[c | k_pe] per position, a single "head" of Rk + Dr values (ModelConfig.kv_cache_dims), never the
per-head keys and values. Two forms compute the same attention:
- absorbed: q_nope[h] . (k_b[h] @ c) = (k_b[h]^T q_nope[h]) . c, so each query is moved into the latent
  space once and attends to the cached [c | k_pe] directly as MQA (one kv head for H query heads); the
  heads' outputs are latent vectors, then v_b[h] takes each to its value space;
- naive: the cached latents of the span are expanded to every head's keys and values, then plain MHA.
Absorbed does ~(2 Rk + Dr) multiply-adds per query and cache position, naive ~(Dn + Dr + Do) plus
the expansion, Rk (Dn + Do) per head and cache position whatever the step's tokens: `form` picks the
cheaper one for a step's tokens per row (Kernels.mla "auto").

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.gguf.quant import dequant
from strata_jax.model.config import MLADims, ModelConfig
from strata_jax.model.kernels import Kernels
from strata_jax.model import kvquant
from strata_jax.model.layers.attention import attend, attend_keys, attn_mscale, rope
from strata_jax.model.layers.basic import linear, project, rms_norm


@struct.dataclass
class MLAParams:
    """deepseek2's multi-head latent attention (model/layers/mla.py; dims: ModelConfig.mla). `qkv_a` is the two
    products of the normed input: the query latent attn_q_a [Rq, D] (or, without one, the whole query
    attn_q [H*(Dn+Dr), D]) and attn_kv_a_mqa [Rk+Dr, D] (the kv latent, then the shared rope key)."""

    norm_D: jax.Array
    qkv_a: Projections
    q_a_norm_Rq: jax.Array | None  # None: no query latent (attn_q)
    q_b: QTensor | None  # [H*(Dn+Dr), Rq]
    kv_a_norm_Rk: jax.Array
    k_b: QTensor  # attn_k_b [H, Rk, Dn]: a head's no-rope key is k_b[h] @ latent
    v_b: QTensor  # attn_v_b [H, Do, Rk]: its value v_b[h] @ latent
    wo: QTensor  # [D, H*Do]


def form(kernels: Kernels, d: MLADims, n_tokens: int, blocked: bool) -> str:
    """The form a step with n_tokens per row runs: Kernels.mla, or for "auto" the one with fewer
    multiply-adds (per head and cache position: absorbed n_tokens (2 Rk + Dr), naive
    n_tokens (Dn + Dr + Do) + Rk (Dn + Do)). Blocked attention (long spans) reads the cache block by
    block, which only the absorbed form does."""
    if blocked or kernels.mla == "absorbed":
        return "absorbed"
    if kernels.mla == "naive":
        return "naive"
    absorbed = n_tokens * (2 * d.kv_lora_rank + d.rope_dim)
    naive = n_tokens * (d.qk_dim + d.v_dim) + d.kv_lora_rank * (d.nope_dim + d.v_dim)
    return "naive" if naive < absorbed else "absorbed"


def kq_scale(cfg: ModelConfig) -> float:
    """The attention scale: 1 / sqrt(Dn + Dr), times YaRN's mscale squared (llama.cpp's kq_scale)."""
    return attn_mscale(cfg) ** 2 / cfg.mla.qk_dim ** 0.5


def attention(p: MLAParams, x_BTD: jax.Array, pos_BT: jax.Array, c_LBSKDh: jax.Array, layer: int, cfg: ModelConfig,
              kernels: Kernels, attn_len: int | None = None, attn_block: int | None = None
              ) -> tuple[jax.Array, jax.Array]:
    """Causal MLA for `layer` of the normed input x: writes the step's [latent | rotated key] into the
    (donated) latent cache at pos_BT and attends over its first attn_len positions (attn_block:
    blocked, see layers.attend_blocked). Returns the output projection's [B, T, D] and the cache."""
    B, T, _ = x_BTD.shape
    d, H = cfg.mla, cfg.n_heads
    Rk, Dn = d.kv_lora_rank, d.nope_dim
    dtype = x_BTD.dtype
    q, kv_a = project(x_BTD, p.qkv_a, kernels)
    if p.q_b is not None:
        q = linear(rms_norm(q, p.q_a_norm_Rq, cfg.rms_eps), p.q_b, kernels)
    q = q.reshape(B, T, H, d.qk_dim)
    q_nope, q_pe = q[..., :Dn], rope(q[..., Dn:], pos_BT, cfg)
    latent_BTRk = rms_norm(kv_a[..., :Rk], p.kv_a_norm_Rk, cfg.rms_eps)
    k_pe_BT1Dr = rope(kv_a[..., Rk:][:, :, None, :], pos_BT, cfg)
    c_BT1Dh = jnp.concatenate([latent_BTRk[:, :, None, :], k_pe_BT1Dr], axis=-1)
    k_b_HRkDn, v_b_HDoRk = dequant(p.k_b, dtype), dequant(p.v_b, dtype)
    scale = kq_scale(cfg)
    f32 = jnp.float32
    if form(kernels, d, T, bool(attn_block)) == "absorbed":
        q_lat_BTHRk = jnp.einsum("bthn,hrn->bthr", q_nope, k_b_HRkDn, preferred_element_type=f32).astype(dtype)
        q_BTHDh = jnp.concatenate([q_lat_BTHRk, q_pe], axis=-1)
        o_lat_BTHRk, c_LBSKDh, _ = attend(q_BTHDh, c_BT1Dh, None, pos_BT, c_LBSKDh, None, layer, attn_len,
                                    attn_block=attn_block, scale=scale, v_dim=Rk)
        o_BTHDo = jnp.einsum("bthr,hor->btho", o_lat_BTHRk.reshape(B, T, H, Rk).astype(dtype), v_b_HDoRk,
                             preferred_element_type=f32)
    else:
        c_LBSKDh = kvquant.write(c_LBSKDh, layer, pos_BT, c_BT1Dh)
        S = min(attn_len or c_LBSKDh.shape[2], c_LBSKDh.shape[2])
        c_BSDh = kvquant.read(c_LBSKDh, layer, 0, S, dtype)[:, :, 0]
        lat_BSRk, k_pe_BSDr = c_BSDh[..., :Rk], c_BSDh[..., Rk:]
        k_nope_BSHDn = jnp.einsum("bsr,hrn->bshn", lat_BSRk, k_b_HRkDn, preferred_element_type=f32).astype(dtype)
        v_BSHDo = jnp.einsum("bsr,hor->bsho", lat_BSRk, v_b_HDoRk, preferred_element_type=f32).astype(dtype)
        k_pe_BSHDr = jnp.broadcast_to(k_pe_BSDr[:, :, None, :], (B, S, H, d.rope_dim))
        k_BSHDh = jnp.concatenate([k_nope_BSHDn, k_pe_BSHDr], axis=-1)
        o_BTHDo = attend_keys(jnp.concatenate([q_nope, q_pe], axis=-1), k_BSHDh, v_BSHDo, pos_BT, scale)
    return linear(o_BTHDo.reshape(B, T, H * d.v_dim).astype(dtype), p.wo, kernels), c_LBSKDh
