"""Conversation cache: a row's conversation, kept in host RAM and on disk when its row is about to be
overwritten, comes back into a row when a later prompt continues it, in this process or after a restart.

Chat clients resend the whole conversation each turn. A Session reuses the prefix a free row still
holds (in VRAM); with more conversations than rows, the row has been taken by then. Before a row's
content is overwritten, `spill` copies it (its KV positions 0..n-1, and for the hybrid family its
recurrent state) into the tiers; `admit` asks `best` for the longest cached prefix of the new prompt and,
when that beats what the chosen row holds, restores it into the row, so only the new tokens prefill.

A KV cache can be cut at any position, so an attention-only entry serves any prefix of its tokens. A
recurrent state (DeltaNet, QSA, PLE) holds exactly the position it reached: such an entry serves only a
prompt that extends all of its tokens (the next turn of that conversation); the session spills each state
it kept for a row (a turn's start, a prompt's end) as an entry of its own.

Tiers: host RAM (`--conversation-cache-mib`) and a folder (`--conversation-cache-dir`, capped by
`--conversation-cache-disk-mib`), written in the background, one file per conversation under a subfolder
named by the model's identity (file fingerprint, KV type, dtype, RoPE settings), each checked on reading
(identity, shapes against the model's row, a sha256 of the arrays): a foreign, truncated or corrupt file
is a miss with a logged reason and is deleted, never an error. Entries hold the row's arrays as stored
(a q8_0 cache stays q8_0). Each tier evicts its least recently used entries past its cap.

Entries are found by a linear scan of token prefixes: a tier holds tens to hundreds of conversations,
and finding the first differing token of each costs little next to a prefill.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import struct as bstruct
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SEQ_AXIS = 2  # the position axis of a KV leaf [L, B, S, ...] (model/forward.py KVCache)
MAGIC = b"STRATA-JAX CONV 1\n"
SUFFIX = ".conv"


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


def make_entry(tokens: Sequence[int], kv_row, whole_only: bool) -> Entry:
    """A row's conversation on the host: K/V leaves cut to their first len(tokens) positions, recurrent
    state whole. kv_row: the row's one-row cache (device arrays, the full context)."""
    n = len(tokens)
    kv = _by_position(kv_row, lambda a: np.asarray(a)[(slice(None),) * SEQ_AXIS + (slice(0, n),)])
    return Entry(tuple(tokens), kv, sum(a.nbytes for a in jax.tree.leaves(kv)), whole_only)


def _by_position(kv, f):
    """kv with f applied to its K/V leaves (the MTP block's too: model/mtp.py) and the rest as host arrays."""
    def one(c):
        return dataclasses.replace(c, k_LBSKDh=jax.tree.map(f, c.k_LBSKDh), v_LBSKDh=jax.tree.map(f, c.v_LBSKDh),
                                   rec=jax.tree.map(np.asarray, c.rec))
    out = one(kv)
    if kv.mtp is not None:
        out = dataclasses.replace(out, mtp=kv.mtp.replace(kv=one(kv.mtp.kv), h_1BD=np.asarray(kv.mtp.h_1BD)))
    return out


def padded(entry: Entry, length: int):
    """The entry's one-row cache at the full context `length` (zeros past its tokens), host arrays."""
    def pad(a):
        width = [(0, 0)] * a.ndim
        width[SEQ_AXIS] = (0, length - a.shape[SEQ_AXIS])
        return np.pad(a, width)
    return _by_position(entry.kv, pad)


@dataclasses.dataclass
class TierStats:
    spills: int = 0
    hits: int = 0  # restores from this tier
    tokens_restored: int = 0
    evictions: int = 0
    refused: int = 0  # spills larger than the whole tier, or (disk) unreadable entries and failed writes


@dataclasses.dataclass
class _Meta:
    tokens: tuple[int, ...]
    whole_only: bool
    nbytes: int


class _Tier:
    """Entries' tokens under a byte cap, least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._index: collections.OrderedDict[Any, _Meta] = collections.OrderedDict()
        self.nbytes = 0
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._index)

    def best_key(self, ids: Sequence[int], limit: int) -> tuple[Any, int]:
        """The key of the entry serving the longest prefix of ids (at most limit tokens), and that length."""
        found, n_best = None, 0
        for key, m in self._index.items():
            n = min(common_prefix(ids, m.tokens), limit)
            if m.whole_only and n < len(m.tokens):
                continue
            if n > n_best:
                found, n_best = key, n
        if found is not None:
            self._index.move_to_end(found)
        return found, n_best

    def holds(self, tokens: tuple[int, ...], whole_only: bool) -> bool:
        """Whether an entry already serves these tokens (a longer one serves a prefix too); it counts as used."""
        for key, m in self._index.items():
            n = common_prefix(tokens, m.tokens)
            if n == len(tokens) and (not whole_only or n == len(m.tokens)):
                self._index.move_to_end(key)
                return True
        return False

    def _admit(self, key, meta: _Meta) -> bool:
        """Index a new entry: the ones it makes redundant and the least recently used past the cap go."""
        if meta.nbytes > self.capacity:
            self.stats.refused += 1
            return False
        for k, m in list(self._index.items()):
            if not m.whole_only and common_prefix(meta.tokens, m.tokens) == len(m.tokens):
                self._drop(k)  # the new one serves all that this one did
        while self.nbytes + meta.nbytes > self.capacity:
            self._drop(next(iter(self._index)))
            self.stats.evictions += 1
        self._index[key] = meta
        self.nbytes += meta.nbytes
        self.stats.spills += 1
        return True

    def _drop(self, key) -> None:
        self.nbytes -= self._index.pop(key).nbytes

    def summary(self) -> dict[str, int]:
        return {**dataclasses.asdict(self.stats), "entries": len(self), "bytes": self.nbytes, "capacity": self.capacity}


class HostTier(_Tier):
    """Conversations in host RAM, at most `capacity` bytes."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._entries: dict[int, Entry] = {}
        self._next = 0

    def add(self, entry: Entry) -> bool:
        key, self._next = self._next, self._next + 1
        if not self._admit(key, _Meta(entry.tokens, entry.whole_only, entry.nbytes)):
            return False
        self._entries[key] = entry
        return True

    def get(self, key) -> Entry:
        return self._entries[key]

    def _drop(self, key) -> None:
        super()._drop(key)
        del self._entries[key]


def identity(fingerprint: str, **settings: Any) -> str:
    """What a saved conversation must match to be reused: the model file and the settings that change
    what its cache holds (KV type, dtype, RoPE scaling), as a short hex digest (the disk tier's subfolder)."""
    blob = json.dumps({"format": MAGIC.decode().strip(), "model": fingerprint, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class DiskTier(_Tier):
    """Conversations as files in `folder`/`ident`, at most `capacity` bytes, written by a background thread.
    template: the model's one-row cache (shapes and dtypes, e.g. from jax.eval_shape) that entries must fit."""

    def __init__(self, folder: str | os.PathLike, capacity: int, ident: str, template: Any):
        super().__init__(capacity)
        self.folder = Path(folder) / ident
        self.ident = ident
        self._treedef = jax.tree.structure(template)
        self._template = template
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="conv-cache-writer")
        self._pending: list[concurrent.futures.Future] = []
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                head = _read_header(path)
                self._admit(path.name, _Meta(tuple(head["tokens"]), bool(head["whole_only"]), path.stat().st_size))
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._refuse(path, f"unreadable header ({e})")
        self.stats.spills = 0  # what was already there is not this process' spilling
        log.info("conversation cache: %d conversations (%.1f MiB) on disk in %s", len(self), self.nbytes / 2**20,
                 self.folder)

    def add(self, entry: Entry) -> None:
        """Write the entry in the background; the index takes it now (a restore before the write ends waits)."""
        name = hashlib.sha256(np.asarray(entry.tokens, np.int64).tobytes()).hexdigest()[:32] + SUFFIX
        leaves = jax.tree.leaves(entry.kv)
        head = {"identity": self.ident, "tokens": list(entry.tokens), "whole_only": entry.whole_only,
                "leaves": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in leaves],
                "sha256": _digest(leaves)}
        blob = json.dumps(head).encode()
        size = len(MAGIC) + 8 + len(blob) + sum(a.nbytes for a in leaves)
        if not self._admit(name, _Meta(entry.tokens, entry.whole_only, size)):
            return
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._writer.submit(self._write, self.folder / name, blob, leaves))

    def flush(self) -> None:
        """Wait for the writes in flight."""
        for f in self._pending:
            f.result()
        self._pending = []

    def load(self, key) -> Entry | None:
        """The entry of file `key`, checked; None (and the file deleted, with the reason logged) if it is not
        this model's, is cut short, or its arrays do not match their checksum or the model's row."""
        self.flush()
        path = self.folder / key
        try:
            with open(path, "rb") as f:
                head = _read_header_from(f)
                if head.get("identity") != self.ident:
                    raise ValueError(f"saved for another model or setting ({head.get('identity')!r})")
                leaves = []
                for spec, want in zip(head["leaves"], jax.tree.leaves(self._template), strict=True):
                    dtype, shape = jnp.dtype(spec["dtype"]), tuple(spec["shape"])
                    if dtype != want.dtype or len(shape) != len(want.shape):
                        raise ValueError(f"an array of {dtype}{list(shape)} where the model has {want.dtype}"
                                         f"{list(want.shape)}")
                    data = f.read(int(np.prod(shape)) * dtype.itemsize)
                    leaves.append(np.frombuffer(data, dtype).reshape(shape))  # ValueError when cut short
                if _digest(leaves) != head["sha256"]:
                    raise ValueError("its arrays do not match their checksum")
            kv = jax.tree.unflatten(self._treedef, leaves)
            _check_fits(kv, self._template, len(head["tokens"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._refuse(path, str(e))
            return None
        os.utime(path)  # its recency survives a restart
        return Entry(tuple(head["tokens"]), kv, sum(a.nbytes for a in leaves), bool(head["whole_only"]))

    def _write(self, path: Path, blob: bytes, leaves: list[np.ndarray]) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + bstruct.pack("<Q", len(blob)) + blob)
                for a in leaves:
                    f.write(_raw(a))
            os.replace(tmp, path)
        except OSError as e:  # a full disk loses this conversation, nothing else
            # (its index entry stays: reading it later finds no file, a miss that drops it)
            log.warning("conversation cache: could not write %s (%s); the conversation stays in RAM only", path, e)
            tmp.unlink(missing_ok=True)
            self.stats.refused += 1

    def _drop(self, key) -> None:
        super()._drop(key)
        self._writer.submit((self.folder / key).unlink, missing_ok=True)  # after its write, if one is queued

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("conversation cache: %s is not used and is deleted: %s", path, why)
        self.stats.refused += 1
        if path.name in self._index:
            super()._drop(path.name)
        path.unlink(missing_ok=True)


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes; as uint8, since the buffer protocol refuses ml_dtypes' bfloat16 (a GPU's KV cache)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _digest(leaves: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in leaves:
        h.update(_raw(a))
    return h.hexdigest()


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        return _read_header_from(f)


def _read_header_from(f) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a conversation file of this format")
    (n,) = bstruct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def _check_fits(kv, template, n: int) -> None:
    """kv (an entry's cache, K/V cut to n positions) has the model row's shapes."""
    def same(a, t, cut: bool):
        want = tuple(t.shape)
        if cut:
            want = want[:SEQ_AXIS] + (n,) + want[SEQ_AXIS + 1:]
            if n > t.shape[SEQ_AXIS]:
                raise ValueError(f"{n} tokens do not fit the context of {t.shape[SEQ_AXIS]}")
        if tuple(a.shape) != want:
            raise ValueError(f"an array of shape {list(a.shape)} where the model's row has {list(want)}")
    for c, t in [(kv, template)] + ([(kv.mtp.kv, template.mtp.kv)] if template.mtp is not None else []):
        jax.tree.map(lambda a, t: same(a, t, True), (c.k_LBSKDh, c.v_LBSKDh), (t.k_LBSKDh, t.v_LBSKDh))
        jax.tree.map(lambda a, t: same(a, t, False), c.rec, t.rec)


class ConversationCache:
    """The tiers together: spills go to each (RAM, then disk); a lookup takes the longer of the two and a
    conversation read from disk is kept in RAM too."""

    def __init__(self, ram: HostTier | None, disk: DiskTier | None):
        self.ram, self.disk = ram, disk

    def spill(self, tokens: Sequence[int], take: Callable[[], Any], whole_only: bool) -> None:
        """Keep a row's conversation; take() gives its one-row cache, read only if a tier lacks it."""
        tokens = tuple(tokens)
        tiers = [t for t in (self.ram, self.disk) if t is not None and not t.holds(tokens, whole_only)]
        if tiers:
            entry = make_entry(tokens, take(), whole_only)
            for t in tiers:
                t.add(entry)

    def best(self, ids: Sequence[int], limit: int, beat: int = 0) -> tuple[Entry | None, int, str]:
        """The entry serving the longest prefix of ids (at most limit tokens), that length and its tier, if
        longer than `beat` (what the row already holds: no file is read for less)."""
        key_r, n_r = self.ram.best_key(ids, limit) if self.ram is not None else (None, 0)
        key_d, n_d = self.disk.best_key(ids, limit) if self.disk is not None else (None, 0)
        if key_d is not None and n_d > max(n_r, beat):
            entry = self.disk.load(key_d)
            if entry is not None:
                if self.ram is not None:
                    self.ram.add(entry)
                return entry, n_d, "disk"
        if key_r is not None and n_r > beat:
            return self.ram.get(key_r), n_r, "ram"
        return None, 0, ""

    def restored(self, tier: str, n: int) -> None:
        stats = (self.ram if tier == "ram" else self.disk).stats
        stats.hits += 1
        stats.tokens_restored += n

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def summary(self) -> dict[str, int]:
        """Each tier's counters and occupancy, as ram_hits, disk_bytes, ... (the server's /metrics)."""
        return {f"{name}_{k}": v for name, t in (("ram", self.ram), ("disk", self.disk)) if t is not None
                for k, v in t.summary().items()}
