"""The MoE block: router (fp32 softmax or sigmoid scores, optional selection bias and expert groups,
top-k, optional renormalisation), routed experts reached through an ExpertProvider
(core/experts.py), and the shared expert (qwen2moe's sigmoid-gated, glm4moe's plain). Pure math:
where the experts' bytes live (resident pools, offloaded slot tables, a test's fake) is the provider's.

Two static code paths, chosen by the provider from the token count (a trace-time constant):
- few tokens (decode): multiply by just the N*k routed experts, read from the provider's pool at their
  slots by the fused dequantize + mat-vec kernel (qmatvec; elsewhere their blocks are gathered and
  dequantized);
- many tokens (prefill): dequantize each of the layer's experts once per chunk, so each expert's bytes
  are read once per chunk rather than once per token; every token runs through every expert, weighted
  by its routing weight, a group of experts at a time (see _experts_dense and _many_token_impl).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core import cards
from strata_jax.core.layer_ref import LayerRef
from strata_jax.core.experts import ExpertProvider, ExpertRows, unique_ids
from strata_jax.gguf.quant import dequant
from strata_jax.model import qmatvec
from strata_jax.model.config import ModelConfig
from strata_jax.model.kernels import Kernels
from strata_jax.model.layers.basic import few_rows_product, reduce_rows, swiglu


@struct.dataclass
class MoEParams:
    router_ED: jax.Array  # float32
    shared: MLPParams | None
    shared_gate_D: jax.Array | None  # qwen2moe: sigmoid(x @ g) scales the shared expert
    score_bias_E: jax.Array | None = None  # exp_probs_b: added to the router's scores to choose experts
    router_bias_E: jax.Array | None = None  # ffn_gate_inp.bias (gpt-oss): added to the router's logits
    # gpt-oss: the routed experts' biases, kept on the device beside the router and read by expert id
    # (never by slot), so they are the same whatever the expert cache holds: gate [E, F], up [E, F],
    # down [E, D]
    expert_bias: tuple[jax.Array, jax.Array, jax.Array] | None = None


def route(x_ND: jax.Array, router_ED: jax.Array, cfg: ModelConfig,
          forced_Nk: jax.Array | None = None, bias_E: jax.Array | None = None,
          logit_bias_E: jax.Array | None = None, kernels: Kernels | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their weights, in float32 (routing decisions are precision-sensitive).
    Scores are the router logits' softmax or sigmoid (cfg.expert_gating); bias_E (exp_probs_b) is added
    to them for the choice only, and the weights are the unbiased scores of the chosen experts. With
    cfg.expert_groups, only experts of the expert_groups_used groups with the highest sum of their two
    best biased scores can be chosen (llama.cpp's build_moe_ffn, DeepSeek-V3's router).
    forced_Nk: use these experts instead of the top-k (benchmarks replaying a routing trace), weighted by
    the router's scores for them. logit_bias_E (gpt-oss's ffn_gate_inp.bias) is part of the router's
    logits. "softmax_weight" gating (gpt-oss): the top-k of the logits, weighted by the softmax of
    just those k. kernels: where its few-row logits are a multiply-and-reduce (basic.reduce_rows)."""
    if kernels is not None and reduce_rows(x_ND.shape[0], kernels):
        logits_NE = few_rows_product(x_ND.astype(jnp.float32), router_ED)
    else:
        logits_NE = jnp.einsum("nd,ed->ne", x_ND.astype(jnp.float32), router_ED, precision="highest")
    if logit_bias_E is not None:
        logits_NE = logits_NE + logit_bias_E
    if cfg.expert_gating == "softmax_weight":
        ids_Nk = jax.lax.top_k(logits_NE, cfg.n_experts_used)[1] if forced_Nk is None else forced_Nk.astype(jnp.int32)
        w_Nk = jax.nn.softmax(jnp.take_along_axis(logits_NE, ids_Nk, axis=-1), axis=-1)
        return w_Nk * cfg.expert_weights_scale, ids_Nk.astype(jnp.int32)
    if cfg.expert_gating == "sigmoid":
        probs_NE = jax.nn.sigmoid(logits_NE)
    else:
        probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    if forced_Nk is None:
        choice_NE = probs_NE if bias_E is None else probs_NE + bias_E
        if cfg.expert_groups > 1:
            N, E, G = choice_NE.shape[0], cfg.n_experts, cfg.expert_groups
            choice_NGe = choice_NE.reshape(N, G, E // G)
            group_NG = jnp.sum(jax.lax.top_k(choice_NGe, 2)[0], axis=-1)
            keep_NG = jnp.zeros((N, G), bool).at[jnp.arange(N)[:, None],
                                                 jax.lax.top_k(group_NG, cfg.expert_groups_used)[1]].set(True)
            choice_NE = jnp.where(keep_NG[:, :, None], choice_NGe, -jnp.inf).reshape(N, E)
        ids_Nk = jax.lax.top_k(choice_NE, cfg.n_experts_used)[1]
    else:
        ids_Nk = forced_Nk.astype(jnp.int32)
    w_Nk = jnp.take_along_axis(probs_NE, ids_Nk, axis=-1)
    if cfg.norm_topk:
        w_Nk = w_Nk / jnp.sum(w_Nk, axis=-1, keepdims=True)
    return w_Nk * cfg.expert_weights_scale, ids_Nk.astype(jnp.int32)


def expert_glu(g: jax.Array, u: jax.Array, cfg: ModelConfig | None = None) -> jax.Array:
    """The routed experts' gated activation of gate and up pre-activations (float32), cfg.expert_act:
    "silu" (or no cfg) is silu(g) * u; "swiglu_oai" (gpt-oss) clamps g above and u on both sides at
    cfg.swiglu_limit, then g * sigmoid(cfg.swiglu_alpha g) * (u + 1) (ggml_swiglu_oai, transformers'
    GptOssExperts)."""
    if cfg is None or cfg.expert_act == "silu":
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, cfg.swiglu_limit)
    u = jnp.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
    return g * jax.nn.sigmoid(cfg.swiglu_alpha * g) * (u + 1.0)


def _dequant_rows(rows: ExpertRows, rows_P: jax.Array, dtype):
    """Dequantized gate, up and down weights of expert rows [..., P]; after this the source may be
    overwritten."""
    return tuple(dequant(t, dtype) for t in rows.split(rows_P))


def _bias_rows(bias, ids):
    """The expert biases (gate, up, down: MoEParams.expert_bias) of experts `ids`, or Nones."""
    return (None,) * 3 if bias is None else tuple(jnp.take(b, ids, axis=0) for b in bias)


def _plus(y, b):
    return y if b is None else y + b


def _apply_experts(x_ND, w_Nk, weights, dtype, cfg=None, bias_Nk=(None,) * 3):
    g_NkFD, u_NkFD, d_NkDF = weights
    bg, bu, bd = bias_Nk
    f32 = jnp.float32
    g = _plus(jnp.einsum("nd,nkfd->nkf", x_ND, g_NkFD, preferred_element_type=f32), bg)
    u = _plus(jnp.einsum("nd,nkfd->nkf", x_ND, u_NkFD, preferred_element_type=f32), bu)
    h = expert_glu(g, u, cfg).astype(dtype)
    y_NkD = _plus(jnp.einsum("nkf,nkdf->nkd", h, d_NkDF, preferred_element_type=f32), bd)
    return jnp.einsum("nkd,nk->nd", y_NkD, w_Nk)


def _routed(x_ND, w_Nk, ids_Nk, slot_Nk, pool: ExpertRows, dtype, kernels: Kernels, cfg=None, bias=None,
            skipping: bool = False):
    """The few-token product of each token's routed experts, read from their slots (their biases, if
    any, by expert id). skipping (mixed precision): a negative slot is a pair this pool does not serve,
    weighted 0; the swiglu kernel skips it (and takes every IQ type then), the other paths read slot 0."""
    if pool.cards is not None:  # a pool split over cards (core/cards.py): each card its slots' pairs, summed
        def local(data_XP, w_Nk, slot_Nk, x_ND, ids_Nk, bias):
            return _routed(x_ND, w_Nk, ids_Nk, slot_Nk, ExpertRows(data_XP, pool.parts), dtype, kernels, cfg, bias,
                           skipping=True)

        return cards.routed_sum(pool.cards, pool.data, local, w_Nk, slot_Nk, x_ND, ids_Nk, bias)
    parts = qmatvec.expert_parts(pool, slot_Nk.size, kernels, skipping)
    bias_Nk = _bias_rows(bias, ids_Nk)
    if parts is not None and (cfg is None or cfg.expert_act == "silu") and bias is None:
        return qmatvec.experts_swiglu(x_ND, w_Nk, slot_Nk, pool.data, parts, dtype, kernels)
    slot_Nk = jnp.maximum(slot_Nk, 0)
    if parts is not None:
        return qmatvec.experts_glu(x_ND, w_Nk, slot_Nk, pool.data, parts, dtype, kernels,
                                   functools.partial(expert_glu, cfg=cfg), bias_Nk)
    return _apply_experts(x_ND, w_Nk, _dequant_rows(pool, jnp.take(pool.data, slot_Nk, axis=0), dtype), dtype,
                          cfg, bias_Nk)


PREFILL_GROUP_BYTES = 1 << 30  # transient bytes of one group of experts in the prefill's scan


def _prefill_group(n_tokens: int, n_experts: int, ffn_dim: int, d_model: int, dtype) -> int:
    """Experts per step of the dense prefill's scan: the largest power of two dividing the expert count
    whose dequantized weights and float32 gate/up activations stay within PREFILL_GROUP_BYTES."""
    per_expert = _prefill_expert_bytes(n_tokens, ffn_dim, d_model, jnp.dtype(dtype).itemsize)
    g = 1
    while g * 2 <= n_experts and n_experts % (g * 2) == 0 and (g * 2) * per_expert <= PREFILL_GROUP_BYTES:
        g *= 2
    return g


def _prefill_expert_bytes(n_tokens: int, ffn_dim: int, d_model: int, itemsize: int) -> int:
    """One expert's share of a prefill scan step: its dequantized gate, up and down, and its float32
    gate/up activations (and their product in the compute dtype) for every token."""
    return 3 * ffn_dim * d_model * itemsize + n_tokens * ffn_dim * (2 * 4 + itemsize)


def prefill_group_bytes(n_tokens: int, n_experts: int, ffn_dim: int, d_model: int, dtype=jnp.bfloat16) -> int:
    """Bytes of one step of the dense prefill's scan over experts (the memory planner's share for it)."""
    g = _prefill_group(n_tokens, n_experts, ffn_dim, d_model, dtype)
    return g * _prefill_expert_bytes(n_tokens, ffn_dim, d_model, jnp.dtype(dtype).itemsize)


def _group_weights(experts: ExpertProvider, moe_idx: int, first: jax.Array, n: int, dtype, bias, cached=False):
    """Experts first .. first + n - 1 of a prefill's scan step: their gate, up and down weights dequantized
    (offloaded, copied from the host store in that step; cached: only those the cache does not hold) and
    their biases (Nones without)."""
    rows = experts.group(moe_idx, first, n, cached)
    biases = (None,) * 3 if bias is None else tuple(jax.lax.dynamic_slice_in_dim(b, first, n) for b in bias)
    return _dequant_rows(rows, rows.data, dtype), biases


def _experts_dense(x_ND, w_Nk, ids_Nk, experts: ExpertProvider, moe_idx: int, dtype, n_experts: int, ffn_dim: int,
                   cfg: ModelConfig | None = None, bias=None, cached: bool = False, part=None):
    """Every token through every expert, weighted by its routing weight (zero where it did not route):
    E/k times the multiply-adds of the routed products, but as large plain GEMMs, deterministic (each
    weight lands on zero once), and in bounded memory: a scan over groups of experts (_prefill_group)
    dequantizes one group at a time, and the weight is applied before the down projection so no
    [tokens, experts, D] tensor exists. (XLA:GPU may expand ragged_dot into padded dense operands, and
    its scatter-add of the rows sums in no fixed order: docs/benchmarks.md.)

    Each scan step asks the provider for its group's rows (`group`): offloaded, they are copied from
    the host store in that step, so the device holds one group's bytes, never the layer's (a whole
    streamed layer per MoE layer could be copied early for every layer at once and exhaust memory).
    cfg, bias: the experts' activation (expert_glu) and biases (MoEParams.expert_bias); a down bias
    is weighted by the routing weight as its expert's output is.
    part: (card, cards, total) on several cards (_prefill_experts): this card's share of the groups."""
    N = x_ND.shape[0]
    f32 = jnp.float32
    combine_NE = jnp.zeros((N, n_experts), f32).at[jnp.arange(N)[:, None], ids_Nk].add(w_Nk)
    J = _group_size(_experts_dense, N, ids_Nk.shape[1], n_experts, ffn_dim, x_ND.shape[1], dtype)
    first_C = jnp.arange(0, n_experts, J, dtype=jnp.int32)  # C groups of J consecutive experts
    combine_CNJ = combine_NE.reshape(N, -1, J).transpose(1, 0, 2)
    first_C, combine_CNJ = _share(part, first_C, combine_CNJ)

    def group(acc_ND, xs):
        first, combine_NJ = xs
        (g_JFD, u_JFD, d_JDF), (bg, bu, bd) = _group_weights(experts, moe_idx, first, J, dtype, bias, cached)
        g = _plus(jnp.einsum("nd,gfd->ngf", x_ND, g_JFD, preferred_element_type=f32), bg)
        u = _plus(jnp.einsum("nd,gfd->ngf", x_ND, u_JFD, preferred_element_type=f32), bu)
        h = expert_glu(g, u, cfg) * combine_NJ[:, :, None]
        acc_ND = acc_ND + jnp.einsum("ngf,gdf->nd", h.astype(dtype), d_JDF, preferred_element_type=f32)
        if bd is not None:
            acc_ND = acc_ND + jnp.einsum("ng,gd->nd", combine_NJ, bd, precision="highest")
        return acc_ND, None

    return _total(part, jax.lax.scan(group, jnp.zeros((N, x_ND.shape[1]), f32), (first_C, combine_CNJ))[0])


def _experts_blocked(x_ND, w_Nk, ids_Nk, experts: ExpertProvider, moe_idx: int, dtype, n_experts: int, ffn_dim: int,
                     cfg: ModelConfig | None = None, bias=None, cached: bool = False, part=None):
    """Every (token, expert) pair computed once, within the dense path's scan over streamed groups of
    experts: the pairs sorted by expert, each expert of a group multiplies a block of up to `cap` of its
    rows (one batched GEMM over the group's experts), and a group holding a busier expert takes more
    rounds of blocks. About E/k times fewer multiply-adds than _experts_dense, plus the blocks' padding
    (cap is twice the mean rows per expert). Deterministic: each pair's row is written once and each
    token's k rows are summed in routing order."""
    N, k = ids_Nk.shape
    D, P, f32 = x_ND.shape[1], N * k, jnp.float32
    flat = ids_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the pairs, sorted by expert
    sizes_E = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    tok_P, w_P = (order // k).astype(jnp.int32), w_Nk.reshape(-1)[order]
    cap = _block_rows(N, k, n_experts)
    J = _group_size(_experts_blocked, N, k, n_experts, ffn_dim, D, dtype)

    def group(y_PD, first):
        (g_JFD, u_JFD, d_JDF), (bg, bu, bd) = _group_weights(experts, moe_idx, first, J, dtype, bias, cached)
        size_J, start_J = (jax.lax.dynamic_slice_in_dim(a, first, J) for a in (sizes_E, starts_E))

        def block(r, y_PD):
            i_JC = r * cap + jnp.arange(cap, dtype=jnp.int32)[None, :]
            at_JC = jnp.where(i_JC < size_J[:, None], start_J[:, None] + i_JC, P)  # P: past the end, dropped
            x_JCD = jnp.take(x_ND, jnp.take(tok_P, at_JC, mode="fill", fill_value=0), axis=0)
            w_JC = jnp.take(w_P, at_JC, mode="fill", fill_value=0)
            g = jnp.einsum("jcd,jfd->jcf", x_JCD, g_JFD, preferred_element_type=f32)
            u = jnp.einsum("jcd,jfd->jcf", x_JCD, u_JFD, preferred_element_type=f32)
            if bg is not None:
                g, u = g + bg[:, None], u + bu[:, None]
            h = expert_glu(g, u, cfg) * w_JC[:, :, None]
            y = jnp.einsum("jcf,jdf->jcd", h.astype(dtype), d_JDF, preferred_element_type=f32)
            if bd is not None:
                y = y + w_JC[:, :, None] * bd[:, None]
            return y_PD.at[at_JC.reshape(-1)].set(y.reshape(-1, D), mode="drop")

        return jax.lax.fori_loop(0, (jnp.max(size_J) + cap - 1) // cap, block, y_PD), None

    first_C, = _share(part, jnp.arange(0, n_experts, J, dtype=jnp.int32))
    y_PD = _total(part, jax.lax.scan(group, jnp.zeros((P, D), f32), first_C)[0])  # each pair's row from one card
    return _sum_pairs(y_PD, order, N, k)


def _block_rows(N: int, k: int, n_experts: int) -> int:
    """_experts_blocked's rows per block of an expert: twice the mean rows per expert, a multiple of 8."""
    return min(N, 8 * -(-2 * N * k // (8 * n_experts)))


def _group_size(impl, N: int, k: int, n_experts: int, ffn_dim: int, d_model: int, dtype) -> int:
    """Experts per step of a prefill formulation's scan over groups."""
    rows = _block_rows(N, k, n_experts) if impl is _experts_blocked else N
    return _prefill_group(rows, n_experts, ffn_dim, d_model, dtype)


def _share(part, *xs):
    """This card's share of a scan's groups (leading axis cut into `cards` equal parts), or all of them."""
    if part is None:
        return xs
    card, n, _ = part
    return tuple(jax.lax.dynamic_index_in_dim(x.reshape(n, -1, *x.shape[1:]), card, 0, keepdims=False) for x in xs)


def _total(part, x):
    return x if part is None else part[2](x)


def _prefill_experts(impl, x_ND, w_Nk, ids_Nk, experts: ExpertProvider, moe_idx, dtype, n_experts: int,
                     ffn_dim: int, cfg: ModelConfig, bias, cached: bool):
    """A many-token formulation over groups of experts (dense or blocked). Offloaded over several cards
    (core/cards.py), each card streams and multiplies its share of the groups over its own PCIe link and one
    sum over the cards joins them; where the groups do not divide by the cards, every card runs them all."""
    split = experts.card_streamer(moe_idx, cached)
    N, k = ids_Nk.shape
    if split is None or n_experts // _group_size(impl, N, k, n_experts, ffn_dim, x_ND.shape[1], dtype) % split[0].size:
        return impl(x_ND, w_Nk, ids_Nk, experts, moe_idx, dtype, n_experts, ffn_dim, cfg, bias, cached)
    mesh, streamer = split
    at = moe_idx.at if isinstance(moe_idx, LayerRef) else None  # a scanned run's traced layer, as an operand

    def local(card, n, x_ND, w_Nk, ids_Nk, streamer, bias, at):
        idx = moe_idx if at is None else LayerRef(moe_idx.ids, at)
        return impl(x_ND, w_Nk, ids_Nk, streamer, idx, dtype, n_experts, ffn_dim, cfg, bias, False,
                    part=(card, n, cards.total))

    return cards.on_every_card(mesh, local, x_ND, w_Nk, ids_Nk, streamer, bias, at)


def _experts_grouped(x_ND, w_Nk, ids_Nk, rows_E: ExpertRows, dtype, n_experts: int, cfg: ModelConfig | None = None,
                     bias=None):
    """Every (token, expert) pair computed once: the N*k pairs sorted by expert and multiplied group by
    group (ragged_dot), each expert's weights dequantized once per chunk. The dense alternative (all
    tokens through all experts, masked) does E/k times the work: 51x for 512 experts top-10.
    rows_E: all the layer's experts on the device, row e = expert e."""
    N, k = ids_Nk.shape
    f32 = jnp.float32
    flat = ids_Nk.reshape(-1)  # N*k pairs, one per (token, routed expert)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes_E = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    x_sorted = x_ND[tok]
    g_EFD, u_EFD, d_EDF = _dequant_rows(rows_E, rows_E.data, dtype)
    rdot = functools.partial(jax.lax.ragged_dot, group_sizes=sizes_E, preferred_element_type=f32)
    bg, bu, bd = _bias_rows(bias, flat[order])
    h = expert_glu(_plus(rdot(x_sorted, g_EFD.transpose(0, 2, 1)), bg), _plus(rdot(x_sorted, u_EFD.transpose(0, 2, 1)), bu),
                   cfg)
    y = _plus(rdot(h.astype(dtype), d_EDF.transpose(0, 2, 1)), bd) * w_Nk.reshape(-1)[order][:, None]
    return _sum_pairs(y, order, N, k)


def _sum_pairs(y_PD, order, N: int, k: int):
    """Each token's sum of its k pair rows y_PD (in `order`, the pairs sorted by expert), summed in routing
    order: a scatter-add's order is not fixed on a GPU, and the last bits of the sum with it."""
    at_Nk = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype)).reshape(N, k)
    return jnp.sum(y_PD[at_Nk], axis=1)


def _many_token_impl(kernels: Kernels):
    """The prefill MoE formulation, Kernels.moe_prefill: dense (_experts_dense) by default; blocked
    (_experts_blocked: each pair once, in blocks of rows per expert) or grouped (tokens sorted by expert,
    ragged_dot) on request. Grouped does E/k times fewer multiply-adds, but ragged_dot has only a slow
    reference lowering on CPU and XLA:GPU may expand it into padded dense operands (slower, and out of
    memory under a budget): figures in docs/benchmarks.md."""
    return {"grouped": _experts_grouped, "blocked": _experts_blocked}.get(kernels.moe_prefill, _experts_dense)


def finish_routing(routed: list[jax.Array], valid_N: jax.Array, cfg: ModelConfig,
                   experts: ExpertProvider | None) -> tuple[jax.Array, ExpertProvider | None]:
    """After the layer loop: int32 [M, N, k], every MoE layer's routed experts for the step's N tokens, -1
    for the tokens that are not real (bucket padding, idle rows), as the host's trace takes them; and the
    provider once it has counted them (ExpertProvider.finish)."""
    if not routed:
        routed_MNk = jnp.zeros((0, valid_N.shape[0], max(cfg.n_experts_used, 1)), jnp.int32)
    else:
        routed_MNk = jnp.where(valid_N[None, :, None], jnp.stack(routed), -1)
    return routed_MNk, experts.finish(routed_MNk) if experts is not None else None


def moe_block(
    p: MoEParams, experts: ExpertProvider, moe_idx: int, x_BTD: jax.Array, cfg: ModelConfig, kernels: Kernels,
    prefetch: tuple[tuple[int, jax.Array], ...] = (), predicted_Nk: jax.Array | None = None,
    forced_Nk: jax.Array | None = None, valid_N: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, ExpertProvider]:
    """Returns the block output, the routed expert ids [N, k], and the updated provider (its counters
    included).

    prefetch = ((later MoE layer, its predicted expert ids), ...): once this layer's output is
    computed, the provider admits and fetches the predicted experts for those layers (nearest first).
    predicted_Nk: what the previous layer predicted for this one (counted for precision/recall).
    forced_Nk: experts to use instead of the router's top-k (see route).
    valid_N: which tokens are real (None: all); the others' experts are not looked up (ExpertProvider).
    """
    B, T, D = x_BTD.shape
    dtype = x_BTD.dtype
    N, k, E = B * T, cfg.n_experts_used, cfg.n_experts
    x_ND = x_BTD.reshape(N, D)
    w_Nk, ids_Nk = route(x_ND, p.router_ED, cfg, forced_Nk, p.score_bias_E, p.router_bias_E, kernels)
    bias = p.expert_bias
    if experts.few_path(moe_idx, N * k):
        experts, pool, slot_Nk, cold = experts.lookup(moe_idx, ids_Nk, valid_N)
        if cold is None:
            out_ND = _routed(x_ND, w_Nk, ids_Nk, slot_Nk, pool, dtype, kernels, cfg, bias)
        else:  # mixed precision: each routed expert from its pool; the other pool skips it (weight 0)
            rows, row_Nk, cold_Nk = cold
            out_ND = (_routed(x_ND, jnp.where(cold_Nk, 0.0, w_Nk), ids_Nk, jnp.where(cold_Nk, -1, slot_Nk), pool,
                              dtype, kernels, cfg, bias, skipping=True)
                      + _routed(x_ND, jnp.where(cold_Nk, w_Nk, 0.0), ids_Nk, jnp.where(cold_Nk, row_Nk, -1), rows,
                                dtype, kernels, cfg, bias, skipping=True))
        experts, out_ND = experts.prefetch(moe_idx, prefetch, out_ND)
    else:
        impl = _many_token_impl(kernels)
        cached = kernels.prefill_cached == "on" and impl is not _experts_grouped  # Kernels.prefill_cached
        experts = experts.stream(moe_idx, cached)
        if impl is not _experts_grouped:
            out_ND = _prefill_experts(impl, x_ND, w_Nk, ids_Nk, experts, moe_idx, dtype, E, cfg.expert_ffn_dim, cfg,
                                      bias, cached)
        else:
            out_ND = _experts_grouped(x_ND, w_Nk, ids_Nk, experts.layer(moe_idx), dtype, E, cfg, bias)
    if predicted_Nk is not None:
        actual_U, pred_U = unique_ids(ids_Nk, E), unique_ids(predicted_Nk, E)
        pred_hit = jnp.sum((pred_U[:, None] == actual_U[None, :]) & (pred_U[:, None] >= 0)).astype(jnp.int32)
        experts = experts.count(moe_idx, predicted_routed=pred_hit, predicted=jnp.sum(pred_U >= 0).astype(jnp.int32))
    if p.shared is not None:
        shared_ND = swiglu(x_ND, p.shared, kernels).astype(jnp.float32)
        if p.shared_gate_D is not None:
            gate_N1 = jax.nn.sigmoid(jnp.einsum("nd,d->n", x_ND.astype(jnp.float32), p.shared_gate_D))[:, None]
            shared_ND = shared_ND * gate_N1
        out_ND = out_ND + shared_ND
    return out_ND.astype(dtype).reshape(B, T, D), ids_Nk, experts
