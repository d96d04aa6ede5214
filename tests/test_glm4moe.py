"""glm4moe against transformers: a tiny random Glm4MoeForCausalLM (sigmoid routing with the selection
bias, expert groups, routed scaling, shared expert, q/k norms, partial rotary, a leading dense layer,
an MTP block) converted by llama.cpp's converter (tests/reference_models.py, glm4moe section)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from engine_checks import assert_offloaded_matches, resident_reference
from reference_models import glm4moe_model, hf_greedy, hf_logits
from reference_models import load_weights as _load
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model import runs

pytestmark = pytest.mark.slow  # converter-made models (~25 s each on a cold cache)

N_TOKENS = 37  # in 16-token prefill chunks: 16 + 16 + 5 (a padded last chunk)
REL_TOL = 1e-3  # f32: max |ours - transformers| over max |transformers|, at every position
OFF_TOL = 1e-2  # a feature switched off must move the logits at least this far from transformers'
CTX = 128


def _ids(tm, n=N_TOKENS, seed=0):
    return np.random.default_rng(seed).integers(0, tm.vocab_size - 4, n).tolist()


def _engine(tm, **kw):
    import strata_jax

    return strata_jax.load(str(tm.gguf_path), ctx=CTX, dtype="float32", prefill_chunk=16, **kw)


def _rel_err(ours, ref):
    """Per position: max |ours - ref| / max |ref|."""
    return np.abs(np.asarray(ours) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


@pytest.mark.parametrize("mtp", [True, False])
def test_fixture_carries_what_the_checkpoint_says(mtp):
    """The converter writes the routing (sigmoid, groups, scale, renormalisation), the leading dense
    layer and, unless --no-mtp, the MTP block after the trunk."""
    tm = glm4moe_model("f32", mtp)
    g = GGUFFile(tm.gguf_path)
    md, c = g.metadata, tm.config
    assert g.architecture == "glm4moe" and md["tokenizer.ggml.pre"] == "qwen2"
    assert md["glm4moe.expert_gating_func"] == 2  # sigmoid
    assert md["glm4moe.expert_group_count"] == c["n_group"] and md["glm4moe.expert_group_used_count"] == c["topk_group"]
    assert md["glm4moe.expert_weights_scale"] == pytest.approx(c["routed_scaling_factor"])
    assert md["glm4moe.leading_dense_block_count"] == c["first_k_dense_replace"]
    assert md["glm4moe.rope.dimension_count"] == c["head_dim"] // 2
    n = c["num_hidden_layers"]
    if mtp:
        assert md["glm4moe.nextn_predict_layers"] == 1 and md["glm4moe.block_count"] == n + 1
        assert g.has(f"blk.{n}.nextn.eh_proj.weight") and g.has(f"blk.{n}.exp_probs_b.bias")
    else:
        assert "glm4moe.nextn_predict_layers" not in md and md["glm4moe.block_count"] == n
        assert not any(name.startswith(f"blk.{n}.") for name in g.tensors)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("mtp", [True, False])
def test_every_tensor_is_consumed(mtp, outtype):
    """Config and weights take every tensor of the file, the MTP block's included (its routed experts
    shape-checked, left to the file); the trunk's routed experts are the expert store's."""
    g, cfg, loader, params, spec = _load(glm4moe_model(outtype, mtp))
    assert sorted(set(g.tensors) - loader.consumed) == []
    assert cfg.n_layers == 3 and cfg.moe_layers == (1, 2) and spec.moe_layers == (1, 2)
    assert params.layers[0].mlp is not None and params.layers[0].moe is None  # the leading dense layer
    assert cfg.expert_gating == "sigmoid" and (cfg.expert_groups, cfg.expert_groups_used) == (4, 2)
    assert cfg.expert_weights_scale == pytest.approx(2.5) and cfg.norm_topk
    assert cfg.qk_norm == "head" and cfg.qkv_bias and cfg.rope_dim == 16 and cfg.rope_style == "neox"
    assert cfg.shared_expert_ffn_dim == 96 and cfg.expert_ffn_dim == 32 and cfg.ffn_dim == 96
    assert all(params.layers[i].moe.score_bias_E is not None for i in cfg.moe_layers)
    assert cfg.n_nextn_layers == int(mtp) and len(params.nextn) == int(mtp)
    if mtp:
        nx = params.nextn[0]
        assert nx.block.moe is not None and nx.block.moe.score_bias_E is not None
        assert nx.expert_names == tuple(f"blk.3.{n}.weight" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        assert nx.shared_head_norm_D is not None and nx.shared_head is None and nx.embed is None


def test_mtp_block_holds_the_checkpoint_weights():
    """Params.nextn[0] is the checkpoint's model.layers.3 (eh_proj, norms, router bias, attention)."""
    from safetensors.numpy import load_file

    from strata_jax.gguf.quant import dequant

    tm = glm4moe_model("f32")
    _, _, _, params, _ = _load(tm)
    sd = load_file(tm.hf_dir / "model.safetensors")
    nx = params.nextn[0]
    np.testing.assert_array_equal(np.asarray(dequant(nx.eh_proj, np.float32)), sd["model.layers.3.eh_proj.weight"])
    np.testing.assert_array_equal(np.asarray(nx.enorm_D), sd["model.layers.3.enorm.weight"])
    np.testing.assert_array_equal(np.asarray(nx.hnorm_D), sd["model.layers.3.hnorm.weight"])
    np.testing.assert_array_equal(np.asarray(nx.shared_head_norm_D), sd["model.layers.3.shared_head.norm.weight"])
    np.testing.assert_array_equal(np.asarray(nx.block.moe.score_bias_E),
                                  sd["model.layers.3.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(np.asarray(nx.block.moe.router_ED), sd["model.layers.3.mlp.gate.weight"])
    np.testing.assert_array_equal(np.asarray(nx.block.attn.k_norm), sd["model.layers.3.self_attn.k_norm.weight"])


@pytest.mark.parametrize("groups", [4, 1])
def test_route_matches_transformers_router(groups):
    """route() against transformers' Glm4MoeTopkRouter on random activations: the same experts (as
    sets: both top-k's are unsorted) and the same weights, with and without expert groups."""
    import jax.numpy as jnp
    import torch
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from strata_jax.model.config import ModelConfig
    from strata_jax.model.layers.moe import route

    E, D, k, N = 16, 32, 4, 64
    hf_cfg = Glm4MoeConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                           topk_group=min(2, groups), routed_scaling_factor=1.8, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(hf_cfg)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((E, D)).astype(np.float32) * 0.3))
        router.e_score_correction_bias.copy_(torch.from_numpy(rng.standard_normal(E).astype(np.float32) * 0.3))
    x = rng.standard_normal((N, D)).astype(np.float32)
    with torch.no_grad():
        _, w_ref, ids_ref = router(torch.from_numpy(x))
    cfg = ModelConfig(arch="glm4moe", n_layers=1, d_model=D, n_heads=1, n_kv_heads=1, head_dim=D, ffn_dim=0,
                      vocab_size=1, context_length=1, rope_theta=1.0, rope_style="neox", rope_dim=D, rms_eps=1e-5,
                      qkv_bias=False, qk_norm="none", tied_embeddings=False, n_experts=E, n_experts_used=k,
                      norm_topk=True, expert_weights_scale=1.8, expert_gating="sigmoid",
                      expert_groups=groups if groups > 1 else 0, expert_groups_used=min(2, groups) if groups > 1 else 0)
    w, ids = route(jnp.asarray(x), jnp.asarray(router.weight.detach().numpy()), cfg,
                   bias_E=jnp.asarray(router.e_score_correction_bias.numpy()))
    order_ref, order = np.argsort(ids_ref.numpy(), axis=1), np.argsort(np.asarray(ids), axis=1)
    ids_ref_s, ids_s = np.take_along_axis(ids_ref.numpy(), order_ref, 1), np.take_along_axis(np.asarray(ids), order, 1)
    np.testing.assert_array_equal(ids_s, ids_ref_s)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(w_ref.numpy(), order_ref, 1), rtol=1e-6, atol=1e-7)
    if groups > 1:  # every token's experts lie in at most topk_group groups
        assert (np.array([len(set(r)) for r in ids_s // (E // groups)]) <= 2).all()


def test_logits_match_transformers():
    """Every position's logits (prefilled in chunks, the last one padded) within REL_TOL of
    transformers' fp32 forward pass; the file without the MTP block gives the same logits, bit for bit."""
    tm = glm4moe_model("f32")
    ids = _ids(tm)
    ours, ref = _engine(tm).logits(ids), hf_logits(tm, ids)
    err = _rel_err(ours, ref)
    print(f"glm4moe: max relative logit error vs transformers {err.max():.2e}")
    assert ours.shape == ref.shape and err.max() < REL_TOL, err
    np.testing.assert_array_equal(_engine(glm4moe_model("f32", mtp=False)).logits(ids), ours)


def test_greedy_decode_matches_transformers():
    """Decode runs the few-token MoE path, prefill the all-experts one: transformers' tokens, each one."""
    tm = glm4moe_model("f32")
    m = _engine(tm)
    prompt = _ids(tm, 12, seed=4)
    gen = m.generate(prompt, max_tokens=16, temperature=0, cache_prompt=False)
    assert len(gen.token_ids) == 16, gen.finish_reason
    assert gen.token_ids == hf_greedy(tm, prompt, 16)


def test_offloaded_equals_resident():
    """Half the experts in device slots (LRU, misses fetched in the step; with and without the next
    layer's router predicting its experts, the selection bias included): logits and greedy tokens
    are the all-resident run's, bit for bit."""
    tm = glm4moe_model("f32")
    ids = _ids(tm)
    ref = resident_reference(_engine(tm), ids)
    for prefetch in (0, 1):
        assert_offloaded_matches(_engine(tm, expert_slots=2 * 4, expert_pools="per-layer", prefetch=prefetch), ids, ref)


def _without_bias(params):
    layers = tuple(dataclasses.replace(lp, moe=dataclasses.replace(lp.moe, score_bias_E=None)) if lp.moe else lp
                   for lp in runs.layers_of(params.layers))
    return dataclasses.replace(params, layers=layers)


def _without_shared(params):
    layers = tuple(dataclasses.replace(lp, moe=dataclasses.replace(lp.moe, shared=None)) if lp.moe else lp
                   for lp in runs.layers_of(params.layers))
    return dataclasses.replace(params, layers=layers)


SWITCHED_OFF = {  # feature -> (config changes, params change)
    "selection bias": ({}, _without_bias),
    "expert groups": (dict(expert_groups=0, expert_groups_used=0), None),
    "routed scaling": (dict(expert_weights_scale=1.0), None),
    "sigmoid scoring": (dict(expert_gating="softmax"), None),
    "shared expert": ({}, _without_shared),
    "q/k norms": (dict(qk_norm="none"), None),
    "partial rotary": (dict(rope_dim=32), None),
}


@pytest.mark.parametrize("feature", list(SWITCHED_OFF))
def test_each_feature_matters(feature):
    """The forward pass with one feature switched off is far from transformers (while the full one is
    within REL_TOL: test_logits_match_transformers), so the logit tests cover every feature."""
    import jax
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache, forward

    tm = glm4moe_model("f32")
    m = _engine(tm)
    ids = _ids(tm, 32)
    ref = hf_logits(tm, ids)
    cfg_changes, params_change = SWITCHED_OFF[feature]

    def run(cfg, params):
        step = jax.jit(functools.partial(forward, cfg=cfg, dtype=jnp.float32, kernels=m.kernels, all_logits=True,
                                         attn_len=CTX))
        experts = m.experts.take()
        try:
            kv = KVCache.zeros(cfg, 1, CTX, jnp.float32)
            logits, _, experts, _ = step(params, experts, kv, jnp.asarray([ids], jnp.int32), jnp.zeros(1, jnp.int32),
                                         jnp.asarray([len(ids)], jnp.int32))
        finally:
            m.experts.put(experts)
        return np.asarray(logits[0])

    assert _rel_err(run(m.config, m.params), ref).max() < REL_TOL
    off = run(dataclasses.replace(m.config, **cfg_changes), params_change(m.params) if params_change else m.params)
    assert _rel_err(off, ref).max() > OFF_TOL, feature
