"""The hybrid family's forward pass (config.HYBRID_ARCHITECTURES: qwen4exp, qwen3next, qwen35moe,
qwen35): heterogeneous layers, gated DeltaNet or gated full attention, with per-row recurrent state
carried next to the KV cache (KVCache.rec).

Per block, qwen4exp (transformers' Qwen4ExpTextDecoderLayer): PLE adds hashed n-gram features to the
streams (its layers only); the attention hyper-connection mixes the streams into the block input, the
block is gated full attention (KV cache + the QSA indexer's selection) or gated DeltaNet (recurrent),
its output goes back into every stream; the same around the MoE block. The final mixer replaces the
output norm before the head.

The others (hc_count == 0: transformers' Qwen3NextDecoderLayer, Qwen3_5(Moe)DecoderLayer): a plain
pre-norm residual, attn_norm before the mixer and post_attention_norm before the MoE block (or, qwen35,
the dense MLP), output_norm before the head. Their MTP blocks are loaded (params.nextn), not run.

State (`HybridState`, every leaf batch-first, float32 or int32, fixed shape): per linear layer the
DeltaNet conv + delta state, per PLE layer its n-gram context and conv state, per QSA layer its
compressed block keys. Rows starting a sequence (start_B == 0) start from fresh state; a token past
n_valid_B (bucket padding, a dead row in decode) changes no state.

The layer modules (model/deltanet.py, model/qsa.py, model/ple.py) load only for this family.
Prefetch is not done here (EngineConfig refuses it for the family).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core import layer_ref
from strata_jax.core.experts import ExpertProvider
from strata_jax.gguf.quant import take_rows
from strata_jax.model import deltanet, hyper, ple, qsa, runs
from strata_jax.model.config import ATTENTION, ModelConfig
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers import gated_attention, lm_head, rms_norm, swiglu
from strata_jax.model.moe import finish_routing, moe_block


@struct.dataclass
class HybridLayerParams:
    """One block of the hybrid family (model/hybrid.py): attention (full, gated) or linear (gated
    DeltaNet), then the MoE block or (qwen35) a dense MLP. qwen4exp: optional PLE before it and the
    hyper-connections around both sub-blocks; the others: the two pre-norms of a plain residual."""

    attn: GatedAttnParams | None
    linear: Any  # model/deltanet.py's DeltaNetParams on linear layers, else None
    ple: Any  # model/ple.py's PLEParams (the n-gram table included) on the PLE layer, else None
    hc: Any  # model/hyper.py's LayerHyper (hc_attn_*, hc_ffn_*): qwen4exp, else None
    moe: MoEParams | None
    mlp: MLPParams | None = None  # qwen35's dense SwiGLU
    attn_norm_D: jax.Array | None = None  # attn_norm (no hyper-connections)
    ffn_norm_D: jax.Array | None = None  # post_attention_norm: before the MoE block / MLP


@struct.dataclass
class HybridParams:
    embed: QTensor  # [V, D]
    layers: tuple[HybridLayerParams, ...]
    hc_head: Any  # qwen4exp: the final hyper-connection mixer (output_hc_*), in place of the output norm
    lm_head: QTensor  # [V, D]; the embedding when tied
    out_norm_D: jax.Array | None = None  # output_norm (no hyper-connections)
    nextn: tuple[NextNParams, ...] = ()  # MTP blocks (cfg.n_nextn_layers) the file has, not run


def hyper_dims(cfg: ModelConfig) -> hyper.HyperDims:
    return hyper.HyperDims(cfg.hc_count, cfg.hc_rank, cfg.d_model, cfg.rms_eps)


def qsa_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Attention layers with a compress ratio (QSA on): the others attend densely."""
    if cfg.indexer is None:
        return ()
    return tuple(i for i in cfg.attention_layers if cfg.indexer.compress_ratios[i])


def linear_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.n_layers) if cfg.kind(i) != ATTENTION)


@struct.dataclass
class HybridState:
    linear: tuple[Any, ...]  # DeltaNet state per linear layer (linear_layers order)
    ple: tuple[Any, ...]  # PLE state per PLE layer (cfg.ple.layers order)
    qsa: tuple[Any, ...]  # QSA indexer state per QSA layer (qsa_layers order)


def state_zeros(cfg: ModelConfig, batch: int, length: int) -> HybridState:
    """Fresh per-row state for `batch` rows of `length` cache positions."""
    lin = linear_layers(cfg)
    dn = deltanet_dims(cfg) if lin else None
    return HybridState(
        linear=tuple(deltanet.DeltaNetState.zeros(batch, dn) for _ in lin),
        ple=tuple(ple.PLEState.zeros(batch, ple_dims(cfg)) for _ in (cfg.ple.layers if cfg.ple else ())),
        qsa=tuple(qsa.QSAState.zeros(batch, length, qsa_dims(cfg, i)) for i in qsa_layers(cfg)),
    )


def deltanet_dims(cfg: ModelConfig):
    d = cfg.linear
    # output_gate: no GGUF key says; config.py takes what llama.cpp's graph of the arch hard-codes
    return deltanet.DeltaNetDims(d_model=cfg.d_model, n_k_heads=d.n_k_heads, n_v_heads=d.n_v_heads,
                                 k_head_dim=d.k_head_dim, v_head_dim=d.v_head_dim, conv_kernel=d.conv_kernel,
                                 rms_eps=cfg.rms_eps, output_gate=d.output_gate, v_head_order=d.v_head_order)


def qsa_dims(cfg: ModelConfig, layer: int):
    ix = cfg.indexer
    return qsa.QSADims(n_heads=ix.n_heads, head_dim=ix.head_dim, budget=ix.budget,
                       compress_ratio=ix.compress_ratios[layer], rope_dim=cfg.rope_dim, rope_theta=cfg.rope_theta,
                       rms_eps=cfg.rms_eps)


def ple_dims(cfg: ModelConfig):
    p = cfg.ple
    return ple.PLEDims(d_model=cfg.d_model, hc_count=cfg.hc_count, row_dim=p.head_dim, ngram_size=p.ngram_size,
                       heads_per_ngram=p.heads_per_ngram, conv_kernel=p.conv_kernel, eos_token_id=p.eos_token_id,
                       layer_multipliers=p.multipliers, head_offsets=p.head_offsets,
                       head_vocab_sizes=p.head_vocab_sizes, rms_eps=cfg.rms_eps, layers=p.layers)


def _fresh(state, fresh_B: jax.Array, zeros):
    """state with the rows where fresh_B holds replaced by `zeros`' (a sequence that restarts)."""
    return jax.tree.map(lambda a, z: jnp.where(fresh_B.reshape((-1,) + (1,) * (a.ndim - 1)), z, a), state, zeros)


def forward(params: HybridParams, experts: ExpertProvider | None, kv, tokens_BT, start_B, n_valid_B, *,
            cfg: ModelConfig, dtype, kernels: Kernels, all_logits: bool = False, attn_len: int | None = None,
            attn_block: int | None = None, forced_MNk: jax.Array | None = None):
    """model/forward.py's forward for the hybrid family (same arguments and results). Routed-expert
    prefetch is not done (qwen4exp: each layer's router input is its own hyper-connection mix, known
    only there): EngineConfig refuses prefetch > 0 for this family, and a provider's prefetch_depth is
    ignored."""
    B, T = tokens_BT.shape
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    # real tokens (model/forward.py's rule): not bucket padding, not an idle row (at a position past the
    # cache); the others look no experts up and come back routed to -1
    valid_N = ((jnp.arange(T)[None, :] < n_valid_B[:, None]) & (pos_BT < kv.length)).reshape(B * T)
    hc = cfg.hc_count > 0  # qwen4exp: hyper-connection streams; the others: a plain residual
    hd = hyper_dims(cfg) if hc else None
    rec = _fresh(kv.rec, start_B == 0, state_zeros(cfg, B, kv.length))
    lin_state, ple_state, qsa_state = list(rec.linear), list(rec.ple), list(rec.qsa)
    lin_idx = {layer: j for j, layer in enumerate(linear_layers(cfg))}
    kv_idx = {layer: j for j, layer in enumerate(cfg.attention_layers)}
    qsa_idx = {layer: j for j, layer in enumerate(qsa_layers(cfg))}
    ple_idx = {layer: j for j, layer in enumerate(cfg.ple.layers if cfg.ple else ())}
    moe_idx = {layer: j for j, layer in enumerate(cfg.moe_layers)}
    k_all, v_all = kv.k_LBSKDh, kv.v_LBSKDh

    x = take_rows(params.embed, tokens_BT, dtype)  # [B, T, D]
    xs = hyper.streams(x, hd) if hc else x  # qwen4exp: [B, T, Hc, D]

    def block_input(xs, hyper_p, norm_D):
        """The sub-block's input and what puts its output back: the hyper-connection mix, or a pre-norm."""
        if hc:
            h, w = hyper.mix(hyper_p, xs, hd, kernels)
            return h, lambda xs, out: hyper.combine(xs, out, w)
        return rms_norm(xs, norm_D, cfg.rms_eps), lambda xs, out: xs + out

    # each layer's own recurrent state (linear, PLE, QSA: None where it has none) travels with its params
    own = [(lin_state[lin_idx[i]] if i in lin_idx else None, ple_state[ple_idx[i]] if i in ple_idx else None,
            qsa_state[qsa_idx[i]] if i in qsa_idx else None) for i in range(cfg.n_layers)]

    def block(carry, layer_own, i):
        """Block i (an int, or a LayerRef inside a scanned run of alike layers: model/runs.py)."""
        xs, k_all, v_all, experts = carry
        layer, (lin, ple_s, qsa_s) = layer_own
        at = layer_ref.first(i)  # the static stand-in: a run's layers share kind, QSA ratio, PLE
        ids = None
        with jax.named_scope(f"layer{i}" if isinstance(i, int) else f"layers{at}+"):
            if at in ple_idx:
                with jax.named_scope("ple"):
                    out, ple_s = ple.apply(layer.ple, xs, tokens_BT, ple_s, n_valid_B=n_valid_B, dims=ple_dims(cfg),
                                           kernels=kernels)
                    xs = (xs.astype(jnp.float32) + out.astype(jnp.float32)).astype(xs.dtype)
            h, put_back = block_input(xs, layer.hc.attn if hc else None, layer.attn_norm_D)
            if at in kv_idx:
                with jax.named_scope("attn"):
                    select = None
                    if at in qsa_idx:
                        select, qsa_s = qsa.apply(layer.attn.indexer, h, qsa_s, start_B=start_B, n_valid_B=n_valid_B,
                                                  dims=qsa_dims(cfg, at), kernels=kernels, attn_len=attn_len)
                    out, k_all, v_all = gated_attention(layer.attn, h, pos_BT, k_all, v_all,
                                                        layer_ref.value(layer_ref.mapped(i, kv_idx)), cfg, kernels,
                                                        attn_len, select, attn_block)
            else:
                with jax.named_scope("linear"):
                    out, lin = deltanet.apply(layer.linear, h, lin, n_valid_B=n_valid_B, dims=deltanet_dims(cfg),
                                              kernels=kernels)
            xs = put_back(xs, out)
            h, put_back = block_input(xs, layer.hc.ffn if hc else None, layer.ffn_norm_D)
            if layer.moe is not None:
                with jax.named_scope("moe"):
                    mi = layer_ref.mapped(i, moe_idx)
                    forced = None if forced_MNk is None else forced_MNk[layer_ref.value(mi)]
                    out, ids, experts = moe_block(layer.moe, experts, mi, h, cfg, kernels, (), None, forced, valid_N)
            else:
                with jax.named_scope("mlp"):
                    out = swiglu(h, layer.mlp, kernels)
            xs = put_back(xs, out)
        return (xs, k_all, v_all, experts), (ids, (lin, ple_s, qsa_s))

    (xs, k_all, v_all, experts), outs = runs.run_layers(
        runs.with_own(params.layers, own), (xs, k_all, v_all, experts), block, detach=runs.detach_provider,
        attach=runs.attach_provider)
    routed = [ids for ids, _ in outs if ids is not None]
    for i, (_, (lin, ple_s, qsa_s)) in enumerate(outs):
        if i in lin_idx:
            lin_state[lin_idx[i]] = lin
        if i in ple_idx:
            ple_state[ple_idx[i]] = ple_s
        if i in qsa_idx:
            qsa_state[qsa_idx[i]] = qsa_s
    with jax.named_scope("head"):
        if not all_logits:
            xs = xs[jnp.arange(B), jnp.maximum(n_valid_B, 1) - 1][:, None]
        if hc:
            x, _ = hyper.mix(params.hc_head, xs, hd, kernels)  # the final mixer: no output norm after it
        else:
            x = rms_norm(xs, params.out_norm_D, cfg.rms_eps)
        logits = lm_head(x, params.lm_head, dtype, kernels)
        if not all_logits:
            logits = logits[:, 0]
    routed_MNk, experts = finish_routing(routed, valid_N, cfg, experts)
    out_kv = type(kv)(k_all, v_all, HybridState(tuple(lin_state), tuple(ple_state), tuple(qsa_state)))
    return logits, out_kv, experts, routed_MNk
