"""The synthetic model shapes of `strata-jax bench` and the cached GGUF files written for them.

b30: Qwen3-30B-A3B (48 layers, 128 experts top-8, expert ffn 768, Q4_K, ~17 GB); bseed: the 125B-class
target's expert scale (512 experts top-10, expert ffn 512, ~43 GB); small: a quick GPU check; tiny: the
CPU test-suite's shape (seconds, not minutes). A file is written once into the cache, keyed by its spec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from pathlib import Path

from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

log = logging.getLogger("strata_jax")

SHAPES = {
    "tiny": SyntheticSpec(arch="qwen3moe", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                          n_experts=16, n_experts_used=2, expert_ffn_dim=64, vocab_size=512, qtype="Q8_0",
                          context_length=4096),
    "small": SyntheticSpec(arch="qwen3moe", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=2, head_dim=128,
                           n_experts=64, n_experts_used=8, expert_ffn_dim=512, vocab_size=32768, qtype="Q4_K"),
    "b30": SyntheticSpec(arch="qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                         n_experts=128, n_experts_used=8, expert_ffn_dim=768, vocab_size=151936, qtype="Q4_K",
                         context_length=40960),
    "bseed": SyntheticSpec(arch="qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                           n_experts=512, n_experts_used=10, expert_ffn_dim=512, vocab_size=151936, qtype="Q4_K",
                           context_length=40960),
}


def synthetic_model_path(shape: str) -> Path:
    from strata_jax.core.paths import cache_dir, file_lock

    spec = SHAPES[shape]
    key = hashlib.sha256(repr(dataclasses.astuple(spec)).encode()).hexdigest()[:16]
    path = cache_dir() / "synthetic" / f"{shape}-{key}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if not path.exists():
            t0 = time.perf_counter()
            tmp = path.with_suffix(".partial")
            write_synthetic_gguf(tmp, spec)
            tmp.rename(path)
            log.info("wrote %s (%.1f GB) in %.0f s", path, path.stat().st_size / 1e9, time.perf_counter() - t0)
    return path
