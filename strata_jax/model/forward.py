"""The whole-model forward pass: one pure function, jitted per (batch, token-bucket) shape.

Every layer is unrolled into one program (no Python between layers, no host sync inside a step);
layers are not scanned because quantized files mix GGML types across layers. The KV cache is donated
so its update is in place.

Shape legend: B batch, T tokens in this step (a power-of-two bucket), S cache length, L layers,
K kv heads, Dh head dim, D model dim, V vocab, M MoE layers, E experts, k experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.model import qmatvec
from strata_jax.model.config import ModelConfig
from strata_jax.model.layers import attention, rms_norm, swiglu
from strata_jax.model.moe import N_STATS, moe_block, resident_hits, route
from strata_jax.model.weights import Params, pytree_dataclass
from strata_jax.offload.policies import Policy
from strata_jax.offload.slot_table import SlotTable
from strata_jax.offload.store import ExpertStore


@pytree_dataclass
class KVCache:
    k_LBSKDh: jax.Array
    v_LBSKDh: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype, device=None) -> "KVCache":
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        make = functools.partial(jnp.zeros, shape, dtype)
        if device is not None:
            return cls(jax.device_put(make(), device), jax.device_put(make(), device))
        return cls(make(), make())

    @property
    def length(self) -> int:
        return self.k_LBSKDh.shape[2]


def forward(
    params: Params,
    slots: SlotTable | None,
    store: ExpertStore | None,
    kv: KVCache,
    tokens_BT: jax.Array,
    start_B: jax.Array,
    n_valid_B: jax.Array,
    *,
    cfg: ModelConfig,
    dtype,
    policy: Policy | None = None,
    prefetch: int = 0,
    all_logits: bool = False,
    attn_len: int | None = None,
    forced_MNk: jax.Array | None = None,
) -> tuple[jax.Array, KVCache, SlotTable | None, jax.Array, jax.Array]:
    """Run T new tokens per sequence starting at cache position start_B.

    Tokens past n_valid_B are bucket padding: they are computed (fixed shapes) but never read back, and
    the cache slots they write lie past the sequence's end, where the next real token overwrites them
    before anything attends to them. Routed experts come from `slots` (with misses fetched from `store`
    by `policy` when the cache is not fully resident).

    With prefetch = d > 0 (offloading, decode), each MoE layer also admits and fetches the experts that
    the routers of the next d MoE layers predict from the current residual stream.

    attn_len (static): attention reads only the first attn_len cache positions; every position this
    step writes must lie below it.

    forced_MNk (int32 [M, B*T, k]): replay these routed experts instead of the routers' choice
    (benchmarks with a synthetic routing trace; prefetch predictions still come from the routers).

    Returns (logits, kv cache, slot table, routed expert ids [M, B*T, k], counters int32 [M, N_STATS]
    per MoE layer: see moe.N_STATS). Logits are float32, [B, T, V] with all_logits,
    else [B, V] for each sequence's last valid token.
    """
    B, T = tokens_BT.shape
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = params.embed.take_rows(tokens_BT, dtype)
    k_all, v_all = kv.k_LBSKDh, kv.v_LBSKDh
    routed, stats = [], []
    moe_idx = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    offloading = slots is not None and not slots.resident and all(
        slots.few_path(m, B * T * cfg.n_experts_used, cfg.n_experts) for m in range(len(cfg.moe_layers)))
    depth = int(prefetch) if offloading else 0  # MoE layers ahead whose experts each layer prefetches
    predicted: dict[int, jax.Array] = {}  # MoE index -> experts predicted for it by the layer before
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attn"):
                h = rms_norm(x, layer.attn.norm_D, cfg.rms_eps)
                h, k_all, v_all = attention(layer.attn, h, pos_BT, k_all, v_all, i, cfg, attn_len)
                x = x + h
            h = rms_norm(x, layer.ffn_norm_D, cfg.rms_eps)
            if layer.moe is not None:
                with jax.named_scope("moe"):
                    mi = moe_idx[i]
                    pf = []
                    for ahead in range(mi + 1, min(mi + 1 + depth, len(cfg.moe_layers))):
                        # a later MoE layer's router on this residual stream predicts its experts
                        nxt = params.layers[cfg.moe_layers[ahead]]
                        h_next = rms_norm(x, nxt.ffn_norm_D, cfg.rms_eps).reshape(B * T, -1)
                        pf.append((ahead, route(h_next, nxt.moe.router_ED, cfg)[1]))
                    if pf:
                        predicted[mi + 1] = pf[0][1]  # precision/recall: the next layer's prediction
                    h, ids, slots, st = moe_block(layer.moe, slots, store, mi, h, cfg, policy, tuple(pf),
                                                  predicted.get(mi),
                                                  None if forced_MNk is None else forced_MNk[mi])
                    routed.append(ids)
                    stats.append(st)
            else:
                with jax.named_scope("mlp"):
                    h = swiglu(h, layer.mlp)
            x = x + h
    with jax.named_scope("head"):
        if not all_logits:
            x = x[jnp.arange(B), n_valid_B - 1][:, None, :]
        x = rms_norm(x, params.out_norm_D, cfg.rms_eps)
        n_rows = x.shape[0] * x.shape[1]
        if qmatvec.linear_ok(params.lm_head, n_rows):  # decode: read the head's blocks once
            logits = qmatvec.linear(x.reshape(n_rows, -1), params.lm_head).reshape(*x.shape[:2], -1)
        else:
            logits = jnp.einsum("btd,vd->btv", x, params.lm_head.dequant(dtype), preferred_element_type=jnp.float32)
        if not all_logits:
            logits = logits[:, 0]
    routed_MNk = jnp.stack(routed) if routed else jnp.zeros((0, B * T, max(cfg.n_experts_used, 1)), jnp.int32)
    stats_MS = jnp.stack(stats) if stats else jnp.zeros((0, N_STATS), jnp.int32)
    if stats and slots.resident and slots.few_path(0, B * T * cfg.n_experts_used, cfg.n_experts):
        stats_MS = stats_MS.at[:, 0].set(resident_hits(routed_MNk))
    return logits, KVCache(k_all, v_all), slots, routed_MNk, stats_MS
