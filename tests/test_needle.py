"""Needle in a haystack on the real default model (Qwen2.5-Coder-0.5B-Instruct, 32K trained) at 8K on CPU:
the passphrase hidden mid-prompt in ~8,100 tokens of real text comes back in the greedy answer (the
blocked attention loop and the prefill chunks over a long prompt, on a real model), with the whole cache on the
device and with all but 2,048 positions a layer streamed from host memory. The other depths and
sizes are `python -m strata_jax.bench.needle` runs (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

import strata_jax
from strata_jax.bench.needle import KEYS, needle_prompt, run_one

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kv_resident", [None, 2048])
def test_needle_at_8k_is_found(qwen_gguf_path, kv_resident):
    """kv_resident 2048: the needle (at ~4,050) lies in the streamed part of every layer's cache, brought back
    from host memory in each step."""
    m = strata_jax.load(qwen_gguf_path, ctx=8192, kv_resident=kv_resident)
    ids = needle_prompt(m, 4096, 0.5)
    assert abs(len(ids) - 4096) < 64 and "passphrase" in m.detokenize(ids)  # text round trips shift a token or two
    row = run_one(m, 8192, 0.5)
    assert row["prompt_tokens"] > 8000
    assert row["found"], f"the answer {row['answer']!r} lacks {KEYS}"
    if kv_resident:
        assert 0 < m.kv_stats()["kv_vram_hit"] < 0.5
