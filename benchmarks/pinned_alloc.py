"""How fast does a fresh process get pinned host memory? (issue 30: qseed's cold load spends ~44 s of
its ~64 s before the first expert byte is read, allocating 46 GiB; benchmarks/load_store.py's alloc_GB_s
timed reused memory.)

`--way` makes `--gb` GB of `--memory-kind` memory, first in this fresh process, then again after freeing
it (`again_GB_s`: what a cache of freed pinned memory gives); run each way in its own process:
  put      jax.device_put(np.zeros) of one array (offload/store.py's `_host_array` today)
  jit      a jitted jnp.zeros with out_shardings in that memory, one array
  threads  N arrays of gb/N, each a device_put from its own thread (does the pinning run in parallel?)

    python benchmarks/pinned_alloc.py --way put|threads|jit [--gb 16] [--threads 4]   (one JSON line)
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.offload.store import _host_array, _host_sharding

p = argparse.ArgumentParser()
p.add_argument("--way", choices=("put", "threads", "jit"), default="put")
p.add_argument("--gb", type=float, default=16.0)
p.add_argument("--threads", type=int, default=4)
p.add_argument("--memory-kind", default="pinned_host")
args = p.parse_args()

n = int(args.gb * 1e9)
sharding = _host_sharding(jax.devices()[0], args.memory_kind)
jax.device_put(np.zeros(16, np.uint8), sharding).block_until_ready()  # the client and its allocator up


def put():
    return [_host_array((n,), sharding)[0]]


def jit():
    return [jax.block_until_ready(jax.jit(lambda: jnp.zeros((n,), jnp.uint8), out_shardings=sharding)())]


def put_threads():
    with ThreadPoolExecutor(args.threads) as pool:
        return list(pool.map(lambda _: _host_array((n // args.threads,), sharding)[0], range(args.threads)))


make = {"put": put, "threads": put_threads, "jit": jit}[args.way]
out = {"way": args.way, "gb": args.gb, "threads": args.threads, "memory_kind": args.memory_kind,
       "backend": jax.default_backend()}
for label in ("fresh", "again"):
    t0 = time.perf_counter()
    try:
        arrays = make()
    except Exception as e:  # noqa: BLE001 - a way that fails is a result too
        out[label] = f"failed: {str(e).splitlines()[0][:200]}"
        break
    out[f"{label}_GB_s"] = round(n / (time.perf_counter() - t0) / 1e9, 2)
    del arrays
print(json.dumps(out))
