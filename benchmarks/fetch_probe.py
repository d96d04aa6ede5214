"""What does one in-jit expert fetch cost, and where does the time go?

A whole-token program of L layers; each layer copies `n` expert rows (R bytes each) from a pinned-host
store into a donated device pool, then reads the pool (a stand-in for the expert compute). Variants:
  dyn     fori_loop(0, n_traced): trip count known only on the device (the engine's miss loop)
  static  fori_loop(0, n_python): trip count known at compile time
  unroll  n copies written out, no loop
  cond    one lax.cond per layer around a static loop (a data-dependent branch per layer)
Run it once plainly and once with XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL to see
whether device-side control flow (CUDA graph conditional nodes) removes the per-iteration host sync.

    python benchmarks/fetch_probe.py [--rows-mb 0.88 2.65] [--layers 48] [--n 0 1 2 4]
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

p = argparse.ArgumentParser()
p.add_argument("--rows-mb", type=float, nargs="+", default=[0.88, 2.65])
p.add_argument("--layers", type=int, default=48)
p.add_argument("--n", type=int, nargs="+", default=[0, 1, 2, 4, 8])
p.add_argument("--variants", nargs="+", default=["dyn", "static", "unroll", "cond"])
p.add_argument("--reps", type=int, default=20)
args = p.parse_args()

dev = jax.devices()[0]
DEV = SingleDeviceSharding(dev)
HOST = SingleDeviceSharding(dev, memory_kind="pinned_host")
L = args.layers
N_STORE = 64  # rows in the host store per layer
N_POOL = 32  # slots per layer


def build(variant, n_static, L):
    def layer_fetch(pool_SB, store_XB, l, n, src_U, dst_U):
        def body(i, pool):
            row = jax.device_put(jax.lax.dynamic_index_in_dim(store_XB, l * N_STORE + src_U[i], 0, keepdims=False),
                                 jax.memory.Space.Device)
            return jax.lax.dynamic_update_index_in_dim(pool, row, l * N_POOL + dst_U[i], 0)

        if variant == "dyn":
            return jax.lax.fori_loop(0, n, body, pool_SB)
        if variant == "static":
            return jax.lax.fori_loop(0, n_static, body, pool_SB)
        if variant == "unroll":
            for i in range(n_static):
                pool_SB = body(i, pool_SB)
            return pool_SB
        if variant == "cond":
            return jax.lax.cond(n > 0, lambda q: jax.lax.fori_loop(0, n_static, body, q), lambda q: q, pool_SB)
        raise ValueError(variant)

    def step(x, pool_SB, store_XB, n, src_LU, dst_LU):
        for l in range(L):
            pool_SB = layer_fetch(pool_SB, store_XB, l, n, src_LU[l], dst_LU[l])
            # stand-in for the expert compute: read 8 slots of this layer
            rows = jnp.take(pool_SB, l * N_POOL + jnp.arange(8), axis=0)
            x = x + jnp.sum(rows[:, :4096].astype(jnp.float32)) * 1e-9
        return x, pool_SB

    return jax.jit(step, in_shardings=(DEV, DEV, HOST, DEV, DEV, DEV), donate_argnums=(1,))


results = []
for mb in args.rows_mb:
    R = int(mb * 1e6) // 256 * 256
    store = jax.device_put(np.random.default_rng(0).integers(0, 255, (L * N_STORE, R), dtype=np.uint8), HOST)
    pool = jax.device_put(jnp.zeros((L * N_POOL, R), jnp.uint8), DEV)
    rng = np.random.default_rng(1)
    for variant in args.variants:
        for n in args.n:
            f = build(variant, n, L)
            src = jnp.asarray(rng.integers(0, N_STORE, (L, max(n, 1))), jnp.int32)
            dst = jnp.asarray(rng.permutation(N_POOL)[: max(n, 1)][None].repeat(L, 0), jnp.int32)
            x = jnp.zeros((), jnp.float32)
            nn = jnp.int32(n)
            try:
                t0 = time.perf_counter()
                x, pool = f(x, pool, store, nn, src, dst)
                jax.block_until_ready(pool)
                compile_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    x, pool = f(x, pool, store, nn, src, dst)
                jax.block_until_ready((x, pool))
                dt = (time.perf_counter() - t0) / args.reps
                moved = n * L * R
                r = {"variant": variant, "row_MB": R / 1e6, "n_per_layer": n, "ms_per_step": dt * 1e3,
                     "us_per_copy": dt / max(n * L, 1) * 1e6, "GB_s": moved / dt / 1e9, "compile_s": compile_s}
            except Exception as e:  # noqa: BLE001 - a probe reports what failed
                r = {"variant": variant, "row_MB": R / 1e6, "n_per_layer": n, "error": f"{type(e).__name__}: {e}"[:300]}
            r["xla_flags"] = os.environ.get("XLA_FLAGS", "")
            results.append(r)
            print(json.dumps(r), flush=True)
    del store, pool

out = os.environ.get("OUT")
if out:
    tag = "cmdbuf" if "command_buffer" in os.environ.get("XLA_FLAGS", "") else "plain"
    with open(os.path.join(out, f"fetch_probe_{tag}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
