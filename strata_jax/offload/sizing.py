"""How many expert slots the device can hold, and the log line that says so.

budget (vram_budget, default: the device's free memory) - vram_reserve - dense weights - KV cache
- activations = bytes for experts; divided by the bytes of one expert, that is the slot count. If every
expert fits, the cache is fully resident and no policy runs.
"""

from __future__ import annotations

import dataclasses
import logging

from strata_jax.core.errors import ConfigError
from strata_jax.core.units import fmt_bytes, parse_size

log = logging.getLogger("strata_jax")

DEFAULT_RESERVE = 1 << 30  # XLA workspace, fragmentation, sampling buffers


@dataclasses.dataclass(frozen=True)
class CachePlan:
    resident: bool
    slots_per_pool: tuple[int, ...]
    expert_cache_bytes: int
    total_experts: int
    reason: str
    fixed_bytes: int = 0  # dense weights + KV cache + activations, placed before any expert
    avg_expert_bytes: float = 0.0

    @property
    def n_slots(self) -> int:
        return sum(self.slots_per_pool)


def device_free_bytes(device) -> int | None:
    """Free memory the allocator reports for `device`, or None where it reports nothing (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def plan_cache(*, pool_layers: tuple[tuple[int, ...], ...], pool_expert_bytes: tuple[int, ...], n_experts: int,
               min_slots_per_pool: int, fixed_bytes: int, expert_slots: int | None = None,
               vram_budget: int | str | None = None, vram_reserve: int | str | None = None,
               free_bytes: int | None = None) -> CachePlan:
    """Decide the cache size. `fixed_bytes`: dense weights + KV cache + activations, which come first."""
    n_layers = sum(len(p) for p in pool_layers)
    total = n_layers * n_experts
    avg_bytes = sum(b * len(p) for b, p in zip(pool_expert_bytes, pool_layers)) / max(n_layers, 1)
    reserve = parse_size(vram_reserve, "vram_reserve") if vram_reserve is not None else DEFAULT_RESERVE

    if expert_slots is not None:
        if isinstance(expert_slots, bool) or not isinstance(expert_slots, int) or expert_slots < 1:
            raise ConfigError(f"expert_slots={expert_slots!r} is invalid: give a positive integer (total slots).")
        slots, why = expert_slots, "expert_slots"
    else:
        if vram_budget is not None:
            budget, src = parse_size(vram_budget, "vram_budget"), "vram_budget"
        elif free_bytes is not None:
            budget, src = free_bytes, "free device memory"
        else:
            return _resident(pool_layers, n_experts, avg_bytes, "no memory limit known on this device (CPU)",
                             fixed_bytes)
        avail = budget - reserve - fixed_bytes
        need_min = min_slots_per_pool * len(pool_layers) * avg_bytes
        if avail < need_min:
            smallest = fixed_bytes + reserve + need_min
            raise ConfigError(
                f"{src} {fmt_bytes(budget)} is too small: the dense weights, KV cache and activations take "
                f"{fmt_bytes(fixed_bytes)}, {fmt_bytes(reserve)} is reserved, and one step needs at least "
                f"{min_slots_per_pool} expert slots per pool ({fmt_bytes(need_min)}). The smallest budget that works "
                f"is {fmt_bytes(smallest)}; lower --ctx, --vram-reserve, or the batch size, or raise --vram-budget.")
        slots = int(avail // avg_bytes)
        why = f"{src} {fmt_bytes(budget)} - reserve {fmt_bytes(reserve)} - dense/kv/activations {fmt_bytes(fixed_bytes)}"

    if slots >= total:
        return _resident(pool_layers, n_experts, avg_bytes, f"{why}: every expert fits", fixed_bytes)
    per_pool = [slots * len(p) // n_layers for p in pool_layers]
    for i in range(slots - sum(per_pool)):  # the rounding remainder, one slot each, so the budget is used
        per_pool[i % len(per_pool)] += 1
    per_pool = [min(max(s, min_slots_per_pool), len(p) * n_experts) for s, p in zip(per_pool, pool_layers)]
    if min(per_pool) < min_slots_per_pool or expert_slots is not None and slots < min_slots_per_pool * len(pool_layers):
        raise ConfigError(
            f"expert_slots={slots} is too few: one step needs {min_slots_per_pool} slots in each of the "
            f"{len(pool_layers)} expert pool(s), so at least {min_slots_per_pool * len(pool_layers)}.")
    cache_bytes = int(sum(s * b for s, b in zip(per_pool, pool_expert_bytes)))
    return CachePlan(False, tuple(per_pool), cache_bytes, total, why, fixed_bytes, avg_bytes)


def _resident(pool_layers, n_experts, avg_bytes, why, fixed_bytes) -> CachePlan:
    per_pool = tuple(len(p) * n_experts for p in pool_layers)
    return CachePlan(True, per_pool, int(sum(per_pool) * avg_bytes), sum(per_pool), why, fixed_bytes, avg_bytes)


def describe(plan: CachePlan) -> str:
    pct = 100 * plan.n_slots / max(plan.total_experts, 1)
    mode = "all resident" if plan.resident else "offloading"
    return (f"expert cache: {fmt_bytes(plan.expert_cache_bytes)} -> {plan.n_slots:,} slots ({pct:.0f}% of "
            f"{plan.total_experts:,} experts), {mode}; {plan.reason}")
