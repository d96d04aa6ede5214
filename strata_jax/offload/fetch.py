"""Moving expert blocks from the host store into device memory, inside the jitted step.

`fetch_misses` copies only the experts the policy marked as misses, one DMA per expert, in a
loop whose trip count is the (traced) number of misses: at a high hit rate a step moves few bytes and
pays no per-expert branch. Writes go into the donated slot pool, in place. `stream_layer` brings a
whole layer's experts over at once (the grouped prefill); `stream_group` a group of consecutive
experts (the dense prefill, one group per step of its scan: model/moe.py).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.offload.policies import Plan
from strata_jax.core.experts import ExpertRows


def to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def fetch_misses(pool: ExpertRows, layer: ExpertRows, plan: Plan) -> ExpertRows:
    order_U = jnp.argsort(~plan.miss_U, stable=True)  # misses first

    def body(i, data_XP):
        j = order_U[i]
        row_P = to_device(jax.lax.dynamic_index_in_dim(layer.data, plan.ids_U[j], 0, keepdims=False))
        return jax.lax.dynamic_update_index_in_dim(data_XP, row_P, plan.slot_U[j], 0)

    return ExpertRows(jax.lax.fori_loop(0, plan.n_misses, body, pool.data), pool.parts)


def stream_layer(layer: ExpertRows) -> ExpertRows:
    """All E experts of one layer on the device (one copy), as a temporary pool indexed by expert id."""
    return ExpertRows(to_device(layer.data), layer.parts)


def stream_group(layer: ExpertRows, first: jax.Array, n: int) -> ExpertRows:
    """Experts first .. first + n - 1 of one layer on the device (one copy), indexed from 0."""
    return ExpertRows(to_device(jax.lax.dynamic_slice_in_dim(layer.data, first, n, axis=0)), layer.parts)


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
    fetch = jax.jit(fetch_misses, donate_argnums=0)

    def run_fetch():
        pool[0] = fetch(pool[0], layer, plan)  # the scratch pool is donated back each time
        return pool[0]

    stream = jax.jit(lambda rows: stream_layer(rows).data)
    return seconds(run_fetch) / n, seconds(lambda: stream(layer)) / layer.n_rows
