"""How fast does the expert store load from a warm page cache?

Writes (once) a synthetic qwen3moe GGUF with Qwen3-30B-A3B's expert shape (128 experts of ffn 768 at
d_model 2048, Q4_K: 340 MB a layer) and `--layers` MoE layers, reads it once so that it sits in the page
cache, then times `load_expert_store` (offload/store.py) `--reps` times: GB/s of expert bytes and the
process' peak RSS. `alloc_GB_s` times the store's allocation alone (`_host_array`: a device_put of zeros
of the store's size, before any byte of the file is copied), the part of the load that is not reading;
`alloc_jit_GB_s` the same size made by a jitted `jnp.zeros` placed in that memory (a candidate
replacement). `read_{plain,store_memory}_{1,N}_GB_s`: preadv of the file in 64 MiB pieces, 1 and N threads,
into ordinary memory and into the store's kind of memory: whether the reads or the destination are slow. `verified`: every layer's store rows equal the file's expert bytes (the store is filled
through a raw pointer into the host buffer: this checks that the writes land on this backend).

    python benchmarks/load_store.py [--layers 12] [--path /tmp/strata_load/b30x12.gguf] [--reps 3]
"""

import argparse
import json
import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.core.experts import EXPERT_TENSORS, ExpertSpec, expert_parts
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf
from strata_jax.gguf.reader import GGUFFile
from strata_jax.offload.store import READERS, _host_array, _host_sharding, load_expert_store, store_groups

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=12)
p.add_argument("--path", default=None)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--memory-kind", default="pinned_host")
args = p.parse_args()

path = Path(args.path or f"/tmp/strata_load/b30x{args.layers}.gguf")
if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    write_synthetic_gguf(path, SyntheticSpec(arch="qwen3moe", n_layers=args.layers, d_model=2048, n_heads=16,
                                             n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8,
                                             expert_ffn_dim=768, vocab_size=2048, qtype="Q4_K"))
with open(path, "rb") as f:  # into the page cache
    while f.read(1 << 26):
        pass

gguf = GGUFFile(path)
layers = tuple(range(args.layers))
infos = [[gguf.tensor(f"blk.{i}.{n}.weight") for n in EXPERT_TENSORS] for i in layers]
spec = ExpertSpec(layers, infos[0][0].shape[0], 8, tuple(expert_parts(t) for t in infos))
total = sum(t.nbytes for layer in infos for t in layer)
rates = []
for _ in range(args.reps):
    t0 = time.perf_counter()
    store = load_expert_store(gguf, spec, memory_kind=args.memory_kind)
    rates.append(total / (time.perf_counter() - t0) / 1e9)
verified = True
for j, layer in enumerate(infos):  # the row of expert e: its gate, up and down blocks back to back
    want = np.concatenate([np.asarray(t.data).reshape(spec.n_experts, -1) for t in layer], axis=1)
    verified &= bool(np.array_equal(np.asarray(store.layer(j).data), want))
del store
group_parts, layer_group, _ = store_groups(spec)
shapes = [(layer_group.count(g), spec.n_experts, sum(x.nbytes for x in parts)) for g, parts in enumerate(group_parts)]
alloc = []
for _ in range(args.reps):
    t0 = time.perf_counter()
    arrays = [_host_array(shape, _host_sharding(jax.devices()[0], args.memory_kind))[0] for shape in shapes]
    alloc.append(total / (time.perf_counter() - t0) / 1e9)
    del arrays
alloc_jit = []
for _ in range(args.reps):
    t0 = time.perf_counter()
    arrays = [jax.jit(lambda s=s: jnp.zeros(s, jnp.uint8),
                      out_shardings=_host_sharding(jax.devices()[0], args.memory_kind))() for s in shapes]
    jax.block_until_ready(arrays)
    alloc_jit.append(total / (time.perf_counter() - t0) / 1e9)
    del arrays


def read_rate(dst: np.ndarray, threads: int) -> float:
    """GB/s of preadv from the (cached) file into dst, in 64 MiB pieces over `threads` threads: where the
    store's fill loses time, the file's reads or the destination memory."""
    n, piece = dst.nbytes, 64 << 20
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(at):
            os.preadv(fd, [dst[at:at + piece]], at)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(0, n, piece)))
        return n / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


size = min(path.stat().st_size, total)
pinned, pinned_view = _host_array((size,), _host_sharding(jax.devices()[0], args.memory_kind))
plain = np.zeros(size, np.uint8)
plain[::4096] = 1  # its pages faulted in, as the store's are
reads = {f"read_{name}_{t}_GB_s": round(max(read_rate(dst, t) for _ in range(args.reps)), 2)
         for name, dst in (("plain", plain), ("store_memory", pinned_view)) for t in (1, READERS)}
del pinned_view, pinned, plain
print(json.dumps({**reads, "expert_GB": round(total / 1e9, 2), "layers": args.layers, "memory_kind": args.memory_kind,
                  "GB_s": [round(r, 2) for r in rates], "best_GB_s": round(max(rates), 2),
                  "alloc_GB_s": round(max(alloc), 2),
                  "alloc_jit_GB_s": round(max(alloc_jit), 2), "verified": verified,
                  "peak_rss_GB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                  "cpus": os.cpu_count(), "backend": jax.default_backend()}))
