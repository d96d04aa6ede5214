"""Attention in fixed KV blocks with a run-time trip count (model/layers/attention.py attend_blocked): the same
result as the static span (float32, within rounding), extra masked blocks change nothing bit for bit, the
loop stops at the furthest position, and the engine's programs do not multiply with prompt length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from conftest import count_compiles
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine import programs
from strata_jax.engine import session as session_mod
from strata_jax.model.layers.attention import attend, attend_blocked

SPEC = SyntheticSpec(arch="qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                     vocab_size=320, context_length=16384, qtype="F32", seed=11)

_attend = jax.jit(attend, static_argnames=("layer", "attn_len", "attn_block"))
_blocked = jax.jit(attend_blocked, static_argnames=("layer", "S", "block"))


def _cache(rng, L=2, B=3, S=700, K=2, Dh=16):
    return tuple(jnp.asarray(rng.standard_normal((L, B, S, K, Dh)), jnp.float32) for _ in range(2))


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("with_select", [False, True])
def test_blocked_equals_the_static_span(T, with_select):
    """Rows near the end of a cache that is not whole blocks (700 = 2 x 256 + 188: the last block is
    clamped to end at S and overlaps the one before), near its start, and idle (past the cache), with GQA
    and optionally a selection mask: the blocked heads equal the static path's for every real row."""
    rng = np.random.default_rng(T)
    B, S, K, H, Dh = 3, 700, 2, 4, 16
    k, v = _cache(rng, B=B, S=S)
    q = jnp.asarray(rng.standard_normal((B, T, H, Dh)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.array([690, 40, S])[:, None] + np.arange(T)[None, :], jnp.int32)
    select = None
    if with_select:  # a random subset, always with the query's own position (as QSA's tail block is)
        sel = rng.random((B, T, S)) < 0.3
        sel[np.arange(B)[:, None], np.arange(T)[None, :], np.minimum(np.asarray(pos), S - 1)] = True
        select = jnp.asarray(sel)
    want, kw, vw = _attend(q, kn, vn, pos, k, v, layer=1, attn_len=None, select_BTS=select)
    got, kg, vg = _attend(q, kn, vn, pos, k, v, layer=1, attn_len=None, select_BTS=select, attn_block=256)
    np.testing.assert_array_equal(np.asarray(kg), np.asarray(kw))  # the same cache writes
    np.testing.assert_array_equal(np.asarray(vg), np.asarray(vw))
    np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], rtol=1e-5, atol=1e-6)
    # attn_len clips the span the same way in both
    want, _, _ = _attend(q, kn, vn, pos, k, v, layer=0, attn_len=512, select_BTS=select)
    got, _, _ = _attend(q, kn, vn, pos, k, v, layer=0, attn_len=512, select_BTS=select, attn_block=256)
    np.testing.assert_allclose(np.asarray(got)[1], np.asarray(want)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("T", [1, 3])
def test_reading_before_the_write_equals_reading_after(monkeypatch, kv, T):
    """attention.READ_BEFORE_WRITE (few queries: each block, or the static span, is read from the cache as it
    was and the step's entries merged in as the cache stores them) gives bit for bit the heads and caches of
    reading after the scatter: plain and quantized caches, a traced layer index, a sliding window, an idle
    row, sinks."""
    from strata_jax.model import kvquant
    from strata_jax.model.layers import attention
    rng = np.random.default_rng(7)
    B, S, K, H, Dh = 3, 700, 2, 4, 32
    k, v = (kvquant.quantize(c, kv) if kv != "f16" else c for c in _cache(rng, B=B, S=S, Dh=Dh))
    q = jnp.asarray(rng.standard_normal((B, T, H, Dh)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32) for _ in range(2))
    pos = jnp.asarray(np.array([300, 255, S])[:, None] + np.arange(T)[None, :], jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)

    def run(layer, window, block):
        return jax.jit(lambda *a: attend(*a, attn_len=None, attn_block=block, window=window, sinks_H=sinks))(
            q, kn, vn, pos, k, v, layer)

    outs = {}
    for before in (False, True):
        monkeypatch.setattr(attention, "READ_BEFORE_WRITE", before)
        outs[before] = [run(jnp.int32(1), 0, 256), run(jnp.int32(0), 100, 256), run(jnp.int32(1), 0, None)]
    for want, got in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(np.asarray(got[0])[:2], np.asarray(want[0])[:2])
        for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_loop_stops_at_the_furthest_position_and_extra_blocks_change_nothing():
    """Positions past the blocks the furthest real query needs are never read (NaN there stays out),
    an idle row (position S) adds no block, and a row batched with one that needs more blocks gets its
    heads bit for bit as alone: a block it cannot see adds exactly zero."""
    rng = np.random.default_rng(0)
    S, block, H, Dh = 700, 256, 4, 16
    k, v = _cache(rng, L=1, B=3, S=S)
    q = jnp.asarray(rng.standard_normal((3, 1, H, Dh)), jnp.float32)
    near, far, idle = 300, 650, S
    pos = jnp.asarray([[near], [far], [idle]], jnp.int32)
    poisoned = [a.at[:, :2, 2 * block:].set(jnp.nan) for a in (k, v)]  # rows 0 and 1 past block 1
    out = np.asarray(_blocked(q[:1], *[a[:, :1] for a in poisoned], pos[:1], layer=0, S=S, block=block))
    assert np.isfinite(out).all()
    with_idle = np.asarray(_blocked(q[::2], *[a[:, ::2] for a in poisoned], pos[::2], layer=0, S=S, block=block))
    np.testing.assert_array_equal(with_idle[0], out[0])
    batched = np.asarray(_blocked(q[:2], k[:, :2], v[:, :2], pos[:2], layer=0, S=S, block=block))
    alone = np.asarray(_blocked(q[:1], k[:, :1], v[:, :1], pos[:1], layer=0, S=S, block=block))
    np.testing.assert_array_equal(batched[0], alone[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("span") / "qwen3.gguf", SPEC)
    return strata_jax.load(path, ctx=9216, prefill_chunk=512, dtype="float32")


def _static_spans(end, ctx, prefill, blocked_ok=True):
    return {"attn_len": session_mod.attn_bucket(end, ctx), "attn_block": None}


@pytest.mark.slow
def test_engine_logits_equal_the_static_spans(model, monkeypatch):
    """A 1,300-token prompt in 512-token chunks over 256-position blocks (six by its end), then greedy
    decode past a static cap lowered to 512: prefill logits and decode logprobs as with static spans,
    in f32."""
    monkeypatch.setattr(session_mod, "ATTN_BLOCK", 256)
    monkeypatch.setattr(session_mod, "DECODE_STATIC_SPAN", 512)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, SPEC.vocab_size, 1300)]
    assert session_mod.attn_span(len(ids) + 1, model.ctx, prefill=False)["attn_block"] == 256
    got = model.logits(ids)
    gen = model.generate(ids, max_tokens=4, temperature=0, logprobs=True, cache_prompt=False)
    monkeypatch.setattr(session_mod, "attn_span", _static_spans)
    want = model.logits(ids)
    ref = model.generate(ids, max_tokens=4, temperature=0, logprobs=True, cache_prompt=False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert gen.token_ids == ref.token_ids
    lp = lambda g: [t.logprob for t in g.logprobs]  # noqa: E731
    np.testing.assert_allclose(lp(gen), lp(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_programs_do_not_grow_with_the_prompt(model):
    """Prompts of 600, 2,000, 5,000 and 9,000 tokens (9 KV blocks): after the first, prefill compiles
    nothing (one program per token bucket: 512 and the first prompt's 128-token tail); decode compiles
    its static spans 1024 and 2048, then one blocked program past the cap that the 9,000-token prompt
    reuses."""
    rng = np.random.default_rng(2)
    sizes = []

    def run(n):
        ids = [int(t) for t in rng.integers(0, SPEC.vocab_size, n)]
        with count_compiles() as compiles:
            model.generate(ids, max_tokens=3, temperature=0, cache_prompt=False)
        sizes.append((programs.prefill._cache_size(), programs.decode._cache_size()))
        return len(compiles)

    run(600)
    assert run(2000) == 1  # the 2048 decode span
    assert run(5000) == 1  # the blocked decode program
    assert run(9000) == 0
    assert [s[0] for s in sizes] == [sizes[0][0]] * 4
    assert [s[1] - sizes[0][1] for s in sizes] == [0, 1, 2, 2]
