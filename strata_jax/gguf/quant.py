"""Dequantize GGML blocks with jnp, inside jit.

Weights stay on the device in their GGUF block format, `uint8[..., row_bytes]`; each forward pass expands
the rows it needs. Every decoder reproduces `gguf.quants` (`dequantize_blocks`) with the same float32
operations in the same order, so results are bit-exact against the reference.

Shape legend: strata_jax/core/shapes.py (here: Y blocks in a row, A sub-blocks of a K-quant super-block,
Q values in one block or sub-block, Z bytes of one field), after the arbitrary leading axes `...`,
which are never named: e.g. `qs_YQ` is uint8[..., Y, Q]; `d_Y1` is float32[..., Y, 1], ready to
broadcast over Q.

XLA-friendliness: only slices, reshapes, shifts, masks and elementwise float math (no gathers, no
int64); fields are bitcast from their bytes rather than assembled arithmetically.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType

from strata_jax.core.errors import UnsupportedQuantTypeError
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf.layout import QK_K, layout, row_bytes

T = GGMLQuantizationType


# ---- field decoding ---------------------------------------------------------------------------------


def _f16(b_Z: jax.Array) -> jax.Array:
    """uint8[..., 2] little-endian fp16 -> float32[...]."""
    return jax.lax.bitcast_convert_type(b_Z, jnp.float16).astype(jnp.float32)


def _int8(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.int8)


def _nibbles(qs_YZ: jax.Array) -> jax.Array:
    """[..., Y, Z] bytes -> [..., Y, 2, Z]: low nibbles of all Z bytes, then high nibbles (GGML's order:
    value j < Z is byte j's low nibble, value Z + j its high one)."""
    return (qs_YZ[..., None, :] >> jnp.array([0, 4], jnp.uint8)[:, None]) & 0x0F


def _crumbs(qs_YZ: jax.Array) -> jax.Array:
    """[..., Y, Z] bytes -> [..., Y, 4, Z]: bit pairs 0-1 of all bytes, then 2-3, 4-5, 6-7."""
    return (qs_YZ[..., None, :] >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]) & 0x03


def _bits(qh_YZ: jax.Array) -> jax.Array:
    """[..., Y, Z] bytes -> [..., Y, 8, Z]: bit 0 of all bytes, then bit 1, ... bit 7."""
    return (qh_YZ[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 0x01


def _bits_lsb_first(qh_YZ: jax.Array) -> jax.Array:
    """[..., Y, Z] bytes -> [..., Y, Z * 8]: the Z bytes as one little-endian bit string (Q5_0/Q5_1's
    uint32 qh: value i takes bit i)."""
    bits = (qh_YZ[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 0x01
    return bits.reshape(*qh_YZ.shape[:-1], -1)


# ---- per-type decoders: uint8[..., Y, type_size] -> float32[..., Y, block_size] ---------------------


def _deq_f32(b_YZ):
    return jax.lax.bitcast_convert_type(b_YZ, jnp.float32)[..., None]


def _deq_f16(b_YZ):
    return _f16(b_YZ)[..., None]


def _deq_bf16(b_YZ):
    # bf16 is the top half of an f32: widen by shifting the bits, exact for every input (a float
    # conversion could quiet NaNs or flush subnormals).
    u16 = jax.lax.bitcast_convert_type(b_YZ, jnp.uint16)
    return jax.lax.bitcast_convert_type(u16.astype(jnp.uint32) << 16, jnp.float32)[..., None]


def _deq_q8_0(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    x_YQ = _int8(b_YZ[..., 2:34]).astype(jnp.float32)
    return x_YQ * d_Y1


def _q4(qs_YZ):
    return _nibbles(qs_YZ).reshape(*qs_YZ.shape[:-1], 32)


def _q5(qh_YZ, qs_YZ):
    return _q4(qs_YZ) | (_bits_lsb_first(qh_YZ) << 4)


def _deq_q4_0(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    q_YQ = _q4(b_YZ[..., 2:18]).astype(jnp.float32) - 8.0  # exact: small integers
    return d_Y1 * q_YQ


def _deq_q4_1(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    m_Y1 = _f16(b_YZ[..., 2:4])[..., None]
    q_YQ = _q4(b_YZ[..., 4:20]).astype(jnp.float32)
    return d_Y1 * q_YQ + m_Y1


def _deq_q5_0(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    q_YQ = _q5(b_YZ[..., 2:6], b_YZ[..., 6:22]).astype(jnp.float32) - 16.0
    return d_Y1 * q_YQ


def _deq_q5_1(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    m_Y1 = _f16(b_YZ[..., 2:4])[..., None]
    q_YQ = _q5(b_YZ[..., 4:8], b_YZ[..., 8:24]).astype(jnp.float32)
    return d_Y1 * q_YQ + m_Y1


def _lead(b_YZ):
    return b_YZ.shape[:-1]


def _deq_q2_k(b_YZ):
    lead = _lead(b_YZ)
    scales_YA = b_YZ[..., 0:16]
    d_Y1 = _f16(b_YZ[..., 80:82])[..., None]
    dmin_Y1 = _f16(b_YZ[..., 82:84])[..., None]
    dl_YA1 = (d_Y1 * (scales_YA & 0x0F).astype(jnp.float32))[..., None]
    ml_YA1 = (dmin_Y1 * (scales_YA >> 4).astype(jnp.float32))[..., None]
    # 64 bytes = two 32-byte groups, each giving four 32-value slices (bit pairs 0-1, 2-3, ...)
    q_YAQ = _crumbs(b_YZ[..., 16:80].reshape(*lead, 2, 32)).reshape(*lead, 16, 16)
    return (dl_YA1 * q_YAQ.astype(jnp.float32) - ml_YA1).reshape(*lead, QK_K)


def _deq_q3_k(b_YZ):
    lead = _lead(b_YZ)
    hmask_YZ = b_YZ[..., 0:32]
    qs_YZ = b_YZ[..., 32:96]
    scales_YZ = b_YZ[..., 96:108]
    d_Y1 = _f16(b_YZ[..., 108:110])[..., None]
    # 16 six-bit scales: low nibbles from bytes 0-7 (low nibbles first, then high), top two bits from
    # bytes 8-11 (bit pairs 0-1 of the four bytes, then 2-3, ...)
    lo_YA = _nibbles(scales_YZ[..., 0:8]).reshape(*lead, 16)
    hi_YA = _crumbs(scales_YZ[..., 8:12]).reshape(*lead, 16)
    sc_YA = (lo_YA | (hi_YA << 4)).astype(jnp.float32) - 32.0
    dl_YA1 = (d_Y1 * sc_YA)[..., None]
    ql_YAQ = _crumbs(qs_YZ.reshape(*lead, 2, 32)).reshape(*lead, 16, 16)
    qh_YAQ = _bits(hmask_YZ).reshape(*lead, 16, 16)
    # a CLEAR hmask bit subtracts 4 (GGML's convention)
    q_YAQ = ql_YAQ.astype(jnp.float32) - ((qh_YAQ ^ 1) << 2).astype(jnp.float32)
    return (dl_YA1 * q_YAQ).reshape(*lead, QK_K)


def _scale_min_k4(scales_YZ):
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, each uint8[..., Y, 8]. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes 8-11
    the low nibbles of scales 4-7 (low half) and mins 4-7 (high half)."""
    d_YZ, m_YZ, md_YZ = scales_YZ[..., 0:4], scales_YZ[..., 4:8], scales_YZ[..., 8:12]
    sc_YA = jnp.concatenate([d_YZ & 0x3F, (md_YZ & 0x0F) | ((d_YZ >> 2) & 0x30)], axis=-1)
    mn_YA = jnp.concatenate([m_YZ & 0x3F, (md_YZ >> 4) | ((m_YZ >> 2) & 0x30)], axis=-1)
    return sc_YA, mn_YA


def _k4_scales(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    dmin_Y1 = _f16(b_YZ[..., 2:4])[..., None]
    sc_YA, mn_YA = _scale_min_k4(b_YZ[..., 4:16])
    d_YA1 = (d_Y1 * sc_YA.astype(jnp.float32))[..., None]
    dm_YA1 = (dmin_Y1 * mn_YA.astype(jnp.float32))[..., None]
    return d_YA1, dm_YA1


def _deq_q4_k(b_YZ):
    lead = _lead(b_YZ)
    d_YA1, dm_YA1 = _k4_scales(b_YZ)
    # 128 bytes = four 32-byte groups, each giving two 32-value sub-blocks (low nibbles, high nibbles)
    q_YAQ = _nibbles(b_YZ[..., 16:144].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
    return (d_YA1 * q_YAQ.astype(jnp.float32) - dm_YA1).reshape(*lead, QK_K)


def _deq_q5_k(b_YZ):
    lead = _lead(b_YZ)
    d_YA1, dm_YA1 = _k4_scales(b_YZ)
    ql_YAQ = _nibbles(b_YZ[..., 48:176].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
    qh_YAQ = _bits(b_YZ[..., 16:48]).reshape(*lead, 8, 32)
    q_YAQ = ql_YAQ | (qh_YAQ << 4)
    return (d_YA1 * q_YAQ.astype(jnp.float32) - dm_YA1).reshape(*lead, QK_K)


def _deq_q6_k(b_YZ):
    lead = _lead(b_YZ)
    ql_YZ = b_YZ[..., 0:128]
    qh_YZ = b_YZ[..., 128:192]
    sc_YA = _int8(b_YZ[..., 192:208]).astype(jnp.float32)
    d_Y1 = _f16(b_YZ[..., 208:210])[..., None]
    d_YA1 = (d_Y1 * sc_YA)[..., None]
    # two 128-value halves; per half: 64 ql bytes -> 2 x 64 nibbles, 32 qh bytes -> 4 x 32 bit pairs
    ql_YAQ = _nibbles(ql_YZ.reshape(*lead, 2, 64)).reshape(*lead, 8, 32)
    qh_YAQ = _crumbs(qh_YZ.reshape(*lead, 2, 32)).reshape(*lead, 8, 32)
    q_YAQ = (ql_YAQ | (qh_YAQ << 4)).astype(jnp.float32) - 32.0
    return (d_YA1 * q_YAQ.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


_DECODERS: dict[GGMLQuantizationType, Callable[[jax.Array], jax.Array]] = {
    T.F32: _deq_f32,
    T.F16: _deq_f16,
    T.BF16: _deq_bf16,
    T.Q8_0: _deq_q8_0,
    T.Q4_0: _deq_q4_0,
    T.Q4_1: _deq_q4_1,
    T.Q5_0: _deq_q5_0,
    T.Q5_1: _deq_q5_1,
    T.Q2_K: _deq_q2_k,
    T.Q3_K: _deq_q3_k,
    T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k,
    T.Q6_K: _deq_q6_k,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)


def _supported_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))


def check_supported(qtype, tensor_name: str = "") -> None:
    """Raise UnsupportedQuantTypeError unless `qtype` has a dequantizer here."""
    try:
        qtype = GGMLQuantizationType(qtype)
        type_name = qtype.name
    except ValueError:
        type_name = f"unknown GGML type id {qtype!r}"
    if qtype in SUPPORTED_TYPES:
        return
    what = f"tensor {tensor_name!r}" if tensor_name else "a tensor"
    raise UnsupportedQuantTypeError(
        f"{what} is stored as {type_name}, which strata-jax cannot dequantize. Supported types: "
        f"{_supported_names()}. Re-quantize the model with llama.cpp's llama-quantize to one of them "
        "(e.g. Q4_K_M: `llama-quantize --allow-requantize in.gguf out.gguf Q4_K_M`)."
    )


def dequantize(data: jax.Array, qtype: GGMLQuantizationType, n_cols: int, dtype=jnp.float32) -> jax.Array:
    """uint8[..., row_bytes] GGML rows -> dtype[..., n_cols], computed in float32.

    `qtype` and `n_cols` are static (Python values); any leading axes; works under jit and vmap.
    """
    qtype = GGMLQuantizationType(qtype)
    check_supported(qtype)
    block, type_size = layout(qtype).block_size, layout(qtype).type_size
    n_bytes = row_bytes(qtype, n_cols)
    if data.shape[-1] != n_bytes:
        raise ValueError(
            f"{qtype.name} rows of {n_cols} values take {n_bytes} bytes, but the data's last axis has "
            f"{data.shape[-1]}; pass the raw row bytes (uint8[..., row_bytes]) and the logical column count."
        )
    data = jnp.asarray(data)
    if data.dtype != jnp.uint8:
        raise ValueError(f"dequantize takes the raw GGML bytes as uint8, got {data.dtype}.")
    lead = data.shape[:-1]
    b_YZ = data.reshape(*lead, n_cols // block, type_size)
    out_YQ = _DECODERS[qtype](b_YZ)
    return out_YQ.reshape(*lead, n_cols).astype(dtype)


def dequant(qt: QTensor, dtype=jnp.float32) -> jax.Array:
    """The logical matrix of a QTensor, in dtype (a no-op cast for an already dequantized one)."""
    if qt.qtype is None:
        return qt.data.astype(dtype)
    return dequantize(qt.data, qt.qtype, qt.n_cols, dtype)


def take_rows(qt: QTensor, idx: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Dequantize only the rows `idx` of a QTensor (embedding lookup) instead of the whole table."""
    rows = jnp.take(qt.data, idx, axis=-2)
    if qt.qtype is None:
        return rows.astype(dtype)
    return dequantize(rows, qt.qtype, qt.n_cols, dtype)
