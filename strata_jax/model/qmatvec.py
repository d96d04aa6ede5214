"""Fused dequantize + matrix-vector products over GGML blocks (Pallas; Triton on GPU).

Decode multiplies each weight matrix by one token (or a few). Dequantizing the matrix first writes and
re-reads 2 bytes per weight in bf16 for the ~0.56 a Q4_K weight takes; this kernel reads the block
bytes once, decodes them in registers and accumulates the dot products in float32, so a step reads
each routed expert's and each dense matrix's quantized bytes once and writes only the outputs.

One kernel serves both uses, as "pair m multiplies matrix slot_I[m] of a stack by its T token rows":
- dense weights: a stack of one matrix, I = 1 pair, T = the tokens of the step;
- routed experts: the slot pool is the stack, I = tokens x experts-per-token pairs, T = 1, and each
  pair's matrix is read straight from its slot: no gather copy of the routed experts.
The routed experts' gate and up projections run in one call that produces silu(g) * u directly.

Layout: a matrix is `n_rows` GGML rows of `row_bytes` bytes at byte `offset` of a stack row (a slot of
the fused expert rows, or the whole dense matrix). Each program computes `block_rows` outputs of one
pair, walking the row a unit at a time (a 256-value super-block of a K-quant or IQ type, or up to 8
blocks of a 32-value type). Within a unit every field is loaded as a [rows, groups, values] tensor through
index arithmetic: Triton tensors need power-of-two shapes and cannot be sliced in registers. The IQ types'
codebooks (grids, IQ4 values) are small constant inputs of the call, gathered like the weight bytes.

Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ4_NL, IQ4_XS, MXFP4, and the float types F16, BF16, F32 (`SUPPORTED`); not Q2_K, Q3_K or the
ternary types.

Where the model uses it (`use_kernel`), by the static `Kernels.qmatvec` choice (model/kernels.py):
"auto" (on a GPU, K-quant matrices with enough rows to fill the chip, and IQ3_S routed experts: where
it is faster, docs/benchmarks.md; the other IQ types wait for their GPU measurement), "on" (every
supported matrix; on CPU through Pallas' interpreter, for tests), "off" (never).

Numerics: float32 dot products of the decoded integers with x, scaled per sub-block (llama.cpp's
formulation); the summation order differs from dequantize-then-matmul, so results agree to float32
rounding, not bit for bit.

Shape legend: strata_jax/core/shapes.py (here: I pairs, T token rows per pair, D input columns, F output
rows, X stack rows (slots), P bytes per stack row, O rows of one program, A sub-block groups of a
super-block, Q values per group).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType

from strata_jax.gguf import iq_tables as iqt
from strata_jax.gguf.layout import QK_K, is_k_quant, is_super_block, layout, row_bytes
from strata_jax.gguf.quant import dequantize
from strata_jax.model.kernels import Kernels

Q = GGMLQuantizationType

MAX_T = 8  # token rows a pair multiplies in registers; more go through dequantize + matmul
SUPER = QK_K  # values per K-quant super-block


@dataclasses.dataclass(frozen=True)
class Part:
    """One matrix inside a stack row: GGML type, rows, bytes per row, byte offset, logical columns."""

    qtype: GGMLQuantizationType
    n_rows: int
    row_bytes: int
    offset: int
    n_cols: int


# ---- in-kernel field decoding --------------------------------------------------------------------
# `ld(idx)` loads the bytes at offsets idx (int32 [A] or [A, Q], relative to the current super-block)
# of every row of the program: uint8[O, A] or [O, A, Q]. Each decoder returns terms
# (q[O, A, Q] float32, scale[O, A], bias[O, A] | None, x_idx[A, Q]); a super-block contributes
# sum_A(scale * sum_Q(q * x[x_idx]) + bias * sum_Q(x[x_idx])). Index grids are iotas of their final
# shapes.


def _u(b):
    return b.astype(jnp.int32)


def _f16(lo, hi):
    u16 = (_u(lo) | (_u(hi) << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(u16, jnp.float16).astype(jnp.float32)


def _grid(*shape):
    """int32 index grids of `shape`, one per axis: _grid(4, 32) -> (g[4, 32], l[4, 32])."""
    return tuple(jax.lax.broadcasted_iota(jnp.int32, shape, i) for i in range(len(shape)))


def _iota(n):
    return jax.lax.iota(jnp.int32, n)


def _const(n, v):
    return jnp.full((n,), v, jnp.int32)


def _int8(u):
    return jnp.where(u >= 128, u - 256, u)


def _k4_scale_min(ld, s_A):
    """Q4_K/Q5_K six-bit scales and mins of sub-blocks s_A (int32 [A], values 0-7) as float32 [O, A].
    Packing (quant._scale_min_k4): scale bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, bytes
    4-7 the same for mins, bytes 8-11 the low nibbles of scales 4-7 and mins 4-7."""
    hi_A = s_A >= 4
    p = _u(ld(4 + jnp.where(hi_A, s_A + 4, s_A)))
    q = _u(ld(4 + jnp.where(hi_A, s_A - 4, s_A + 4)))
    r = _u(ld(4 + s_A))
    hi = hi_A[None, :]
    sc = jnp.where(hi, (p & 0x0F) | ((q >> 6) << 4), p & 0x3F)
    mn = jnp.where(hi, (p >> 4) | ((r >> 6) << 4), q & 0x3F)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k4_terms(ld, q_of_half):
    g, l = _grid(4, 32)  # value 64g + 32h + l comes from nibble h of qs byte 32g + l
    d = _f16(ld(_const(4, 0)), ld(_const(4, 1)))
    dmin = _f16(ld(_const(4, 2)), ld(_const(4, 3)))
    out = []
    for half in (0, 1):
        sc, mn = _k4_scale_min(ld, 2 * _iota(4) + half)
        out.append((q_of_half(g, half).astype(jnp.float32), d * sc, -dmin * mn, 64 * g + 32 * half + l))
    return out


def _terms_q4_k(ld):
    g, l = _grid(4, 32)
    qs = _u(ld(16 + 32 * g + l))
    return _k4_terms(ld, lambda g, half: (qs >> (4 * half)) & 0x0F)


def _terms_q5_k(ld):
    g, l = _grid(4, 32)
    qs = _u(ld(48 + 32 * g + l))
    qh = _u(ld(16 + l))  # bit s of qh byte l: the fifth bit of value l of sub-block s
    return _k4_terms(ld, lambda g, half: ((qs >> (4 * half)) & 0x0F) | (((qh >> (2 * g + half)) & 1) << 4))


def _terms_q6_k(ld):
    # value 128h + 32k + c (half h < 2, k < 4, c < 32): ql byte 64h + 32(k % 2) + c (low nibble for
    # k < 2, high for k >= 2), bits 2k, 2k+1 of qh byte 128 + 32h + c; an int8 scale per 16 values
    hk, c = _grid(8, 32)
    h, k = hk // 4, hk % 4
    ql = _u(ld(64 * h + 32 * (k % 2) + c))
    qh = _u(ld(128 + 32 * h + c))
    q = (((ql >> (4 * (k // 2))) & 0x0F) | (((qh >> (2 * k)) & 3) << 4)) - 32
    d = _f16(ld(_const(8, 208)), ld(_const(8, 209)))
    xi = 128 * h + 32 * k + c
    out = []
    for part in (0, 1):  # the first and the second 16 values of each 32 have their own scale
        sc = _int8(_u(ld(192 + 2 * _iota(8) + part))).astype(jnp.float32)
        out.append((jnp.where((c >= 16) == bool(part), q, 0).astype(jnp.float32), d * sc, None, xi))
    return out


# The 32-value types are decoded G blocks at a time (G a power of two dividing the row's block count).


def _blocks_f16(ld, G, size, at=0):
    base = size * _iota(G) + at
    return _f16(ld(base), ld(base + 1))


def _terms_q8_0(ld, G):
    g, l = _grid(G, 32)  # blocks of 34 bytes: d (fp16), 32 int8
    q = _int8(_u(ld(34 * g + 2 + l)))
    return [(q.astype(jnp.float32), _blocks_f16(ld, G, 34), None, 32 * g + l)]


def _terms_q4_0(ld, G):
    g, l = _grid(G, 16)  # blocks of 18 bytes: d, 16 bytes (low nibbles: values 0-15, high: 16-31)
    qs = _u(ld(18 * g + 2 + l))
    d = _blocks_f16(ld, G, 18)
    return [((((qs >> (4 * half)) & 0x0F) - 8).astype(jnp.float32), d, None, 32 * g + 16 * half + l)
            for half in (0, 1)]


def _terms_q4_1(ld, G):
    g, l = _grid(G, 16)  # blocks of 20 bytes: d, m, 16 bytes
    qs = _u(ld(20 * g + 4 + l))
    d, m = _blocks_f16(ld, G, 20), _blocks_f16(ld, G, 20, 2)
    return [(((qs >> (4 * half)) & 0x0F).astype(jnp.float32), d, m, 32 * g + 16 * half + l) for half in (0, 1)]


def _q5_terms(ld, G, size, qh_at, qs_at, with_min):
    g, l = _grid(G, 16)
    qs = _u(ld(size * g + qs_at + l))
    d = _blocks_f16(ld, G, size)
    m = _blocks_f16(ld, G, size, 2) if with_min else None
    out = []
    for half in (0, 1):
        j = 16 * half + l  # value j's fifth bit is bit j of the little-endian uint32 qh
        qh = _u(ld(size * g + qh_at + j // 8))
        q = ((qs >> (4 * half)) & 0x0F) | (((qh >> (j % 8)) & 1) << 4)
        out.append(((q if with_min else q - 16).astype(jnp.float32), d, m, 32 * g + j))
    return out


# ---- IQ types: lattice grid points, sign patterns, non-linear values -------------------------------
# Their codebooks reach the kernel as small constant inputs (`_TABLES`: the grid rows flattened to
# uint8/int8, value j of point i at i * width + j, at most 16 KiB). A lookup is one more gather load,
# the same pointer-tensor load the weight bytes take (Triton has no register-indexed arrays), served
# from L1/L2; bytes rather than packed uint32 words, so no unpacking shifts follow the load. `tab(idx)`
# loads the entries at idx (int32, any shape) of the part's table. The seven-bit sign indices of
# IQ2_XXS/IQ2_XS/IQ3_XXS need no table: their eighth sign is the parity of the seven (iq_tables).
# Terms are one per grid point: A points of Q values, the point's sub-block scale repeated per point.


def _u16_at(ld, at):
    return _u(ld(at)) | (_u(ld(at + 1)) << 8)


def _u32_at(ld, at):
    # bit 31 may land in the sign of the int32: callers only shift right by <= 28 and mask
    return _u16_at(ld, at) | (_u16_at(ld, at + 2) << 16)


def _ksign_bits(s_OA, bit_AQ):
    """Sign bits (1 = negative) of seven-bit sign indices s [O, A] at bits bit_AQ (0-7): [O, A, Q]."""
    par = s_OA ^ (s_OA >> 4)
    par = par ^ (par >> 2)
    par = (par ^ (par >> 1)) & 1
    return ((s_OA | (par << 7))[:, :, None] >> bit_AQ[None]) & 1


def _points(tab, ix_OA, j_AQ, width):
    """Values j of grid points ix: float32 [O, A, Q]."""
    return tab(ix_OA[:, :, None] * width + j_AQ[None]).astype(jnp.float32)


def _signed(v, neg):
    return jnp.where(neg != 0, -v, v)


def _d(ld, n):
    return _f16(ld(_const(n, 0)), ld(_const(n, 1)))


def _iq2_scale(d, sc):
    return d * (0.5 + sc.astype(jnp.float32)) * 0.25


def _terms_iq2_xxs(ld, tab):
    # 8 sub-blocks of 8 bytes: 4 grid indices (points of 8), a uint32 of four 7-bit sign indices + scale
    p, j = _grid(32, 8)
    p_A = _iota(32)
    at = 2 + 8 * (p_A // 4)
    grid = _points(tab, _u(ld(at + p_A % 4)), j, 8)
    s = (_u32_at(ld, at + 4) >> (7 * (p_A % 4))) & 0x7F
    return [(_signed(grid, _ksign_bits(s, j)), _iq2_scale(_d(ld, 32), _u(ld(at + 7)) >> 4), None, 8 * p + j)]


def _terms_iq2_xs(ld, tab):
    # a uint16 per point: 9-bit grid index, 7-bit sign index; a nibble scale per 2 points
    p, j = _grid(32, 8)
    p_A = _iota(32)
    w = _u16_at(ld, 2 + 2 * p_A)
    sc = (_u(ld(66 + p_A // 4)) >> (4 * ((p_A // 2) % 2))) & 0x0F
    grid = _points(tab, w & 0x1FF, j, 8)
    return [(_signed(grid, _ksign_bits(w >> 9, j)), _iq2_scale(_d(ld, 32), sc), None, 8 * p + j)]


def _terms_iq2_s(ld, tab):
    # 10-bit grid indices (qs byte, 2 bits of qh), an explicit sign byte per point, a nibble per 2 points
    p, j = _grid(32, 8)
    p_A = _iota(32)
    ix = _u(ld(2 + p_A)) | (((_u(ld(66 + p_A // 4)) >> (2 * (p_A % 4))) & 3) << 8)
    neg = (_u(ld(34 + p_A))[:, :, None] >> j[None]) & 1
    sc = (_u(ld(74 + p_A // 4)) >> (4 * ((p_A // 2) % 2))) & 0x0F
    return [(_signed(_points(tab, ix, j, 8), neg), _iq2_scale(_d(ld, 32), sc), None, 8 * p + j)]


def _terms_iq3_xxs(ld, tab):
    # 64 grid indices (points of 4), then per 32-value sub-block (8 points) a uint32 as in IQ2_XXS
    p, j = _grid(64, 4)
    p_A = _iota(64)
    at = 66 + 4 * (p_A // 8)
    s = (_u32_at(ld, at) >> (7 * ((p_A % 8) // 2))) & 0x7F  # one sign index per 8 values (2 points)
    neg = _ksign_bits(s, 4 * (p % 2) + j)
    db = _d(ld, 64) * (0.5 + (_u(ld(at + 3)) >> 4).astype(jnp.float32)) * 0.5
    return [(_signed(_points(tab, _u(ld(2 + p_A)), j, 4), neg), db, None, 4 * p + j)]


def _terms_iq3_s(ld, tab):
    # 9-bit grid indices (qs byte, qh bit p), one sign bit per value, a nibble scale per 8 points
    p, j = _grid(64, 4)
    p_A = _iota(64)
    ix = _u(ld(2 + p_A)) | (((_u(ld(66 + p_A // 8)) >> (p_A % 8)) & 1) << 8)
    neg = (_u(ld(74 + p_A // 2))[:, :, None] >> (4 * (p % 2) + j)[None]) & 1
    sc = (_u(ld(106 + p_A // 16)) >> (4 * ((p_A // 8) % 2))) & 0x0F
    db = _d(ld, 64) * (1 + 2 * sc).astype(jnp.float32)
    return [(_signed(_points(tab, ix, j, 4), neg), db, None, 4 * p + j)]


def _iq1_delta(neg_OA):
    return jnp.where(neg_OA != 0, -iqt.IQ1S_DELTA, iqt.IQ1S_DELTA)


def _terms_iq1_s(ld, tab):
    # per 4 points a uint16: their 3 high index bits, a 3-bit scale, the delta's sign; dl * (grid + delta)
    # as dl * grid + dl * delta (the bias)
    p, j = _grid(32, 8)
    p_A = _iota(32)
    qh = _u16_at(ld, 34 + 2 * (p_A // 4))
    ix = _u(ld(2 + p_A)) | (((qh >> (3 * (p_A % 4))) & 7) << 8)
    dl = _d(ld, 32) * (2 * ((qh >> 12) & 7) + 1).astype(jnp.float32)
    return [(_points(tab, ix, j, 8), dl, dl * _iq1_delta(qh & 0x8000), 8 * p + j)]


def _terms_iq1_m(ld, tab):
    # d: the top nibbles of the four uint16 scale words; 3-bit scales per 2 points; a qh nibble per
    # point: 3 high index bits, the delta's sign
    p, j = _grid(32, 8)
    p_A = _iota(32)
    top = [_u(ld(_const(32, 49 + 2 * w))) >> 4 for w in range(4)]
    d = _f16(top[0] | (top[1] << 4), top[2] | (top[3] << 4))
    a = p_A // 2
    s = (_u16_at(ld, 48 + 2 * (a // 4)) >> (3 * (a % 4))) & 7
    h = (_u(ld(32 + p_A // 2)) >> (4 * (p_A % 2))) & 0x0F
    dl = d * (2 * s + 1).astype(jnp.float32)
    return [(_points(tab, _u(ld(p_A)) | ((h & 7) << 8), j, 8), dl, dl * _iq1_delta(h & 8), 8 * p + j)]


def _terms_iq4_xs(ld, tab):
    # 8 sub-blocks of 32: six-bit scales (low nibbles at 4-7, top bit pairs in the uint16 at 2-3) - 32;
    # value k of sub-block a: nibble k // 16 of qs byte 8 + 16a + k % 16, through the 16 non-linear values
    a, k = _grid(8, 32)
    a_A = _iota(8)
    nib = (_u(ld(8 + 16 * a + k % 16)) >> (4 * (k // 16))) & 0x0F
    lo = (_u(ld(4 + a_A // 2)) >> (4 * (a_A % 2))) & 0x0F
    hi = (_u(ld(2 + a_A // 4)) >> (2 * (a_A % 4))) & 3
    dl = _d(ld, 8) * ((lo | (hi << 4)) - 32).astype(jnp.float32)
    return [(tab(nib).astype(jnp.float32), dl, None, 32 * a + k)]


def _terms_iq4_nl(ld, G, tab):
    g, l = _grid(G, 16)  # Q4_0's layout, the nibbles through the 16 non-linear values
    qs = _u(ld(18 * g + 2 + l))
    d = _blocks_f16(ld, G, 18)
    return [(tab((qs >> (4 * half)) & 0x0F).astype(jnp.float32), d, None, 32 * g + 16 * half + l)
            for half in (0, 1)]


def _terms_mxfp4(ld, G, tab):
    g, l = _grid(G, 16)  # blocks of 17 bytes: an e8m0 exponent, then Q4_0's nibble order of e2m1 codes
    qs = _u(ld(17 * g + 1 + l))
    e = _u(ld(17 * _iota(G)))
    # half the block's power of two, from its bits (quant._e8m0_half): e < 2 are the subnormals
    d = jax.lax.bitcast_convert_type(jnp.where(e < 2, 0x00200000 << e, (e - 1) << 23), jnp.float32)
    return [(tab((qs >> (4 * half)) & 0x0F).astype(jnp.float32), d, None, 32 * g + 16 * half + l)
            for half in (0, 1)]


# Float matrices (F16, BF16, F32) are walked in pseudo-blocks of up to 32 values (a power of two dividing the
# row), G at a time like the 32-value types: no scale, each value built from its bytes (a stack of float rows
# is stored as bytes, as every QTensor is).
def _float_block(n_cols: int) -> int | None:
    return next((w for w in (32, 16, 8) if n_cols % w == 0), None)


def _terms_float(ld, G, qtype, width):
    g, l = _grid(G, width)
    size = 4 if qtype == Q.F32 else 2
    at = size * (width * g + l)
    if qtype == Q.F32:
        b = [_u(ld(at + i)) for i in range(4)]
        q = jax.lax.bitcast_convert_type(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24), jnp.float32)
    elif qtype == Q.BF16:  # the high half of a float32
        q = jax.lax.bitcast_convert_type((_u(ld(at)) | (_u(ld(at + 1)) << 8)) << 16, jnp.float32)
    else:
        q = _f16(ld(at), ld(at + 1))
    return [(q, jnp.ones(q.shape[:2], jnp.float32), None, width * g + l)]


_TABLES = {  # name -> flat table; a part's table is _TABLES[_TABLE_OF[qtype]]
    "iq2xxs_grid": iqt.IQ2XXS_GRID.reshape(-1),
    "iq2xs_grid": iqt.IQ2XS_GRID.reshape(-1),
    "iq2s_grid": iqt.IQ2S_GRID.reshape(-1),
    "iq3xxs_grid": iqt.IQ3XXS_GRID.reshape(-1),
    "iq3s_grid": iqt.IQ3S_GRID.reshape(-1),
    "iq1s_grid": iqt.IQ1S_GRID.reshape(-1),
    "iq4nl_values": iqt.KVALUES_IQ4NL,
    "mxfp4_values": iqt.KVALUES_MXFP4,
}
_TABLE_OF = {
    Q.IQ2_XXS: "iq2xxs_grid", Q.IQ2_XS: "iq2xs_grid", Q.IQ2_S: "iq2s_grid", Q.IQ3_XXS: "iq3xxs_grid",
    Q.IQ3_S: "iq3s_grid", Q.IQ1_S: "iq1s_grid", Q.IQ1_M: "iq1s_grid", Q.IQ4_XS: "iq4nl_values",
    Q.IQ4_NL: "iq4nl_values", Q.MXFP4: "mxfp4_values",
}


_TERMS = {
    Q.Q4_K: _terms_q4_k,
    Q.Q5_K: _terms_q5_k,
    Q.Q6_K: _terms_q6_k,
    Q.Q8_0: _terms_q8_0,
    Q.Q4_0: _terms_q4_0,
    Q.Q4_1: _terms_q4_1,
    Q.Q5_0: lambda ld, G: _q5_terms(ld, G, 22, 2, 6, False),
    Q.Q5_1: lambda ld, G: _q5_terms(ld, G, 24, 4, 8, True),
    Q.IQ2_XXS: _terms_iq2_xxs,
    Q.IQ2_XS: _terms_iq2_xs,
    Q.IQ2_S: _terms_iq2_s,
    Q.IQ3_XXS: _terms_iq3_xxs,
    Q.IQ3_S: _terms_iq3_s,
    Q.IQ1_S: _terms_iq1_s,
    Q.IQ1_M: _terms_iq1_m,
    Q.IQ4_XS: _terms_iq4_xs,
    Q.IQ4_NL: _terms_iq4_nl,
    Q.MXFP4: _terms_mxfp4,
    Q.F16: functools.partial(_terms_float, qtype=Q.F16),
    Q.BF16: functools.partial(_terms_float, qtype=Q.BF16),
    Q.F32: functools.partial(_terms_float, qtype=Q.F32),
}
FLOATS = frozenset({Q.F16, Q.BF16, Q.F32})

SUPPORTED = frozenset(_TERMS)


def _group(qtype, n_cols: int) -> tuple[int, int, int] | None:
    """(values, bytes, G) of the unit a program decodes at a time along a row: one 256-value super-block
    (K-quant, IQ), or G blocks of a 32-value type (G <= 8, a power of two dividing the block count); None
    if the row cannot be walked so."""
    block, size = layout(qtype).block_size, layout(qtype).type_size
    if qtype in FLOATS:
        block = _float_block(n_cols)
        if block is None:
            return None
        size *= block
    if n_cols % block:
        return None
    if is_super_block(qtype):
        return SUPER, size, 1
    n_blocks = n_cols // block
    G = 8
    while n_blocks % G:
        G //= 2
    return block * G, size * G, G


def supported(qtype, n_cols: int) -> bool:
    """Whether the kernel takes matrices of this GGML type and row length."""
    return qtype in SUPPORTED and _group(qtype, n_cols) is not None


# ---- the kernel ------------------------------------------------------------------------------------


def _tables(parts) -> tuple[str, ...]:
    """Names of the tables the parts' types look up, each once, in the order of the kernel's inputs."""
    return tuple(dict.fromkeys(_TABLE_OF[p.qtype] for p in parts if p.qtype in _TABLE_OF))


def _row_dot(w_ref, x_ref, tab_refs, slot, m, rows_O, ok_O, part: Part, T: int, unroll: bool, split=None):
    """[T] list of float32[O]: the program's rows of `part` dotted with each of the pair's T rows.
    tab_refs: {table name: ref} of the call's lookup tables. split: (this program's share, shares): only
    that share of the row's units (split-K: a partial sum)."""
    from jax.experimental.pallas import triton as plgpu

    values, nbytes, G = _group(part.qtype, part.n_cols)
    kw = {} if is_super_block(part.qtype) else {"G": G}
    if part.qtype in FLOATS:
        kw["width"] = _float_block(part.n_cols)
    if part.qtype in _TABLE_OF:
        tab_ref = tab_refs[_TABLE_OF[part.qtype]]
        kw["tab"] = lambda idx: tab_ref[idx]  # indices in range by construction (masked fields)
    terms = functools.partial(_TERMS[part.qtype], **kw)

    def unit(b, acc):
        base_O = part.offset + rows_O * part.row_bytes + b * nbytes

        def ld(idx):
            expand = (slice(None),) + (None,) * idx.ndim
            at = base_O[expand] + idx[None]
            if ok_O is None:
                return w_ref[slot, at]
            return plgpu.load(w_ref.at[slot, at], mask=jnp.broadcast_to(ok_O[expand], at.shape), other=0)

        acc = list(acc)
        for q_OAQ, scale_OA, bias_OA, xi_AQ in terms(ld):
            for t in range(T):
                x_AQ = x_ref[m, t, b * values + xi_AQ].astype(jnp.float32)
                term_OA = scale_OA * jnp.sum(q_OAQ * x_AQ[None], axis=2)
                if bias_OA is not None:
                    term_OA = term_OA + bias_OA * jnp.sum(x_AQ, axis=1)[None]
                acc[t] = acc[t] + jnp.sum(term_OA, axis=1)
        return tuple(acc)

    acc = tuple(jnp.zeros(rows_O.shape, jnp.float32) for _ in range(T))
    n_units = part.n_cols // values
    if unroll:
        for b in range(n_units):
            acc = unit(b, acc)
        return list(acc)
    if split is None:
        return list(jax.lax.fori_loop(0, n_units, unit, acc))
    share = n_units // split[1]  # a static trip count: the shares divide the units (stacked_matvec checks)
    return list(jax.lax.fori_loop(0, share, lambda i, acc: unit(split[0] * share + i, acc), acc))


def _kernel(slot_ref, x_ref, w_ref, *refs, parts, tables, T, block_rows, swiglu, unroll, splits):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    *tab, o_ref = refs
    tab_refs = dict(zip(tables, tab))

    m = pl.program_id(0)
    rows_O = pl.program_id(1) * block_rows + _iota(block_rows)
    ok_O = rows_O < parts[0].n_rows if parts[0].n_rows % block_rows else None
    slot = slot_ref[m]
    split = None if splits == 1 else (pl.program_id(2), splits)

    def put(i, t, y):  # splits > 1: each part's partial sums at [share, part, pair, row, out]
        at = o_ref.at[m, t, rows_O] if split is None else o_ref.at[split[0], i, m, t, rows_O]
        plgpu.store(at, y.astype(o_ref.dtype), mask=ok_O)

    @pl.when(slot >= 0)
    def _():
        ys = [_row_dot(w_ref, x_ref, tab_refs, slot, m, rows_O, ok_O, p, T, unroll, split) for p in parts]
        for t in range(T):
            if split is not None:
                for i, y in enumerate(ys):
                    put(i, t, y[t])
            else:
                put(0, t, jax.nn.silu(ys[0][t]) * ys[1][t] if swiglu else ys[0][t])

    @pl.when(slot < 0)  # a pair served elsewhere (mixed precision's other pool): zeros, no byte read
    def _():
        for t in range(T):
            for i in range(len(parts) if split is not None else 1):
                put(i, t, jnp.zeros(rows_O.shape, jnp.float32))


def stack_ok(w_XP) -> bool:
    """Pallas' Triton lowering indexes a buffer of up to 4 GiB with 32-bit offsets, which the pointer
    arithmetic takes as signed: past 2 GiB they go negative (an illegal address). Stacks of 2-4 GiB
    therefore stay on dequantize + matmul."""
    return not (2**31 <= w_XP.size * w_XP.dtype.itemsize <= 2**32)


@functools.partial(jax.jit, static_argnames=("parts", "swiglu", "block_rows", "num_warps", "out_dtype", "interpret",
                                             "unroll", "splits"))
def stacked_matvec(x_ITD, w_XP, slot_I, *, parts: tuple[Part, ...], swiglu: bool = False, block_rows: int = 32,
                   num_warps: int = 4, out_dtype=jnp.float32, interpret: bool | None = None, unroll: bool = False,
                   splits: int = 1):
    """y[m, t] = W_{slot_I[m]} @ x[m, t] for the matrix `parts[0]` of each stack row of w_XP (uint8
    [X, P]); with swiglu, silu(W0 x) * (W1 x) for parts (gate, up); zeros where slot_I[m] < 0 (nothing
    read). Returns out_dtype[I, T, F].
    interpret: run in Pallas' interpreter (default: off the GPU). unroll: walk the row in straight-line
    code instead of a loop (much slower to compile: docs/benchmarks.md). splits: split-K, each (pair, rows)
    tile cut into this many programs over shares of the row's units, whose float32 partial sums are added
    (and, with swiglu, activated) after the call: more programs for few long rows."""
    from jax.experimental import pallas as pl

    n_pairs, T, D = x_ITD.shape
    F = parts[0].n_rows
    for p in parts:
        if not supported(p.qtype, p.n_cols) or p.n_cols != D or p.n_rows != F:
            raise ValueError(f"stacked_matvec cannot take {p} for x of {D} columns")
    if not stack_ok(w_XP):
        raise ValueError(f"a stack of {w_XP.nbytes} bytes is between 2 and 4 GiB: see stack_ok")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if splits > 1 and (unroll or (D // _group(parts[0].qtype, D)[0]) % splits):
        raise ValueError(f"stacked_matvec: splits={splits} must divide the row's units and cannot unroll")
    tables = _tables(parts)
    kernel = functools.partial(_kernel, parts=parts, tables=tables, T=T, block_rows=block_rows, swiglu=swiglu,
                               unroll=unroll, splits=splits)
    kw = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        kw["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    out = (n_pairs, T, F) if splits == 1 else (splits, len(parts), n_pairs, T, F)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out, out_dtype if splits == 1 else jnp.float32),
        grid=(n_pairs, pl.cdiv(F, block_rows)) + ((splits,) if splits > 1 else ()),
        interpret=interpret,
        name=f"qmatvec_{parts[0].qtype.name.lower()}{'_swiglu' if swiglu else ''}_r{block_rows}w{num_warps}"
             f"{f's{splits}' if splits > 1 else ''}",
        **kw,
    )(slot_I.astype(jnp.int32), x_ITD, w_XP, *(jnp.asarray(_TABLES[t]) for t in tables))
    if splits == 1:
        return y
    y = jnp.sum(y, axis=0)
    return (jax.nn.silu(y[0]) * y[1] if swiglu else y[0]).astype(out_dtype)


def dense_part(qtype, n_rows: int, n_cols: int) -> Part:
    return Part(Q(qtype), n_rows, row_bytes(qtype, n_cols), 0, n_cols)


def dense_matvec(x_TD, data_FR, qtype, n_cols: int, **kw):
    """x @ W.T for a dense GGML matrix uint8[F, R] and T <= MAX_T token rows: float32[T, F]."""
    F, R = data_FR.shape
    w_1P = data_FR.reshape(1, F * R)
    return stacked_matvec(x_TD[None], w_1P, jnp.zeros((1,), jnp.int32), parts=(dense_part(qtype, F, n_cols),),
                          **kw)[0]


def reference_matvec(x_ITD, w_XP, slot_I, parts, swiglu=False):
    """The same product by dequantize-then-matmul in float32 (tests)."""
    def mat(p, slot):
        rows = jax.lax.dynamic_slice_in_dim(w_XP[slot], p.offset, p.n_rows * p.row_bytes)
        return dequantize(rows.reshape(p.n_rows, p.row_bytes), p.qtype, p.n_cols)

    outs = []
    for m in range(x_ITD.shape[0]):
        ys = [jnp.matmul(x_ITD[m].astype(jnp.float32), mat(p, slot_I[m]).T, precision="highest") for p in parts]
        outs.append(jax.nn.silu(ys[0]) * ys[1] if swiglu else ys[0])
    return jnp.stack(outs)


# ---- where the model uses it -----------------------------------------------------------------------

MIN_PROGRAMS = 256  # auto mode: fewer programs than ~2 per SM of a large GPU leave it latency-bound
SPLIT_PROGRAMS = 2048  # split-K: cut a call's tiles until it has about this many programs
MIN_SPLIT_UNITS = 2  # ... each walking at least this many units of its row


def block_config(part: Part, n_pairs: int, kernels: Kernels | None = None) -> dict:
    """Tile shape: 16-row programs of 2 warps, the fastest tile for the routed experts' gate+up and as
    fast as any for their down projection (benchmarks/decode_profile.py; figures in docs/benchmarks.md).
    With Kernels.qmatvec_split "auto", a call of few tiles (qseed's routed gate+up: 320; its [3072, 4096]
    output projections: 192) is also split along its rows' units (split-K) toward SPLIT_PROGRAMS programs."""
    splits = 1
    if kernels is not None and kernels.qmatvec_split == "auto":
        tiles, units = n_pairs * -(-part.n_rows // 16), part.n_cols // _group(part.qtype, part.n_cols)[0]
        fits = lambda n: tiles * n <= SPLIT_PROGRAMS and units // n >= MIN_SPLIT_UNITS and not units % n  # noqa: E731
        while fits(splits * 2):
            splits *= 2
    return {"block_rows": 16, "num_warps": 2, "splits": splits}


# auto mode's IQ types, for routed experts only: measured faster than dequantize + matmul in a qseed decode
# step (docs/benchmarks.md, "Where a qseed token's GPU time goes"); the other IQ types are not measured there
ROUTED_IQ = frozenset({Q.IQ3_S})


def use_kernel(parts: tuple[Part, ...], n_pairs: int, kernels: Kernels, routed: bool = False,
               skipping: bool = False) -> bool:
    """Whether n_pairs products with these matrices go through the kernel. Auto mode takes only where
    it is faster than dequantize + matmul: K-quant matrices (and, for routed experts, ROUTED_IQ) with at
    least MIN_PROGRAMS programs. Small projections (few programs) and 32-value block types (Q5_0/Q8_0
    rows) are slower on the kernel (docs/benchmarks.md, "Fused dequantize + mat-vec kernel").
    skipping: routed products where some pairs are served by another pool (mixed precision): every IQ
    type too, since only the kernel skips those pairs (the dequantize path would read them all)."""
    if kernels.qmatvec == "off" or not all(supported(p.qtype, p.n_cols) and p.qtype not in FLOATS for p in parts):
        return False  # float matrices: only a scanned layer's, by Kernels.float_stack (linear_ok)
    if kernels.qmatvec == "on":
        return True
    auto = lambda q: is_k_quant(q) or (routed and (Q(q) in ROUTED_IQ or (skipping and Q(q).name.startswith("IQ"))))  # noqa: E731
    if kernels.platform != "gpu" or not all(auto(p.qtype) for p in parts):
        return False
    tile = block_config(parts[0], n_pairs, kernels)
    return n_pairs * -(-parts[0].n_rows // tile["block_rows"]) * tile["splits"] >= MIN_PROGRAMS


def expert_parts(pool, n_pairs: int, kernels: Kernels, skipping: bool = False) -> tuple[Part, ...] | None:
    """qmatvec Parts (gate, up, down) of a pool of expert rows (core.experts.ExpertRows) when n_pairs
    routed products with them go through the kernel, else None (skipping: see use_kernel)."""
    if not stack_ok(pool.data):
        return None
    out = tuple(Part(Q(p.qtype), p.n_rows, p.row_bytes, at, p.n_cols) for p, at in zip(pool.parts, pool.offsets()))
    if not (use_kernel(out[:2], n_pairs, kernels, True, skipping) and use_kernel(out[2:], n_pairs, kernels, True,
                                                                                   skipping)):
        return None
    return out


def _interpret(kernels: Kernels) -> bool:
    return kernels.platform != "gpu"  # Pallas' interpreter off the GPU (tests)


def experts_swiglu(x_ND, w_Nk, slot_Nk, pool_data_XP, parts, dtype, kernels: Kernels):
    """The routed experts of N tokens read straight from their slots: sum_j w[n, j] * down(silu(gate x) *
    up x) for the expert in slot slot_Nk[n, j] (none, and nothing read, where it is negative). float32 [N, D]."""
    N, k = slot_Nk.shape
    gate, up, down = parts
    slot_I = slot_Nk.reshape(N * k)
    x_I1D = jnp.repeat(x_ND, k, axis=0)[:, None, :]
    h_I1F = stacked_matvec(x_I1D, pool_data_XP, slot_I, parts=(gate, up), swiglu=True, out_dtype=dtype,
                           interpret=_interpret(kernels), **block_config(gate, N * k, kernels))
    y_I1D = stacked_matvec(h_I1F, pool_data_XP, slot_I, parts=(down,), interpret=_interpret(kernels),
                           **block_config(down, N * k, kernels))
    return jnp.einsum("nkd,nk->nd", y_I1D.reshape(N, k, -1), w_Nk)


def experts_glu(x_ND, w_Nk, slot_Nk, pool_data_XP, parts, dtype, kernels: Kernels, glu, bias_Nk):
    """experts_swiglu for experts with biases or another gated activation (gpt-oss): gate and up read
    by the kernel one part at a time, then glu(gate x + b_gate, up x + b_up), the down product and
    its bias. bias_Nk: the routed experts' (gate [N, k, F], up [N, k, F], down [N, k, D]) biases, or
    Nones. float32 [N, D]."""
    N, k = slot_Nk.shape
    gate, up, down = parts
    slot_I = slot_Nk.reshape(N * k)
    x_I1D = jnp.repeat(x_ND, k, axis=0)[:, None, :]

    def product(x, part, b):
        y = stacked_matvec(x, pool_data_XP, slot_I, parts=(part,), interpret=_interpret(kernels),
                           **block_config(part, N * k, kernels))[:, 0]
        return y if b is None else y + b.reshape(N * k, -1)

    bg, bu, bd = bias_Nk
    h_I1F = glu(product(x_I1D, gate, bg), product(x_I1D, up, bu)).astype(dtype)[:, None, :]
    y_ID = product(h_I1F, down, bd)
    return jnp.einsum("nkd,nk->nd", y_ID.reshape(N, k, -1), w_Nk)


def linear_ok(w, n_rows: int, kernels: Kernels) -> bool:
    """Whether x @ W.T for n_rows token rows takes the kernel (W a 2-D QTensor, or one of a stack)."""
    ndim = w.data.ndim - (w.index is not None)
    if w.qtype is None or n_rows > MAX_T or ndim != 2 or not stack_ok(w.data):
        return False
    if w.qtype in FLOATS:  # only a scanned layer's matrix, read in place where the slice would be copied
        return (kernels.float_stack == "kernel" and w.index is not None and w.data.dtype == jnp.uint8
                and supported(w.qtype, w.n_cols))
    return use_kernel((dense_part(w.qtype, w.data.shape[-2], w.n_cols),), 1, kernels)


def linear(x_TD, w, kernels: Kernels):
    """x @ W.T, float32 [T, F], for a QTensor W ([F, R] GGML rows) and T <= MAX_T; a stack's matrix
    (W.index set) is read in place, the stack's rows being the kernel's slots."""
    F, R = w.data.shape[-2:]
    part = dense_part(w.qtype, F, w.n_cols)
    if w.index is None:
        return dense_matvec(x_TD, w.data, w.qtype, w.n_cols, interpret=_interpret(kernels),
                            **block_config(part, 1, kernels))
    w_XP = w.data.reshape(-1, F * R)
    slot_1 = jnp.reshape(w.index, (1,)).astype(jnp.int32)
    return stacked_matvec(x_TD[None], w_XP, slot_1, parts=(part,), interpret=_interpret(kernels),
                          **block_config(part, 1, kernels))[0]
