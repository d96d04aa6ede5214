"""strata_jax/model/layers/ple.py against transformers' qwen4_exp PLE (torch fp32): exact n-gram row indices at
the real model's hash scale, the layer's output on random weights mapped to the GGUF layout the way
llama.cpp's converter maps them, chunked / decode / padding properties, and both table placements."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from transformers import DynamicCache
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

from strata_jax.core.qtensor import QTensor
from strata_jax.model.layers import ple
from strata_jax.model.dims import PLEDims
from strata_jax.model.kernels import Kernels

KERNELS = Kernels()
EOS = 7
B, T = 3, 24  # rows and tokens of every layer test (one compiled shape per chunk width)


def _config(**kw) -> Qwen4ExpTextConfig:
    base = dict(vocab_size=300, hidden_size=32, hc_count=2, num_hidden_layers=2,
                layer_types=["linear_attention", "linear_attention"], ple_layer_ids=[1], ple_embed_dim=32,
                ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000, ple_conv_kernel_size=4,
                eos_token_id=EOS, rms_norm_eps=1e-6)
    return Qwen4ExpTextConfig(**{**base, **kw})


def _tokens(rng, B: int, T: int, vocab: int, eos: int, p_eos: float = 0.15) -> np.ndarray:
    """Random ids with EOS runs, a leading EOS, and the extreme ids 0 and vocab - 1."""
    t = rng.integers(0, vocab, size=(B, T))
    t[rng.random((B, T)) < p_eos] = eos
    t[0, 0] = eos
    t[0, 3:5] = eos
    t[-1, 1], t[-1, 2] = vocab - 1, 0
    return t.astype(np.int64)


def _chunks(T: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sizes:
        if at >= T:
            break
        out.append((at, min(at + s, T)))
        at += s
    if at < T:
        out.append((at, T))
    return out


# -- the hash -----------------------------------------------------------------------------------------


def _dims_of(emb: hf.Qwen4ExpTextNGramEmbedding, cfg, d_model=32, hc=2, row_dim=8) -> PLEDims:
    """The hash constants as the converter writes them (conversion/qwen4exp.py set_gguf_parameters:
    the module's int64 buffers, read exactly, and the EOS id)."""
    return PLEDims(d_model=d_model, hc_count=hc, row_dim=row_dim, ngram_size=cfg.ngram_size,
                       heads_per_ngram=cfg.heads_per_ngram, conv_kernel=cfg.ple_conv_kernel_size,
                       eos_token_id=cfg.eos_token_id,
                       layer_multipliers=tuple(int(v) for v in emb.layer_multipliers.tolist()),
                       head_offsets=tuple(int(v) for v in emb.ngram_heads_offsets.tolist()),
                       head_vocab_sizes=tuple(int(v) for v in emb.ngram_heads_vocab_sizes.tolist()),
                       rms_eps=cfg.rms_norm_eps)


class _RowIds(torch.nn.Module):
    """Stands in for the (here enormous) ngram_embedding: returns the row indices it is asked for."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, ids):
        return ids[..., None]


def _hash_module(cfg, ple_layer_index: int) -> hf.Qwen4ExpTextNGramEmbedding:
    with torch.device("meta"):  # the real-scale table would be tens of GB
        emb = hf.Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 0, ple_layer_index)
    emb.layer_multipliers = hf._build_layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_layer_index, cfg.seed)
    emb.ngram_heads_vocab_sizes = torch.tensor(emb.head_vocab_sizes, dtype=torch.long)
    emb.ngram_heads_offsets = torch.tensor(emb.head_offsets, dtype=torch.long)
    emb.ngram_embedding = _RowIds()
    return emb


@pytest.mark.parametrize("ngram_size,ple_layer_index", [(3, 0), (4, 1)])
def test_rows_exact_vs_transformers_real_scale(ngram_size, ple_layer_index):
    """The real model's hash scale (vocab 248320: ~45-bit multipliers, products up to 2**63; ~20M-row
    prime heads): every row index equals transformers', over chunks (its cache carries the context)."""
    vocab, eos = 248320, 248044
    cfg = _config(vocab_size=vocab, hidden_size=2048, ngram_size=ngram_size, heads_per_ngram=8,
                  ple_embed_dim=2048 if ngram_size == 3 else 2064, ngram_vocab_size_base=20_000_000,
                  eos_token_id=eos)
    emb = _hash_module(cfg, ple_layer_index)
    dims = _dims_of(emb, cfg, row_dim=cfg.ple_embed_dim // ((ngram_size - 1) * 8))
    assert max(dims.layer_multipliers) > 1 << 44 and min(dims.head_vocab_sizes) > 20_000_000

    rng = np.random.default_rng(ngram_size)
    tokens = _tokens(rng, B, 48, vocab, eos)
    cache = DynamicCache(config=cfg)
    ctx = jnp.zeros((B, ngram_size - 1), jnp.int32)
    rows_fn = jax.jit(functools.partial(ple.ngram_rows, dims=dims))
    W = 16  # every chunk padded to one width (garbage past the chunk), as the engine's buckets
    for a, b in _chunks(48, [1, 2, 9, 1, 1, 16, 5]):
        with torch.no_grad():
            want = emb(torch.from_numpy(tokens[:, a:b]), cache).numpy()
        chunk = jnp.asarray(np.concatenate([tokens[:, a:b], rng.integers(0, vocab, (B, W - (b - a)))], 1), jnp.int32)
        got = np.asarray(rows_fn(chunk, ctx))[:, : b - a]
        np.testing.assert_array_equal(got, want, err_msg=f"tokens {a}:{b}")
        ctx = ple.next_ctx(chunk, ctx, jnp.full((B,), b - a, jnp.int32))


def test_mul_mod_exact_vs_python_ints():
    """The limb arithmetic against Python's big ints: any 32-bit t, 64-bit m, p up to 2**31 - 1."""
    rng = np.random.default_rng(0)
    t = rng.integers(0, 1 << 32, size=512, dtype=np.uint64)
    t[:3] = [0, 1, (1 << 32) - 1]
    for m in [1, (1 << 64) - 1, 0x9E3779B97F4A7C15, int(rng.integers(1, 1 << 62)), 14383222055071283]:
        for p in [2, 3, 1009, 20_000_003, (1 << 31) - 1]:
            hi, lo = ple._mul64(jnp.asarray(t, jnp.uint32), m)
            r = np.asarray(ple._mod64(hi, lo, jnp.uint32(p), p)).astype(np.int64)
            want = np.array([(int(v) * m % (1 << 64)) % p for v in t], np.int64)
            np.testing.assert_array_equal(r, want, err_msg=f"m={m} p={p}")


# -- the layer ----------------------------------------------------------------------------------------


def _hf_layer(cfg, seed: int = 0) -> hf.Qwen4ExpTextPLELayer:
    torch.manual_seed(seed)
    layer = hf.Qwen4ExpTextPLELayer(cfg, 0, 0)
    E, C = cfg.ple_embed_dim, cfg.hidden_size * cfg.hc_count
    with torch.no_grad():
        layer.ple_embedding.ngram_embedding.weight.normal_(0.0, 0.5)
        layer.key_proj.weight.normal_(0.0, E ** -0.5)
        layer.value_proj.weight.normal_(0.0, E ** -0.5)
        for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
            norm.weight.normal_(0.0, 0.1)  # zero-centred gammas, as trained
        layer.conv1d.weight.normal_(0.0, 0.4)
    assert layer.conv1d.weight.shape == (C, 1, cfg.ple_conv_kernel_size)
    return layer.eval()


def gguf_tensors(layer: hf.Qwen4ExpTextPLELayer, bid: int = 0) -> dict[str, np.ndarray]:
    """The layer's tensors as llama.cpp's converter writes them (conversion/qwen4exp.py,
    Qwen4ExpTextModel.modify_tensors): norm_key / norm_query / norm_conv get +1 (zero-centred gammas),
    conv1d is squeezed to [Cc, Kc], key / value projections pass through as [out, in]; the n-gram
    table becomes the global per_layer_token_embd (_place_ple_shard: the shards in row order)."""
    p = f"blk.{bid}."
    sd = {k: v.detach().float().numpy() for k, v in layer.state_dict().items()}
    return {
        p + "ple_key.weight": sd["key_proj.weight"],
        p + "ple_value.weight": sd["value_proj.weight"],
        p + "ple_norm_key.weight": sd["norm_key.weight"] + 1,
        p + "ple_norm_query.weight": sd["norm_query.weight"] + 1,
        p + "ple_norm_conv.weight": sd["norm_conv.weight"] + 1,
        p + "ple_conv1d.weight": sd["conv1d.weight"].squeeze(),
        "per_layer_token_embd.weight": sd["ple_embedding.ngram_embedding.weight"],
    }


@functools.lru_cache(maxsize=None)
def _setup(memory_kind: str = "device"):
    cfg = _config()
    layer = _hf_layer(cfg)
    dims = _dims_of(layer.ple_embedding, cfg)
    params = ple.PLEParams.from_gguf(gguf_tensors(layer).__getitem__, 0, dims, table_memory_kind=memory_kind)
    step = jax.jit(functools.partial(ple.apply, dims=dims, kernels=KERNELS))
    return cfg, layer, dims, params, step


def _pad(a: np.ndarray, width: int, rng) -> np.ndarray:
    """a [B, t, ...] padded to [B, width, ...] with garbage (ids with EOS among them, or noise)."""
    fill = (rng.integers(0, 300, (a.shape[0], width - a.shape[1])) if a.dtype.kind == "i" else
            rng.standard_normal((a.shape[0], width - a.shape[1], *a.shape[2:])).astype(a.dtype))
    if a.dtype.kind == "i":
        fill[:, ::2] = EOS
    return np.concatenate([a, fill.astype(a.dtype)], axis=1)


def _run(params, step, dims, x, tokens, sizes, width=None, state=None):
    """Our layer over chunks of the given sizes, each padded to `width` (the engine's buckets) or run
    at its own width: the valid outputs concatenated, and the final state."""
    B, T = tokens.shape
    state = ple.PLEState.zeros(B, dims) if state is None else state
    rng = np.random.default_rng(99)
    outs = []
    for a, b in _chunks(T, sizes):
        w = width or b - a
        y, state = step(params, jnp.asarray(_pad(x[:, a:b], w, rng)), jnp.asarray(_pad(tokens[:, a:b], w, rng)),
                        state, n_valid_B=jnp.full((B,), b - a, jnp.int32))
        outs.append(np.asarray(y)[:, : b - a])
    return np.concatenate(outs, axis=1), state


def _inputs(seed: int, cfg):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, cfg.hc_count * cfg.hidden_size)).astype(np.float32)
    return x, _tokens(rng, B, T, cfg.vocab_size, EOS)


def _hf_run(layer, cfg, x, tokens, sizes) -> np.ndarray:
    cache = DynamicCache(config=cfg)
    want = []
    with torch.no_grad():
        for a, b in _chunks(tokens.shape[1], sizes):
            want.append(layer(torch.from_numpy(x[:, a:b]), torch.from_numpy(tokens[:, a:b]), cache).numpy())
    return np.concatenate(want, axis=1)


def test_layer_matches_transformers_one_pass_and_chunked():
    """One pass, and uneven chunks (decode steps among them) padded to one bucket width, against
    transformers' layer fed the same chunks through its cache."""
    cfg, layer, dims, params, step = _setup()
    x, tokens = _inputs(1, cfg)
    for sizes, width in (([T], None), ([1, 1, 5, 2, 1, 8, 3, 3], 8)):
        want = _hf_run(layer, cfg, x, tokens, sizes)
        got, _ = _run(params, step, dims, x, tokens, sizes, width)
        assert np.abs(want).max() > 0.5  # the gate and the conv both contribute at this scale
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"chunks {sizes}")


def test_decode_chunks_and_stream_layout_equal_one_pass():
    """T == 1 steps, padded uneven chunks and one pass agree (outputs and final state); an input laid
    out [B, T, Hc, D] gives the same answer in its own shape."""
    cfg, layer, dims, params, step = _setup()
    x, tokens = _inputs(2, cfg)
    one, s_one = _run(params, step, dims, x, tokens, [T])
    for sizes, width in (([1] * T, None), ([3, 1, 7, 8, 5], 8)):
        got, s = _run(params, step, dims, x, tokens, sizes, width)
        np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(s.ctx_BKc), np.asarray(s_one.ctx_BKc))
        np.testing.assert_allclose(np.asarray(s.conv_BKcCc), np.asarray(s_one.conv_BKcCc), rtol=1e-5, atol=1e-6)
    x4 = x.reshape(B, T, cfg.hc_count, cfg.hidden_size)
    y4, _ = step(params, jnp.asarray(x4), jnp.asarray(tokens, jnp.int32), ple.PLEState.zeros(B, dims),
                 n_valid_B=jnp.full((B,), T, jnp.int32))
    assert y4.shape == x4.shape
    np.testing.assert_allclose(np.asarray(y4).reshape(B, T, -1), one, rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_state():
    """Rows of one call with different n_valid (0 included) end in the state of their valid tokens
    alone, and their next chunk continues as if the padding had never been there."""
    cfg, layer, dims, params, step = _setup()
    x, tokens = _inputs(3, cfg)
    W, n_valid = 8, [8, 5, 0]
    rng = np.random.default_rng(7)
    y1, s = step(params, jnp.asarray(x[:, :W]), jnp.asarray(tokens[:, :W]), ple.PLEState.zeros(B, dims),
                 n_valid_B=jnp.asarray(n_valid, jnp.int32))
    # the row with no valid token is still fresh
    assert not np.asarray(s.ctx_BKc)[2].any() and not np.asarray(s.conv_BKcCc)[2].any()
    # each row's next tokens start at its own n_valid; padding (garbage) again past 5 of them
    x2 = np.stack([x[b, n:n + 5] for b, n in enumerate(n_valid)])
    t2 = np.stack([tokens[b, n:n + 5] for b, n in enumerate(n_valid)])
    y2, s2 = step(params, jnp.asarray(_pad(x2, W, rng)), jnp.asarray(_pad(t2, W, rng)), s,
                  n_valid_B=jnp.full((B,), 5, jnp.int32))
    for b, n in enumerate(n_valid):
        xb = np.repeat(x[b:b + 1, :n + 5], B, 0)  # the row alone (repeated to keep the compiled shape)
        tb = np.repeat(tokens[b:b + 1, :n + 5], B, 0)
        alone, s_alone = _run(params, step, dims, xb, tb, [n, 5] if n else [5], W)
        np.testing.assert_allclose(np.asarray(y1)[b, :n], alone[0, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(y2)[b, :5], alone[0, n:], rtol=1e-5, atol=1e-6, err_msg=f"row {b}")
        np.testing.assert_array_equal(np.asarray(s2.ctx_BKc)[b], np.asarray(s_alone.ctx_BKc)[0])
        np.testing.assert_allclose(np.asarray(s2.conv_BKcCc)[b], np.asarray(s_alone.conv_BKcCc)[0],
                                   rtol=1e-5, atol=1e-6)


def test_host_table_matches_device_table():
    """The table in pinned_host memory (rows gathered on the host, only they cross over) gives the
    same bits as the resident table."""
    cfg, _, dims, p_dev, step = _setup("device")
    _, _, _, p_host, _ = _setup("pinned_host")
    assert p_host.table.rows.data.sharding.memory_kind == "pinned_host"
    assert p_dev.table.rows.data.sharding.memory_kind == "device"
    x, tokens = _inputs(4, cfg)
    sizes = [1, 1, 6, 8, 8]
    a, sa = _run(p_dev, step, dims, x, tokens, sizes, 8)
    b, sb = _run(p_host, step, dims, x, tokens, sizes, 8)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(sa.conv_BKcCc), np.asarray(sb.conv_BKcCc))


@pytest.mark.parametrize("memory_kind,n_rows,kernel", [("device", 40, False), ("pinned_host", 40, False),
                                                        ("pinned_host", 40, True),
                                                        ("pinned_host", ple.DMA_ROWS_MAX + 1, False)])
def test_quantized_table_rows(memory_kind, n_rows, kernel):
    """A Q8_0 table: the gathered rows equal gguf-py's dequantization of those rows, in both places, and a
    host table in each of its gathers (a decode step's rows by DMA or by the host-rows kernel, a prefill
    chunk's by host compute)."""
    from strata_jax.core import hostrows

    if kernel and not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the host-rows kernel: {hostrows.why_not(jax.devices()[0])}")
    rng = np.random.default_rng(5)
    table = rng.standard_normal((300, 64)).astype(np.float32)
    q = gguf_quantize(table, GGMLQuantizationType.Q8_0)
    t = ple.place_table(QTensor(q, GGMLQuantizationType.Q8_0, 64), memory_kind, kernel=kernel)
    assert (t.addr is not None) == kernel
    idx = rng.integers(0, 300, size=n_rows).astype(np.int32)
    compiled = jax.jit(ple.gather_rows).lower(t, jnp.asarray(idx)).compile()
    # the program reads the table where it was placed (a host table is not copied over whole); the kernel
    # reads it by its address, so the table is not even an operand
    took = compiled.input_shardings[0][0].rows.data
    assert took is None if kernel else took.memory_kind == memory_kind
    got = compiled(t, jnp.asarray(idx))
    np.testing.assert_array_equal(np.asarray(got), gguf_dequantize(q[idx], GGMLQuantizationType.Q8_0))


def test_bad_dims_and_tensors_refused():
    cfg, layer, dims, _, _ = _setup()
    with pytest.raises(ValueError, match="multipliers"):
        PLEDims(**{**dims.__dict__, "layer_multipliers": dims.layer_multipliers[:2]})
    with pytest.raises(ValueError, match="int32 row index"):
        PLEDims(**{**dims.__dict__, "head_offsets": (0, 1 << 30, 3 << 29, (1 << 31) - 1000)})
    tensors = gguf_tensors(layer)
    tensors["blk.0.ple_value.weight"] = tensors["blk.0.ple_value.weight"][:, :16]
    with pytest.raises(ValueError, match="ple_value"):
        ple.PLEParams.from_gguf(tensors.__getitem__, 0, dims)
    with pytest.raises(ValueError, match="memory_kind"):
        ple.place_table(QTensor(np.zeros((4, 8), np.float32), None, 8), "hbm")


# -- the GGUF keys and names, written by the converter's own gguf-py --------------------------------


_WRITER = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import gguf
spec = json.load(open(sys.argv[2]))
arrays = np.load(sys.argv[3])
w = gguf.GGUFWriter(sys.argv[4], gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN4EXP])
w.add_embedding_length(spec["d_model"])
w.add_layer_norm_rms_eps(spec["rms_eps"])
w.add_hyper_connection_count(spec["hc_count"])
# the calls of conversion/qwen4exp.py set_gguf_parameters
w.add_ple_layers(spec["layers"])
w.add_ple_ngram_size(spec["ngram_size"])
w.add_ple_heads_per_ngram(spec["heads_per_ngram"])
w.add_ple_conv_kernel(spec["conv_kernel"])
w.add_ple_eos_token_id(spec["eos"])
w.add_embedding_length_per_layer_input(spec["row_dim"])
w.add_ple_layer_multipliers(spec["multipliers"])
w.add_ple_head_offsets(spec["offsets"])
w.add_ple_head_vocab_sizes(spec["vocab_sizes"])
names = {"ple_key": gguf.MODEL_TENSOR.PLE_KEY, "ple_value": gguf.MODEL_TENSOR.PLE_VALUE,
         "ple_norm_key": gguf.MODEL_TENSOR.PLE_NORM_KEY, "ple_norm_query": gguf.MODEL_TENSOR.PLE_NORM_QUERY,
         "ple_norm_conv": gguf.MODEL_TENSOR.PLE_NORM_CONV, "ple_conv1d": gguf.MODEL_TENSOR.PLE_CONV1D}
for key in arrays.files:
    if key == "table":
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.PER_LAYER_TOKEN_EMBD] + ".weight"
    else:
        name = gguf.TENSOR_NAMES[names[key]].format(bid=spec["layers"][0]) + ".weight"
    w.add_tensor(name, arrays[key])
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
"""


@pytest.mark.slow
def test_dims_and_params_from_converter_gguf(tmp_path, llama_cpp_converter):
    """A GGUF written with the converter's gguf-py and its set_gguf_parameters calls (u64 hash arrays,
    tensor names from its constants): PLEDims and PLEParams read back the exact constants and tensors,
    and the layer computes what it computes from the in-memory mapping."""
    from strata_jax.gguf.reader import GGUFFile, metadata_view
    from strata_jax.model.weights import WeightLoader

    cfg, layer, dims, params, step = _setup()
    bid = 1
    t = gguf_tensors(layer, 0)
    arrays = {k.removeprefix("blk.0.").removesuffix(".weight"): v for k, v in t.items()}
    arrays["table"] = arrays.pop("per_layer_token_embd")
    spec = dict(d_model=dims.d_model, rms_eps=dims.rms_eps, hc_count=dims.hc_count, layers=[bid],
                ngram_size=dims.ngram_size, heads_per_ngram=dims.heads_per_ngram, conv_kernel=dims.conv_kernel,
                eos=dims.eos_token_id, row_dim=dims.row_dim, multipliers=list(dims.layer_multipliers),
                offsets=list(dims.head_offsets), vocab_sizes=list(dims.head_vocab_sizes))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    np.savez(tmp_path / "arrays.npz", **arrays)
    out = tmp_path / "ple.gguf"
    subprocess.run([sys.executable, "-c", _WRITER, str(llama_cpp_converter.parent / "gguf-py"),
                    str(tmp_path / "spec.json"), str(tmp_path / "arrays.npz"), str(out)], check=True)

    f = GGUFFile(out)
    got = PLEDims.from_metadata(metadata_view(f.metadata, f.architecture))
    assert got.rms_eps == pytest.approx(dims.rms_eps)  # a float32 KV
    assert got == PLEDims(**{**dims.__dict__, "layers": (bid,), "rms_eps": got.rms_eps})
    loader = WeightLoader(f, SimpleNamespace(arch=f.architecture))
    from_file = ple.PLEParams.from_gguf(ple.loader_get(loader), bid, got, table_memory_kind="pinned_host")
    assert from_file.ple_key.qtype == GGMLQuantizationType.F32  # the file's bytes, dequantized in jit
    rng = np.random.default_rng(6)
    x, tokens = _inputs(6, cfg)
    np.testing.assert_array_equal(_run(from_file, step, dims, x, tokens, [8] * 3, 8)[0],
                                  _run(params, step, dims, x, tokens, [8] * 3, 8)[0])


def test_rewind_to_every_prefix_equals_running_only_it():
    """ple.rewind stops a pass's state after any prefix of its tokens from the state before it and the conv
    inputs it taped (no weights): equal to running only that prefix (n-gram context and conv window)."""
    cfg, _, dims, params, step = _setup()
    x, tokens = _inputs(11, cfg)
    _, before = _run(params, step, dims, x[:, :17], tokens[:, :17], [17])
    xs, ts = jnp.asarray(x[:, 17:]), jnp.asarray(tokens[:, 17:])
    P = T - 17
    _, after, conv_in = ple.apply(params, xs, ts, before, n_valid_B=jnp.full((B,), P, jnp.int32), dims=dims,
                                  kernels=KERNELS, tape=True)
    for n in range(P + 1):
        n_B = jnp.asarray([n, P - n, min(n + 1, P)], jnp.int32)
        want = step(params, xs, ts, before, n_valid_B=n_B)[1]
        got = ple.rewind(before, conv_in, ts, n_B, dims)
        np.testing.assert_array_equal(np.asarray(got.ctx_BKc), np.asarray(want.ctx_BKc))
        np.testing.assert_allclose(np.asarray(got.conv_BKcCc), np.asarray(want.conv_BKcCc), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ple.rewind(before, conv_in, ts, jnp.full((B,), P), dims).conv_BKcCc),
                                  np.asarray(after.conv_BKcCc))
