"""deepseek2 against transformers: tiny random DeepseekV3ForCausalLM models (multi-head latent attention
with a query latent or without one, YaRN rope, sigmoid routing with the selection bias, expert groups,
routed scaling, shared experts, a leading dense layer) converted by llama.cpp's converter
(tests/reference_models.py, deepseek2 section)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from engine_checks import assert_offloaded_matches, decode_two_rows, resident_reference
from reference_models import deepseek2_model, hf_greedy, hf_logits, hf_quantized_model
from reference_models import load_weights as _load
from reference_models import rewrite_gguf
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model import runs

pytestmark = pytest.mark.slow  # converter-made models (~10 s each on a cold cache)

N_TOKENS = 37  # in prefill chunks of 16 (16 + 16 + 5, a padded last chunk) or one chunk of 64
REL_TOL = 1e-3  # f32: max |ours - transformers| over max |transformers|, at every position
OFF_TOL = 1e-2  # a feature switched off must move the logits at least this far from transformers'
CTX = 128
QUANT_TOL = 5e-2  # a q8_0 latent cache against f16, relative as REL_TOL, at the median position


def _ids(tm, n=N_TOKENS, seed=0):
    return np.random.default_rng(seed).integers(0, tm.vocab_size - 4, n).tolist()


@functools.lru_cache(maxsize=4)
def _engine(variant="v3", outtype="f32", prefill_chunk=16, **kw):
    import strata_jax

    return strata_jax.load(str(deepseek2_model(variant, outtype).gguf_path), ctx=CTX, dtype="float32",
                           prefill_chunk=prefill_chunk, **kw)


def _rel_err(ours, ref):
    """Per position: max |ours - ref| / max |ref|."""
    return np.abs(np.asarray(ours) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


@functools.lru_cache(maxsize=None)
def _step(cfg, kernels, attn_block=None):
    import jax
    import jax.numpy as jnp

    from strata_jax.model.forward import forward

    return jax.jit(functools.partial(forward, cfg=cfg, dtype=jnp.float32, all_logits=True, attn_len=CTX,
                                     kernels=kernels, attn_block=attn_block))


def _forward(m, ids, cfg=None, params=None, attn_block=None, kv_type="f16", **kernels):
    """All-position logits of one pass over ids (one row, one chunk) with config, params, the KV storage
    or kernel choices changed (one compile per config, kernels and storage)."""
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache

    cfg = cfg or m.config
    step = _step(cfg, dataclasses.replace(m.kernels, **kernels), attn_block)
    experts = m.experts.take()
    try:
        kv = KVCache.zeros(cfg, 1, CTX, jnp.float32, kv=kv_type)
        logits, _, experts, _ = step(params or m.params, experts, kv, jnp.asarray([ids], jnp.int32),
                                     jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32))
    finally:
        m.experts.put(experts)
    return np.asarray(logits[0])


def test_fixture_carries_what_the_checkpoint_says():
    """The converter writes MLA's dims (the MQA view and the per-head ones), YaRN with the log
    multiplier, sigmoid routing (scoring_func, put back into config.json), groups, scale, renormalisation,
    the leading dense layer, and the split k_b / v_b; the lite model has attn_q and no YaRN."""
    tm = deepseek2_model("v3")
    g = GGUFFile(tm.gguf_path)
    md, c = g.metadata, tm.config
    assert g.architecture == "deepseek2" and md["tokenizer.ggml.pre"] == "qwen2"
    assert md["deepseek2.expert_gating_func"] == 2  # sigmoid
    assert md["deepseek2.expert_group_count"] == c["n_group"] and md["deepseek2.expert_group_used_count"] == c["topk_group"]
    assert md["deepseek2.expert_weights_scale"] == pytest.approx(c["routed_scaling_factor"])
    assert md["deepseek2.expert_weights_norm"] is True
    assert md["deepseek2.leading_dense_block_count"] == c["first_k_dense_replace"]
    assert md["deepseek2.attention.q_lora_rank"] == c["q_lora_rank"]
    assert md["deepseek2.attention.kv_lora_rank"] == c["kv_lora_rank"]
    assert md["deepseek2.attention.head_count_kv"] == 1
    assert md["deepseek2.attention.key_length"] == c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert md["deepseek2.attention.key_length_mla"] == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    assert md["deepseek2.attention.value_length_mla"] == c["v_head_dim"]
    rp = c["rope_parameters"]
    assert md["deepseek2.rope.scaling.type"] == "yarn" and md["deepseek2.rope.scaling.factor"] == rp["factor"]
    assert md["deepseek2.rope.scaling.original_context_length"] == rp["original_max_position_embeddings"]
    assert md["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * rp["mscale_all_dim"])
    assert g.has("blk.1.attn_k_b.weight") and g.has("blk.1.attn_v_b.weight") and not g.has("blk.1.attn_kv_b.weight")
    lite = GGUFFile(deepseek2_model("lite").gguf_path)
    assert lite.has("blk.0.attn_q.weight") and not lite.has("blk.0.attn_q_a.weight")
    assert "deepseek2.rope.scaling.type" not in lite.metadata


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("variant", ["v3", "lite"])
def test_every_tensor_is_consumed(variant, outtype):
    """Config and weights take every tensor of the file; the routed experts are the expert store's."""
    g, cfg, loader, params, spec = _load(deepseek2_model(variant, outtype))
    assert sorted(set(g.tensors) - loader.consumed) == []
    assert cfg.n_layers == 3 and cfg.moe_layers == (1, 2) and spec.moe_layers == (1, 2)
    assert params.layers[0].mlp is not None and params.layers[0].moe is None  # the leading dense layer
    assert cfg.expert_gating == "sigmoid" and (cfg.expert_groups, cfg.expert_groups_used) == (4, 2)
    assert cfg.expert_weights_scale == pytest.approx(2.5) and cfg.norm_topk and cfg.rope_style == "normal"
    assert cfg.shared_expert_ffn_dim == 96 and cfg.expert_ffn_dim == 32 and cfg.ffn_dim == 96
    assert all(params.layers[i].moe.score_bias_E is not None for i in cfg.moe_layers)
    d = cfg.mla
    assert (d.q_lora_rank, d.kv_lora_rank, d.nope_dim, d.rope_dim, d.v_dim) == (32 if variant == "v3" else 0, 96, 32, 16, 24)
    assert (cfg.rope_scaling is not None) == (variant == "v3")
    if variant == "v3":
        y = cfg.rope_scaling
        assert (y.kind, y.factor, y.orig_ctx) == ("yarn", 16.0, 32) and y.log_mul == pytest.approx(1.0)


def test_unsplit_kv_b_file_is_refused_by_name(tmp_path):
    """A file with the older unsplit attn_kv_b (no attn_k_b / attn_v_b) is refused before any weight is
    read, naming the tensor and the fix."""
    import strata_jax
    from strata_jax.core.errors import UnsupportedArchitectureError

    def unsplit(r):
        out = []
        for t in r.tensors:
            if t.name.endswith("attn_v_b.weight"):
                continue
            if t.name.endswith("attn_k_b.weight"):  # any [H * (Dn + Do), Rk] matrix will do: it is never read
                out.append((t.name.replace("attn_k_b", "attn_kv_b"), np.zeros((4 * (32 + 24), 96), np.float32),
                            t.tensor_type))
                continue
            out.append((t.name, np.asarray(t.data), t.tensor_type))
        return out

    path = rewrite_gguf(deepseek2_model("v3").gguf_path, tmp_path / "kv_b.gguf", tensors=unsplit)
    with pytest.raises(UnsupportedArchitectureError, match="attn_kv_b.*reconvert"):
        strata_jax.load(str(path), ctx=CTX, dtype="float32")


def test_kv_cache_holds_the_latent():
    """The cache is the latent + rope key per position (one "head" of kv_lora_rank + rope dims, no value
    cache), not every head's keys and values; the memory estimate counts exactly what is allocated."""
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache
    from strata_jax.model.memory import kv_cache_bytes

    cfg = _engine().config
    kv = KVCache.zeros(cfg, 2, CTX, jnp.float32)
    assert kv.k_LBSKDh.shape == (3, 2, CTX, 1, 96 + 16) and kv.v_LBSKDh is None
    assert kv_cache_bytes(cfg, CTX, 2, 4) == kv.k_LBSKDh.nbytes
    full_kv = 3 * 2 * CTX * cfg.n_heads * (32 + 16 + 24) * 4  # every head's K and V, as MHA would cache them
    assert kv.k_LBSKDh.nbytes < full_kv
    row = kv.take_row(1)
    assert row.v_LBSKDh is None and kv.put_row(1, row).k_LBSKDh.shape == kv.k_LBSKDh.shape


def test_auto_form_is_absorbed_for_decode_naive_for_long_chunks():
    from strata_jax.model.layers import mla

    m = _engine()
    d = m.config.mla
    assert m.kernels.mla == "auto"
    assert mla.form(m.kernels, d, 1, False) == "absorbed" and mla.form(m.kernels, d, 16, False) == "absorbed"
    assert mla.form(m.kernels, d, 64, False) == "naive" and mla.form(m.kernels, d, 64, True) == "absorbed"


@pytest.mark.parametrize("variant,prefill_chunk", [("v3", 16), ("v3", 64), ("lite", 64)])
def test_logits_match_transformers(variant, prefill_chunk):
    """Every position's logits within REL_TOL of transformers' fp32 forward pass: prefilled in chunks of
    16 (the absorbed form, a padded last chunk) or in one chunk of 64 (the naive form)."""
    tm = deepseek2_model(variant)
    ids = _ids(tm)
    ours, ref = _engine(variant, prefill_chunk=prefill_chunk).logits(ids), hf_logits(tm, ids)
    err = _rel_err(ours, ref)
    print(f"deepseek2 {variant} chunk {prefill_chunk}: max relative logit error vs transformers {err.max():.2e}")
    assert ours.shape == ref.shape and err.max() < REL_TOL, err


def test_absorbed_and_naive_forms_both_match_transformers():
    """The two MLA forms, forced over one 37-token pass, each within REL_TOL of transformers; they are
    different computations (not bit-identical), so each is checked on its own."""
    tm = deepseek2_model("v3")
    m = _engine()
    ids = _ids(tm)
    ref = hf_logits(tm, ids)
    absorbed, naive = _forward(m, ids, mla="absorbed"), _forward(m, ids, mla="naive")
    assert _rel_err(absorbed, ref).max() < REL_TOL and _rel_err(naive, ref).max() < REL_TOL
    assert not np.array_equal(absorbed, naive)


def test_quantized_latent_cache_in_both_forms(monkeypatch):
    """A q8_0 latent cache (quantized [latent | rope key] per position) through the naive form (the span
    read back, expanded per head), the absorbed form (keys carrying values) and blocked attention: the
    forms read the same values (they agree as closely as over the f16 cache: measured 1.5e-6 and 2.1e-6),
    the median position's logits stay within QUANT_TOL of the f16 cache's (measured 0.015; this random
    model's top-k routing flips on small changes at some positions: max 0.21), blocked equals static.
    The tiny latent (96 + 16 values) is not whole blocks of 32, so its blocks here are 16 values
    (kvquant.BLOCK, read at trace time)."""
    from strata_jax.model import kvquant

    monkeypatch.setattr(kvquant, "BLOCK", 16)
    tm = deepseek2_model("v3")
    m = _engine()
    ids = _ids(tm)
    q8 = {form: _forward(m, ids, mla=form, kv_type="q8_0") for form in ("absorbed", "naive")}
    assert _rel_err(q8["absorbed"], q8["naive"]).max() < 1e-4
    err = _rel_err(q8["naive"], _forward(m, ids, mla="naive"))
    assert 0 < np.median(err) < QUANT_TOL, err
    static = q8["absorbed"]
    np.testing.assert_allclose(_forward(m, ids, attn_block=16, kv_type="q8_0"), static, rtol=0,
                               atol=1e-5 * np.abs(static).max())


def test_blocked_attention_equals_static():
    """Attention over the latent cache in blocks of 16 positions (what spans past 4096 run, always the
    absorbed form) gives the static pass's logits."""
    tm = deepseek2_model("v3")
    m = _engine()
    ids = _ids(tm)
    static = _forward(m, ids, mla="absorbed")
    np.testing.assert_allclose(_forward(m, ids, attn_block=16), static, rtol=0, atol=1e-5 * np.abs(static).max())


def test_decode_one_token_at_a_time_equals_full_forward():
    """Two rows: a prefill chunk, then one token per step (the absorbed form against the latent cache),
    row 1 idle for a few steps; each row's logits at every position equal the one-pass forward of its
    sequence (and transformers')."""
    tm = deepseek2_model("v3")
    m = _engine()
    seqs = [_ids(tm, 24, seed=1), _ids(tm, 24, seed=2)]
    got, pos, _ = decode_two_rows(m, seqs, CTX)
    for b in range(2):
        one_pass = m.logits(seqs[b][:pos[b]])
        np.testing.assert_allclose(np.stack(got[b]), one_pass, rtol=0, atol=1e-4 * np.abs(one_pass).max())
        assert _rel_err(got[b], hf_logits(tm, seqs[b][:pos[b]])).max() < REL_TOL


def test_greedy_decode_and_prefix_reuse():
    """Greedy decode is transformers' tokens; a second prompt extending the first reuses its cached
    latents (cache_n) and gives the tokens of a run without the cache."""
    tm = deepseek2_model("v3")
    m = _engine()
    prompt = _ids(tm, 12, seed=4)
    gen = m.generate(prompt, max_tokens=12, temperature=0, cache_prompt=False)
    assert len(gen.token_ids) == 12, gen.finish_reason
    assert gen.token_ids == hf_greedy(tm, prompt, 12)
    longer = prompt + gen.token_ids + _ids(tm, 5, seed=5)
    reused = m.generate(longer, max_tokens=8, temperature=0, cache_prompt=True)
    assert reused.timings["cache_n"] >= len(prompt)
    assert reused.token_ids == m.generate(longer, max_tokens=8, temperature=0, cache_prompt=False).token_ids


def test_batched_rows_equal_alone():
    """Two requests in a 2-row Session (each row's latent cache taken and put back around its prefill,
    both decoded in one batch, the second admitted a step later): each gets its alone-run tokens."""
    import strata_jax

    tm = deepseek2_model("v3")
    m = _engine()
    prompts = [_ids(tm, 9, seed=6), _ids(tm, 14, seed=7)]
    alone = [m.generate(p, max_tokens=8, temperature=0, cache_prompt=False).token_ids for p in prompts]
    session = strata_jax.Session(m, 2)
    got: dict[int, list[int]] = {}
    row0, chunks = session.admit(prompts[0], max_tokens=8, temperature=0)
    rows = {row0: 0}
    got[0] = [t for c in chunks for t in c.token_ids]
    admitted = False
    while session.active_rows or not admitted:
        for row, chunks in session.step().items():
            got[rows[row]] += [t for c in chunks for t in c.token_ids]
        if not admitted:
            row1, chunks = session.admit(prompts[1], max_tokens=8, temperature=0)
            rows[row1], got[1], admitted = 1, [t for c in chunks for t in c.token_ids], True
    assert row1 != row0 and [got[0], got[1]] == alone


def test_offloaded_equals_resident():
    """Half the experts in device slots (LRU, misses fetched in the step; with and without the next
    layer's router predicting its experts, the selection bias included): logits and greedy tokens are
    the all-resident run's, bit for bit."""
    tm = deepseek2_model("v3")
    ids = _ids(tm)
    ref = resident_reference(_engine(), ids)
    for prefetch in (0, 1):
        assert_offloaded_matches(_engine(expert_slots=2 * 4, expert_pools="per-layer", prefetch=prefetch), ids, ref)


def _gguf_exact_reference(tm):
    """transformers' model with the q8_0 GGUF's weights: hf_quantized_model round-trips every matrix
    through Q8_0 along its input dim, which is the file's layout for all but attn_k_b (the converter
    transposes kv_b's key rows before quantizing): those rows are taken from the file's k_b."""
    import torch
    from gguf.quants import dequantize

    model = hf_quantized_model(tm.arch, "q8_0")
    g = GGUFFile(tm.gguf_path)
    c = tm.config
    H, Dn, Dv, Rk = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            t = g.tensor(f"blk.{i}.attn_k_b.weight")
            k_b = dequantize(np.asarray(t.data), t.ggml_type).reshape(H, Rk, Dn)
            w = layer.self_attn.kv_b_proj.weight.view(H, Dn + Dv, Rk)
            w[:, :Dn] = torch.from_numpy(np.ascontiguousarray(k_b.transpose(0, 2, 1)))
    return model


@pytest.mark.parametrize("dequantize_dense", [True, False])
def test_q8_0_logits_match_transformers_with_the_files_weights(dequantize_dense):
    """The converter's q8_0 file against transformers holding exactly its weights (dequantized by
    gguf-py): every position within REL_TOL, with the matrices (the 3-d k_b / v_b included) dequantized
    once at load or inside every step (the GPU default)."""
    tm = deepseek2_model("v3", "q8_0")
    ids = _ids(tm)
    m = _engine("v3", "q8_0", dequantize_dense=dequantize_dense)
    assert (runs.layers_of(m.params.layers)[1].attn.k_b.qtype is None) == dequantize_dense
    ours = m.logits(ids)
    err = _rel_err(ours, hf_logits(_gguf_exact_reference(tm), ids))
    print(f"deepseek2 q8_0: max relative logit error vs transformers (same weights) {err.max():.2e}")
    assert err.max() < REL_TOL, err


def test_route_matches_transformers_router():
    """route() against transformers' DeepseekV3TopkRouter on random activations: the same experts (as
    sets) and weights, with groups, the selection bias and the routed scaling."""
    import jax.numpy as jnp
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from strata_jax.model.layers.moe import route

    E, D, k, N = 16, 64, 4, 64
    router = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=k,
                                                   n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                                   norm_topk_prob=True))
    rng = np.random.default_rng(3)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((E, D)).astype(np.float32) * 0.3))
        router.e_score_correction_bias.copy_(torch.from_numpy(rng.standard_normal(E).astype(np.float32) * 0.3))
    x = rng.standard_normal((N, D)).astype(np.float32)
    with torch.no_grad():
        _, w_ref, ids_ref = router(torch.from_numpy(x))
    cfg = dataclasses.replace(_engine().config, d_model=D, n_experts=E, n_experts_used=k)
    w, ids = route(jnp.asarray(x), jnp.asarray(router.weight.detach().numpy()), cfg,
                   bias_E=jnp.asarray(router.e_score_correction_bias.numpy()))
    order_ref, order = np.argsort(ids_ref.numpy(), axis=1), np.argsort(np.asarray(ids), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                  np.take_along_axis(ids_ref.numpy(), order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(w_ref.numpy(), order_ref, 1), rtol=1e-6, atol=1e-7)


def _moe_params(params, **changes):
    layers = tuple(dataclasses.replace(lp, moe=dataclasses.replace(lp.moe, **changes)) if lp.moe else lp
                   for lp in runs.layers_of(params.layers))
    return dataclasses.replace(params, layers=layers)


def _cfg_yarn(cfg, **changes):
    return dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, **changes))


SWITCHED_OFF = {  # feature -> (config change, params change)
    "selection bias": (None, lambda p: _moe_params(p, score_bias_E=None)),
    "expert groups": (lambda c: dataclasses.replace(c, expert_groups=0, expert_groups_used=0), None),
    "routed scaling": (lambda c: dataclasses.replace(c, expert_weights_scale=1.0), None),
    "sigmoid scoring": (lambda c: dataclasses.replace(c, expert_gating="softmax"), None),
    "shared experts": (None, lambda p: _moe_params(p, shared=None)),
    "YaRN mscale (log multiplier)": (lambda c: _cfg_yarn(c, log_mul=0.0), None),
    # a correction range past every rope dim: each frequency kept (extrapolated), the mscale unchanged
    "YaRN frequencies": (lambda c: _cfg_yarn(c, beta_fast=1e-4, beta_slow=1e-5), None),
    "interleaved rope pairs": (lambda c: dataclasses.replace(c, rope_style="neox"), None),
}


@pytest.mark.parametrize("feature", list(SWITCHED_OFF))
def test_each_feature_matters(feature):
    """The forward pass with one feature switched off is far from transformers (while the full one is
    within REL_TOL), so the logit tests cover every feature. "YaRN frequencies" keeps the attention
    scale's mscale and drops only the frequency interpolation."""
    tm = deepseek2_model("v3")
    m = _engine()
    ids = _ids(tm, 32)
    ref = hf_logits(tm, ids)
    cfg_change, params_change = SWITCHED_OFF[feature]
    assert _rel_err(_forward(m, ids), ref).max() < REL_TOL
    cfg = cfg_change(m.config) if cfg_change else m.config
    if feature == "YaRN frequencies":
        from strata_jax.model.layers.attention import rope_freqs
        from strata_jax.model.layers.mla import kq_scale

        n = cfg.rope_dim
        np.testing.assert_allclose(np.asarray(rope_freqs(cfg)[0]), cfg.rope_theta ** (-np.arange(0, n, 2) / n), rtol=1e-6)
        assert kq_scale(cfg) == kq_scale(m.config) and rope_freqs(cfg)[1] == rope_freqs(m.config)[1]
    off = _forward(m, ids, cfg=cfg, params=params_change(m.params) if params_change else None)
    assert _rel_err(off, ref).max() > OFF_TOL, feature
