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
    qtype None, that matrix already dequantized (CPU default: see WeightLoader.dequantize_dense)."""

    data: jax.Array
    qtype: Any = struct.field(pytree_node=False)  # GGMLQuantizationType or None
    n_cols: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.n_cols)
