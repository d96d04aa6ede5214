"""gpt-oss against transformers: a tiny random GptOssForCausalLM (attention sinks, alternating
sliding-window and full layers, q/k/v/o biases, a biased router with softmax over the top-k, experts
with biases and the clamped SwiGLU, YaRN rope) converted by llama.cpp's converter
(tests/reference_models.py, gpt-oss section).

From an unquantized checkpoint the converter writes the experts as the outtype (F32, Q8_0): it writes
MXFP4 only from an MXFP4 checkpoint's blocks. The MXFP4 model here is the converter's F32 file with
its expert matrices re-quantized to MXFP4 by gguf-py, checked against transformers holding the same
(dequantized) expert weights; tests/test_quant.py and tests/test_qmatvec.py check MXFP4's blocks."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from engine_checks import assert_offloaded_matches, resident_reference
from reference_models import gptoss_model, hf_greedy, hf_logits
from reference_models import load_weights as _load
from reference_models import rewrite_gguf
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model import runs

pytestmark = pytest.mark.slow  # converter-made models (~20 s on a cold cache)

N_TOKENS = 37  # in 16-token prefill chunks: 16 + 16 + 5 (a padded last chunk); > 4 windows of 8
REL_TOL = 1e-3  # f32: max |ours - transformers| over max |transformers|, at every position
OFF_TOL = 1e-2  # a feature switched off must move the logits at least this far from transformers'
CTX = 64
EXPERT_MATS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _ids(tm, n=N_TOKENS, seed=0):
    return np.random.default_rng(seed).integers(0, tm.vocab_size - 4, n).tolist()


def _engine(path, **kw):
    import strata_jax

    return strata_jax.load(str(path), ctx=CTX, dtype="float32", prefill_chunk=16, **kw)


@functools.lru_cache(maxsize=2)
def _resident(experts: str = "f32"):
    """The all-resident engine of the f32 file or of its MXFP4-expert copy, shared by the tests."""
    return _engine(_mxfp4_paths() if experts == "mxfp4" else gptoss_model("f32").gguf_path)


@functools.lru_cache(maxsize=1)
def _reference():
    """(ids, transformers' logits for them) of the f32 model."""
    tm = gptoss_model("f32")
    ids = _ids(tm)
    return ids, hf_logits(tm, ids)


def _rel_err(ours, ref):
    """Per position: max |ours - ref| / max |ref|."""
    return np.abs(np.asarray(ours) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


# -- the MXFP4-expert model and its reference -----------------------------------------------------


@functools.lru_cache(maxsize=1)
def _mxfp4_paths():
    """The f32 file with every expert matrix re-quantized to MXFP4 by gguf-py, beside it in the test
    artifacts (named after it, so it is rebuilt when the f32 file is)."""
    import os

    from gguf import GGMLQuantizationType as T
    from gguf import quants as gq

    tm = gptoss_model("f32")
    out = tm.gguf_path.with_name(f"{tm.gguf_path.stem}-mxfp4-experts.gguf")
    if out.is_file():
        return out

    def requantize(r):
        items = []
        for t in r.tensors:
            data = np.asarray(t.data)
            if t.name.endswith(EXPERT_MATS):
                items.append((t.name, gq.quantize(data.astype(np.float32), T.MXFP4), T.MXFP4))
            else:
                items.append((t.name, data, t.tensor_type))
        return items

    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    rewrite_gguf(tm.gguf_path, tmp, tensors=requantize)
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=1)
def _hf_mxfp4_model():
    """The tiny transformers model with its experts' weights replaced by the MXFP4 file's, dequantized
    by gguf-py (gate and up interleaved back into gate_up_proj [E, D, 2F], down_proj [E, F, D])."""
    import copy

    import torch
    from gguf.quants import dequantize

    from reference_models import _load_hf

    tm = gptoss_model("f32")
    model = copy.deepcopy(_load_hf(str(tm.hf_dir.resolve())))
    g = GGUFFile(_mxfp4_paths())
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = (dequantize(np.asarray(g.tensor(f"blk.{i}.{n}").data), g.tensor(f"blk.{i}.{n}").ggml_type)
                              for n in EXPERT_MATS)  # [E, F, D], [E, F, D], [E, D, F]
            ex = layer.mlp.experts
            gate_up = ex.gate_up_proj.detach().numpy().copy()
            gate_up[:, :, 0::2] = gate.transpose(0, 2, 1)
            gate_up[:, :, 1::2] = up.transpose(0, 2, 1)
            ex.gate_up_proj.copy_(torch.from_numpy(gate_up))
            ex.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1))))
    return model.eval()


# -- the file ---------------------------------------------------------------------------------------


def test_fixture_carries_what_the_checkpoint_says():
    """The converter writes the window (no pattern key: llama.cpp's default alternation), the YaRN
    keys (none for `truncate`), the sinks and every bias; the experts in the outtype, not MXFP4."""
    from gguf import GGMLQuantizationType as T

    for outtype, expert_type in (("f32", T.F32), ("q8_0", T.Q8_0)):
        tm = gptoss_model(outtype)
        g = GGUFFile(tm.gguf_path)
        md, c = g.metadata, tm.config
        assert g.architecture == "gpt-oss" and md["tokenizer.ggml.pre"] == "gpt-4o"
        assert md["gpt-oss.attention.sliding_window"] == c["sliding_window"]
        assert "gpt-oss.attention.sliding_window_pattern" not in md
        rp = c["rope_parameters"]
        assert md["gpt-oss.rope.scaling.type"] == "yarn" and md["gpt-oss.rope.scaling.factor"] == rp["factor"]
        assert md["gpt-oss.rope.scaling.original_context_length"] == rp["original_max_position_embeddings"]
        assert not [k for k in md if "truncate" in k]
        assert g.has("blk.0.attn_sinks.weight") and g.has("blk.0.attn_output.bias") and g.has("blk.0.ffn_gate_inp.bias")
        assert {g.tensor(f"blk.0.{n}").ggml_type for n in EXPERT_MATS} == {expert_type}
        assert {g.tensor(f"blk.0.{n}").ggml_type for n in ("ffn_gate_exps.bias", "ffn_up_exps.bias")} == {T.F32}


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "mxfp4"])
def test_every_tensor_is_consumed(outtype):
    """Config and weights take every tensor of the file; the routed experts' matrices are the expert
    store's, their biases stay beside the router (and count as dense bytes)."""
    from gguf import GGMLQuantizationType as T

    from strata_jax.model.memory import routed_expert_bytes

    tm = gptoss_model("f32" if outtype == "mxfp4" else outtype)
    if outtype == "mxfp4":
        tm = dataclasses.replace(tm, gguf_path=_mxfp4_paths())
    g, cfg, loader, params, spec = _load(tm)
    assert sorted(set(g.tensors) - loader.consumed) == []
    assert cfg.n_layers == 3 and cfg.moe_layers == (0, 1, 2) and spec.moe_layers == (0, 1, 2)
    assert cfg.sliding_window == 8 and cfg.swa_layers == (0, 2)
    assert cfg.expert_gating == "softmax_weight" and cfg.expert_act == "swiglu_oai" and not cfg.norm_topk
    y = cfg.rope_scaling
    assert (y.kind, y.factor, y.orig_ctx, y.beta_fast, y.beta_slow, y.ext_factor, y.log_mul) == (
        "yarn", 4.0, 64, 32.0, 1.0, 1.0, 0.0)
    assert cfg.rope_style == "neox" and cfg.qkv_bias and cfg.ffn_norm_tensor == "post_attention_norm"
    assert cfg.head_dim == 32 and cfg.q_dim == 128 != cfg.d_model
    for lp in params.layers:
        assert lp.attn.sinks_H.shape == (4,) and lp.attn.wo_bias_D.shape == (64,)
        assert lp.moe.router_bias_E.shape == (8,)
        assert [b.shape for b in lp.moe.expert_bias] == [(8, 32), (8, 32), (8, 64)]
    if outtype == "mxfp4":
        assert {p.qtype for parts in spec.layer_parts for p in parts} == {T.MXFP4}
    # the memory plan counts as routed experts exactly the bytes the expert store holds (the biases
    # are dense: on the device beside the router)
    assert routed_expert_bytes(g) == sum(spec.bytes_per_expert(i) * cfg.n_experts for i in range(3))


def test_yarn_frequencies_match_transformers():
    """rope_freqs against transformers' YaRN init for the checkpoint's parameters (truncate at
    its default, True, which is what llama.cpp computes: GGUF cannot say otherwise), and the ramp's
    ends are truncated: truncate=False gives other frequencies. Linear scaling against its init too."""
    import torch
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from strata_jax.model.layers.attention import rope_freqs

    tm = gptoss_model("f32")
    _, cfg, _, _, _ = _load(tm)
    inv_freq, mscale = rope_freqs(cfg)
    hf_cfg = GptOssConfig(**tm.config)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, torch.device("cpu"))
    inv_freq = np.asarray(inv_freq)
    np.testing.assert_allclose(inv_freq, ref.numpy(), rtol=1e-6)
    assert mscale == pytest.approx(ref_scale, rel=1e-7)
    untruncated = GptOssConfig(**dict(tm.config, rope_parameters=dict(tm.config["rope_parameters"], truncate=False)))
    other, _ = ROPE_INIT_FUNCTIONS["yarn"](untruncated, torch.device("cpu"))
    assert np.abs(other.numpy() - inv_freq).max() > 1e-3 * inv_freq.max()
    # linear scaling (any architecture's rope.scaling.type = linear)
    linear = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, kind="linear"))
    lin_cfg = GptOssConfig(**dict(tm.config, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=150000.0)))
    lin_ref, lin_scale = ROPE_INIT_FUNCTIONS["linear"](lin_cfg, torch.device("cpu"))
    lin, lin_mscale = rope_freqs(linear)
    np.testing.assert_allclose(np.asarray(lin), lin_ref.numpy(), rtol=1e-6)
    assert lin_mscale == lin_scale == 1.0


# -- against transformers -------------------------------------------------------------------------


def test_logits_match_transformers():
    """Every position's logits (prefilled in chunks, the last one padded; the sequence over four
    windows long) within REL_TOL of transformers' fp32 forward pass."""
    ids, ref = _reference()
    ours = _resident().logits(ids)
    err = _rel_err(ours, ref)
    print(f"gpt-oss f32: max relative logit error vs transformers {err.max():.2e}")
    assert ours.shape == ref.shape and err.max() < REL_TOL, err


@pytest.mark.parametrize("routing", ["router", "busy"])
def test_sparse_prefills_equal_dense(routing):
    """The grouped prefill MoE (tokens sorted by expert, ragged_dot; each pair's expert biases by its
    expert id) and the blocked one (the dense scan over groups of experts, each expert through blocks of
    its own rows) compute what the dense one (test_logits_match_transformers) does, on layer 0's
    experts; without the biases they are far from it. "busy": every token routed to the same experts,
    more rows than one block holds, so the blocked form takes several rounds."""
    import jax.numpy as jnp

    from strata_jax.model.layers.moe import _experts_blocked, _experts_dense, _experts_grouped, route

    m = _resident()
    cfg, p = m.config, runs.layers_of(m.params.layers)[0].moe
    x = jnp.asarray(np.random.default_rng(5).standard_normal((12, cfg.d_model)).astype(np.float32))
    forced = None if routing == "router" else jnp.tile(jnp.arange(cfg.n_experts_used)[::-1], (12, 1))
    w, ids = route(x, p.router_ED, cfg, forced, logit_bias_E=p.router_bias_E)
    experts = m.experts.take()
    try:
        experts = experts.stream(0)
        args = (x, w, ids)
        dims = (jnp.float32, cfg.n_experts, cfg.expert_ffn_dim, cfg)
        dense = _experts_dense(*args, experts, 0, *dims, p.expert_bias)
        blocked = _experts_blocked(*args, experts, 0, *dims, p.expert_bias)
        unbiased_blocked = _experts_blocked(*args, experts, 0, *dims, None)
        rows = experts.layer(0)
        grouped = _experts_grouped(*args, rows, jnp.float32, cfg.n_experts, cfg, p.expert_bias)
        unbiased = _experts_grouped(*args, rows, jnp.float32, cfg.n_experts, cfg, None)
    finally:
        m.experts.put(experts)
    scale = np.abs(np.asarray(dense)).max()
    for ours, off in ((grouped, unbiased), (blocked, unbiased_blocked)):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(dense), rtol=0, atol=1e-5 * scale)
        assert np.abs(np.asarray(off) - np.asarray(dense)).max() > OFF_TOL * scale


def test_mxfp4_experts_match_transformers():
    """Experts in MXFP4 (prefill: dequantized in the step; decode: the few-token path, through the
    fused kernel when forced on) against transformers holding the same expert weights."""
    from strata_jax.model.kernels import Kernels

    ids, f32_ref = _reference()
    ref = hf_logits(_hf_mxfp4_model(), ids)
    m = _resident("mxfp4")
    err = _rel_err(m.logits(ids), ref)
    print(f"gpt-oss MXFP4 experts: max relative logit error vs transformers {err.max():.2e}")
    assert err.max() < REL_TOL, err
    assert _rel_err(f32_ref, ref).max() > OFF_TOL  # the re-quantization is visible
    prompt = ids[:12]
    gen = m.generate(prompt, max_tokens=4, temperature=0, cache_prompt=False)
    assert gen.token_ids == hf_greedy(_hf_mxfp4_model(), prompt, 4)
    forced = _engine(_mxfp4_paths(), kernels=Kernels(qmatvec="on"))
    assert forced.generate(prompt, max_tokens=4, temperature=0, cache_prompt=False).token_ids == gen.token_ids


@functools.lru_cache(maxsize=None)
def _step_fn(cfg, attn_block=None):
    """The jitted one-row forward over the whole cache span, all logits (one compile per config)."""
    import jax
    import jax.numpy as jnp

    from strata_jax.model.forward import forward

    return jax.jit(functools.partial(forward, cfg=cfg, dtype=jnp.float32, kernels=_resident().kernels,
                                     all_logits=True, attn_len=CTX, attn_block=attn_block))


def _one_pass(ids, cfg=None, params=None, attn_block=None):
    """float32 [len(ids), V]: the f32 model's forward over ids in one step (cfg, params: changed ones)."""
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache

    m = _resident()
    cfg = cfg or m.config
    experts = m.experts.take()
    try:
        kv = KVCache.zeros(cfg, 1, CTX, jnp.float32)
        logits, _, experts, _ = _step_fn(cfg, attn_block)(params or m.params, experts, kv, jnp.asarray([ids], jnp.int32),
                                                          jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32))
    finally:
        m.experts.put(experts)
    return np.asarray(logits[0])


def test_decode_one_token_at_a_time_equals_full_forward():
    """A 5-token prefill, then one token per step past several windows, through the blocked attention
    (blocks of 8: the loop starts at the window's first block): every position's logits equal the
    one-pass forward's and transformers'. (The engine's static decode: test_offloaded_equals_resident
    and test_mxfp4_experts_match_transformers, greedy against transformers.)"""
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache

    tm = gptoss_model("f32")
    m = _resident()
    seq = _ids(tm, 30, seed=1)
    step = _step_fn(m.config, 8)
    experts = m.experts.take()
    got = []
    try:
        kv = KVCache.zeros(m.config, 1, CTX, jnp.float32)
        toks = np.zeros((1, 16), np.int32)
        toks[0, :5] = seq[:5]
        logits, kv, experts, _ = step(m.params, experts, kv, jnp.asarray(toks), jnp.zeros(1, jnp.int32),
                                      jnp.asarray([5], jnp.int32))
        got += list(np.asarray(logits[0, :5]))
        for pos in range(5, len(seq)):
            logits, kv, experts, _ = step(m.params, experts, kv, jnp.asarray([[seq[pos]]], jnp.int32),
                                          jnp.asarray([pos], jnp.int32), jnp.ones(1, jnp.int32))
            got.append(np.asarray(logits[0, 0]))
    finally:
        m.experts.put(experts)
    one_pass = m.logits(seq)
    np.testing.assert_allclose(np.stack(got), one_pass, rtol=0, atol=1e-4 * np.abs(one_pass).max())
    assert _rel_err(got, hf_logits(tm, seq)).max() < REL_TOL


def test_blocked_prefill_equals_static():
    """The whole sequence in one step through the blocked attention (blocks of 8, the window 8):
    transformers' logits, and the static path's to float32 rounding."""
    ids, ref = _reference()
    static, blocked = _one_pass(ids), _one_pass(ids, attn_block=8)
    np.testing.assert_allclose(blocked, static, rtol=0, atol=1e-5 * np.abs(static).max())
    assert _rel_err(blocked, ref).max() < REL_TOL


@pytest.mark.parametrize("experts, prefetch", [("f32", 1), ("mxfp4", 0)])
def test_offloaded_equals_resident(experts, prefetch):
    """Half the experts in device slots (LRU, misses fetched in the step; with prefetch, the next
    layer's biased router predicting its experts): logits and greedy tokens are the all-resident
    run's, bit for bit (the expert biases are read by expert id, never from a slot); the f32 model's
    greedy tokens are transformers'."""
    tm = gptoss_model("f32")
    ids, _ = _reference()
    ref = resident_reference(_resident(experts), ids, 8)
    if experts == "f32":
        assert ref[1] == hf_greedy(tm, ids, 8)
    path = _mxfp4_paths() if experts == "mxfp4" else tm.gguf_path
    assert_offloaded_matches(_engine(path, expert_slots=3 * 4, expert_pools="per-layer", prefetch=prefetch), ids, ref)


# -- each feature matters ---------------------------------------------------------------------------


def _layers(params, attn=None, moe=None):
    """params with each layer's attention / MoE fields replaced by fn(old value)."""
    def change(obj, fns):
        return dataclasses.replace(obj, **{k: fn(getattr(obj, k)) for k, fn in (fns or {}).items()})

    return dataclasses.replace(params, layers=tuple(
        dataclasses.replace(lp, attn=change(lp.attn, attn), moe=change(lp.moe, moe)) for lp in runs.layers_of(params.layers)))


def _zero(x):
    import jax

    return jax.tree.map(lambda a: a * 0, x)


# feature -> (config changes, params change). A params change keeps the pytree's
# structure (zero biases, a sink of -inf: exp(-inf) = 0 in the denominator) so it reuses the program.
SWITCHED_OFF = {
    "attention sinks": ({}, lambda p: _layers(p, attn=dict(sinks_H=lambda s: s * 0 - np.inf))),
    "q/k/v biases": ({}, lambda p: _layers(p, attn=dict(qkv=lambda q: dataclasses.replace(q, biases=_zero(q.biases))))),
    "output bias": ({}, lambda p: _layers(p, attn=dict(wo_bias_D=_zero))),
    "router bias": ({}, lambda p: _layers(p, moe=dict(router_bias_E=_zero))),
    "expert biases": ({}, lambda p: _layers(p, moe=dict(expert_bias=_zero))),
    "sliding window": (dict(swa_layers=()), None),
    "softmax after top-k": (dict(expert_gating="softmax"), None),
    "clamp": (dict(swiglu_limit=float("inf")), None),
    "clamped swiglu (+1 on up, alpha)": (dict(expert_act="silu"), None),
    "yarn": (dict(rope_scaling=None), None),
}


@pytest.mark.parametrize("feature", list(SWITCHED_OFF))
def test_each_feature_matters(feature):
    """The forward pass with one feature switched off is far from transformers (while the full one is
    within REL_TOL: test_logits_match_transformers, test_blocked_prefill_equals_static), so the logit
    tests cover every feature."""
    m = _resident()
    ids, ref = _reference()
    cfg_changes, params_change = SWITCHED_OFF[feature]
    cfg = dataclasses.replace(m.config, **cfg_changes) if cfg_changes else None
    off = _one_pass(ids, cfg, params_change(m.params) if params_change else None)
    assert _rel_err(off, ref).max() > OFF_TOL, feature
