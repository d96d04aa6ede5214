"""LayerRef: one of several identical layers, picked by a traced index (a scan over a run of layers,
model/runs.py). Functions that take a layer index (KV layer, MoE layer, state slot) accept an int or a
LayerRef; `value` gives either as something that indexes an array, `first` the static stand-in for
what all the candidates share (their pool, their window)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerRef:
    ids: tuple[int, ...]  # the candidate indices, static
    at: Any  # int32 scalar, traced: the candidate this iteration runs

    def pick(self, values) -> jax.Array:
        """values[at] for a static per-candidate sequence (ints), by arithmetic where they are evenly spaced
        (a run's layers are) and else by a select over them: never a dynamic slice of a constant, which XLA
        on a GPU would run as a memcpy thunk needing `at` on the host when the result feeds a custom call
        (the row and fetch kernels of core/hostrows.py), keeping the layer scan out of its command buffers."""
        values = [int(v) for v in values]
        at = jnp.asarray(self.at, jnp.int32)
        steps = {b - a for a, b in zip(values, values[1:])}
        if len(steps) <= 1:
            return jnp.int32(values[0]) + at * jnp.int32(steps.pop() if steps else 0)
        hit = jnp.arange(len(values), dtype=jnp.int32) == at
        return jnp.sum(jnp.where(hit, jnp.asarray(values, jnp.int32), 0))


def value(i: int | LayerRef) -> int | jax.Array:
    """The index itself: an int, or the traced ids[at]."""
    return i.pick(i.ids) if isinstance(i, LayerRef) else i


def first(i: int | LayerRef) -> int:
    """A static index standing for all candidates (which are alike in every static property)."""
    return i.ids[0] if isinstance(i, LayerRef) else i


def each(i: int | LayerRef) -> tuple[int, ...]:
    """Every index i can be."""
    return i.ids if isinstance(i, LayerRef) else (i,)


def mapped(i: int | LayerRef, table) -> int | LayerRef:
    """table[i] (a static mapping, e.g. block -> MoE index) for an int or each candidate."""
    return LayerRef(tuple(table[j] for j in i.ids), i.at) if isinstance(i, LayerRef) else table[i]


def scatter_updates(idx_BT: jax.Array, new_BT: jax.Array, drop_at: int) -> tuple[jax.Array, jax.Array]:
    """Indices and values for `.at[..., idx_BT].set(new_BT, mode="drop")` inside a layer scan, with a second
    update at drop_at (past the axis: always dropped) where there is only one. XLA turns a one-update
    scatter into a dynamic update that reads the old cell at the loop's index, a slice that keeps the loop
    out of the GPU's command buffers (docs/benchmarks.md); two updates stay a scatter."""
    if idx_BT.size != 1:
        return idx_BT, new_BT
    return (jnp.concatenate([idx_BT, jnp.full_like(idx_BT, drop_at)], axis=1),
            jnp.concatenate([new_BT, jnp.zeros_like(new_BT)], axis=1))
