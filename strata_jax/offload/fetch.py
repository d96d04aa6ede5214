"""Moving expert blocks from the host store into device memory, inside the jitted step.

`fetch_misses` copies only the experts the policy marked as misses, one DMA per expert, in a
loop whose trip count is the (traced) number of misses: at a high hit rate a step moves few bytes and
pays no per-expert branch. Writes go into the donated slot pool, in place. `stream_layer` brings a
whole layer's experts over at once (the grouped prefill); `stream_group` a group of consecutive
experts (the dense prefill, one group per step of its scan: model/layers/moe.py).

Each takes the store and a MoE layer: an int, or a LayerRef (traced inside a scanned run of layers:
model/runs.py). The store stacks the layers of a row layout in one host array, so a traced layer is
one more index of the same dynamic slice: only the rows needed are copied, never a whole layer.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.core import cards, layer_ref
from strata_jax.core.experts import ExpertRows
from strata_jax.offload.policies import Plan
from strata_jax.offload.store import ExpertStore


def to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def read_rows(store: ExpertStore, moe_idx, start, n: int) -> jax.Array:
    """Rows start .. start + n - 1 of MoE layer moe_idx's store rows, on the device: uint8 [n, P]."""
    return to_device(store.rows(moe_idx, start, n))[0]


def fetch_misses(pool: ExpertRows, store: ExpertStore, moe_idx, plan: Plan, base=0) -> ExpertRows:
    """The pool with plan's misses copied from MoE layer moe_idx's store rows into slots base + plan.slot_U:
    by one call of the fetch kernel where the store has its addresses (core/hostrows.py), else a loop. A pool
    split over cards (core/cards.py): each card copies the misses whose slots it holds."""
    if store.addr:
        g = store.group(moe_idx)
        _, E, _ = store.shape(g)
        at = layer_ref.value(layer_ref.mapped(moe_idx, store.layer_local))
        if pool.cards is None:
            data = store.kernel_rows(g, pool.data, at * E + plan.ids_U, base + plan.slot_U, plan.miss_U)
        else:
            def copy(data_XP, slot_U, miss_U, addr_2, row_U):
                return store.kernel_rows(g, data_XP, row_U, slot_U, miss_U, addr=addr_2)

            data = cards.fetch_rows(pool.cards, pool.data, copy, base + plan.slot_U, plan.miss_U, store.addr[g],
                                    at * E + plan.ids_U)
        return pool.replace(data=data)
    if pool.cards is not None:
        raise ValueError("a pool split over cards is filled by the fetch kernel only (the store has no addresses)")
    order_U = jnp.argsort(~plan.miss_U, stable=True)  # misses first

    def body(i, data_XP):
        j = order_U[i]
        row_1P = read_rows(store, moe_idx, plan.ids_U[j], 1)
        return jax.lax.dynamic_update_slice_in_dim(data_XP, row_1P, base + plan.slot_U[j], 0)

    return pool.replace(data=jax.lax.fori_loop(0, plan.n_misses, body, pool.data))


def stream_layer(store: ExpertStore, moe_idx) -> ExpertRows:
    """All E experts of one layer on the device (one copy), as a temporary pool indexed by expert id."""
    return stream_group(store, moe_idx, 0, store.shape(store.group(moe_idx))[1])


def stream_group(store: ExpertStore, moe_idx, first, n: int) -> ExpertRows:
    """Experts first .. first + n - 1 of one layer on the device (one copy), indexed from 0. An addressed
    store (several cards: ExpertStore.addressed) by the fetch kernel, on every card."""
    g = store.group(moe_idx)
    if store.groups:
        return ExpertRows(read_rows(store, moe_idx, first, n), store.parts[g])
    L, E, P = store.shape(g)
    at = layer_ref.value(layer_ref.mapped(moe_idx, store.layer_local))
    i_n = jnp.arange(n, dtype=jnp.int32)
    data = store.kernel_rows(g, jnp.zeros((n, P), jnp.uint8), at * E + first + i_n, i_n, jnp.ones((n,), bool))
    return ExpertRows(data, store.parts[g])


def calibrate_fetch(store: ExpertStore, device, n: int = 8, reps: int = 3) -> tuple[float, float]:
    """Seconds per expert of an in-jit miss fetch of MoE layer 0 (through `fetch_misses` itself: same loop,
    same DMA, into a scratch pool) and of streaming a whole layer: the costs telemetry uses for transfer time."""
    import time

    def seconds(run) -> float:
        jax.block_until_ready(run())  # compile
        t0 = time.perf_counter()
        for _ in range(reps):
            out = run()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps

    g = store.layer_group[0]
    _, E, P = store.shape(g)
    n = min(n, E)
    pool = [ExpertRows(jnp.zeros((n, P), jnp.uint8, device=device), store.parts[g])]
    ids = jnp.arange(n, dtype=jnp.int32)
    plan = jax.device_put(Plan(ids, ids, jnp.ones((n,), bool), jnp.full((n,), -1, jnp.int32)), device)
    fetch = jax.jit(lambda pool, store, plan: fetch_misses(pool, store, 0, plan), donate_argnums=0)

    def run_fetch():
        pool[0] = fetch(pool[0], store, plan)  # the scratch pool is donated back each time
        return pool[0]

    stream = jax.jit(lambda store: stream_layer(store, 0).data)
    return seconds(run_fetch) / n, seconds(lambda: stream(store)) / E
