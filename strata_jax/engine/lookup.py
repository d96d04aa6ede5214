"""Prompt-lookup drafts for speculative decoding: no extra weights, only the sequence so far.

The longest suffix of the sequence (prompt + output, NGRAM_MAX tokens down to NGRAM_MIN) that also
occurs earlier proposes the tokens that followed its latest earlier occurrence. Text that repeats its
context (code being edited, quoted passages) is drafted well; elsewhere there is often no match, and
the session takes a plain decode step.

`Acceptance` is the adaptive part (every drafter's): a row drafts about as many tokens as its recent passes
accepted in a run, plus one, and after a few passes that accepted little it drafts nothing for a while, so
a prompt that does not repeat itself pays (almost) nothing for speculation. It also weighs what a pass costs
against a plain step, as timed in this session: where misses cross PCIe a pass costs several steps
(docs/benchmarks.md, "Speculative decoding"), and an acceptance that pays on a resident model loses there.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence

import numpy as np

NGRAM_MAX = 4  # longest suffix matched
NGRAM_MIN = 1  # shortest suffix matched
WINDOW = 4  # verify passes the acceptance rate is taken over
MIN_RATE = 0.3  # below this acceptance rate over the window, the row stops drafting ...
COOLDOWN = 8  # ... for this many steps, then tries again
TIMED = 5  # the latest timings of passes and of plain tokens kept (their medians are compared)


def lookup_draft(seq: Sequence[int], n_max: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to n_max tokens that followed the latest earlier occurrence of the longest matching suffix of
    seq (ngram_max tokens down to ngram_min); [] when no suffix occurred before."""
    a = np.asarray(seq, np.int64)
    L = len(a)
    if n_max < 1:
        return []
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        # starts i < L - n whose n tokens equal the suffix (the suffix itself, at L - n, is excluded)
        hit = np.ones(L - n, bool)
        for j in range(n):
            hit &= a[j: L - n + j] == a[L - n + j]
        starts = np.flatnonzero(hit)
        if len(starts):
            i = int(starts[-1]) + n  # what followed the latest occurrence
            return a[i: i + n_max].tolist()
    return []


class Acceptance:
    """A row's recent verify passes (drafted, accepted): whether its next step should draft, and how many.
    adaptive False: always the most (a benchmark's forced acceptance: bench/spec.py)."""

    def __init__(self, adaptive: bool = True):
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=WINDOW)
        self.cooldown = 0
        self.adaptive = adaptive
        self.pass_s: collections.deque[float] = collections.deque(maxlen=TIMED)  # seconds per verify pass
        self.token_s: collections.deque[float] = collections.deque(maxlen=TIMED)  # per token of a plain call
        self._untimed = {"pass", "plain"}  # each kind's first timing includes its program's compile: dropped

    def draft_count(self, n_max: int) -> int:
        """Tokens to draft, at most n_max: with a per-token acceptance r over the window, a pass accepts
        r / (1 - r) drafts in a run on average; drafting one more than that wastes little of the pass."""
        d = sum(x for x, _ in self.recent)
        if not self.adaptive or not d:
            return n_max
        r = sum(y for _, y in self.recent) / d
        return n_max if r >= 1 else max(1, min(n_max, math.ceil(r / (1 - r)) + 1))

    def should_draft(self) -> bool:
        if self.cooldown:
            self.cooldown -= 1
            return False
        return True

    def timed(self, kind: str, seconds: float, tokens: int = 1) -> None:
        """A verify pass ("pass") or a plain decode call of `tokens` tokens ("plain") took `seconds`."""
        if kind in self._untimed:
            self._untimed.discard(kind)
        elif tokens > 0:
            (self.pass_s if kind == "pass" else self.token_s).append(seconds / tokens)

    def worth(self, n: int) -> bool:
        """Whether a pass of n drafts is expected to emit tokens faster than plain steps: 1 + p + ... + p^n
        tokens (p: the chance a draft is accepted, given the one before was, over the window) against the
        pass's cost in plain tokens. True until both costs and a window of passes are known."""
        if not self.adaptive or len(self.recent) < WINDOW or not self.pass_s or not self.token_s:
            return True
        accepted = sum(y for _, y in self.recent)
        stopped = sum(y < x for x, y in self.recent)  # passes that met a rejected draft
        p = accepted / (accepted + stopped) if accepted + stopped else 0.0
        expected = sum(p ** i for i in range(n + 1))
        return expected * statistics.median(self.token_s) >= statistics.median(self.pass_s)

    def pause(self) -> None:
        """Draft nothing for COOLDOWN steps (a pass would not pay now), then try again with a fresh window."""
        self.cooldown = COOLDOWN
        self.recent.clear()

    def record(self, drafted: int, accepted: int) -> None:
        self.recent.append((drafted, accepted))
        if self.adaptive and len(self.recent) == WINDOW:
            d = sum(x for x, _ in self.recent)
            if d and sum(y for _, y in self.recent) / d < MIN_RATE:
                self.cooldown = COOLDOWN
                self.recent.clear()
