"""The fused dequantize + mat-vec kernel (strata_jax/model/qmatvec.py) against gguf-py's dequantizer, and
the model decoding through it. On CPU the Pallas kernel runs in its interpreter: the same indexing and
arithmetic the Triton build runs on the GPU, where benchmarks/decode_profile.py checks it again."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

import strata_jax
from strata_jax.dev.synthetic import SyntheticSpec, random_tensor_bytes, write_synthetic_gguf
from strata_jax.core.qtensor import QTensor
from strata_jax.model import qmatvec as qm
from strata_jax.model.kernels import Kernels

K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
BLOCK_32 = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
CASES = [(t, d) for t in K_QUANTS for d in (512, 768)] + [(t, d) for t in BLOCK_32 for d in (96, 512, 896)]
# the IQ types (grid codebooks as constant kernel inputs); IQ4_NL has 32-value blocks
IQ_SUPER = [Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_S, Q.IQ1_S, Q.IQ4_XS]
IQ_CASES = [(t, 512) for t in IQ_SUPER] + [(Q.IQ4_NL, 96), (Q.IQ4_NL, 512)]
# MXFP4 (gpt-oss's experts): 32-value blocks of e2m1 codes under an e8m0 exponent, through its value table
MX_CASES = [(Q.MXFP4, 96), (Q.MXFP4, 512)]


def _reference(x_MTD, stack_SFR, slot_M, qtype, n_cols):
    """float64 x @ W.T with W dequantized by gguf-py, per pair."""
    out = []
    for m, slot in enumerate(slot_M):
        w = gguf_dequantize(stack_SFR[slot], qtype).astype(np.float64).reshape(stack_SFR.shape[1], n_cols)
        out.append(x_MTD[m].astype(np.float64) @ w.T)
    return np.stack(out)


# float matrices (a scanned layer's F16 hyper-connection matrices): 32-value pseudo-blocks, G of them per unit
FLOAT_CASES = [(Q.F16, 320), (Q.F16, 48), (Q.BF16, 96), (Q.F32, 512), (Q.F32, 40)]
ALL_CASES = CASES + IQ_CASES + MX_CASES + FLOAT_CASES


@pytest.mark.parametrize("qtype,n_cols", ALL_CASES, ids=[f"{t.name}-{d}" for t, d in ALL_CASES])
def test_kernel_matches_gguf_dequantize(qtype, n_cols):
    rng = np.random.default_rng(int(qtype) * 1000 + n_cols)
    F = 40  # not a multiple of the 16-row blocks: the last program's rows are masked
    stack_SFR = random_tensor_bytes(rng, qtype, (3, F, n_cols), 0.02)
    R = stack_SFR.shape[-1]
    x = rng.standard_normal((4, 3, n_cols)).astype(np.float32)
    slots = np.array([2, 0, 1, 2], np.int32)
    part = qm.Part(qtype, F, R, 0, n_cols)
    y = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(stack_SFR.reshape(3, F * R)), jnp.asarray(slots),
                          parts=(part,), block_rows=16, interpret=True)
    ref = _reference(x, stack_SFR, slots, qtype, n_cols)
    assert y.shape == (4, 3, F)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("qtype,n_cols", IQ_CASES + MX_CASES, ids=[f"{t.name}-{d}" for t, d in IQ_CASES + MX_CASES])
def test_iq_linear_matches_dequantize_then_matmul(qtype, n_cols):
    """`linear` (a dense matrix, a few token rows) over random blocks: every grid index, sign and scale
    bit pattern is valid, so random bytes reach all of each codebook."""
    rng = np.random.default_rng(int(qtype) * 7 + n_cols)
    F, T = 40, 3
    w_FR = random_tensor_bytes(rng, qtype, (F, n_cols), 0.02)
    x_TD = rng.standard_normal((T, n_cols)).astype(np.float32)
    w = QTensor(jnp.asarray(w_FR), qtype, n_cols)
    on = Kernels(qmatvec="on")
    assert qm.supported(qtype, n_cols) and qm.linear_ok(w, T, on)
    y = np.asarray(qm.linear(jnp.asarray(x_TD), w, on))
    ref = x_TD.astype(np.float64) @ gguf_dequantize(w_FR, qtype).astype(np.float64).T
    assert y.shape == (T, F) and np.abs(ref).max() > 0
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [Q.IQ3_S, Q.IQ2_XS, Q.IQ1_M, Q.IQ4_NL, Q.MXFP4, Q.F16, Q.BF16, Q.F32],
                         ids=lambda t: t.name)
def test_iq_kernel_lowers_to_triton(qtype):
    """The Triton lowering (run here without a GPU: Pallas' lowering rules emit Triton IR on the host)
    takes the IQ decoders' ops, the codebook gathers included; the GPU compile itself is for
    benchmarks/decode_profile.py."""
    part = qm.dense_part(qtype, 40, 512)
    w = jax.ShapeDtypeStruct((3, 40 * part.row_bytes), jnp.uint8)
    x = jax.ShapeDtypeStruct((4, 1, 512), jnp.float32)
    fn = jax.jit(lambda x, w, s: qm.stacked_matvec(x, w, s, parts=(part,), block_rows=16, interpret=False))
    text = fn.trace(x, w, jax.ShapeDtypeStruct((4,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"qmatvec_{qtype.name.lower()}_r16w4" in text and "__gpu$xla.gpu.triton" in text


def _gate_up_rows(rng, gate_type, up_type, S: int, F: int, D: int):
    """S expert rows holding a random gate [F, D] then up [F, D] back to back, as a fused slot row holds
    them: (gate bytes, up bytes, rows uint8 [S, P], the two Parts)."""
    g = random_tensor_bytes(rng, gate_type, (S, F, D), 0.02)
    u = random_tensor_bytes(rng, up_type, (S, F, D), 0.02)
    rows = np.concatenate([g.reshape(S, -1), u.reshape(S, -1)], axis=1)
    return g, u, rows, (qm.Part(gate_type, F, g.shape[-1], 0, D), qm.Part(up_type, F, u.shape[-1], F * g.shape[-1], D))


def test_swiglu_over_fused_rows_of_two_iq_types():
    """gate IQ3_S and up IQ1_M in one call: two codebook inputs, each part reading its own."""
    rng = np.random.default_rng(8)
    F, D, S = 24, 256, 3
    g, u, rows, parts = _gate_up_rows(rng, Q.IQ3_S, Q.IQ1_M, S, F, D)
    assert qm._tables(parts) == ("iq3s_grid", "iq1s_grid")
    x = rng.standard_normal((2, 1, D)).astype(np.float32)
    slots = np.array([2, 0], np.int32)
    y = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(slots), parts=parts, swiglu=True,
                          block_rows=16, interpret=True)
    gx = _reference(x, g, slots, Q.IQ3_S, D)
    ux = _reference(x, u, slots, Q.IQ1_M, D)
    ref = gx / (1 + np.exp(-gx)) * ux
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_swiglu_over_fused_rows_of_two_types():
    """gate in Q4_K and up in Q6_K back to back in one row, as an expert's fused slot row holds them."""
    rng = np.random.default_rng(7)
    F, D, S = 48, 512, 5
    g, u, rows, parts = _gate_up_rows(rng, Q.Q4_K, Q.Q6_K, S, F, D)
    x = rng.standard_normal((3, 1, D)).astype(np.float32)
    slots = np.array([4, 1, 4], np.int32)
    y = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(slots), parts=parts, swiglu=True,
                          interpret=True)
    gx = _reference(x, g, slots, Q.Q4_K, D)
    ux = _reference(x, u, slots, Q.Q6_K, D)
    ref = gx / (1 + np.exp(-gx)) * ux
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_a_negative_slot_reads_nothing_and_gives_zeros():
    """Mixed precision hands each pool the pairs it does not serve as slot -1: zeros there, the others as
    before; and a stack of only those is never read (NaN bytes would show)."""
    rng = np.random.default_rng(9)
    _, _, rows, parts = _gate_up_rows(rng, Q.IQ3_S, Q.IQ3_S, 3, 40, 256)
    D = 256
    x = rng.standard_normal((3, 1, D)).astype(np.float32)
    y = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(np.array([2, -1, 0], np.int32)),
                          parts=parts, swiglu=True, block_rows=16, interpret=True)
    full = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(np.array([2, 1, 0], np.int32)),
                             parts=parts, swiglu=True, block_rows=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(y)[[0, 2]], np.asarray(full)[[0, 2]])
    assert not np.asarray(y)[1].any()
    # a mixed step's pools take the kernel for any IQ type on a GPU (auto mode): only it skips such pairs
    gpu, two = Kernels(platform="gpu"), (qm.dense_part(Q.IQ2_XXS, 512, 2048),) * 2
    assert not qm.use_kernel(two, 10, gpu, routed=True) and qm.use_kernel(two, 10, gpu, routed=True, skipping=True)
    nan_rows = np.full_like(rows, 0xFF)  # fp16 scales of 0xFFFF: NaN wherever a byte is read
    y = qm.stacked_matvec(jnp.asarray(x), jnp.asarray(nan_rows), jnp.asarray(np.full(3, -1, np.int32)),
                          parts=parts, swiglu=True, block_rows=16, interpret=True)
    assert not np.asarray(y).any()


def test_stacks_between_2_and_4_gib_are_refused():
    """Pallas' Triton lowering indexes such buffers with 32-bit offsets that turn negative past 2 GiB."""
    def fake(n):
        return jax.ShapeDtypeStruct((n,), jnp.uint8)

    assert qm.stack_ok(fake(2**31 - 1)) and qm.stack_ok(fake(2**32 + 1))
    assert not qm.stack_ok(fake(2**31)) and not qm.stack_ok(fake(3 * 2**30))
    with pytest.raises(ValueError, match="between 2 and 4 GiB"):
        qm.stacked_matvec(jnp.zeros((1, 1, 256)), fake(2**31 + 2**20), jnp.zeros((1,), jnp.int32),
                          parts=(qm.dense_part(Q.Q4_K, 4, 256),))


def test_modes():
    k4 = (qm.dense_part(Q.Q4_K, 4096, 2048),)
    small = (qm.dense_part(Q.Q4_K, 512, 2048),)
    q8 = (qm.dense_part(Q.Q8_0, 4096, 2048),)
    assert not qm.use_kernel(k4, 1, Kernels(qmatvec="off", platform="gpu"))
    on = Kernels(qmatvec="on")
    assert qm.use_kernel(k4, 1, on) and qm.use_kernel(q8, 1, on) and qm.use_kernel(small, 1, on)
    assert not qm.use_kernel((qm.Part(Q.F16, 8, 512, 0, 256),), 1, on)  # floats: only by Kernels.float_stack
    with pytest.raises(ValueError, match="qmatvec='yes'"):
        Kernels(qmatvec="yes")
    assert not qm.use_kernel(k4, 1, Kernels(platform="cpu"))  # auto: GPU only
    gpu = Kernels(platform="gpu")
    assert qm.use_kernel(k4, 1, gpu)  # 256 programs of 16 rows
    assert not qm.use_kernel(small, 1, gpu) and qm.use_kernel(small, 8, gpu)  # 32 programs; 8 experts x 32
    assert not qm.use_kernel(q8, 1, gpu)  # auto takes only the K-quants measured faster
    iq = (qm.dense_part(Q.IQ3_S, 4096, 2048),)
    assert qm.use_kernel(iq, 1, on) and not qm.use_kernel(iq, 8, gpu)  # dense IQ: not measured faster
    experts = (qm.dense_part(Q.IQ3_S, 512, 3072),)  # qseed's routed gate: 10 x 32 programs
    assert qm.use_kernel(experts, 10, gpu, routed=True) and not qm.use_kernel(experts, 10, gpu)
    assert not qm.use_kernel(experts, 4, gpu, routed=True)  # 128 programs: too few to fill the chip
    assert not qm.use_kernel((qm.dense_part(Q.IQ2_XS, 512, 3072),), 10, gpu, routed=True)  # not measured
    assert not qm.use_kernel(experts, 10, Kernels(platform="cpu"), routed=True)
    assert not qm.use_kernel((qm.dense_part(Q.TQ2_0, 8, 256),), 1, on)  # no kernel decoder for TQ types


def test_kernels_from_environment(monkeypatch):
    """The kernel switches come from the environment once, when the engine config is built, and the
    device platform is filled in when it is resolved; a bad value is a ConfigError naming the variable."""
    from strata_jax.core.errors import ConfigError
    from strata_jax.engine.config import EngineConfig

    monkeypatch.setenv("STRATA_JAX_QMATVEC", "1")
    monkeypatch.setenv("STRATA_JAX_MOE_PREFILL", "grouped")
    assert EngineConfig.create().resolved("cpu").kernels == Kernels(qmatvec="on", moe_prefill="grouped", platform="cpu")
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "0")
    monkeypatch.delenv("STRATA_JAX_MOE_PREFILL")
    assert EngineConfig.create().resolved("gpu").kernels == Kernels(qmatvec="off", moe_prefill="dense", platform="gpu")
    monkeypatch.delenv("STRATA_JAX_QMATVEC")
    assert EngineConfig.create().kernels.qmatvec == "auto"
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "yes")
    with pytest.raises(ConfigError, match="STRATA_JAX_QMATVEC='yes'"):
        EngineConfig.create()
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "1")
    monkeypatch.setenv("STRATA_JAX_MOE_PREFILL", "sparse")
    with pytest.raises(ConfigError, match="STRATA_JAX_MOE_PREFILL='sparse'.*dense.*grouped"):
        EngineConfig.create()


SPEC = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                     n_experts=8, n_experts_used=2, expert_ffn_dim=256, vocab_size=512, qtype="Q4_K",
                     odd_down_qtype="Q6_K", seed=5)


@pytest.fixture(scope="module")
def kmoe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("qmatvec") / "moe.gguf", SPEC)


def _decode_run(path, flag, **kw):
    """Greedy tokens and the first decode step's logits with STRATA_JAX_QMATVEC=flag (read at trace time,
    so compiled programs are dropped first)."""
    old = os.environ.get("STRATA_JAX_QMATVEC")
    os.environ["STRATA_JAX_QMATVEC"] = flag
    jax.clear_caches()
    try:
        m = strata_jax.load(path, ctx=64, dequantize_dense=False, **kw)
        ids = list(range(5, 20))
        gen = m.generate(ids, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5)
        return gen.token_ids, [lp.logprob for lp in gen.logprobs], m.stats()
    finally:
        if old is None:
            os.environ.pop("STRATA_JAX_QMATVEC", None)
        else:
            os.environ["STRATA_JAX_QMATVEC"] = old
        jax.clear_caches()


def test_model_decodes_the_same_through_the_kernel(kmoe_path):
    """Every decode matmul (attention projections, routed experts from their slots, the LM head) through
    the kernel gives the tokens and log-probabilities of dequantize + matmul, resident and offloaded."""
    ref_tokens, ref_lp, _ = _decode_run(kmoe_path, "0")
    for kw in ({}, {"expert_slots": 6}):
        tokens, lp, st = _decode_run(kmoe_path, "1", **kw)
        assert tokens == ref_tokens
        np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
        if kw:
            assert st["misses"] > 0


def test_kernel_is_in_the_decode_step(kmoe_path, monkeypatch):
    """The kernel really serves the decode step (not a silent fallback): count its traced calls."""
    calls = []
    real = qm.stacked_matvec
    monkeypatch.setattr(qm, "stacked_matvec", lambda *a, **k: calls.append(k["parts"]) or real(*a, **k))
    _decode_run(kmoe_path, "1")
    kinds = {(p[0].qtype, p[0].n_rows, len(p)) for p in calls}
    assert (Q.Q4_K, 256, 2) in kinds  # routed experts: gate + up in one call
    assert (Q.Q6_K, 256, 1) in kinds  # an odd layer's down projection
    assert (Q.Q4_K, 512, 1) in kinds  # the LM head (vocab 512)


# routed experts IQ3_S, the odd layer's down projections IQ1_M (as tests/test_quant.py's IQ model)
IQ_SPEC = dataclasses.replace(SPEC, qtype="Q8_0", expert_qtype="IQ3_S", odd_down_qtype="IQ1_M", seed=11)


@pytest.mark.slow  # three whole-model decodes, two of them in Pallas' interpreter (~2 min on CPU)
def test_iq_experts_decode_through_the_kernel(tmp_path, monkeypatch):
    """IQ3_S / IQ1_M experts read from their slots by the kernel (resident and offloaded) decode the
    tokens and log-probabilities of the same model whose experts are gguf-py's F32 dequantization of the
    same blocks, decoded by dequantize + matmul."""
    iq_path = write_synthetic_gguf(tmp_path / "iq.gguf", IQ_SPEC)
    ref_path = write_synthetic_gguf(tmp_path / "f32.gguf", dataclasses.replace(IQ_SPEC, dequantize_experts=True))
    ref_tokens, ref_lp, _ = _decode_run(ref_path, "0")
    calls = []
    real = qm.stacked_matvec
    monkeypatch.setattr(qm, "stacked_matvec", lambda *a, **k: calls.append(k["parts"]) or real(*a, **k))
    for kw in ({}, {"expert_slots": 6}):
        tokens, lp, st = _decode_run(iq_path, "1", **kw)
        assert tokens == ref_tokens
        np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
        if kw:
            assert st["misses"] > 0
    kinds = {(p[0].qtype, p[0].n_rows, len(p)) for p in calls}
    assert (Q.IQ3_S, 256, 2) in kinds  # gate + up in one call
    assert (Q.IQ3_S, 256, 1) in kinds and (Q.IQ1_M, 256, 1) in kinds  # the down projections


def test_scanned_float_matrices_read_in_their_stack(monkeypatch, tmp_path):
    """STRATA_JAX_FLOAT_STACK=kernel: a scanned layer's float matrices (qtiny with qseed's F16 hyper-connection
    up matrices: a rank of 48 that Q8_0's 32-value blocks do not tile, as qseed's 320 and Q4_K) go through
    the kernel, read in their stack by slot (no slice of the stack), and greedy decode gives the tokens and
    log-probabilities of the default copy."""
    from strata_jax.bench.shapes import SHAPES

    path = write_synthetic_gguf(tmp_path / "qtiny-f16.gguf", dataclasses.replace(SHAPES["qtiny"], hc_rank=48))
    calls = []
    real = qm.stacked_matvec

    def counted(*a, **k):
        calls.append(k["parts"][0].qtype)
        return real(*a, **k)

    def run(flag):
        monkeypatch.setenv("STRATA_JAX_FLOAT_STACK", flag)
        jax.clear_caches()
        m = strata_jax.load(path, ctx=64, dequantize_dense=False)
        gen = m.generate(list(range(5, 17)), max_tokens=5, temperature=0, logprobs=True)
        return gen.token_ids, [lp.logprob for lp in gen.logprobs]

    ref_tokens, ref_lp = run("copy")
    monkeypatch.setattr(qm, "stacked_matvec", counted)
    tokens, lp = run("kernel")
    jax.clear_caches()
    assert Q.F16 in calls
    assert tokens == ref_tokens
    np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
    monkeypatch.setenv("STRATA_JAX_FLOAT_STACK", "views")
    from strata_jax.core.errors import ConfigError
    from strata_jax.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="STRATA_JAX_FLOAT_STACK='views'"):
        EngineConfig.create()


@pytest.mark.parametrize("qtype,n_cols,splits", [(Q.Q4_K, 1024, 2), (Q.Q4_K, 1024, 4), (Q.IQ3_S, 768, 3),
                                                 (Q.Q8_0, 512, 2)])
def test_split_k_sums_the_same_products(qtype, n_cols, splits):
    """Split-K: each (pair, rows) tile over shares of the row's units, the partial sums added after the call
    (and, with swiglu, activated there), gives the products of gguf-py's dequantized weights; a negative
    slot still gives zeros."""
    rng = np.random.default_rng(splits * 100 + n_cols)
    F, S = 40, 3
    g, u, rows, parts = _gate_up_rows(rng, qtype, qtype, S, F, n_cols)
    x = rng.standard_normal((4, 1, n_cols)).astype(np.float32)
    slots = np.array([2, 0, -1, 1], np.int32)
    run = lambda **kw: np.asarray(qm.stacked_matvec(jnp.asarray(x), jnp.asarray(rows), jnp.asarray(slots),  # noqa: E731
                                                    block_rows=16, interpret=True, **kw))
    y = run(parts=parts[:1], splits=splits)
    ref = _reference(x, g, np.maximum(slots, 0), qtype, n_cols)
    ref[2] = 0
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    h = run(parts=parts, swiglu=True, splits=splits, out_dtype=jnp.bfloat16)
    gx, ux = ref, _reference(x, u, np.maximum(slots, 0), qtype, n_cols)
    ux[2] = 0
    want = gx / (1 + np.exp(-gx)) * ux
    assert h.dtype == jnp.bfloat16
    np.testing.assert_allclose(h.astype(np.float32), want, rtol=0, atol=1e-2 * np.abs(want).max())
    np.testing.assert_allclose(h.astype(np.float32), run(parts=parts, swiglu=True, out_dtype=jnp.bfloat16
                                                          ).astype(np.float32), rtol=0, atol=1e-2 * np.abs(want).max())


def test_split_k_is_chosen_for_calls_of_few_tiles():
    """Kernels.qmatvec_split "auto" splits qseed's routed gate+up (10 pairs x 32 tiles) and its [3072, 4096]
    output projections (192 tiles: under MIN_PROGRAMS unsplit, so on the kernel only when split), not the LM
    head; "off" (the default) never."""
    auto, off = Kernels(platform="gpu", qmatvec_split="auto"), Kernels(platform="gpu")
    gate, out = qm.dense_part(Q.IQ3_S, 512, 3072), qm.dense_part(Q.Q4_K, 3072, 4096)
    head = qm.dense_part(Q.Q4_K, 248320, 3072)
    assert qm.block_config(gate, 10, auto)["splits"] == 4  # 320 tiles, 12 units a row -> 3 each
    assert qm.block_config(out, 1, auto)["splits"] == 8  # 192 tiles, 16 units -> 2 each
    assert qm.block_config(head, 1, auto)["splits"] == 1
    assert all(qm.block_config(p, 10, off)["splits"] == 1 for p in (gate, out, head))
    assert qm.use_kernel((out,), 1, auto) and not qm.use_kernel((out,), 1, off)


def test_model_decodes_the_same_tokens_split(monkeypatch, tmp_path):
    """qtiny (IQ3_S experts, Q8_0 dense) on the kernel everywhere (STRATA_JAX_QMATVEC=1), split-K on
    (STRATA_JAX_QMATVEC_SPLIT=1): the tokens and log-probabilities of the unsplit run."""
    from strata_jax.bench.shapes import SHAPES

    # d_model 1024: the experts' gate/up rows are 4 IQ3_S units long, enough to split (MIN_SPLIT_UNITS)
    path = write_synthetic_gguf(tmp_path / "qtiny.gguf", dataclasses.replace(SHAPES["qtiny"], d_model=1024))
    monkeypatch.setenv("STRATA_JAX_QMATVEC", "1")
    splits, real = [], qm.stacked_matvec
    monkeypatch.setattr(qm, "stacked_matvec", lambda *a, **k: splits.append(k.get("splits", 1)) or real(*a, **k))
    outs = []
    for split in ("0", "1"):
        monkeypatch.setenv("STRATA_JAX_QMATVEC_SPLIT", split)
        jax.clear_caches()
        m = strata_jax.load(path, ctx=64, dequantize_dense=False)
        assert m.kernels.qmatvec_split == ("auto" if split == "1" else "off")
        outs.append(m.generate(list(range(5, 17)), max_tokens=5, temperature=0, logprobs=True))
    jax.clear_caches()
    assert max(splits) > 1
    assert outs[0].token_ids == outs[1].token_ids
    np.testing.assert_allclose([e.logprob for e in outs[0].logprobs], [e.logprob for e in outs[1].logprobs],
                               atol=1e-4)
