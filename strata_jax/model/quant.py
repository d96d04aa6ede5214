"""Dequantize GGML blocks with jnp, inside jit.

Weights stay on the device in their GGUF block format, `uint8[..., row_bytes]`; each forward pass expands
the rows it needs. Every decoder reproduces `gguf.quants` (`dequantize_blocks`) with the same float32
operations in the same order, so results are bit-exact against the reference.

Shape suffixes (after the arbitrary leading axes `...`, which are never named):
  B  blocks in a row (n_cols // block_size)
  S  sub-blocks of a K-quant super-block (8 or 16)
  Q  values in one sub-block or block
  N  bytes of one field (the axis a field's bytes are unpacked or bitcast along)
e.g. `qs_BQ` is uint8[..., B, Q]; `d_B1` is float32[..., B, 1], ready to broadcast over Q.

XLA-friendliness: only slices, reshapes, shifts, masks and elementwise float math (no gathers, no
int64); fields are bitcast from their bytes rather than assembled arithmetically.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_jax.errors import UnsupportedQuantTypeError

T = GGMLQuantizationType
QK_K = 256  # values in a K-quant super-block


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if n_cols % block:
        raise ValueError(
            f"{GGMLQuantizationType(qtype).name} rows must hold a multiple of {block} values (its block "
            f"size); got n_cols={n_cols}."
        )
    return n_cols // block * type_size


# ---- field decoding ---------------------------------------------------------------------------------


def _f16(b_N: jax.Array) -> jax.Array:
    """uint8[..., 2] little-endian fp16 -> float32[...]."""
    return jax.lax.bitcast_convert_type(b_N, jnp.float16).astype(jnp.float32)


def _int8(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.int8)


def _nibbles(qs_BN: jax.Array) -> jax.Array:
    """[..., B, N] bytes -> [..., B, 2, N]: low nibbles of all N bytes, then high nibbles (GGML's order:
    value j < N is byte j's low nibble, value N + j its high one)."""
    return (qs_BN[..., None, :] >> jnp.array([0, 4], jnp.uint8)[:, None]) & 0x0F


def _crumbs(qs_BN: jax.Array) -> jax.Array:
    """[..., B, N] bytes -> [..., B, 4, N]: bit pairs 0-1 of all bytes, then 2-3, 4-5, 6-7."""
    return (qs_BN[..., None, :] >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]) & 0x03


def _bits(qh_BN: jax.Array) -> jax.Array:
    """[..., B, N] bytes -> [..., B, 8, N]: bit 0 of all bytes, then bit 1, ... bit 7."""
    return (qh_BN[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 0x01


def _bits_lsb_first(qh_BN: jax.Array) -> jax.Array:
    """[..., B, N] bytes -> [..., B, N * 8]: the N bytes as one little-endian bit string (Q5_0/Q5_1's
    uint32 qh: value i takes bit i)."""
    bits = (qh_BN[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 0x01
    return bits.reshape(*qh_BN.shape[:-1], -1)


# ---- per-type decoders: uint8[..., B, type_size] -> float32[..., B, block_size] ---------------------


def _deq_f32(b_BN):
    return jax.lax.bitcast_convert_type(b_BN, jnp.float32)[..., None]


def _deq_f16(b_BN):
    return _f16(b_BN)[..., None]


def _deq_bf16(b_BN):
    # bf16 is the top half of an f32: widen by shifting the bits, exact for every input (a float
    # conversion could quiet NaNs or flush subnormals).
    u16 = jax.lax.bitcast_convert_type(b_BN, jnp.uint16)
    return jax.lax.bitcast_convert_type(u16.astype(jnp.uint32) << 16, jnp.float32)[..., None]


def _deq_q8_0(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    x_BQ = _int8(b_BN[..., 2:34]).astype(jnp.float32)
    return x_BQ * d_B1


def _q4(qs_BN):
    return _nibbles(qs_BN).reshape(*qs_BN.shape[:-1], 32)


def _q5(qh_BN, qs_BN):
    return _q4(qs_BN) | (_bits_lsb_first(qh_BN) << 4)


def _deq_q4_0(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    q_BQ = _q4(b_BN[..., 2:18]).astype(jnp.float32) - 8.0  # exact: small integers
    return d_B1 * q_BQ


def _deq_q4_1(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    m_B1 = _f16(b_BN[..., 2:4])[..., None]
    q_BQ = _q4(b_BN[..., 4:20]).astype(jnp.float32)
    return d_B1 * q_BQ + m_B1


def _deq_q5_0(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    q_BQ = _q5(b_BN[..., 2:6], b_BN[..., 6:22]).astype(jnp.float32) - 16.0
    return d_B1 * q_BQ


def _deq_q5_1(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    m_B1 = _f16(b_BN[..., 2:4])[..., None]
    q_BQ = _q5(b_BN[..., 4:8], b_BN[..., 8:24]).astype(jnp.float32)
    return d_B1 * q_BQ + m_B1


def _lead(b_BN):
    return b_BN.shape[:-1]


def _deq_q2_k(b_BN):
    lead = _lead(b_BN)
    scales_BS = b_BN[..., 0:16]
    d_B1 = _f16(b_BN[..., 80:82])[..., None]
    dmin_B1 = _f16(b_BN[..., 82:84])[..., None]
    dl_BS1 = (d_B1 * (scales_BS & 0x0F).astype(jnp.float32))[..., None]
    ml_BS1 = (dmin_B1 * (scales_BS >> 4).astype(jnp.float32))[..., None]
    # 64 bytes = two 32-byte groups, each giving four 32-value slices (bit pairs 0-1, 2-3, ...)
    q_BSQ = _crumbs(b_BN[..., 16:80].reshape(*lead, 2, 32)).reshape(*lead, 16, 16)
    return (dl_BS1 * q_BSQ.astype(jnp.float32) - ml_BS1).reshape(*lead, QK_K)


def _deq_q3_k(b_BN):
    lead = _lead(b_BN)
    hmask_BN = b_BN[..., 0:32]
    qs_BN = b_BN[..., 32:96]
    scales_BN = b_BN[..., 96:108]
    d_B1 = _f16(b_BN[..., 108:110])[..., None]
    # 16 six-bit scales: low nibbles from bytes 0-7 (low nibbles first, then high), top two bits from
    # bytes 8-11 (bit pairs 0-1 of the four bytes, then 2-3, ...)
    lo_BS = _nibbles(scales_BN[..., 0:8]).reshape(*lead, 16)
    hi_BS = _crumbs(scales_BN[..., 8:12]).reshape(*lead, 16)
    sc_BS = (lo_BS | (hi_BS << 4)).astype(jnp.float32) - 32.0
    dl_BS1 = (d_B1 * sc_BS)[..., None]
    ql_BSQ = _crumbs(qs_BN.reshape(*lead, 2, 32)).reshape(*lead, 16, 16)
    qh_BSQ = _bits(hmask_BN).reshape(*lead, 16, 16)
    # a CLEAR hmask bit subtracts 4 (GGML's convention)
    q_BSQ = ql_BSQ.astype(jnp.float32) - ((qh_BSQ ^ 1) << 2).astype(jnp.float32)
    return (dl_BS1 * q_BSQ).reshape(*lead, QK_K)


def _scale_min_k4(scales_BN):
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, each uint8[..., B, 8]. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes 8-11
    the low nibbles of scales 4-7 (low half) and mins 4-7 (high half)."""
    d_BN, m_BN, md_BN = scales_BN[..., 0:4], scales_BN[..., 4:8], scales_BN[..., 8:12]
    sc_BS = jnp.concatenate([d_BN & 0x3F, (md_BN & 0x0F) | ((d_BN >> 2) & 0x30)], axis=-1)
    mn_BS = jnp.concatenate([m_BN & 0x3F, (md_BN >> 4) | ((m_BN >> 2) & 0x30)], axis=-1)
    return sc_BS, mn_BS


def _k4_scales(b_BN):
    d_B1 = _f16(b_BN[..., 0:2])[..., None]
    dmin_B1 = _f16(b_BN[..., 2:4])[..., None]
    sc_BS, mn_BS = _scale_min_k4(b_BN[..., 4:16])
    d_BS1 = (d_B1 * sc_BS.astype(jnp.float32))[..., None]
    dm_BS1 = (dmin_B1 * mn_BS.astype(jnp.float32))[..., None]
    return d_BS1, dm_BS1


def _deq_q4_k(b_BN):
    lead = _lead(b_BN)
    d_BS1, dm_BS1 = _k4_scales(b_BN)
    # 128 bytes = four 32-byte groups, each giving two 32-value sub-blocks (low nibbles, high nibbles)
    q_BSQ = _nibbles(b_BN[..., 16:144].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
    return (d_BS1 * q_BSQ.astype(jnp.float32) - dm_BS1).reshape(*lead, QK_K)


def _deq_q5_k(b_BN):
    lead = _lead(b_BN)
    d_BS1, dm_BS1 = _k4_scales(b_BN)
    ql_BSQ = _nibbles(b_BN[..., 48:176].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
    qh_BSQ = _bits(b_BN[..., 16:48]).reshape(*lead, 8, 32)
    q_BSQ = ql_BSQ | (qh_BSQ << 4)
    return (d_BS1 * q_BSQ.astype(jnp.float32) - dm_BS1).reshape(*lead, QK_K)


def _deq_q6_k(b_BN):
    lead = _lead(b_BN)
    ql_BN = b_BN[..., 0:128]
    qh_BN = b_BN[..., 128:192]
    sc_BS = _int8(b_BN[..., 192:208]).astype(jnp.float32)
    d_B1 = _f16(b_BN[..., 208:210])[..., None]
    d_BS1 = (d_B1 * sc_BS)[..., None]
    # two 128-value halves; per half: 64 ql bytes -> 2 x 64 nibbles, 32 qh bytes -> 4 x 32 bit pairs
    ql_BSQ = _nibbles(ql_BN.reshape(*lead, 2, 64)).reshape(*lead, 8, 32)
    qh_BSQ = _crumbs(qh_BN.reshape(*lead, 2, 32)).reshape(*lead, 8, 32)
    q_BSQ = (ql_BSQ | (qh_BSQ << 4)).astype(jnp.float32) - 32.0
    return (d_BS1 * q_BSQ.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


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
    block, type_size = GGML_QUANT_SIZES[qtype]
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
    b_BN = data.reshape(*lead, n_cols // block, type_size)
    out_BQ = _DECODERS[qtype](b_BN)
    return out_BQ.reshape(*lead, n_cols).astype(dtype)
