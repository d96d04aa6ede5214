"""Conversation cache, host tier (engine/convcache.py): a conversation whose row another took comes back
from host RAM, and its next turn prefills only its new tokens and gives what a cold run gives (dense,
qwen3moe offloaded, qwen4exp with its recurrent state); the tier's LRU eviction, deduplication and
whole-state rule."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import strata_jax
from strata_jax.bench.shapes import synthetic_model_path
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.engine.convcache import ConversationCache, DiskTier, HostTier, _read_header, make_entry, padded
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
    tier = warm.conversation_cache.ram
    assert tier.stats.hits == 1 and tier.stats.tokens_restored == len(turn2) - 3
    held = tier.get(tier.best_key(other, len(other))[0])
    if options.get("kv") == "q8_0":  # the tier keeps the cache as stored
        assert held.kv.k_LBSKDh.q.dtype == np.int8 and held.kv.v_LBSKDh.q.dtype == np.int8
    # and the second conversation, spilled by that restore, comes back too
    back = warm.generate(other + [44], **GREEDY)
    assert back.timings["cache_n"] == len(other) and tier.stats.hits == 2


@pytest.mark.parametrize("kind", ["dense", "qtiny"])
def test_a_conversation_on_disk_comes_back_after_a_restart(kind, tmp_path, tmp_path_factory):
    path, folder = _path(kind, tmp_path_factory), tmp_path / "conv"
    first = strata_jax.load(path, ctx=256, conversation_cache_dir=str(folder))
    first.generate([5, 6, 7, 8, 9, 10, 11, 12], **GREEDY)
    turn2 = first.session().cached_tokens(0) + [13, 14, 15]
    first.generate([40, 41, 42, 43], **GREEDY)  # takes the row: the first conversation goes to disk
    first.conversation_cache.flush()
    again = strata_jax.load(path, ctx=256, conversation_cache_dir=str(folder))  # a restart
    a = again.generate(turn2, **GREEDY)
    b = strata_jax.load(path, ctx=256).generate(turn2, cache_prompt=False, **GREEDY)
    assert a.timings["cache_n"] == len(turn2) - 3 and a.token_ids == b.token_ids
    np.testing.assert_allclose([lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4)
    assert again.conversation_cache.disk.stats.hits == 1
    # a cache of another kind does not read these (its own subfolder)
    q8 = strata_jax.load(path, ctx=256, kv="q8_0", conversation_cache_dir=str(folder))
    assert q8.generate(turn2, **GREEDY).timings["cache_n"] == 0


def _row(n_tokens: int, length: int = 32, rec=None) -> KVCache:
    k = np.arange(2 * length * 4, dtype=np.float32).reshape(2, 1, length, 2, 2)
    return KVCache(k, k + 1, rec)


def _spill(cache, tokens, length=32, rec=None, whole=False):
    cache.spill(tokens, lambda: _row(len(tokens), length, rec), whole_only=whole)


def test_the_tier_keeps_prefixes_once_and_evicts_the_least_recently_used():
    per = _row(0).k_LBSKDh[:, :, :8].nbytes * 2  # K and V of 8 positions
    ram = HostTier(capacity=2 * per)
    cache = ConversationCache(ram, None)
    _spill(cache, tuple(range(8)))
    assert ram.nbytes == per
    got, n, tier = cache.best([0, 1, 2, 3, 4, 99], limit=5)
    assert n == 5 and tier == "ram" and got.tokens == tuple(range(8))
    np.testing.assert_array_equal(padded(got, 32).k_LBSKDh[:, :, :8], _row(8).k_LBSKDh[:, :, :8])
    assert not padded(got, 32).k_LBSKDh[:, :, 8:].any()
    # a prefix of what it holds is not stored again; the row is not even read
    cache.spill(tuple(range(5)), lambda: pytest.fail("read a row the tier holds"), whole_only=False)
    assert len(ram) == 1
    _spill(cache, tuple(range(100, 108)))
    cache.best(range(8), limit=8)  # the first is now the more recently used
    _spill(cache, tuple(range(200, 208)))
    assert len(ram) == 2 and ram.stats.evictions == 1 and ram.nbytes <= ram.capacity
    assert cache.best(range(100, 108), limit=8)[0] is None and cache.best(range(8), limit=8)[1] == 8
    _spill(cache, tuple(range(40)), length=40)  # larger than the tier
    assert ram.stats.refused == 1


def test_a_recurrent_state_serves_only_prompts_that_extend_all_of_it():
    cache = ConversationCache(HostTier(capacity=1 << 20), None)
    _spill(cache, tuple(range(8)), rec=np.ones(3, np.float32), whole=True)
    assert cache.best([0, 1, 2, 3, 4, 99], limit=5) == (None, 0, "")
    got, n, _ = cache.best(list(range(8)) + [50], limit=8)
    assert n == 8 and got.kv.rec.shape == (3,)
    assert cache.best(range(8), limit=7) == (None, 0, "")  # the last prompt token must run: 7 < all 8


def _template(length=32):
    return jax.eval_shape(lambda: _row(0, length))


def test_the_disk_tier_survives_a_restart_and_refuses_foreign_or_corrupt_files(tmp_path, caplog):
    disk = DiskTier(tmp_path, 1 << 20, "model-a", _template())
    cache = ConversationCache(None, disk)
    _spill(cache, tuple(range(8)))
    _spill(cache, tuple(range(50, 60)))
    cache.flush()
    files = sorted((tmp_path / "model-a").glob("*.conv"))
    assert len(files) == 2
    again = ConversationCache(None, DiskTier(tmp_path, 1 << 20, "model-a", _template()))  # a restart
    got, n, tier = again.best(list(range(8)) + [9], limit=8)
    assert (n, tier) == (8, "disk")
    np.testing.assert_array_equal(got.kv.v_LBSKDh, _row(8).v_LBSKDh[:, :, :8])
    # another model's entry, copied into this model's folder, is refused and deleted
    other = DiskTier(tmp_path, 1 << 20, "model-b", _template())
    other.add(make_entry(tuple(range(70, 80)), _row(10), False))
    other.flush()
    foreign = next((tmp_path / "model-b").glob("*.conv"))
    (tmp_path / "model-a" / foreign.name).write_bytes(foreign.read_bytes())
    # a corrupt one: a flipped byte in the arrays
    victim = next(f for f in files if _read_header(f)["tokens"][0] == 0)
    blob = bytearray(victim.read_bytes())
    blob[-3] ^= 0xFF
    victim.write_bytes(bytes(blob))
    third = ConversationCache(None, DiskTier(tmp_path, 1 << 20, "model-a", _template()))
    assert third.best(list(range(70, 80)) + [1], limit=10) == (None, 0, "")
    assert "another model" in caplog.text and not (tmp_path / "model-a" / foreign.name).exists()
    # a row that already holds as much is not beaten: no file is read (the corrupt one is not found out yet)
    assert third.best(list(range(8)) + [9], limit=8, beat=8) == (None, 0, "") and third.disk.stats.refused == 1
    hits = [third.best(list(range(8)) + [9], limit=8), third.best(list(range(50, 60)) + [1], limit=10)]
    assert sorted(n for _, n, _ in hits) == [0, 10] and "checksum" in caplog.text
    assert third.disk.stats.refused == 2 and len(third.disk) == 1
    # a model whose row differs (another context here) refuses an entry that does not fit it
    small = ConversationCache(None, DiskTier(tmp_path, 1 << 20, "model-a", _template(length=6)))
    assert small.best(list(range(50, 60)) + [1], limit=10) == (None, 0, "")


def test_the_disk_tier_keeps_a_bfloat16_cache(tmp_path):
    # a GPU's KV cache is bfloat16, whose arrays the buffer protocol refuses (the H100 sitting's failure)
    import ml_dtypes

    def row(length=32):
        k = (np.arange(2 * length * 4, dtype=np.float32).reshape(2, 1, length, 2, 2) / 7).astype(ml_dtypes.bfloat16)
        return KVCache(k, k + 1, None)

    template = jax.eval_shape(row)
    cache = ConversationCache(None, DiskTier(tmp_path, 1 << 20, "m", template))
    cache.spill(tuple(range(8)), row, whole_only=False)
    cache.flush()
    got, n, tier = ConversationCache(None, DiskTier(tmp_path, 1 << 20, "m", template)).best(list(range(9)), limit=8)
    assert (n, tier) == (8, "disk") and got.kv.k_LBSKDh.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.kv.k_LBSKDh, row().k_LBSKDh[:, :, :8])


def test_the_disk_tier_keeps_to_its_cap(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, "m", _template())
    _spill(ConversationCache(None, disk), tuple(range(8)))
    disk.flush()
    size = next((tmp_path / "m").glob("*.conv")).stat().st_size
    capped = DiskTier(tmp_path / "capped", 2 * size + 100, "m", _template())  # headers differ by a few bytes
    cache = ConversationCache(None, capped)
    for start in (0, 100, 200):
        _spill(cache, tuple(range(start, start + 8)))
    cache.flush()
    assert len(capped) == 2 and capped.stats.evictions == 1
    assert len(list((tmp_path / "capped" / "m").glob("*.conv"))) == 2 and capped.nbytes <= capped.capacity


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
        assert conv["ram_hits"] == 1 and conv["ram_spills"] >= 1 and 0 < conv["ram_bytes"] <= conv["ram_capacity"]


def test_a_folder_that_cannot_be_made_is_refused_before_loading(tmp_path):
    from strata_jax.core.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="conversation_cache_dir=.* cannot create the folder"):
        strata_jax.load("/nonexistent/model.gguf", conversation_cache_dir=str(blocker / "sub"))
