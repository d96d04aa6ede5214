"""Moving expert blocks from the host store into device memory, inside the jitted step.

`fetch_misses` copies only the experts the policy marked as misses, one DMA per expert tensor, in a
loop whose trip count is the (traced) number of misses: at a high hit rate a step moves few bytes and
pays no per-expert branch. Writes go into the donated slot pool, in place. `stream_layer` brings a
whole layer's experts over at once for prefill chunks, where every expert is likely needed.

Shape legend: S slots, E experts of the layer, U requested experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.model.weights import QTensor
from strata_jax.offload.policies import Plan
from strata_jax.offload.slot_table import ExpertPool
from strata_jax.offload.store import LayerExperts


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


def fetch_misses(pool: ExpertPool, layer: LayerExperts, plan: Plan) -> ExpertPool:
    order_U = jnp.argsort(~plan.miss_U, stable=True)  # misses first

    def body(i, tensors):
        j = order_U[i]
        expert, slot = plan.ids_U[j], plan.slot_U[j]
        out = []
        for dst, src in zip(tensors, (layer.gate.data, layer.up.data, layer.down.data)):
            w = _to_device(jax.lax.dynamic_index_in_dim(src, expert, 0, keepdims=False))
            out.append(jax.lax.dynamic_update_index_in_dim(dst, w, slot, 0))
        return tuple(out)

    g, u, d = jax.lax.fori_loop(0, plan.n_misses, body, (pool.gate.data, pool.up.data, pool.down.data))
    return ExpertPool(QTensor(g, pool.gate.qtype, pool.gate.n_cols), QTensor(u, pool.up.qtype, pool.up.n_cols),
                      QTensor(d, pool.down.qtype, pool.down.n_cols))


def stream_layer(layer: LayerExperts) -> ExpertPool:
    """All E experts of one layer on the device, as a temporary pool indexed by expert id."""
    return ExpertPool(*(QTensor(_to_device(t.data), t.qtype, t.n_cols) for t in (layer.gate, layer.up, layer.down)))
