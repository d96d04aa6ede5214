"""jnp dequantizers vs gguf.quants.dequantize: bit-exact, under jit, any leading axes; and a model
whose routed experts are IQ types against the same model with gguf-py's dequantized experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gq

import strata_jax
from strata_jax.core.errors import UnsupportedQuantTypeError
from strata_jax.core.qtensor import QTensor
from strata_jax.dev.synthetic import SyntheticSpec, set_iq1m_d, write_synthetic_gguf
from strata_jax.gguf import iq_tables
from strata_jax.gguf.quant import SUPPORTED_TYPES, check_supported, dequant, dequantize, row_bytes, take_rows
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model import qmatvec
from strata_jax.model.kernels import Kernels

# the ternary and IQ types (lattice grids and sign tables: gguf/iq_tables.py)
IQ = [T.TQ1_0, T.TQ2_0, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS]
ALL = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *IQ,
       T.MXFP4]
FLOATS = {T.F32: np.float32, T.F16: np.float16}

# byte offsets of each block's fp16 scale fields: random bytes there would give NaN/inf scales (IQ1_M
# has none: its d is spread over the scale words, set_iq1m_d)
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.TQ1_0: [52], T.TQ2_0: [64], T.IQ1_S: [0], T.IQ1_M: [], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0],
    T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ4_NL: [0], T.IQ4_XS: [0],
    T.MXFP4: [],  # every e8m0 byte is a valid scale, the subnormal 2^-128 and 2^-127 included
}
# types gguf-py can also quantize (realistic bytes, not just random ones)
QUANTIZABLE = [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]

# (leading axes, n_blocks per row): one row, a matrix, an expert stack
SHAPES = [((1,), 1), ((6,), 3), ((3, 4), 2)]

_deq = jax.jit(dequantize, static_argnums=(1, 2, 3))


def random_rows(qtype, lead, n_blocks, rng) -> np.ndarray:
    """uint8[*lead, row_bytes]: random bytes with finite, moderate scales."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_cols = n_blocks * block
    if qtype in FLOATS:
        return rng.standard_normal((*lead, n_cols)).astype(FLOATS[qtype]).view(np.uint8)
    if qtype == T.BF16:
        f32 = rng.standard_normal((*lead, n_cols)).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (*lead, n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-2, 2, (*lead, n_blocks)).astype(np.float16)
        blocks[..., off : off + 2] = scale.view(np.uint8).reshape(*lead, n_blocks, 2)
    if qtype == T.IQ1_M:
        set_iq1m_d(blocks, rng.uniform(-2, 2, (*lead, n_blocks)))
    return blocks.reshape(*lead, n_blocks * type_size)


def check_exact(raw: np.ndarray, qtype, n_cols: int):
    ref = gq.dequantize(raw, qtype)
    got = np.asarray(_deq(jnp.asarray(raw), qtype, n_cols, jnp.float32))
    assert got.dtype == np.float32 and got.shape == ref.shape == (*raw.shape[:-1], n_cols)
    assert not np.isnan(ref).any()
    np.testing.assert_array_equal(got, ref)
    return got


def test_supported_types():
    assert SUPPORTED_TYPES == frozenset(ALL)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("lead,n_blocks", SHAPES, ids=str)
def test_random_blocks_bit_exact(qtype, lead, n_blocks):
    rng = np.random.default_rng([int(qtype), n_blocks, *lead])
    raw = random_rows(qtype, lead, n_blocks, rng)
    check_exact(raw, qtype, n_blocks * GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((2, 8, 512)) * 0.05).astype(np.float32)
    w[0, 0, :32] = 0.0  # an all-zero block (scale 0)
    raw = gq.quantize(w, qtype).view(np.uint8)
    check_exact(raw, qtype, 512)


def test_iq_tables_equal_gguf_py():
    """Every row of the grids, the sign patterns and the IQ4 values, not only those random blocks hit."""
    for cls, table in [(gq.IQ2_XXS, iq_tables.IQ2XXS_GRID), (gq.IQ2_XS, iq_tables.IQ2XS_GRID),
                       (gq.IQ2_S, iq_tables.IQ2S_GRID), (gq.IQ3_XXS, iq_tables.IQ3XXS_GRID),
                       (gq.IQ3_S, iq_tables.IQ3S_GRID), (gq.IQ1_S, iq_tables.IQ1S_GRID)]:
        cls.init_grid()
        np.testing.assert_array_equal(table.astype(np.float32), cls.grid.reshape(cls.grid_shape))
    np.testing.assert_array_equal(iq_tables.KSIGNS_IQ2XS, np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))
    np.testing.assert_array_equal(iq_tables.KVALUES_IQ4NL, gq.IQ4_NL.kvalues)
    np.testing.assert_array_equal(iq_tables.KVALUES_MXFP4, gq.MXFP4.kvalues)
    assert iq_tables.IQ1S_DELTA == gq.IQ1_S.delta


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, *IQ, T.MXFP4], ids=lambda t: t.name)
def test_take_rows_and_dequant(qtype):
    """take_rows (the embedding lookup) of some rows, and dequant of the whole QTensor, under jit."""
    rng = np.random.default_rng([int(qtype), 7])
    raw = random_rows(qtype, (10,), 2, rng)
    n_cols = 2 * GGML_QUANT_SIZES[qtype][0]
    qt = QTensor(jnp.asarray(raw), qtype, n_cols)
    idx = np.array([[3, 0, 9], [9, 3, 5]])
    got = jax.jit(take_rows)(qt, jnp.asarray(idx))
    np.testing.assert_array_equal(np.asarray(got), gq.dequantize(raw[idx], qtype))
    np.testing.assert_array_equal(np.asarray(jax.jit(dequant)(qt)), gq.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ3_S, T.IQ1_M], ids=lambda t: t.name)
def test_bfloat16_output(qtype):
    rng = np.random.default_rng(0)
    raw = jnp.asarray(random_rows(qtype, (4,), 2, rng))
    n_cols = 2 * GGML_QUANT_SIZES[qtype][0]
    f32 = _deq(raw, qtype, n_cols, jnp.float32)
    bf16 = _deq(raw, qtype, n_cols, jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))


def test_vmap_and_gathered_rows():
    """A gathered [T, K, rows, row_bytes] expert slice, dequantized through vmap, matches."""
    rng = np.random.default_rng(1)
    experts = random_rows(T.Q4_K, (5, 3), 2, rng)  # [E, rows, row_bytes]
    idx = np.array([[0, 4], [2, 2], [3, 1]])  # [T, K]
    gathered = experts[idx]
    ref = gq.dequantize(gathered, T.Q4_K)
    got = jax.jit(jax.vmap(lambda x: dequantize(x, T.Q4_K, 512)))(jnp.asarray(experts)[jnp.asarray(idx)])
    np.testing.assert_array_equal(np.asarray(got), ref)


def test_row_bytes():
    assert row_bytes(T.F32, 896) == 3584
    assert row_bytes(T.Q8_0, 896) == 28 * 34
    assert row_bytes(T.Q4_K, 4864) == 19 * 144
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(T.Q4_K, 896)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(jnp.zeros((2, 34), jnp.uint8), T.Q8_0, 40)
    with pytest.raises(ValueError, match="68 bytes"):
        dequantize(jnp.zeros((2, 34), jnp.uint8), T.Q8_0, 64)


def test_check_supported():
    for t in ALL:
        check_supported(t, "x")
    with pytest.raises(UnsupportedQuantTypeError) as e:
        check_supported(T.Q8_1, "blk.0.ffn_down_exps.weight")
    msg = str(e.value)
    assert "Q8_1" in msg and "blk.0.ffn_down_exps.weight" in msg
    assert "Supported types" in msg and all(t.name in msg for t in ALL)
    assert "llama-quantize" in msg and "Q4_K_M" in msg
    with pytest.raises(UnsupportedQuantTypeError, match="Q8_1"):
        dequantize(jnp.zeros((1, 36), jnp.uint8), T.Q8_1, 32)
    with pytest.raises(UnsupportedQuantTypeError, match="unknown GGML type id 9999"):
        check_supported(9999, "x")


@pytest.mark.slow
def test_real_gguf_tensors(qwen_gguf_path):
    from strata_jax.gguf.reader import GGUFFile

    f = GGUFFile(qwen_gguf_path)
    one_per_type = {}
    for info in f.tensors.values():
        one_per_type.setdefault(info.ggml_type, info)
    assert {T.F32, T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K} <= set(one_per_type)
    for qtype, info in one_per_type.items():
        raw = np.ascontiguousarray(info.data[:64] if info.data.ndim > 1 else info.data)
        check_exact(raw, qtype, info.shape[-1])


# 2 MoE layers of 8 experts, top-2: routed experts IQ3_S, the odd layer's down projections IQ1_M
IQ_MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                       n_experts=8, n_experts_used=2, expert_ffn_dim=256, vocab_size=512, qtype="Q8_0",
                       expert_qtype="IQ3_S", odd_down_qtype="IQ1_M", seed=11)


def test_iq_experts_model_equals_gguf_py_dequantized(tmp_path):
    """The model with IQ experts gives the logits of the same model whose experts are gguf-py's F32
    dequantization of the same blocks, with the default Kernels (auto: no fused kernel on CPU, so the
    experts go through dequantize), with qmatvec forced on (the kernel takes the IQ types but not the
    ternary ones: the same logits to float32 rounding), and offloaded."""
    iq_path = write_synthetic_gguf(tmp_path / "iq.gguf", IQ_MOE)
    ref_path = write_synthetic_gguf(tmp_path / "f32.gguf", dataclasses.replace(IQ_MOE, dequantize_experts=True))
    types = {n: t.ggml_type for n, t in GGUFFile(iq_path).tensors.items() if "_exps" in n}
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == T.IQ3_S
    assert types["blk.1.ffn_down_exps.weight"] == T.IQ1_M
    assert {t.ggml_type for n, t in GGUFFile(ref_path).tensors.items() if "_exps" in n} == {T.F32}
    assert [t for t in IQ if not qmatvec.supported(t, 256)] == [T.TQ1_0, T.TQ2_0]

    ids = list(range(5, 37))
    ref = strata_jax.load(ref_path, ctx=64).logits(ids)
    m = strata_jax.load(iq_path, ctx=64)
    assert m.kernels == Kernels(qmatvec="auto", platform="cpu")
    got = m.logits(ids)
    assert np.isfinite(ref).all() and ref.std() > 0.1
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    forced = strata_jax.load(iq_path, ctx=64, kernels=Kernels(qmatvec="on")).logits(ids)
    np.testing.assert_allclose(forced, got, rtol=1e-5, atol=1e-5)
    offloaded = strata_jax.load(iq_path, ctx=64, expert_slots=4)
    assert not offloaded.cache_plan.resident
    np.testing.assert_array_equal(offloaded.logits(ids), got)
