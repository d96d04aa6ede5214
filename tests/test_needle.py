"""Needle in a haystack on the real default model (Qwen2.5-Coder-0.5B-Instruct, 32K trained) at 8K on CPU:
the passphrase hidden mid-prompt in ~8,100 tokens of real text comes back in the greedy answer (the
blocked attention loop and the prefill chunks over a long prompt, on a real model). The other depths and
sizes are `python -m strata_jax.bench.needle` runs (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

import strata_jax
from strata_jax.bench.needle import KEYS, needle_prompt, run_one

pytestmark = pytest.mark.slow


def test_needle_at_8k_is_found(qwen_gguf_path):
    m = strata_jax.load(qwen_gguf_path, ctx=8192)
    ids = needle_prompt(m, 4096, 0.5)
    assert abs(len(ids) - 4096) < 64 and "passphrase" in m.detokenize(ids)  # text round trips shift a token or two
    row = run_one(m, 8192, 0.5)
    assert row["prompt_tokens"] > 8000
    assert row["found"], f"the answer {row['answer']!r} lacks {KEYS}"
