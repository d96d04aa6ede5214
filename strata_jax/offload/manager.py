"""OffloadManager: the host-side owner of a MoE model's expert cache.

It decides the cache size (sizing.plan_cache), builds the slot table and, when not every expert fits,
the pinned-host ExpertStore; between jitted steps it hands the donated device state (slot table and
counters) to the step and takes the updated state back; it turns the device counters into telemetry.
Inside a step the policy, miss fetches and prefetch run in jit (see model/moe.py), so a token costs
one dispatch and no host round trip per layer.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.model.moe import N_STATS
from strata_jax.model.weights import WeightLoader
from strata_jax.offload.policies import Policy, get_policy
from strata_jax.offload.sizing import CachePlan, describe, device_free_bytes, plan_cache
from strata_jax.offload.slot_table import SlotTable, empty_slot_table, expert_bytes, expert_layout, resident_slot_table
from strata_jax.offload.store import ExpertStore, load_expert_store
from strata_jax.units import fmt_bytes

log = logging.getLogger("strata_jax")

LOW_FREE_VRAM = 512 << 20


class OffloadManager:
    def __init__(self, loader: WeightLoader, *, fixed_bytes: int, expert_slots: int | None = None,
                 vram_budget: int | str | None = None, vram_reserve: int | str | None = None,
                 policy: str | Policy = "lru", prefetch: bool = True):
        cfg = loader.cfg
        self.device = loader.device
        self.policy = get_policy(policy)
        self.prefetch = bool(prefetch)
        layout = expert_layout(loader)
        self.plan: CachePlan = plan_cache(
            pool_layers=layout.pool_layers, pool_expert_bytes=tuple(expert_bytes(cfg, t) for t in layout.pool_types),
            n_experts=cfg.n_experts, min_slots_per_pool=min(cfg.n_experts_used, cfg.n_experts),
            fixed_bytes=fixed_bytes, expert_slots=expert_slots, vram_budget=vram_budget, vram_reserve=vram_reserve,
            free_bytes=device_free_bytes(self.device))
        log.info(describe(self.plan))
        self.store: ExpertStore | None = None
        if self.plan.resident:
            slots = resident_slot_table(loader)
        else:
            self.store = load_expert_store(loader)
            slots = empty_slot_table(loader, list(self.plan.slots_per_pool), self.policy)
        # Step inputs are committed to the device up front: jit's cache key includes committedness and
        # step outputs are committed, so uncommitted initial state would recompile the second step.
        self.slots: SlotTable | None = jax.device_put(slots, self.device)
        self._n_layers = len(cfg.moe_layers)
        self.reset_stats()
        free = device_free_bytes(self.device)
        if free is not None and free < LOW_FREE_VRAM:
            log.warning("only %s of device memory is free after loading; long prompts may run out. Lower "
                        "--expert-slots or --vram-budget, or raise --vram-reserve.", fmt_bytes(free))

    @property
    def bytes_per_expert_M(self) -> np.ndarray:
        if self.store is None:
            return np.zeros(self._n_layers, np.int64)
        return np.array([layer.bytes_per_expert for layer in self.store.layers], np.int64)

    def take(self) -> tuple[SlotTable, jax.Array]:
        """The donated state for one jitted step; the manager holds nothing until `put`."""
        slots, stats = self.slots, self._stats_MS
        self.slots = self._stats_MS = None
        return slots, stats

    def put(self, slots: SlotTable, stats_MS: jax.Array) -> None:
        self.slots, self._stats_MS = slots, stats_MS

    def reset_stats(self) -> None:
        self._stats_MS = jax.device_put(jnp.zeros((self._n_layers, N_STATS), jnp.int32), self.device)

    def counters(self) -> np.ndarray:
        """int64 [MoE layers, N_STATS]: hits, misses, streamed, prefetched, predicted-and-routed, predicted."""
        return np.asarray(self._stats_MS, np.int64)

    def stats(self) -> dict[str, Any]:
        """Counters since load or reset_stats: decode lookups, hits, misses, hit rate, bytes moved
        host->device (misses, prefetches, and whole layers streamed for prefill), prefetch quality."""
        st = self.counters()
        hits, misses, streamed, prefetched, pred_hit, pred_total = (int(x) for x in st.sum(axis=0))
        actual = hits + misses - int(st[0, 0] + st[0, 1])  # lookups of layers that had a prediction
        return {
            "lookups": hits + misses,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "bytes_h2d": int(((st[:, 1] + st[:, 2] + st[:, 3]) * self.bytes_per_expert_M).sum()),
            "prefill_streamed_experts": streamed,
            "prefetched": prefetched,
            "prefetch_precision": pred_hit / pred_total if pred_total else None,
            "prefetch_recall": pred_hit / actual if pred_total and actual else None,
            "per_layer_hit_rate": [float(r[0] / (r[0] + r[1])) if r[0] + r[1] else 1.0 for r in st.tolist()],
            "expert_slots": self.plan.n_slots,
            "total_experts": self.plan.total_experts,
            "resident": self.plan.resident,
            "policy": None if self.plan.resident else self.policy.name,
            "prefetch": self.prefetch and not self.plan.resident,
            "store_memory": self.store.memory_kind if self.store is not None else None,
        }
