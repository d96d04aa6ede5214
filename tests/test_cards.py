"""Several devices as one expert cache (core/cards.py), on CPU: two virtual devices in a process of their
own (tests/cards_probe.py; XLA_FLAGS must be set before JAX starts). Each case's logits and greedy tokens
on two cards equal one card's (logits to float32 rounding: a split prefill sums in another order),
resident and offloaded (a cache per layer, one shared pool), for qwen3moe and qseed's architecture; the pools are split and the rest replicated; the misses each card fetched add
up; /metrics reports each card; what several cards do not serve yet is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_jax.core.errors import ConfigError
from strata_jax.engine.config import EngineConfig

PROBE = Path(__file__).with_name("cards_probe.py")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("cards") / "out.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(PROBE), str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return np.load(out), json.loads(out.with_suffix(".json").read_text())


CASES = ("moe-resident", "moe-per-layer", "moe-shared", "moe-resident-grouped", "qtiny-offloaded", "moe-lookup",
         "moe-draft", "moe-blocked", "glm4moe-mtp", "moe-kv-stream", "moe-mixed")


SPLIT, WHOLE = ("moe-per-layer", "moe-blocked"), ("moe-resident", "moe-resident-grouped", "moe-shared")


@pytest.mark.parametrize("case", CASES)
def test_two_cards_equal_one(probe, case):
    arrays, meta = probe
    # equal but for the order of a sum: a split prefill adds each card's groups, then the cards'
    np.testing.assert_allclose(arrays[f"{case}/two/logits"], arrays[f"{case}/one/logits"], rtol=1e-5, atol=1e-5)
    assert arrays[f"{case}/two/tokens"].tolist() == arrays[f"{case}/one/tokens"].tolist()
    if "lookup" in case or "draft" in case or "mtp" in case:  # verify passes ran, the same on both
        assert arrays[f"{case}/two/drafted"] == arrays[f"{case}/one/drafted"] > 0
    m = meta[case]
    # every pool split in two equal ranges, one per card; the dense weights on both
    assert all(d == [0, 1] for d in m["pool_devices"])
    assert all(len(s) == 2 and s[0] == s[1] for s in m["pool_shards"])
    assert m["param_devices"] == [0, 1]
    st, per_card = m["stats"], m["cards"]
    assert [c["card"] for c in per_card] == [0, 1]
    assert sum(c["slots"] for c in per_card) == st["expert_slots"]
    # what crossed into the cache's slots (misses served low-bit count in misses, not in a card's slots)
    assert sum(c["misses"] for c in per_card) == st["misses"] - (st["cold_experts"] or 0) + st["prefetched"]
    # offloaded and streaming, the prefill's two groups of experts a layer were cut over the cards (each streams
    # one); resident, or reading cached experts in place (moe-shared), every card runs them all. Counted where
    # the case traces its programs afresh (a later case of the same programs reuses them)
    if case == "moe-mixed":  # misses served low-bit on both
        assert m["cold_experts"] > 0
    if case == "qtiny-offloaded":  # the PLE table in host memory, every card reading its rows by address
        assert m["ple"] == "host" and m["host_tables"] > 0
    if case in SPLIT or case in WHOLE:
        assert (m["split_traces"] > 0) == (case in SPLIT)
    if "resident" in case:
        assert st["resident"] and st["misses"] == 0
    else:  # each card fetched some of the misses into its own slots, from the store in memory of our own
        assert not st["resident"] and all(c["misses"] > 0 for c in per_card)
        assert st["store_memory"] == os.environ.get("STRATA_JAX_STORE", "registered")


def test_metrics_and_the_monitor_report_each_card(probe):
    served = probe[1]["served"]
    assert served["status"] == 200 and served["misses"] > 0
    lines = [line for line in served["metrics"].splitlines() if line.startswith("strata_expert_cache_card_")]
    slots = {line.split("{")[1].split(",")[0]: float(line.split()[-1]) for line in lines if "_slots{" in line}
    misses = [float(line.split()[-1]) for line in lines if "_misses{" in line]
    assert slots == {'card="0"': 6.0, 'card="1"': 6.0} and len(misses) == 2 and sum(misses) > 0
    # the web UI's monitor stream carries them too (its expert card lists each card)
    assert [(c["device"], c["slots"]) for c in served["monitor_cards"]] == [("cpu:0", 6), ("cpu:1", 6)]


@pytest.mark.parametrize("what, words", [("dense", "has no experts"), ("no_device", "no device 7")])
def test_what_two_cards_refuse_is_named(probe, what, words):
    msg = probe[1]["refused"][what]
    assert msg is not None and msg.startswith("ConfigError") and words in msg


@pytest.mark.parametrize("value", ["0,x", "1,1", "-1", ""])
def test_devices_option_is_checked(value):
    with pytest.raises(ConfigError, match="devices"):
        EngineConfig.create(devices=value)


def test_which_devices_by_default(monkeypatch):
    """Unasked, a MoE model takes every GPU where there are several, a dense model the first; asked, the
    devices named (JAX's order)."""
    import jax

    from strata_jax.engine.model import pick_devices

    gpus = [SimpleNamespace(platform="gpu", id=i) for i in range(2)]
    monkeypatch.setattr(jax, "devices", lambda *a: gpus)
    assert pick_devices(None, None, moe=True) == gpus and pick_devices(None, None, moe=False) == gpus[:1]
    assert pick_devices((1,), None) == gpus[1:] and pick_devices(None, gpus[1]) == gpus[1:]
    cpus = [SimpleNamespace(platform="cpu", id=i) for i in range(2)]
    monkeypatch.setattr(jax, "devices", lambda *a: cpus)
    assert pick_devices(None, None, moe=True) == cpus[:1]  # virtual CPU devices are not cards


@pytest.mark.parametrize("given, want", [
    ((12, 12, 12), (12, 12, 12)),  # already even: kept
    ((13, 15, 17), (12, 14, 16)),  # rounded down
    ((9, 9, 30), (10, 10, 28)),    # up to the step's floor (10 over 2 cards), the 2 slots that costs taken from the largest
    ((9, 9, 9), (10, 10, 10)),     # no pool can spare any: the floor stands
])
def test_a_split_plan_keeps_to_its_budget(given, want):
    """Two cards: every pool's slots even; a pool the rounding leaves under a step's floor rounds up, and the
    slots that adds come out of the largest pools, so the plan holds no more than the budget gave."""
    from strata_jax.core.experts import ExpertSpec
    from strata_jax.offload.manager import split_plan
    from strata_jax.offload.sizing import CachePlan

    spec = ExpertSpec(moe_layers=(0, 1, 2), n_experts=64, n_experts_used=9, layer_parts=())
    plan = CachePlan(resident=False, slots_per_pool=given, expert_cache_bytes=sum(given) * 100, total_experts=192,
                     reason="budget", avg_expert_bytes=100.0)
    got = split_plan(plan, spec, 2)
    assert got.slots_per_pool == want and got.expert_cache_bytes == sum(want) * 100
    assert got.n_slots <= max(plan.n_slots, 10 * 3)


def test_check_plans_each_card_and_the_load_agrees(probe):
    """`check --devices 0,1 --vram-budget B`: both cards listed; the budget is per card, so two cards hold
    more experts than one (here every one), as a load over both does."""
    c = probe[1]["checked"]
    assert [card["index"] for card in c["cards"]] == [0, 1]
    assert c["two_slots"] > c["one_slots"]
    v = c["verdict"]
    assert v["fits"] and "2 cards x" in v["text"]
    assert c["two_slots"] == (24 if v["mode"] == "resident" else v["expert_slots"])  # 3 layers x 8 experts
    assert sum(card["slots"] for card in c["two_cards"]) == c["two_slots"]


def test_a_saved_cache_comes_back_warm_on_two_cards(probe):
    w = probe[1]["warm"]
    assert w["same"] and sum(w["owned"]) > 0 and w["warm_misses"] < w["cold_misses"]
    assert sum(c["misses"] for c in w["cards"]) == w["warm_misses"]


def test_a_conversation_comes_back_from_host_ram_on_two_cards(probe):
    c = probe[1]["conversation"]
    assert c["two"] == c["one"]
    assert c["two"]["hits"] == 1 and c["two"]["cache_n"] == c["two"]["turn2"] - 3
