"""Checks several architecture test files share (an import of the tests, not a test module)."""

from __future__ import annotations

import numpy as np


def resident_reference(res, ids, n_tokens: int = 12):
    """(logits, greedy tokens) of the all-resident engine `res` on `ids`: what the offloaded one must give."""
    assert res.cache_plan.resident
    return res.logits(ids), res.generate(ids, max_tokens=n_tokens, temperature=0).token_ids


def assert_offloaded_matches(off, ids, reference) -> None:
    """An offloading engine gives the resident reference's logits and greedy tokens bit for bit, and its
    cache did miss (so the fetch path ran) with every lookup counted once."""
    ref_logits, ref_tokens = reference
    assert not off.cache_plan.resident
    np.testing.assert_array_equal(off.logits(ids), ref_logits)
    assert off.generate(ids, max_tokens=len(ref_tokens), temperature=0).token_ids == ref_tokens
    st = off.stats()
    assert st["misses"] > 0 and st["lookups"] == st["hits"] + st["misses"]
