"""The device expert cache: fixed-shape pools of expert slots and, per pool, the cache state
(`[layer, expert] -> slot` map, slot owners, policy metadata).

Routed experts are addressed only through this table, so the jitted forward pass is the same whether
every expert is resident or a few slots are shared by thousands of experts swapped in on demand.
Layers whose expert tensors have the same GGML types share one pool (a Q4_K_M file mixes Q4_K and
Q6_K down projections by layer, and a pool array has one type); within a pool all its layers compete
for slots, so hot layers can hold more experts than cold ones.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.core.errors import ConfigError
from strata_jax.core.experts import ExpertRows, ExpertSpec, fused_rows
from strata_jax.offload.policies import CacheState, Policy

ExpertPool = ExpertRows  # a pool of slots: one expert per row, indexed by slot


@struct.dataclass
class SlotTable:
    pools: tuple[ExpertPool, ...]
    caches: tuple[CacheState, ...]  # one per pool
    layer_pool: tuple[int, ...] = struct.field(pytree_node=False)  # the pool of each MoE layer
    layer_local: tuple[int, ...] = struct.field(pytree_node=False)  # the layer's row in its pool's cache
    resident: bool = struct.field(pytree_node=False)  # every expert has a slot (no policy, no fetches)

    @property
    def n_slots(self) -> int:
        return sum(p.n_rows for p in self.pools)

    @property
    def n_experts(self) -> int:
        return self.caches[0].n_experts

    def few_path(self, moe_idx: int, n_lookups: int, n_experts: int) -> bool:
        """Whether a step routing n_lookups (token, expert) pairs in MoE layer `moe_idx` looks each expert up
        in the cache (else it streams or computes the whole layer): at most every expert, and, when
        offloading, at most the pool's slots (a prefill chunk of 16 tokens top-8 can ask for 128 experts
        at once of a pool holding 64)."""
        if self.resident:
            return n_lookups <= n_experts
        return n_lookups <= min(n_experts, self.pools[self.layer_pool[moe_idx]].n_rows)

    def pool(self, moe_idx: int) -> ExpertPool:
        return self.pools[self.layer_pool[moe_idx]]

    def slot_map(self, moe_idx: int) -> jax.Array:
        """int32 [E]: the slot of each expert of MoE layer `moe_idx` (-1 if not resident)."""
        return self.caches[self.layer_pool[moe_idx]].slot_map_LE[self.layer_local[moe_idx]]


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


def resident_slot_table(gguf, spec: ExpertSpec, device=None) -> SlotTable:
    """Every expert resident, a pool per MoE layer (slot = expert id). One pool per layer rather than one
    for the whole model keeps each buffer small: the fused kernel (model/qmatvec.py) cannot index a
    buffer of 2-4 GiB."""
    E = spec.n_experts
    layout = expert_layout(spec, "per-layer")
    pools, caches = [], []
    for layers in layout.pool_layers:
        host = np.concatenate([fused_rows([gguf.tensor(n) for n in spec.tensor_names(i)]) for i in layers], axis=0)
        pools.append(ExpertPool(jax.device_put(host, device), spec.layer_parts[layers[0]]))
        n = len(layers) * E
        caches.append(CacheState(jnp.arange(n, dtype=jnp.int32).reshape(len(layers), E),
                                 jnp.arange(n, dtype=jnp.int32), jnp.zeros((), jnp.int32), {}))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, True)


def empty_slot_table(spec: ExpertSpec, slots_per_pool: list[int], policy: Policy, layout: ExpertLayout | None = None,
                     device=None) -> SlotTable:
    """An offloading cache: pools of the given sizes (and layout), empty; experts arrive on demand."""
    layout = layout or expert_layout(spec)
    pools, caches = [], []
    for parts, layers, n_slots in zip(layout.pool_types, layout.pool_layers, slots_per_pool):
        data = jnp.zeros((n_slots, expert_bytes(parts)), jnp.uint8, device=device)
        pools.append(ExpertPool(data, parts))
        caches.append(init_cache(policy, n_slots, layers, spec.n_experts))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, False)


def init_cache(policy: Policy, n_slots: int, layers: tuple[int, ...], n_experts: int) -> CacheState:
    """policy.init for a pool holding `layers` (MoE indices); policies whose init takes `layers` (a static
    profile of the whole model) get them, so one policy object serves every pool."""
    if "layers" in inspect.signature(policy.init).parameters:
        return policy.init(n_slots, len(layers), n_experts, layers=tuple(layers))
    return policy.init(n_slots, len(layers), n_experts)
