"""Can an in-jit host->device expert copy overlap the step's compute on XLA:GPU?

A whole-token program of L layers. Each layer does a fixed amount of compute (a matrix-vector chain
standing in for attention + experts) and, in the variants that copy, brings `n` expert rows of R bytes
from a pinned-host store into a donated device pool. If copies overlap compute, "both" costs about
max(compute, copy) per layer; if not, compute + copy.

  compute   compute only
  copy      copies only (static trip count)
  serial    copy layer l's rows, then compute that reads them (today's miss path)
  ahead     issue layer l+1's copies before layer l's compute, read them one layer later (prefetch)
  ahead_dyn as ahead, but the copies run in a dynamic-trip fori_loop (the engine's loop)

    python benchmarks/overlap_probe.py [--rows-mb 2.65] [--n 2] [--dim 4096] [--layers 48]
Run plainly and with XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true to see whether the
scheduler moves the copies off the compute stream.
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
p.add_argument("--rows-mb", type=float, default=2.65)
p.add_argument("--n", type=int, default=2)
p.add_argument("--dim", type=int, default=4096, help="compute: dim x dim bf16 mat-vec chain per layer")
p.add_argument("--chain", type=int, default=4, help="mat-vecs per layer")
p.add_argument("--layers", type=int, default=48)
p.add_argument("--reps", type=int, default=20)
args = p.parse_args()

dev = jax.devices()[0]
DEV, HOST = SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")
L, n = args.layers, args.n
R = int(args.rows_mb * 1e6) // 256 * 256
N_STORE, N_POOL = 16, 8
store = jax.device_put(np.random.default_rng(0).integers(0, 255, (L * N_STORE, R), dtype=np.uint8), HOST)
pool = jax.device_put(jnp.zeros((L * N_POOL, R), jnp.uint8), DEV)
w = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (args.chain, args.dim, args.dim), jnp.bfloat16) * 0.01,
                   DEV)


def fetch(pool_SB, store_XB, l, cnt, dynamic):
    def body(i, q):
        row = jax.device_put(jax.lax.dynamic_index_in_dim(store_XB, l * N_STORE + i, 0, keepdims=False),
                             jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(q, row, (l % L) * N_POOL + i, 0)

    return jax.lax.fori_loop(0, cnt if dynamic else n, body, pool_SB)


def compute(x, w):
    for c in range(w.shape[0]):
        x = jnp.tanh(w[c] @ x)
    return x


def use(x, pool_SB, l):
    # read the layer's rows so the copy must land before this point
    return x + jnp.sum(pool_SB[(l % L) * N_POOL, :256].astype(jnp.float32)).astype(x.dtype) * 1e-9


def make(variant):
    def step(x, pool_SB, store_XB, w, cnt):
        if variant in ("ahead", "ahead_dyn"):
            pool_SB = fetch(pool_SB, store_XB, 0, cnt, variant == "ahead_dyn")
        for l in range(L):
            if variant == "copy":
                pool_SB = fetch(pool_SB, store_XB, l, cnt, False)
                x = use(x, pool_SB, l)
                continue
            if variant == "serial":
                pool_SB = fetch(pool_SB, store_XB, l, cnt, False)
            if variant in ("ahead", "ahead_dyn") and l + 1 < L:
                nxt = fetch(pool_SB, store_XB, l + 1, cnt, variant == "ahead_dyn")
            x = compute(x, w)
            if variant != "compute":
                x = use(x, pool_SB, l)
            if variant in ("ahead", "ahead_dyn") and l + 1 < L:
                pool_SB = nxt
        return x, pool_SB

    return jax.jit(step, in_shardings=(DEV, DEV, HOST, DEV, DEV), donate_argnums=(1,))


results = []
x = jnp.ones((args.dim,), jnp.bfloat16)
cnt = jnp.int32(n)
for variant in ["compute", "copy", "serial", "ahead", "ahead_dyn"]:
    f = make(variant)
    x1, pool = f(x, pool, store, w, cnt)
    jax.block_until_ready(pool)
    t0 = time.perf_counter()
    for _ in range(args.reps):
        x1, pool = f(x, pool, store, w, cnt)
    jax.block_until_ready((x1, pool))
    dt = (time.perf_counter() - t0) / args.reps
    r = {"variant": variant, "ms_per_step": dt * 1e3, "row_MB": R / 1e6, "n_per_layer": n, "layers": L,
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
    results.append(r)
    print(json.dumps(r), flush=True)

if os.environ.get("OUT"):
    tag = "lhs" if "latency_hiding" in os.environ.get("XLA_FLAGS", "") else "plain"
    with open(os.path.join(os.environ["OUT"], f"overlap_probe_{tag}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
