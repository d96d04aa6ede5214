"""Every supported architecture against transformers: tiny random models, converted to GGUF by
llama.cpp's own convert_hf_to_gguf.py (f32 and q8_0), logits and greedy decoding compared with the
PyTorch model in fp32."""

from __future__ import annotations

import numpy as np
import pytest

import strata_jax
from reference_models import TINY_ARCHS, hf_greedy, hf_logits, hf_quantized_model, tiny_model

pytestmark = pytest.mark.slow


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, min(vocab, 30000), n).tolist()


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_f32_logits_match(arch):
    tm = tiny_model(arch, "f32")
    model = strata_jax.load(tm.gguf_path, ctx=128, dtype="float32")
    assert model.config.arch == tm.gguf_arch
    ids = _ids(model.config.vocab_size, 40, seed=1)
    ref = hf_logits(tm.hf_dir, ids)
    ours = model.logits(ids)
    assert ours.shape == ref.shape
    assert _rel_err(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_q8_0_logits_match_dequantized_reference(arch):
    """q8_0 file vs the same transformers model holding exactly the file's (dequantized) weights."""
    tm = tiny_model(arch, "q8_0")
    model = strata_jax.load(tm.gguf_path, ctx=128, dtype="float32")
    ids = _ids(model.config.vocab_size, 40, seed=2)
    ref = hf_logits(hf_quantized_model(arch, "q8_0"), ids)
    ours = model.logits(ids)
    assert _rel_err(ours, ref) < 1e-4
    # and the quantized model stays close to the fp32 original (q8_0 error, not an engine error)
    fp32 = hf_logits(tm.hf_dir, ids)
    assert np.corrcoef(ours.ravel(), fp32.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral", "olmoe"])
def test_in_jit_dequant_equals_load_time_dequant(arch):
    """The GPU path (GGML blocks on device, dequantized per step) = the CPU default (dequantized once)."""
    tm = tiny_model(arch, "q8_0")
    ids = _ids(tm.vocab_size, 20, seed=3)
    a = strata_jax.load(tm.gguf_path, ctx=64, dequantize_dense=True).logits(ids)
    b = strata_jax.load(tm.gguf_path, ctx=64, dequantize_dense=False).logits(ids)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_decode_matches(arch):
    """Decode runs the few-token MoE path (only the routed experts' blocks gathered), prefill the
    all-experts path; both must agree with transformers token for token."""
    tm = tiny_model(arch, "f32")
    model = strata_jax.load(tm.gguf_path, ctx=128, dtype="float32")
    prompt = _ids(model.config.vocab_size, 12, seed=4)
    ref = hf_greedy(tm.hf_dir, prompt, 16)
    gen = model.generate(prompt, max_tokens=16, temperature=0)
    n = len(gen.token_ids)
    assert gen.token_ids == ref[:n]
    if gen.finish_reason == "stop":  # the model chose a stop token, which is not returned
        assert ref[n] in model.tokenizer.stop_ids
    else:
        assert n == 16
