"""KV streaming (--kv-resident, model/kvquant.py StreamedKV): a cache whose positions past the first N
live in pinned host memory, written and read back inside the step by the host-rows kernels, gives what
the all-device cache gives, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_checks import session_tokens

import strata_jax
from strata_jax.core import hostrows
from strata_jax.core.errors import ConfigError
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.session import Session
from strata_jax.model import kvquant
from strata_jax.model.layers.attention import attend

pytestmark = pytest.mark.skipif(not hostrows.available(jax.devices()[0]),
                                reason="the host-rows extension cannot be built here (no C++ compiler)")

L, B, S, K, Dh, H = 3, 2, 48, 2, 32, 4


def _filled(kind: str, resident: int | None, seed: int = 0):
    """A cache leaf (and its host part) with every position of every layer written (the same values either
    way). As the engine runs its programs, the host part goes into a jitted call beside the leaf and never
    comes out of it: returned, jit could hand back a copy at an address the kernels do not know."""
    leaf, host = kvquant.zeros((L, B, S, K, Dh), kind, jnp.float32), None
    if resident is not None:
        leaf, host = kvquant.split_host(kvquant.streamed(leaf, resident))
    vals = jax.random.normal(jax.random.PRNGKey(seed), (L, B, S, K, Dh), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    write = jax.jit(lambda leaf, host, layer, v: kvquant.split_host(kvquant.write(kvquant.join_host(leaf, host), layer,
                                                                                      pos, v))[0], static_argnums=2)
    for layer in range(L):
        leaf = write(leaf, host, layer, vals[layer])
    return leaf, host


def _read(leaf, host, layer, start, size):
    f = jax.jit(lambda leaf, host, layer, start: kvquant.read(kvquant.join_host(leaf, host), layer, start, size,
                                                              jnp.float32))
    return f(leaf, host, layer, start)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("resident", [8, 16, 40])
def test_reads_equal_the_device_cache(kind, resident):
    """Every span, static or at a traced start, straddling the resident part or not, reads the same values."""
    plain, _ = _filled(kind, None)
    streamed, host = _filled(kind, resident)
    for layer in range(L):
        for start, size in ((0, S), (0, 8), (4, 16), (resident - 4, 8), (32, 16), (S - 8, 8)):
            want = kvquant.read(plain, layer, start, size, jnp.float32)
            static = jax.jit(lambda leaf, host: kvquant.read(kvquant.join_host(leaf, host), layer, start, size,
                                                             jnp.float32))
            np.testing.assert_array_equal(static(streamed, host), want)
            # traced layer and start, as a scanned layer and a blocked read give them
            np.testing.assert_array_equal(_read(streamed, host, jnp.int32(layer), jnp.int32(start), size), want)


def test_a_read_brings_over_only_what_some_query_sees():
    """Host cells past `upto` or outside want_BSr (QSA's selected blocks) are not copied: they read as zeros;
    the device's cells and the wanted ones read as stored."""
    plain, _ = _filled("f16", None)
    streamed, host = _filled("f16", 16)
    want = np.zeros((B, S), bool)
    want[0, 20:30] = want[1, 40:44] = True
    f = jax.jit(lambda leaf, host, want: kvquant.read(kvquant.join_host(leaf, host), 1, 0, S, jnp.float32, 42, want))
    got, full = np.asarray(f(streamed, host, jnp.asarray(want))), np.asarray(kvquant.read(plain, 1, 0, S, jnp.float32))
    brought = want.copy()
    brought[:, :16] = True  # on the device
    brought[:, 42:] &= False  # past upto
    np.testing.assert_array_equal(got[brought], full[brought])
    assert not np.any(got[~brought])


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("T", [1, 12])
def test_attention_over_a_streamed_cache(block, T):
    """attend (which writes the step's keys, then reads) over a streamed cache: the outputs and every cell
    afterwards equal the all-device cache's, for decode steps and a prefill chunk, statically and blocked."""
    (kp, _), (vp, _) = _filled("q8_0", None, 1), _filled("f16", None, 2)
    (ks, kh), (vs, vh) = _filled("q8_0", 16, 1), _filled("f16", 16, 2)
    key = jax.random.PRNGKey(3)
    q = jax.random.normal(key, (B, T, H, Dh), jnp.float32)
    k_new, v_new = (jax.random.normal(jax.random.fold_in(key, i), (B, T, K, Dh), jnp.float32) for i in (1, 2))
    pos = jnp.asarray([[20], [33]], jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None]
    def step(q, k, v, kc, vc, kh, vh, layer):
        out, kc, vc = attend(q, k, v, pos, kvquant.join_host(kc, kh), kvquant.join_host(vc, vh), layer, S,
                             attn_block=block)
        return out, kvquant.split_host(kc)[0], kvquant.split_host(vc)[0]

    run = jax.jit(step, donate_argnums=(3, 4))
    for layer in (1, jnp.int32(2)):
        out_p, kp, vp = run(q, k_new, v_new, kp, vp, None, None, layer)
        out_s, ks, vs = run(q, k_new, v_new, ks, vs, kh, vh, layer)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(out_s, out_p)
        else:  # a GPU's fusions of the two programs differ: 1 ulp (measured on an H100, docs/benchmarks.md)
            np.testing.assert_allclose(out_s, out_p, rtol=1e-5, atol=1e-6)
    for layer in range(L):
        for a, b, h in ((kp, ks, kh), (vp, vs, vh)):
            np.testing.assert_array_equal(_read(b, h, layer, 0, S), kvquant.read(a, layer, 0, S, jnp.float32))


# -- the engine: --kv-resident ----------------------------------------------------------------------------


MOE = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=5)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("kvstream") / "moe.gguf", MOE)


@pytest.mark.parametrize("kv, slots", [("f16", None), ("q8_0", 8)])
def test_streamed_model_equals_the_device_cache(moe_path, kv, slots):
    """A prompt prefilled in chunks across the resident boundary, then greedy decode past it: the logits at
    every position and the tokens are the all-device cache's, bit for bit (resident and offloaded experts)."""
    ids = list(range(3, 70))
    plain = strata_jax.load(moe_path, ctx=256, kv=kv, prefill_chunk=16, expert_slots=slots)
    streamed = strata_jax.load(moe_path, ctx=256, kv=kv, prefill_chunk=16, expert_slots=slots, kv_resident=32)
    np.testing.assert_array_equal(streamed.logits(ids), plain.logits(ids))
    want = plain.generate(ids, max_tokens=12, temperature=0)
    got = streamed.generate(ids, max_tokens=12, temperature=0)
    assert got.token_ids == want.token_ids
    s = streamed._session
    assert isinstance(s._kv.k_LBSKDh, kvquant.StreamedKV) and s._kv.k_LBSKDh.resident == 32
    # telemetry: every token computed (the prompt's past the reused prefix that logits() left, then all
    # generated but the last) read positions 0 .. p
    positions = range(got.timings["cache_n"], len(ids) + 12 - 1)
    cells, near = sum(p + 1 for p in positions), sum(min(p + 1, 32) for p in positions)
    assert (got.timings["kv_cells"], got.timings["kv_cells_vram"]) == (cells, near)
    assert got.timings["kv_vram_hit"] == near / cells and "kv_vram_hit" not in want.timings
    assert streamed.kv_stats()["kv_resident"] == 32 and plain.kv_stats() == {}


GREEDY = dict(max_tokens=6, temperature=0, logprobs=True)


@pytest.mark.parametrize("kind, options", [("moe", dict(kv="q8_0")), ("qtiny", {})])
def test_a_streamed_conversation_comes_back_from_host_ram(kind, options, moe_path):
    """The conversation cache keeps a streamed row whole (device cells and host cells) and puts it back into
    both: turn 2 continues from it as a fresh prefill does. qtiny: qseed's architecture (DeltaNet, QSA)."""
    from strata_jax.bench.shapes import synthetic_model_path

    path = moe_path if kind == "moe" else synthetic_model_path("qtiny")
    warm = strata_jax.load(path, ctx=256, conversation_cache_mib=8, kv_resident=16, prefill_chunk=16, **options)
    cold = strata_jax.load(path, ctx=256, prefill_chunk=16, **options)
    first = list(range(5, 40))
    warm.generate(first, **GREEDY)
    turn2 = warm.session().cached_tokens(0) + [13, 14, 15]
    warm.generate([40, 41, 42, 43], **GREEDY)  # another conversation takes the only row
    a, b = warm.generate(turn2, **GREEDY), cold.generate(turn2, cache_prompt=False, **GREEDY)
    assert a.timings["cache_n"] == len(turn2) - 3 and warm.conversation_cache.ram.stats.hits == 1
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4)


def test_rows_forks_and_prefix_reuse_stream_each_rows_cells(moe_path):
    """Two rows at once and n=2 choices (a fork copies a row's host cells too) equal each prompt decoded
    alone on the all-device cache; the next turn reuses the row's streamed prefix."""
    m = strata_jax.load(moe_path, ctx=256, kv="q8_0", prefill_chunk=16, parallel=3, kv_resident=16)
    ref = strata_jax.load(moe_path, ctx=256, kv="q8_0", prefill_chunk=16)
    prompts = [list(range(5, 40)), list(range(40, 49))]
    alone = [ref.generate(p, max_tokens=10, temperature=0, cache_prompt=False).token_ids for p in prompts]
    s = Session(m, 3)
    assert session_tokens(s, prompts, 10) == alone
    turn2 = s.cached_tokens(0) + [7, 8, 9]
    want = ref.generate(turn2, max_tokens=6, temperature=0, cache_prompt=False)
    row, chunks = s.admit(turn2, max_tokens=6, temperature=0)
    out = [t for c in chunks for t in c.token_ids]
    while s.active_rows:
        out += [t for cs in s.step().values() for c in cs for t in c.token_ids]
    assert out == want.token_ids and row == 0
    # a fork (a second choice of a prompt: serving/engine.py) copies the row's host cells too
    fresh = list(range(60, 90))
    r0, _ = s.admit(fresh, max_tokens=5, temperature=0, cache_prompt=False)
    dst = s.fork(r0)
    r1, chunks = s.admit(fresh, max_tokens=5, temperature=0)
    got = list(chunks)
    while r1 in s.active_rows:
        got += s.step().get(r1, [])
    assert r1 == dst and got[-1].timings["cache_n"] == len(fresh) - 1
    assert [t for c in got for t in c.token_ids] == ref.generate(fresh, max_tokens=5, temperature=0, cache_prompt=False).token_ids
    s.release(r0)
    # a released request counts what it read too: here its prompt's 20 tokens, from position 0
    before = m.kv_stats()["kv_cells"]
    r2, _ = s.admit(list(range(100, 120)), max_tokens=50, temperature=0, cache_prompt=False)
    s.release(r2)
    assert m.kv_stats()["kv_cells"] - before == sum(p + 1 for p in range(20))


def test_decode_does_not_recompile_as_the_context_grows(moe_path):
    """Past the resident positions the programs are the same ones: growing the context compiles nothing."""
    from conftest import count_compiles

    m = strata_jax.load(moe_path, ctx=512, kv_resident=32, prefill_chunk=16)
    m.generate(list(range(3, 20)), max_tokens=4, temperature=0)
    with count_compiles() as compiles:
        m.generate(list(range(3, 20)) + list(range(50, 62)), max_tokens=40, temperature=0, cache_prompt=False)
    assert compiles == []


def test_the_device_holds_only_the_resident_positions(moe_path, caplog):
    """The session's device cache is kv_resident positions a layer (the context's rest is host memory), and
    the freed device memory goes to expert slots under the same budget; load's log names the trade."""
    budget = "19MiB"  # the whole-context cache leaves room for 14 of the 16 experts
    full = strata_jax.load(moe_path, ctx=4096, vram_budget=budget, vram_reserve=0)
    with caplog.at_level("INFO", logger="strata_jax"):
        streamed = strata_jax.load(moe_path, ctx=4096, vram_budget=budget, vram_reserve=0, kv_resident=256)
    assert "on the device (256 positions a layer) + 3.75 MiB in host memory for 4,096 cells" in caplog.text
    full.generate([5, 6, 7], max_tokens=2, temperature=0)
    streamed.generate([5, 6, 7], max_tokens=2, temperature=0)
    assert streamed._session.kv_bytes() * 8 < full._session.kv_bytes()
    assert streamed.cache_plan.n_slots > full.cache_plan.n_slots


@pytest.mark.parametrize("value", [0, -3, "many"])
def test_kv_resident_is_checked(value):
    from strata_jax.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="--kv-resident"):
        EngineConfig.create(flags=True, kv_resident=value)


def test_inspect_plans_the_streamed_cache(moe_path):
    """inspect --kv-resident: the device's KV bytes are the resident positions', the rest is host memory,
    and the expert slots under a budget grow by what the device no longer holds."""
    from strata_jax.engine.inspect import format_report, report
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model import memory
    from strata_jax.model.config import ModelConfig

    g = GGUFFile(moe_path)
    cfg = ModelConfig.from_gguf(g)
    full = report(g, "19MiB", ctx=4096, vram_reserve=0)
    streamed = report(g, "19MiB", ctx=4096, vram_reserve=0, kv_resident=256)
    assert streamed["kv_bytes"] == memory.kv_cache_bytes(cfg, 256, 1, 4) == full["kv_bytes"] // 16
    assert streamed["kv_bytes"] + streamed["kv_host_bytes"] == full["kv_bytes"]
    assert streamed["fixed_bytes"] == full["fixed_bytes"] - full["kv_bytes"] + streamed["kv_bytes"]
    assert "256 positions a layer on the device" in format_report(streamed)


def test_speculative_passes_over_a_streamed_cache(moe_path):
    """Verify passes write drafts' cells past the resident positions (rejected ones are overwritten later):
    greedy speculative decoding over a streamed cache gives plain decoding's tokens."""
    ids = [5, 6, 7, 8, 9] * 8 + list(range(3, 30))
    plain = strata_jax.load(moe_path, ctx=256, prefill_chunk=16)
    spec = strata_jax.load(moe_path, ctx=256, prefill_chunk=16, kv_resident=32, spec="lookup", spec_max=3)
    want = plain.generate(ids, max_tokens=24, temperature=0).token_ids
    got = spec.generate(ids, max_tokens=24, temperature=0)
    assert got.token_ids == want and got.timings["draft_passes"] > 0
