"""Moving expert blocks from the host store into device memory, inside the jitted step.

`fetch_misses` copies only the experts the policy marked as misses, one DMA per expert, in a
loop whose trip count is the (traced) number of misses: at a high hit rate a step moves few bytes and
pays no per-expert branch. Writes go into the donated slot pool, in place. `stream_layer` brings a
whole layer's experts over at once (the grouped prefill); `stream_group` a group of consecutive
experts (the dense prefill, one group per step of its scan: model/moe.py).

Each takes the candidate store layers and which of them (`which`, traced inside a scanned run of
layers: model/runs.py): the store keeps one host array per layer, so a traced layer is a switch over
its candidates' copies, never a stack of host arrays.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.offload.policies import Plan
from strata_jax.core.experts import ExpertRows


def to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def read_rows(layers: tuple[ExpertRows, ...], which, start, n: int) -> jax.Array:
    """Rows start .. start + n - 1 of store layer layers[which], on the device: uint8 [n, P]."""
    def one(layer):
        return lambda s: to_device(jax.lax.dynamic_slice_in_dim(layer.data, s, n, axis=0))

    if len(layers) == 1:
        return one(layers[0])(start)
    return jax.lax.switch(which, [one(layer) for layer in layers], start)


def fetch_misses(pool: ExpertRows, layers: tuple[ExpertRows, ...], which, plan: Plan, base=0) -> ExpertRows:
    """The pool with plan's misses copied from store layer layers[which] into slots base + plan.slot_U."""
    order_U = jnp.argsort(~plan.miss_U, stable=True)  # misses first

    def body(i, data_XP):
        j = order_U[i]
        row_1P = read_rows(layers, which, plan.ids_U[j], 1)
        return jax.lax.dynamic_update_slice_in_dim(data_XP, row_1P, base + plan.slot_U[j], 0)

    return ExpertRows(jax.lax.fori_loop(0, plan.n_misses, body, pool.data), pool.parts)


def stream_layer(layers: tuple[ExpertRows, ...], which=0) -> ExpertRows:
    """All E experts of one layer on the device (one copy), as a temporary pool indexed by expert id."""
    return ExpertRows(read_rows(layers, which, 0, layers[0].n_rows), layers[0].parts)


def stream_group(layers: tuple[ExpertRows, ...], which, first: jax.Array, n: int) -> ExpertRows:
    """Experts first .. first + n - 1 of one layer on the device (one copy), indexed from 0."""
    return ExpertRows(read_rows(layers, which, first, n), layers[0].parts)


def calibrate_fetch(layer: ExpertRows, device, n: int = 8, reps: int = 3) -> tuple[float, float]:
    """Seconds per expert of an in-jit miss fetch (through `fetch_misses` itself: same loop, same DMA,
    into a scratch pool) and of streaming a whole layer: the costs telemetry uses for transfer time."""
    import time

    def seconds(run) -> float:
        jax.block_until_ready(run())  # compile
        t0 = time.perf_counter()
        for _ in range(reps):
            out = run()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps

    n = min(n, layer.n_rows)
    pool = [ExpertRows(jnp.zeros((n, layer.bytes_per_expert), jnp.uint8, device=device), layer.parts)]
    ids = jnp.arange(n, dtype=jnp.int32)
    plan = jax.device_put(Plan(ids, ids, jnp.ones((n,), bool), jnp.full((n,), -1, jnp.int32)), device)
    fetch = jax.jit(lambda pool, layer, plan: fetch_misses(pool, (layer,), 0, plan), donate_argnums=0)

    def run_fetch():
        pool[0] = fetch(pool[0], layer, plan)  # the scratch pool is donated back each time
        return pool[0]

    stream = jax.jit(lambda rows: stream_layer((rows,)).data)
    return seconds(run_fetch) / n, seconds(lambda: stream(layer)) / layer.n_rows
