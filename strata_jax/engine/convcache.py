"""Conversation cache, host RAM tier: a row's conversation, spilled to host memory when its row is about
to be overwritten, comes back into a row when a later prompt continues it.

Chat clients resend the whole conversation each turn. A Session reuses the prefix a free row still
holds (in VRAM); with more conversations than rows, the row has been taken by then. Before a row's
content is overwritten, `spill` copies it (its KV positions 0..n-1, and for the hybrid family its
recurrent state) into this cache; `admit` asks `best` for the longest cached prefix of the new prompt and,
when that beats what the chosen row holds, `restore`s it into the row, so only the new tokens prefill.

A KV cache can be cut at any position, so an attention-only entry serves any prefix of its tokens. A
recurrent state (DeltaNet, QSA, PLE) holds exactly the position it reached: such an entry serves only a
prompt that extends all of its tokens (the next turn of that conversation).

Entries are found by a linear scan of token prefixes: the tier holds tens of conversations, and a scan
of their first differing token costs microseconds next to a prefill. Eviction is least recently used,
under `capacity` bytes. Entries hold the row's arrays as stored (a q8_0 cache stays q8_0).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

SEQ_AXIS = 2  # the position axis of a KV leaf [L, B, S, ...] (model/forward.py KVCache)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclasses.dataclass
class Entry:
    tokens: tuple[int, ...]
    kv: Any  # a one-row KVCache with numpy leaves, its K/V cut to len(tokens) positions
    nbytes: int
    whole_only: bool  # recurrent state: serves only prompts that extend all of `tokens`


@dataclasses.dataclass
class TierStats:
    spills: int = 0
    hits: int = 0  # restores
    tokens_restored: int = 0
    evictions: int = 0
    refused: int = 0  # spills larger than the whole tier


class HostTier:
    """Least-recently-used conversations in host RAM, at most `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, ids: Sequence[int], limit: int) -> tuple[Entry | None, int]:
        """The entry that serves the longest prefix of ids, at most `limit` tokens, and that length."""
        found, n_best = None, 0
        for key, e in self._entries.items():
            n = min(common_prefix(ids, e.tokens), limit)
            if e.whole_only and n < len(e.tokens):
                continue
            if n > n_best:
                found, n_best = key, n
        if found is None:
            return None, 0
        self._entries.move_to_end(found)
        return self._entries[found], n_best

    def spill(self, tokens: Sequence[int], take: Callable[[], Any], whole_only: bool) -> bool:
        """Keep a row's conversation: take() gives its one-row cache (device arrays, the full context; only
        called when the tier does not hold these tokens yet), of which positions below len(tokens) are
        kept. Returns whether the tier holds them."""
        tokens = tuple(tokens)
        for key, e in list(self._entries.items()):
            n = common_prefix(tokens, e.tokens)
            if n == len(tokens) and (not whole_only or n == len(e.tokens)):
                self._entries.move_to_end(key)  # already held (a longer one serves this prefix too)
                return True
            if n == len(e.tokens) and not e.whole_only:  # the new one serves all that this one did
                self._drop(key)
        cut = _cut(take(), len(tokens))
        nbytes = sum(a.nbytes for a in jax.tree.leaves(cut))
        if nbytes > self.capacity:
            self.stats.refused += 1
            return False
        while self.nbytes + nbytes > self.capacity:
            self._drop(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[self._next] = Entry(tokens, cut, nbytes, whole_only)
        self._next += 1
        self.nbytes += nbytes
        self.stats.spills += 1
        return True

    def summary(self) -> dict[str, int]:
        """The tier's counters and occupancy (the server's /metrics)."""
        return {**dataclasses.asdict(self.stats), "entries": len(self), "bytes": self.nbytes,
                "capacity": self.capacity}

    def restored(self, n: int) -> None:
        self.stats.hits += 1
        self.stats.tokens_restored += n

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _cut(kv_row, n: int):
    """The row's cache on the host: K/V leaves cut to their first n positions, recurrent state whole."""
    keep = jax.tree.map(lambda a: np.asarray(a)[(slice(None),) * SEQ_AXIS + (slice(0, n),)],
                        (kv_row.k_LBSKDh, kv_row.v_LBSKDh))
    return dataclasses.replace(kv_row, k_LBSKDh=keep[0], v_LBSKDh=keep[1],
                               rec=jax.tree.map(np.asarray, kv_row.rec))


def padded(entry: Entry, length: int):
    """The entry's one-row cache at the full context `length` (zeros past its tokens), host arrays."""
    def pad(a):
        width = [(0, 0)] * a.ndim
        width[SEQ_AXIS] = (0, length - a.shape[SEQ_AXIS])
        return np.pad(a, width)
    kv = entry.kv
    return dataclasses.replace(kv, k_LBSKDh=jax.tree.map(pad, kv.k_LBSKDh), v_LBSKDh=jax.tree.map(pad, kv.v_LBSKDh))
