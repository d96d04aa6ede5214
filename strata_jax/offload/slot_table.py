"""The device expert cache: fixed-shape pools of expert slots and the `[layer, expert] -> slot` map.

Routed experts are addressed only through this table, so the jitted forward pass is the same whether
every expert is resident or a few slots are shared by thousands of experts that an offload manager
swaps in. Layers whose expert tensors have the same GGML types share one pool (a Q4_K_M file mixes
Q4_K and Q6_K down projections by layer, and a pool array has one type).

Shape legend: S slots in a pool, F expert ffn dim, D model dim, R row bytes, L MoE layers, E experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.model.config import ModelConfig
from strata_jax.model.weights import QTensor, WeightLoader, _dataclass_pytree

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@_dataclass_pytree
class ExpertPool:
    gate: QTensor  # [S, F, R]
    up: QTensor  # [S, F, R]
    down: QTensor  # [S, D, R]


@_dataclass_pytree(meta=("layer_pool",))
class SlotTable:
    pools: tuple[ExpertPool, ...]
    slot_map_LE: jax.Array  # int32; -1 where the expert is not resident
    layer_pool: tuple[int, ...]  # static: the pool each MoE layer's experts live in

    @property
    def n_slots(self) -> int:
        return sum(p.gate.data.shape[0] for p in self.pools)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where each MoE layer's experts go: pool index per layer, pool types, experts per pool."""

    layer_pool: tuple[int, ...]
    pool_types: tuple[tuple, ...]
    pool_layers: tuple[tuple[int, ...], ...]


def expert_layout(loader: WeightLoader) -> ExpertLayout:
    cfg = loader.cfg
    types: list[tuple] = []
    layer_pool = []
    for layer in cfg.moe_layers:
        key = tuple(loader.gguf.tensor(f"blk.{layer}.{n}.weight").ggml_type for n in EXPERT_TENSORS)
        if key not in types:
            types.append(key)
        layer_pool.append(types.index(key))
    pool_layers = tuple(tuple(i for i, p in enumerate(layer_pool) if p == g) for g in range(len(types)))
    return ExpertLayout(tuple(layer_pool), tuple(types), pool_layers)


def _expert_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    E, F, D = cfg.n_experts, cfg.expert_ffn_dim, cfg.d_model
    return (E, F, D), (E, F, D), (E, D, F)


def resident_slot_table(loader: WeightLoader) -> SlotTable:
    """Every expert resident: pool g holds its layers' experts back to back, slot = i * E + e."""
    cfg = loader.cfg
    E = cfg.n_experts
    layout = expert_layout(loader)
    pools = []
    for layers in layout.pool_layers:
        tensors = []
        for name, shape in zip(EXPERT_TENSORS, _expert_shapes(cfg)):
            infos = [loader.info(f"blk.{cfg.moe_layers[i]}.{name}.weight", shape) for i in layers]
            host = np.concatenate([np.asarray(t.data) for t in infos], axis=0)
            tensors.append(QTensor(loader._put(host), infos[0].ggml_type, shape[-1]))
        pools.append(ExpertPool(*tensors))
    slot_map = np.full((len(cfg.moe_layers), E), -1, np.int32)
    for layers in layout.pool_layers:
        for i, layer in enumerate(layers):
            slot_map[layer] = i * E + np.arange(E)
    return SlotTable(tuple(pools), jnp.asarray(slot_map), layout.layer_pool)
