"""How the forward program grows with depth: qtiny (the seed's architecture at test scale) at 4 and 48
layers, decode step (T=1) and a 16-token prefill chunk, resident and offloaded into one shared pool:
characters of the lowered program, argument leaves (params, experts, KV) and compile seconds with the
compilation cache off. Issue 30 asks 48 vs 4 within 1.3x in size and 1.5x in compile time.

    JAX_PLATFORMS=cpu python benchmarks/program_growth.py
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

import strata_jax
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.model.forward import KVCache, forward

jax.config.update("jax_enable_compilation_cache", False)


def program(path, T, **load):
    m = strata_jax.load(path, ctx=64, **load)
    ex = m.experts.take()
    try:
        kv = KVCache.zeros(m.config, 1, 64, m.dtype)
        step = jax.jit(forward, static_argnames=("cfg", "dtype", "kernels"))
        lo = step.lower(m.params, ex, kv, jnp.ones((1, T), jnp.int32), jnp.zeros((1,), jnp.int32),
                        jnp.full((1,), T, jnp.int32), cfg=m.config, dtype=m.dtype, kernels=m.kernels)
        t0 = time.perf_counter()
        lo.compile()
        return len(lo.as_text()), len(jax.tree.leaves((m.params, ex, kv))), round(time.perf_counter() - t0, 2)
    finally:
        m.experts.put(ex)


for n in (4, 48):
    path = write_synthetic_gguf(f"/tmp/program_growth_q{n}.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=n))
    for T in (1, 16):
        for load in ({}, dict(expert_slots=4 * n, expert_pools="shared")):
            chars, leaves, compile_s = program(path, T, **load)
            print(f"layers {n:2d} T {T:2d} {'offloaded' if load else 'resident '}: {chars:,} chars, {leaves} leaves, "
                  f"compile {compile_s} s", flush=True)
