"""The quantized KV cache (model/kvquant.py) and context sizing (offload/sizing.py plan_context).

- q8_0 and q4_0 blocks are gguf-py's quantizers' bytes (ggml-quants.c's reference), with written error bounds;
- attention over a quantized cache stays within a written bound of the f16 cache's (static and blocked spans,
  GQA and keys-carry-values as MLA), and a write touches only the new positions;
- the real default model: greedy tokens unchanged with q8_0 and with 8-bit keys / 4-bit values, logit
  errors within the measured bounds written below;
- the tiny synthetic MoE with q8_0: offloaded == resident bit-exact, batched rows == alone, prefix reuse;
- a context that cannot fit is refused before weights load with the largest that can; ctx=None takes the
  trained context, cut to fit; the planner logs the KV / expert-slot trade.
"""

from __future__ import annotations

import dataclasses
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_checks import session_tokens

import strata_jax
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.inspect import format_report, report
from strata_jax.engine.session import Session
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model import kvquant, memory
from strata_jax.model.config import ModelConfig
from strata_jax.model.layers.attention import attend
from strata_jax.offload.sizing import CTX_STEP

QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=5)
DENSE = SyntheticSpec(arch="qwen2", n_layers=2, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0")


def _values(shape, seed=0):
    """Normal values at block scales from 0.01 to 30, one all-zero block and one outlier beside small values
    (Qwen2's keys have such channels)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 30, (*shape[:-1], 1)).astype(np.float32)
    x.reshape(-1, 32)[0] = 0
    x.reshape(-1, 32)[1, 5] = 200.0
    return x


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_are_gguf_py_quantizers_bytes(kind):
    x = _values((6, 4, 64))
    c = kvquant.quantize(jnp.asarray(x), kind)
    ours = np.concatenate([np.asarray(c.scale).reshape(-1, 1).view(np.uint8),
                           np.asarray(c.q).reshape(-1, 32 if kind == "q8_0" else 16).view(np.uint8)], axis=1)
    ref = gguf.quants.quantize(x.reshape(-1, 64), QTYPES[kind]).reshape(ours.shape)
    np.testing.assert_array_equal(ours, ref)
    deq = np.asarray(kvquant.dequantize(c, jnp.float32))
    np.testing.assert_array_equal(deq, gguf.quants.dequantize(ref.reshape(24, -1), QTYPES[kind]).reshape(x.shape))
    # the bounds: d the float32 scale, d16 the stored one (its rounding costs q * |d16 - d| more)
    x_YQ, err_YQ = x.reshape(-1, 32), np.abs(deq - x).reshape(-1, 32)
    d16 = np.asarray(c.scale, np.float32).reshape(-1)
    if kind == "q8_0":
        d = np.abs(x_YQ).max(-1) / 127
        bound = d / 2 + 127 * np.abs(d16 - d)
    else:
        d = np.abs(x_YQ[np.arange(len(x_YQ)), np.abs(x_YQ).argmax(-1)]) / 8
        bound = d + 8 * np.abs(d16 - d)  # the opposite sign's extreme: -8 d is exact, +8 d is not a level
    assert np.all(err_YQ.max(-1) <= bound * (1 + 1e-5) + 1e-30)
    assert np.all(deq.reshape(-1, 32)[0] == 0)  # an all-zero block: zeros, no nan


def test_kv_option_and_model_checks():
    assert [EngineConfig.create(kv=v).kv for v in ("q8_0", "q8_0,q8_0", "q8_0, q4_0")] == ["q8_0", "q8_0", "q8_0,q4_0"]
    assert kvquant.kinds("q8_0,q4_0") == ("q8_0", "q4_0") and kvquant.kinds("q4_0") == ("q4_0", "q4_0")
    model = dict(context_length=4096, is_moe=False, is_hybrid=False, ple=None)
    mla = types.SimpleNamespace(arch="deepseek2", kv_cache_dims=((1, 96 + 16), None), **model)
    with pytest.raises(ConfigError, match=r"kv='q8_0' \(--kv\) needs cached head dims in whole blocks of 32, but "
                                          r"deepseek2 caches 112 values per head; use kv='f16'"):
        EngineConfig.create(kv="q8_0").check_model(mla)
    mla.kv_cache_dims = ((1, 512 + 64), None)
    EngineConfig.create(kv="q8_0").check_model(mla)  # the real latent (576 values) takes it
    with pytest.raises(ConfigError, match=r"deepseek2's latent cache holds both in one; give one type, e.g. kv='q8_0'"):
        EngineConfig.create(kv="q8_0,q4_0").check_model(mla)


def _attend_all(kv, q_BTHDh, k_BTKDh, v_BTKDh, pos_BT, S, **kw):
    """attend() over fresh caches of type kv (K,V; v None: keys carry values), static and blocked."""
    k_kind, v_kind = kvquant.kinds(kv)
    L, (B, _, K, Dh) = 2, k_BTKDh.shape  # layer 1 is written, layer 0 must stay empty
    kc = kvquant.zeros((L, B, S, K, Dh), k_kind, jnp.float32)
    vc = None if v_BTKDh is None else kvquant.zeros((L, B, S, K, v_BTKDh.shape[-1]), v_kind, jnp.float32)
    static, kc2, _ = attend(q_BTHDh, k_BTKDh, v_BTKDh, pos_BT, kc, vc, 1, S, **kw)
    blocked, _, _ = attend(q_BTHDh, k_BTKDh, v_BTKDh, pos_BT, kc, vc, 1, S, attn_block=16, **kw)
    return np.asarray(static), np.asarray(blocked), kc2


# max |out - out_f16| over unit-normal heads (measured: 0.016 q8_0, 0.21 q4_0, 0.17 K8/V4, and 0.011, 0.20 with
# keys carrying values); the bounds are ~2x
@pytest.mark.parametrize("kv, bound, mla", [("q8_0", 0.035, False), ("q4_0", 0.45, False), ("q8_0,q4_0", 0.35, False),
                                           ("q8_0", 0.035, True), ("q4_0", 0.45, True)])  # a latent takes one type
def test_attention_over_a_quantized_cache_is_close_to_f16(kv, bound, mla):
    rng = np.random.default_rng(1)
    B, T, H, K, Dh, S = 2, 40, 4, 1 if mla else 2, 64, 64
    q = jnp.asarray(rng.standard_normal((B, T, H, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
    v = None if mla else jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
    pos = jnp.asarray([np.arange(T), np.arange(T) + 7])  # row 1 starts later: positions 0..6 stay empty
    kw = dict(v_dim=32, scale=0.1) if mla else {}
    ref, ref_blocked, _ = _attend_all("f16", q, k, v, pos, S, **kw)
    got, got_blocked, kc = _attend_all(kv, q, k, v, pos, S, **kw)
    np.testing.assert_allclose(ref_blocked, ref, atol=1e-5)
    np.testing.assert_allclose(got_blocked, got, atol=1e-5)  # blocked reads dequantize the same values
    assert np.abs(got - ref).max() <= bound, np.abs(got - ref).max()
    # what was written is the new positions quantized, and nothing else changed
    want = kvquant.dequantize(kvquant.quantize(k, kvquant.kinds(kv)[0]), jnp.float32)
    cache = np.asarray(kvquant.read(kc, 1, 0, S, jnp.float32))
    np.testing.assert_array_equal(cache[0, :T], np.asarray(want[0]))
    np.testing.assert_array_equal(cache[1, 7:7 + T], np.asarray(want[1]))
    assert not cache[1, :7].any() and not np.asarray(kvquant.read(kc, 0, 0, S, jnp.float32)).any()


# -- the real default model -------------------------------------------------------------------------------
PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
# measured on this prompt and its 16 greedy tokens against the f16 cache (float32 on CPU): max |logit error|
# 5.15 (q8_0) and 2.63 (K8/V4), mean 0.16 and 0.18, mean KL of the next-token distribution 0.033 and 0.015.
# Qwen2.5's keys hold channels near 200 beside channels near 0.3 in one block, which a shared scale
# blurs: 4-bit keys (q4_0 alone) change the first token, so the 4-bit check here is on values.
LOGIT_BOUNDS = {"q8_0": (8.0, 0.3, 0.06), "q8_0,q4_0": (5.0, 0.3, 0.03)}


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def f16_reference(qwen_gguf_path):
    m = strata_jax.load(qwen_gguf_path, ctx=512)
    g = m.generate(PROMPT, max_tokens=16, temperature=0)
    ids = m.prompt_tokens(PROMPT) + g.token_ids
    return g.token_ids, ids, m.logits(ids)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["q8_0", "q8_0,q4_0"])
def test_default_model_greedy_tokens_unchanged(qwen_gguf_path, f16_reference, kv):
    tokens, ids, ref = f16_reference
    m = strata_jax.load(qwen_gguf_path, ctx=512, kv=kv)
    if kv == "q8_0":  # the decode program's cache reads, over a real generation
        assert m.generate(PROMPT, max_tokens=16, temperature=0).token_ids == tokens
    lg = m.logits(ids)  # the prefill program's (blocked) reads, teacher-forced
    n = len(tokens)
    assert lg[-n - 1:-1].argmax(-1).tolist() == tokens
    err = np.abs(lg - ref)
    kl = (np.exp(_log_softmax(ref)) * (_log_softmax(ref) - _log_softmax(lg))).sum(-1)
    max_err, mean_err, mean_kl = LOGIT_BOUNDS[kv]
    assert err.max() <= max_err and err.mean() <= mean_err and kl.mean() <= mean_kl, (err.max(), err.mean(), kl.mean())
    assert err.max() > 0  # the cache really is quantized


# -- the tiny synthetic MoE -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("kvquant") / "moe.gguf", MOE)


def test_offloaded_equals_resident_with_q8_0(moe_path):
    ids = list(range(3, 60))
    resident = strata_jax.load(moe_path, ctx=256, kv="q8_0")
    offloaded = strata_jax.load(moe_path, ctx=256, kv="q8_0", expert_slots=8)
    assert resident.cache_plan.resident and not offloaded.cache_plan.resident
    np.testing.assert_array_equal(offloaded.logits(ids), resident.logits(ids))
    assert (offloaded.generate(ids, max_tokens=6, temperature=0).token_ids
            == resident.generate(ids, max_tokens=6, temperature=0).token_ids)


def test_rows_and_prefix_reuse_with_q8_0(moe_path):
    m = strata_jax.load(moe_path, ctx=256, kv="q8_0", prefill_chunk=16, parallel=2)
    prompts = [list(range(5, 30)), list(range(40, 49))]
    alone = [m.generate(p, max_tokens=10, temperature=0, cache_prompt=False).token_ids for p in prompts]
    s = Session(m, 2)
    assert session_tokens(s, prompts, 10) == alone
    assert isinstance(s._kv.k_LBSKDh, kvquant.QuantKV) and s._kv.k_LBSKDh.q.dtype == jnp.int8
    # the next turn reuses the row's quantized prefix and decodes what a fresh prefill does
    turn2 = s.cached_tokens(0) + [7, 8, 9]
    want = m.generate(turn2, max_tokens=6, temperature=0, cache_prompt=False)
    row, chunks = s.admit(turn2, max_tokens=6, temperature=0)
    out = [t for c in chunks for t in c.token_ids]
    while s.active_rows:
        out += [t for cs in s.step().values() for c in cs for t in c.token_ids]
    assert out == want.token_ids and row == 0 and s.cached_tokens(0)[:len(turn2)] == turn2


# -- context sizing ---------------------------------------------------------------------------------------
def _budget_for(path, kv, ctx, itemsize=4, rows=1, prefill_chunk=512, expert_slots=None):
    """The vram_budget (reserve 0) that holds exactly `ctx` KV positions beside the rest load counts."""
    g = GGUFFile(path)
    cfg = ModelConfig.from_gguf(g)
    # on this CPU load dequantizes the dense matrices to the compute dtype (itemsize bytes a value)
    other = memory.dense_weight_bytes(g, dense_itemsize=itemsize) + memory.activation_bytes(cfg, prefill_chunk)
    floor = 0
    if cfg.is_moe:
        from strata_jax.model.weights import WeightLoader, expert_spec
        from strata_jax.offload.manager import expert_floor_bytes

        floor = expert_floor_bytes(expert_spec(WeightLoader(g, cfg)), batch_rows=rows, expert_slots=expert_slots)
    return int(other + floor + memory.kv_cache_bytes(cfg, ctx, rows, itemsize, kv)), cfg


def test_a_context_that_cannot_fit_is_refused_with_the_largest_that_can(tmp_path, monkeypatch):
    path = write_synthetic_gguf(tmp_path / "dense.gguf", DENSE)
    budget, _ = _budget_for(path, "f16", 1000)  # room for 1000 positions: 768 is the largest multiple of 256

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the context was checked")

    monkeypatch.setattr("strata_jax.engine.model.load_params", no_weights)
    with pytest.raises(ConfigError, match=r"ctx 2,048 does not fit vram_budget .*: its KV cache takes 2.00 MiB beside "
                                          r".* The largest context that fits is 768: use --ctx 768"):
        strata_jax.load(path, ctx=2048, vram_budget=budget, vram_reserve=0)
    monkeypatch.undo()
    m = strata_jax.load(path, ctx=768, vram_budget=budget, vram_reserve=0)
    assert m.ctx == 768
    # q8_0 holds 32 / (34 / 4) = 3.76x the positions in the same bytes: 3,764, cut to a multiple of 256
    with pytest.raises(ConfigError, match=r"The largest context that fits is 3,584"):
        strata_jax.load(path, ctx=4096, vram_budget=budget, vram_reserve=0, kv="q8_0")
    with pytest.raises(ConfigError, match="too small for any context"):
        strata_jax.load(path, vram_budget=budget // 2, vram_reserve=0)


def test_ctx_none_takes_the_trained_context_cut_to_fit(tmp_path, caplog):
    spec = dataclasses.replace(MOE, context_length=8192)
    path = write_synthetic_gguf(tmp_path / "moe.gguf", spec)
    with caplog.at_level("INFO", logger="strata_jax"):
        assert strata_jax.load(path, prefill_chunk=16).ctx == 8192  # CPU, no budget: the trained context
    assert ("KV 8.00 MiB for 8,192 cells x 1 row (float32, the compute dtype) leaves 16 expert slots of 16; the trained context "
            "8,192; no memory limit known (no vram_budget, and the device reports none)") in caplog.text, caplog.text
    budget, _ = _budget_for(path, "q8_0", 3000, rows=2, prefill_chunk=16)
    caplog.clear()
    with caplog.at_level("INFO", logger="strata_jax"):
        m = strata_jax.load(path, vram_budget=budget, vram_reserve=0, kv="q8_0", parallel=2, prefill_chunk=16)
    assert m.ctx == 2816 and m.ctx % CTX_STEP == 0
    # the trade: what KV takes, what the expert cache gets (the fewest slots: 2 rows x top-2 per layer)
    kv_bytes = memory.kv_cache_bytes(m.config, 2816, 2, 4, "q8_0")
    line = (f"KV {kv_bytes / 2**20:.2f} MiB for 2,816 cells x 2 rows (q8_0) leaves {m.cache_plan.n_slots} expert "
            f"slots of 16; the trained context 8,192 does not fit vram_budget")
    assert line in caplog.text and "ctx 2,816 is the largest that does" in caplog.text, caplog.text
    assert m.cache_plan.n_slots >= 8  # 2 pools x 2 rows x top-2
    # `strata-jax inspect` plans the same context from the header (float32: 4-byte values, as on this CPU)
    r = report(GGUFFile(path), vram_budget=budget, vram_reserve=0, kv="q8_0", parallel=2, prefill_chunk=16,
               dtype="float32")
    assert (r["ctx"], r["kv_bytes"], r["expert_slots"]) == (2816, kv_bytes, m.cache_plan.n_slots)
    assert "kv cache      " + f"{kv_bytes / 2**20:.2f} MiB at ctx 2,816 x 2 rows (q8_0); the trained" in format_report(r)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_one_entry_write_is_a_scatter_that_drops_past_the_cache(kind):
    # a decode step's single write stays a scatter: XLA makes a one-update scatter a dynamic update reading the
    # old cell, a slice at the layer loop's index that keeps the loop out of the CUDA graphs on a GPU
    import re

    c = kvquant.zeros((3, 1, 64, 2, 32), kind, jnp.bfloat16)
    new = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, 2, 32)), jnp.float32)
    write = jax.jit(kvquant.write)
    hlo = write.lower(c, jnp.int32(1), jnp.array([[5]], jnp.int32), new).compile().as_text()
    ops = set(re.findall(r"= \S+ (scatter|dynamic-update-slice|dynamic-slice)\(", hlo))
    assert ops == {"scatter"}, ops
    got = kvquant.read(write(c, jnp.int32(1), jnp.array([[5]], jnp.int32), new), 1, 5, 1, jnp.float32)
    want = kvquant.read(kvquant.write(c, 1, jnp.array([[5, 64]], jnp.int32), jnp.concatenate(
        [new, jnp.zeros_like(new)], axis=1)), 1, 5, 1, jnp.float32)  # the two-entry path, its own reference
    np.testing.assert_array_equal(got, want)
    if kind == "f16":
        np.testing.assert_allclose(got, new.astype(jnp.bfloat16).astype(jnp.float32))
    dropped = write(c, jnp.int32(1), jnp.array([[64]], jnp.int32), new)
    for a, b in zip(jax.tree.leaves(dropped), jax.tree.leaves(c)):
        np.testing.assert_array_equal(a, b)
