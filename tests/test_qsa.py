"""qwen4exp QSA token indexer (strata_jax/model/layers/qsa.py) against transformers' Qwen4ExpTextQSAIndexer
(torch fp32, random weights), with the tensors mapped to the GGUF layout the way llama.cpp's converter
does: the selection mask, the attention output under it (a plain reference attention here), the dense
case, and that prefill, chunked prefill with bucket padding and decode agree."""

from __future__ import annotations

import functools
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers.models.qwen4_exp.modular_qwen4_exp import (Qwen4ExpTextConfig, Qwen4ExpTextQSAIndexer,
                                                             Qwen4ExpTextRotaryEmbedding)

from strata_jax.core.qtensor import QTensor
from strata_jax.gguf.reader import metadata_view
from strata_jax.model.layers import qsa
from strata_jax.model.kernels import Kernels
from strata_jax.model.dims import QSADims
from strata_jax.model.layers.qsa import QSAParams, QSAState

D, HI, DI, R, BUDGET = 64, 8, 32, 4, 12  # 3 blocks of 4 positions per query
HEAD_DIM, ROPE_FACTOR, THETA, EPS = 32, 0.5, 10000.0, 1e-6
B, S, CTX = 2, 45, 64  # S tokens per row (the last block incomplete) in a 64-position cache
KERNELS = Kernels()
LAYER = 3


def _config(budget: int = BUDGET) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(
        hidden_size=D, num_hidden_layers=LAYER + 1, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        vocab_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, rms_norm_eps=EPS, indexer_n_heads=HI, indexer_kv_heads=1, indexer_head_dim=DI,
        indexer_budget=budget, indexer_compress_ratio=R, layer_types=["linear_attention"] * LAYER + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": ROPE_FACTOR})


def _dims(budget: int = BUDGET) -> QSADims:
    return QSADims(n_heads=HI, head_dim=DI, budget=budget, compress_ratio=R, rope_dim=int(HEAD_DIM * ROPE_FACTOR),
                   rope_theta=THETA, rms_eps=EPS)


def _indexer(budget: int = BUDGET, seed: int = 0) -> Qwen4ExpTextQSAIndexer:
    idx = Qwen4ExpTextQSAIndexer(_config(budget), LAYER)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        idx.index_qk_proj.weight.copy_(torch.randn(idx.index_qk_proj.weight.shape, generator=g) / np.sqrt(D))
        # zero-centred gammas (HF applies 1 + w), far enough from 0 that a missing + 1 shows
        idx.q_layernorm.weight.copy_(0.3 * torch.randn(DI, generator=g))
        idx.k_layernorm.weight.copy_(0.3 * torch.randn(DI, generator=g))
    return idx


def gguf_tensors(idx: Qwen4ExpTextQSAIndexer, layer: int = LAYER) -> dict[str, np.ndarray]:
    """HF -> GGUF as llama.cpp's conversion/qwen4exp.py Qwen4ExpTextModel.modify_tensors does it:
    index_qk_proj splits at indexer_n_heads * indexer_head_dim rows into INDEXER_Q_PROJ / INDEXER_K_PROJ,
    q_layernorm / k_layernorm (INDEXER_Q_NORM / INDEXER_K_NORM in tensor_mapping.py) get + 1."""
    w = idx.index_qk_proj.weight.detach().numpy()
    p = f"blk.{layer}.indexer."
    return {p + "q_proj.weight": w[: HI * DI], p + "k_proj.weight": w[HI * DI:],
            p + "q_norm.weight": idx.q_layernorm.weight.detach().numpy() + 1,
            p + "k_norm.weight": idx.k_layernorm.weight.detach().numpy() + 1}


def getter(tensors: dict[str, np.ndarray], qtype=None):
    """get(name) as the loader gives it: matrices as QTensor (float, or quantized to qtype), vectors float32."""
    def get(name):
        a = tensors[name].astype(np.float32)
        if a.ndim == 1:
            return jnp.asarray(a)
        if qtype is None:
            return QTensor(jnp.asarray(a), None, a.shape[-1])
        return QTensor(jnp.asarray(quantize(a, qtype)), qtype, a.shape[-1])
    return get


def _params(idx, qtype=None) -> QSAParams:
    return QSAParams.from_gguf(getter(gguf_tensors(idx), qtype), LAYER, _dims(idx.token_budget), D)


def _hidden(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((B, S, D)).astype(np.float32)


def hf_mask(idx: Qwen4ExpTextQSAIndexer, x: np.ndarray) -> np.ndarray:
    """The HF indexer's selection over a whole causal prefill (no cache): bool [B, S, S]."""
    xt = torch.from_numpy(x)
    Bx, Sx, _ = x.shape
    pos = torch.arange(Sx)[None, None, :].expand(3, Bx, Sx)
    cos, sin = Qwen4ExpTextRotaryEmbedding(idx_config(idx))(xt, pos)
    causal = torch.tril(torch.ones(Sx, Sx, dtype=torch.bool))[None, None].expand(Bx, 1, Sx, Sx)
    with torch.no_grad():
        sel = idx(xt, (cos, sin), causal, None)
    return (sel & causal)[:, 0].numpy()


def idx_config(idx) -> Qwen4ExpTextConfig:
    return _config(idx.token_budget)


@functools.partial(jax.jit, static_argnames=("dims", "attn_len"))
def _apply(p, x, state, start_B, n_valid_B, dims, attn_len=None):
    return qsa.apply(p, x, state, start_B=start_B, n_valid_B=n_valid_B, dims=dims, kernels=KERNELS, attn_len=attn_len)


def prefill(p, x, dims, state=None):
    state = QSAState.zeros(B, CTX, dims) if state is None else state
    zeros = jnp.zeros((B,), jnp.int32)
    return _apply(p, jnp.asarray(x), state, zeros, zeros + x.shape[1], dims)


def attention(q, k, v, mask):
    """Plain softmax attention under a boolean mask [B, T, S], float64."""
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(mask[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v)


def _qkv(seed: int = 2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, S, 4, 16)) for _ in range(3))


@pytest.fixture(scope="module")
def ref():
    idx = _indexer()
    x = _hidden()
    return idx, x, hf_mask(idx, x)


def test_mask_matches_transformers(ref):
    idx, x, want = ref
    mask, _ = prefill(_params(idx), x, _dims())
    mask = np.asarray(mask)
    assert mask.shape == (B, S, CTX) and mask.dtype == bool
    assert not mask[:, :, S:].any()
    np.testing.assert_array_equal(mask[:, :, :S], want)
    # the budget binds: from 4 complete blocks on a query keeps 3 of them and its tail
    causal = np.tril(np.ones((S, S), bool))
    n_done = (np.arange(S) + 1) // R
    n_want = np.minimum(n_done, BUDGET // R) * R + (np.arange(S) + 1 - n_done * R)
    assert (want.sum(-1) == n_want).all()
    assert (want != causal).any(-1)[:, 4 * R:].all()
    # and the rows differ in what they keep
    assert len({m.tobytes() for m in want[:, -1]}) == B


def test_attention_under_the_mask_matches(ref):
    idx, x, want = ref
    mask, _ = prefill(_params(idx), x, _dims())
    q, k, v = _qkv()
    out = attention(q, k, v, np.asarray(mask)[:, :, :S])
    np.testing.assert_allclose(out, attention(q, k, v, want), rtol=0, atol=1e-12)
    dense = attention(q, k, v, np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S)))
    assert np.abs(out - dense).max() > 0.1  # the selection really changes the output


def test_dense_budget_is_plain_causal():
    budget = 48  # >= every sequence here: all complete blocks kept
    idx = _indexer(budget, seed=3)
    x = _hidden(4)
    want = hf_mask(idx, x)
    causal = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S))
    np.testing.assert_array_equal(want, causal)
    mask, _ = prefill(_params(idx), x, _dims(budget))
    np.testing.assert_array_equal(np.asarray(mask)[:, :, :S], causal)
    q, k, v = _qkv(5)
    np.testing.assert_allclose(attention(q, k, v, np.asarray(mask)[:, :, :S]), attention(q, k, v, causal), atol=1e-12)


def test_chunks_with_padding_and_decode_match_one_pass(ref):
    """Rows fed in different chunkings in one batch (bucket of 8, per-row n_valid, rows that already
    finished ride along with n_valid 0), then token by token with a shorter attention span, give the
    one-pass masks and state."""
    idx, x, want = ref
    dims = _dims()
    p = _params(idx)
    _, full = prefill(p, x, dims)
    chunks = [[5, 8, 1, 3, 8, 2], [8, 8, 7, 1, 4]]  # row 0: 27 tokens, row 1: 28, then decode both
    state = QSAState.zeros(B, CTX, dims)
    done = np.zeros(B, np.int32)
    for step in range(max(map(len, chunks))):
        n = np.array([c[step] if step < len(c) else 0 for c in chunks], np.int32)
        xs = np.zeros((B, 8, D), np.float32)
        for b in range(B):
            xs[b, : n[b]] = x[b, done[b]: done[b] + n[b]]
            xs[b, n[b]:] = 7.0  # padding: computed, must change nothing
        mask, state = _apply(p, jnp.asarray(xs), state, jnp.asarray(done), jnp.asarray(n), dims)
        mask = np.asarray(mask)
        for b in range(B):
            np.testing.assert_array_equal(mask[b, : n[b], :S], want[b, done[b]: done[b] + n[b]])
        done += n
    for t in range(done.min(), S):
        n = (done <= t).astype(np.int32)
        xs = x[np.arange(B), np.minimum(done, S - 1)][:, None]
        span = 32 if t < 32 else None
        mask, state = _apply(p, jnp.asarray(xs), state, jnp.asarray(done), jnp.asarray(n), dims, attn_len=span)
        mask = np.asarray(mask)
        assert mask.shape == (B, 1, span or CTX)
        for b in range(B):
            if n[b]:
                np.testing.assert_array_equal(mask[b, 0, :S][: mask.shape[-1]], want[b, done[b]][: mask.shape[-1]])
        done += n
    n_blocks = S // R
    np.testing.assert_allclose(state.blocks_BSbDi[:, :n_blocks], full.blocks_BSbDi[:, :n_blocks], rtol=0, atol=1e-5)
    np.testing.assert_allclose(state.tail_BRcDi, full.tail_BRcDi, rtol=0, atol=1e-5)
    assert not np.asarray(full.blocks_BSbDi[:, n_blocks:]).any()  # nothing past the last complete block


def test_padding_and_idle_rows_leave_the_state(ref):
    idx, x, _ = ref
    dims = _dims()
    p = _params(idx)
    thirteen = jnp.full((B,), 13, jnp.int32)
    _, state = _apply(p, jnp.asarray(x), QSAState.zeros(B, CTX, dims), thirteen * 0, thirteen, dims)
    leaves = jax.tree_util.tree_leaves(state)
    xs = jnp.asarray(x[:, 13:21])
    # no valid token; a row that is not live sits at the cache's end with one "valid" token
    for start, n_valid in ((13, 0), (CTX, 1)):
        mask, after = _apply(p, xs, state, jnp.full((B,), start, jnp.int32), jnp.full((B,), n_valid, jnp.int32), dims)
        for a, b in zip(jax.tree_util.tree_leaves(after), leaves):
            np.testing.assert_array_equal(a, b)
        pos = start + np.arange(8)
        np.testing.assert_array_equal(mask, np.broadcast_to(np.arange(CTX) <= pos[:, None], mask.shape))  # plain causal
    # three valid tokens in a bucket of 8 (completing block 3 on the way) leave what three decode steps leave
    _, padded = _apply(p, xs, state, thirteen, jnp.full((B,), 3, jnp.int32), dims)
    one = jnp.ones((B,), jnp.int32)
    for t in range(3):
        _, state = _apply(p, xs[:, t: t + 1], state, thirteen + t, one, dims)
    for a, b in zip(jax.tree_util.tree_leaves(padded), jax.tree_util.tree_leaves(state)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert np.abs(np.asarray(state.blocks_BSbDi[:, 3])).max() > 0.1  # the block that completed was written


def test_quantized_projections(ref):
    """Q8_0 projections (dequantized inside jit) select what their dequantized values select."""
    idx, x, _ = ref
    q8 = _params(idx, GGMLQuantizationType.Q8_0)
    assert q8.q_proj.qtype == GGMLQuantizationType.Q8_0
    deq = {k: (dequantize(quantize(v, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0) if v.ndim == 2 else v)
           for k, v in gguf_tensors(idx).items()}
    plain = QSAParams.from_gguf(getter(deq), LAYER, _dims(), D)
    (m8, s8), (m, s) = prefill(q8, x, _dims()), prefill(plain, x, _dims())
    np.testing.assert_array_equal(m8, m)
    np.testing.assert_allclose(s8.blocks_BSbDi, s.blocks_BSbDi, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_names_and_keys_are_the_converters(llama_cpp_converter):
    """The tensor names and KV keys the builders read are the pinned converter's gguf-py qwen4exp ones."""
    c = runpy.run_path(str(llama_cpp_converter.parent / "gguf-py" / "gguf" / "constants.py"))
    keys, arch = c["Keys"], c["MODEL_ARCH"].QWEN4EXP
    names = {c["TENSOR_NAMES"][t].format(bid=LAYER) for t in c["MODEL_TENSORS"][arch]}
    assert {n.removesuffix(".weight") for n in gguf_tensors(_indexer())} <= names
    a = c["MODEL_ARCH_NAMES"][arch]
    md = {keys.Attention.Indexer.HEAD_COUNT: HI, keys.Attention.Indexer.KEY_LENGTH: DI,
          keys.Attention.Indexer.TOP_K: BUDGET, keys.Attention.COMPRESS_RATIOS: [0] * LAYER + [R],
          keys.Rope.DIMENSION_COUNT: int(HEAD_DIM * ROPE_FACTOR), keys.Rope.FREQ_BASE: THETA,
          keys.Attention.LAYERNORM_RMS_EPS: EPS}
    md = {k.format(arch=a): v for k, v in md.items()}
    assert QSADims.from_metadata(metadata_view(md, a), LAYER) == _dims()


@pytest.mark.parametrize("start,T", [(9, 7), (12, 4), (30, 1)])
def test_rewind_to_every_prefix_equals_running_only_it(ref, start, T):
    """qsa.rewind stops a pass's state after any prefix of its tokens from the states before and after it
    and the keys it taped (no weights): the ring and the blocks equal running only that prefix, for passes
    that start inside a block, on a block boundary, and of one token."""
    idx, x, _ = ref
    p, dims = _params(idx), _dims()
    _, before = prefill(p, x[:, :start], dims)
    tok = jnp.asarray(x[:, start:start + T])
    start_B = jnp.full((B,), start, jnp.int32)
    _, after, k = qsa.apply(p, tok, before, start_B=start_B, n_valid_B=jnp.full((B,), T, jnp.int32), dims=dims,
                            kernels=KERNELS, tape=True)
    for n in range(T + 1):
        n_B = jnp.asarray([n, T - n], jnp.int32)  # two rows stopped at different tokens
        want = _apply(p, tok, before, start_B, n_B, dims)[1]
        got = qsa.rewind(before, after, k, start_B, n_B)
        # copies of the same keys (eager here, jitted there: rounding apart)
        np.testing.assert_allclose(np.asarray(got.tail_BRcDi), np.asarray(want.tail_BRcDi), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.blocks_BSbDi), np.asarray(want.blocks_BSbDi), rtol=0, atol=1e-5)
