"""Conversation cache, host tier (engine/convcache.py): a conversation whose row another took comes back
from host RAM, and its next turn prefills only its new tokens and gives what a cold run gives (dense,
qwen3moe offloaded, qwen4exp with its recurrent state); the tier's LRU eviction, deduplication and
whole-state rule."""

from __future__ import annotations

import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import synthetic_model_path
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.convcache import HostTier, padded
from strata_jax.model.forward import KVCache

DENSE = SyntheticSpec(arch="qwen2", n_layers=2, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0")
GREEDY = dict(max_tokens=6, temperature=0, logprobs=True)


def _path(kind, tmp_path_factory):
    if kind == "dense":
        return write_synthetic_gguf(tmp_path_factory.mktemp("conv") / "dense.gguf", DENSE)
    return synthetic_model_path(kind)


@pytest.mark.parametrize("kind, options", [("dense", {}), ("dense", dict(kv="q8_0")), ("tiny", dict(expert_slots=4)),
                                           ("qtiny", {})])
def test_a_taken_rows_conversation_comes_back_from_host_ram(kind, options, tmp_path_factory):
    path = _path(kind, tmp_path_factory)
    warm = strata_jax.load(path, ctx=256, conversation_cache_mib=4, **options)
    cold = strata_jax.load(path, ctx=256, **options)
    warm.generate([5, 6, 7, 8, 9, 10, 11, 12], **GREEDY)
    turn2 = warm.session().cached_tokens(0) + [13, 14, 15]
    warm.generate([40, 41, 42, 43], **GREEDY)  # another conversation takes the only row
    other = warm.session().cached_tokens(0)
    assert other[:4] == [40, 41, 42, 43]
    a, b = warm.generate(turn2, **GREEDY), cold.generate(turn2, cache_prompt=False, **GREEDY)
    assert a.timings["cache_n"] == len(turn2) - 3 and b.timings["cache_n"] == 0
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4)
    tier = warm.conversation_tier
    assert tier.stats.hits == 1 and tier.stats.tokens_restored == len(turn2) - 3
    held, _ = tier.best(other, len(other))
    if options.get("kv") == "q8_0":  # the tier keeps the cache as stored
        assert held.kv.k_LBSKDh.q.dtype == np.int8 and held.kv.v_LBSKDh.q.dtype == np.int8
    # and the second conversation, spilled by that restore, comes back too
    back = warm.generate(other + [44], **GREEDY)
    assert back.timings["cache_n"] == len(other) and tier.stats.hits == 2


def _row(n_tokens: int, length: int = 32, rec=None) -> KVCache:
    k = np.arange(2 * length * 4, dtype=np.float32).reshape(2, 1, length, 2, 2)
    return KVCache(k, k + 1, rec)


def test_the_tier_keeps_prefixes_once_and_evicts_the_least_recently_used():
    per = _row(0).k_LBSKDh[:, :, :8].nbytes * 2  # K and V of 8 positions
    tier = HostTier(capacity=2 * per)
    assert tier.spill(range(8), lambda: _row(8), whole_only=False) and tier.nbytes == per
    got, n = tier.best([0, 1, 2, 3, 4, 99], limit=5)
    assert n == 5 and got.tokens == tuple(range(8))
    np.testing.assert_array_equal(padded(got, 32).k_LBSKDh[:, :, :8], _row(8).k_LBSKDh[:, :, :8])
    assert not padded(got, 32).k_LBSKDh[:, :, 8:].any()
    # a prefix of what it holds is not stored again; the row is not even read
    assert tier.spill(range(5), lambda: pytest.fail("read a row the tier holds"), whole_only=False)
    assert len(tier) == 1
    tier.spill(range(100, 108), lambda: _row(8), whole_only=False)
    tier.best(range(8), limit=8)  # the first is now the more recently used
    tier.spill(range(200, 208), lambda: _row(8), whole_only=False)
    assert len(tier) == 2 and tier.stats.evictions == 1 and tier.nbytes <= tier.capacity
    assert tier.best(range(100, 108), limit=8)[0] is None and tier.best(range(8), limit=8)[1] == 8
    assert not tier.spill(range(40), lambda: _row(40, length=40), whole_only=False)  # larger than the tier
    assert tier.stats.refused == 1


def test_a_recurrent_state_serves_only_prompts_that_extend_all_of_it():
    tier = HostTier(capacity=1 << 20)
    tier.spill(range(8), lambda: _row(8, rec=np.ones(3, np.float32)), whole_only=True)
    assert tier.best([0, 1, 2, 3, 4, 99], limit=5) == (None, 0)
    got, n = tier.best(list(range(8)) + [50], limit=8)
    assert n == 8 and got.kv.rec.shape == (3,)
    assert tier.best(range(8), limit=7) == (None, 0)  # the last prompt token must run: 7 < all 8


def test_the_server_reports_a_restored_conversation(tmp_path_factory):
    """Over HTTP with one row: conversation A, then B takes the row, then A's next turn comes back from host
    RAM: its usage counts the cached prompt tokens and /metrics counts the restore."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from strata_jax.serving.app import create_app
    from strata_jax.serving.engine import Engine

    model = strata_jax.load(_path("dense", tmp_path_factory), ctx=256, conversation_cache_mib=4)
    engine = Engine(lambda: model, queue_size=8, warmup=False, parallel=1)
    a = [{"role": "user", "content": "hello there, how is the weather"}]
    b = [{"role": "user", "content": "a different question"}]
    with TestClient(create_app(engine, model_id="dense")) as c:
        assert engine.wait_ready(60)
        post = lambda msgs: c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})  # noqa: E731
        first = post(a).json()
        post(b)
        a2 = a + [first["choices"][0]["message"], {"role": "user", "content": "and tomorrow?"}]
        usage = post(a2).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        conv = {s.labels["what"]: s.value for s in fams["strata_conversation_cache"].samples}
        assert conv["hits"] == 1 and conv["spills"] >= 1 and 0 < conv["bytes"] <= conv["capacity"]
