"""Routed experts as the rest of the package sees them: the byte layout of one expert, the counters
a step keeps about them, and the provider protocol through which the MoE block reaches them.

An expert is ONE byte row `uint8[P]`: its gate, up and down GGML rows back to back (`ExpertRows`).
The host store, the device slot pools and a group streamed for prefill all use this row, so a miss
is one copy and the kernels index a pool by slot.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.core.qtensor import QTensor

# the three GGUF tensors of a MoE layer's routed experts, in row order
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# or two, gate and up fused ([E, 2F, D]: an expert's F gate rows, then its F up rows)
FUSED_EXPERT_TENSORS = ("ffn_gate_up_exps", "ffn_down_exps")


def expert_shapes(n_experts: int, ffn_dim: int, d_model: int) -> tuple[tuple[int, int, int], ...]:
    """Logical shapes of the gate, up and down tensors of one MoE layer: [E, F, D], [E, F, D], [E, D, F]."""
    E, F, D = n_experts, ffn_dim, d_model
    return (E, F, D), (E, F, D), (E, D, F)


class Part(NamedTuple):
    """One of an expert's three matrices inside its row: GGML type, rows, bytes per row, columns."""

    qtype: Any
    n_rows: int
    row_bytes: int
    n_cols: int

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes


def expert_parts(infos) -> tuple[Part, Part, Part]:
    """The row layout of one expert from the tensor infos (gate, up, down; or gate_up, down:
    gguf.reader.TensorInfo, data uint8[E, rows, R]) of a MoE layer. A fused gate_up's expert bytes are
    its gate rows then its up rows (GGML rows are independent), which is the gate part then the up part
    of the three-part layout: the row is the same, so nothing downstream knows the file was fused."""
    parts = [Part(t.ggml_type, t.data.shape[1], t.data.shape[2], t.shape[-1]) for t in infos]
    if len(parts) == 2:
        gu, down = parts
        half = gu._replace(n_rows=gu.n_rows // 2)
        return half, half, down
    return tuple(parts)


def fused_rows(infos) -> np.ndarray:
    """uint8 [E, P]: each expert's gate, up and down bytes back to back, from the memory-mapped tensors."""
    E = infos[0].data.shape[0]
    return np.concatenate([np.asarray(t.data).reshape(E, -1) for t in infos], axis=1)


@struct.dataclass
class ExpertRows:
    """Whole experts as byte rows `uint8[X, P]` (X: experts or slots): gate, up and down back to back."""

    data: jax.Array
    parts: tuple[Part, Part, Part] = struct.field(pytree_node=False)
    # a device pool split over several cards (core/cards.py): the mesh whose cards each hold a range of rows
    cards: Any = struct.field(pytree_node=False, default=None)

    @property
    def bytes_per_expert(self) -> int:
        return self.data.shape[-1]

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    def offsets(self) -> tuple[int, int, int]:
        """Byte offset of each part within a row."""
        out, at = [], 0
        for p in self.parts:
            out.append(at)
            at += p.nbytes
        return tuple(out)

    def split(self, rows_P: jax.Array) -> tuple[QTensor, QTensor, QTensor]:
        """The gate, up and down matrices of gathered rows `[..., P]`, as quantized tensors."""
        out = []
        for p, at in zip(self.parts, self.offsets()):
            block = rows_P[..., at : at + p.nbytes].reshape(*rows_P.shape[:-1], p.n_rows, p.row_bytes)
            out.append(QTensor(block, p.qtype, p.n_cols))
        return tuple(out)

    def take(self, idx: jax.Array) -> tuple[QTensor, QTensor, QTensor]:
        return self.split(jnp.take(self.data, idx, axis=0))


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """What offloading needs to know of a model's routed experts, as plain values (built by the model
    side from its config and GGUF file: strata_jax.model.weights.expert_spec)."""

    moe_layers: tuple[int, ...]  # block index of each MoE layer
    n_experts: int
    n_experts_used: int
    layer_parts: tuple[tuple[Part, Part, Part], ...]  # per MoE layer
    # per MoE layer, the file's expert tensors when they are not EXPERT_TENSORS (fused gate_up, down)
    layer_tensors: tuple[tuple[str, ...], ...] = ()

    def tensor_names(self, moe_idx: int) -> tuple[str, ...]:
        """The GGUF tensors whose per-expert bytes, back to back, make an expert's row (fused_rows)."""
        if self.layer_tensors:
            return self.layer_tensors[moe_idx]
        return tuple(f"blk.{self.moe_layers[moe_idx]}.{n}.weight" for n in EXPERT_TENSORS)

    def bytes_per_expert(self, moe_idx: int) -> int:
        return sum(p.nbytes for p in self.layer_parts[moe_idx])


COUNTERS = ("hits", "misses", "streamed", "prefetched", "predicted_routed", "predicted", "cold")


@struct.dataclass
class ExpertCounters:
    """Per MoE layer (int32 [M] each), accumulated on the device across steps:
    hits, misses: distinct experts a few-token step looked up, found / fetched;
    streamed: experts a many-token step brought over from the host (a whole layer per chunk);
    prefetched: experts the layer's prefetch fetched for later layers;
    predicted_routed, predicted: of the experts the previous layer predicted for this one, how many
    were routed, and how many there were (prefetch precision and recall);
    cold: distinct experts a few-token step served from the low-bit copy (--cold-experts) instead of
    fetching them into the cache (counted in misses too: they crossed PCIe)."""

    hits: jax.Array
    misses: jax.Array
    streamed: jax.Array
    prefetched: jax.Array
    predicted_routed: jax.Array
    predicted: jax.Array
    cold: jax.Array

    @classmethod
    def zeros(cls, n_moe_layers: int) -> "ExpertCounters":
        return cls(*(jnp.zeros((n_moe_layers,), jnp.int32) for _ in COUNTERS))

    def add(self, moe_idx: int, **values: jax.Array) -> "ExpertCounters":
        """These counters with values added to MoE layer moe_idx's fields."""
        return self.replace(**{k: getattr(self, k).at[moe_idx].add(jnp.asarray(v, jnp.int32))
                               for k, v in values.items()})

    def as_array(self) -> np.ndarray:
        """int64 [M, len(COUNTERS)] on the host, columns in COUNTERS order."""
        return np.stack([np.asarray(getattr(self, k), np.int64) for k in COUNTERS], axis=1).reshape(-1, len(COUNTERS))


def unique_ids(ids_Nk: jax.Array, n_experts: int) -> jax.Array:
    """The distinct ids in first-occurrence (router) order, -1 padded to min(N*k, E): the order a policy
    sees them in, as offload.simulate's unique_requests gives them (LRU breaks ties within a step by it).
    Negative ids (tokens that are not real: bucket padding, idle rows) are dropped. Quadratic in N*k,
    which the few-token path bounds by the expert count."""
    flat, first = _first_occurrences(ids_Nk)
    order = jnp.argsort(~first, stable=True)
    return jnp.where(first[order], flat[order], -1)[: min(flat.shape[0], n_experts)]


def _first_occurrences(ids_Nk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ids flattened, and whether each is the first of its value (never for a negative id)."""
    flat = ids_Nk.reshape(-1)
    n = flat.shape[0]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]
    return flat, ~jnp.any((flat[:, None] == flat[None, :]) & earlier, axis=1) & (flat >= 0)


def n_distinct(ids_Nk: jax.Array) -> jax.Array:
    """How many distinct non-negative ids (what unique_ids keeps, without its sort)."""
    return jnp.sum(_first_occurrences(ids_Nk)[1]).astype(jnp.int32)


class ExpertProvider(Protocol):
    """Where the MoE block (strata_jax.model.layers.moe.moe_block) gets routed experts. A pytree passed through
    the jitted forward pass and returned updated (it is donated between steps); every method is traced
    inside jit, takes a static Python int for the MoE layer or, inside a scanned run of alike layers
    (model/runs.py), a core.layer_ref.LayerRef over layers with the same `layer_key`, and returns the
    updated provider where the state changes. Implementations: strata_jax.offload.provider.SlotExperts (resident and offloaded
    slot tables); tests/test_moe_provider.py has a minimal one.

    Two paths per MoE layer, chosen statically by `few_path`:
    - few tokens (decode): `lookup` the routed ids, then read them from `pool` at `slot`;
      `prefetch` may then bring experts predicted for later layers;
    - many tokens (prefill): `stream`, then either `group` (the dense scan, J experts at a time) or
      `layer` (all E experts at once: the grouped ragged_dot formulation).
    """

    counters: ExpertCounters
    prefetch_depth: int  # static: later MoE layers whose predicted experts each layer prefetches (0: none)

    def few_path(self, moe_idx: int, n_lookups: int) -> bool:
        """Whether a step routing n_lookups (token, expert) pairs in this layer looks them up (else it
        takes the many-token path). Static."""

    def lookup(self, moe_idx: int, ids_Nk: jax.Array, valid_N: jax.Array | None = None
               ) -> tuple["ExpertProvider", ExpertRows, jax.Array, tuple[ExpertRows, jax.Array, jax.Array] | None]:
        """Make the routed experts readable: (provider, pool, slot_Nk, cold), expert ids_Nk[n, j] being row
        slot_Nk[n, j] of pool, unless cold (mixed precision, else None) = (rows, row_Nk, cold_Nk) says
        it is served from row row_Nk[n, j] of those (low-bit) rows where cold_Nk[n, j]. Counts hits and
        misses. valid_N (bool, None: all): the tokens that are real; the others (bucket padding, idle
        rows) neither fetch nor count, and get some readable slot (their output is never read)."""

    def prefetch(self, moe_idx: int, predicted: tuple[tuple[int, jax.Array], ...],
                 after: jax.Array) -> tuple["ExpertProvider", jax.Array]:
        """Once `after` (the layer's output, so its reads of the pool) is computed, admit and fetch the
        experts predicted for later layers ((MoE index, ids_Nk), nearest first). Returns (provider, after)."""

    def stream(self, moe_idx: int, cached: bool = False) -> "ExpertProvider":
        """A many-token step is about to read every expert of the layer (counts what that moves; cached:
        only the experts its cache does not hold)."""

    def group(self, moe_idx: int, first_expert: jax.Array, n: int, cached: bool = False) -> ExpertRows:
        """Experts first_expert .. first_expert + n - 1 of the layer, on the device (inside a scan step:
        the device holds one group, never the layer). cached: those the cache holds are read from their
        slots and only the others copied in."""

    def layer(self, moe_idx: int) -> ExpertRows:
        """All E experts of the layer on the device, row e = expert e."""

    def card_streamer(self, moe_idx: int, cached: bool = False) -> tuple[Any, "ExpertProvider"] | None:
        """Where a many-token step's streamed groups can be cut over several cards (core/cards.py): the mesh
        and a provider reduced to what `group` needs, an operand every card takes whole; None elsewhere."""

    def count(self, moe_idx: int, **values: jax.Array) -> "ExpertProvider":
        """The provider with values added to its counters of this layer (ExpertCounters.add)."""

    def layer_key(self, moe_idx: int) -> Any:
        """What MoE layers must have equal to be scanned as one body (e.g. their slot pool)."""

    def detach_counts(self) -> tuple["ExpertProvider", tuple[tuple, tuple]]:
        """(the provider without its not-yet-folded counts, (their static keys, their values)): a scan
        carries a fixed structure, so counts leave the carry before it and each iteration."""

    def attach_counts(self, keys: tuple, values: tuple) -> "ExpertProvider":
        """Counts detached earlier put back (a scan's values stacked [repeats])."""

    def finish(self, routed_MNk: jax.Array) -> "ExpertProvider":
        """After the layer loop, with every MoE layer's routed ids (counting done once per step)."""

    def split(self) -> tuple["ExpertProvider", Any]:
        """(the changing part, the fixed part: e.g. the host store); `changing.join(fixed)` rebuilds the
        provider. A jitted step donates only the changing part (host memory cannot always be donated:
        XLA:CPU aborts on a donated unpinned_host array) and a loop carries only it."""

    def join(self, fixed: Any) -> "ExpertProvider":
        ...


def split_provider(experts: ExpertProvider | None) -> tuple[ExpertProvider | None, Any]:
    """experts.split(), or (None, None) for a dense model."""
    return experts.split() if experts is not None else (None, None)


def join_provider(experts: ExpertProvider | None, fixed: Any) -> ExpertProvider | None:
    return experts.join(fixed) if experts is not None else None
