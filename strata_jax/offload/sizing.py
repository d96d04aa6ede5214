"""How long a context and how many expert slots the device can hold, and the log lines that say so.

budget (vram_budget, default: the device's free memory) - vram_reserve - dense weights - KV cache
- activations = bytes for experts; divided by the bytes of one expert, that is the slot count. If every
expert fits, the cache is fully resident and no policy runs. The context comes first (plan_context): the
requested one, or the trained one, must leave the fewest expert slots a step needs; with no budget known
(CPU without vram_budget) any context is taken.
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
        need_min = min_expert_bytes(pool_layers, pool_expert_bytes, min_slots_per_pool)
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
    # the rounding remainder, a slot to each pool of a set of alike pools (as many layers, as many bytes an
    # expert) at once: alike pools stay equal, so that their layers stack and scan as one body
    # (model/runs.py); fewer slots than such a set has pools stay unused
    alike: dict[tuple[int, int], list[int]] = {}
    for i, (p, b) in enumerate(zip(pool_layers, pool_expert_bytes)):
        alike.setdefault((len(p), b), []).append(i)
    left = slots - sum(per_pool)
    for group in sorted(alike.values(), key=len):
        while left >= len(group):
            for i in group:
                per_pool[i] += 1
            left -= len(group)
    per_pool = [min(max(s, min_slots_per_pool), len(p) * n_experts) for s, p in zip(per_pool, pool_layers)]
    if min(per_pool) < min_slots_per_pool or expert_slots is not None and slots < min_slots_per_pool * len(pool_layers):
        raise ConfigError(
            f"expert_slots={slots} is too few: one step needs {min_slots_per_pool} slots in each of the "
            f"{len(pool_layers)} expert pool(s), so at least {min_slots_per_pool * len(pool_layers)}.")
    cache_bytes = int(sum(s * b for s, b in zip(per_pool, pool_expert_bytes)))
    return CachePlan(False, tuple(per_pool), cache_bytes, total, why, fixed_bytes, avg_bytes)


def min_expert_bytes(pool_layers: tuple[tuple[int, ...], ...], pool_expert_bytes: tuple[int, ...],
                     min_slots_per_pool: int) -> float:
    """The fewest expert bytes a step needs: min_slots_per_pool slots in every pool, at the average
    expert's size."""
    n_layers = sum(len(p) for p in pool_layers)
    avg_bytes = sum(b * len(p) for b, p in zip(pool_expert_bytes, pool_layers)) / max(n_layers, 1)
    return min_slots_per_pool * len(pool_layers) * avg_bytes


CTX_STEP = 256  # a context cut to fit the budget is a multiple of this


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    ctx: int
    kv_bytes: int  # the KV cache of every row at ctx
    reason: str


def plan_context(*, requested: int | None, trained: int, kv_bytes_per_position: int, other_bytes: int,
                 expert_bytes: float = 0.0, vram_budget: int | str | None = None,
                 vram_reserve: int | str | None = None, free_bytes: int | None = None) -> ContextPlan:
    """The context to allocate: `requested` (None: the trained length). kv_bytes_per_position: the KV
    cache of one position of every row (model/memory.py's kv_cache_bytes at ctx 1); other_bytes: dense
    weights + activations; expert_bytes: the fewest expert bytes a step needs (0 for a dense model).
    With a budget known, a requested context that does not fit raises a ConfigError naming the largest
    that does; the trained one is cut to that (a multiple of CTX_STEP) and the reason says so."""
    ctx = requested or trained
    what = f"ctx {ctx:,}" if requested else f"the trained context {ctx:,}"
    if vram_budget is not None:
        budget, src = parse_size(vram_budget, "vram_budget"), "vram_budget"
    elif free_bytes is not None:
        budget, src = free_bytes, "free device memory"
    else:
        return ContextPlan(ctx, ctx * kv_bytes_per_position, f"{what}; no memory limit known (no vram_budget, and the device reports none)")
    reserve = parse_size(vram_reserve, "vram_reserve") if vram_reserve is not None else DEFAULT_RESERVE
    room = budget - reserve - other_bytes - expert_bytes  # what the KV cache may take
    if ctx * kv_bytes_per_position <= room:
        return ContextPlan(ctx, ctx * kv_bytes_per_position, f"{what} fits {src} {fmt_bytes(budget)}")
    largest = max(int(room // max(kv_bytes_per_position, 1)), 0)
    largest = largest // CTX_STEP * CTX_STEP if largest >= CTX_STEP else largest
    others = (f"{fmt_bytes(other_bytes)} of dense weights and activations, {fmt_bytes(reserve)} reserved"
              + (f", {fmt_bytes(expert_bytes)} for the fewest expert slots a step needs" if expert_bytes else ""))
    need = fmt_bytes(budget - room + ctx * kv_bytes_per_position)
    if largest < 1:
        raise ConfigError(f"{src} {fmt_bytes(budget)} is too small for any context: {others} leave "
                          f"{fmt_bytes(max(room, 0))} for the KV cache. The smallest budget that works is {need} for "
                          f"{what}; raise --vram-budget, or lower --vram-reserve or --parallel.")
    if requested:
        raise ConfigError(
            f"ctx {ctx:,} does not fit {src} {fmt_bytes(budget)}: its KV cache takes "
            f"{fmt_bytes(ctx * kv_bytes_per_position)} beside {others}. The largest context that fits is "
            f"{largest:,}: use --ctx {largest}, a smaller --kv type or fewer --parallel rows (the smallest budget "
            f"for ctx {ctx:,} is {need}).")
    return ContextPlan(largest, largest * kv_bytes_per_position,
                       f"the trained context {ctx:,} does not fit {src} {fmt_bytes(budget)} beside {others}: "
                       f"ctx {largest:,} is the largest that does (--ctx, --kv and --parallel trade it)")


def describe_context(plan: ContextPlan, rows: int, kv: str, cache: "CachePlan | None",
                     streamed: tuple[int, int, int] | None = None) -> str:
    """The trade of KV cache against expert slots, one line (kv: how the cache stores its values; streamed:
    --kv-resident's (positions a layer on the device, their bytes, the host memory's bytes))."""
    where = f"{fmt_bytes(plan.kv_bytes)}"
    if streamed is not None:
        n, dev, host = streamed
        where = f"{fmt_bytes(dev)} on the device ({n:,} positions a layer) + {fmt_bytes(host)} in host memory"
    head = f"KV {where} for {plan.ctx:,} cells x {rows} row{'s' if rows > 1 else ''} ({kv})"
    if cache is not None:
        head += f" leaves {cache.n_slots:,} expert slots of {cache.total_experts:,}"
    return f"{head}; {plan.reason}"


def _resident(pool_layers, n_experts, avg_bytes, why, fixed_bytes) -> CachePlan:
    per_pool = tuple(len(p) * n_experts for p in pool_layers)
    return CachePlan(True, per_pool, int(sum(per_pool) * avg_bytes), sum(per_pool), why, fixed_bytes, avg_bytes)


def describe(plan: CachePlan) -> str:
    pct = 100 * plan.n_slots / max(plan.total_experts, 1)
    mode = "all resident" if plan.resident else "offloading"
    return (f"expert cache: {fmt_bytes(plan.expert_cache_bytes)} -> {plan.n_slots:,} slots ({pct:.0f}% of "
            f"{plan.total_experts:,} experts), {mode}; {plan.reason}")
