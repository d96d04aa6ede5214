"""Process-wide XLA settings the engine relies on, applied before JAX starts its GPU backend.

The expert-miss loop in each jitted step has a trip count known only on the device. By default XLA:GPU
runs such a loop from the host and copies its predicate back after every iteration; measured on an
H200 (benchmarks/fetch_probe.py, 48 layers) that costs ~39 us per loop plus ~10 us per fetched expert.
With while loops and conditionals captured in CUDA graphs (conditional nodes evaluated on the device)
the same loop costs ~13 us and a 2.6 MB expert moves at 40 GB/s instead of 25-30.

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
