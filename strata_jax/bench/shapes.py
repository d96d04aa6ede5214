"""The synthetic model shapes of `strata-jax bench` and the cached GGUF files written for them.

b30: Qwen3-30B-A3B (48 layers, 128 experts top-8, expert ffn 768, Q4_K, ~17 GB); bseed: the 125B-class
target's expert scale (512 experts top-10, expert ffn 512, ~43 GB); qseed: the seed model itself
(qwen4exp, see its comment); small: a quick GPU check; tiny / qtiny: the CPU test-suite's shapes
(seconds, not minutes). A file is written once into the cache, keyed by its spec.
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
    # qseed: the seed's qwen4exp (shared/seeds/000_*: 125B-class, 24,576 experts, IQ3_S, 83.6 GB in two shards:
    # 54.8 GB of experts and dense weights, a 28.8 GB PLE table). 48 layers, full attention every 4th (12
    # gated attention + QSA, 36 gated DeltaNet), 512 experts top-10 + a shared expert. d_model 3072: the seed
    # logs 1.94 MiB per IQ3_S expert, which is 3 x 512 x 3072 weights at 3.44 bits (vocab 248,320 also from
    # its log). Not in the seed, so transformers' Qwen4ExpTextConfig defaults: attention 16 heads of 256
    # (2 KV heads, partial rotary 0.25 = 64 dims, mrope sections 11/11/10), DeltaNet 16 key / 32 value
    # heads of 128, conv 4, hyper-connections 4 streams of rank 320, PLE 3-grams x 8 heads per order
    # (16 heads of 3072 / 16 = 192 dims, conv 4). The QSA indexer has no defaults: 32 heads of 128, blocks
    # of 4, a 2048-token budget (guessed, DeepSeek-V3.2-like). Dense matrices Q4_K (rows the 256 blocks
    # don't tile, hc_up's 320, fall back to F16). Experts are the real size (49.8 GB), dense 3.7 GB; the file 56.6 GB.
    # SCALED: the PLE table. Real: 16 heads of ~20M rows (ngram_vocab_size_base 20,000,000) x 192, the
    # seed's 28.8 GB shard; here 16 heads of ~500K rows x 192 in F16 = 3.1 GB, so the file fits the GPU
    # machine's 64 GiB disk and the table a few GB of pinned host RAM (the table's bytes per gathered row,
    # the per-token traffic, are the real ones). The hash constants are random, as a checkpoint's are.
    "qseed": SyntheticSpec(arch="qwen4exp", n_layers=48, d_model=3072, n_heads=16, n_kv_heads=2, head_dim=256,
                           n_experts=512, n_experts_used=10, expert_ffn_dim=512, shared_expert_ffn_dim=512,
                           vocab_size=248320, qtype="Q4_K", expert_qtype="IQ3_S", context_length=131072,
                           rope_theta=1e7, full_attention_interval=4, rope_dim=64, rope_sections=(11, 11, 10),
                           linear_k_heads=16, linear_v_heads=32, linear_head_dim=128, linear_conv_kernel=4,
                           hc_count=4, hc_rank=320, indexer_heads=32, indexer_head_dim=128, indexer_budget=2048,
                           compress_ratio=4, ple_layer=0, ple_ngram_size=3, ple_heads_per_ngram=8,
                           ple_head_vocab=500_000, ple_conv_kernel=4, ple_qtype="F16"),
    # qtiny: qseed's architecture at test scale (4 layers: 3 DeltaNet, 1 attention; IQ3_S experts; PLE on
    # layer 0), a few MB, loads and decodes on CPU in seconds (plus compilation)
    "qtiny": SyntheticSpec(arch="qwen4exp", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                           n_experts=16, n_experts_used=4, expert_ffn_dim=256, shared_expert_ffn_dim=256,
                           vocab_size=512, qtype="Q8_0", expert_qtype="IQ3_S", context_length=4096,
                           full_attention_interval=4, rope_dim=16, rope_sections=(3, 3, 2), linear_k_heads=2,
                           linear_v_heads=4, linear_head_dim=32, hc_count=4, hc_rank=32, indexer_heads=2,
                           indexer_head_dim=32, indexer_budget=16, compress_ratio=4, ple_layer=0, ple_ngram_size=3,
                           ple_heads_per_ngram=2, ple_head_vocab=97, ple_conv_kernel=4),
}


def synthetic_model_path(shape: str, expert_qtype: str | None = None) -> Path:
    """The shape's synthetic GGUF, written once into the cache; expert_qtype: its routed experts in that
    type instead (a low-bit copy for --cold-experts: random weights, the speed is what it measures)."""
    from strata_jax.core.paths import cache_dir, file_lock

    spec = SHAPES[shape] if expert_qtype is None else dataclasses.replace(SHAPES[shape], expert_qtype=expert_qtype)
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
