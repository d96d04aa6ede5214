"""model/memory.py's estimates against what is really allocated or stored, and `inspect`'s slot count
against the planner that `load` uses (a synthetic MoE GGUF of the bench's "tiny" shape)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from gguf import GGUFReader

import strata_jax
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.engine.inspect import format_report, report
from strata_jax.core.errors import ConfigError
from strata_jax.model import memory
from strata_jax.model.config import ModelConfig
from strata_jax.model.forward import KVCache, forward
from strata_jax.gguf.reader import GGUFFile
from strata_jax.offload.sizing import DEFAULT_RESERVE, plan_cache

# Q4_K down projections in odd layers (as Q4_K_M mixes types): experts differ in size by layer, and
# "shared" pools group layers 0 and 2 while "per-layer" gives each layer its own.
SPEC = dataclasses.replace(SHAPES["tiny"], n_layers=3, odd_down_qtype="Q4_K", expert_ffn_dim=256)
# load as on a GPU (bfloat16, dense weights in their GGML blocks), so fixed_device_bytes(itemsize=2) is what it plans
# (at ctx 256 the prefill chunk, auto, is 256: no chunk is longer than the context)
GPU_LIKE = dict(dtype="bfloat16", dequantize_dense=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("memory") / "moe.gguf", SPEC)
    gguf = GGUFFile(path)
    return path, gguf, ModelConfig.from_gguf(gguf)


@pytest.mark.parametrize("rows,dtype,kv", [(1, jnp.bfloat16, "f16"), (3, jnp.float32, "f16"), (2, jnp.float32, "q8_0"),
                                           (1, jnp.bfloat16, "q4_0"), (2, jnp.float32, "q8_0,q4_0")])
def test_kv_cache_bytes_is_the_allocation(moe, rows, dtype, kv):
    _, _, cfg = moe
    cache = KVCache.zeros(cfg, rows, 96, dtype, kv=kv)
    allocated = sum(a.nbytes for a in jax.tree.leaves(cache))
    assert memory.kv_cache_bytes(cfg, 96, rows, jnp.dtype(dtype).itemsize, kv) == allocated
    values = 96 * rows * cfg.n_kv_layers * cfg.kv_values_per_position
    # GGML's block sizes: 34 bytes per 32 values (q8_0), 18 (q4_0)
    per_32 = {"f16": 32 * jnp.dtype(dtype).itemsize, "q8_0": 34, "q4_0": 18, "q8_0,q4_0": (34 + 18) / 2}[kv]
    assert allocated == values * per_32 / 32


def test_weight_bytes_match_the_tensor_table(moe):
    path, gguf, _ = moe
    # gguf-py's own reader, independent of GGUFFile
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    dense = sum(n for name, n in sizes.items() if "_exps." not in name)
    assert memory.dense_weight_bytes(gguf) == dense
    assert memory.routed_expert_bytes(gguf) == sum(sizes.values()) - dense > 0
    assert memory.dense_weight_bytes(gguf) + memory.routed_expert_bytes(gguf) <= path.stat().st_size


def test_fixed_bytes_add_dense_kv_and_activations(moe):
    _, gguf, cfg = moe
    fixed = memory.fixed_device_bytes(gguf, cfg, ctx=512, itemsize=2, rows=2, prefill_chunk=256)
    assert fixed == (memory.dense_weight_bytes(gguf) + memory.kv_cache_bytes(cfg, 512, 2, 2)
                     + memory.activation_bytes(cfg, 256))


@pytest.mark.parametrize("shape", ["qtiny", "tiny"])
def test_activation_bound_covers_the_prefill_programs_temporaries(tmp_path, shape):
    """The planner's activation bound against what XLA allocates for a prefill chunk's temporaries (the
    compiled program's temp buffers; XLA:CPU fuses less than XLA:GPU, so it needs at least as much), at
    two chunk lengths: the bound is neither below it nor more than 8x above it where tokens dominate."""
    spec = dataclasses.replace(SHAPES[shape], n_layers=4)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    m = strata_jax.load(path, ctx=1024, **GPU_LIKE)
    step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels"))
    experts = m.experts.take()
    try:
        for T in (256, 1024):
            kv = KVCache.zeros(m.config, 1, 1024, m.dtype)
            compiled = step.lower(m.params, experts, kv, jnp.ones((1, T), jnp.int32), jnp.zeros((1,), jnp.int32),
                                  jnp.full((1,), T, jnp.int32), cfg=m.config, dtype=m.dtype,
                                  kernels=m.kernels).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            bound = memory.activation_bytes(m.config, T)
            assert temp <= bound, (T, temp, bound)
            if T == 1024:
                assert bound < 8 * temp, (T, temp, bound)
    finally:
        m.experts.put(experts)


def test_load_plans_with_the_fixed_bytes(moe):
    path, gguf, cfg = moe
    m = strata_jax.load(path, ctx=128, **GPU_LIKE, parallel=2, prefill_chunk=64, expert_slots=12)
    assert m.cache_plan.fixed_bytes == memory.fixed_device_bytes(gguf, cfg, ctx=128, itemsize=2, rows=2,
                                                                 prefill_chunk=64)


def _planned(gguf, cfg, budget, pools, rows=1):
    """plan_cache called directly, with the pools spelled out from the tensor table."""
    def expert(i, names=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
        return sum(gguf.tensor(f"blk.{i}.{n}.weight").nbytes for n in names) // cfg.n_experts

    per_layer = [expert(i) for i in cfg.moe_layers]
    assert per_layer[0] == per_layer[2] != per_layer[1]
    if pools == "per-layer":
        pool_layers, pool_bytes = ((0,), (1,), (2,)), tuple(per_layer)
    else:
        pool_layers, pool_bytes = ((0, 2), (1,)), (per_layer[0], per_layer[1])
    fixed = memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, rows=rows, prefill_chunk=256)
    return plan_cache(pool_layers=pool_layers, pool_expert_bytes=pool_bytes, n_experts=cfg.n_experts,
                      min_slots_per_pool=min(rows * cfg.n_experts_used, cfg.n_experts), fixed_bytes=fixed,
                      vram_budget=budget)


@pytest.mark.parametrize("pools", ["per-layer", "shared"])
@pytest.mark.parametrize("extra_experts", [6.5, 17, 1000])
def test_inspect_slots_are_the_planners(moe, pools, extra_experts):
    _, gguf, cfg = moe
    per_expert = memory.routed_expert_bytes(gguf) / (cfg.n_experts * len(cfg.moe_layers))
    budget = int(DEFAULT_RESERVE + memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, prefill_chunk=256)
                 + extra_experts * per_expert)
    r = report(gguf, vram_budget=budget, ctx=256, expert_pools=pools, **GPU_LIKE)
    plan = _planned(gguf, cfg, budget, pools)
    assert r["expert_slots"] == plan.n_slots and r["plan"] == plan
    assert plan.resident == (extra_experts >= cfg.n_experts * len(cfg.moe_layers))


def test_inspect_agrees_with_load(moe):
    """The same budget through `load` (CPU: the budget is the only limit) and through the report."""
    path, gguf, cfg = moe
    per_expert = memory.routed_expert_bytes(gguf) / (cfg.n_experts * len(cfg.moe_layers))
    budget = int(DEFAULT_RESERVE + memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, prefill_chunk=256) + 9.5 * per_expert)
    r = report(gguf, vram_budget=budget, ctx=256, **GPU_LIKE)
    m = strata_jax.load(path, ctx=256, **GPU_LIKE, vram_budget=budget)
    assert not m.cache_plan.resident
    assert m.cache_plan == r["plan"] and m.stats()["expert_slots"] == r["expert_slots"]


def test_inspect_plans_several_cards(moe):
    """--cards 2: each card keeps the fixed bytes and its budget's share of experts, so two cards of the budget
    hold twice one card's expert bytes (rounded to an even count per pool); the report says so."""
    _, gguf, cfg = moe
    per_expert = memory.routed_expert_bytes(gguf) / (cfg.n_experts * len(cfg.moe_layers))
    budget = int(DEFAULT_RESERVE + memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, prefill_chunk=256)
                 + 9.5 * per_expert)
    one, two = (report(gguf, vram_budget=budget, ctx=256, cards=n, **GPU_LIKE) for n in (1, 2))
    assert not one["plan"].resident and two["cards"] == 2
    assert all(n % 2 == 0 for n in two["plan"].slots_per_pool)
    assert 2 * one["expert_slots"] - 2 * len(one["plan"].slots_per_pool) <= two["expert_slots"] <= 2 * one["expert_slots"] + 2
    assert "a card x 2 cards" in format_report(two)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_inspect_cards_must_be_a_count(moe, value, capsys):
    """`inspect --cards` takes a positive count of cards; anything else is refused by name."""
    from strata_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["inspect", "--model", str(moe[0]), "--cards", value])
    assert e.value.code == 2 and "--cards" in capsys.readouterr().err


def test_inspect_refuses_what_load_refuses(moe):
    path, gguf, cfg = moe
    budget = DEFAULT_RESERVE + memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, prefill_chunk=256)  # no room for an expert
    r = report(gguf, vram_budget=budget, ctx=256, **GPU_LIKE)
    assert not r["fits_dense"] and "too small" in r["too_small"]
    with pytest.raises(ConfigError, match="too small"):
        strata_jax.load(path, ctx=256, **GPU_LIKE, vram_budget=budget)


@pytest.mark.parametrize("extra_experts", [1000, 30])  # every expert fits beside the table / offloaded
def test_inspect_places_the_ple_table_as_load_does(tmp_path, extra_experts):
    """qwen4exp's PLE table: load puts it in host memory once the experts are offloaded (and then it takes
    no device memory); the report (`inspect`, `check`'s verdict) must make the same call and slot count."""
    path = write_synthetic_gguf(tmp_path / "qple.gguf", dataclasses.replace(SHAPES["qtiny"], ple_head_vocab=4096))
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gguf)
    per_expert = memory.routed_expert_bytes(gguf) / (cfg.n_experts * len(cfg.moe_layers))
    budget = int(DEFAULT_RESERVE + memory.fixed_device_bytes(gguf, cfg, ctx=256, itemsize=2, prefill_chunk=256) + extra_experts * per_expert)
    r = report(gguf, vram_budget=budget, ctx=256, **GPU_LIKE)
    m = strata_jax.load(path, ctx=256, **GPU_LIKE, vram_budget=budget)
    assert r["ple_table"] == m.ple_table == ("device" if extra_experts > 100 else "host")
    assert m.cache_plan == r["plan"] and m.stats()["expert_slots"] == r["expert_slots"]


@pytest.mark.parametrize("options", [{}, GPU_LIKE, dict(dtype="bfloat16")], ids=["cpu-default", "gpu-like", "bf16"])
def test_every_report_gives_the_bytes_load_allocates(moe, options, caplog):
    """One estimate behind `inspect`, `check`, the load log and the server's memory figures (the web UI's
    source: Model.device_memory), each equal to what load really allocates with the same options."""
    from strata_jax import check as chk
    from strata_jax.core.units import fmt_bytes
    from strata_jax.engine.inspect import format_report

    path, gguf, cfg = moe
    r = report(gguf, ctx=128, **options)
    with caplog.at_level("INFO", logger="strata_jax"):
        m = strata_jax.load(path, ctx=128, **options)
    m.generate("the tea", max_tokens=2, temperature=0)  # the one-row session allocates its KV cache
    dtype = jnp.dtype(m.dtype).name
    assert r["dtype"] == dtype
    used = m.device_memory()
    assert (used["dense"], used["kv"]) == (r["dense_bytes"], r["kv_bytes"])
    assert used["experts"] == memory.routed_expert_bytes(gguf, cfg)  # CPU: every expert resident
    # the same figures, named the same way, in inspect's text and the load log
    label = memory.kv_label("f16", dtype)
    text = format_report(r)
    assert f"dense weights {fmt_bytes(used['dense'])} on the device" in text
    assert f"kv cache      {fmt_bytes(used['kv'])} at ctx 128 ({label})" in text
    assert f"KV {fmt_bytes(used['kv'])} for 128 cells x 1 row ({label})" in caplog.text
    assert f"dense weights {fmt_bytes(used['dense'])} " in caplog.text
    if not options:  # check sizes what this machine's load does: the CPU default
        c = chk.check(str(path), ctx=128, probe_pinned=False)
        assert (c["model"]["dense_bytes"], c["model"]["kv_bytes"]) == (used["dense"], used["kv"])
        need = r["fixed_bytes"] + used["experts"]
        assert f"needs about {fmt_bytes(need)}: dense weights {fmt_bytes(used['dense'])}, KV cache " \
               f"{fmt_bytes(used['kv'])} at ctx 128 ({label})" in c["verdict"]["text"]


def test_prefill_chunk_auto_follows_the_memory(moe):
    """prefill_chunk "auto" (the default): the longest power of two (<= 4096, <= the context) whose
    activation bound is at most 1/8 of the budget and that plans the context 512 plans; 512 where no
    memory figure is known (CPU without --vram-budget) or where 512 does not fit; a load prefills with it,
    and inspect reports the chunk load takes."""
    from strata_jax.engine.config import EngineConfig
    from strata_jax.engine.inspect import report
    from strata_jax.engine.model import plan_model_context, resolve_prefill_chunk
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.model.weights import WeightLoader, expert_spec
    from strata_jax.offload.manager import expert_floor_bytes
    from strata_jax.offload.sizing import DEFAULT_RESERVE

    path, _, cfg = moe
    gguf = GGUFFile(path)
    spec = expert_spec(WeightLoader(gguf, cfg))

    def chunk(budget, ctx):
        def plan(c):
            return plan_model_context(gguf, cfg, spec, ctx=ctx, kv="f16", itemsize=4, rows=1, prefill_chunk=c,
                                      vram_budget=budget)
        return resolve_prefill_chunk("auto", cfg, ctx=ctx, budget=budget, plan=plan), plan

    assert EngineConfig.create().prefill_chunk == "auto"
    assert resolve_prefill_chunk(1024, cfg, ctx=None, budget=None, plan=None) == 1024  # a number stays
    assert chunk(None, 8192)[0] == 512
    for budget in (1 << 26, 1 << 30, 1 << 34):
        c, plan = chunk(budget, 8192)
        assert c & (c - 1) == 0 and 16 <= c <= 4096
        assert c == 512 or memory.activation_bytes(cfg, c) <= budget // 8
        assert c == 4096 or memory.activation_bytes(cfg, 2 * c) > budget // 8 or c == 512
    assert chunk(1 << 40, 100)[0] == 128  # never past the context
    # room for half the trained context at 512: a longer chunk would cut the context further, so auto
    # keeps 512 although 1/8 of the budget would allow 1,024
    half = (DEFAULT_RESERVE + memory.dense_weight_bytes(gguf) + memory.activation_bytes(cfg, 512)
            + int(expert_floor_bytes(spec)) + cfg.context_length // 2 * memory.kv_cache_bytes(cfg, 1, 1, 4, "f16"))
    c, plan = chunk(half, None)
    assert plan(512).ctx == cfg.context_length // 2 and memory.activation_bytes(cfg, 1024) <= half // 8
    assert c == 512
    assert chunk(4 * half, None)[0] >= 1024  # with room, it goes longer
    m = strata_jax.load(path, ctx=256, vram_budget="2GiB")
    assert m.prefill_chunk == 256  # the default is auto: the 256-token context caps it
    assert report(gguf, vram_budget="2GiB", ctx=256)["prefill_chunk"] == 256
    assert report(gguf, ctx=256)["prefill_chunk"] == 256 and report(gguf)["prefill_chunk"] == 512
    with pytest.raises(ConfigError, match=r"or 'auto'"):
        EngineConfig.create(prefill_chunk="automatic")


@pytest.mark.parametrize("shape", ["qtiny", "tiny"])
def test_subchunk_bound_covers_the_layer_major_prefill(tmp_path, shape):
    """Layer-major prefill (Kernels.prefill_subchunk): a 1,024-token chunk in 128-token sub-chunks needs less
    than the whole chunk's bound, and its own bound (a sub-chunk's activations, the chunk's residual, one MoE
    layer's experts) still covers XLA's temporaries for it."""
    spec = dataclasses.replace(SHAPES[shape], n_layers=4)
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    m = strata_jax.load(path, ctx=1024, **GPU_LIKE)
    kernels = dataclasses.replace(m.kernels, prefill_subchunk=128)
    step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels"))
    experts = m.experts.take()
    try:
        kv = KVCache.zeros(m.config, 1, 1024, m.dtype)
        compiled = step.lower(m.params, experts, kv, jnp.ones((1, 1024), jnp.int32), jnp.zeros((1,), jnp.int32),
                              jnp.full((1,), 1024, jnp.int32), cfg=m.config, dtype=m.dtype, kernels=kernels).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        layer = memory.routed_expert_bytes(m.gguf, m.config) // len(m.config.moe_layers)
        bound = memory.activation_bytes(m.config, 1024, 128, layer)
        assert temp <= bound < memory.activation_bytes(m.config, 1024), (temp, bound)
    finally:
        m.experts.put(experts)
