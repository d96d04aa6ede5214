"""The device expert cache: fixed-shape pools of expert slots and, per pool, the cache state
(`[layer, expert] -> slot` map, slot owners, policy metadata).

Routed experts are addressed only through this table, so the jitted forward pass is the same whether
every expert is resident or a few slots are shared by thousands of experts swapped in on demand.
Layers whose expert tensors have the same GGML types share one pool array (a Q4_K_M file mixes Q4_K
and Q6_K down projections by layer, and a pool array has one type). Within a shared pool all its
layers compete for slots, so hot layers can hold more experts than cold ones; within a pool of blocks
(the per-layer caches) each layer owns a block of slots and a cache state of its own, the states
stacked so that a scan over alike layers indexes them by the traced layer.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.core import hostrows, layer_ref
from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import ExpertRows, ExpertSpec, fused_rows
from strata_jax.offload.policies import CacheState, Policy

ExpertPool = ExpertRows  # a pool of slots: one expert per row, indexed by slot


@struct.dataclass
class SlotTable:
    pools: tuple[ExpertPool, ...]
    caches: tuple[CacheState, ...]  # one per pool; a blocked pool's stacked over its layers [layers, ...]
    layer_pool: tuple[int, ...] = struct.field(pytree_node=False)  # the pool of each MoE layer
    layer_local: tuple[int, ...] = struct.field(pytree_node=False)  # the layer's row (block) in its pool
    resident: bool = struct.field(pytree_node=False)  # every expert has a slot (no policy, no fetches)
    # per pool: 0 when its layers compete for all its slots (one cache); else the slots of each layer's own
    # block (slots local * block ..), each layer with its own cache state, stacked: alike layers then
    # index one buffer and one state and scan as one body (model/runs.py)
    block: tuple[int, ...] = struct.field(pytree_node=False, default=())

    @property
    def n_slots(self) -> int:
        return sum(p.n_rows for p in self.pools)

    @property
    def n_experts(self) -> int:
        return self.caches[0].n_experts

    def few_path(self, moe_idx, n_lookups: int, n_experts: int) -> bool:
        """Whether a step routing n_lookups (token, expert) pairs in MoE layer `moe_idx` looks each expert up
        in the cache (else it streams or computes the whole layer): at most every expert, and, when
        offloading, at most the layer's slots (a prefill chunk of 16 tokens top-8 can ask for 128 experts
        at once of a pool holding 64)."""
        if self.resident:
            return n_lookups <= n_experts
        return n_lookups <= min(n_experts, self.layer_slots(moe_idx))

    def layer_key(self, moe_idx: int) -> int:
        """What MoE layers must share to run as one scanned body (model/runs.py): their pool."""
        return self.layer_pool[moe_idx]

    def local(self, moe_idx) -> int | jax.Array:
        """The layer's row in its pool's cache (traced for a LayerRef)."""
        return layer_ref.value(layer_ref.mapped(moe_idx, self.layer_local))

    def pool(self, moe_idx) -> ExpertPool:
        """moe_idx: an int, or a LayerRef over layers of one pool."""
        return self.pools[self.cache_index(moe_idx)]

    def cache_index(self, moe_idx) -> int:
        return self.layer_pool[layer_ref.first(moe_idx)]

    def _block(self, moe_idx) -> int:
        return self.block[self.cache_index(moe_idx)] if self.block else 0

    def layer_slots(self, moe_idx) -> int:
        """The slots layer `moe_idx` may use: its block, or its whole (shared) pool."""
        return self._block(moe_idx) or self.pool(moe_idx).n_rows

    def slot_base(self, moe_idx) -> int | jax.Array:
        """The pool slot of the layer's cache slot 0."""
        return self.local(moe_idx) * self._block(moe_idx)

    def layer_cache(self, moe_idx, rows: bool = False) -> tuple[CacheState, int | jax.Array]:
        """The cache state serving layer `moe_idx` and the layer's row in it (policy.access' arguments).
        rows: a traced layer's slice of a stacked state read by core/hostrows.py's row kernel (available)."""
        cache = self.caches[self.cache_index(moe_idx)]
        if not self._block(moe_idx):
            return cache, self.local(moe_idx)
        at = self.local(moe_idx)
        return jax.tree.map(lambda a: row_at(a, at, rows), cache), 0

    def with_layer(self, moe_idx, cache: CacheState, pool: ExpertPool, rows: bool = False) -> "SlotTable":
        """The table with layer `moe_idx`'s cache state (as layer_cache gave it) and its pool replaced."""
        p = self.cache_index(moe_idx)
        if self._block(moe_idx):
            at = self.local(moe_idx)
            cache = jax.tree.map(lambda A, a: put_row_at(A, a, at, rows), self.caches[p], cache)
        return self.replace(pools=tuple(pool if i == p else q for i, q in enumerate(self.pools)),
                            caches=tuple(cache if i == p else c for i, c in enumerate(self.caches)))

    def slot_map(self, moe_idx, rows: bool = False) -> jax.Array:
        """int32 [E]: the pool slot of each expert of MoE layer `moe_idx` (-1 if not resident)."""
        cache, row = self.layer_cache(moe_idx, rows)
        map_E = cache.slot_map_LE[row]
        return jnp.where(map_E >= 0, map_E + self.slot_base(moe_idx), -1) if self._block(moe_idx) else map_E


def row_at(a: jax.Array, at, rows: bool) -> jax.Array:
    """a[at]: by the row kernel for a traced index when asked (XLA's memcpy thunk for a plain dynamic slice
    at a loop-dependent index keeps the layer scan out of its command buffers on a GPU)."""
    if rows and isinstance(at, jax.Array) and hostrows.rows_ok(a):
        return hostrows.row_get(a, at)
    return jax.lax.dynamic_index_in_dim(a, at, 0, keepdims=False)


def put_row_at(A: jax.Array, a: jax.Array, at, rows: bool) -> jax.Array:
    if rows and isinstance(at, jax.Array) and hostrows.rows_ok(A):
        return hostrows.row_put(A, a, at)
    return jax.lax.dynamic_update_index_in_dim(A, a, at, 0)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each MoE layer's experts go: pool index per layer, pool types, layers per pool."""

    layer_pool: tuple[int, ...]
    pool_types: tuple[tuple, ...]
    pool_layers: tuple[tuple[int, ...], ...]

    @property
    def layer_local(self) -> tuple[int, ...]:
        return tuple(self.pool_layers[p].index(i) for i, p in enumerate(self.layer_pool))


POOLS = ("per-layer", "shared")


def expert_layout(spec: ExpertSpec, pools: str = "shared") -> ExpertLayout:
    """pools="shared": one pool per expert row layout (the GGML types of gate, up, down), its layers
    competing for slots; "per-layer": a pool (and cache) per MoE layer, with an equal share of the slots."""
    if pools not in POOLS:
        raise ConfigError(f"expert_pools={pools!r} is invalid: choose {' or '.join(map(repr, POOLS))}.")
    keys: list[tuple] = []
    types: list[tuple] = []
    layer_pool = []
    for i, parts in enumerate(spec.layer_parts):
        t = tuple(p.qtype for p in parts)
        key = (t, i) if pools == "per-layer" else t
        if key not in keys:
            keys.append(key)
            types.append(parts)
        layer_pool.append(keys.index(key))
    pool_layers = tuple(tuple(i for i, p in enumerate(layer_pool) if p == g) for g in range(len(keys)))
    return ExpertLayout(tuple(layer_pool), tuple(types), pool_layers)


def expert_bytes(parts) -> int:
    """Bytes of one expert (gate + up + down) with these parts."""
    return sum(p.nbytes for p in parts)


# the fused kernel cannot index a buffer of 2-4 GiB (model/qmatvec.py's stack_ok)
KERNEL_GAP = (2**31, 2**32)


def _gap_chunks(layers: tuple[int, ...], layer_bytes: int) -> list[tuple[int, ...]]:
    """The layers of one buffer cut, in order, into buffers below KERNEL_GAP when theirs falls in it."""
    if not KERNEL_GAP[0] <= layer_bytes * len(layers) <= KERNEL_GAP[1]:
        return [tuple(layers)]
    chunks: list[list[int]] = [[]]
    for i in layers:
        if chunks[-1] and (len(chunks[-1]) + 1) * layer_bytes >= KERNEL_GAP[0]:
            chunks.append([])
        chunks[-1].append(i)
    return [tuple(c) for c in chunks]


def _grouped(groups: list[tuple[tuple, tuple[int, ...], int]], n_layers: int) -> ExpertLayout:
    """A layout of one pool per (parts, layers) group, each cut by _gap_chunks at its bytes per layer."""
    layer_pool = [0] * n_layers
    types, pool_layers = [], []
    for parts, layers, layer_bytes in groups:
        for chunk in _gap_chunks(layers, layer_bytes):
            for i in chunk:
                layer_pool[i] = len(types)
            types.append(parts)
            pool_layers.append(chunk)
    return ExpertLayout(tuple(layer_pool), tuple(types), tuple(pool_layers))


def resident_layout(spec: ExpertSpec) -> ExpertLayout:
    """Every expert resident: a pool per expert row layout (the GGML types of gate, up, down), its layers
    stacked (slot = local layer * E + expert), so alike layers index one buffer and scan as one body. A
    layout whose layers together fall in KERNEL_GAP is split, in layer order, into pools below it."""
    shared = expert_layout(spec, "shared")
    return _grouped([(parts, layers, expert_bytes(parts) * spec.n_experts)
                     for parts, layers in zip(shared.pool_types, shared.pool_layers)], len(spec.layer_parts))


def stacked_layout(layout: ExpertLayout, slots_per_pool: list[int]) -> tuple[ExpertLayout, list[int]]:
    """A per-layer layout (a pool of one layer each) with its layers of equal row layout and slot count
    gathered into one pool of blocks (SlotTable.block), split as resident_layout splits; and each new
    pool's slots per layer."""
    if any(len(layers) != 1 for layers in layout.pool_layers):
        raise ValueError("stacked_layout takes a per-layer layout")
    keys: dict[tuple, list[int]] = {}
    for i, p in enumerate(layout.layer_pool):
        keys.setdefault((layout.pool_types[p], slots_per_pool[p]), []).append(i)
    out = _grouped([(parts, tuple(layers), n * expert_bytes(parts)) for (parts, n), layers in keys.items()],
                   len(layout.layer_pool))
    block = [slots_per_pool[layout.layer_pool[layers[0]]] for layers in out.pool_layers]
    return out, block


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2)
def _put_rows(pool_XP: jax.Array, rows_EP: jax.Array, at: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(pool_XP, rows_EP, at, axis=0)


def resident_slot_table(gguf, spec: ExpertSpec, device=None, rows_at=None) -> SlotTable:
    """Every expert resident (resident_layout). Each pool is filled a layer at a time in place, so
    neither host nor device holds a second copy of it. device: a device, or a sharding (a pool split over
    cards: core/cards.py), with rows_at where each layer's rows go on their way in (every card)."""
    E = spec.n_experts
    layout = resident_layout(spec)
    pools, caches = [], []
    for parts, layers in zip(layout.pool_types, layout.pool_layers):
        data = jnp.zeros((len(layers) * E, expert_bytes(parts)), jnp.uint8, device=device)
        for j, i in enumerate(layers):
            rows = jax.device_put(fused_rows([gguf.tensor(n) for n in spec.tensor_names(i)]), rows_at or device)
            data = _put_rows(data, rows, j * E)
        pools.append(ExpertPool(data, parts))
        n = len(layers) * E
        caches.append(CacheState(jnp.arange(n, dtype=jnp.int32).reshape(len(layers), E),
                                 jnp.arange(n, dtype=jnp.int32), jnp.zeros((), jnp.int32), {}))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, True,
                     (0,) * len(pools))


def empty_slot_table(spec: ExpertSpec, slots_per_pool: list[int], policy: Policy, layout: ExpertLayout | None = None,
                     device=None, stacked: bool = False) -> SlotTable:
    """An offloading cache: pools of the given sizes (and layout), empty; experts arrive on demand.
    stacked: a per-layer layout's alike layers gathered into pools of blocks (stacked_layout)."""
    layout = layout or expert_layout(spec)
    block = [0] * len(layout.pool_layers)
    if stacked:
        layout, block = stacked_layout(layout, slots_per_pool)
        slots_per_pool = [n * len(layers) for n, layers in zip(block, layout.pool_layers)]
    pools, caches = [], []
    for parts, layers, n_slots, n in zip(layout.pool_types, layout.pool_layers, slots_per_pool, block):
        data = jnp.zeros((n_slots, expert_bytes(parts)), jnp.uint8, device=device)
        pools.append(ExpertPool(data, parts))
        if n:  # a state per layer, stacked
            caches.append(jax.tree.map(lambda *a: jnp.stack(a),
                                       *(init_cache(policy, n, (i,), spec.n_experts) for i in layers)))
        else:
            caches.append(init_cache(policy, n_slots, layers, spec.n_experts))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, False, tuple(block))


def init_cache(policy: Policy, n_slots: int, layers: tuple[int, ...], n_experts: int) -> CacheState:
    """policy.init for a pool holding `layers` (MoE indices); policies whose init takes `layers` (a static
    profile of the whole model) get them, so one policy object serves every pool."""
    if "layers" in inspect.signature(policy.init).parameters:
        return policy.init(n_slots, len(layers), n_experts, layers=tuple(layers))
    return policy.init(n_slots, len(layers), n_experts)
