"""Cache policies at qseed's scale (48 MoE layers x 512 experts, top-10) on the bench's realistic routing
(offload/routing.py, fitted to Qwen3-30B-A3B's reuse figures), after 200 tokens of warm-up: the hit rate of
each policy, per-layer caches against one shared cache, at 1/4 and at qseed's ~45 % under 32 GiB
(docs/routing.md).

    JAX_PLATFORMS=cpu python benchmarks/policy_scale.py [TOKENS]    (default 1200; ~1 min on 2 cores)
"""
import json
import sys
import time

from strata_jax.offload.routing import realistic_trace
from strata_jax.offload.simulate import simulate
L, E, K = 48, 512, 10
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1200
trace = realistic_trace(T, L, E, K)
rows = []
for frac in (0.25, 0.45):
    slots = int(frac * L * E)
    for per_layer in (True, False):
        for pol in ("lru", "lfu", "lrfu", "lrfu(0.02)", "belady"):
            if pol == "belady" and per_layer:
                continue
            t0 = time.time()
            r = simulate(trace, pol, slots, per_layer=per_layer, warmup_tokens=200, n_experts=E)
            rows.append(dict(frac=frac, per_layer=per_layer, policy=pol, hit=r.get("hit_rate_after_warmup", r["hit_rate"]), s=round(time.time()-t0, 1)))
            print(json.dumps(rows[-1]), flush=True)
