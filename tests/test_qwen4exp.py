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
