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


def session_tokens(s, prompts, max_tokens: int) -> list[list[int]]:
    """Every prompt admitted into Session `s` at once (greedy), stepped until all end: each one's tokens."""
    got, rows = {}, {}
    for i, p in enumerate(prompts):
        r, chunks = s.admit(p, max_tokens=max_tokens, temperature=0)
        rows[r], got[i] = i, [t for c in chunks for t in c.token_ids]
    while s.active_rows:
        for r, chunks in s.step().items():
            got[rows[r]] += [t for c in chunks for t in c.token_ids]
    return [got[i] for i in range(len(prompts))]


def decode_two_rows(m, seqs, ctx: int, n0=(5, 7), idle_until: int = 6):
    """Two rows through model/forward.py's forward (jitted, all logits): a prefill of n0[b] tokens each in
    one call (a 16-token bucket), then one token per call, row 1 idle (at a position past the cache) for
    its first idle_until steps; an idle row routes to no expert (checked for a MoE). Returns each row's
    logits per position, how far each row got, and the prefill's routed expert ids [M, B*T, k]."""
    import functools

    import jax
    import jax.numpy as jnp

    from strata_jax.model.forward import KVCache, forward

    cfg, n = m.config, len(seqs[0])
    step = jax.jit(functools.partial(forward, cfg=cfg, dtype=jnp.float32, kernels=m.kernels, all_logits=True,
                                     attn_len=ctx))
    experts = m.experts.take() if m.experts is not None else None
    try:
        kv = KVCache.zeros(cfg, 2, ctx, jnp.float32)
        toks = np.zeros((2, 16), np.int32)
        for b in range(2):
            toks[b, :n0[b]] = seqs[b][:n0[b]]
        logits, kv, experts, prefill_routed = step(m.params, experts, kv, jnp.asarray(toks), jnp.zeros(2, jnp.int32),
                                                   jnp.asarray(n0, jnp.int32))
        got = [list(np.asarray(logits[b, :n0[b]])) for b in range(2)]
        pos = list(n0)
        for s in range(n - n0[0]):
            live = [True, s >= idle_until and pos[1] < n]
            tok = [seqs[b][pos[b]] if live[b] else 0 for b in range(2)]
            start = [pos[b] if live[b] else ctx for b in range(2)]
            logits, kv, experts, routed = step(m.params, experts, kv, jnp.asarray(tok, jnp.int32)[:, None],
                                               jnp.asarray(start, jnp.int32), jnp.asarray(live, jnp.int32))
            if cfg.is_moe:
                assert (np.asarray(routed) >= 0).all(axis=(0, 2)).tolist() == live  # an idle row routes nowhere
            for b in range(2):
                if live[b]:
                    got[b].append(np.asarray(logits[b, 0]))
                    pos[b] += 1
    finally:
        if experts is not None:
            m.experts.put(experts)
    assert pos == [n, n - idle_until + n0[1] - n0[0]]
    return got, pos, np.asarray(prefill_routed)
