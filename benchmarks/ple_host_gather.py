"""Rows of a pinned-host table gathered inside jit: XLA host compute (what model/layers/ple.py does) against one
DMA per row (offload/fetch.py's pattern). Run on the GPU machine: `python3 benchmarks/ple_host_gather.py`.
Figures in docs/benchmarks.md ("PLE n-gram table in host memory")."""

import time

import jax
import jax.experimental.compute_on as con
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding as SDS

print(jax.__version__, [n for n in dir(con) if not n.startswith("_")])
con_fn = getattr(con, "compute_on2", None) or con.compute_on
d = jax.devices()[0]
R, C = 20_000_000, 88  # one PLE head's rows, 128 Q5_0 values each
host = np.random.randint(0, 255, size=(R, C), dtype=np.uint8)
tab = jax.device_put(host, SDS(d, memory_kind="pinned_host"))
tab.block_until_ready()


def take(t, i):
    return jnp.take(t, i, axis=0, mode="clip")


hg = con_fn(take, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


def f(t, i):
    r = hg(t, jax.device_put(i, jax.memory.Space.Host))
    return jax.device_put(r, jax.memory.Space.Device).astype(jnp.float32).sum(-1)


def loop(t, i):
    o = jnp.zeros((i.shape[0], t.shape[1]), t.dtype)

    def body(k, o):
        r = jax.device_put(jax.lax.dynamic_index_in_dim(t, i[k], 0, keepdims=False), jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(o, r, k, 0)

    return jax.lax.fori_loop(0, i.shape[0], body, o).astype(jnp.float32).sum(-1)


for name, fn in (("compute_on", f), ("loop", loop)):
    for n in (64, 8192):
        try:
            jf = jax.jit(fn)
            i = jnp.asarray(np.random.randint(0, R, size=n).astype(np.int32))
            r = jf(tab, i)
            r.block_until_ready()
            ok = np.array_equal(np.asarray(r), host[np.asarray(i)].astype(np.float32).sum(-1))
            t0 = time.perf_counter()
            for _ in range(10):
                r = jf(tab, i)
            r.block_until_ready()
            print(name, n, "exact", ok, f"{(time.perf_counter() - t0) / 10 * 1e3:.3f} ms")
        except Exception as e:
            print(name, n, "FAIL", type(e).__name__, str(e)[:600])
