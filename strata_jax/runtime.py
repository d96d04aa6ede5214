"""Process-wide XLA settings the engine relies on, applied before JAX starts its GPU backend.

The expert-miss loop in each jitted step has a trip count known only on the device. By default XLA:GPU
runs such a loop from the host and copies its predicate back after every iteration, a host round trip
per loop and per fetched expert. Capturing while loops and conditionals in CUDA graphs (conditional
nodes evaluated on the device) removes the round trips (figures: docs/benchmarks.md, fetch_probe).

XLA's choices of GEMM configurations (autotuning) are most of a prefill program's compile time (docs/benchmarks.md:
20.7 s with it, 7.9 s without, but 5.2x slower). They are kept per fusion on disk beside the compiled programs, so a
program that changed (another context, budget or chunk) still finds its GEMMs tuned: 17.5 -> 6.2-7.7 s for qseed's
prefill at 8 layers. STRATA_JAX_COMPILATION_CACHE=0 turns that off with the program cache.

Set STRATA_JAX_XLA_DEFAULTS=0 to leave XLA_FLAGS alone; flags the user already set always win.
"""

from __future__ import annotations

import importlib.metadata
import os

from strata_jax.core.paths import cache_dir

GPU_FLAGS = {
    "--xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL",
}

applied: dict[str, str] = {}


def cache_flags() -> dict[str, str]:
    """The on-disk autotuning cache, one per jaxlib version (its XLA's choices), unless
    STRATA_JAX_COMPILATION_CACHE=0 (the cold-compile benchmarks)."""
    if os.environ.get("STRATA_JAX_COMPILATION_CACHE", "") == "0":
        return {}
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"--xla_gpu_per_fusion_autotune_cache_dir": str(cache_dir() / "xla-autotune" / version)}


def configure_xla() -> dict[str, str]:
    """Add GPU_FLAGS to XLA_FLAGS unless the user set them (or opted out). Returns what was added.
    Only effective before the first JAX computation in the process; CPU runs ignore these flags."""
    if os.environ.get("STRATA_JAX_XLA_DEFAULTS", "1") == "0":
        return {}
    current = os.environ.get("XLA_FLAGS", "")
    added = {k: v for k, v in (GPU_FLAGS | cache_flags()).items() if k not in current}
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current] + [f"{k}={v}" for k, v in added.items()]).strip()
        applied.update(added)
    return added
