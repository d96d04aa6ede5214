"""`strata-jax bench`: the offload path against the all-resident run and against llama.cpp, on a synthetic
random-weight MoE GGUF (or any GGUF), with every figure issue 5 asks for, as JSON rows.

One invocation per shape. For each configuration (resident; --cache-fraction F: F of all experts as
slots; --vram-budget B: the cache that B holds) and each --routing mode (model: the random routers,
near-uniform, the worst case for a cache; realistic: the same realistic_trace(QWEN3_30B_A3B, seed 0)
replayed in every configuration, docs/routing.md), a row gives: steady-state decode tok/s (--tokens
after a warm-up), warm prefill tok/s of each --prefill-len prompt, hit rate, host->device GB/s, the
share of step time stalled on transfers, the limit ratio (strata_jax/bench/limits.py), and whether the
greedy tokens equal the resident run of the same routing mode.

--vram-budget 32GiB emulates a 32 GiB card: JAX's allocations are capped at it
(XLA_CLIENT_MEM_FRACTION, set before JAX starts) and the cache is sized for it. A resident
reference that does not fit then runs in a child process that sees the whole card.
--peer-llama-bench PATH adds llama.cpp's rows (all-gpu, cpu-experts, budget) on the same file.
--out FILE keeps every row with the machine, versions, date and command line; render the docs table
with `python -m strata_jax.bench.table FILE... --update docs/benchmarks.md`.

Shapes (strata_jax/bench/shapes.py): b30 (Qwen3-30B-A3B, ~17 GB), bseed (512 experts top-10, ~43 GB),
small (a quick GPU check), tiny (the CPU tests'). The GGUF is written once into the cache.
"""

from strata_jax.bench.cli import main
from strata_jax.bench.shapes import SHAPES, synthetic_model_path

__all__ = ["main", "SHAPES", "synthetic_model_path"]
