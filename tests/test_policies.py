"""Expert-cache policies and the trace simulator: invariants every policy must keep (property tests),
LRU and Belady against pure-Python references, Belady as an upper bound, and the shared granite trace.

Shape legend: T tokens, L layers, K routed experts per token, E experts per layer, S slots,
A accesses (T * L), U requested ids per access.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_jax.core.errors import ConfigError
from strata_jax.offload import (LFU, LRFU, LRU, POLICIES, belady_policy, get_policy, load_trace, lrfu_policy,
                                simulate, static_policy, usage_profile)
from strata_jax.offload.policies import DISABLED, FREE, NEVER, CacheState, admit, belady_next_use
from strata_jax.offload.simulate import replay, unique_requests, with_slots

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "granite-3.0-1b-a400m" / \
    "moe_expert_trace.json"

# (L, E, K, T): fixed shapes, so each policy compiles once per shape; the slot count varies freely
# inside them (the simulator's padding: unused slots are DISABLED)
SHAPES = [(1, 6, 3, 24), (3, 5, 3, 8)]
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _policies(trace_TLk, E):
    L = trace_TLk.shape[1]
    rng = np.random.default_rng(int(np.abs(trace_TLk).sum()))
    return [LRU, LFU, LRFU, lrfu_policy(0.5), static_policy(rng.random((L, E)).astype(np.float32)),
            belady_policy(trace_TLk)]


@st.composite
def cases(draw):
    """(trace [T, L, K] with -1 padding and repeats, E, usable slots in [K, L * E])."""
    L, E, K, T = draw(st.sampled_from(SHAPES))
    flat = draw(st.lists(st.integers(-1, E - 1), min_size=T * L * K, max_size=T * L * K))
    return np.array(flat, np.int32).reshape(T, L, K), E, draw(st.integers(K, L * E))


def _sim_order(trace_TLk):
    T, L, K = trace_TLk.shape
    return np.tile(np.arange(L, dtype=np.int32), T), unique_requests(trace_TLk).reshape(T * L, K)


def _replay(policy, S, L, E, layer_Ac, ids_AcU):
    state0 = with_slots(policy.init(L * E, L, E), S)
    _, plans, states = replay(policy.access, state0, layer_Ac, ids_AcU, keep_states=True)
    return state0, plans, states


def _hits(plans) -> int:
    return int(((np.asarray(plans.ids_U) >= 0) & ~np.asarray(plans.miss_U)).sum())


def _check_invariants(policy, S, L, E, layer_Ac, ids_AcU):
    """Replay and check every access against the state before and after it."""
    state0, plans, states = _replay(policy, S, L, E, layer_Ac, ids_AcU)
    slot_map_AcLE, owner_AcX = np.asarray(states.slot_map_LE), np.asarray(states.owner_X)
    slot_U_A, miss_Ac, ev_Ac = np.asarray(plans.slot_U), np.asarray(plans.miss_U), np.asarray(plans.evicted_U)
    prev_map, prev_owner = np.asarray(state0.slot_map_LE), np.asarray(state0.owner_X)
    total_misses = 0
    for a in range(len(layer_Ac)):
        l, ids = int(layer_Ac[a]), ids_AcU[a]
        valid = ids >= 0
        need = {l * E + int(e) for e in ids[valid]}
        smap, owner, slot, miss, ev = slot_map_AcLE[a], owner_AcX[a], slot_U_A[a], miss_Ac[a], ev_Ac[a]
        # a miss is exactly a requested expert that was not resident; a hit keeps its slot
        was = np.where(valid, prev_map[l, np.maximum(ids, 0)], -1)
        assert np.array_equal(miss, valid & (was < 0))
        assert np.array_equal(slot[valid & ~miss], was[valid & ~miss])
        assert int((valid & ~miss).sum() + miss.sum()) == int(valid.sum())
        # never evict what this access needs; every requested expert is resident at its returned slot
        assert not need & {int(g) for g in ev[miss] if g >= 0}
        assert np.all(slot[~valid] == -1)
        for e, s in zip(ids[valid], slot[valid]):
            assert smap[l, e] == s and owner[s] == l * E + e
        # misses use free slots before evicting anything; disabled slots are never touched
        n_free = int((prev_owner == FREE).sum())
        assert int((ev[miss] >= 0).sum()) == max(0, int(miss.sum()) - n_free)
        assert np.all(prev_owner[slot[miss & (ev < 0)]] == FREE)
        assert np.array_equal(ev[miss], prev_owner[slot[miss]])
        assert np.all(owner[S:] == DISABLED) and np.all(owner[:S] != DISABLED)
        # slot_map and owner_X describe the same bijection
        mapped = np.argwhere(smap >= 0)
        slots = smap[smap >= 0]
        assert len(set(slots.tolist())) == len(slots)
        assert np.array_equal(np.sort(slots), np.flatnonzero(owner >= 0))
        for (ll, e), s in zip(mapped, slots):
            assert owner[s] == ll * E + e
        prev_map, prev_owner = smap, owner
        total_misses += int(miss.sum())
    if S >= L * E:  # everything fits: only compulsory misses
        distinct = {(int(layer_Ac[a]), int(e)) for a in range(len(layer_Ac)) for e in ids_AcU[a] if e >= 0}
        assert total_misses == len(distinct)
    return plans


@PROPS
@given(cases())
def test_invariants_every_policy(case):
    trace_TLk, E, S = case
    layer_Ac, ids_AcU = _sim_order(trace_TLk)
    for policy in _policies(trace_TLk, E):
        _check_invariants(policy, S, trace_TLk.shape[1], E, layer_Ac, ids_AcU)


@PROPS
@given(cases(), st.randoms(use_true_random=False))
def test_invariants_any_layer_order(case, rnd):
    """The engine may visit layers in any order (pools, chunks): online policies must not care."""
    trace_TLk, E, S = case
    L = trace_TLk.shape[1]
    layer_Ac, ids_AcU = _sim_order(trace_TLk)
    layer_Ac = np.array([rnd.randrange(L) for _ in layer_Ac], np.int32)
    for policy in _policies(trace_TLk, E)[:-1]:
        _check_invariants(policy, S, L, E, layer_Ac, ids_AcU)


# --- pure-Python references --------------------------------------------------------------------------

def _streams(trace_TLk, per_layer):
    """Access streams in simulator order, one per cache: lists of (layer, unique ids in router order)."""
    T, L, _ = trace_TLk.shape
    out = [[] for _ in range(L if per_layer else 1)]
    for t in range(T):
        for l in range(L):
            req = list(dict.fromkeys(int(e) for e in trace_TLk[t, l] if e >= 0))
            out[l if per_layer else 0].append([(l, e) for e in req])
    return out


def ref_lru_hits(trace_TLk, n_slots, per_layer=False):
    cap = n_slots // trace_TLk.shape[1] if per_layer else n_slots
    hits = 0
    for stream in _streams(trace_TLk, per_layer):
        od = OrderedDict()
        for keys in stream:
            need = set(keys)
            for k in keys:
                if k in od:
                    hits += 1
                    od.move_to_end(k)
                else:
                    if len(od) >= cap:
                        del od[next(x for x in od if x not in need)]
                    od[k] = True
    return hits


def ref_belady_hits(trace_TLk, n_slots, per_layer=False):
    cap = n_slots // trace_TLk.shape[1] if per_layer else n_slots
    hits = 0
    for stream in _streams(trace_TLk, per_layer):
        cache = set()
        for a, keys in enumerate(stream):
            need = set(keys)
            for k in keys:
                if k in cache:
                    hits += 1
                    continue
                if len(cache) >= cap:
                    def next_use(x):
                        return next((b for b in range(a + 1, len(stream)) if x in stream[b]), len(stream))
                    cache.remove(max(sorted(cache - need), key=next_use))
                cache.add(k)
    return hits


@PROPS
@given(cases(), st.booleans())
def test_lru_and_belady_match_references(case, per_layer):
    trace_TLk, E, S = case
    L, K = trace_TLk.shape[1:]
    if per_layer:
        n_slots = max(S // L, K) * L
        for name, ref in (("lru", ref_lru_hits), ("belady", ref_belady_hits)):
            r = simulate(trace_TLk, name, n_slots, per_layer=True, n_experts=E)
            assert r["hits"] == ref(trace_TLk, n_slots, per_layer=True), name
            assert r["lookups"] == r["hits"] + r["misses"] == int((unique_requests(trace_TLk) >= 0).sum())
    else:
        layer_Ac, ids_AcU = _sim_order(trace_TLk)
        assert _hits(_replay(LRU, S, L, E, layer_Ac, ids_AcU)[1]) == ref_lru_hits(trace_TLk, S)
        assert _hits(_replay(belady_policy(trace_TLk), S, L, E, layer_Ac, ids_AcU)[1]) == \
            ref_belady_hits(trace_TLk, S)


@PROPS
@given(cases())
def test_belady_is_an_upper_bound(case):
    """Shared caches; a per-layer cache is a set of independent shared caches of one layer each, and
    the L = 1 shape covers that."""
    trace_TLk, E, S = case
    L = trace_TLk.shape[1]
    layer_Ac, ids_AcU = _sim_order(trace_TLk)
    hits = [_hits(_replay(p, S, L, E, layer_Ac, ids_AcU)[1]) for p in _policies(trace_TLk, E)]
    assert max(hits[:-1]) <= hits[-1], hits


# --- smaller units -----------------------------------------------------------------------------------

def test_get_policy_names():
    assert set(POLICIES) == {"lru", "lfu", "lrfu"}
    assert get_policy("lru") is LRU and get_policy(LFU) is LFU
    assert get_policy("lrfu(0.2)").name == "lrfu(0.2)" == get_policy(" lrfu( 0.2 ) ").name
    assert get_policy("lrfu(0)").access is LFU.access  # lam = 0 is LFU, served by exact integer counts
    for bad in ("lrfu(-1)", "lrfu(x)", "mru", "belady", "static", 3):
        with pytest.raises(ConfigError):
            get_policy(bad)


@pytest.mark.parametrize("bad", [np.inf, np.nan, -np.inf])
def test_admit_non_finite_scores_never_evict_needed(bad):
    """+inf used to tie with the +inf that protects hits, and top_k then took slot 0: a needed expert."""
    state, _ = admit(CacheState.empty(3, 1, 6), 0, jnp.array([0, 1, 2]), jnp.zeros(3))
    _, plan = admit(state, 0, jnp.array([0, 1, 5]), jnp.full(3, bad))
    assert np.asarray(plan.evicted_U).tolist() == [-1, -1, 2]


def test_belady_next_use_and_usage_profile():
    trace_TLk = np.array([[[0, 1]], [[1, -1]], [[0, 0]]], np.int32)  # T=3, L=1, K=2
    ids_Ack, next_Ack = belady_next_use(trace_TLk)
    assert ids_Ack.tolist() == [[0, 1], [1, -1], [0, 0]]
    assert next_Ack.tolist() == [[2, 1], [NEVER, NEVER], [NEVER, NEVER]]
    assert usage_profile(trace_TLk, 1, 3).tolist() == [[2.0, 2.0, 0.0]]
    with pytest.raises(ValueError):
        static_policy(np.ones((2, 3))).init(4, 1, 3)


def test_simulate_report_and_warmup():
    rng = np.random.default_rng(0)
    trace_TLk = rng.integers(0, 6, (20, 2, 2)).astype(np.int32)
    r = simulate(trace_TLk, "lru", 6, warmup_tokens=5)
    assert r["lookups"] == r["hits"] + r["misses"]
    assert r["hits_after_warmup"] <= r["hits"] and r["misses_after_warmup"] <= r["misses"]
    assert len(r["per_layer_hit_rate"]) == 2 and r["policy"] == "lru" and r["n_slots"] == 6
    assert simulate(trace_TLk, "lru", 12)["misses"] == r["compulsory_misses"] == 12
    # the simulator's padding to one shape changes nothing: same hits as a cache of exactly 6 slots
    layer_Ac, ids_AcU = _sim_order(trace_TLk)
    for policy in _policies(trace_TLk, 6):
        name = "belady" if policy.access is belady_policy(trace_TLk).access else policy
        _, plans, _ = replay(policy.access, policy.init(6, 2, 6), layer_Ac, ids_AcU)
        assert simulate(trace_TLk, name, 6, n_experts=6)["hits"] == _hits(plans), policy.name
    with pytest.raises(ValueError):
        simulate(trace_TLk, "lru", 2, per_layer=True)  # one slot per layer cannot hold a top-2 request
    with pytest.raises(ValueError):
        simulate(trace_TLk, belady_policy(trace_TLk), 6, per_layer=True)


def test_lrfu_stays_finite_over_a_long_run():
    """float32: log-domain CRF neither overflows (small lam ~ counts) nor collapses (large lam)."""
    rng = np.random.default_rng(1)
    trace_TLk = rng.zipf(1.5, (4000, 2, 2)).clip(1, 16).astype(np.int32) - 1
    for lam in (0.001, 1.0, 30.0):
        pol = lrfu_policy(lam)
        layer_Ac, ids_AcU = _sim_order(trace_TLk)
        final, plans, _ = replay(pol.access, pol.init(8, 2, 16), layer_Ac, ids_AcU)
        crf = np.asarray(final.meta["log_crf_LE"])
        assert np.all(np.isfinite(crf) | (crf == -np.inf)) and np.isfinite(crf).any()
        assert 0 < int(np.asarray(plans.miss_U).sum()) < int((ids_AcU >= 0).sum())


# --- the shared real trace ---------------------------------------------------------------------------

@pytest.mark.skipif(not TRACE.exists(), reason=f"shared trace not found at {TRACE}")
def test_granite_trace_hit_rates():
    trace_TLk = load_trace(TRACE)
    T, L, K = trace_TLk.shape
    assert (L, K) == (24, 8) and T == sum(len(load_trace(TRACE, p)) for p in ("english_prose", "code", "math"))
    sizes = (8, 12, 16, 24)
    names = ("lru", "lfu", "lrfu", "static", "belady")
    table = {}
    for per_layer in (False, True):
        for name in names:
            table[name, per_layer] = [simulate(trace_TLk, name, s * L, per_layer=per_layer, n_experts=32)["hit_rate"]
                                      for s in sizes]
    print(f"\ngranite-3.0-1b-a400m, {T} tokens, hit rate by slots per layer (of 32):")
    print("policy   cache      " + "".join(f"{s:>8}" for s in sizes))
    for (name, per_layer), rates in table.items():
        print(f"{name:<8} {'per-layer' if per_layer else 'shared':<10} " + "".join(f"{r:8.1%}" for r in rates))
    for per_layer in (False, True):
        lru = table["lru", per_layer]
        assert all(a < b for a, b in zip(lru, lru[1:])), lru
        for name in names:
            assert all(r <= b + 1e-12 for r, b in zip(table[name, per_layer], table["belady", per_layer])), name
    # a top-8 request fills 8 per-layer slots: every policy is forced, so all agree
    assert len({table[n, True][0] for n in names}) == 1
