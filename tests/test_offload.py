"""Offloading changes where experts live, never what the model computes: with any policy and any cache
size from the minimum to all experts, logits and generated tokens equal the all-resident run exactly
(the same jitted math reads the same bytes from a slot instead of its resident copy)."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

import strata_jax
from conftest import count_compiles
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.core.errors import ConfigError
from strata_jax.core.layer_ref import LayerRef
from strata_jax.offload.policies import POLICIES
from strata_jax.model import runs

# 4 MoE layers x 8 experts, top-2; odd layers' down projections in another type -> two slot pools
SPEC = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=128, head_dim=32, expert_ffn_dim=64, vocab_size=512,
                     qtype="Q8_0", expert_qtype="Q8_0", odd_down_qtype="Q4_0", seed=3)
PROMPT = "the tea is hot and the rain is there, so she sat on the stairs to read"


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("offload") / "moe.gguf", SPEC)


@pytest.fixture(scope="module")
def reference(moe_path):
    m = strata_jax.load(moe_path, ctx=128)
    ids = m.tokenize(PROMPT)
    return ids, m.logits(ids), m.generate(ids, max_tokens=24, temperature=0).token_ids


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("pools,slots,scan", [("shared", 4, "on"), ("shared", 6, "on"), ("shared", 12, "on"),
                                              ("shared", 24, "on"), ("per-layer", 8, "on"), ("per-layer", 12, "on"),
                                              ("per-layer", 24, "on"), ("per-layer", 12, "off")])
def test_offloaded_equals_resident(moe_path, reference, policy, pools, slots, scan):
    """Every policy and pool layout decodes the resident tokens. Per-layer caches with the layer scan on
    are blocks of one pool per expert row layout (the model's two), each layer's state stacked; off, a
    pool of its own per layer."""
    ids, ref_logits, ref_tokens = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=slots, policy=policy, expert_pools=pools, layer_scan=scan)
    assert not m.cache_plan.resident and m.cache_plan.n_slots == slots
    table = m.experts.slots
    assert len(table.pools) == (4 if (pools, scan) == ("per-layer", "off") else 2)
    assert table.block == ((slots // 4,) * 2 if (pools, scan) == ("per-layer", "on") else (0,) * len(table.pools))
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    gen = m.generate(ids, max_tokens=24, temperature=0)
    assert gen.token_ids == ref_tokens
    st = m.stats()
    assert st["lookups"] == st["hits"] + st["misses"] > 0
    assert st["misses"] > 0  # fewer slots than experts: something had to move
    assert st["bytes_h2d"] > 0 and st["prefill_streamed_experts"] > 0


def test_all_slots_is_resident(moe_path, reference):
    ids, ref_logits, _ = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=32)
    assert m.cache_plan.resident
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    # resident hits are counted for all layers at once after the layer loop: one token's k distinct
    # experts per MoE layer per decode step, as the offloading path counts them
    m.reset_stats()
    m.generate(ids, max_tokens=6, temperature=0)
    cfg = m.config
    st = m.stats()
    assert st["hits"] == st["lookups"] == 5 * len(cfg.moe_layers) * cfg.n_experts_used and st["misses"] == 0


def test_hit_rate_grows_with_slots(moe_path, reference):
    ids, _, _ = reference
    rates = []
    for slots in (8, 12, 16, 24):
        m = strata_jax.load(moe_path, ctx=128, expert_slots=slots)
        m.generate(ids, max_tokens=32, temperature=0)
        rates.append(m.stats()["hit_rate"])
    assert rates == sorted(rates) and rates[-1] > rates[0]


def test_too_few_slots_is_a_clear_error(moe_path):
    with pytest.raises(ConfigError, match="at least 4"):  # two shared pools x top-2
        strata_jax.load(moe_path, ctx=128, expert_slots=3, expert_pools="shared")
    with pytest.raises(ConfigError, match="at least 8"):  # a pool per layer: 4 x top-2
        strata_jax.load(moe_path, ctx=128, expert_slots=7)
    with pytest.raises(ConfigError, match="expert_pools='per-expert' is invalid"):
        strata_jax.load(moe_path, ctx=128, expert_slots=8, expert_pools="per-expert")
    with pytest.raises(ConfigError, match="smallest budget that works is"):
        strata_jax.load(moe_path, ctx=128, vram_budget="1MiB")


def test_unknown_policy(moe_path):
    with pytest.raises(ConfigError, match="unknown cache policy 'mru'.*lru"):
        strata_jax.load(moe_path, ctx=128, expert_slots=8, policy="mru")


def test_budget_sizes_the_cache(moe_path, caplog):
    plan = strata_jax.load(moe_path, ctx=128).cache_plan  # fully resident; tells the fixed and per-expert bytes
    budget = plan.fixed_bytes + int(10.5 * plan.avg_expert_bytes)
    with caplog.at_level(logging.INFO, logger="strata_jax"):
        m = strata_jax.load(moe_path, ctx=128, vram_budget=budget, vram_reserve=0)
    assert not m.cache_plan.resident and m.cache_plan.n_slots == 10
    assert "expert cache:" in caplog.text and "-> 10 slots (31% of 32 experts), offloading" in caplog.text


def test_pinned_memory_failure_falls_back_to_pageable(moe_path, reference, monkeypatch, caplog):
    """If pinned host memory cannot be had, experts go to pageable memory with a warning naming the cost."""
    real_put = jax.device_put

    def put(x, dst=None, *a, **kw):
        if getattr(dst, "memory_kind", None) == "pinned_host":
            raise RuntimeError("RESOURCE_EXHAUSTED: could not allocate pinned host memory")
        return real_put(x, dst, *a, **kw)

    monkeypatch.setattr(jax, "device_put", put)
    with caplog.at_level(logging.WARNING, logger="strata_jax"):
        m = strata_jax.load(moe_path, ctx=128, expert_slots=8)
    monkeypatch.undo()
    assert m.experts.store.memory_kind == "unpinned_host"
    assert "falling back to unpinned_host" in caplog.text and "ulimit -l" in caplog.text
    ids, ref_logits, _ = reference
    np.testing.assert_array_equal(m.logits(ids), ref_logits)


def test_routing_trace_records_every_token(moe_path, reference):
    ids, _, _ = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=8, record_routing=True)
    gen = m.generate(ids, max_tokens=10, temperature=0)
    trace = m.routing_trace()
    # prompt tokens + every generated token fed back through the model (all but the last one sampled)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 10
    assert trace.shape == (len(ids) + 10 - 1, 4, 2)
    assert trace.min() >= 0 and trace.max() < 8


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu"])
@pytest.mark.parametrize("pools", ["shared", "per-layer"])
def test_simulator_equals_engine_telemetry(tmp_path, policy, pools):
    """The simulator replays the engine's own routing trace through the same policy functions: the same
    hits and misses, layer by layer (prefetch off: the simulator models demand fetches); a shared pool
    is simulate's one cache, per-layer pools its per_layer=True."""
    from strata_jax.offload import simulate

    path = write_synthetic_gguf(tmp_path / "uniform.gguf", SyntheticSpec(
        arch="qwen3moe", n_layers=4, d_model=128, head_dim=32, expert_ffn_dim=64, vocab_size=512, qtype="Q8_0",
        seed=5))
    slots = 10 if pools == "shared" else 12
    m = strata_jax.load(path, ctx=128, expert_slots=slots, policy=policy, prefetch=False, record_routing=True,
                        expert_pools=pools)
    ids = m.tokenize(PROMPT)
    m.generate(ids, max_tokens=40, temperature=0)
    decode_trace = m.routing_trace()[len(ids):]  # prefill streams whole layers and leaves the cache alone
    sim = simulate(decode_trace, policy, slots, per_layer=pools == "per-layer")
    st = m.stats()
    assert (sim["hits"], sim["misses"]) == (st["hits"], st["misses"])
    np.testing.assert_allclose(sim["per_layer_hit_rate"], st["per_layer_hit_rate"])


@pytest.mark.parametrize("slots,chunk", [(None, 1), (8, 1), (None, 16), (8, 16)])
def test_second_request_compiles_nothing(moe_path, slots, chunk):
    """State fed back from a jitted step must hit the same compiled program (committed arrays on both
    calls), so a repeated request shape compiles nothing, resident or offloading. With chunks of 16 the
    warm-up requests run one chunk each, and the longer request's second chunk takes the state the first
    returned: the state a request starts with must be the same kind of array."""
    m = strata_jax.load(moe_path, ctx=128, expert_slots=slots, decode_chunk=chunk)
    m.tokenizer.stop_ids = frozenset()
    ids = m.tokenize(PROMPT)
    m.generate(ids, max_tokens=4, temperature=0)
    m.generate(ids, max_tokens=4, temperature=0)  # a repeat reuses the cached prompt: one-token prefill
    m.generate(ids, max_tokens=4, temperature=0.9, seed=1)  # the sampling mode's decode program
    m.logits(ids)
    with count_compiles() as compiles:
        m.reset_stats()
        m.generate(ids, max_tokens=8, temperature=0.5, seed=3)
        m.generate(ids, max_tokens=40, temperature=0, cache_prompt=False)
        m.logits(ids)
    assert compiles == []
    assert m.host_timing()["decode_calls"] == (7 + 39 if chunk == 1 else 1 + 3)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_prefetch_depth_keeps_logits_and_tokens(moe_path, reference, depth):
    ids, ref_logits, ref_tokens = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=8, prefetch=depth)
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.generate(ids, max_tokens=24, temperature=0).token_ids == ref_tokens
    st = m.stats()
    assert st["prefetch"] == depth
    assert (st["prefetched"] > 0) == (depth > 0)
    assert (st["prefetch_precision"] is None) == (depth == 0)


def test_prefetch_depth_must_be_a_depth(moe_path):
    with pytest.raises(ConfigError, match="prefetch=-1 is invalid"):
        strata_jax.load(moe_path, ctx=128, expert_slots=8, prefetch=-1)


def test_transfer_telemetry(moe_path, reference):
    ids, _, _ = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=8)
    m.generate(ids, max_tokens=16, temperature=0)
    st = m.stats()
    assert st["fetch_us_per_expert"] > 0 and st["link_GB_per_s"] > 0
    assert st["steps"] == 15 + 1  # decode steps (the first token comes out of prefill) + one prefill chunk
    assert 0 < st["transfer_stall_seconds"] < st["step_seconds"]
    assert st["h2d_GB_per_s"] == pytest.approx(st["bytes_h2d"] / st["step_seconds"] / 1e9)
    m.reset_stats()
    assert m.stats()["step_seconds"] == 0 and m.stats()["transfer_stall_seconds"] == 0


def test_static_policy_from_a_saved_trace_spans_both_pools(moe_path, reference, tmp_path):
    ids, ref_logits, ref_tokens = reference
    rec = strata_jax.load(moe_path, ctx=128, record_routing=True)
    rec.generate(ids, max_tokens=24, temperature=0)
    trace = rec.routing_trace()  # [tokens, 4 MoE layers, k]: one profile for the model's two pools
    np.save(tmp_path / "trace.npy", trace)
    m = strata_jax.load(moe_path, ctx=128, expert_slots=8, policy=f"static:{tmp_path / 'trace.npy'}",
                        expert_pools="shared")
    assert len(m.experts.slots.pools) == 2
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.generate(ids, max_tokens=24, temperature=0).token_ids == ref_tokens
    # each pool's cache was seeded with its own layers' rows of the whole-model profile
    prof = np.asarray(m.experts.slots.caches[1].meta["profile_LE"])
    from strata_jax.offload.policies import usage_profile
    full = usage_profile(trace, trace.shape[1], 8)
    np.testing.assert_array_equal(prof, full[[i for i, p in enumerate(m.experts.slots.layer_pool) if p == 1]])
    with pytest.raises(ConfigError, match="cannot read the static policy's profile"):
        strata_jax.load(moe_path, ctx=128, expert_slots=8, policy=f"static:{tmp_path / 'missing.npy'}")


def test_static_policy_per_layer_pools_take_their_rows(moe_path, reference):
    ids, ref_logits, _ = reference
    prof = np.arange(32, dtype=np.float32).reshape(4, 8)
    from strata_jax.offload.policies import static_policy
    m = strata_jax.load(moe_path, ctx=128, expert_slots=12, policy=static_policy(prof))
    table = m.experts.slots
    for i, (p, j) in enumerate(zip(table.layer_pool, table.layer_local)):  # stacked per layer: [layers, 1, E]
        np.testing.assert_array_equal(np.asarray(table.caches[p].meta["profile_LE"][j]), prof[i:i + 1])
    np.testing.assert_array_equal(m.logits(ids), ref_logits)


@pytest.mark.parametrize("slots", [None, 8])
def test_decode_chunk_size_changes_nothing_but_the_calls(moe_path, reference, slots):
    """Decoding 1, 3 or 16 steps per jitted call (the loop over tokens on the device) gives the same
    tokens, logprobs, cache decisions and routing, also under a replayed routing trace: the chunk only
    changes how often the host launches."""
    ids, _, ref_tokens = reference
    rng = np.random.default_rng(1)
    trace = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(4)]) for _ in range(40)])
    runs = []
    for chunk in (1, 3, 16):
        m = strata_jax.load(moe_path, ctx=128, expert_slots=slots, decode_chunk=chunk, record_routing=True)
        m.tokenizer.stop_ids = frozenset()  # every request runs to max_tokens: the call counts are known
        greedy = m.generate(ids, max_tokens=24, temperature=0)
        sampled = m.generate(ids, max_tokens=10, temperature=0.9, seed=4, logprobs=True, top_logprobs=2,
                             presence_penalty=0.5, cache_prompt=False)
        m.force_routing(trace)
        forced = m.generate(ids, max_tokens=7, temperature=0, cache_prompt=False)
        host, st = m.host_timing(), m.stats()
        assert greedy.token_ids == ref_tokens
        assert host["decode_steps"] == 23 + 9 + 6
        assert host["decode_calls"] == sum(-(-n // chunk) for n in (23, 9, 6))
        routing = m.routing_trace()
        np.testing.assert_array_equal(routing[-6:], trace[np.arange(len(ids), len(ids) + 6) % 40])
        runs.append((sampled.token_ids, [lp.logprob for lp in sampled.logprobs], forced.token_ids,
                     st["hits"], st["misses"], routing))
    for run in runs[1:]:
        assert run[0] == runs[0][0] and run[2] == runs[0][2] and run[3:5] == runs[0][3:5]
        np.testing.assert_allclose(run[1], runs[0][1], atol=1e-5)
        np.testing.assert_array_equal(run[5], runs[0][5])


def test_forced_routing_replays_the_trace_and_keeps_offloading_exact(moe_path, reference):
    """A replayed routing trace drives the cache (benchmarks' realistic routing): the routed experts are
    the trace's, and offloaded logits still equal the resident run under the same forced routing."""
    ids, _, _ = reference
    rng = np.random.default_rng(0)
    trace = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(4)]) for _ in range(16)])
    res = strata_jax.load(moe_path, ctx=128, record_routing=True)
    res.force_routing(trace)
    ref = res.logits(ids)
    got = res.routing_trace()
    np.testing.assert_array_equal(got, trace[np.arange(len(ids)) % 16])
    off = strata_jax.load(moe_path, ctx=128, expert_slots=8)
    off.force_routing(trace)
    np.testing.assert_array_equal(off.logits(ids), ref)
    assert off.generate(ids, max_tokens=8, temperature=0).token_ids == res.generate(ids, max_tokens=8,
                                                                                     temperature=0).token_ids
    res.force_routing(None)
    assert not np.array_equal(res.logits(ids), ref)
    with pytest.raises(ConfigError, match=r"must be \[tokens, 4, 2\]"):
        res.force_routing(trace[:, :3])


def test_grouped_prefill_equals_dense(moe_path):
    """The GPU prefill formulation (tokens grouped by expert, ragged_dot) computes what the dense masked
    product computes, on the real slot pool of a loaded model."""
    import jax.numpy as jnp

    from strata_jax.model.layers import moe
    from strata_jax.model.kernels import Kernels

    m = strata_jax.load(moe_path, ctx=128)
    cfg, experts = m.config, m.experts.take()
    try:
        for layer in (0, 1):  # the two pools (odd layers' down projections are Q4_0)
            rng = np.random.default_rng(layer)
            x_ND = jnp.asarray(rng.normal(size=(40, cfg.d_model)), jnp.float32)
            w_Nk, ids_Nk = moe.route(x_ND, runs.layers_of(m.params.layers)[cfg.moe_layers[layer]].moe.router_ED, cfg)
            grouped = moe._experts_grouped(x_ND, w_Nk, ids_Nk, experts.layer(layer), jnp.float32, cfg.n_experts)
            dense = moe._experts_dense(x_ND, w_Nk, ids_Nk, experts, layer, jnp.float32, cfg.n_experts,
                                       cfg.expert_ffn_dim)
            np.testing.assert_allclose(grouped, dense, rtol=2e-5, atol=2e-5)
    finally:
        m.experts.put(experts)
    assert moe._many_token_impl(Kernels(moe_prefill="grouped")) is moe._experts_grouped
    assert moe._many_token_impl(Kernels()) is moe._experts_dense
    with pytest.raises(ValueError, match="moe_prefill='sparse'"):
        Kernels(moe_prefill="sparse")


def test_a_prefill_reads_the_cached_experts_in_place(moe_path):
    """Kernels.prefill_cached: a many-token step takes the experts its cache holds from their slots and
    copies only the others from the store. The logits are those of copying them all (the same bytes), and
    the streamed count is only what was not cached: after a decode has filled the cache, fewer."""
    import dataclasses

    from strata_jax.model.kernels import Kernels

    ids = list(range(3, 40))
    ref = strata_jax.load(moe_path, ctx=128, expert_slots=10)
    on = strata_jax.load(moe_path, ctx=128, expert_slots=10, kernels=dataclasses.replace(Kernels(), prefill_cached="on"))
    assert not on.cache_plan.resident
    for m in (ref, on):
        m.generate(ids[:6], max_tokens=6, temperature=0)  # a decode fills part of each layer's cache
        m.reset_stats()
    np.testing.assert_array_equal(on.logits(ids), ref.logits(ids))
    total = on.config.n_experts * len(on.config.moe_layers)
    assert ref.experts.counters()[:, 2].sum() == total  # every expert streamed
    assert 0 < on.experts.counters()[:, 2].sum() <= total - 10 + len(on.config.moe_layers)
    with pytest.raises(ValueError, match="prefill_cached"):
        Kernels(prefill_cached="yes")


def test_short_prompt_routing_more_experts_than_a_pool_holds(tmp_path):
    """A 16-token prefill bucket at top-2 can route 32 experts of 64 at once, more than a per-layer pool
    of 8 slots: it must stream the layer like a long prompt (it used to fail in the policy: '32 experts
    requested at once but the cache has only 8 slots'), and compute what the resident model does."""
    spec = SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=64, head_dim=16, n_experts=64, n_experts_used=2,
                         expert_ffn_dim=32, vocab_size=320, qtype="Q8_0", seed=11)
    path = write_synthetic_gguf(tmp_path / "wide.gguf", spec)
    ids = list(range(3, 13))
    ref = strata_jax.load(path, ctx=64)
    m = strata_jax.load(path, ctx=64, expert_slots=16)
    assert m.cache_plan.slots_per_pool == (8, 8)
    np.testing.assert_allclose(m.logits(ids), ref.logits(ids), rtol=0, atol=1e-5)
    assert m.generate(ids, max_tokens=8, temperature=0).token_ids == ref.generate(ids, max_tokens=8,
                                                                                 temperature=0).token_ids


def _file_rows(path, block: int) -> np.ndarray:
    """uint8 [E, P]: block `block`'s experts as the file holds them, read with gguf-py (not our reader):
    each expert's gate, up and down bytes back to back."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    blocks = [np.asarray(tensors[f"blk.{block}.{n}.weight"].data) for n in ("ffn_gate_exps", "ffn_up_exps",
                                                                             "ffn_down_exps")]
    return np.concatenate([b.reshape(b.shape[0], -1) for b in blocks], axis=1)


@pytest.mark.parametrize("task_bytes", [None, 700])
def test_store_equals_the_file_bytes(moe_path, monkeypatch, task_bytes):
    """Each MoE layer's store rows are its experts' gate, up and down bytes as the file holds them; layers
    of one row layout share one [layers, E, P] array (the two here: odd layers' down is Q4_0). With
    small copy tasks every tensor is split over many tasks (a run of experts each), so a task boundary
    that skipped or repeated an expert would show."""
    from strata_jax.offload import store as store_mod

    if task_bytes is not None:
        monkeypatch.setattr(store_mod, "TASK_BYTES", task_bytes)
    m = strata_jax.load(moe_path, ctx=128, expert_slots=8)
    store = m.experts.store
    assert store.memory_kind in ("pinned_host", "unpinned_host")
    assert [g.shape[:2] for g in store.groups] == [(2, 8), (2, 8)]
    assert store.layer_group == (0, 1, 0, 1) and store.layer_local == (0, 0, 1, 1)
    assert store.parts[0] != store.parts[1]
    assert all(g.sharding.memory_kind == store.memory_kind for g in store.groups)
    want = [_file_rows(moe_path, block) for block in m.config.moe_layers]
    for i, rows in enumerate(want):
        assert len({r.tobytes() for r in rows}) == len(rows)  # distinct experts: a swap would show
        np.testing.assert_array_equal(np.asarray(store.layer(i).data), rows)
    # what a scanned step reads: rows through the dynamic slice, the layer a traced LayerRef of its group
    read = jax.jit(lambda s, at, e, ids: s.rows(LayerRef(ids, at), e, 3), static_argnums=3)
    for ids in ((0, 2), (1, 3)):
        for at, i in enumerate(ids):
            np.testing.assert_array_equal(np.asarray(read(store, at, 4, ids))[0], want[i][4:7])


@pytest.mark.parametrize("pools", ["shared", "per-layer"])
def test_step_arguments_do_not_grow_with_layers(tmp_path, pools):
    """The store is one array per row layout (one here), so the store and the step's whole expert argument
    (the provider as a step takes it) have as many leaves at 8 MoE layers as at 2."""
    leaves, layers = {}, {}
    for n in (2, 8):
        spec = SyntheticSpec(arch="qwen3moe", n_layers=n, d_model=64, head_dim=16, expert_ffn_dim=32,
                             vocab_size=320, qtype="Q8_0", expert_qtype="Q8_0", seed=1)
        m = strata_jax.load(write_synthetic_gguf(tmp_path / f"m{n}.gguf", spec), ctx=64, expert_slots=2 * n,
                            expert_pools=pools)
        assert not m.cache_plan.resident and len(m.config.moe_layers) == n
        experts = m.experts.take()
        try:
            leaves[n] = (len(jax.tree.leaves(experts.store)), len(jax.tree.leaves(experts)))
            layers[n] = [g.shape[0] for g in experts.store.groups]
        finally:
            m.experts.put(experts)
    assert leaves[2][0] == 1 and leaves[2] == leaves[8], leaves
    assert layers == {2: [2], 8: [8]}, layers


@pytest.mark.parametrize("pools,slots,scan", [("shared", 6, "on"), ("per-layer", 8, "on"), ("per-layer", 12, "off")])
def test_fetch_kernel_equals_resident(moe_path, reference, pools, slots, scan, monkeypatch):
    """The misses copied by one call of the fetch kernel per layer (core/hostrows.py; on CPU its
    memcpy build, the same call and addresses as the CUDA one) decode the resident tokens, fetching the
    same experts as the loop of copies does."""
    from strata_jax.core import hostrows

    if not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(jax.devices()[0])}")
    ids, ref_logits, ref_tokens = reference
    got = {}
    for fetch in ("kernel", "loop"):
        # the kernel reading JAX's pinned memory (our own memory, the default, is the test below)
        monkeypatch.setenv("STRATA_JAX_STORE", "pinned")
        m = strata_jax.load(moe_path, ctx=128, expert_slots=slots, expert_pools=pools, layer_scan=scan,
                            expert_fetch=fetch)
        assert m.experts.fetch_kernel == (fetch == "kernel")
        assert bool(m.experts.store.addr) == (fetch == "kernel") and m.experts.store.memory_kind != "registered"
        np.testing.assert_array_equal(m.logits(ids), ref_logits)
        assert m.generate(ids, max_tokens=24, temperature=0).token_ids == ref_tokens
        st = m.stats()
        assert st["misses"] > 0 and st["expert_fetch"] == fetch
        got[fetch] = (st["hits"], st["misses"], np.asarray(m.experts.slots.pools[0].data))
    assert got["kernel"][:2] == got["loop"][:2]
    np.testing.assert_array_equal(got["kernel"][2], got["loop"][2])  # the same bytes in the same slots


@pytest.mark.parametrize("mode", ["registered", "mapped"])
@pytest.mark.parametrize("pools,slots,scan", [("shared", 6, "on"), ("per-layer", 12, "off")])
def test_own_store_equals_resident(moe_path, reference, pools, slots, scan, mode, monkeypatch):
    """Where the kernel fetches, the store is in host memory of our own (store.HostMemory, the default), or the
    model file itself mapped (STRATA_JAX_STORE=mapped: each expert's row three pieces of the file), read by
    address only: it holds the file's rows, and decodes (prefill streamed from it too) the resident logits and
    tokens."""
    from strata_jax.core import hostrows
    from strata_jax.offload.store import FileMapping, HostMemory

    if not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(jax.devices()[0])}")
    if mode == "mapped":
        monkeypatch.setenv("STRATA_JAX_STORE", "mapped")
    else:
        monkeypatch.delenv("STRATA_JAX_STORE", raising=False)
    ids, ref_logits, ref_tokens = reference
    m = strata_jax.load(moe_path, ctx=128, expert_slots=slots, expert_pools=pools, layer_scan=scan,
                        expert_fetch="kernel")
    store = m.experts.store
    assert store.memory_kind == mode and store.groups == () and len(store.addr) == 2
    mems = m.experts._host_memory
    if mode == "registered":
        assert len(mems) == 2 and all(isinstance(x, HostMemory) for x in mems)
        for i, block in enumerate(m.config.moe_layers):  # the file's rows, where the kernel reads them
            view = mems[store.layer_group[i]].view()
            np.testing.assert_array_equal(view[store.layer_local[i]], _file_rows(moe_path, block))
    else:
        assert [type(x) for x in mems] == [FileMapping] and [len(w) for w in store.widths] == [3, 3]
        assert all(a.shape == (2, 3, 2) for a in store.addr)  # per group: 2 layers x 3 tensors
    np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.generate(ids, max_tokens=24, temperature=0).token_ids == ref_tokens
    st = m.stats()
    assert st["misses"] > 0 and st["store_memory"] == mode


def test_registered_store_falls_back_by_name(moe_path, reference, monkeypatch, caplog):
    """Memory that cannot be page-locked (a low `ulimit -l`): the store goes into JAX's pinned memory, says
    why, and decodes the same."""
    from strata_jax.core import hostrows

    if not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(jax.devices()[0])}")
    monkeypatch.setattr(hostrows, "register", lambda ptr, n, device, read_only=False: "out of memory")
    ids, ref_logits, _ = reference
    with caplog.at_level(logging.WARNING, logger="strata_jax"):
        m = strata_jax.load(moe_path, ctx=128, expert_slots=8, expert_fetch="kernel")
        np.testing.assert_array_equal(m.logits(ids), ref_logits)
    assert m.experts.store.memory_kind in ("pinned_host", "unpinned_host")
    assert "could not page-lock" in caplog.text and "out of memory" in caplog.text


def test_store_memory_setting_is_checked(moe_path, monkeypatch):
    from strata_jax.core import hostrows

    if not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(jax.devices()[0])}")
    monkeypatch.setenv("STRATA_JAX_STORE", "pinnned")
    with pytest.raises(ConfigError, match="STRATA_JAX_STORE=.pinnned.: choose registered"):
        strata_jax.load(moe_path, ctx=128, expert_slots=8, expert_fetch="kernel")


def test_cuda_kernels_are_registered_command_buffer_compatible(monkeypatch):
    """On CUDA every handler of the extension is registered with XLA's command-buffer trait (a custom call XLA
    does not know as compatible keeps its loop out of the CUDA graphs); the CPU handlers need none."""
    from jaxlib import xla_client

    from strata_jax.core import hostrows

    calls = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, fn, **kw: calls.append((name, kw)))
    monkeypatch.setattr(jax.ffi, "pycapsule", lambda f: f)
    lib = type("Lib", (), {"__getattr__": lambda self, name: name})()
    hostrows._register(lib, "cuda")
    names = {hostrows.TARGET, hostrows.ROW_GET, hostrows.ROW_PUT, hostrows.HOST_PUT, hostrows.FILE_ROWS}
    assert {n for n, _ in calls} == names
    assert all(kw == {"platform": "CUDA", "traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
               for _, kw in calls), calls
    calls.clear()
    hostrows._register(lib, "cpu")
    assert {n for n, _ in calls} == names and all(kw == {"platform": "cpu"} for _, kw in calls)


def test_fetch_kernel_skips_what_it_must(tmp_path):
    """The call copies exactly the rows marked as misses, into their slots, and leaves a request outside
    the store or the pool alone (a padded id, a slot of -1)."""
    from strata_jax.core import hostrows

    dev = jax.devices()[0]
    if not hostrows.available(dev):
        pytest.skip(f"no C++ compiler to build the fetch kernel: {hostrows.why_not(dev)}")
    rng = np.random.default_rng(0)
    store = jax.device_put(rng.integers(0, 255, (2, 5, 48), dtype=np.uint8),
                           jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    (addr,) = hostrows.addresses([store], dev)
    pool = np.zeros((4, 48), np.uint8)
    row = np.array([7, 2, 9, -1, 3, 4], np.int32)  # flat store rows (layer * 5 + expert)
    dst = np.array([0, 1, 3, 2, -1, 2], np.int32)
    miss = np.array([1, 0, 1, 1, 1, 1], bool)
    out = jax.jit(lambda a, p, r, d, m: hostrows.host_rows(a, p, r, d, m, 10), donate_argnums=1)(
        addr, jax.device_put(pool, dev), row, dst, miss)
    flat = np.asarray(store).reshape(10, 48)
    want = pool.copy()
    want[0], want[3], want[2] = flat[7], flat[9], flat[4]
    np.testing.assert_array_equal(np.asarray(out), want)
