"""Speculative decoding's ceiling on random weights (issue 18): random weights draft nothing real, so the
drafts come from an oracle that knows the greedy continuation and gets each drafted token right with a
forced probability. Acceptance 1 gives the cost of a verify pass of K tokens (each pass emits K), lower
acceptances the tok/s a drafter of that quality would give (the verify pass, its expert fetches and the
host's round trip per pass all real; only the drafter's own cost is left out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("strata_jax")


class OracleDrafter:
    """Drafts the reference continuation `ref` of `prompt_len` prompt tokens: each drafted token is the
    reference's with probability `accept`, else another id (a wrong draft ends what the pass accepts)."""

    def __init__(self, ref: Sequence[int], prompt_len: int, accept: float, vocab: int, seed: int = 0):
        self.ref, self.prompt_len, self.accept, self.vocab = list(ref), prompt_len, accept, vocab
        self.rng = np.random.default_rng(seed)

    def __call__(self, seq: Sequence[int], n_max: int) -> list[int]:
        j = len(seq) - self.prompt_len  # seq ends with the reference's token j - 1
        want = self.ref[j: j + n_max]
        right = self.rng.random(len(want)) < self.accept
        return [t if ok else (t + 1) % self.vocab for t, ok in zip(want, right)]


def forced_speculation(model, prompt: list[int], ref: list[int], n_tokens: int, pass_tokens: Sequence[int],
                       accepts: Sequence[float]) -> list[dict]:
    """For each verify-pass size K (tokens per pass: the last token and K - 1 drafts) and forced acceptance
    a: greedy decode of n_tokens with the oracle drafter, timed after a warm-up that compiles the pass.
    same_tokens: the output equals the plain decode's (the verify pass's logits may round differently)."""
    rows = []
    try:
        for k in pass_tokens:
            for a in accepts:
                model.use_drafter(OracleDrafter(ref, len(prompt), a, model.config.vocab_size), spec_max=k - 1,
                                  name=f"oracle-{a:g}")
                model.generate(prompt, max_tokens=min(8, n_tokens), temperature=0, cache_prompt=False)  # compiles
                t0 = time.perf_counter()
                g = model.generate(prompt, max_tokens=n_tokens, temperature=0, cache_prompt=False)
                t = g.timings
                drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
                row = {"pass_tokens": k, "forced_accept": a, "decode_tok_s": t["decode_per_second"],
                       "wall_s": time.perf_counter() - t0, "draft_n": drafted, "draft_n_accepted": accepted,
                       "accept_rate": accepted / drafted if drafted else None,
                       "same_tokens": g.token_ids == ref[: len(g.token_ids)]}
                log.info("speculation, %d tokens per pass, forced acceptance %g: %.1f tok/s (accepted %d of %d)",
                         k, a, row["decode_tok_s"], accepted, drafted)
                rows.append(row)
    finally:
        model.use_drafter(None)
    return rows
