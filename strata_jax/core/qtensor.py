"""QTensor: a matrix kept in its GGML block bytes. A container only: dequantizing it is
strata_jax.gguf.quant's `dequant(qt, dtype)` and `take_rows(qt, idx, dtype)`.

Shape legend: strata_jax/core/shapes.py
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class QTensor:
    """GGML block bytes `uint8[..., rows, R]` of a logical `[..., rows, n_cols]` matrix, or, with
    qtype None, that matrix already dequantized (CPU default: see WeightLoader.dequantize_dense).

    With `index` set (an int32 scalar, traced inside a scan over identical layers: model/runs.py) the
    tensor is matrix `index` of the stack `data` [layers, ...]: consumers that can read a stack in place
    (the fused kernel, by slot) keep it whole, the others take `resolved()`, a slice XLA fuses into the
    dequantization."""

    data: jax.Array
    qtype: Any = struct.field(pytree_node=False)  # GGMLQuantizationType or None
    n_cols: int = struct.field(pytree_node=False)
    index: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        lead = self.data.shape[1:-1] if self.index is not None else self.data.shape[:-1]
        return (*lead, self.n_cols)

    def resolved(self) -> "QTensor":
        """This matrix as a plain QTensor (the stack's slice at `index`)."""
        if self.index is None:
            return self
        return QTensor(jax.lax.dynamic_index_in_dim(self.data, self.index, 0, keepdims=False), self.qtype, self.n_cols)
