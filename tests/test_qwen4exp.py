"""qwen4exp (the seed model's architecture) against transformers: tiny random Qwen4ExpForCausalLM
models converted by llama.cpp's converter (tests/reference_models.py, qwen4exp section)."""

from __future__ import annotations

import numpy as np
import pytest

from reference_models import QWEN4EXP_VARIANTS, hf_logits, qwen4exp_model
from strata_jax.gguf.reader import GGUFFile

pytestmark = pytest.mark.slow  # converter-made models (~20 s each on a cold cache)


@pytest.mark.parametrize("variant", QWEN4EXP_VARIANTS)
def test_fixture_carries_what_the_checkpoint_says(variant):
    """The conversion keeps QSA on (a compress ratio on every full-attention layer), the layer mix and,
    for the PLE variant, the hash constants transformers computed."""
    tm = qwen4exp_model(variant)
    g = GGUFFile(tm.gguf_path)
    md = g.metadata
    assert g.architecture == "qwen4exp"
    full = [i for i in range(4) if (i + 1) % tm.config["full_attention_interval"] == 0]
    assert list(md["qwen4exp.attention.compress_ratios"]) == [4 if i in full else 0 for i in range(4)]
    assert list(md["qwen4exp.attention.recurrent_layers"]) == [i not in full for i in range(4)]
    assert md["qwen4exp.attention.indexer.top_k"] == tm.config["indexer_budget"]
    assert md["tokenizer.ggml.pre"] == "qwen2" and len(md["tokenizer.ggml.tokens"]) == tm.vocab_size
    if variant == "ple":
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tm.hf_dir), dtype=torch.float32)
        emb = hf.model.layers[0].ple.ple_embedding
        assert list(md["qwen4exp.ple.layers"]) == [0]
        assert list(md["qwen4exp.ple.layer_multipliers"]) == emb.layer_multipliers.tolist()
        assert list(md["qwen4exp.ple.head_vocab_sizes"]) == emb.ngram_heads_vocab_sizes.tolist()
        assert g.tensor("per_layer_token_embd.weight").shape[0] == emb.ngram_embedding.weight.shape[0]
    else:
        assert "qwen4exp.ple.layers" not in md


def test_sparse_selection_changes_the_reference():
    """The sparse variant's budget bites within the test length (else it tests nothing dense does not),
    and not while a query sees at most budget / ratio = 2 complete blocks (positions 0..10)."""
    ids = np.random.default_rng(0).integers(0, 509, 40).tolist()
    dense, sparse = hf_logits(qwen4exp_model("dense"), ids), hf_logits(qwen4exp_model("sparse"), ids)
    np.testing.assert_allclose(dense[:11], sparse[:11], rtol=1e-5, atol=1e-5)
    assert np.abs(dense[16:] - sparse[16:]).max() > 1e-2 * np.abs(dense).max()


def _load(tm):
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.weights import WeightLoader, expert_spec, load_params

    g = GGUFFile(tm.gguf_path)
    cfg = ModelConfig.from_gguf(g)
    loader = WeightLoader(g, cfg)
    params = load_params(loader)
    return g, cfg, loader, params, expert_spec(loader)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("variant", QWEN4EXP_VARIANTS)
def test_every_tensor_is_consumed(variant, outtype):
    """Config and weights take every tensor of the file (a tensor nobody reads is a part of the model
    the forward pass would silently skip); the routed experts' bytes rows match the file's tensors."""
    g, cfg, loader, params, spec = _load(qwen4exp_model(variant, outtype))
    assert sorted(set(g.tensors) - loader.consumed) == []
    assert cfg.layer_kinds == ("linear", "attention", "linear", "attention")
    assert cfg.attention_layers == (1, 3) and cfg.n_kv_layers == 2
    assert (cfg.ple is not None) == (variant == "ple")
    assert spec.moe_layers == (0, 1, 2, 3)
    for i in range(4):
        assert spec.bytes_per_expert(i) == sum(g.tensor(n).nbytes for n in spec.tensor_names(i)) // cfg.n_experts


def test_gated_attention_matches_transformers():
    """One full-attention layer (dense QSA: every block selected) against transformers' attention
    module on the same input, with the GGUF's tensors (q+gate interleaved per head, (1 + w) norms)."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from strata_jax.model.kernels import Kernels
    from strata_jax.model.layers import gated_attention

    tm = qwen4exp_model("dense")
    g, cfg, loader, params, spec = _load(tm)
    hf = AutoModelForCausalLM.from_pretrained(str(tm.hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    B, T, layer = 2, 20, 3
    x = np.random.default_rng(1).standard_normal((B, T, cfg.d_model)).astype(np.float32)
    pos = np.arange(T)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        pe = hf.model.rotary_emb(xt, torch.from_numpy(pos)[None, None].expand(3, B, T))
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
        ref = hf.model.layers[layer].self_attn(xt, pe, attention_mask=mask)[0].numpy()
    kv = jnp.zeros((cfg.n_kv_layers, B, 32, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
    ours, k_cache, _ = gated_attention(params.layers[layer].attn, jnp.asarray(x), jnp.asarray(np.tile(pos, (B, 1))),
                                       kv, kv, 1, cfg, Kernels())
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    k_cache = np.asarray(k_cache)  # written to KV layer 1 only, at positions 0..T-1 only
    assert not k_cache[0].any() and not k_cache[1, :, T:].any() and np.abs(k_cache[1, :, :T]).min(axis=-1).all()
