"""The MoE block over the slot table: router (fp32 softmax, top-k, optional renormalisation), routed
experts read from their slots, and qwen2moe's sigmoid-gated shared expert.

Two static code paths, chosen by the token count (a trace-time constant):
- few tokens (decode): multiply by just the N*K routed experts, read from their slots by the fused
  dequantize + mat-vec kernel (qmatvec; elsewhere their blocks are gathered and dequantized); when the cache
  does not hold every expert, the policy first decides hits, misses and victims, and the misses are
  DMA'd from the pinned-host store into their slots (all inside the jitted step: no host sync);
- many tokens (prefill): dequantize each of the layer's experts once per chunk, so each expert's bytes
  are read once per chunk rather than once per token; every token runs through every expert, weighted
  by its routing weight, a group of experts at a time (see _experts_dense and _many_token_impl); with
  offloading, the layer's experts are streamed from the host once per chunk.

Shape legend: N tokens (B*T flattened), D model dim, E experts, K experts per token, F expert ffn dim.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from strata_jax.model import qmatvec
from strata_jax.model.config import ModelConfig
from strata_jax.model.layers import swiglu
from strata_jax.model.weights import MoEParams
from strata_jax.offload.fetch import fetch_misses, stream_layer, to_device
from strata_jax.offload.policies import Policy
from strata_jax.offload.slot_table import SlotTable
from strata_jax.offload.store import ExpertStore


def route(x_ND: jax.Array, router_ED: jax.Array, cfg: ModelConfig,
          forced_NK: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their weights, in float32 (routing decisions are precision-sensitive).
    forced_NK: use these experts instead of the top-k (benchmarks replaying a routing trace), weighted by
    the router's probabilities for them."""
    logits_NE = jnp.einsum("nd,ed->ne", x_ND.astype(jnp.float32), router_ED, precision="highest")
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    if forced_NK is None:
        w_NK, ids_NK = jax.lax.top_k(probs_NE, cfg.n_experts_used)
    else:
        ids_NK = forced_NK.astype(jnp.int32)
        w_NK = jnp.take_along_axis(probs_NE, ids_NK, axis=-1)
    if cfg.norm_topk:
        w_NK = w_NK / jnp.sum(w_NK, axis=-1, keepdims=True)
    return w_NK * cfg.expert_weights_scale, ids_NK.astype(jnp.int32)


def _gather_experts(pool, slot_NK, dtype):
    """Dequantized copies of the routed experts' weights; after this the pool may be overwritten."""
    return tuple(t.dequant(dtype) for t in pool.take(slot_NK))


def _apply_experts(x_ND, w_NK, weights, dtype):
    g_NKFD, u_NKFD, d_NKDF = weights
    f32 = jnp.float32
    h = jax.nn.silu(jnp.einsum("nd,nkfd->nkf", x_ND, g_NKFD, preferred_element_type=f32))
    h = (h * jnp.einsum("nd,nkfd->nkf", x_ND, u_NKFD, preferred_element_type=f32)).astype(dtype)
    y_NKD = jnp.einsum("nkf,nkdf->nkd", h, d_NKDF, preferred_element_type=f32)
    return jnp.einsum("nkd,nk->nd", y_NKD, w_NK)


def _routed(x_ND, w_NK, slot_NK, pool, dtype):
    """The few-token product of each token's routed experts, read from their slots."""
    parts = qmatvec.expert_parts(pool, slot_NK.size)
    if parts is not None:
        return qmatvec.experts_swiglu(x_ND, w_NK, slot_NK, pool.data, parts, dtype)
    return _apply_experts(x_ND, w_NK, _gather_experts(pool, slot_NK, dtype), dtype)


PREFILL_GROUP_BYTES = 1 << 30  # transient bytes of one group of experts in the prefill's scan


def _prefill_group(n_tokens: int, n_experts: int, pool, dtype) -> int:
    """Experts per step of the dense prefill's scan: the largest power of two dividing the expert count
    whose dequantized weights and float32 gate/up activations stay within PREFILL_GROUP_BYTES."""
    _, f, _, d = pool.parts[0]  # the gate projection: (GGML type, rows = ffn dim, row bytes, columns = D)
    per_expert = 3 * f * d * jnp.dtype(dtype).itemsize + n_tokens * f * (2 * 4 + jnp.dtype(dtype).itemsize)
    g = 1
    while g * 2 <= n_experts and n_experts % (g * 2) == 0 and (g * 2) * per_expert <= PREFILL_GROUP_BYTES:
        g *= 2
    return g


def _experts_dense(x_ND, w_NK, ids_NK, slot_E, pool, dtype, n_experts, from_host: bool = False):
    """Every token through every expert, weighted by its routing weight (zero where it did not route):
    E/K times the multiply-adds of the routed products, but as large plain GEMMs, deterministic (each
    weight lands on zero once), and in bounded memory: a scan over groups of experts (_prefill_group)
    dequantizes one group at a time, and the weight is applied before the down projection so no
    [tokens, experts, D] tensor exists. (ragged_dot on the H200 was expanded by XLA into padded dense
    operands: a 512-token BSEED chunk asked for 10 GiB under a 32 GiB cap; its scatter-add of the rows
    also made prefill non-deterministic.)

    from_host (offloading): pool is the layer's rows in the host store, slot_E the expert ids; each
    group's rows are copied in by its scan step, so the device holds one group's bytes, never the
    layer's (a whole streamed layer, 0.86 GiB for BSEED, could be copied early for every layer at once:
    the 48-layer BSEED prefill asked for 5.7 GiB of temporaries under a 32 GiB cap and ran out of
    memory)."""
    N = x_ND.shape[0]
    f32 = jnp.float32
    combine_NE = jnp.zeros((N, n_experts), f32).at[jnp.arange(N)[:, None], ids_NK].add(w_NK)
    G = _prefill_group(N, n_experts, pool, dtype)
    slot_CG = slot_E.reshape(-1, G)  # C groups of G experts
    combine_CNG = combine_NE.reshape(N, -1, G).transpose(1, 0, 2)

    def group(acc_ND, xs):
        slot_G, combine_NG = xs
        if from_host:  # groups are consecutive expert ids: slot_G[0] is the first
            rows = to_device(jax.lax.dynamic_slice_in_dim(pool.data, slot_G[0], G, axis=0))
            g_GFD, u_GFD, d_GDF = (t.dequant(dtype) for t in pool.split(rows))
        else:
            g_GFD, u_GFD, d_GDF = _gather_experts(pool, slot_G, dtype)
        h = jax.nn.silu(jnp.einsum("nd,gfd->ngf", x_ND, g_GFD, preferred_element_type=f32))
        h = h * jnp.einsum("nd,gfd->ngf", x_ND, u_GFD, preferred_element_type=f32) * combine_NG[:, :, None]
        return acc_ND + jnp.einsum("ngf,gdf->nd", h.astype(dtype), d_GDF, preferred_element_type=f32), None

    return jax.lax.scan(group, jnp.zeros((N, x_ND.shape[1]), f32), (slot_CG, combine_CNG))[0]


def _experts_grouped(x_ND, w_NK, ids_NK, slot_E, pool, dtype, n_experts):
    """Every (token, expert) pair computed once: the N*K rows sorted by expert and multiplied group by
    group (ragged_dot), each expert's weights dequantized once per chunk. The dense alternative (all
    tokens through all experts, masked) does E/K times the work: 51x for 512 experts top-10."""
    N, K = ids_NK.shape
    f32 = jnp.float32
    flat_R = ids_NK.reshape(-1)  # R = N*K rows, one per (token, routed expert)
    order_R = jnp.argsort(flat_R, stable=True)
    tok_R = order_R // K
    sizes_E = jnp.bincount(flat_R, length=n_experts).astype(jnp.int32)
    x_RD = x_ND[tok_R]
    g_EFD, u_EFD, d_EDF = _gather_experts(pool, slot_E, dtype)
    rdot = functools.partial(jax.lax.ragged_dot, group_sizes=sizes_E, preferred_element_type=f32)
    h_RF = jax.nn.silu(rdot(x_RD, g_EFD.transpose(0, 2, 1))) * rdot(x_RD, u_EFD.transpose(0, 2, 1))
    y_RD = rdot(h_RF.astype(dtype), d_EDF.transpose(0, 2, 1)) * w_NK.reshape(-1)[order_R][:, None]
    return jnp.zeros((N, x_ND.shape[1]), f32).at[tok_R].add(y_RD)


def _many_token_impl():
    """The prefill MoE formulation: dense (_experts_dense) everywhere by default; grouped (tokens sorted by
    expert, ragged_dot) on request, STRATA_JAX_MOE_PREFILL=grouped|dense (read at trace time). Grouped
    does E/K times fewer multiply-adds, but ragged_dot has only a slow reference lowering on CPU (512
    tokens, 64 experts top-8: 45 tok/s against 330 dense) and XLA:GPU expanded it into padded dense
    operands on the H200 (B30 prefill 1,305 tok/s; BSEED ran out of memory under a 32 GiB cap)."""
    choice = os.environ.get("STRATA_JAX_MOE_PREFILL") or "dense"
    if choice not in ("grouped", "dense"):
        raise ValueError(f"STRATA_JAX_MOE_PREFILL={choice!r}: use 'grouped' or 'dense'")
    return _experts_grouped if choice == "grouped" else _experts_dense


N_STATS = 6  # hits, misses, streamed experts, prefetched experts, predicted-and-routed, predicted


def _unique(ids_NK: jax.Array, n_experts: int) -> jax.Array:
    """The distinct ids in first-occurrence (router) order, -1 padded to min(N*K, E): the order a policy
    sees them in, as simulate's unique_requests gives them (LRU breaks ties within a step by it).
    Quadratic in N*K, which the few-token path bounds by the expert count."""
    flat, first = _first_occurrences(ids_NK)
    order = jnp.argsort(~first, stable=True)
    return jnp.where(first[order], flat[order], -1)[: min(flat.shape[0], n_experts)]


def _first_occurrences(ids_NK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ids flattened, and whether each is the first of its value."""
    flat = ids_NK.reshape(-1)
    n = flat.shape[0]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    return flat, ~jnp.any((flat[:, None] == flat[None, :]) & earlier, axis=1)


def _n_distinct(ids_NK: jax.Array) -> jax.Array:
    """How many distinct ids (what _unique counts, without its sort)."""
    return jnp.sum(_first_occurrences(ids_NK)[1]).astype(jnp.int32)


def resident_hits(routed_MNk: jax.Array) -> jax.Array:
    """int32 [M]: the distinct experts each MoE layer looked up in a few-token step of a resident cache,
    counted like the offloading path's hits (unique experts per step)."""
    return jax.vmap(_n_distinct)(routed_MNk)


def _access_and_fetch(slots: SlotTable, store: ExpertStore, moe_idx: int, ids_U: jax.Array, policy: Policy):
    """Run the policy for MoE layer `moe_idx` and DMA its misses into their slots."""
    pool_i, local = slots.layer_pool[moe_idx], slots.layer_local[moe_idx]
    cache, plan = policy.access(slots.caches[pool_i], local, ids_U)
    pool = fetch_misses(slots.pools[pool_i], store.layers[moe_idx], plan)
    slots = dataclasses.replace(
        slots,
        pools=tuple(pool if i == pool_i else q for i, q in enumerate(slots.pools)),
        caches=tuple(cache if i == pool_i else c for i, c in enumerate(slots.caches)),
    )
    return slots, plan


def moe_block(
    p: MoEParams, slots: SlotTable, store: ExpertStore | None, moe_idx: int, x_BTD: jax.Array, cfg: ModelConfig,
    policy: Policy | None, prefetch: tuple[tuple[int, jax.Array], ...] = (), predicted_NK: jax.Array | None = None,
    forced_NK: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, SlotTable, jax.Array]:
    """Returns the block output, the routed expert ids [N, k], the updated slot table, and this layer's
    counters int32 [N_STATS].

    prefetch = ((later MoE layer, its predicted expert ids), ...): once this layer's experts are
    gathered, the predicted ones are admitted and fetched for those layers (nearest first).
    predicted_NK: what the previous layer predicted for this one (for precision/recall).
    forced_NK: experts to use instead of the router's top-k (see route).
    """
    B, T, D = x_BTD.shape
    dtype = x_BTD.dtype
    N, K, E = B * T, cfg.n_experts_used, cfg.n_experts
    x_ND = x_BTD.reshape(N, D)
    w_NK, ids_NK = route(x_ND, p.router_ED, cfg, forced_NK)
    zero = jnp.zeros((), jnp.int32)
    hits = misses = streamed = prefetched = zero
    few = slots.few_path(moe_idx, N * K, E)
    if slots.resident:
        # a resident pool holds expert e in slot e (resident_slot_table): no lookup. Every lookup hits;
        # forward counts them for all layers at once (resident_hits), not with a few kernels per layer
        pool = slots.pools[slots.layer_pool[moe_idx]]
        if few:
            out_ND = _routed(x_ND, w_NK, ids_NK, pool, dtype)
        else:
            out_ND = _many_token_impl()(x_ND, w_NK, ids_NK, jnp.arange(E, dtype=jnp.int32), pool, dtype, E)
    elif few:
        slots, plan = _access_and_fetch(slots, store, moe_idx, _unique(ids_NK, E), policy)
        pool = slots.pools[slots.layer_pool[moe_idx]]
        out_ND = _routed(x_ND, w_NK, slots.slot_map(moe_idx)[ids_NK], pool, dtype)
        if prefetch:
            # Prefetching overwrites slots in place, possibly ones this layer just read. The barrier makes
            # the output (so the read) come first: without one XLA:GPU was seen reading a slot after its
            # overwrite (greedy tokens drifted from the resident run on the B30 shape; exact without prefetch).
            out_ND, slots = jax.lax.optimization_barrier((out_ND, slots))
        hits, misses = plan.n_hits.astype(jnp.int32), plan.n_misses.astype(jnp.int32)
        for next_idx, pred_NK in prefetch:
            slots, pf_plan = _access_and_fetch(slots, store, next_idx, _unique(pred_NK, E), policy)
            prefetched = prefetched + pf_plan.n_misses.astype(jnp.int32)
    else:
        impl, layer, ids_E = _many_token_impl(), store.layers[moe_idx], jnp.arange(E, dtype=jnp.int32)
        if impl is _experts_dense:  # streams group by group from the host store
            out_ND = impl(x_ND, w_NK, ids_NK, ids_E, layer, dtype, E, from_host=True)
        else:
            out_ND = impl(x_ND, w_NK, ids_NK, ids_E, stream_layer(layer), dtype, E)
        streamed = jnp.int32(E)
    pred_hit = pred_total = zero
    if predicted_NK is not None:
        actual_U, pred_U = _unique(ids_NK, E), _unique(predicted_NK, E)
        pred_hit = jnp.sum((pred_U[:, None] == actual_U[None, :]) & (pred_U[:, None] >= 0)).astype(jnp.int32)
        pred_total = jnp.sum(pred_U >= 0).astype(jnp.int32)
    if p.shared is not None:
        shared_ND = swiglu(x_ND, p.shared).astype(jnp.float32)
        if p.shared_gate_D is not None:
            gate_N1 = jax.nn.sigmoid(jnp.einsum("nd,d->n", x_ND.astype(jnp.float32), p.shared_gate_D))[:, None]
            shared_ND = shared_ND * gate_N1
        out_ND = out_ND + shared_ND
    stats = jnp.stack([hits, misses, streamed, prefetched, pred_hit, pred_total])
    return out_ND.astype(dtype).reshape(B, T, D), ids_NK, slots, stats
