"""The GGML block layout: per type, values per block and bytes per block; `row_bytes` is the one
place the bytes of a row are computed (the reader, the dequantizers, the qmatvec kernel and the
expert spec all ask here)."""

from __future__ import annotations

import dataclasses

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values in a K-quant super-block


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    block_size: int  # values per block
    type_size: int  # bytes per block


# gguf-py's table is the source: the same numbers llama.cpp writes files with
LAYOUTS: dict[GGMLQuantizationType, BlockLayout] = {
    GGMLQuantizationType(t): BlockLayout(*sizes) for t, sizes in GGML_QUANT_SIZES.items()}


def layout(qtype) -> BlockLayout:
    return LAYOUTS[GGMLQuantizationType(qtype)]


# the K-quant family proper (llama.cpp's k_quants: 6- or 8-bit sub-block scales in a 256-value
# super-block); the IQ and TQ types also come in 256-value blocks but are different formats
K_QUANTS = frozenset(GGMLQuantizationType[n] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"))


def is_k_quant(qtype) -> bool:
    """Whether qtype is one of the K-quants (Q2_K ... Q8_K); False for IQ/TQ types."""
    return GGMLQuantizationType(qtype) in K_QUANTS


def is_super_block(qtype) -> bool:
    """Whether qtype's blocks are 256-value super-blocks (K-quants, most IQ types, TQ types)."""
    return layout(qtype).block_size == QK_K


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols values in GGML type qtype; raises ValueError unless whole blocks."""
    lay = layout(qtype)
    if n_cols % lay.block_size:
        raise ValueError(
            f"{GGMLQuantizationType(qtype).name} rows must hold a multiple of {lay.block_size} values (its block "
            f"size); got n_cols={n_cols}."
        )
    return n_cols // lay.block_size * lay.type_size
