"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M against transformers' Qwen2ForCausalLM loaded with the
gguf-dequantized weights (fp32, CPU): logits, greedy continuations, and that decode never recompiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import strata_jax
from conftest import count_compiles
from reference_models import hf_model_from_gguf
from strata_jax.model import runs

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a hash map is in two sentences."}],
    [{"role": "user", "content": "写一个计算阶乘的 JavaScript 函数。"}],
]


@pytest.fixture(scope="module")
def qwen(qwen_gguf_path):
    return strata_jax.load(qwen_gguf_path, ctx=512)


@pytest.fixture(scope="module")
def qwen_hf(qwen_gguf_path):
    return hf_model_from_gguf(qwen_gguf_path)


def test_logits_match_transformers(qwen, qwen_hf):
    ids = qwen.prompt_tokens(CHATS[0]) + qwen.tokenize("def is_palindrome(s):\n    return", add_special=False)
    ours = qwen.logits(ids)
    with torch.no_grad():
        ref = qwen_hf(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == ref.shape == (len(ids), qwen.config.vocab_size)
    assert ours.dtype == np.float32
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=2e-5 * scale, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_projections_stack_by_ggml_type(qwen):
    """Consecutive projections of one GGML type run as one product: in Qwen2.5's Q4_K_M file q and k are
    Q5_0 and v is Q8_0 in some layers and Q5_0 in others, so a layer has one or two q/k/v products (their
    biases stacked the same way); gate and up (one type) always one. logits_match_transformers checks
    the numbers through them."""
    cfg = qwen.config
    n_groups = set()
    for i, layer in enumerate(runs.layers_of(qwen.params.layers)):
        t = {n: qwen.gguf.tensor(f"blk.{i}.attn_{n}.weight").ggml_type for n in "qkv"}
        assert t["q"] == t["k"]
        want = ((cfg.q_dim, cfg.kv_dim, cfg.kv_dim),) if t["v"] == t["k"] else ((cfg.q_dim, cfg.kv_dim), (cfg.kv_dim,))
        qkv = layer.attn.qkv
        assert qkv.sizes == want
        assert [w.shape for w in qkv.mats] == [(sum(g), cfg.d_model) for g in want]
        assert [b.shape for b in qkv.biases] == [(sum(g),) for g in want]
        assert layer.mlp.gate_up.sizes == ((cfg.ffn_dim, cfg.ffn_dim),)
        n_groups.add(len(want))
    assert n_groups == {1, 2}  # the file has both kinds of layer


def test_chunked_prefill_equals_one_pass(qwen_gguf_path, qwen):
    """Prefill in 16-token chunks (several buckets, the cache carried across calls) = one pass."""
    small = strata_jax.load(qwen_gguf_path, ctx=512, prefill_chunk=16)
    ids = qwen.tokenize("The quick brown fox jumps over the lazy dog. " * 5)
    np.testing.assert_allclose(small.logits(ids), qwen.logits(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_greedy_matches_transformers(qwen, qwen_hf, chat):
    n_new = 32
    gen = qwen.generate(CHATS[chat], max_tokens=n_new, temperature=0)
    prompt = gen.prompt_token_ids
    with torch.no_grad():
        out = qwen_hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                               eos_token_id=sorted(qwen.tokenizer.stop_ids), pad_token_id=qwen.tokenizer.eos_id)
    ref = [t for t in out[0, len(prompt):].tolist() if t not in qwen.tokenizer.stop_ids]
    assert gen.token_ids == ref[: len(gen.token_ids)]
    assert len(gen.token_ids) == len(ref)
    assert gen.text == qwen.detokenize(ref)


def test_decode_compiles_nothing_after_first_step(qwen):
    with count_compiles() as compiles:
        counts = []
        chunks = qwen.generate_stream("Count from one to one hundred: one, two, three,", max_tokens=64,
                                      temperature=0.7, seed=1, stop=None)
        n_tokens = 0
        for i, chunk in enumerate(chunks):
            n_tokens += len(chunk.token_ids)
            counts.append(len(compiles))
        assert n_tokens >= 60  # the prompt keeps the model counting, not stopping
        # counts[1] is taken after the first decode step ran; nothing compiles after it
        assert counts[-1] == counts[1], f"decode recompiled: {counts}"


def test_seed_reproduces_and_differs(qwen):
    kw = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = qwen.generate("Once upon a time", seed=7, **kw)
    b = qwen.generate("Once upon a time", seed=7, **kw)
    c = qwen.generate("Once upon a time", seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_is_cut_and_not_emitted(qwen):
    free = qwen.generate("def add(a, b):\n", max_tokens=24, temperature=0)
    assert "return" in free.text
    cut = qwen.generate("def add(a, b):\n", max_tokens=24, temperature=0, stop=["return"])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index("return")]


@pytest.mark.parametrize("kind", ["yarn"])  # linear also matches (checked by hand: +3 min of CPU for CI)
def test_rope_scaling_override_matches_transformers(qwen_gguf_path, qwen, qwen_hf, kind):
    """--rope-scaling / --rope-scale over a file without scaling (Qwen2.5-Coder's 32K): the logits of a
    1,024-token text equal transformers' Qwen2 with the same rope_parameters (YaRN: factor 4 over the
    original 32,768, its attention factor and correction range; linear: positions / 4), and differ from
    the unscaled model's by far more than the tolerance (the override is applied)."""
    import copy

    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    scaled = strata_jax.load(qwen_gguf_path, ctx=1024, rope_scaling=kind, rope_scale=4)
    assert scaled.config.context_length == 4 * 32768 and scaled.config.rope_scaling.kind == kind
    text = open(__file__.replace("tests/test_qwen_reference.py", "README.md"), encoding="utf-8").read()
    ids = scaled.tokenize(text, add_special=False)[:1024]
    ours = scaled.logits(ids)
    del scaled
    hf_cfg = copy.deepcopy(qwen_hf.config)
    hf_cfg.rope_parameters = {"rope_type": kind, "factor": 4.0, "rope_theta": hf_cfg.rope_parameters["rope_theta"]}
    if kind == "yarn":
        hf_cfg.rope_parameters["original_max_position_embeddings"] = 32768
        hf_cfg.max_position_embeddings = 4 * 32768  # transformers takes yarn's factor from this ratio
    plain = qwen_hf.model.rotary_emb
    qwen_hf.model.rotary_emb = Qwen2RotaryEmbedding(hf_cfg)
    try:
        with torch.no_grad():
            ref = qwen_hf(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        qwen_hf.model.rotary_emb = plain
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=5e-5 * scale, rtol=0)
    unscaled = qwen.logits(ids[:512]) if qwen.ctx >= 512 else None
    assert unscaled is not None and np.abs(unscaled - ours[:512]).max() > 100 * 5e-5 * scale
