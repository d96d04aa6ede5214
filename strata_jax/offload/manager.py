"""OffloadManager: the host-side owner of a MoE model's expert cache.

It decides the cache size (sizing.plan_cache), builds the slot table and, when not every expert fits,
the pinned-host ExpertStore; between jitted steps it hands the donated expert provider (SlotExperts:
slot table, store and counters) to the step and takes the updated one back; it turns the device
counters into telemetry. Inside a step the policy, miss fetches and prefetch run in jit (see
offload/provider.py), so a token costs one dispatch and no host round trip per layer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from strata_jax.core.errors import ConfigError
from strata_jax.core import cards as cards_
from strata_jax.core.experts import ExpertCounters, ExpertRows, ExpertSpec
from strata_jax.core.units import fmt_bytes, parse_size
from strata_jax.offload.fetch import calibrate_fetch
from strata_jax.offload.policies import Policy, get_policy
from strata_jax.offload.provider import SlotExperts
from strata_jax.offload.sizing import (DEFAULT_RESERVE, CachePlan, describe, device_free_bytes, min_expert_bytes,
                                      plan_cache)
from strata_jax.offload.slot_table import (SlotTable, empty_slot_table, expert_bytes, expert_layout, resident_layout,
                                          resident_slot_table)
from strata_jax.core import hostrows
from strata_jax.offload.store import (ExpertStore, file_widths, load_expert_store, load_file_store,
                                      load_registered_store, store_shapes)
from strata_jax.offload.warm import cache_identity, load_cache_state, restore_slot_table, save_cache_state

log = logging.getLogger("strata_jax")

LOW_FREE_VRAM = 512 << 20


def _in_background(fn, *args) -> Future:
    """fn(*args) on a daemon thread: the process can exit (a Ctrl-C) without waiting for it."""
    out: Future = Future()

    def run() -> None:
        try:
            out.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised by whoever waits on it
            out.set_exception(e)

    threading.Thread(target=run, name="strata-jax store", daemon=True).start()
    return out


def plan_model_cache(spec: ExpertSpec, *, fixed_bytes: int, expert_pools: str = "per-layer", batch_rows: int = 1,
                     expert_slots: int | None = None, vram_budget: int | str | None = None,
                     vram_reserve: int | str | None = None, free_bytes: int | None = None, cards: int = 1) -> CachePlan:
    """The expert-cache plan of a model as OffloadManager makes it, from its experts' layout alone, so a
    report without a device (`strata-jax inspect`) gets the slot count a load would. cards: the cache split
    over that many (core/cards.py), each holding fixed_bytes beside its share; vram_budget and vram_reserve
    per card, free_bytes all cards'."""
    layout = expert_layout(spec, expert_pools)
    plan = plan_cache(
        pool_layers=layout.pool_layers, pool_expert_bytes=tuple(expert_bytes(t) for t in layout.pool_types),
        n_experts=spec.n_experts, min_slots_per_pool=_min_slots(spec, batch_rows),
        fixed_bytes=fixed_bytes * cards, expert_slots=expert_slots, vram_budget=_times(vram_budget, cards, "vram_budget"),
        vram_reserve=_times(DEFAULT_RESERVE if vram_reserve is None and cards > 1 else vram_reserve, cards,
                            "vram_reserve"), free_bytes=free_bytes)
    return plan if cards == 1 else split_plan(plan, spec, cards, batch_rows)


def expert_floor_bytes(spec: ExpertSpec, *, expert_pools: str = "per-layer", batch_rows: int = 1,
                       expert_slots: int | None = None) -> float:
    """Expert bytes the device must hold beside the KV cache (what plan_context leaves room for): the
    expert_slots asked for, else the fewest slots a step needs (plan_model_cache's minimum)."""
    layout = expert_layout(spec, expert_pools)
    pool_bytes = tuple(expert_bytes(t) for t in layout.pool_types)
    if expert_slots is not None:
        return expert_slots * min_expert_bytes(layout.pool_layers, pool_bytes, 1) / len(layout.pool_layers)
    return min_expert_bytes(layout.pool_layers, pool_bytes, _min_slots(spec, batch_rows))


def _min_slots(spec: ExpertSpec, batch_rows: int) -> int:
    # one access (a layer of a decode step) may route batch_rows * k distinct experts
    return min(max(batch_rows, 1) * spec.n_experts_used, spec.n_experts)


class OffloadManager:
    """gguf: the model's GGUFFile (strata_jax.gguf.reader); spec: its experts' layout, checked against the
    file (strata_jax.model.weights.expert_spec); device: where the slot pools go; cache_state: a directory
    whose saved cache state (offload/warm.py) warms an offloading cache at load; stacked: per-layer caches
    of alike layers in one pool of blocks (slot_table.stacked_layout), so that those layers scan as one
    body."""

    def __init__(self, gguf, spec: ExpertSpec, device, *, fixed_bytes: int, expert_slots: int | None = None,
                 vram_budget: int | str | None = None, vram_reserve: int | str | None = None,
                 policy: str | Policy = "lru", prefetch: bool | int = False, expert_pools: str = "per-layer",
                 batch_rows: int = 1, cache_state: str | None = None, stacked: bool = False, fetch: str = "auto",
                 cold: tuple[Any, ExpertSpec] | None = None, promote_after: int = 2, cards: Mesh | None = None):
        self.device = device if device is not None else jax.devices()[0]
        # several cards (core/cards.py): the mesh whose cards split the slot pools; budgets are per card
        self.cards = cards
        n = 1 if cards is None else cards.size
        self.spec = spec
        self.policy = get_policy(policy)
        if isinstance(prefetch, bool) or prefetch is None:
            prefetch = int(bool(prefetch))
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ConfigError(f"prefetch={prefetch!r} is invalid: give True/False or a depth >= 0 "
                              "(MoE layers ahead to prefetch).")
        if fetch not in ("auto", "kernel", "loop"):
            raise ConfigError(f"fetch={fetch!r} is invalid: give 'auto', 'kernel' or 'loop'.")
        self.prefetch = prefetch  # depth: MoE layers ahead whose predicted experts each layer fetches
        if prefetch > 1 and self.device.platform == "gpu":
            log.warning("prefetch depth %d is not exact on GPU: greedy tokens may differ from the all-resident "
                        "run (depths 0 and 1 are exact; docs/benchmarks.md, \"Prefetch correctness\"); use "
                        "--prefetch-depth 1 for exact results", prefetch)
        layout = expert_layout(spec, expert_pools)
        self.plan: CachePlan = plan_model_cache(
            spec, fixed_bytes=fixed_bytes, expert_pools=expert_pools, batch_rows=batch_rows,
            expert_slots=expert_slots, vram_budget=vram_budget, vram_reserve=vram_reserve,
            free_bytes=_free_bytes(self.device, cards), cards=n)
        log.info(describe(self.plan) + ("" if cards is None else f"; split over {n} cards ({self.plan.n_slots // n:,} "
                                        f"slots each: {', '.join(str(d) for d in cards.devices.flat)})"))
        self.expert_pools = expert_pools
        if not self.plan.resident:
            sizes = sorted(set(self.plan.slots_per_pool))
            log.info("expert pools: %s (%d pool%s of %s slots)%s", expert_pools, len(self.plan.slots_per_pool),
                     "s" if len(self.plan.slots_per_pool) > 1 else "", "/".join(f"{n:,}" for n in sizes),
                     "; LRU hit rates measured higher with a cache per layer, see docs/benchmarks.md"
                     if expert_pools == "per-layer" else "")
        # misses fetched by one kernel call per layer (core/hostrows.py), else by a loop of copies; auto:
        # the kernel on a GPU, where the loop holds the host once per miss
        self.fetch_kernel = not self.plan.resident and (
            fetch == "kernel" or (fetch == "auto" and (self.device.platform == "gpu" or cards is not None))
        ) and hostrows.available(self.device)
        if cards is not None and not self.plan.resident and not self.fetch_kernel:
            raise ConfigError("several cards fetch their misses by the fetch kernel only, which is "
                              f"{'off (fetch=loop)' if fetch == 'loop' else 'not available here: ' + hostrows.why_not(self.device)}"
                              ": drop --fetch loop / install a compiler, or run on one card (--devices 0).")
        store: ExpertStore | None = None
        # seconds per expert of an in-step miss fetch and of a whole-layer stream, timed at load (0: resident)
        self.fetch_s = self.stream_s = 0.0
        self._loading: Future | None = None  # the store's load, until `wait` takes it
        # the store in host memory of our own or the file mapped (STRATA_JAX_STORE), read by address only; what
        # holds that memory (store.HostMemory / FileMapping) while the store is in use
        self._own_store = False
        self._host_memory: tuple = ()
        # mixed precision: (the low-bit GGUF, its experts' layout), used only when offloading
        self.cold_spec = cold[1] if cold is not None and not self.plan.resident else None
        self.promote_after = promote_after
        if cold is not None and self.plan.resident:
            log.info("cold experts not used: every expert is resident at the model's own type")
        if self.plan.resident:
            if cards is None:
                slots = resident_slot_table(gguf, spec, self.device)
            else:  # built split: no card ever holds more than its share
                slots = resident_slot_table(gguf, spec, cards_.split_rows(cards), cards_.replicated(cards))
            if cache_state is not None:
                log.info("expert cache state %s not used: every expert is resident, there is no cache to warm",
                         cache_state)
        else:
            # the store loads in the background (most of a cold start: allocating pinned memory and reading
            # the file); until it is in, the provider holds its shapes, so a first step can compile meanwhile
            # where the kernels fetch, the store goes into host memory of our own, page-locked after the reads
            # (store.HostMemory, read by address), which loads several times faster than JAX's pinned memory
            # (docs/benchmarks.md); STRATA_JAX_STORE=pinned keeps JAX's, =mapped reads the model file itself
            # in place (store.FileMapping: no copy)
            mode = _store_memory() if self.fetch_kernel else "pinned"
            self._own_store = mode != "pinned"
            self._loading = _in_background(_load_stores, gguf, spec, self.device, cold if self.cold_spec else None,
                                           mode)
            at = self.device if cards is None else cards_.replicated(cards)
            store = _ahead_store(gguf, spec, self.device, at, mode, self.fetch_kernel)
            if self.cold_spec is not None:
                store = store.replace(cold=_ahead_store(cold[0], self.cold_spec, self.device, at, mode,
                                                        self.fetch_kernel))
            if cards is not None or self._own_store:
                store = store.addressed()
            slots = empty_slot_table(spec, list(self.plan.slots_per_pool), self.policy, layout,
                                     self.device if cards is None else cards_.split_rows(cards),  # built split
                                     stacked=stacked and expert_pools == "per-layer")
            if len(slots.pools) != len(self.plan.slots_per_pool):
                log.info("expert pools: the %d per-layer caches in %d pool%s of alike layers (layer scan)",
                         len(self.plan.slots_per_pool), len(slots.pools), "s" if len(slots.pools) > 1 else "")
            self._identity = cache_identity(gguf, spec.n_experts, slots, self.policy.name)
            # read (and checked) now, so a state that does not fit is reported at load; filled once the store is in
            self._saved = None if cache_state is None else load_cache_state(cache_state, slots.caches, self._identity)
            self._cache_state = cache_state
        self.store_memory_kind = None  # the store's, once it is in (`wait`)
        self.device_bytes = sum(p.data.nbytes for p in slots.pools)  # what the slot pools take on the device
        self._n_layers = len(spec.moe_layers)
        # Step inputs are committed to the device up front: jit's cache key includes committedness and
        # step outputs are committed, so uncommitted initial state would recompile the second step.
        uses_ME = None if self.cold_spec is None else jax.device_put(
            jnp.zeros((len(spec.moe_layers), spec.n_experts), jnp.int32), self.device)
        self._experts: SlotExperts | None = SlotExperts(
            self._place_table(slots), store, self._zero_counters(), None if self.plan.resident else self.policy,
            0 if self.plan.resident else self.prefetch, uses_ME=self._place(uses_ME),
            promote_after=promote_after if self.cold_spec is not None else 0,
            card_misses_C=None if cards is None else self._place(jnp.zeros((n,), jnp.int32)))
        self.reset_stats()
        free = device_free_bytes(self.device)
        if free is not None and free < LOW_FREE_VRAM:
            log.warning("only %s of device memory is free after loading; long prompts may run out. Lower "
                        "--expert-slots or --vram-budget, or raise --vram-reserve.", fmt_bytes(free))

    @property
    def bytes_per_expert_M(self) -> np.ndarray:
        if self.store_memory_kind is None:
            return np.zeros(self._n_layers, np.int64)
        return np.array([self.spec.bytes_per_expert(i) for i in range(self._n_layers)], np.int64)

    def layer_key(self, moe_idx: int):
        """What MoE layers share to be scanned as one body (SlotExperts.layer_key)."""
        return self._experts.layer_key(moe_idx)

    @property
    def slots(self) -> SlotTable | None:
        """The slot table, once the store is in (None while a step holds the provider)."""
        if self._experts is not None:
            self.wait()
        return self._experts.table if self._experts is not None else None

    @property
    def store(self) -> ExpertStore | None:
        if self._experts is not None:
            self.wait()
        return self._experts.store if self._experts is not None else None

    @property
    def loading(self) -> bool:
        """Whether the store is still loading (`wait` ends it)."""
        return self._loading is not None

    def ahead(self) -> SlotExperts:
        """While the store loads: the provider with the store's shapes, to lower and compile a step with
        (jit(...).lower(...).compile()); it cannot run. Between steps only."""
        return self._experts

    def wait(self) -> None:
        """Until the store is in (a no-op after): then warm the cache from the saved state and time the
        in-step fetch. A failed load raises here, at every call. Between steps only."""
        if self._loading is None:
            return
        store, self._host_memory = self._loading.result()
        if self.fetch_kernel:
            stores = (store,) if store.cold is None else (store, store.cold)
            if any(not s.addr and hostrows.addresses(s.groups, self.device) is None for s in stores):
                log.warning("the expert store is not in memory the device can read (%s host memory): misses are "
                            "fetched by a loop of copies instead of the fetch kernel", store.memory_kind)
                self.fetch_kernel = False
            else:
                store = _with_addr(store, lambda s: s.addr or hostrows.addresses(s.groups, self.device))
        slots = self._experts.table
        self.fetch_s, self.stream_s = calibrate_fetch(store, self.device)
        if self.cards is not None:  # the arrays stay here (the kernels read them); the steps take their addresses
            self._host_store = store
            store = _with_addr(store, lambda s: self._place(s.addr)).addressed()
        elif self._own_store:  # as the ahead-compiled steps took it (a cold twin's arrays stay here)
            self._host_store = store
            store = store.addressed()
        if self._saved is not None:  # each card fills its own slots (by the fetch kernel on several)
            caches, saved = self._saved
            slots = self._place_table(restore_slot_table(self._cache_state, (self._place(caches), saved), slots, store))
            self._saved = None
        row_bytes = self.spec.bytes_per_expert(0)
        log.info("in-step expert fetch (%s): %.0f us per expert of %s (%.1f GB/s host->device)",
                 "kernel" if self.fetch_kernel else "loop", self.fetch_s * 1e6, fmt_bytes(row_bytes),
                 row_bytes / self.fetch_s / 1e9)
        self.store_memory_kind = store.memory_kind
        self._experts = self._experts.replace(table=slots, store=store)
        self._loading = None

    def take(self) -> SlotExperts:
        """The donated expert provider for one jitted step (after the store is in); the manager holds
        nothing until `put`."""
        self.wait()
        experts, self._experts = self._experts, None
        return experts

    def put(self, experts: SlotExperts) -> None:
        self._experts = experts

    def save_cache_state(self, path: str) -> bool:
        """Save the cache's state to the directory `path` (offload/warm.py); False (and nothing written)
        when every expert is resident. Between steps only: a step holds the slot table."""
        if self.plan.resident:
            log.info("expert cache state not saved: every expert is resident, there is no cache to warm")
            return False
        if self._experts is None:
            raise RuntimeError("save_cache_state during a step: the step holds the slot table")
        self.wait()
        save_cache_state(path, self._experts.table.caches, self._identity)
        return True

    def _zero_counters(self) -> ExpertCounters:
        return self._place(ExpertCounters.zeros(self._n_layers))

    def _place(self, tree):
        """Step state that is not a slot pool: on the device, or replicated on every card."""
        return jax.device_put(tree, self.device if self.cards is None else cards_.replicated(self.cards))

    def _place_table(self, table: SlotTable) -> SlotTable:
        """The slot table on the device; on several cards its pools' rows split over them and the rest
        replicated (core/cards.py)."""
        if self.cards is None:
            return jax.device_put(table, self.device)
        pools = tuple(ExpertRows(jax.device_put(p.data, cards_.split_rows(self.cards)), p.parts, self.cards)
                      for p in table.pools)
        return table.replace(pools=pools, caches=self._place(table.caches))

    def card_stats(self) -> list[dict[str, Any]]:
        """Per card of a split cache: its device, slots, their bytes and the misses it fetched (they add up to
        the misses fetched into the cache); [] on one card."""
        if self.cards is None:
            return []
        n = self.cards.size
        misses = np.asarray(self._experts.card_misses_C) if self._experts is not None else np.zeros(n, np.int64)
        return [{"card": c, "device": str(d), "slots": self.plan.n_slots // n, "bytes": self.device_bytes // n,
                 "misses": int(misses[c])} for c, d in enumerate(self.cards.devices.flat)]

    def reset_stats(self) -> None:
        if self._experts is not None:
            self._experts = self._experts.replace(counters=self._zero_counters())
            if self._experts.card_misses_C is not None:
                self._experts = self._experts.replace(card_misses_C=self._place(jnp.zeros_like(
                    self._experts.card_misses_C)))
        self.step_s = 0.0  # wall time of the steps run since the reset (Model reports it via note_steps)
        self.steps = 0

    def note_steps(self, seconds: float, n: int) -> None:
        self.step_s += seconds
        self.steps += n

    def counters(self) -> np.ndarray:
        """int64 [MoE layers, 7]: hits, misses, streamed, prefetched, predicted-and-routed, predicted, cold
        (core.experts.COUNTERS)."""
        return self._experts.counters.as_array()

    def stats(self) -> dict[str, Any]:
        """Counters since load or reset_stats: decode lookups, hits, misses, hit rate, bytes moved
        host->device (misses, prefetches, and whole layers streamed for prefill), prefetch quality."""
        st = self.counters()
        hits, misses, streamed, prefetched, pred_hit, pred_total, cold = (int(x) for x in st.sum(axis=0))
        actual = hits + misses - int(st[0, 0] + st[0, 1])  # lookups of layers that had a prediction
        per_expert_M = self.bytes_per_expert_M
        moved = int(((st[:, 1] - st[:, 6] + st[:, 2] + st[:, 3]) * per_expert_M).sum() + self.cold_bytes(st))
        # in-step fetches are not overlapped with compute, so their time is time the step waits:
        # fetched experts x the per-expert cost measured at load through the same code path
        transfer_s = (misses + prefetched) * self.fetch_s + streamed * self.stream_s
        return {
            "lookups": hits + misses,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "bytes_h2d": moved,
            "step_seconds": self.step_s,
            "steps": self.steps,
            "h2d_GB_per_s": moved / self.step_s / 1e9 if self.step_s else None,
            "fetch_us_per_expert": self.fetch_s * 1e6,
            "link_GB_per_s": float(per_expert_M[0]) / self.fetch_s / 1e9 if self.fetch_s else None,
            "transfer_stall_seconds": transfer_s,
            "transfer_stall_fraction": min(transfer_s / self.step_s, 1.0) if self.step_s else None,
            "prefill_streamed_experts": streamed,
            "prefetched": prefetched,
            "prefetch_precision": pred_hit / pred_total if pred_total else None,
            "prefetch_recall": pred_hit / actual if pred_total and actual else None,
            "per_layer_hit_rate": [float(r[0] / (r[0] + r[1])) if r[0] + r[1] else 1.0 for r in st.tolist()],
            "per_layer_lookups": [int(r[0] + r[1]) for r in st.tolist()],
            "expert_slots": self.plan.n_slots,
            "total_experts": self.plan.total_experts,
            "resident": self.plan.resident,
            "policy": None if self.plan.resident else self.policy.name,
            "expert_pools": None if self.plan.resident else self.expert_pools,
            "prefetch": 0 if self.plan.resident else self.prefetch,
            "store_memory": self.store_memory_kind,
            "expert_fetch": "kernel" if self.fetch_kernel else "loop",
            "cold_experts": cold,
            "cold_share": cold / (hits + misses) if self.cold_spec is not None and hits + misses else None,
            "promote_after": self.promote_after if self.cold_spec is not None else None,
            "cards": self.card_stats(),
        }

    def cold_bytes(self, st: np.ndarray) -> int:
        """Bytes the misses served low-bit moved (counters() rows st)."""
        if self.cold_spec is None or self.store_memory_kind is None:
            return 0
        return int(sum(int(st[i, 6]) * self.cold_spec.bytes_per_expert(i) for i in range(self._n_layers)))


def _ahead_store(gguf, spec: ExpertSpec, device, at, mode: str, kernel: bool) -> ExpertStore:
    """The store's shapes as the load will give it (mode: _store_memory's), to compile a first step against
    while it loads; at: where its addresses go (the device, or replicated over the cards)."""
    store = store_shapes(spec, device)
    if not kernel:
        return store
    if mode != "mapped":
        return store.replace(addr=hostrows.address_shapes(len(store.groups), at))
    widths = file_widths(gguf, spec)
    sharding = at if isinstance(at, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(at)
    return store.replace(widths=widths, addr=tuple(
        jax.ShapeDtypeStruct((store.shape(g)[0], len(w), 2), np.uint32, sharding=sharding) for g, w in enumerate(widths)))


def _load_stores(gguf, spec: ExpertSpec, device, cold: tuple[Any, ExpertSpec] | None,
                 mode: str = "pinned") -> tuple[ExpertStore, tuple]:
    """The expert store, with its low-bit twin when mixed precision is on, and the host memory of our own
    it lives in (store.HostMemory, or the file's store.FileMapping; with JAX's arrays, ())."""
    own = {"mapped": load_file_store, "registered": load_registered_store}.get(mode)

    def one(gguf, spec):
        if own is not None:
            try:
                return own(gguf, spec, device)
            except MemoryError as e:
                log.warning("%s: the store goes into JAX's pinned memory instead", e)
        return load_expert_store(gguf, spec, device), ()

    store, mems = one(gguf, spec)
    if cold is not None:
        cold_store, cold_mems = one(*cold)
        store, mems = store.replace(cold=cold_store), mems + cold_mems
    return store, mems


def _store_memory() -> str:
    """STRATA_JAX_STORE: "registered" (the default), "pinned" (JAX's pinned host memory) or "mapped" (the
    model file itself)."""
    value = os.environ.get("STRATA_JAX_STORE", "registered") or "registered"
    if value not in ("registered", "pinned", "mapped"):
        raise ConfigError(f"STRATA_JAX_STORE={value!r}: choose registered (the default: host memory of the engine's "
                          "own, page-locked after the reads), pinned (JAX's pinned host memory) or mapped (the model "
                          "file itself, read in place).")
    return value


def _with_addr(store: ExpertStore, addr) -> ExpertStore:
    """The store (and its cold twin) with the fetch kernel's addresses addr(store)."""
    cold = None if store.cold is None else store.cold.replace(addr=addr(store.cold))
    return store.replace(addr=addr(store), cold=cold)


def _times(size: int | str | None, n: int, name: str) -> int | None:
    """A per-card size (vram_budget, vram_reserve) for n cards together."""
    return size if size is None or n == 1 else parse_size(size, name) * n


def _free_bytes(device, mesh: Mesh | None) -> int | None:
    if mesh is None:
        return device_free_bytes(device)
    free = [device_free_bytes(d) for d in mesh.devices.flat]
    return None if any(f is None for f in free) else min(free) * len(free)


def split_plan(plan: CachePlan, spec: ExpertSpec, n: int, batch_rows: int = 1) -> CachePlan:
    """A plan whose pools split evenly over n cards: each offloading pool's slots rounded down to a multiple
    of n (up where that leaves fewer than a step needs, the slots that costs taken back from the largest
    pools, so the plan stays within the bytes it was given where any pool can spare them); every expert
    resident needs each resident pool's rows (layers x experts) to divide by n."""
    if plan.resident:
        for layers in resident_layout(spec).pool_layers:
            if len(layers) * spec.n_experts % n:
                raise ConfigError(f"{len(layers)} layers x {spec.n_experts} experts do not split over {n} cards: "
                                  "use a number of cards that divides them, or --expert-slots to offload.")
        return plan
    floor = -(-_min_slots(spec, batch_rows) // n) * n  # a step's floor, a multiple of n
    slots = [max(s - s % n, floor) for s in plan.slots_per_pool]
    over = sum(slots) - plan.n_slots  # slots the floor added beyond what the budget gave
    while over > 0:
        i = max(range(len(slots)), key=slots.__getitem__)
        if slots[i] - n < floor:
            break  # no pool can spare n slots: the step's floor needs these few more
        slots[i] -= n
        over -= n
    return dataclasses.replace(plan, slots_per_pool=tuple(slots),
                               expert_cache_bytes=int(sum(slots) * plan.avg_expert_bytes))
