"""Speculative decoding's ceiling on random weights (issue 18): random weights draft nothing real, so a
benchmark forces the acceptance. An oracle drafter proposes n_max tokens and says how many of them the
verify pass accepts (`accept_n`: each draft in turn with probability `accept`, as a drafter of that
per-token acceptance would), and the verify program takes that count instead of its own comparison
(engine/programs.py verify, accept_n). Acceptance 1 gives the cost of a verify pass of K tokens (each
pass emits K); lower acceptances the tok/s a drafter of that quality would give. The pass, its expert
fetches and the host's round trip per pass are all real; the drafter's own cost is left out, and the
output tokens are the drafts (not the model's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("strata_jax")


class OracleDrafter:
    """Drafts n_max tokens, the reference continuation `ref` of `prompt_len` prompt tokens where it has
    them; `accept_n`, set by each call, is how many the pass accepts: each in turn with probability
    `accept` (a reference-following drafter as right as that). With `force` False the count is only a
    guess and the pass compares as usual (for tests of use_drafter: a wrong draft is another id)."""

    def __init__(self, ref: Sequence[int], prompt_len: int, accept: float, vocab: int, seed: int = 0,
                 force: bool = True):
        self.ref, self.prompt_len, self.accept, self.vocab, self.force = list(ref), prompt_len, accept, vocab, force
        self.rng = np.random.default_rng(seed)
        self.accept_n: int | None = 0 if force else None  # set (forced) by each call
        self.calls = 0  # drafts made: the verify passes

    def __call__(self, seq: Sequence[int], n_max: int) -> list[int]:
        j = len(seq) - self.prompt_len  # seq ends with the reference's token j - 1
        want = (self.ref[j: j + n_max] + [0] * n_max)[:n_max] if self.force else self.ref[j: j + n_max]
        right = self.rng.random(len(want)) < self.accept
        n = int(np.argmin(right)) if not right.all() else len(want)
        if self.force:
            self.accept_n = n
        self.calls += bool(want)
        return [t if ok else (t + 1) % self.vocab for t, ok in zip(want, right)]


def forced_speculation(model, prompt: list[int], ref: list[int], n_tokens: int, pass_tokens: Sequence[int],
                       accepts: Sequence[float]) -> list[dict]:
    """For each verify-pass size K (tokens per pass: the last token and K - 1 drafts) and forced acceptance
    a: greedy decode of n_tokens with the oracle drafter, timed after a warm-up that compiles the pass
    (ms_per_call: the decode's time over its calls, passes and plain steps; with few plain steps, against
    plain decode's ms per token it is a pass's relative cost)."""
    rows = []
    try:
        for k in pass_tokens:
            for a in accepts:
                oracle = OracleDrafter(ref, len(prompt), a, model.config.vocab_size)
                model.use_drafter(oracle, spec_max=k - 1, name=f"oracle-{a:g}")
                model.generate(prompt, max_tokens=min(8, n_tokens), temperature=0, cache_prompt=False)  # compiles
                oracle.calls = 0
                t0 = time.perf_counter()
                g = model.generate(prompt, max_tokens=n_tokens, temperature=0, cache_prompt=False)
                t = g.timings
                drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
                steps = len(g.token_ids) - 1  # the first token comes out of prefill
                plain = steps - oracle.calls - accepted  # each pass emits its accepted drafts + 1
                row = {"pass_tokens": k, "forced_accept": a, "decode_tok_s": t["decode_per_second"],
                       "wall_s": time.perf_counter() - t0, "draft_n": drafted, "draft_n_accepted": accepted,
                       "accept_rate": accepted / drafted if drafted else None, "passes": oracle.calls,
                       # plain decode steps: drafting paused by the adaptive rule (lookup.MIN_RATE), or no
                       # room for a draft before max_tokens
                       "plain_steps": plain, "ms_per_call": steps / t["decode_per_second"] / (oracle.calls + plain) * 1e3}
                log.info("speculation, %d tokens per pass, forced acceptance %g: %.1f tok/s (accepted %d of %d)",
                         k, a, row["decode_tok_s"], accepted, drafted)
                rows.append(row)
    finally:
        model.use_drafter(None)
    return rows
