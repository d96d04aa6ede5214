"""Runs in its own process (tests/test_cards.py starts it): JAX must see several CPU devices, which
XLA_FLAGS=--xla_force_host_platform_device_count=2 gives only if set before JAX starts.

    python tests/cards_probe.py OUT.npz

For each case (a model and its cache options), the same prompt on one device and on two: every
position's logits, greedy tokens, and the two-card run's expert-cache telemetry, written to OUT.npz
(arrays) and OUT.json (telemetry) for the test to compare."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import strata_jax  # noqa: E402
from strata_jax.bench.shapes import synthetic_model_path  # noqa: E402
from strata_jax.model.kernels import Kernels  # noqa: E402
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

MOE = SyntheticSpec(arch="qwen3moe", n_layers=3, d_model=128, head_dim=32, expert_ffn_dim=64, ffn_dim=128,
                    vocab_size=512, qtype="Q8_0", seed=11)

DENSE = SyntheticSpec(arch="qwen2", n_layers=2, d_model=128, head_dim=32, ffn_dim=128, vocab_size=512, qtype="Q8_0")

# the prefill's groups of experts: 4 of MOE's 8 at a chunk of 16 (or 8) tokens in float32, so two groups a layer
# and each card streams and multiplies one (model/layers/moe.py _prefill_experts)
SPLIT_GROUP_BYTES = 500_000

BUDGET = "1029.6MiB"  # per card, 1 GiB of it reserved: the moe model offloads on one card, fits on two

# (name, model, options): resident; offloaded with a cache per layer and with one shared pool (the
# prefill reading cached experts in place too); qseed's architecture (DeltaNet, QSA, PLE, IQ3_S) offloaded
CASES = [
    ("moe-resident", "moe", {}),
    ("moe-per-layer", "moe", dict(expert_slots=12)),
    ("moe-shared", "moe", dict(expert_slots=10, expert_pools="shared", kernels=Kernels(prefill_cached="on"))),
    ("moe-resident-grouped", "moe", dict(kernels=Kernels(moe_prefill="grouped"))),
    ("qtiny-offloaded", "qtiny", dict(expert_slots=24)),
    # speculative decoding: verify passes over the split cache (lookup drafts; a draft model on the first card)
    ("moe-lookup", "moe", dict(expert_slots=12, spec="lookup")),
    ("moe-draft", "moe", dict(expert_slots=12, spec="draft:MOE")),
    ("moe-blocked", "moe", dict(expert_slots=12, kernels=Kernels(moe_prefill="blocked"))),
    # mixed precision: misses served from a Q4_0 copy of the experts until used twice (staged on every card)
    ("moe-mixed", "moe", dict(expert_slots=12, cold_experts="COLD", promote_after=2)),
    # KV streaming: the cache past 16 positions in host memory, which both cards read and write by address
    ("moe-kv-stream", "moe", dict(expert_slots=12, kv="q8_0", kv_resident=16)),
    # MTP drafting: the converted tiny glm4moe with its MTP block (tests/reference_models.py), offloaded
    ("glm4moe-mtp", "glm4moe", dict(expert_slots=6, spec="mtp", spec_max=3, dtype="float32")),
]


def main(out: str) -> None:
    assert len(jax.devices()) >= 2, jax.devices()
    from strata_jax.core import cards
    from strata_jax.model.layers import moe

    group_bytes, moe.PREFILL_GROUP_BYTES = moe.PREFILL_GROUP_BYTES, SPLIT_GROUP_BYTES  # read at trace time
    on_every_card, splits = cards.on_every_card, []

    def counted(*args):  # a prefill cut over the cards, traced
        splits.append(1)
        return on_every_card(*args)

    cards.on_every_card = counted
    from reference_models import glm4moe_model

    paths = {"moe": write_synthetic_gguf(os.path.join(os.path.dirname(out), "moe.gguf"), MOE),
             "glm4moe": glm4moe_model("f32").gguf_path,
             "moe-q4": write_synthetic_gguf(os.path.join(os.path.dirname(out), "moe-q4.gguf"),
                                            dataclasses.replace(MOE, expert_qtype="Q4_0")),
             "qtiny": synthetic_model_path("qtiny")}
    prompt = list(range(3, 40))
    arrays, meta = {}, {}
    for name, model, options in CASES:
        runs = {}
        splits.clear()
        if options.get("spec") == "draft:MOE":
            options = dict(options, spec=f"draft:{paths['moe']}")
        if options.get("cold_experts") == "COLD":
            options = dict(options, cold_experts=str(paths["moe-q4"]))
        for label, devices in (("one", (0,)), ("two", (0, 1))):
            m = strata_jax.load(paths[model], ctx=128, prefill_chunk=16, devices=devices, **options)
            arrays[f"{name}/{label}/logits"] = np.asarray(m.logits(prompt))
            g = m.generate(prompt + prompt, max_tokens=12, temperature=0, cache_prompt=False)
            arrays[f"{name}/{label}/tokens"] = np.array(g.token_ids)
            arrays[f"{name}/{label}/drafted"] = np.array(g.timings.get("draft_n") or 0)
            runs[label] = m
        two = runs["two"]
        meta[name] = {"split_traces": len(splits), "host_tables": len(two._host_tables), "ple": two.ple_table,"stats": {k: v for k, v in two.stats().items() if not isinstance(v, list)},
                      "cards": two.experts.card_stats(),
                      "pool_devices": [sorted(d.id for d in p.data.sharding.device_set)
                                       for p in two.experts.slots.pools],
                      "pool_shards": [[s.data.shape[0] for s in p.data.addressable_shards]
                                      for p in two.experts.slots.pools],
                      "cold_experts": two.stats().get("cold_experts"),
                      "param_devices": sorted({d.id for x in jax.tree.leaves(two.params) for d in x.sharding.device_set})}
    moe.PREFILL_GROUP_BYTES, cards.on_every_card = group_bytes, on_every_card  # the planner reads it too
    meta["served"] = served(paths["moe"])
    meta["checked"] = checked(paths["moe"])
    meta["warm"] = warm(paths["moe"], os.path.join(os.path.dirname(out), "state"))
    meta["conversation"] = conversation(paths["moe"])
    dense = write_synthetic_gguf(os.path.join(os.path.dirname(out), "dense.gguf"), DENSE)
    meta["refused"] = refused(paths["moe"], dense)
    np.savez(out, **arrays)
    with open(out.replace(".npz", ".json"), "w") as f:
        json.dump(meta, f)


def served(path) -> dict:
    """A two-card model behind the HTTP app: a chat's text, and /metrics' text after it."""
    from starlette.testclient import TestClient

    from strata_jax.serving.app import create_app
    from strata_jax.serving.engine import Engine

    m = strata_jax.load(path, ctx=128, prefill_chunk=16, devices=(0, 1), expert_slots=12)
    engine = Engine(lambda: m, warmup=False)
    with TestClient(create_app(engine, model_id="moe")) as c:
        assert engine.wait_ready(60)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello cards"}],
                                                 "max_tokens": 4, "temperature": 0})
        for _ in range(100):  # the engine thread refreshes its snapshot once the request is done
            text = c.get("/metrics").text
            if 'strata_expert_cache_card_misses{card="1"' in text:
                break
            time.sleep(0.1)
    return {"status": r.status_code, "metrics": text, "misses": m.stats()["misses"],
            "monitor_cards": (engine.snapshot.get("expert") or {}).get("cards")}


def checked(path, budget: str = BUDGET) -> dict:
    """`check --devices 0,1 --vram-budget B` (per card): each card's figures and the plan, beside the slots
    a load over both cards and over one makes of the same budget."""
    from strata_jax.check import check

    c = check(str(path), ctx=128, vram_budget=budget, probe_pinned=False, devices="0,1")
    two = strata_jax.load(path, ctx=128, devices=(0, 1), vram_budget=budget)
    one = strata_jax.load(path, ctx=128, devices=(0,), vram_budget=budget)
    return {"cards": c["cards"], "verdict": c["verdict"], "two_slots": two.experts.plan.n_slots,
            "one_slots": one.experts.plan.n_slots, "two_cards": two.stats()["cards"]}


def warm(path, state: str) -> dict:
    """A two-card cache saved, then loaded warm on two cards: each card refills its own slots; the same prompt
    then misses less and decodes the same tokens."""
    prompt, kw = list(range(3, 40)), dict(ctx=128, prefill_chunk=16, devices=(0, 1), expert_slots=12)
    cold = strata_jax.load(path, **kw)
    a = cold.generate(prompt, max_tokens=8, temperature=0)
    cold.save_expert_cache(state)
    again = strata_jax.load(path, expert_cache_state=state, **kw)
    owned = [int(np.sum(np.asarray(c.owner_X) >= 0)) for c in again.experts.slots.caches]
    b = again.generate(prompt, max_tokens=8, temperature=0)
    return {"same": a.token_ids == b.token_ids, "cold_misses": cold.stats()["misses"],
            "warm_misses": again.stats()["misses"], "owned": owned, "cards": again.stats()["cards"]}


def conversation(path) -> dict:
    """The conversation cache on two cards: a row taken by another conversation comes back from host RAM and
    the next turn continues as on one card."""
    out = {}
    for label, devices in (("one", (0,)), ("two", (0, 1))):
        m = strata_jax.load(path, ctx=128, prefill_chunk=16, devices=devices, expert_slots=12,
                            conversation_cache_mib=8)
        m.generate(list(range(5, 40)), max_tokens=6, temperature=0)
        turn2 = m.session().cached_tokens(0) + [13, 14, 15]
        m.generate([40, 41, 42, 43], max_tokens=6, temperature=0)  # takes the only row
        a = m.generate(turn2, max_tokens=6, temperature=0)
        out[label] = {"tokens": a.token_ids, "cache_n": a.timings["cache_n"], "turn2": len(turn2),
                      "hits": m.conversation_cache.ram.stats.hits}
    return out


def refused(path, dense) -> dict:
    """What several devices refuse, by name: each case's error message."""
    out = {}
    for what, model, devices in (("dense", dense, (0, 1)), ("no_device", path, (0, 7))):
        try:
            strata_jax.load(model, ctx=128, devices=devices)
            out[what] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out[what] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    main(sys.argv[1])
