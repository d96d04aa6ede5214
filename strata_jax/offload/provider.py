"""SlotExperts: the ExpertProvider (core/experts.py) over a slot table, resident or offloaded.

Resident (every expert has a slot, slot = expert id): a lookup is the identity and runs no kernel;
its hits are counted once per step for all layers (`finish`), not with a few kernels per layer.
Offloaded: a lookup runs the policy and DMAs the misses from the pinned-host store into their slots,
all inside the jitted step; prefill streams each layer's experts from the store.
Mixed precision (the store has a low-bit `cold` twin, --cold-experts): a miss not yet promoted
(policies.promote) is not admitted; its low-bit row is copied into a per-layer staging buffer and
computed from there, so it moves fewer bytes over PCIe and evicts nothing.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from strata_jax.core.layer_ref import LayerRef
from strata_jax.core.experts import ExpertCounters, ExpertRows, n_distinct, unique_ids
from strata_jax.offload.fetch import fetch_misses, stream_group, stream_layer
from strata_jax.core import cards, layer_ref
from strata_jax.offload.policies import FREE, Plan, Policy, promote
from strata_jax.offload.slot_table import SlotTable, put_row_at, row_at
from strata_jax.offload.store import ExpertStore


@struct.dataclass
class SlotExperts:
    table: SlotTable
    store: ExpertStore | None  # offloading only: every expert, in host memory
    counters: ExpertCounters
    policy: Policy | None = struct.field(pytree_node=False)  # offloading only
    prefetch_depth: int = struct.field(pytree_node=False, default=0)
    # counts of this step not yet in `counters`, ((moe_idx, counter), ...) and their int32 values: folded
    # in once by `finish`, one stack and add per counter rather than a scatter per layer and counter
    pending_keys: tuple[tuple[int, str], ...] = struct.field(pytree_node=False, default=())
    pending: tuple[jax.Array, ...] = ()
    # mixed precision (store.cold): each MoE layer's low-bit uses per expert, int32 [M, E]
    # (policies.promote), and the uses after which a miss is promoted to the cache
    uses_ME: jax.Array | None = None
    promote_after: int = struct.field(pytree_node=False, default=0)
    # pools split over cards (core/cards.py): the misses each card has fetched, int32 [cards]
    card_misses_C: jax.Array | None = None

    @property
    def resident(self) -> bool:
        return self.table.resident

    def few_path(self, moe_idx, n_lookups: int) -> bool:
        return self.table.few_path(moe_idx, n_lookups, self.table.n_experts)

    def layer_key(self, moe_idx: int):
        """Layers scan as one body when they share a slot pool and, offloading, a store group (read
        by one dynamic slice)."""
        if self.store is None:
            return self.table.layer_key(moe_idx)
        cold = () if self.store.cold is None else (self.store.cold.layer_group[moe_idx],)
        return (self.table.layer_key(moe_idx), self.store.layer_group[moe_idx]) + cold

    def lookup(self, moe_idx, ids_Nk: jax.Array, valid_N: jax.Array | None = None):
        if self.resident:  # expert e is in slot local * E + e of its layer's pool (resident_layout): no lookup
            return self, self.table.pool(moe_idx), ids_Nk + self.table.local(moe_idx) * self.table.n_experts, None
        wanted_Nk = ids_Nk if valid_N is None else jnp.where(valid_N[:, None], ids_Nk, -1)
        ids_U = unique_ids(wanted_Nk, self.table.n_experts)
        me, cold = self, None
        state = self.table.layer_cache(moe_idx, self._rows)  # read once: the promotion rule counts its free slots
        if self.store.cold is not None:
            me, ids_U, cold = self._cold_rows(moe_idx, ids_Nk, ids_U, state[0])
        table, plan = me._access_and_fetch(me.table, moe_idx, ids_U, state)
        n_cold = jnp.zeros((), jnp.int32) if cold is None else jnp.sum(cold[2]).astype(jnp.int32)
        me = me.replace(table=table)._count_cards(moe_idx, plan)
        me = me.count(moe_idx, hits=plan.n_hits, misses=plan.n_misses + n_cold)
        if cold is not None:
            me = me.count(moe_idx, cold=n_cold)
            cold = cold[0], cold[1], cold[2][cold[1]] & (ids_Nk >= 0)
        # a token that is not real may route to an expert that was not fetched (slot -1): read slot 0
        return me, table.pool(moe_idx), jnp.maximum(table.slot_map(moe_idx, self._rows)[ids_Nk], 0), cold

    def _cold_rows(self, moe_idx, ids_Nk: jax.Array, ids_U: jax.Array, cache):
        """Mixed precision: (provider, the ids the cache serves (-1 for the others), (the low-bit rows of the
        others [U, P'], each routed id's row among them [N, k], whether ids_U[u] is served low-bit [U]));
        cache: the layer's cache state (layer_cache)."""
        rows = self._rows
        hit_U = (ids_U >= 0) & (self.table.slot_map(moe_idx, rows)[jnp.maximum(ids_U, 0)] >= 0)
        m = layer_ref.value(moe_idx)  # the MoE layer's index (traced in a scanned run)
        n_free = jnp.sum(cache.owner_X == FREE)
        uses_E, promote_U = promote(row_at(self.uses_ME, m, rows), ids_U, hit_U, self.promote_after, n_free)
        cold_U = (ids_U >= 0) & ~promote_U
        store = self.store.cold
        g, U = store.group(moe_idx), ids_U.shape[0]
        staging = ExpertRows(jnp.zeros((U, store.shape(g)[2]), jnp.uint8), store.parts[g])
        at_U = jnp.arange(U, dtype=jnp.int32)
        staged = fetch_misses(staging, store, moe_idx, Plan(ids_U, at_U, cold_U, jnp.full((U,), -1, jnp.int32)))
        at_Nk = jnp.argmax(ids_Nk[..., None] == ids_U, axis=-1).astype(jnp.int32)
        me = self.replace(uses_ME=put_row_at(self.uses_ME, uses_E, m, rows))
        return me, jnp.where(promote_U, ids_U, -1), (staged, at_Nk, cold_U)

    def prefetch(self, moe_idx: int, predicted: tuple[tuple[int, jax.Array], ...],
                 after: jax.Array) -> tuple["SlotExperts", jax.Array]:
        if not predicted or self.resident:
            return self, after
        # Prefetching overwrites slots in place, possibly ones this layer just read. The barrier makes
        # the output (so the read) come before the overwrite; without it XLA may reorder them
        # (docs/benchmarks.md, "Prefetch correctness").
        after, table = jax.lax.optimization_barrier((after, self.table))
        prefetched = jnp.zeros((), jnp.int32)
        me = self
        for next_idx, pred_Nk in predicted:
            table, plan = self._access_and_fetch(table, next_idx, unique_ids(pred_Nk, self.table.n_experts))
            me = me.replace(table=table)._count_cards(next_idx, plan)
            prefetched = prefetched + plan.n_misses.astype(jnp.int32)
        return me.count(moe_idx, prefetched=prefetched), after

    def stream(self, moe_idx: int, cached: bool = False) -> "SlotExperts":
        if self.resident:
            return self
        if cached:
            return self.count(moe_idx, streamed=jnp.sum(self.table.slot_map(moe_idx, self._rows) < 0))
        return self.count(moe_idx, streamed=self.table.n_experts)

    def group(self, moe_idx, first_expert: jax.Array, n: int, cached: bool = False) -> ExpertRows:
        if self.resident:
            pool = self.table.pool(moe_idx)
            at = self.table.local(moe_idx) * self.table.n_experts + first_expert
            return _rows(pool, at, n)
        if not cached:
            return stream_group(self.store, moe_idx, first_expert, n)
        # the group's experts the cache holds come from their slots, the others from the store (one fetch)
        pool = self.table.pool(moe_idx)
        slot_n = jax.lax.dynamic_slice_in_dim(self.table.slot_map(moe_idx, self._rows), first_expert, n)
        if pool.cards is None:
            rows = ExpertRows(pool.data[jnp.maximum(slot_n, 0)], pool.parts)
        else:
            rows = ExpertRows(cards.take_rows(pool.cards, pool.data, jnp.maximum(slot_n, 0)), pool.parts)
        ids_n = first_expert + jnp.arange(n, dtype=jnp.int32)
        plan = Plan(ids_n, jnp.arange(n, dtype=jnp.int32), slot_n < 0, jnp.full((n,), -1, jnp.int32))
        return fetch_misses(rows, self.store, moe_idx, plan)

    def card_streamer(self, moe_idx, cached: bool = False):
        """Offloaded over several cards, streaming (not reading cached slots): the mesh and this provider
        with only its store (the fetch kernel's addresses), for each card to stream its share of the groups."""
        pool = self.table.pool(moe_idx)
        if self.resident or cached or pool.cards is None:
            return None
        return pool.cards, self.replace(table=self.table.replace(pools=(), caches=()), counters=None, pending_keys=(),
                                        pending=(), uses_ME=None, card_misses_C=None)

    def layer(self, moe_idx) -> ExpertRows:
        if self.resident:
            E = self.table.n_experts
            return _rows(self.table.pool(moe_idx), self.table.local(moe_idx) * E, E)
        return stream_layer(self.store, moe_idx)

    def count(self, moe_idx, **values: jax.Array) -> "SlotExperts":
        # a LayerRef's counts are keyed by all its candidates (scalars in a scan's body, stacked [R] after)
        key = moe_idx.ids if isinstance(moe_idx, LayerRef) else moe_idx
        keys = tuple((key, k) for k in values)
        vals = tuple(jnp.asarray(v).astype(jnp.int32) for v in values.values())
        return self.replace(pending_keys=self.pending_keys + keys, pending=self.pending + vals)

    def detach_counts(self) -> tuple["SlotExperts", tuple[tuple, tuple]]:
        return self.replace(pending_keys=(), pending=()), (self.pending_keys, self.pending)

    def attach_counts(self, keys: tuple, values: tuple) -> "SlotExperts":
        return self.replace(pending_keys=self.pending_keys + tuple(keys), pending=self.pending + tuple(values))

    def finish(self, routed_MNk: jax.Array) -> "SlotExperts":
        me = self._fold()
        if not me.resident or not routed_MNk.shape[0] or not me.few_path(0, routed_MNk[0].size):
            return me
        # every lookup of a resident cache hits: distinct experts per layer, as the offloaded path counts
        hits_M = jax.vmap(n_distinct)(routed_MNk)
        return me.replace(counters=me.counters.replace(hits=me.counters.hits + hits_M))

    def _fold(self) -> "SlotExperts":
        """The pending counts added to the counters: per counter, one [M] vector."""
        if not self.pending_keys:
            return self
        M = self.counters.hits.shape[0]
        zero = jnp.zeros((), jnp.int32)
        updates = {}
        for name in dict.fromkeys(k for _, k in self.pending_keys):
            per_layer = [zero] * M
            for (mi, k), v in zip(self.pending_keys, self.pending):
                if k != name:
                    continue
                if isinstance(mi, tuple):  # a scanned run's counts: v[q] is layer mi[q]'s
                    for q, m in enumerate(mi):
                        per_layer[m] = per_layer[m] + v[q]
                else:
                    per_layer[mi] = per_layer[mi] + v
            updates[name] = getattr(self.counters, name) + jnp.stack(per_layer)
        return self.replace(counters=self.counters.replace(**updates), pending_keys=(), pending=())

    def split(self) -> tuple["SlotExperts", Any]:
        return self.replace(store=None), self.store

    def join(self, fixed: Any) -> "SlotExperts":
        return self.replace(store=fixed)

    def _access_and_fetch(self, table: SlotTable, moe_idx, ids_U: jax.Array, state=None):
        """Run the policy for MoE layer `moe_idx` (an int or a LayerRef) and DMA its misses into their slots;
        state: the layer's (cache, row) as table.layer_cache gives them, where the caller has read them."""
        cache, row = state or table.layer_cache(moe_idx, self._rows)
        cache, plan = self.policy.access(cache, row, ids_U)
        pool = fetch_misses(table.pool(moe_idx), self.store, moe_idx, plan, base=table.slot_base(moe_idx))
        return table.with_layer(moe_idx, cache, pool, self._rows), plan

    def _count_cards(self, moe_idx, plan: Plan) -> "SlotExperts":
        """Split pools (core/cards.py): the misses each card fetched, into card_misses_C."""
        pool = self.table.pool(moe_idx)
        if pool.cards is None or self.card_misses_C is None:
            return self
        n = self.card_misses_C.shape[0]
        card_U = cards.owner(self.table.slot_base(moe_idx) + plan.slot_U, pool.n_rows, n)
        per_C = jnp.sum((card_U[None, :] == jnp.arange(n)[:, None]) & plan.miss_U[None, :], axis=1)
        return self.replace(card_misses_C=self.card_misses_C + per_C.astype(jnp.int32))

    @property
    def _rows(self) -> bool:
        """A traced layer's cache state is read and written by the row kernels where the misses go by the
        fetch kernel (core/hostrows.py): both keep the layer scan in XLA's command buffers."""
        return self.store is not None and bool(self.store.addr)


def _rows(pool: ExpertRows, at, n: int) -> ExpertRows:
    """Rows at .. at + n - 1 of a pool (read from the cards that hold them where it is split)."""
    if pool.cards is None:
        return ExpertRows(jax.lax.dynamic_slice_in_dim(pool.data, at, n, axis=0), pool.parts)
    return ExpertRows(cards.take_rows(pool.cards, pool.data, at + jnp.arange(n, dtype=jnp.int32)), pool.parts)
