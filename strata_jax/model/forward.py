"""The whole-model forward pass: one pure function, jitted per (batch, token-bucket) shape.

Every layer runs inside one program (no Python between layers, no host sync inside a step): alike
layers as one scanned body over their stacked params (model/runs.py), the others unrolled. The KV cache
is donated so its update is in place.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core import layer_ref
from strata_jax.core.experts import ExpertProvider
from strata_jax.gguf.quant import take_rows
from strata_jax.model.config import ModelConfig
from strata_jax.model import kvquant, mla, runs
from strata_jax.model.kvquant import QuantKV
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers import attention, lm_head, rms_norm, swiglu
from strata_jax.model.moe import finish_routing, moe_block, route


@struct.dataclass
class LayerParams:
    attn: AttnParams | MLAParams
    ffn_norm_D: jax.Array
    mlp: MLPParams | None  # dense layers
    moe: MoEParams | None  # MoE layers (experts themselves are in the SlotTable)


@struct.dataclass
class Params:
    embed: QTensor  # [V, D]
    layers: tuple[LayerParams, ...]
    out_norm_D: jax.Array
    lm_head: QTensor  # [V, D]; the embedding when tied
    nextn: tuple[NextNParams, ...] = ()  # MTP blocks (cfg.n_nextn_layers) the file has, not run


@struct.dataclass
class KVCache:
    """Every row's sequence state: K and V of the attention layers (L: KV layers, cfg.attention_layers;
    heads and dims: cfg.kv_cache_dims) and, for a model with recurrent layers (the hybrid family), `rec`:
    their per-row state, a pytree whose every leaf has the batch axis first (None otherwise, so other
    models' programs are what they were). K and V are each a plain array (kv type f16: the compute
    dtype) or a kvquant.QuantKV (q8_0, q4_0: quantized on write, dequantized where attention reads).
    v_LBSKDh is None where the keys carry the values (deepseek2's latent cache, model/mla.py). All are
    donated and updated in place by the two programs."""

    k_LBSKDh: jax.Array | QuantKV
    v_LBSKDh: jax.Array | QuantKV | None
    rec: Any = None

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype, device=None, kv: str = "f16") -> "KVCache":
        """An empty cache; kv: EngineConfig.kv, the storage type of keys and values (kvquant.kinds)."""
        k_dims, v_dims = cfg.kv_cache_dims
        k_kind, v_kind = kvquant.kinds(kv)
        make = lambda dims, kind: kvquant.zeros((cfg.n_kv_layers, batch, length, *dims), kind, dtype)  # noqa: E731
        rec = None
        if cfg.has_recurrent_state:
            from strata_jax.model import hybrid  # noqa: PLC0415 - the one family with recurrent state

            rec = hybrid.state_zeros(cfg, batch, length)
        kv = cls(make(k_dims, k_kind), None if v_dims is None else make(v_dims, v_kind), rec)
        return jax.device_put(kv, device) if device is not None else kv

    @property
    def length(self) -> int:
        return self.k_LBSKDh.shape[2]

    def take_row(self, row) -> "KVCache":
        """Row `row` (traced) as a batch-1 cache."""
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row, slice_size=1)
        rec = jax.tree.map(lambda a: take(a, axis=0), self.rec)
        k, v = jax.tree.map(lambda a: take(a, axis=1), (self.k_LBSKDh, self.v_LBSKDh))
        return KVCache(k, v, rec)

    def put_row(self, row, one: "KVCache") -> "KVCache":
        """This cache with row `row` replaced by the batch-1 cache `one` (in place when donated)."""
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=row)
        rec = jax.tree.map(lambda a, v: put(a, v.astype(a.dtype), axis=0), self.rec, one.rec)
        k, v = jax.tree.map(lambda a, b: put(a, b, axis=1), (self.k_LBSKDh, self.v_LBSKDh),
                            (one.k_LBSKDh, one.v_LBSKDh))
        return KVCache(k, v, rec)


def forward(
    params: Params,
    experts: ExpertProvider | None,
    kv: KVCache,
    tokens_BT: jax.Array,
    start_B: jax.Array,
    n_valid_B: jax.Array,
    *,
    cfg: ModelConfig,
    dtype,
    kernels: Kernels,
    all_logits: bool = False,
    attn_len: int | None = None,
    attn_block: int | None = None,
    forced_MNk: jax.Array | None = None,
) -> tuple[jax.Array, KVCache, ExpertProvider | None, jax.Array]:
    """Run T new tokens per sequence starting at cache position start_B.

    Tokens past n_valid_B are bucket padding: they are computed (fixed shapes) but never read back, and
    the cache slots they write lie past the sequence's end, where the next real token overwrites them
    before anything attends to them. Neither they nor an idle row's token (start at or past the cache
    length) look experts up, fetch, prefetch or count. Routed experts come from `experts` (None for a dense model), which
    comes back updated, its counters included.

    With experts.prefetch_depth = d > 0 (offloading, decode), each MoE layer also has the provider admit
    and fetch the experts that the routers of the next d MoE layers predict from the current residual
    stream.

    kernels (static): the implementation choices (model/kernels.py).
    attn_len (static): attention reads only the first attn_len cache positions; every position this
    step writes must lie below it.
    attn_block (static): attention runs over those positions in blocks of attn_block, as many as the
    furthest position needs at run time (model/layers.py attend_blocked): one program for every span.
    forced_MNk (int32 [M, B*T, k]): replay these routed experts instead of the routers' choice
    (benchmarks with a synthetic routing trace; prefetch predictions still come from the routers).

    Returns (logits, kv cache, experts, routed expert ids [M, B*T, k], -1 for tokens that are not real). Logits are float32, [B, T, V]
    with all_logits, else [B, V] for each sequence's last valid token.
    """
    if cfg.is_hybrid:
        from strata_jax.model import hybrid  # noqa: PLC0415 - its layer modules load only for it

        return hybrid.forward(params, experts, kv, tokens_BT, start_B, n_valid_B, cfg=cfg, dtype=dtype,
                              kernels=kernels, all_logits=all_logits, attn_len=attn_len, attn_block=attn_block,
                              forced_MNk=forced_MNk)
    B, T = tokens_BT.shape
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    # real tokens: not bucket padding, not an idle row (which runs at a position past the cache)
    valid_N = ((jnp.arange(T)[None, :] < n_valid_B[:, None]) & (pos_BT < kv.length)).reshape(B * T)
    x = take_rows(params.embed, tokens_BT, dtype)
    n_moe = len(cfg.moe_layers)
    moe_idx = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    few = experts is not None and all(experts.few_path(m, B * T * cfg.n_experts_used) for m in range(n_moe))
    depth = experts.prefetch_depth if few else 0  # MoE layers ahead whose experts each layer prefetches
    predicted: dict[int, jax.Array] = {}  # MoE index -> experts predicted for it by the layer before

    def block(carry, layer, i):
        """Block i (an int, or a LayerRef inside a scanned run: runs.py)."""
        x, k_all, v_all, experts = carry
        with jax.named_scope(f"layer{i}" if isinstance(i, int) else f"layers{i.ids[0]}+"):
            with jax.named_scope("attn"):
                h = rms_norm(x, layer.attn.norm_D, cfg.rms_eps)
                if cfg.mla is not None:
                    h, k_all = mla.attention(layer.attn, h, pos_BT, k_all, layer_ref.value(i), cfg, kernels, attn_len,
                                             attn_block)
                else:
                    h, k_all, v_all = attention(layer.attn, h, pos_BT, k_all, v_all, i, cfg, kernels, attn_len,
                                                attn_block)
                x = x + h
            h = rms_norm(x, layer.ffn_norm_D, cfg.rms_eps)
            ids = None
            if layer.moe is not None:
                with jax.named_scope("moe"):
                    mi = layer_ref.mapped(i, moe_idx)
                    pf = []
                    for ahead in range(mi + 1, min(mi + 1 + depth, n_moe)) if depth else ():
                        # a later MoE layer's router on this residual stream predicts its experts
                        nxt = runs.layer_at(params.layers, cfg.moe_layers[ahead])
                        h_next = rms_norm(x, nxt.ffn_norm_D, cfg.rms_eps).reshape(B * T, -1)
                        p_ids = route(h_next, nxt.moe.router_ED, cfg, bias_E=nxt.moe.score_bias_E,
                                      logit_bias_E=nxt.moe.router_bias_E)[1]
                        pf.append((ahead, jnp.where(valid_N[:, None], p_ids, -1)))
                    if pf:
                        predicted[mi + 1] = pf[0][1]  # precision/recall: the next layer's prediction
                    forced = None if forced_MNk is None else forced_MNk[layer_ref.value(mi)]
                    h, ids, experts = moe_block(layer.moe, experts, mi, h, cfg, kernels, tuple(pf),
                                                predicted.get(mi) if depth else None, forced, valid_N)
            else:
                with jax.named_scope("mlp"):
                    h = swiglu(h, layer.mlp, kernels)
            x = x + h
        return (x, k_all, v_all, experts), ids

    # prefetch reads later layers' routers by static index: its layers run one by one
    (x, k_all, v_all, experts), outs = runs.run_layers(
        params.layers, (x, kv.k_LBSKDh, kv.v_LBSKDh, experts), block, unroll=depth > 0,
        detach=runs.detach_provider, attach=runs.attach_provider)
    routed = [ids for ids in outs if ids is not None]
    with jax.named_scope("head"):
        if not all_logits:
            x = x[jnp.arange(B), n_valid_B - 1][:, None, :]
        x = rms_norm(x, params.out_norm_D, cfg.rms_eps)
        logits = lm_head(x, params.lm_head, dtype, kernels)
        if not all_logits:
            logits = logits[:, 0]
    routed_MNk, experts = finish_routing(routed, valid_N, cfg, experts)
    return logits, KVCache(k_all, v_all), experts, routed_MNk
