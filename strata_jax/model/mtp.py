"""MTP ("nextn") drafting: a model's own multi-token-prediction block proposes the next tokens for the
verify pass (EngineConfig.spec "mtp"; qwen3next, qwen35*, glm4moe).

As llama.cpp's graph_mtp and its draft-mtp driver run it: the block at position p takes the token x_p
and the trunk's hidden state after the output norm at p - 1, h_{p-1}:
    x = eh_proj @ [enorm(embed(x_p)) | hnorm(h_{p-1})],   h' = shared_head_norm(block(x)),
and its logits head(h') predict x_{p+1}. The block is one attention + FFN layer of its family with a KV
cache of its own, filled for every position the trunk processes (`process`: prefill chunks, verify
passes, decode steps), so that drafting attends to the whole sequence. A draft (`draft`) starts at the
row's next position with its last token and the trunk's hidden state before it, then chains: each drafted
token goes back in with the block's own h'. Entries a draft or a rejected pass wrote past the accepted
position are masked (attention reads only positions up to the query's) and rewritten by the next pass.

The block runs as a one-layer model through model/forward.py (`block_config`, `block_params`): same
attention, MoE routing and kernels as the trunk's layers. Its routed experts are resident: the engine puts
a provider of their own in its params (NextNParams.experts).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.gguf.quant import take_rows
from strata_jax.model import hybrid
from strata_jax.model.config import ATTENTION, ModelConfig
from strata_jax.model.forward import KVCache, Params, forward
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import linear, rms_norm


@struct.dataclass
class MTPState:
    """Every row's MTP state (KVCache.mtp; every leaf has the batch on axis 1, as the KV cache's)."""

    kv: KVCache  # the block's keys and values: one attention layer
    h_1BD: jax.Array  # the trunk's hidden state at the row's last processed position (zeros before any)


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP block as a one-layer model of its family: full attention, its FFN MoE where the trunk's is."""
    if not cfg.n_nextn_layers:
        raise ValueError(f"{cfg.arch}: no MTP block")
    one = dict(n_layers=1, moe_layers=(0,) if cfg.is_moe else (), swa_layers=(), n_nextn_layers=0)
    if cfg.is_hybrid:
        one.update(layer_kinds=(ATTENTION,), qsa=(), ple=None, hc_count=0)
    return dataclasses.replace(cfg, **one)


def block_params(params: Any, j: int = 0) -> Any:
    """MTP block j as the params of a one-layer model: its layer, its head norm and head (else the trunk's)."""
    nx = params.nextn[j]
    norm = nx.shared_head_norm_D if nx.shared_head_norm_D is not None else params.out_norm_D
    head = nx.shared_head if nx.shared_head is not None else params.lm_head
    if isinstance(params, hybrid.HybridParams):
        return hybrid.HybridParams(embed=params.embed, layers=(nx.block,), hc_head=None, lm_head=head, out_norm_D=norm)
    return Params(embed=params.embed, layers=(nx.block,), out_norm_D=norm, lm_head=head)


def state_zeros(cfg: ModelConfig, batch: int, length: int, dtype, kv: str = "f16") -> MTPState:
    """An empty state: the block's cache (kv: its storage, as the trunk's) and zero hidden states."""
    return MTPState(KVCache.zeros(block_config(cfg), batch, length, dtype, kv=kv),
                    jnp.zeros((1, batch, cfg.d_model), dtype))


def _inputs(params: Any, tokens_BT: jax.Array, h_BTD: jax.Array, cfg: ModelConfig, dtype, kernels: Kernels) -> jax.Array:
    """eh_proj @ [enorm(embed(tokens)) | hnorm(h)]: the block's input."""
    nx = params.nextn[0]
    e = take_rows(nx.embed if nx.embed is not None else params.embed, tokens_BT, dtype)
    eh = jnp.concatenate([rms_norm(e, nx.enorm_D, cfg.rms_eps), rms_norm(h_BTD.astype(dtype), nx.hnorm_D, cfg.rms_eps)],
                         axis=-1)
    return linear(eh, nx.eh_proj, kernels)


def process(params: Any, state: MTPState, tokens_BT: jax.Array, h_BTD: jax.Array, start_B: jax.Array,
            n_valid_B: jax.Array, keep_B: jax.Array, *, cfg: ModelConfig, dtype, kernels: Kernels,
            attn_len: int | None = None, attn_block: int | None = None,
            all_logits: bool = False) -> tuple[jax.Array | None, MTPState]:
    """The block over the tokens a trunk pass ran (tokens_BT at start_B.., h_BTD: the trunk's hidden state
    after each): each token paired with the hidden state before it writes the block's cache at its
    position. The row's kept hidden state becomes h_BTD[keep_B] (the last position the sequence keeps:
    a verify pass keeps its accepted tokens only); rows with no valid token keep theirs. all_logits: also
    the block's logits at every position [B, T, V] (else None)."""
    B = tokens_BT.shape[0]
    before_BTD = jnp.concatenate([state.h_1BD[0][:, None].astype(h_BTD.dtype), h_BTD[:, :-1]], axis=1)
    x = _inputs(params, tokens_BT, before_BTD, cfg, dtype, kernels)
    out = forward(block_params(params), params.nextn[0].experts, state.kv, tokens_BT, start_B, n_valid_B,
                  cfg=block_config(cfg), dtype=dtype, kernels=kernels, attn_len=attn_len, attn_block=attn_block,
                  x_BTD=x, all_logits=all_logits, head=all_logits)
    h_BD = h_BTD[jnp.arange(B), jnp.clip(keep_B, 0, h_BTD.shape[1] - 1)]
    h_BD = jnp.where((n_valid_B > 0)[:, None], h_BD.astype(state.h_1BD.dtype), state.h_1BD[0])
    return (out[0] if all_logits else None), MTPState(out[1], h_BD[None])


def draft(params: Any, state: MTPState, tok_B: jax.Array, pos_B: jax.Array, n: int, *, cfg: ModelConfig, dtype,
          kernels: Kernels, attn_len: int | None = None, attn_block: int | None = None) -> tuple[jax.Array, MTPState]:
    """n greedy drafts per row [B, n] after its last token tok_B (at position pos_B, not yet run by the
    trunk), chained through the block's own hidden state; the state with the draft's cache entries."""
    mcfg, mparams = block_config(cfg), block_params(params)
    ones = jnp.ones_like(pos_B)

    def step(carry, j):
        tok, h, kv = carry
        x = _inputs(params, tok[:, None], h[:, None], cfg, dtype, kernels)
        logits_BV, kv, _, _, h_BTD = forward(mparams, params.nextn[0].experts, kv, tok[:, None], pos_B + j, ones,
                                             cfg=mcfg, dtype=dtype, kernels=kernels, attn_len=attn_len,
                                             attn_block=attn_block, x_BTD=x, hidden=True)
        nxt = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        return (nxt, h_BTD[:, 0], kv), nxt

    (_, _, kv), drafts_NB = jax.lax.scan(step, (tok_B, state.h_1BD[0], state.kv), jnp.arange(n, dtype=jnp.int32))
    return drafts_NB.T, MTPState(kv, state.h_1BD)
