"""Process-wide XLA settings the engine relies on, applied before JAX starts its GPU backend.

The expert-miss loop in each jitted step has a trip count known only on the device. By default XLA:GPU
runs such a loop from the host and copies its predicate back after every iteration, a host round trip
per loop and per fetched expert. Capturing while loops and conditionals in CUDA graphs (conditional
nodes evaluated on the device) removes the round trips (figures: docs/benchmarks.md, fetch_probe).

Set STRATA_JAX_XLA_DEFAULTS=0 to leave XLA_FLAGS alone; flags the user already set always win.
"""

from __future__ import annotations

import os

GPU_FLAGS = {
    "--xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL",
}

applied: dict[str, str] = {}


def configure_xla() -> dict[str, str]:
    """Add GPU_FLAGS to XLA_FLAGS unless the user set them (or opted out). Returns what was added.
    Only effective before the first JAX computation in the process; CPU runs ignore these flags."""
    if os.environ.get("STRATA_JAX_XLA_DEFAULTS", "1") == "0":
        return {}
    current = os.environ.get("XLA_FLAGS", "")
    added = {k: v for k, v in GPU_FLAGS.items() if k not in current}
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current] + [f"{k}={v}" for k, v in added.items()]).strip()
        applied.update(added)
    return added
