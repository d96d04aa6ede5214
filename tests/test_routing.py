"""The synthetic routing generator (strata_jax.offload.routing): well-formed, deterministic traces; the
fast numpy LRU used for fitting agrees exactly with the engine's policy in simulate(); and the fitted
Qwen3-30B-A3B parameters reproduce the published reuse figures, measured with simulate() itself.

Shape legend: T tokens, L layers, E experts per layer, K routed experts per token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_jax.offload import load_trace, simulate
from strata_jax.offload.routing import (B30, GRANITE_TRACE, PUBLISHED_LRU, PUBLISHED_REPEAT, QWEN3_30B_A3B,
                                        RoutingParams, lru_hit_rates, realistic_trace, repeat_rate)

STICKY = RoutingParams(skew=1.0, hot_k=1.5, hot_boost=2.0, drift_tokens=5.0, repeat=0.5)
ALL_HOT = RoutingParams(skew=0.0, hot_k=10.0, hot_boost=3.0, drift_tokens=1.0)


@pytest.mark.parametrize("T,L,E,K,params", [
    (50, 3, 16, 4, QWEN3_30B_A3B), (40, 2, 8, 8, QWEN3_30B_A3B), (30, 4, 12, 1, STICKY),
    (30, 2, 9, 3, ALL_HOT), (0, 2, 8, 2, QWEN3_30B_A3B), (20, 48, 512, 8, QWEN3_30B_A3B)])
def test_trace_is_well_formed(T, L, E, K, params):
    tr_TLk = realistic_trace(T, L, E, K, params, seed=3)
    assert tr_TLk.shape == (T, L, K) and tr_TLk.dtype == np.int32
    assert T == 0 or (tr_TLk.min() >= 0 and tr_TLk.max() < E)
    s_TLk = np.sort(tr_TLk, axis=-1)
    assert not np.any(s_TLk[..., 1:] == s_TLk[..., :-1]), "experts of one token and layer must be distinct"


def test_deterministic_by_seed():
    a = realistic_trace(64, 4, 32, 4, STICKY, seed=7)
    assert np.array_equal(a, realistic_trace(64, 4, 32, 4, STICKY, seed=7))
    assert not np.array_equal(a, realistic_trace(64, 4, 32, 4, STICKY, seed=8))


def test_layers_have_their_own_skew():
    # strong skew, no hot set: each layer's favourite is its own (random per-layer ranking)
    tr_TLk = realistic_trace(400, 6, 64, 4, RoutingParams(skew=2.0, hot_k=0.0, hot_boost=0.0, drift_tokens=1.0), 0)
    fav_L = [np.bincount(tr_TLk[:, l].ravel(), minlength=64).argmax() for l in range(6)]
    assert len(set(fav_L)) > 1
    counts_E = np.bincount(tr_TLk[:, 0].ravel(), minlength=64)
    assert counts_E.max() > 5 * np.median(counts_E)


def test_router_order_puts_likelier_experts_first():
    tr_TLk = realistic_trace(400, 4, 64, 8, RoutingParams(skew=1.5, hot_k=0.0, hot_boost=0.0, drift_tokens=1.0), 1)
    top_share = [np.mean([np.bincount(tr_TLk[:, l, j], minlength=64).max() / 400 for l in range(4)])
                 for j in (0, 7)]
    assert top_share[0] > top_share[1]


def test_invalid_params_and_shapes():
    for bad in ({"skew": -1}, {"hot_k": -0.5}, {"drift_tokens": 0}, {"repeat": 1.5}, {"hot_boost": float("nan")}):
        with pytest.raises(ValueError):
            RoutingParams(**{"skew": 0.5, "hot_k": 2.0, "hot_boost": 3.0, "drift_tokens": 10.0, **bad})
    with pytest.raises(ValueError):
        realistic_trace(4, 2, 4, 5, QWEN3_30B_A3B, 0)


def test_repeat_rate_counts_shared_experts():
    tr_TLk = np.array([[[0, 1]], [[1, 2]], [[2, 1]], [[3, 3]]], np.int32)  # shares 1/2, 2/2, 0/1
    assert repeat_rate(tr_TLk) == pytest.approx(3 / 5)
    assert repeat_rate(tr_TLk, warmup_tokens=2) == pytest.approx(2 / 3)


def _simulated_lru(tr_TLk, sizes, warmup, E):
    L = tr_TLk.shape[1]
    return np.array([simulate(tr_TLk, "lru", s * L, per_layer=True, warmup_tokens=warmup,
                              n_experts=E)["hit_rate_after_warmup"] for s in sizes])


def test_fast_lru_equals_simulate():
    tr_TLk = realistic_trace(120, 3, 24, 4, STICKY, seed=5)
    assert np.array_equal(lru_hit_rates(tr_TLk, [4, 6, 9, 16], 10, 24), _simulated_lru(tr_TLk, [4, 6, 9, 16], 10, 24))
    if Path(GRANITE_TRACE).exists():  # real routing
        real_TLk = load_trace(GRANITE_TRACE)
        assert np.array_equal(lru_hit_rates(real_TLk, [8, 12, 20], 0, 32), _simulated_lru(real_TLk, [8, 12, 20], 0, 32))


def test_qwen3_params_reproduce_published_reuse():
    # a seed the fit never saw; LRU from the engine's own policy in simulate, not the fitting shortcut
    L, E, K = B30
    sizes = sorted(PUBLISHED_LRU)
    tr_TLk = realistic_trace(320, L, E, K, QWEN3_30B_A3B, seed=11)
    got = 100 * _simulated_lru(tr_TLk, sizes, 64, E)
    want = 100 * np.array([PUBLISHED_LRU[s] for s in sizes])
    assert np.all(np.abs(got - want) <= 3), (got, want)
    assert abs(100 * repeat_rate(tr_TLk, 64) - 100 * PUBLISHED_REPEAT) <= 3
