"""Layer runs (model/runs.py): alike layers are stacked and scanned as one compiled body. The scan changes
how the program is built, never what it computes: logits, greedy tokens and expert counters equal the
unrolled run's, resident and offloaded, on the XLA path and through the fused kernel; and the program
stops growing with the layer count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import strata_jax
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.model import runs
from strata_jax.model.forward import KVCache, forward
from strata_jax.model.kernels import Kernels

# 6 MoE layers, odd layers' down projections in another type: a period of 2 alike layers, 3 repeats
SPEC = SyntheticSpec(arch="qwen3moe", n_layers=6, d_model=128, head_dim=32, expert_ffn_dim=64, vocab_size=512,
                     qtype="Q8_0", expert_qtype="Q8_0", odd_down_qtype="Q4_0", seed=3)
PROMPT = "the tea is hot and the rain is there, so she sat on the stairs to read"


def test_plan_finds_periods_and_leaves_the_rest_unrolled():
    # a Q4_K_M-like file: 3 leading layers of one kind, a period of 3 (two of kind a, one of b) x 4, 2 trailing
    sigs = ["b"] * 3 + ["a", "a", "b"] * 4 + ["c", "d"]
    plan = runs.plan_runs(sigs)
    # the period's two alike layers are one group: one compiled body, scanned inside the period's scan
    assert plan == (runs.Run(0, 1, 3), runs.Run(3, 3, 4, (2, 1)), runs.Run(15, 1, 1), runs.Run(16, 1, 1))
    assert plan[1].group_layers(0) == (3, 4, 6, 7, 9, 10, 12, 13) and plan[1].group_layers(1) == (5, 8, 11, 14)
    assert runs.plan_runs(list("abcd")) == tuple(runs.Run(i, 1, 1) for i in range(4))
    assert runs.describe(plan).startswith("17 layers, 5 compiled layer bodies: scanned 0-2 (3 x 1 layer), 3-14 (4 x 3")
    # a layer the forward pass runs something before (qwen4exp's PLE) starts a run, none spans it
    assert runs.plan_runs(["a"] * 6, starts=[2]) == (runs.Run(0, 1, 2), runs.Run(2, 1, 4))


def test_stack_and_view_round_trip():
    from strata_jax.core.qtensor import QTensor

    layers = [{"w": QTensor(jnp.full((4, 6), i, jnp.uint8), "T", 8), "n": jnp.full((3,), float(i))} for i in range(6)]
    for sigs, shape in ((["x", "y"] * 3, (3, 4, 6)), (["x", "x", "y"] * 2, (4, 4, 6))):  # (2, 1) groups: 4 x
        segs = runs.stack_layers(layers, runs.plan_runs(sigs))
        assert len(segs) == 1 and segs[0].stacked[0]["w"].data.shape == shape
        for i, got in [(i, g) for i in range(6) for g in (runs.layer_at(segs, i), runs.layers_of(segs)[i])]:
            assert got["w"].index is not None and got["w"].shape == (4, 8)
            np.testing.assert_array_equal(got["w"].resolved().data, layers[i]["w"].data)
            np.testing.assert_array_equal(got["n"], layers[i]["n"])



def test_view_reads_small_leaves_at_a_traced_index_without_a_slice(monkeypatch):
    # a loop-indexed dynamic slice of a small param becomes a memcpy thunk on a GPU that keeps the layer loop
    # out of the CUDA graphs (docs/benchmarks.md): small leaves are read by a masked sum, exactly
    monkeypatch.setattr(runs, "MASKED_VIEW_BYTES", 64)
    stacked = {"small": jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 4)), jnp.float32),  # 48 B a layer
               "big": jnp.arange(5 * 32, dtype=jnp.float32).reshape(5, 32),  # 128 B a layer
               "ids": jnp.arange(5 * 2, dtype=jnp.int32).reshape(5, 2)}
    for r in range(5):
        got = jax.jit(runs.view)(stacked, jnp.int32(r))
        for k, a in stacked.items():
            np.testing.assert_array_equal(got[k], a[r])
    jaxpr = jax.make_jaxpr(runs.view)(stacked, jnp.int32(2)).jaxpr
    sliced = [e.invars[0].aval.shape for e in _eqns(jaxpr) if e.primitive.name == "dynamic_slice"]
    assert sliced == [(5, 32)]  # only the big leaf


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested jaxprs included."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def _primitives(jaxpr) -> set[str]:
    return {e.primitive.name for e in _eqns(jaxpr)}


@pytest.mark.parametrize("stored", ["f32", "f16 bytes"])
def test_few_rows_of_a_float_stack_are_a_reduction_not_a_dot(stored):
    # a dot takes a scanned layer's slice of a float stack (the F16 hyper-connection matrices, the router) as
    # a dynamic-slice fusion that keeps the layer loop out of the CUDA graphs on a GPU (docs/benchmarks.md):
    # there a few rows are a multiply-and-reduce; a CPU keeps its far faster matrix-vector product
    from gguf import GGMLQuantizationType
    from strata_jax.core.qtensor import QTensor
    from strata_jax.model.layers.basic import linear

    rng = np.random.default_rng(0)
    w_LFD = rng.normal(size=(3, 24, 64)).astype(np.float16).astype(np.float32)
    if stored == "f32":
        stack = QTensor(jnp.asarray(w_LFD), None, 64)
    else:
        stack = QTensor(jnp.asarray(w_LFD.astype(np.float16).view(np.uint8)), GGMLQuantizationType.F16, 64)
    kernels = Kernels(qmatvec="off", platform="gpu")  # the form a GPU takes, traced and run here
    f = jax.jit(lambda x, r: linear(x, QTensor(stack.data, stack.qtype, stack.n_cols, r), kernels))
    # token rows as decode ([B, 1, D]) and a short chunk ([1, T, D]: the shape XLA:CPU got wrong unflattened)
    for shape in [(1, 1, 64), (3, 1, 64), (1, 2, 64), (1, 8, 64), (2, 4, 64)]:
        x = rng.normal(size=shape).astype(np.float32)
        want = np.einsum("...d,fd->...f", x.astype(np.float64), w_LFD[1].astype(np.float64))
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(x), jnp.int32(1))), want, rtol=1e-5, atol=1e-5)
        assert "dot_general" not in _primitives(jax.make_jaxpr(f)(jnp.asarray(x), jnp.int32(1)).jaxpr)
    x9 = jnp.ones((1, 9, 64), jnp.float32)  # a prefill chunk: a matmul
    assert "dot_general" in _primitives(jax.make_jaxpr(f)(x9, jnp.int32(1)).jaxpr)
    cpu = jax.jit(lambda x, r: linear(x, QTensor(stack.data, stack.qtype, stack.n_cols, r), Kernels(qmatvec="off")))
    assert "dot_general" in _primitives(jax.make_jaxpr(cpu)(jnp.ones((1, 1, 64)), jnp.int32(1)).jaxpr)  # CPU: a matvec

@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("runs") / "moe.gguf", SPEC)


def _run(path, max_tokens=12, **kw):
    m = strata_jax.load(path, ctx=128, **kw)
    ids = m.tokenize(PROMPT)
    logits = m.logits(ids)
    tokens = m.generate(ids, max_tokens=max_tokens, temperature=0).token_ids
    return m, logits, tokens


@pytest.mark.parametrize("cache", [{}, {"expert_slots": 8, "expert_pools": "shared"},
                                   {"expert_slots": 24, "expert_pools": "shared", "policy": "lfu"}])
def test_scanned_equals_unrolled(moe_path, cache):
    off, ref_logits, ref_tokens = _run(moe_path, layer_scan="off", **cache)
    on, logits, tokens = _run(moe_path, **cache)
    assert off.layer_runs is None
    assert on.layer_runs == (runs.Run(0, 2, 3),)  # the whole model: one period of two layers, 3 repeats
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens
    # every layer's counters land on that layer, not on the run's first
    np.testing.assert_array_equal(on.experts.counters(), off.experts.counters())
    if cache:
        assert on.stats()["misses"] > 0 and on.stats()["prefill_streamed_experts"] > 0


def test_scanned_decode_through_the_kernel(moe_path):
    """Decode's fused kernel reads a scanned layer's matrices from their stack by slot (QTensor.index)
    and the resident experts from the run's stacked pool: same tokens as the unrolled kernel run."""
    kw = dict(dequantize_dense=False, kernels=Kernels(qmatvec="on"), max_tokens=4)
    _, ref_logits, ref_tokens = _run(moe_path, layer_scan="off", **kw)
    on, logits, tokens = _run(moe_path, **kw)
    assert on.layer_runs is not None
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_per_layer_caches_scan_as_blocks_of_one_pool(moe_path, policy):
    """Per-layer caches (the default) with the scan on: one pool per expert row layout, each layer a block
    of it with its own stacked state, the whole model one scanned run. Each layer's cache decides exactly
    as its own pool does unrolled: same tokens, same hits and misses per layer, same slot maps."""
    off, ref_logits, ref_tokens = _run(moe_path, layer_scan="off", expert_slots=12, policy=policy)
    on, logits, tokens = _run(moe_path, expert_slots=12, policy=policy)
    assert len(off.experts.slots.pools) == 6 and len(on.experts.slots.pools) == 2
    assert on.experts.slots.block == (2, 2)
    assert on.layer_runs == (runs.Run(0, 2, 3),)
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(on.experts.counters(), off.experts.counters())
    assert on.stats()["misses"] > 0
    a, b = on.experts.slots, off.experts.slots
    for i in range(6):  # the same experts cached, at the same place within the layer's block
        np.testing.assert_array_equal(np.asarray(a.slot_map(i)) - np.where(np.asarray(a.slot_map(i)) >= 0,
                                      int(a.slot_base(i)), 0), np.asarray(b.slot_map(i)))


def _program_text(path, layer_scan: str, T: int = 1, leaves: bool = False, **load):
    """Characters of the lowered forward step over T tokens (1: a decode step) of the model at `path`
    (loaded with `load`'s options); with `leaves`, also the step's argument leaves (params, experts, kv)."""
    m = strata_jax.load(path, ctx=64, layer_scan=layer_scan, **load)
    experts = m.experts.take()
    try:
        kv = KVCache.zeros(m.config, 1, 64, m.dtype)
        step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels"))
        tokens = jnp.ones((1, T), jnp.int32)
        n = len(step.lower(m.params, experts, kv, tokens, jnp.zeros((1,), jnp.int32), jnp.full((1,), T, jnp.int32),
                           cfg=m.config, dtype=m.dtype, kernels=m.kernels).as_text())
        return (n, len(jax.tree.leaves((m.params, experts, kv)))) if leaves else n
    finally:
        m.experts.put(experts)


def test_program_does_not_grow_with_layers(tmp_path):
    """12 alike layers lower to about the program of 4 (the scan's body is the layer); unrolled, ~3x."""
    sizes = {}
    for n in (4, 12):
        spec = SyntheticSpec(arch="qwen3moe", n_layers=n, d_model=64, head_dim=16, expert_ffn_dim=32,
                             vocab_size=320, qtype="Q8_0", expert_qtype="Q8_0", seed=1)
        path = write_synthetic_gguf(tmp_path / f"m{n}.gguf", spec)
        sizes[n] = {scan: _program_text(path, scan) for scan in ("on", "off")}
    assert sizes[12]["on"] < 1.1 * sizes[4]["on"], sizes
    assert sizes[12]["off"] > 2.5 * sizes[4]["off"], sizes


def test_hybrid_scanned_equals_unrolled(tmp_path):
    """qwen4exp (bench shape qtiny at 8 layers: PLE on layer 0, three DeltaNet layers per attention layer
    with QSA): the 8 layers are one run of 2 periods, the three DeltaNet layers a group scanned inside it
    (PLE runs before the run); every layer reads and writes its slice of the stacked recurrent state and its
    KV layer by the traced index. Same greedy tokens and, in a
    shared offloaded pool, the same counters as unrolled; logits equal to float rounding (XLA fuses a
    scanned body differently on CPU), and offloaded == resident stays bit-exact with the scan on."""
    import dataclasses

    from strata_jax.bench.shapes import SHAPES

    path = write_synthetic_gguf(tmp_path / "q8.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=8))
    off, ref_logits, ref_tokens = _run(path, layer_scan="off", max_tokens=8)
    on, logits, tokens = _run(path, max_tokens=8)
    assert on.layer_runs == (runs.Run(0, 4, 2, (3, 1)),)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    shared = dict(expert_slots=40, expert_pools="shared", max_tokens=8)
    off_c, _, off_tokens = _run(path, layer_scan="off", **shared)
    on_c, on_logits, on_tokens = _run(path, **shared)
    assert any(r.repeats > 1 for r in on_c.layer_runs)
    np.testing.assert_array_equal(on_logits, logits)  # offloaded == resident, both scanned
    assert on_tokens == off_tokens == ref_tokens
    np.testing.assert_array_equal(on_c.experts.counters(), off_c.experts.counters())
    assert on_c.stats()["misses"] > 0


def test_hybrid_scan_through_the_row_kernels(tmp_path):
    """The same 8-layer qwen4exp scanned with every traced-index access that XLA would run as a memcpy
    thunk on a GPU done by core/hostrows.py's kernels instead (their CPU build): the recurrent state's
    slices by the row kernels, the misses by the fetch kernel. Same greedy tokens and logits as the
    scan without them, offloaded == resident, and the programs do call them."""
    import dataclasses

    from strata_jax.bench.shapes import SHAPES
    from strata_jax.core import hostrows
    from strata_jax.model.kernels import Kernels

    if not hostrows.available(jax.devices()[0]):
        pytest.skip(f"no C++ compiler to build the row kernels: {hostrows.why_not(jax.devices()[0])}")
    path = write_synthetic_gguf(tmp_path / "q8.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=8))
    _, ref_logits, ref_tokens = _run(path, max_tokens=8, kernels=Kernels(state_rows="off"))
    on, logits, tokens = _run(path, max_tokens=8, kernels=Kernels(state_rows="on"))
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert tokens == ref_tokens
    off_c, off_logits, off_tokens = _run(path, max_tokens=8, kernels=Kernels(state_rows="on"), expert_slots=40,
                                         expert_pools="shared", expert_fetch="kernel")
    np.testing.assert_array_equal(off_logits, logits)  # offloaded == resident
    assert off_tokens == tokens and off_c.stats()["misses"] > 0 and off_c.stats()["expert_fetch"] == "kernel"
    experts = off_c.experts.take()
    try:
        kv = KVCache.zeros(off_c.config, 1, 64, off_c.dtype)
        hlo = jax.jit(functools.partial(forward, cfg=off_c.config, dtype=off_c.dtype, kernels=off_c.kernels)).lower(
            off_c.params, experts, kv, jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), jnp.int32)).as_text()
    finally:
        off_c.experts.put(experts)
    assert all(t in hlo for t in (hostrows.ROW_GET, hostrows.ROW_PUT, hostrows.TARGET))
    # nothing a kernel call in the scan takes is a plain dynamic slice (XLA on a GPU cannot fuse one into
    # the call and runs it as a memcpy thunk that keeps the scan out of its command buffers)
    experts = off_c.experts.take()
    try:
        on_gpu = dataclasses.replace(off_c.kernels, qmatvec="on")  # the fused mat-vec kernels too
        jaxpr = jax.make_jaxpr(functools.partial(forward, cfg=off_c.config, dtype=off_c.dtype, kernels=on_gpu))(
            off_c.params, experts, kv, jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), jnp.int32))
    finally:
        off_c.experts.put(experts)
    assert _sliced_call_operands(jaxpr.jaxpr) == []


_PLAIN = ("reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p", "bitcast_convert_type")


def _sliced_call_operands(jaxpr, in_loop: bool = False) -> list[str]:
    """The kernel calls (ffi_call, pallas_call) inside a loop body that take a dynamic slice's result."""
    made_by = {}  # var -> the primitive that made it, looking through ops that only reshape or retype
    found = []
    for e in jaxpr.eqns:
        for v in e.outvars:
            src = e.invars[0] if e.invars and not hasattr(e.invars[0], "val") else None
            made_by[v] = made_by.get(src, e.primitive.name) if e.primitive.name in _PLAIN else e.primitive.name
        if in_loop and e.primitive.name in ("ffi_call", "pallas_call"):
            found += [f"{e.primitive.name} <- {made_by[v]}" for v in e.invars
                      if not hasattr(v, "val") and made_by.get(v) == "dynamic_slice"]
        for key in ("jaxpr", "call_jaxpr", "body_jaxpr", "cond_jaxpr"):
            sub = e.params.get(key)
            if sub is not None:
                found += _sliced_call_operands(getattr(sub, "jaxpr", sub), in_loop or e.primitive.name in ("scan", "while"))
        for branch in e.params.get("branches", ()):
            found += _sliced_call_operands(branch.jaxpr, in_loop)
    return found


def test_seed_architecture_program_is_bounded_by_its_distinct_layers(tmp_path):
    """qtiny (qseed's architecture) at 48 layers against 4: both plan as one run of (3 DeltaNet, 1 attention)
    periods whose DeltaNet group is one scanned body (PLE runs before the run, outside the body), so the decode
    step and a 16-token prefill chunk, resident or offloaded into one shared pool, stay within issue 30's 1.3x
    (docs/benchmarks.md, "Program growth with depth") where unrolled they grow 9x; the
    step's arguments (params, store and pools, KV and recurrent state) have as many leaves at 48 as at 4."""
    import dataclasses

    from strata_jax.bench.shapes import SHAPES

    paths = {n: write_synthetic_gguf(tmp_path / f"q{n}.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=n))
             for n in (4, 48)}
    for T in (1, 16):
        for load in ({}, {"expert_pools": "shared"}):
            on = {n: _program_text(p, "on", T, leaves=True, expert_slots=4 * n if load else None, **load)
                  for n, p in paths.items()}
            assert on[48][0] < 1.3 * on[4][0], (T, load, on)
            assert on[48][1] == on[4][1], (T, load, on)
    off = {n: _program_text(p, "off") for n, p in paths.items()}
    assert off[48] > 8 * off[4], off


def test_kv_cache_leaves_do_not_grow_with_layers(tmp_path):
    """qtiny at 48 layers against 4: the KV cache, recurrent state included (each kind's layers stacked
    [L, B, ...], as K and V), has as many leaves, and so the decode program as many donated kv arguments
    (per-layer state had 12 at 4 layers and 100 at 48)."""
    import dataclasses

    from strata_jax.bench.shapes import SHAPES
    from strata_jax.core.experts import split_provider
    from strata_jax.engine import programs
    from strata_jax.engine.sampling import GREEDY, REPEAT_WINDOW

    leaves, args = {}, {}
    for n in (4, 48):
        m = strata_jax.load(write_synthetic_gguf(tmp_path / f"q{n}.gguf",
                                                 dataclasses.replace(SHAPES["qtiny"], n_layers=n)), ctx=64)
        kv = KVCache.zeros(m.config, 2, 64, m.dtype)
        leaves[n] = len(jax.tree.leaves(kv))
        provider = m.experts.take()
        try:
            experts, fixed = split_provider(provider)
            rows = programs.RowState.zeros(2, m.config.vocab_size, REPEAT_WINDOW)
            lowered = programs.decode.lower(m.params, experts, fixed, kv, rows, jnp.ones((2,), bool),
                                            programs.stop_array([0]), jnp.int32(1), cfg=m.config, dtype=m.dtype,
                                            kernels=m.kernels, attn_len=64, mode=GREEDY, n_max=1)
        finally:
            m.experts.put(provider)
        kv_info = jax.tree.leaves(lowered.args_info[0][3])
        assert all(a.donated for a in kv_info)
        args[n] = len(kv_info)
    assert leaves[48] == leaves[4] and args[48] == args[4] == leaves[4], (leaves, args)


def _products_of_sliced_operands(jaxpr, in_scan=False, xs=frozenset()) -> list[str]:
    """Matrix products inside a layer scan with an operand that is (through reshapes and transposes) a
    dynamic slice or a scanned input: on the GPU such a product is a library call fed by a loop-dependent
    dynamic-slice fusion, which keeps the scan out of XLA's command buffers."""
    passthrough = {"reshape", "squeeze", "broadcast_in_dim", "transpose", "copy"}
    made = {o: e for e in jaxpr.eqns for o in e.outvars}

    def origin(v):
        e = made.get(v)
        if e is None:
            return "scanned input" if v in xs else None
        return origin(e.invars[0]) if e.primitive.name in passthrough else e.primitive.name

    found = []
    for e in jaxpr.eqns:
        if in_scan and e.primitive.name == "dot_general":
            found += [f"{origin(v)} -> {e.source_info.traceback}" for v in e.invars
                      if origin(v) in ("dynamic_slice", "scanned input")]
        if e.primitive.name == "scan":
            body = e.params["jaxpr"].jaxpr
            first_x = e.params["num_consts"] + e.params["num_carry"]
            found += _products_of_sliced_operands(body, True, frozenset(body.invars[first_x:]))
        for key in ("jaxpr", "call_jaxpr", "body_jaxpr", "cond_jaxpr"):
            sub = e.params.get(key)
            if sub is not None and e.primitive.name != "scan":
                found += _products_of_sliced_operands(getattr(sub, "jaxpr", sub), in_scan, frozenset())
        for branch in e.params.get("branches", ()):
            found += _products_of_sliced_operands(branch.jaxpr, in_scan, frozenset())
    return found


@pytest.mark.parametrize("shape,slots", [("tiny", None), ("tiny", 24), ("qtiny", None), ("qtiny", 48)])
def test_decode_scan_has_no_product_of_a_sliced_operand(tmp_path, shape, slots):
    """The decode step's layer scan (a qwen3moe and qwen4exp at 8 layers, bfloat16 as on a GPU, resident
    and offloaded) reads its layer's weights, KV cache and recurrent state by traced index without feeding
    any of those slices straight into a matrix product (model/layers/attention.py FEW_QUERIES: before it,
    attention's two einsums over the sliced KV cache did)."""
    import dataclasses

    from strata_jax.bench.shapes import SHAPES

    path = write_synthetic_gguf(tmp_path / "m.gguf", dataclasses.replace(SHAPES[shape], n_layers=8))
    m = strata_jax.load(path, ctx=64, dtype="bfloat16", expert_slots=slots)
    assert any(isinstance(r, runs.Run) and r.repeats > 1 for r in m.layer_runs)
    experts = m.experts.take()
    try:
        kv = KVCache.zeros(m.config, 1, 64, m.dtype)
        step = functools.partial(forward, cfg=m.config, dtype=m.dtype, kernels=m.kernels)
        jaxpr = jax.make_jaxpr(step)(m.params, experts, kv, jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
                                     jnp.ones((1,), jnp.int32))
    finally:
        m.experts.put(experts)
    assert _products_of_sliced_operands(jaxpr.jaxpr) == []
