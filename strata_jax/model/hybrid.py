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

State (`HybridState`, float32 or int32, fixed shape): per linear layer the DeltaNet conv + delta state,
per PLE layer its n-gram context and conv state, per QSA layer its compressed block keys, each kind
stacked over its layers [L, B, ...]. Rows starting a sequence (start_B == 0) start from fresh state; a
token past n_valid_B (bucket padding, a dead row in decode) changes no state.

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

from strata_jax.core import hostrows, layer_ref
from strata_jax.model.config import ATTENTION, ModelConfig
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers import deltanet, hyper, ple, qsa


@struct.dataclass
class HybridLayerParams:
    """One block of the hybrid family (model/hybrid.py): attention (full, gated) or linear (gated
    DeltaNet), then the MoE block or (qwen35) a dense MLP. qwen4exp: the hyper-connections around both
    sub-blocks (and PLE before a few: HybridParams.ple); the others: the two pre-norms of a plain residual."""

    attn: GatedAttnParams | None
    linear: Any  # model/layers/deltanet.py's DeltaNetParams on linear layers, else None
    hc: Any  # model/layers/hyper.py's LayerHyper (hc_attn_*, hc_ffn_*): qwen4exp, else None
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
    # qwen4exp: model/layers/ple.py's PLEParams (the n-gram table included) per PLE layer (cfg.ple.layers order),
    # kept out of the layers so a PLE layer stacks with its alike layers (the forward runs PLE before it)
    ple: tuple[Any, ...] = ()


def hyper_dims(cfg: ModelConfig) -> hyper.HyperDims:
    return hyper.HyperDims(cfg.hc_count, cfg.hc_rank, cfg.d_model, cfg.rms_eps)


def qsa_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Attention layers with a compress ratio (QSA on): the others attend densely."""
    return tuple(i for i, d in enumerate(cfg.qsa) if d is not None)


def linear_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.n_layers) if cfg.kind(i) != ATTENTION)


def qsa_ratios(cfg: ModelConfig) -> tuple[int, ...]:
    """The distinct compress ratios of the QSA layers: their state is stacked per ratio (its shapes follow it)."""
    return tuple(sorted({cfg.qsa[i].compress_ratio for i in qsa_layers(cfg)}))


def _of_ratio(cfg: ModelConfig, r: int) -> tuple[int, ...]:
    return tuple(i for i in qsa_layers(cfg) if cfg.qsa[i].compress_ratio == r)


@struct.dataclass
class HybridState:
    """Every row's recurrent state, one stack per kind of layer: each field is that kind's per-layer
    state (DeltaNetState, PLEState, QSAState) with every leaf stacked over its layers [L, B, ...], as K
    and V are, so the cache's leaves do not grow with depth. A block reads and writes its own slice
    (`layer_state`, `put_layer_state`) by its index within its kind, traced inside a scanned run."""

    linear: Any  # DeltaNet state of the linear layers (linear_layers order); None without any
    ple: Any  # PLE state of the PLE layers (cfg.ple.layers order); None without any
    qsa: tuple[Any, ...]  # per compress ratio (qsa_ratios order), the QSA state of its layers (qsa_layers order)


def _stack(make, n: int):
    """n layers' state as one stack (None for none): zeros shaped as `make`'s one layer."""
    return jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), jax.eval_shape(make)) if n else None


def state_zeros(cfg: ModelConfig, batch: int, length: int) -> HybridState:
    """Fresh per-row state for `batch` rows of `length` cache positions."""
    lin, ples = linear_layers(cfg), cfg.ple.layers if cfg.ple else ()
    return HybridState(
        linear=_stack(lambda: deltanet.DeltaNetState.zeros(batch, cfg.linear), len(lin)),
        ple=_stack(lambda: ple.PLEState.zeros(batch, cfg.ple), len(ples)),
        qsa=tuple(_stack(lambda: qsa.QSAState.zeros(batch, length, cfg.qsa[_of_ratio(cfg, r)[0]]),
                         len(_of_ratio(cfg, r))) for r in qsa_ratios(cfg)),
    )


def tape_zeros(cfg: ModelConfig, B: int, T: int) -> HybridState:
    """An empty tape of a pass of T tokens over B rows, stacked per kind like state_zeros: per layer what its
    recurrent part wrote (deltanet.DeltaNetTape, the QSA indexer's keys [B, T, Di], PLE's conv inputs
    [B, T, Cc]), what each kind's `rewind` needs to stop its state after a prefix of the tokens."""
    z = lambda *s: jnp.zeros((B, T, *s), jnp.float32)  # noqa: E731
    return HybridState(
        linear=_stack(lambda: deltanet.DeltaNetTape.zeros(B, T, cfg.linear), len(linear_layers(cfg))),
        ple=_stack(lambda: z(cfg.ple.channels), len(cfg.ple.layers) if cfg.ple else 0),
        qsa=tuple(_stack(lambda: z(cfg.qsa[_of_ratio(cfg, r)[0]].head_dim), len(_of_ratio(cfg, r)))
                  for r in qsa_ratios(cfg)),
    )


def rewind(cfg: ModelConfig, before: HybridState, after: HybridState, taped: HybridState, tokens_BT: jax.Array,
           start_B: jax.Array, n_B: jax.Array) -> HybridState:
    """The recurrent state after only the first n_B of a pass's tokens (a speculative pass whose later
    drafts were rejected), from the states before and after it and its tape: each kind's closed form,
    over all its layers at once (no loop over the layers, no weights read). Attention needs none (entries
    past a row's position are never read, and are overwritten)."""
    layers = jax.vmap  # each leaf of a kind's state and tape is stacked over its layers: [L, B, ...]
    return HybridState(
        linear=None if before.linear is None else layers(lambda b, t: deltanet.rewind(b, t, n_B))(
            before.linear, taped.linear),
        ple=None if before.ple is None else layers(lambda b, t: ple.rewind(b, t, tokens_BT, n_B, cfg.ple))(
            before.ple, taped.ple),
        qsa=tuple(layers(lambda b, a, k: qsa.rewind(b, a, k, start_B, n_B))(b, a, k)
                  for b, a, k in zip(before.qsa, after.qsa, taped.qsa)),
    )


def _slot(cfg: ModelConfig, rec: HybridState, kind: str, i) -> tuple[Any, Any, Any]:
    """Where block i's (an int or a LayerRef) state of `kind` ("linear", "ple", "qsa") sits in rec: its
    stack, the stack's index within its field (QSA: the ratio's; else None) and the block's index in the
    stack (traced for a LayerRef; a run's layers share kind and ratio, so one stack holds them all)."""
    at = layer_ref.first(i)
    if kind == "qsa":
        r = cfg.qsa[at].compress_ratio
        g, layers = qsa_ratios(cfg).index(r), _of_ratio(cfg, r)
        stack = rec.qsa[g]
    else:
        g, layers = None, linear_layers(cfg) if kind == "linear" else cfg.ple.layers
        stack = getattr(rec, kind)
    return stack, g, layer_ref.value(layer_ref.mapped(i, {layer: j for j, layer in enumerate(layers)}))


def _row_kernels(kernels: Kernels | None, i) -> bool:
    """Whether block i's slice is read and written by core/hostrows.py's row kernels: inside a scanned run
    (a traced index) where kernels.state_rows asks for them and they build."""
    if kernels is None or not isinstance(i, layer_ref.LayerRef) or kernels.state_rows == "off":
        return False
    if kernels.state_rows == "auto" and kernels.platform != "gpu":
        return False
    return hostrows.available(jax.devices(kernels.platform)[0])


def layer_state(cfg: ModelConfig, rec: HybridState, kind: str, i, fresh_B: jax.Array,
                kernels: Kernels | None = None) -> Any:
    """Block i's state of `kind` (see _slot), the rows where fresh_B holds (a sequence that restarts)
    zeroed: all zeros is every kind's fresh state."""
    stack, _, j = _slot(cfg, rec, kind, i)
    rows = _row_kernels(kernels, i)

    def one(a):
        if rows and hostrows.rows_ok(a):
            a = hostrows.row_get(a, j)
        else:
            a = jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False)
        return jnp.where(fresh_B.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.zeros_like(a), a)

    return jax.tree.map(one, stack)


def put_layer_state(cfg: ModelConfig, rec: HybridState, kind: str, i, state,
                    kernels: Kernels | None = None) -> HybridState:
    """rec with block i's slice of `kind` replaced by `state` (in place in a donated cache or a scan's carry)."""
    stack, g, j = _slot(cfg, rec, kind, i)
    rows = _row_kernels(kernels, i)

    def one(a, v):
        if rows and hostrows.rows_ok(a):
            return hostrows.row_put(a, v, j)
        return jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), j, 0)

    stack = jax.tree.map(one, stack, state)
    if g is not None:
        stack = tuple(stack if h == g else s for h, s in enumerate(rec.qsa))
    return rec.replace(**{kind: stack})
