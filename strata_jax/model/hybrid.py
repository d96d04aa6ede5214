"""The hybrid family (config.HYBRID_ARCHITECTURES: qwen4exp, qwen3next, qwen35moe, qwen35): its params
and per-row recurrent state, carried next to the KV cache (KVCache.rec); model/forward.py runs its
blocks. Heterogeneous layers: gated DeltaNet or gated full attention.

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

Routed-expert prefetch is not done for the family (qwen4exp: each layer's router input is its own
hyper-connection mix, known only there): EngineConfig refuses prefetch > 0, and the forward pass
ignores a provider's prefetch_depth.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.model import deltanet, hyper, ple, qsa
from strata_jax.model.config import ATTENTION, ModelConfig


@struct.dataclass
class HybridLayerParams:
    """One block of the hybrid family (model/hybrid.py): attention (full, gated) or linear (gated
    DeltaNet), then the MoE block or (qwen35) a dense MLP. qwen4exp: the hyper-connections around both
    sub-blocks (and PLE before a few: HybridParams.ple); the others: the two pre-norms of a plain residual."""

    attn: GatedAttnParams | None
    linear: Any  # model/deltanet.py's DeltaNetParams on linear layers, else None
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
    # qwen4exp: model/ple.py's PLEParams (the n-gram table included) per PLE layer (cfg.ple.layers order),
    # kept out of the layers so a PLE layer stacks with its alike layers (the forward runs PLE before it)
    ple: tuple[Any, ...] = ()


def hyper_dims(cfg: ModelConfig) -> hyper.HyperDims:
    return hyper.HyperDims(cfg.hc_count, cfg.hc_rank, cfg.d_model, cfg.rms_eps)


def qsa_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Attention layers with a compress ratio (QSA on): the others attend densely."""
    return tuple(i for i, d in enumerate(cfg.qsa) if d is not None)


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
    return HybridState(
        linear=tuple(deltanet.DeltaNetState.zeros(batch, cfg.linear) for _ in lin),
        ple=tuple(ple.PLEState.zeros(batch, cfg.ple) for _ in (cfg.ple.layers if cfg.ple else ())),
        qsa=tuple(qsa.QSAState.zeros(batch, length, cfg.qsa[i]) for i in qsa_layers(cfg)),
    )


def _fresh(state, fresh_B: jax.Array, zeros):
    """state with the rows where fresh_B holds replaced by `zeros`' (a sequence that restarts)."""
    return jax.tree.map(lambda a, z: jnp.where(fresh_B.reshape((-1,) + (1,) * (a.ndim - 1)), z, a), state, zeros)


def layer_states(cfg: ModelConfig, kv, start_B: jax.Array) -> list[tuple[Any, Any, Any]]:
    """Per layer, its own recurrent state (DeltaNet, PLE, QSA; None where it has none) from kv.rec, rows
    starting a sequence (start_B == 0) reset: what model/forward.py threads through each layer."""
    rec = _fresh(kv.rec, start_B == 0, state_zeros(cfg, start_B.shape[0], kv.length))
    lin = dict(zip(linear_layers(cfg), rec.linear))
    pl = dict(zip(cfg.ple.layers if cfg.ple else (), rec.ple))
    qs = dict(zip(qsa_layers(cfg), rec.qsa))
    return [(lin.get(i), pl.get(i), qs.get(i)) for i in range(cfg.n_layers)]


def gather_states(cfg: ModelConfig, per_layer: list[tuple[Any, Any, Any]]) -> HybridState:
    """layer_states' inverse: the per-layer states back in HybridState's order."""
    return HybridState(tuple(per_layer[i][0] for i in linear_layers(cfg)),
                       tuple(per_layer[i][1] for i in (cfg.ple.layers if cfg.ple else ())),
                       tuple(per_layer[i][2] for i in qsa_layers(cfg)))
