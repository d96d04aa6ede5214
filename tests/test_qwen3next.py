"""qwen3next, qwen35moe and qwen35 (the seed model's relatives, model/hybrid.py without hyper-connections)
against transformers: tiny random Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM / Qwen3_5ForCausalLM
models converted by llama.cpp's converter (tests/reference_models.py, hybrid section), without MTP
weights (--no-mtp) and with one random MTP block ("-mtp")."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from safetensors.numpy import load_file

from engine_checks import assert_offloaded_matches, decode_two_rows, resident_reference
from reference_models import HYBRID_ARCHS, HYBRID_BASE_ARCHS, hf_logits, hybrid_model
from reference_models import load_weights as _load
from strata_jax.gguf.reader import GGUFFile

pytestmark = pytest.mark.slow  # converter-made models (~15 s each on a cold cache)

MOE_ARCHS = ("qwen3next", "qwen35moe")
N_TOKENS = 37  # in 16-token chunks: 16 + 16 + 5 (a padded last chunk), the recurrent state carried
REL_TOL = 1e-3  # f32: max |ours - transformers| over max |transformers|, at every position
CTX = 128


def _ids(tm, n=N_TOKENS, seed=0):
    return np.random.default_rng(seed).integers(0, tm.vocab_size - 3, n).tolist()


def _engine(tm, **kw):
    import strata_jax

    return strata_jax.load(str(tm.gguf_path), ctx=CTX, dtype="float32", prefill_chunk=16, **kw)


def _rel_err(ours, ref):
    """Per position: max |ours - ref| / max |ref|."""
    return np.abs(np.asarray(ours) - ref).max(axis=-1) / np.abs(ref).max(axis=-1)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_fixture_carries_what_the_checkpoint_says(arch):
    """The conversion keeps the layer mix, the MTP block only where the checkpoint has one, and the
    tiny vocabulary under Qwen2's pre-tokenizer."""
    tm = hybrid_model(arch)
    g = GGUFFile(tm.gguf_path)
    base = arch.removesuffix("-mtp")
    md, mtp = g.metadata, arch.endswith("-mtp")
    assert g.architecture == base
    assert md[f"{base}.block_count"] == 4 + mtp
    assert list(md[f"{base}.attention.recurrent_layers"]) == [True, False, True, False] + [False] * mtp
    assert md.get(f"{base}.nextn_predict_layers") == (1 if mtp else None)
    assert md["tokenizer.ggml.pre"] == "qwen2" and len(md["tokenizer.ggml.tokens"]) == tm.vocab_size
    assert any(n.startswith("mtp.") for n in load_file(str(next(tm.hf_dir.glob("*.safetensors"))))) == mtp


# q8_0 for the files without MTP: the MTP block's loading does not depend on the quant type
@pytest.mark.parametrize("arch, outtype", [(a, "f32") for a in HYBRID_ARCHS] + [(a, "q8_0") for a in HYBRID_BASE_ARCHS])
def test_every_tensor_is_consumed(arch, outtype):
    """Config and weights take every tensor of the file (a tensor nobody reads is a part of the model the
    forward pass would silently skip), the MTP block's routed experts shape-checked and named by its
    params (left in the file); the routed experts' byte rows match the file's tensors."""
    g, cfg, loader, params, spec = _load(hybrid_model(arch, outtype))
    assert sorted(set(g.tensors) - loader.consumed) == []
    assert all(bool(nx.expert_names) == cfg.is_moe and set(nx.expert_names) <= set(g.tensors) for nx in params.nextn)
    assert cfg.n_layers == 4 and cfg.layer_kinds == ("linear", "attention", "linear", "attention")
    assert cfg.attention_layers == (1, 3) and cfg.hc_count == 0 and cfg.qsa == () and cfg.ple is None
    assert cfg.n_nextn_layers == len(params.nextn) == arch.endswith("-mtp")
    assert cfg.tied_embeddings == (arch in ("qwen35", "qwen35-mtp"))
    if arch.removesuffix("-mtp") in MOE_ARCHS:
        assert spec.moe_layers == (0, 1, 2, 3) and cfg.shared_expert_ffn_dim == 96
        for i in range(4):
            assert spec.bytes_per_expert(i) == sum(g.tensor(n).nbytes for n in spec.tensor_names(i)) // cfg.n_experts
    else:
        assert not cfg.is_moe and cfg.moe_layers == () and cfg.ffn_dim == 96


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_dims(arch):
    """What no GGUF key says, taken per arch as llama.cpp's graphs and transformers do: the DeltaNet's
    output gate is silu, and qwen3next's value heads stay in HF's grouped order."""
    from strata_jax.gguf.reader import metadata_view
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.dims import DeltaNetDims

    tm = hybrid_model(arch)
    g = GGUFFile(tm.gguf_path)
    cfg = ModelConfig.from_gguf(g)
    base = arch.removesuffix("-mtp")
    order = "grouped" if base == "qwen3next" else "tiled"
    assert cfg.linear == DeltaNetDims.from_metadata(metadata_view(g.metadata, base), output_gate="silu",
                                                    v_head_order=order)
    assert cfg.rope_dim == 8 and cfg.rope_sections == ((2, 1, 1, 0) if base != "qwen3next" else ())


def test_nextn_block_is_loaded_not_run():
    """The MTP block's tensors are the checkpoint's (mtp.fc, the (1 + w) norms, its attention), and
    carrying it changes no logit: the trunk is the no-MTP file's, bit for bit."""
    import jax.numpy as jnp

    from strata_jax.gguf.quant import dequant

    tm = hybrid_model("qwen3next-mtp")
    _, cfg, _, params, _ = _load(tm)
    (nx,) = params.nextn
    hf = load_file(str(next(tm.hf_dir.glob("*.safetensors"))))
    np.testing.assert_array_equal(np.asarray(dequant(nx.eh_proj, jnp.float32)), hf["mtp.fc.weight"])
    np.testing.assert_allclose(np.asarray(nx.enorm_D), hf["mtp.pre_fc_norm_embedding.weight"] + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nx.hnorm_D), hf["mtp.pre_fc_norm_hidden.weight"] + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nx.shared_head_norm_D), hf["mtp.norm.weight"] + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(nx.block.attn.k_norm), hf["mtp.layers.0.self_attn.k_norm.weight"] + 1,
                               rtol=1e-6)
    assert nx.expert_names == tuple(f"blk.4.ffn_{n}_exps.weight" for n in ("gate", "up", "down"))
    ids = _ids(tm)
    np.testing.assert_array_equal(_engine(tm).logits(ids), _engine(hybrid_model("qwen3next")).logits(ids))


def test_mtp_experts_are_not_counted_as_the_caches():
    """The MTP block's routed experts stay in the file: the bytes inspect, check and the bench size the
    expert cache with are the text layers' experts, what the offloaded store holds."""
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model import memory

    tm = hybrid_model("qwen3next-mtp")
    g = GGUFFile(str(tm.gguf_path))
    m = _engine(tm, expert_slots=8)
    mtp = sum(t.nbytes for n, t in g.tensors.items() if n.startswith(f"blk.{m.config.n_layers}.") and "_exps." in n)
    assert mtp > 0 and memory.routed_expert_bytes(g) == memory.routed_expert_bytes(g, m.config) + mtp
    assert memory.routed_expert_bytes(g, m.config) == m.experts.store.nbytes


@pytest.mark.parametrize("arch", HYBRID_BASE_ARCHS)
def test_logits_match_transformers(arch):
    """Every position's logits (a prompt prefilled in chunks, the last one padded) within REL_TOL of
    transformers' fp32 forward pass."""
    tm = hybrid_model(arch)
    ids = _ids(tm)
    ours, ref = _engine(tm).logits(ids), hf_logits(tm, ids)
    err = _rel_err(ours, ref)
    print(f"{arch}: max relative logit error vs transformers {err.max():.2e}")
    assert ours.shape == ref.shape and err.max() < REL_TOL, err


def test_value_head_order_matters():
    """qwen3next read with the qwen35 (tiled) value-head order is far from transformers: the test
    above would catch a wrong order (the fixture's 4 value heads over 2 key heads make them differ)."""
    import jax
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache, forward

    tm = hybrid_model("qwen3next")
    m = _engine(tm)
    ids = _ids(tm)
    cfg = dataclasses.replace(m.config, linear=dataclasses.replace(m.config.linear, v_head_order="tiled"))
    experts = m.experts.take()
    try:
        logits = jax.jit(functools.partial(forward, cfg=cfg, dtype=jnp.float32, kernels=m.kernels, all_logits=True))(
            m.params, experts, KVCache.zeros(cfg, 1, CTX, jnp.float32), jnp.asarray([ids], jnp.int32),
            jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32))[0]
    finally:
        m.experts.put(experts)
    assert _rel_err(np.asarray(logits[0]), hf_logits(tm, ids)).max() > 20 * REL_TOL


@pytest.mark.parametrize("arch", HYBRID_BASE_ARCHS)
def test_decode_one_token_at_a_time_equals_full_forward(arch):
    """Two rows: a prefill chunk, then one token per step, row 1 idle (a position past the cache, no
    valid token) for a few steps; each row's logits at every position equal the one-pass forward of its
    sequence (and transformers')."""
    tm = hybrid_model(arch)
    m = _engine(tm)
    seqs = [_ids(tm, 24, seed=1), _ids(tm, 24, seed=2)]
    got, pos, _ = decode_two_rows(m, seqs, CTX)
    for b in range(2):
        n = pos[b]
        one_pass = m.logits(seqs[b][:n])
        np.testing.assert_allclose(np.stack(got[b]), one_pass, rtol=0, atol=1e-4 * np.abs(one_pass).max())
        assert _rel_err(got[b], hf_logits(tm, seqs[b][:n])).max() < REL_TOL


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_offloaded_equals_resident(arch):
    """Half the experts in device slots (LRU, misses fetched in the step): logits and greedy tokens are
    the all-resident run's, bit for bit."""
    tm = hybrid_model(arch)
    ids = _ids(tm)
    assert_offloaded_matches(_engine(tm, expert_slots=4 * 4, expert_pools="per-layer"), ids,
                             resident_reference(_engine(tm), ids))


def test_greedy_equals_transformers():
    """The engine's own generate loop (prefill, then the decode program) gives transformers' greedy tokens."""
    from reference_models import hf_greedy

    for arch in HYBRID_BASE_ARCHS:
        tm = hybrid_model(arch)
        ids = _ids(tm, 11, seed=3)
        got = _engine(tm, decode_chunk=4).generate(ids, max_tokens=8, temperature=0, cache_prompt=False).token_ids
        assert len(got) == 8 and got == hf_greedy(tm, ids, 8), arch


def test_prefetch_is_refused():
    import strata_jax
    from strata_jax.core.errors import ConfigError

    with pytest.raises(ConfigError, match="prefetch"):
        strata_jax.load(str(hybrid_model("qwen35moe").gguf_path), ctx=CTX, prefetch=1, expert_slots=16)
