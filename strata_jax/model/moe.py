"""The MoE block over the slot table: router (fp32 softmax, top-k, optional renormalisation), routed
experts read from their slots, and qwen2moe's sigmoid-gated shared expert.

Two static code paths, chosen by the token count (a trace-time constant):
- few tokens (decode): gather just the N*K routed experts' blocks and dequantize those;
- many tokens (prefill): dequantize each of the layer's experts once and run every token through a
  dense masked product, so each expert's bytes are read once per chunk rather than once per token.

Shape legend: N tokens (B*T flattened), D model dim, E experts, K experts per token, F expert ffn dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.model.config import ModelConfig
from strata_jax.model import quant
from strata_jax.model.layers import swiglu
from strata_jax.model.weights import MoEParams
from strata_jax.offload.slot_table import SlotTable


def route(x_ND: jax.Array, router_ED: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their weights, in float32 (routing decisions are precision-sensitive)."""
    logits_NE = jnp.einsum("nd,ed->ne", x_ND.astype(jnp.float32), router_ED, precision="highest")
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    w_NK, ids_NK = jax.lax.top_k(probs_NE, cfg.n_experts_used)
    if cfg.norm_topk:
        w_NK = w_NK / jnp.sum(w_NK, axis=-1, keepdims=True)
    return w_NK * cfg.expert_weights_scale, ids_NK.astype(jnp.int32)


def _experts_gathered(x_ND, w_NK, slot_NK, pool, dtype):
    g_NKFD = _dequant_slots(pool.gate, slot_NK, dtype)
    u_NKFD = _dequant_slots(pool.up, slot_NK, dtype)
    d_NKDF = _dequant_slots(pool.down, slot_NK, dtype)
    f32 = jnp.float32
    h = jax.nn.silu(jnp.einsum("nd,nkfd->nkf", x_ND, g_NKFD, preferred_element_type=f32))
    h = (h * jnp.einsum("nd,nkfd->nkf", x_ND, u_NKFD, preferred_element_type=f32)).astype(dtype)
    y_NKD = jnp.einsum("nkf,nkdf->nkd", h, d_NKDF, preferred_element_type=f32)
    return jnp.einsum("nkd,nk->nd", y_NKD, w_NK)


def _experts_dense(x_ND, w_NK, ids_NK, slot_E, pool, dtype, n_experts):
    f32 = jnp.float32
    combine_NE = jnp.zeros((x_ND.shape[0], n_experts), f32).at[jnp.arange(x_ND.shape[0])[:, None], ids_NK].add(w_NK)
    g_EFD = _dequant_slots(pool.gate, slot_E, dtype)
    u_EFD = _dequant_slots(pool.up, slot_E, dtype)
    d_EDF = _dequant_slots(pool.down, slot_E, dtype)
    h = jax.nn.silu(jnp.einsum("nd,efd->nef", x_ND, g_EFD, preferred_element_type=f32))
    h = (h * jnp.einsum("nd,efd->nef", x_ND, u_EFD, preferred_element_type=f32)).astype(dtype)
    y_NED = jnp.einsum("nef,edf->ned", h, d_EDF, preferred_element_type=f32)
    return jnp.einsum("ned,ne->nd", y_NED, combine_NE)


def _dequant_slots(qt, slots, dtype):
    return quant.dequantize(jnp.take(qt.data, slots, axis=0), qt.qtype, qt.n_cols, dtype)


def moe_block(
    p: MoEParams, slots: SlotTable, moe_idx: int, x_BTD: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """Returns the block output and the routed expert ids [N, K] (for telemetry and offloading)."""
    B, T, D = x_BTD.shape
    dtype = x_BTD.dtype
    x_ND = x_BTD.reshape(B * T, D)
    w_NK, ids_NK = route(x_ND, p.router_ED, cfg)
    pool = slots.pools[slots.layer_pool[moe_idx]]
    slot_E = slots.slot_map_LE[moe_idx]
    if B * T * cfg.n_experts_used <= cfg.n_experts:
        out_ND = _experts_gathered(x_ND, w_NK, slot_E[ids_NK], pool, dtype)
    else:
        out_ND = _experts_dense(x_ND, w_NK, ids_NK, slot_E, pool, dtype, cfg.n_experts)
    if p.shared is not None:
        shared_ND = swiglu(x_ND, p.shared).astype(jnp.float32)
        if p.shared_gate_D is not None:
            gate_N1 = jax.nn.sigmoid(jnp.einsum("nd,d->n", x_ND.astype(jnp.float32), p.shared_gate_D))[:, None]
            shared_ND = shared_ND * gate_N1
        out_ND = out_ND + shared_ND
    return out_ND.astype(dtype).reshape(B, T, D), ids_NK
