"""Mixed-precision experts (--cold-experts): a miss not yet promoted is computed from the low-bit copy of
the same model, a promoted one from the cache at the model's own type. The two ends are exact: never
promoting decodes exactly what the low-bit model decodes, promoting at once what the model does (its tokens;
its logits to float32 rounding: the low-bit product, weighted zero, still changes how XLA fuses the sum)."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.offload.policies import promote

# 4 MoE layers x 64 experts, top-2; the cold copy's experts are the same values requantized to Q4_0. 32 slots a
# layer hold a 16-token prefill bucket's 32 lookups, so the prompt takes the few-token path (the lookups) too
HOT = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=128, head_dim=32, n_experts=64, expert_ffn_dim=64,
                    vocab_size=512, qtype="Q8_0", expert_qtype="Q8_0", seed=5)
SLOTS = 128
COLD = dataclasses.replace(HOT, expert_qtype="Q4_0", experts_from="Q8_0")
NEVER = -1  # every miss low-bit


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    return write_synthetic_gguf(d / "hot.gguf", HOT), write_synthetic_gguf(d / "cold.gguf", COLD)


@pytest.fixture(scope="module")
def prompt(files):
    return strata_jax.load(files[0], ctx=64).tokenize("the rain is there, so she sat on the stairs")[:12]


def _run(model, ids, n=12):
    logits = model.logits(ids)
    gen = model.generate(ids, max_tokens=n, temperature=0, logprobs=True)
    return logits, gen.token_ids, [t.logprob for t in gen.logprobs]


@pytest.mark.parametrize("scan,fetch,qmatvec", [("on", "loop", ""), ("off", "loop", ""), ("on", "kernel", ""),
                                                ("on", "loop", "1"), ("on", "pinned", "")])
def test_never_promoted_is_the_low_bit_model(files, prompt, scan, fetch, qmatvec, monkeypatch):
    """qmatvec 1: the experts through the fused kernel (its interpreter here), each pool skipping the pairs
    the other serves; its decode sums the two pools' products in one fusion, so logprobs agree to float32
    rounding there. The kernel reads both stores in host memory of our own (store.HostMemory); pinned: the
    kernel, both stores in JAX's pinned memory (STRATA_JAX_STORE=pinned)."""
    monkeypatch.setenv("STRATA_JAX_QMATVEC", qmatvec)
    if fetch == "pinned":
        monkeypatch.setenv("STRATA_JAX_STORE", "pinned")
        fetch = "kernel"
    hot, cold = files
    ref = _run(strata_jax.load(cold, ctx=64), prompt)
    m = strata_jax.load(hot, ctx=64, expert_slots=SLOTS, cold_experts=cold, promote_after=NEVER, layer_scan=scan,
                        expert_fetch=fetch)
    got = _run(m, prompt)
    np.testing.assert_array_equal(got[0], ref[0])
    assert got[1] == ref[1]
    if qmatvec:
        np.testing.assert_allclose(got[2], ref[2], rtol=0, atol=1e-5)
    else:
        assert got[2] == ref[2]
    st = m.stats()
    assert (st["store_memory"] == "registered") == (fetch == "kernel" and os.environ.get("STRATA_JAX_STORE") is None)
    assert st["hits"] == 0 and st["misses"] == st["cold_experts"] == st["lookups"] > 0 and st["cold_share"] == 1.0
    # what crossed PCIe is the low-bit rows only
    per_cold = m.experts.cold_spec.bytes_per_expert(0)
    assert st["bytes_h2d"] == st["cold_experts"] * per_cold < st["cold_experts"] * m.experts.spec.bytes_per_expert(0)


def test_promoted_at_once_is_the_model(files):
    hot, cold = files
    ref = strata_jax.load(hot, ctx=64)
    ids = ref.tokenize("the rain is there, so she sat on the stairs")
    want = _run(ref, ids)
    m = strata_jax.load(hot, ctx=64, expert_slots=SLOTS, cold_experts=cold, promote_after=0)
    got = _run(m, ids)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1] == want[1]
    np.testing.assert_allclose(got[2], want[2], atol=1e-5)
    st = m.stats()
    assert st["cold_experts"] == 0 and st["misses"] > 0 and st["cold_share"] == 0.0


def test_an_expert_used_keeps_being_promoted(files, prompt):
    """promote_after=1: while the cache has free slots every miss is admitted (the prompt's logits are the
    model's); once it is full, an expert's first miss is served low-bit and its next one admitted."""
    hot, cold = files
    m = strata_jax.load(hot, ctx=64, expert_slots=SLOTS, cold_experts=cold, promote_after=1)
    np.testing.assert_allclose(m.logits(prompt), strata_jax.load(hot, ctx=64).logits(prompt), rtol=1e-5, atol=1e-5)
    assert m.stats()["cold_experts"] == 0
    m.generate(prompt, max_tokens=24, temperature=0)
    st = m.stats()
    assert 0 < st["cold_experts"] < st["misses"] and st["hits"] > 0


def test_resident_ignores_the_cold_copy(files, caplog):
    hot, cold = files
    m = strata_jax.load(hot, ctx=64, cold_experts=cold)
    assert m.cache_plan.resident and m.experts.cold_spec is None


def test_another_model_is_refused_by_name(files, tmp_path):
    hot, _ = files
    other = write_synthetic_gguf(tmp_path / "other.gguf", dataclasses.replace(HOT, n_experts=32))
    with pytest.raises(ConfigError, match="expert count is 32, the model's is 64"):
        strata_jax.load(hot, ctx=64, expert_slots=SLOTS, cold_experts=other)
    with pytest.raises(ConfigError, match="cold_experts=.*is not a file"):
        strata_jax.load(hot, ctx=64, cold_experts=tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="promote"):
        strata_jax.load(hot, ctx=64, promote_after=-2)


@pytest.mark.parametrize("pools", ["per-layer", "shared"])
def test_simulator_equals_engine_telemetry(files, pools):
    """The simulator replays the engine's decode routing with the same promotion rule: the same hits, misses
    and low-bit serves (the prompt, over 16 tokens, streams whole layers and leaves the cache alone)."""
    from strata_jax.offload.simulate import simulate

    hot, cold = files
    m = strata_jax.load(hot, ctx=128, expert_slots=SLOTS, cold_experts=cold, promote_after=2, record_routing=True,
                        expert_pools=pools)
    ids = m.tokenize("the tea is hot and the rain is there, so she sat on the stairs to read a book")
    assert len(ids) > 16
    m.generate(ids, max_tokens=40, temperature=0)
    sim = simulate(m.routing_trace()[len(ids):], "lru", SLOTS, per_layer=pools == "per-layer", promote_after=2,
                   n_experts=64)
    st = m.stats()
    assert (sim["hits"], sim["misses"], sim["cold"]) == (st["hits"], st["misses"], st["cold_experts"])
    assert 0 < sim["cold"] < sim["misses"]


def test_promotion_rule():
    """Hits go through the cache; a miss is served low-bit until it has been so `after` times since it last
    entered the cache; after=0 promotes every miss."""
    ids = jnp.array([2, 0, -1, 3], jnp.int32)
    hit = jnp.array([False, True, False, False])
    uses, prom = promote(jnp.zeros(4, jnp.int32), ids, hit, 1)
    assert prom.tolist() == [False, True, False, False] and uses.tolist() == [0, 0, 1, 1]
    uses, prom = promote(uses, jnp.array([3, 2, 1, -1], jnp.int32), jnp.zeros(4, bool), 1)
    assert prom.tolist() == [True, True, False, False] and uses.tolist() == [0, 1, 0, 0]  # admitted: back to 0
    uses, prom = promote(jnp.zeros(4, jnp.int32), ids, hit, 0)
    assert prom.tolist() == [True, True, False, True] and uses.tolist() == [0, 0, 0, 0]
    # one free slot: the first unproven miss takes it; -1: nothing but hits, free slots or not
    uses, prom = promote(jnp.zeros(4, jnp.int32), ids, hit, 1, n_free=1)
    assert prom.tolist() == [True, True, False, False] and uses.tolist() == [0, 0, 0, 1]
    uses, prom = promote(jnp.zeros(4, jnp.int32), ids, hit, -1, n_free=4)
    assert prom.tolist() == [False, True, False, False] and uses.tolist() == [0, 0, 1, 1]


def test_the_seed_architecture_never_promoted_is_its_low_bit_model(tmp_path):
    """qwen4exp (DeltaNet, QSA, hyper-connections, PLE; its alike layers scanned): IQ3_S experts with a Q4_0 copy
    of the same values; never promoting decodes exactly the copy's logits and tokens."""
    from strata_jax.bench.shapes import SHAPES

    hot_spec = dataclasses.replace(SHAPES["qtiny"], n_experts=64, n_experts_used=2)
    hot = write_synthetic_gguf(tmp_path / "hot.gguf", hot_spec)
    cold = write_synthetic_gguf(tmp_path / "cold.gguf", dataclasses.replace(hot_spec, expert_qtype="Q4_0",
                                                                            experts_from="IQ3_S"))
    ref = strata_jax.load(cold, ctx=64)
    ids = ref.tokenize("the rain is there, so she sat on the stairs")[:12]
    want = _run(ref, ids, n=8)
    m = strata_jax.load(hot, ctx=64, expert_slots=SLOTS, cold_experts=cold, promote_after=NEVER)
    got = _run(m, ids, n=8)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:] and m.stats()["cold_share"] == 1.0


def test_batched_rows_equal_alone_when_every_miss_is_low_bit(files):
    """With -1 nothing enters the cache, so what a row computes cannot depend on its neighbours: a batch of rows
    (idle rows and staggered admissions included) decodes what each request decodes alone."""
    from strata_jax.engine.session import Session
    from test_batch import run

    hot, cold = files
    m = strata_jax.load(hot, ctx=128, expert_slots=SLOTS, cold_experts=cold, promote_after=NEVER)
    prompts = ["hello there", "the tea is hot and the rain is there, so she sat on the stairs", "a"]
    refs = [m.generate(p, max_tokens=n, temperature=0, cache_prompt=False).token_ids for p, n in zip(prompts, (9, 14, 6))]
    got = run(Session(m, 3), [(t, p, dict(max_tokens=n, temperature=0, cache_prompt=False))
                              for t, p, n in zip((0, 2, 3), prompts, (9, 14, 6))])
    assert [g["ids"] for g in got] == refs
    assert m.stats()["hits"] == 0


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe"])
def test_a_converted_model_and_its_requantized_copy(arch, tmp_path):
    """llama.cpp's converter writes a tiny transformers model (q8_0); dev/requant.py's copy has its routed
    experts requantized to Q4_0 by gguf-py and every other tensor and key as it was. The engine takes it
    as the model's low-bit copy: decode misses are served from it (its 8 experts a layer are fewer than a
    prefill bucket's lookups, so prompts stream whole layers at the model's type), and promoting at once
    is plain offloading, the model's own tokens."""
    import sys
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q, quants as gguf_quants

    from strata_jax.dev.requant import requantize_experts
    from strata_jax.gguf.reader import GGUFFile

    sys.path.insert(0, str(Path(__file__).parent))
    from reference_models import tiny_model

    hot = tiny_model(arch, "q8_0").gguf_path
    with pytest.raises(ValueError, match="gguf-py quantizes only Q4_0"):
        requantize_experts(hot, tmp_path / "iq2.gguf", "IQ2_XXS")
    cold = requantize_experts(hot, tmp_path / "q4_0.gguf", "Q4_0")
    a, b = GGUFFile(hot), GGUFFile(cold)
    assert a.metadata.keys() - {"general.file_type"} == b.metadata.keys() and a.tensors.keys() == b.tensors.keys()
    assert all(np.array_equal(np.asarray(a.metadata[k]), np.asarray(b.metadata[k])) for k in b.metadata)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        if "_exps.weight" in name:
            assert u.type_name == "Q4_0" and u.shape == t.shape
            want = gguf_quants.quantize(gguf_quants.dequantize(t.data, Q.Q8_0), Q.Q4_0)
            np.testing.assert_array_equal(u.data.reshape(want.shape), want)
        else:
            assert u.type_name == t.type_name
            np.testing.assert_array_equal(u.data, t.data)
    ids = list(range(5, 17))
    half = _routed_experts(hot) // 2
    never = strata_jax.load(hot, ctx=64, expert_slots=half, cold_experts=cold, promote_after=NEVER)
    never.generate(ids, max_tokens=8, temperature=0)
    st = never.stats()
    assert st["cold_experts"] > 0 and st["hits"] == 0
    at_once = strata_jax.load(hot, ctx=64, expert_slots=half, cold_experts=cold, promote_after=0)
    assert _run(at_once, ids)[1] == _run(strata_jax.load(hot, ctx=64), ids)[1]


def _routed_experts(path) -> int:
    """Routed experts over all MoE layers of a GGUF."""
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model.config import ModelConfig

    cfg = ModelConfig.from_gguf(GGUFFile(path))
    return cfg.n_experts * len(cfg.moe_layers)
