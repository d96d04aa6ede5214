"""Several cards of one host as one expert cache (`devices=`, `--devices 0,1`).

One SPMD program runs on every card of a mesh with one axis, "card". Dense weights, the KV cache, the
cache policy's state and the counters are replicated: every card computes the same routing and the same
policy decisions, so the state stays identical without exchanging it. Only the expert slot pools are
split: each pool's rows (slots) are cut into equal contiguous ranges, one per card. A card fetches the
misses whose slots it owns, by the fetch kernel from the shared pinned-host store (its address only: the
store is never a program operand, so host memory holds it once), and multiplies the routed pairs whose
slots it owns; one sum over the cards joins the MoE output. The pool of a per-layer cache is a stack of
its layers' blocks, so there the split falls by layer; a shared pool splits by slot.

Everything here runs inside the jitted step (jax.shard_map over the pool's rows); `pool.cards` (the mesh,
a static field of core.experts.ExpertRows) says a pool is split. On CPU the cards are virtual devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N, set before JAX starts).

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "card"


def mesh(devices: Sequence[Any]) -> Mesh:
    """A one-axis mesh ("card") over these devices, in order (the first holds what is not split)."""
    return Mesh(np.array(list(devices)), (AXIS,))


def replicated(m: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(m, P(), memory_kind=memory_kind)


def split_rows(m: Mesh) -> NamedSharding:
    """A pool's rows cut into one contiguous range per card."""
    return NamedSharding(m, P(AXIS))


def local_slots(slot: jax.Array, n_local: int) -> tuple[jax.Array, jax.Array]:
    """Inside a card's program: each global slot as a row of this card's range (-1 where another card owns
    it), and whether this card owns it."""
    local = slot - jax.lax.axis_index(AXIS) * n_local
    own = (local >= 0) & (local < n_local) & (slot >= 0)
    return jnp.where(own, local, -1), own


def owner(slot: jax.Array, n_slots: int, n_cards: int) -> jax.Array:
    """The card that holds each global slot of a pool of n_slots rows (-1 for slot -1)."""
    return jnp.where(slot >= 0, slot // (n_slots // n_cards), -1)


def _on_cards(m: Mesh, fn: Callable, split: tuple[bool, ...], out_split: bool, *args):
    specs = tuple(P(AXIS) if s else P() for s in split)
    return jax.shard_map(fn, mesh=m, in_specs=specs, out_specs=P(AXIS) if out_split else P(),
                         check_vma=False)(*args)


def _per_card(m: Mesh, data_XP: jax.Array, slot: jax.Array, fn: Callable, out_split: bool, *rest):
    """fn(local data, local slot, own, *rest) on every card: its share of a split pool, the global slots as
    rows of that share (-1 elsewhere) and which of them it owns; the other arguments replicated."""
    def local(data, slot, *rest):
        return fn(data, *local_slots(slot, data.shape[0]), *rest)

    return _on_cards(m, local, (True, False) + (False,) * len(rest), out_split, data_XP, slot, *rest)


def routed_sum(m: Mesh, data_XP: jax.Array, compute: Callable, w_Nk: jax.Array, slot_Nk: jax.Array, *rest):
    """sum over cards of compute(local data_XP, w_Nk, local slot_Nk, *rest): each card computes the pairs
    whose slots it holds, the others at weight 0 and slot -1 (which the kernels skip), and one psum joins
    them. compute returns float32 [N, D] (the products sum in float32, as on one card)."""
    def local(data, slot, own, w, *rest):
        return jax.lax.psum(compute(data, jnp.where(own, w, 0.0), slot, *rest), AXIS)

    return _per_card(m, data_XP, slot_Nk, local, False, w_Nk, *rest)


def take_rows(m: Mesh, data_XP: jax.Array, slot_n: jax.Array) -> jax.Array:
    """data_XP[slot_n] of a split pool, replicated: each card reads the rows it holds (zeros for the others)
    and a sum over the cards joins them, in the pool's own dtype (exact: one card contributes each row, the
    others add zeros)."""
    def local(data, slot, own):
        return jax.lax.psum(jnp.where(own[:, None], data[jnp.maximum(slot, 0)], 0).astype(data.dtype), AXIS)

    return _per_card(m, data_XP, slot_n, local, False)


def fetch_rows(m: Mesh, data_XP: jax.Array, copy: Callable, slot_U: jax.Array, miss_U: jax.Array, *rest):
    """A split pool after copy(local data, local slot_U, miss_U & owned, *rest) on every card: each card
    writes the misses whose slots it holds into its own rows."""
    def local(data, slot, own, miss, *rest):
        return copy(data, slot, miss & own, *rest)

    return _per_card(m, data_XP, slot_U, local, True, miss_U, *rest)


def on_every_card(m: Mesh, fn: Callable, *args):
    """fn(card, n_cards, *args) on every card, every argument and the result replicated: work cut by the
    card's index (a prefill's groups of experts, each card streaming its share over its own link), joined
    inside fn by `total`."""
    def local(*args):
        return fn(jax.lax.axis_index(AXIS), m.size, *args)

    return jax.shard_map(local, mesh=m, in_specs=P(), out_specs=P(), check_vma=False)(*args)


def total(x: jax.Array) -> jax.Array:
    """Inside on_every_card: the sum of x over the cards."""
    return jax.lax.psum(x, AXIS)
