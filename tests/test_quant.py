"""jnp dequantizers vs gguf.quants.dequantize: bit-exact, under jit, any leading axes."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gq

from strata_jax.core.errors import UnsupportedQuantTypeError
from strata_jax.gguf.quant import SUPPORTED_TYPES, check_supported, dequantize, row_bytes

ALL = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
FLOATS = {T.F32: np.float32, T.F16: np.float16}

# byte offsets of each block's fp16 scale fields: random bytes there would give NaN/inf scales
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
# types gguf-py can also quantize (realistic bytes, not just random ones)
QUANTIZABLE = [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]

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


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
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
        check_supported(T.IQ2_XXS, "blk.0.ffn_down_exps.weight")
    msg = str(e.value)
    assert "IQ2_XXS" in msg and "blk.0.ffn_down_exps.weight" in msg
    assert "Supported types" in msg and all(t.name in msg for t in ALL)
    assert "llama-quantize" in msg and "Q4_K_M" in msg
    with pytest.raises(UnsupportedQuantTypeError, match="IQ2_XXS"):
        dequantize(jnp.zeros((1, 66), jnp.uint8), T.IQ2_XXS, 256)


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
