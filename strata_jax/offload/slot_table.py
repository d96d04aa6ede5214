"""The device expert cache: fixed-shape pools of expert slots and, per pool, the cache state
(`[layer, expert] -> slot` map, slot owners, policy metadata).

Routed experts are addressed only through this table, so the jitted forward pass is the same whether
every expert is resident or a few slots are shared by thousands of experts swapped in on demand.
Layers whose expert tensors have the same GGML types share one pool (a Q4_K_M file mixes Q4_K and
Q6_K down projections by layer, and a pool array has one type); within a pool all its layers compete
for slots, so hot layers can hold more experts than cold ones.

Shape legend: S slots in a pool, F expert ffn dim, D model dim, R row bytes, L layers of a pool, E experts.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from gguf import GGML_QUANT_SIZES

from strata_jax.model.weights import WeightLoader, pytree_dataclass
from strata_jax.offload.policies import CacheState, Policy
from strata_jax.offload.store import EXPERT_TENSORS, ExpertRows, expert_parts, expert_shapes, fused_rows


ExpertPool = ExpertRows  # a pool of slots: one expert per row, indexed by slot


@pytree_dataclass(meta=("layer_pool", "layer_local", "resident"))
class SlotTable:
    pools: tuple[ExpertPool, ...]
    caches: tuple[CacheState, ...]  # one per pool
    layer_pool: tuple[int, ...]  # static: the pool of each MoE layer
    layer_local: tuple[int, ...]  # static: the layer's row in its pool's cache
    resident: bool  # static: every expert has a slot (no policy, no fetches)

    @property
    def n_slots(self) -> int:
        return sum(p.n_rows for p in self.pools)

    def few_path(self, moe_idx: int, n_lookups: int, n_experts: int) -> bool:
        """Whether a step routing n_lookups (token, expert) pairs in MoE layer `moe_idx` looks each expert up
        in the cache (else it streams or computes the whole layer): at most every expert, and, when
        offloading, at most the pool's slots (a prefill chunk of 16 tokens top-8 can ask for 128 experts
        at once of a pool holding 64)."""
        if self.resident:
            return n_lookups <= n_experts
        return n_lookups <= min(n_experts, self.pools[self.layer_pool[moe_idx]].n_rows)

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


def expert_layout(loader: WeightLoader, pools: str = "shared") -> ExpertLayout:
    """pools="shared": one pool per set of expert types, its layers competing for slots; "per-layer": a
    pool (and cache) per MoE layer, with an equal share of the slots."""
    return gguf_expert_layout(loader.gguf, loader.cfg, pools)


def gguf_expert_layout(gguf, cfg, pools: str = "shared") -> ExpertLayout:
    """expert_layout from the file's tensor table alone (no weights loaded), for planning without a device."""
    if pools not in POOLS:
        from strata_jax.errors import ConfigError

        raise ConfigError(f"expert_pools={pools!r} is invalid: choose {' or '.join(map(repr, POOLS))}.")
    keys: list[tuple] = []
    types: list[tuple] = []
    layer_pool = []
    for i, layer in enumerate(cfg.moe_layers):
        t = tuple(gguf.tensor(f"blk.{layer}.{n}.weight").ggml_type for n in EXPERT_TENSORS)
        key = (t, i) if pools == "per-layer" else t
        if key not in keys:
            keys.append(key)
            types.append(t)
        layer_pool.append(keys.index(key))
    pool_layers = tuple(tuple(i for i, p in enumerate(layer_pool) if p == g) for g in range(len(keys)))
    return ExpertLayout(tuple(layer_pool), tuple(types), pool_layers)


def expert_bytes(cfg, types: tuple) -> int:
    """Bytes of one expert (gate + up + down) stored in the given GGML types."""
    total = 0
    for qtype, shape in zip(types, expert_shapes(cfg)):
        block, size = GGML_QUANT_SIZES[qtype]
        total += shape[1] * shape[2] // block * size
    return total


def resident_slot_table(loader: WeightLoader) -> SlotTable:
    """Every expert resident, a pool per MoE layer (slot = expert id). One pool per layer rather than one
    for the whole model keeps each buffer small: the fused kernel (model/qmatvec.py) cannot index a
    buffer of 2-4 GiB."""
    cfg = loader.cfg
    E = cfg.n_experts
    layout = expert_layout(loader, "per-layer")
    pools, caches = [], []
    for layers in layout.pool_layers:
        per_layer = [[loader.info(f"blk.{cfg.moe_layers[i]}.{name}.weight", shape)
                      for name, shape in zip(EXPERT_TENSORS, expert_shapes(cfg))] for i in layers]
        host = np.concatenate([fused_rows(infos) for infos in per_layer], axis=0)
        pools.append(ExpertPool(loader._put(host), expert_parts(per_layer[0])))
        n = len(layers) * E
        caches.append(CacheState(jnp.arange(n, dtype=jnp.int32).reshape(len(layers), E),
                                 jnp.arange(n, dtype=jnp.int32), jnp.zeros((), jnp.int32), {}))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, True)


def empty_slot_table(loader: WeightLoader, slots_per_pool: list[int], policy: Policy,
                     layout: ExpertLayout | None = None) -> SlotTable:
    """An offloading cache: pools of the given sizes (and layout), empty; experts arrive on demand."""
    cfg = loader.cfg
    layout = layout or expert_layout(loader)
    pools, caches = [], []
    for types, layers, S in zip(layout.pool_types, layout.pool_layers, slots_per_pool):
        parts = []
        for qtype, shape in zip(types, expert_shapes(cfg)):
            block, size = GGML_QUANT_SIZES[qtype]
            parts.append((qtype, shape[1], shape[2] // block * size, shape[2]))
        data = jnp.zeros((S, sum(n * rb for _, n, rb, _ in parts)), jnp.uint8, device=loader.device)
        loader.bytes_loaded += data.nbytes
        pools.append(ExpertPool(data, tuple(parts)))
        caches.append(init_cache(policy, S, layers, cfg.n_experts))
    return SlotTable(tuple(pools), tuple(caches), layout.layer_pool, layout.layer_local, False)


def init_cache(policy: Policy, n_slots: int, layers: tuple[int, ...], n_experts: int) -> CacheState:
    """policy.init for a pool holding `layers` (MoE indices); policies whose init takes `layers` (a static
    profile of the whole model) get them, so one policy object serves every pool."""
    if "layers" in inspect.signature(policy.init).parameters:
        return policy.init(n_slots, len(layers), n_experts, layers=tuple(layers))
    return policy.init(n_slots, len(layers), n_experts)
