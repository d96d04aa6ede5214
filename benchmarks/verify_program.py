"""A speculative pass's recurrent rewind on CPU: qtiny at 48 layers, a 5-token pass, with and without the rewind
(characters of the lowered program, compile seconds with the compilation cache off, run ms). Run it on an older
tree with PYTHONPATH=that tree to compare (before hybrid.rewind, it takes forward.rewind).

    JAX_PLATFORMS=cpu python benchmarks/verify_program.py
"""
import dataclasses, sys, time
import jax, jax.numpy as jnp
import strata_jax
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
from strata_jax.model import forward as fw, hybrid
jax.config.update("jax_enable_compilation_cache", False)
path = write_synthetic_gguf("/tmp/vp_q48.gguf", dataclasses.replace(SHAPES["qtiny"], n_layers=48))
m = strata_jax.load(path, ctx=64)
ex = m.experts.take()
kv = fw.KVCache.zeros(m.config, 1, 64, m.dtype)
T = 5
new = hasattr(hybrid, "rewind")
def pass_and_rewind(params, ex, kv, toks, start, nv, n):
    out = fw.forward(params, ex, kv, toks, start, nv, cfg=m.config, dtype=m.dtype, kernels=m.kernels, all_logits=True, tape=True)
    taped = out[4]
    if new:
        return hybrid.rewind(m.config, kv.rec, out[1].rec, taped, toks, start, n)
    return fw.rewind(params, kv.rec, taped, toks, start, n, cfg=m.config, kernels=m.kernels)
def pass_only(params, ex, kv, toks, start, nv, n):
    return fw.forward(params, ex, kv, toks, start, nv, cfg=m.config, dtype=m.dtype, kernels=m.kernels, all_logits=True, tape=True)[1].rec
args = (m.params, ex, kv, jnp.ones((1, T), jnp.int32), jnp.full((1,), 7, jnp.int32), jnp.full((1,), T, jnp.int32), jnp.full((1,), 2, jnp.int32))
for name, f in (("pass", pass_only), ("pass+rewind", pass_and_rewind)):
    lo = jax.jit(f).lower(*args)
    t0 = time.perf_counter(); c = lo.compile(); dt = time.perf_counter() - t0
    c(*args); t0 = time.perf_counter()
    for _ in range(5): jax.block_until_ready(c(*args))
    run = (time.perf_counter() - t0) / 5
    print(f"{'new' if new else 'old'} {name}: {len(lo.as_text()):,} chars, compile {dt:.2f} s, run {run*1e3:.1f} ms")
