"""The whole-model forward pass of every architecture: one pure function, jitted per (batch, token-bucket)
shape. embed (+ hyper-connection streams) -> blocks -> head, a block being PLE where the layer has it, a
token mixer (attention, MLA, gated attention with QSA, or gated DeltaNet) and a MoE block or MLP, each
behind a pre-norm residual or a hyper-connection mix. Each layer kind is a module of model/layers/
(basic.py: the norms, projections, MLP and head they share); the hybrid family's per-layer params and
state are in model/hybrid.py. The programs that jit this function, and sampling, are in engine/.

Every layer runs inside one program (no Python between layers, no host sync inside a step): alike
layers as one scanned body over their stacked params (model/runs.py), the others unrolled. The KV cache
is donated so its update is in place.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core import layer_ref
from strata_jax.core.experts import ExpertProvider
from strata_jax.gguf.quant import take_rows
from strata_jax.model.config import ModelConfig
from strata_jax.model import hybrid, kvquant, runs
from strata_jax.model.layers import deltanet, hyper, mla, ple, qsa
from strata_jax.model.kvquant import QuantKV, StreamedKV
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.attention import attention, gated_attention
from strata_jax.model.layers.basic import lm_head, rms_norm, swiglu
from strata_jax.model.layers.moe import finish_routing, moe_block, route


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
    their per-row state (hybrid.HybridState), every leaf [L, B, ...] as K and V over the layers of its
    kind (None otherwise, so other models' programs are what they were). K and V are each a plain array
    (kv type f16: the compute dtype) or a kvquant.QuantKV (q8_0, q4_0: quantized on write, dequantized
    where attention reads).
    v_LBSKDh is None where the keys carry the values (deepseek2's latent cache, model/layers/mla.py). All are
    donated and updated in place by the two programs."""

    k_LBSKDh: jax.Array | QuantKV
    v_LBSKDh: jax.Array | QuantKV | None
    rec: Any = None
    mtp: Any = None  # speculative decoding by MTP: model/mtp.py's MTPState (its block's cache, every leaf [1, B, ...])

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype, device=None, kv: str = "f16",
              resident: int | None = None) -> "KVCache":
        """An empty cache; kv: EngineConfig.kv, the storage type of keys and values (kvquant.kinds);
        resident (--kv-resident): K and V streamed, that many positions on the device (kvquant.streamed;
        the whole length is never allocated there)."""
        k_dims, v_dims = cfg.kv_cache_dims
        k_kind, v_kind = kvquant.kinds(kv)

        def make(dims, kind):
            shape = (cfg.n_kv_layers, batch, length, *dims)
            if resident is None:
                return kvquant.zeros(shape, kind, dtype)
            return kvquant.streamed(jax.eval_shape(lambda: kvquant.zeros(shape, kind, dtype)), resident, device)

        rec = None
        if cfg.has_recurrent_state:
            rec = hybrid.state_zeros(cfg, batch, length)
        kv = cls(make(k_dims, k_kind), None if v_dims is None else make(v_dims, v_kind), rec)
        if device is None:
            return kv
        if resident is None:
            return jax.device_put(kv, device)
        return kv.replace(rec=jax.device_put(rec, device))  # streamed leaves are placed (host part included)

    @property
    def length(self) -> int:
        return self.k_LBSKDh.shape[2]

    def take_row(self, row) -> "KVCache":
        """Row `row` (traced) as a batch-1 cache (a streamed leaf's device part: model/kvquant.py)."""
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row, slice_size=1, axis=1)
        return jax.tree.map(lambda a: a.take_row(row) if isinstance(a, StreamedKV) else take(a), self,
                            is_leaf=_streamed)

    def put_row(self, row, one: "KVCache") -> "KVCache":
        """This cache with row `row` replaced by the batch-1 cache `one` (in place when donated)."""
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=row, axis=1)
        return jax.tree.map(lambda a, b: a.put_row(row, b) if isinstance(a, StreamedKV) else put(a, b.astype(a.dtype)),
                            self, one, is_leaf=_streamed)

    def split_host(self) -> tuple["KVCache", tuple]:
        """(the cache without the host part of its streamed leaves (--kv-resident), that part): a program
        takes the host part beside its donated cache and never returns it."""
        (k, kh), (v, vh) = kvquant.split_host(self.k_LBSKDh), kvquant.split_host(self.v_LBSKDh)
        return self.replace(k_LBSKDh=k, v_LBSKDh=v), (kh, vh)

    def join_host(self, host: tuple | None) -> "KVCache":
        if host is None:
            return self
        return self.replace(k_LBSKDh=kvquant.join_host(self.k_LBSKDh, host[0]),
                            v_LBSKDh=kvquant.join_host(self.v_LBSKDh, host[1]))


def _streamed(x) -> bool:
    return isinstance(x, StreamedKV)


class _Span(NamedTuple):
    """The tokens a block runs on (the step's, or one sub-chunk of them: Kernels.prefill_subchunk): their
    positions [B, T], which are real [B*T], where each row starts, how many are valid, which rows start
    fresh (recurrent state from zeros), the forced routing [M, B*T, k] or None."""

    pos_BT: jax.Array
    valid_N: jax.Array
    start_B: jax.Array
    n_valid_B: jax.Array
    fresh_B: jax.Array
    forced_MNk: jax.Array | None

    def sub(self, j, n: int) -> "_Span":
        """Sub-chunk j (traced) of n equal ones."""
        B, T = self.pos_BT.shape
        Ts = T // n
        cut = lambda a: jax.lax.dynamic_slice_in_dim(a, j * Ts, Ts, axis=1)  # noqa: E731
        forced = None
        if self.forced_MNk is not None:
            M, _, k = self.forced_MNk.shape
            forced = cut(self.forced_MNk.reshape(M, B, T, k).transpose(1, 2, 0, 3)).transpose(2, 0, 1, 3)
            forced = forced.reshape(M, B * Ts, k)
        return _Span(cut(self.pos_BT), cut(self.valid_N.reshape(B, T)).reshape(B * Ts), self.start_B + j * Ts,
                     jnp.clip(self.n_valid_B - j * Ts, 0, Ts), self.fresh_B & (j == 0), forced)


class _LayerRows:
    """A many-token MoE step served from one layer's experts already on the device (a layer-major prefill
    streams them once for all its sub-chunks): the provider calls moe_block makes on that path."""

    def __init__(self, rows):
        self.rows = rows

    def few_path(self, moe_idx, n_lookups: int) -> bool:
        return False

    def stream(self, moe_idx, cached: bool = False) -> "_LayerRows":
        return self

    def group(self, moe_idx, first_expert, n: int, cached: bool = False):
        return type(self.rows)(jax.lax.dynamic_slice_in_dim(self.rows.data, first_expert, n), self.rows.parts)

    def layer(self, moe_idx):
        return self.rows

    def card_streamer(self, moe_idx, cached: bool = False):
        return None

    def count(self, moe_idx, **values) -> "_LayerRows":
        return self


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
    tape: bool = False,
    x_BTD: jax.Array | None = None,
    hidden: bool = False,
    head: bool = True,
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
    furthest position needs at run time (model/layers/attention.py attend_blocked): one program for
    every span.
    forced_MNk (int32 [M, B*T, k]): replay these routed experts instead of the routers' choice
    (benchmarks with a synthetic routing trace; prefetch predictions still come from the routers).

    tape (static; models with recurrent state): also return, last, what every recurrent part (DeltaNet,
    QSA indexer, PLE) wrote, stacked per kind as hybrid.HybridState stacks state (hybrid.tape_zeros): what
    hybrid.rewind needs to stop the state after fewer tokens.

    x_BTD: the blocks' input in place of the tokens' embeddings (an MTP block's, model/mtp.py).
    hidden (static; no hyper-connections): also return, last, every position's hidden state after the
    output norm [B, T, D], what the head reads and an MTP block takes as its input. head (static): False
    skips the head (logits None), for a pass that only fills a cache.

    Returns (logits, kv cache, experts, routed expert ids [M, B*T, k], -1 for tokens that are not real). Logits are float32, [B, T, V]
    with all_logits, else [B, V] for each sequence's last valid token.
    """
    B, T = tokens_BT.shape
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    # real tokens: not bucket padding, not an idle row (which runs at a position past the cache)
    valid_N = ((jnp.arange(T)[None, :] < n_valid_B[:, None]) & (pos_BT < kv.length)).reshape(B * T)
    hc = cfg.hc_count > 0  # qwen4exp: hyper-connection streams; the others: a plain residual
    hd = hybrid.hyper_dims(cfg) if hc else None
    n_moe = len(cfg.moe_layers)
    moe_idx = {layer: i for i, layer in enumerate(cfg.moe_layers)}
    kv_idx = {layer: j for j, layer in enumerate(cfg.attention_layers)}
    qsa_idx = set(hybrid.qsa_layers(cfg))
    ple_idx = {layer: j for j, layer in enumerate(cfg.ple.layers if cfg.ple else ())}
    fresh_B = start_B == 0  # rows starting a sequence: their recurrent state starts from zeros
    span = _Span(pos_BT, valid_N, start_B, n_valid_B, fresh_B, forced_MNk)
    few = experts is not None and all(experts.few_path(m, B * T * cfg.n_experts_used) for m in range(n_moe))
    # MoE layers ahead whose experts each layer prefetches (none in the hybrid family: see model/hybrid.py)
    depth = experts.prefetch_depth if few and not cfg.is_hybrid else 0
    predicted: dict[int, jax.Array] = {}  # MoE index -> experts predicted for it by the layer before

    x = take_rows(params.embed, tokens_BT, dtype) if x_BTD is None else x_BTD.astype(dtype)  # [B, T, D]
    xs = hyper.streams(x, hd) if hc else x  # qwen4exp: [B, T, Hc, D]
    taped = hybrid.tape_zeros(cfg, B, T) if tape and cfg.has_recurrent_state else None

    def sub_input(xs, hyper_p, norm_D):
        """A sub-block's input and what puts its output back: the hyper-connection mix, or a pre-norm."""
        if hc:
            h, w = hyper.mix(hyper_p, xs, hd, kernels)
            return h, lambda xs, out: hyper.combine(xs, out, w)
        return rms_norm(xs, norm_D, cfg.rms_eps), lambda xs, out: xs + out

    # the host part of a streamed cache (--kv-resident) stays out of the layers' carry, and out of what
    # forward returns: its arrays are addressed by kernels, and a copy of them would not be
    kv, kv_host = kv.split_host()

    def mixer(sp, layer, h, k_all, v_all, rec, taped, i, at):
        """The token mixer of block i (at: its static stand-in) on the tokens of span sp: attention of the
        layer's kind, or gated DeltaNet. Returns its output, the KV cache, the recurrent state and the tape."""
        if at in kv_idx:
            k_all, v_all = kvquant.join_host(k_all, kv_host[0]), kvquant.join_host(v_all, kv_host[1])
            out, k_all, v_all, rec, taped = token_mixer(sp, layer, h, k_all, v_all, rec, taped, i, at)
            return out, kvquant.split_host(k_all)[0], kvquant.split_host(v_all)[0], rec, taped
        return token_mixer(sp, layer, h, k_all, v_all, rec, taped, i, at)

    def token_mixer(sp, layer, h, k_all, v_all, rec, taped, i, at):
        if at not in kv_idx:
            with jax.named_scope("linear"):
                out, lin, *t = deltanet.apply(layer.linear, h, hybrid.layer_state(cfg, rec, "linear", i, sp.fresh_B,
                                                                                    kernels),
                                              n_valid_B=sp.n_valid_B, dims=cfg.linear, kernels=kernels,
                                              tape=taped is not None)
            if t:
                taped = hybrid.put_layer_state(cfg, taped, "linear", i, t[0], kernels)
            return out, k_all, v_all, hybrid.put_layer_state(cfg, rec, "linear", i, lin, kernels), taped
        with jax.named_scope("attn"):
            if cfg.mla is not None:
                out, k_all = mla.attention(layer.attn, h, sp.pos_BT, k_all, layer_ref.value(i), cfg, kernels,
                                           attn_len, attn_block)
            elif cfg.is_hybrid:
                select = None
                if at in qsa_idx:
                    select, qsa_s, *t = qsa.apply(layer.attn.indexer, h,
                                                  hybrid.layer_state(cfg, rec, "qsa", i, sp.fresh_B, kernels),
                                                  start_B=sp.start_B, n_valid_B=sp.n_valid_B, dims=cfg.qsa[at],
                                                  kernels=kernels, attn_len=attn_len, tape=taped is not None)
                    rec = hybrid.put_layer_state(cfg, rec, "qsa", i, qsa_s, kernels)
                    if t:
                        taped = hybrid.put_layer_state(cfg, taped, "qsa", i, t[0], kernels)
                out, k_all, v_all = gated_attention(layer.attn, h, sp.pos_BT, k_all, v_all,
                                                    layer_ref.value(layer_ref.mapped(i, kv_idx)), cfg, kernels,
                                                    attn_len, select, attn_block)
            else:
                out, k_all, v_all = attention(layer.attn, h, sp.pos_BT, k_all, v_all, i, cfg, kernels, attn_len,
                                              attn_block)
        return out, k_all, v_all, rec, taped

    def ffn(sp, layer, h, xs, experts, i):
        """Block i's MoE block or dense MLP on h (the tokens of span sp); xs: the residual it reads for
        prefetch."""
        if layer.moe is None:
            with jax.named_scope("mlp"):
                return swiglu(h, layer.mlp, kernels), None, experts
        with jax.named_scope("moe"):
            mi = layer_ref.mapped(i, moe_idx)
            pf = []
            for ahead in range(mi + 1, min(mi + 1 + depth, n_moe)) if depth else ():
                # a later MoE layer's router on this residual stream predicts its experts
                nxt = runs.layer_at(params.layers, cfg.moe_layers[ahead])
                h_next = rms_norm(xs, nxt.ffn_norm_D, cfg.rms_eps).reshape(B * T, -1)
                p_ids = route(h_next, nxt.moe.router_ED, cfg, bias_E=nxt.moe.score_bias_E,
                              logit_bias_E=nxt.moe.router_bias_E, kernels=kernels)[1]
                pf.append((ahead, jnp.where(sp.valid_N[:, None], p_ids, -1)))
            if pf:
                predicted[mi + 1] = pf[0][1]  # precision/recall: the next layer's prediction
            forced = None if sp.forced_MNk is None else sp.forced_MNk[layer_ref.value(mi)]
            return moe_block(layer.moe, experts, mi, h, cfg, kernels, tuple(pf),
                             predicted.get(mi) if depth else None, forced, sp.valid_N)

    def enter(carry, i):
        """Before block i when it starts a segment (model/runs.py: a PLE layer always does): its PLE."""
        if i not in ple_idx:
            return carry
        xs, k_all, v_all, rec, taped, experts = carry
        with jax.named_scope(f"layer{i}/ple"):
            out, ple_s, *t = ple.apply(params.ple[ple_idx[i]], xs, tokens_BT,
                                       hybrid.layer_state(cfg, rec, "ple", i, fresh_B, kernels), n_valid_B=n_valid_B,
                                       dims=cfg.ple, kernels=kernels, tape=taped is not None)
            rec = hybrid.put_layer_state(cfg, rec, "ple", i, ple_s, kernels)
            if t:
                taped = hybrid.put_layer_state(cfg, taped, "ple", i, t[0], kernels)
            xs = (xs.astype(jnp.float32) + out.astype(jnp.float32)).astype(xs.dtype)
        return xs, k_all, v_all, rec, taped, experts

    def apply(sp, carry, layer, i, at):
        """Block i on the tokens of span sp."""
        xs, k_all, v_all, rec, taped, experts = carry
        norm = layer.attn_norm_D if cfg.is_hybrid else layer.attn.norm_D
        h, put_back = sub_input(xs, layer.hc.attn if hc else None, norm)
        out, k_all, v_all, rec, taped = mixer(sp, layer, h, k_all, v_all, rec, taped, i, at)
        xs = put_back(xs, out)
        h, put_back = sub_input(xs, layer.hc.ffn if hc else None, layer.ffn_norm_D)
        out, ids, experts = ffn(sp, layer, h, xs, experts, i)
        xs = put_back(xs, out)
        return (xs, k_all, v_all, rec, taped, experts), ids

    # layer-major prefill (Kernels.prefill_subchunk): each block runs the step's tokens as n sub-chunks in
    # turn, its MoE layer's experts streamed once for all of them, so a long chunk streams every expert once
    # while its activations stay those of a sub-chunk
    n_sub = T // kernels.prefill_subchunk if kernels.prefill_subchunk and not few and not tape else 1
    n_sub = n_sub if n_sub > 1 and T % kernels.prefill_subchunk == 0 else 1

    def block(carry, layer, i):
        """Block i (an int, or a LayerRef inside a scanned run of alike layers: model/runs.py)."""
        at = layer_ref.first(i)  # the static stand-in: a run's layers share kind, QSA ratio, window
        with jax.named_scope(f"layer{i}" if isinstance(i, int) else f"layers{at}+"):
            if n_sub == 1:
                return apply(span, carry, layer, i, at)
            xs, k_all, v_all, rec, taped, experts = carry
            rows = None
            if layer.moe is not None:
                mi = layer_ref.mapped(i, moe_idx)
                rows, experts = experts.layer(mi), experts.stream(mi)

            def sub(c, j):
                xs_j = jax.lax.dynamic_slice_in_dim(xs, j * (T // n_sub), T // n_sub, axis=1)
                c, ids = apply(span.sub(j, n_sub), (xs_j, *c, None if rows is None else _LayerRows(rows)), layer, i,
                               at)
                return c[1:5], (c[0], ids)

            (k_all, v_all, rec, taped), (xs_n, ids_n) = jax.lax.scan(sub, (k_all, v_all, rec, taped),
                                                                     jnp.arange(n_sub))
            xs = jnp.moveaxis(xs_n, 0, 1).reshape(xs.shape)  # [n, B, Ts, ...] -> [B, T, ...]
            ids = None
            if ids_n is not None:
                k = ids_n.shape[-1]
                ids = jnp.moveaxis(ids_n.reshape(n_sub, B, -1, k), 0, 1).reshape(B * T, k)
        return (xs, k_all, v_all, rec, taped, experts), ids

    # the recurrent state (hybrid family) travels whole in the carry, as K and V, each block updating its
    # layer's slice in place; prefetch reads later layers' routers by static index: its layers run one by one
    (xs, k_all, v_all, rec, taped, experts), outs = runs.run_layers(
        params.layers, (xs, kv.k_LBSKDh, kv.v_LBSKDh, kv.rec, taped, experts), block, unroll=depth > 0,
        detach=runs.detach_provider, attach=runs.attach_provider, enter=enter)
    routed = [ids for ids in outs if ids is not None]
    h_BTD = None
    with jax.named_scope("head"):
        if hidden:
            if hc:
                raise NotImplementedError("forward(hidden=True): no MTP input is defined with hyper-connections")
            h_BTD = rms_norm(xs, params.out_norm_D, cfg.rms_eps)
        logits = None
        if head:
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
    out = (logits, KVCache(k_all, v_all, rec, kv.mtp), experts, routed_MNk)
    return out + ((taped,) if tape else ()) + ((h_BTD,) if hidden else ())
