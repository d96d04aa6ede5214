"""Dequantize GGML blocks with jnp, inside jit.

Weights stay on the device in their GGUF block format, `uint8[..., row_bytes]`; each forward pass expands
the rows it needs. Every decoder reproduces `gguf.quants` (`dequantize_blocks`) with the same float32
operations in the same order, so results are bit-exact against the reference.

Shape legend: strata_jax/core/shapes.py (here: Y blocks in a row, A sub-blocks of a super-block, e grid
points of an IQ sub-block, Q values in one block, sub-block or grid point, Z bytes of one field), after
the arbitrary leading axes `...`, which are never named: e.g. `qs_YQ` is uint8[..., Y, Q]; `d_Y1` is
float32[..., Y, 1], ready to broadcast over Q.

XLA-friendliness: only slices, reshapes, shifts, masks and elementwise float math (no int64); fields are
bitcast from their bytes rather than assembled arithmetically. The only gathers are the IQ types'
lookups into their small constant tables (gguf/iq_tables.py), by unsigned, masked (in-bounds) indices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from strata_jax.core.errors import UnsupportedQuantTypeError
from strata_jax.core.qtensor import QTensor
from strata_jax.gguf import iq_tables as iqt
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


def _u16(b_YZ: jax.Array) -> jax.Array:
    """uint8[..., 2n] little-endian -> uint16[..., n]."""
    return jax.lax.bitcast_convert_type(b_YZ.reshape(*b_YZ.shape[:-1], -1, 2), jnp.uint16)


def _u32(b_YZ: jax.Array) -> jax.Array:
    """uint8[..., 4n] little-endian -> uint32[..., n]."""
    return jax.lax.bitcast_convert_type(b_YZ.reshape(*b_YZ.shape[:-1], -1, 4), jnp.uint32)


def _interleaved_nibbles(b_YZ: jax.Array) -> jax.Array:
    """[..., Z] bytes -> [..., 2Z]: byte j's low nibble is value 2j, its high nibble 2j + 1 (the IQ
    types' 4-bit scales)."""
    return ((b_YZ[..., None] >> jnp.array([0, 4], jnp.uint8)) & 0x0F).reshape(*b_YZ.shape[:-1], -1)


def _lookup(table: np.ndarray, idx: jax.Array) -> jax.Array:
    """Rows `idx` of a constant table, in its dtype: [..., n] indices -> [..., n, *row shape]. The
    indices are unsigned and masked to the table's size by the caller (no bounds handling here)."""
    return jnp.asarray(table).at[idx].get(mode="promise_in_bounds")


def _grid(table: np.ndarray, idx: jax.Array) -> jax.Array:
    """Grid points `idx` -> float32[..., n, values per point] (the table's small integers, exactly)."""
    return _lookup(table, idx).astype(jnp.float32)


def _ksigns(idx: jax.Array) -> jax.Array:
    """7-bit sign indices [..., n] -> their 8 sign bits, uint8[..., n, 8] (1 = negative)."""
    return _bits_lsb_first(_lookup(iqt.KSIGNS_IQ2XS, idx)[..., None])


def _signed(x, neg):
    """x with the sign flipped where neg is set: -x, exactly what GGML's multiply by -1.0 gives."""
    return jnp.where(neg != 0, -x, x)


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


# ---- ternary types (TQ) ------------------------------------------------------------------------------


def _deq_tq1_0(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 52:54])[..., None]
    # base-3 digits as fixed-point fractions: multiplying a byte by 3^i (mod 256) moves digit i to the
    # top, and (q * 3) >> 8 reads it. 32 bytes x 5 digits, 16 x 5, then 4 x 4.
    pow3 = jnp.array([1, 3, 9, 27, 81], jnp.uint8)[:, None]
    q0 = (b_YZ[..., None, 0:32] * pow3).reshape(*lead, 160)
    q1 = (b_YZ[..., None, 32:48] * pow3).reshape(*lead, 80)
    q2 = (b_YZ[..., None, 48:52] * pow3[:4]).reshape(*lead, 16)
    q_YQ = jnp.concatenate([q0, q1, q2], axis=-1)
    t_YQ = ((q_YQ.astype(jnp.uint16) * 3) >> 8).astype(jnp.float32) - 1.0
    return d_Y1 * t_YQ


def _deq_tq2_0(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 64:66])[..., None]
    q_YQ = _crumbs(b_YZ[..., 0:64].reshape(*lead, 2, 32)).reshape(*lead, QK_K)
    return d_Y1 * (q_YQ.astype(jnp.float32) - 1.0)


# ---- IQ types: grid points (lattice codebooks) and sign patterns ----------------------------------


def _iq2_db(d_Y1, sc_YA):
    """The IQ2 types' sub-block scale d * (0.5 + s) * 1/4, in GGML's order of float operations."""
    return d_Y1 * (0.5 + sc_YA.astype(jnp.float32)) * 0.25


def _deq_iq2_xxs(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 8 sub-blocks of 32 values, 8 bytes each: 4 grid indices, then a uint32 of four 7-bit sign indices
    # (bits 0-27) and the 4-bit scale (bits 28-31)
    q_YAZ = b_YZ[..., 2:66].reshape(*lead, 8, 8)
    aux_YA = _u32(q_YAZ[..., 4:8])[..., 0]
    db_YA11 = _iq2_db(d_Y1, aux_YA >> 28)[..., None, None]
    six_YAe = (aux_YA[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 0x7F
    grid_YAeQ = _grid(iqt.IQ2XXS_GRID, q_YAZ[..., 0:4])
    return _signed(db_YA11 * grid_YAeQ, _ksigns(six_YAe)).reshape(*lead, QK_K)


def _deq_iq2_xs(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 32 uint16: a 9-bit grid index and a 7-bit sign index each; 16 scales of 16 values (2 points)
    q_YAe = _u16(b_YZ[..., 2:66]).reshape(*lead, 16, 2)
    db_YA11 = _iq2_db(d_Y1, _interleaved_nibbles(b_YZ[..., 66:74]))[..., None, None]
    grid_YAeQ = _grid(iqt.IQ2XS_GRID, q_YAe & 0x1FF)
    return _signed(db_YA11 * grid_YAeQ, _ksigns(q_YAe >> 9)).reshape(*lead, QK_K)


def _deq_iq2_s(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 10-bit grid indices: 8 low bits from qs, 2 high bits from qh (bit pairs 0-1, 2-3, ... of each
    # byte for 4 consecutive points); one explicit sign byte per point
    qh_Ye = _crumbs(b_YZ[..., 66:74][..., None]).reshape(*lead, 32).astype(jnp.uint16)
    ix_Ye = b_YZ[..., 2:34].astype(jnp.uint16) | (qh_Ye << 8)
    neg_YAeQ = _bits_lsb_first(b_YZ[..., 34:66]).reshape(*lead, 16, 2, 8)
    db_YA11 = _iq2_db(d_Y1, _interleaved_nibbles(b_YZ[..., 74:82]))[..., None, None]
    grid_YAeQ = _grid(iqt.IQ2S_GRID, ix_Ye.reshape(*lead, 16, 2))
    return _signed(db_YA11 * grid_YAeQ, neg_YAeQ).reshape(*lead, QK_K)


def _deq_iq3_xxs(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 64 grid indices (4 values each), then per 32-value sub-block a uint32 as in IQ2_XXS
    aux_YA = _u32(b_YZ[..., 66:98])
    db_YA1 = (d_Y1 * (0.5 + (aux_YA >> 28).astype(jnp.float32)) * 0.5)[..., None]
    six_YAe = (aux_YA[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 0x7F
    neg_YAQ = _ksigns(six_YAe).reshape(*lead, 8, 32)
    grid_YAQ = _grid(iqt.IQ3XXS_GRID, b_YZ[..., 2:66]).reshape(*lead, 8, 32)
    return _signed(db_YA1 * grid_YAQ, neg_YAQ).reshape(*lead, QK_K)


def _deq_iq3_s(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 9-bit grid indices: 8 low bits from qs, the ninth from qh as one little-endian bit string
    hi_Ye = _bits_lsb_first(b_YZ[..., 66:74]).astype(jnp.uint16)
    ix_Ye = b_YZ[..., 2:66].astype(jnp.uint16) | (hi_Ye << 8)
    neg_YAQ = _bits_lsb_first(b_YZ[..., 74:106]).reshape(*lead, 8, 32)
    sc_YA = _interleaved_nibbles(b_YZ[..., 106:110])
    db_YA1 = (d_Y1 * (1 + 2 * sc_YA).astype(jnp.float32))[..., None]
    grid_YAQ = _grid(iqt.IQ3S_GRID, ix_Ye).reshape(*lead, 8, 32)
    return _signed(db_YA1 * grid_YAQ, neg_YAQ).reshape(*lead, QK_K)


def _deq_iq1_s(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # per 32-value sub-block a uint16: four 3-bit high parts of the 11-bit grid indices (bits 0-11),
    # the 3-bit scale (12-14) and the delta's sign (15)
    qh_YA = _u16(b_YZ[..., 34:50])
    dl_YA11 = (d_Y1 * (2 * ((qh_YA >> 12) & 7) + 1).astype(jnp.float32))[..., None, None]
    delta_YA = jnp.where((qh_YA & 0x8000) != 0, -iqt.IQ1S_DELTA, iqt.IQ1S_DELTA).astype(jnp.float32)
    delta_YA11 = delta_YA[..., None, None]
    hi_YAe = (qh_YA[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7
    ix_YAe = b_YZ[..., 2:34].reshape(*lead, 8, 4).astype(jnp.uint16) | (hi_YAe << 8)
    grid_YAeQ = _grid(iqt.IQ1S_GRID, ix_YAe)
    return (dl_YA11 * (grid_YAeQ + delta_YA11)).reshape(*lead, QK_K)


def _deq_iq1_m(b_YZ):
    lead = _lead(b_YZ)
    # no separate fp16 field: d's 16 bits are the top nibbles of the four uint16 scale words; their
    # low 12 bits hold four 3-bit scales each (16 sub-blocks of 16 values, 2 points)
    sc_YZ = _u16(b_YZ[..., 48:56])
    top_YZ = (sc_YZ & 0xF000) >> jnp.array([12, 8, 4, 0], jnp.uint16)
    d_bits_Y = top_YZ[..., 0] | top_YZ[..., 1] | top_YZ[..., 2] | top_YZ[..., 3]
    d_Y1 = jax.lax.bitcast_convert_type(d_bits_Y, jnp.float16).astype(jnp.float32)[..., None]
    s_YA = ((sc_YZ[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7).reshape(*lead, 16)
    dl_YA11 = (d_Y1 * (2 * s_YA + 1).astype(jnp.float32))[..., None, None]
    # one nibble of qh per point (low nibble first): 3 high index bits, then the delta's sign
    h_Ye = ((b_YZ[..., 32:48, None] >> jnp.array([0, 4], jnp.uint8)) & 0x0F).reshape(*lead, 32)
    ix_Ye = b_YZ[..., 0:32].astype(jnp.uint16) | ((h_Ye & 7).astype(jnp.uint16) << 8)
    delta_Ye = jnp.where((h_Ye & 8) != 0, -iqt.IQ1S_DELTA, iqt.IQ1S_DELTA).astype(jnp.float32)
    grid_YAeQ = _grid(iqt.IQ1S_GRID, ix_Ye.reshape(*lead, 16, 2))
    return (dl_YA11 * (grid_YAeQ + delta_Ye.reshape(*lead, 16, 2, 1))).reshape(*lead, QK_K)


def _deq_iq4_nl(b_YZ):
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    v_YQ = _lookup(iqt.KVALUES_IQ4NL, _q4(b_YZ[..., 2:18])).astype(jnp.float32)
    return d_Y1 * v_YQ


def _deq_iq4_xs(b_YZ):
    lead = _lead(b_YZ)
    d_Y1 = _f16(b_YZ[..., 0:2])[..., None]
    # 8 six-bit scales: low nibbles interleaved in bytes 4-7, top bit pairs in the uint16 at bytes 2-3
    lo_YA = _interleaved_nibbles(b_YZ[..., 4:8])
    hi_YA = ((_u16(b_YZ[..., 2:4]) >> jnp.arange(0, 16, 2, dtype=jnp.uint16)) & 3).astype(jnp.uint8)
    sc_YA = (lo_YA | (hi_YA << 4)).astype(jnp.float32) - 32.0
    dl_YA1 = (d_Y1 * sc_YA)[..., None]
    q_YAQ = _nibbles(b_YZ[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 8, 32)
    v_YAQ = _lookup(iqt.KVALUES_IQ4NL, q_YAQ).astype(jnp.float32)
    return (dl_YA1 * v_YAQ).reshape(*lead, QK_K)


# ---- MXFP4 (OCP microscaling: an e8m0 exponent, 32 e2m1 values) -------------------------------------


def _e8m0_half(e_Y: jax.Array) -> jax.Array:
    """uint8 e8m0 exponents -> float32 2^(e - 128), half the scale they encode, built from its bits
    (ggml_e8m0_to_fp32_half): e < 2 gives the subnormals 2^-128 and 2^-127."""
    e = e_Y.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _deq_mxfp4(b_YZ):
    d_Y1 = _e8m0_half(b_YZ[..., 0])[..., None]
    v_YQ = _lookup(iqt.KVALUES_MXFP4, _q4(b_YZ[..., 1:17])).astype(jnp.float32)
    return d_Y1 * v_YQ


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
    T.TQ1_0: _deq_tq1_0,
    T.TQ2_0: _deq_tq2_0,
    T.IQ1_S: _deq_iq1_s,
    T.IQ1_M: _deq_iq1_m,
    T.IQ2_XXS: _deq_iq2_xxs,
    T.IQ2_XS: _deq_iq2_xs,
    T.IQ2_S: _deq_iq2_s,
    T.IQ3_XXS: _deq_iq3_xxs,
    T.IQ3_S: _deq_iq3_s,
    T.IQ4_NL: _deq_iq4_nl,
    T.IQ4_XS: _deq_iq4_xs,
    T.MXFP4: _deq_mxfp4,
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
    qt = qt.resolved()
    if qt.qtype is None:
        return qt.data.astype(dtype)
    return dequantize(qt.data, qt.qtype, qt.n_cols, dtype)


def take_rows(qt: QTensor, idx: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Dequantize only the rows `idx` of a QTensor (embedding lookup) instead of the whole table."""
    qt = qt.resolved()
    rows = jnp.take(qt.data, idx, axis=-2)
    if qt.qtype is None:
        return rows.astype(dtype)
    return dequantize(rows, qt.qtype, qt.n_cols, dtype)
