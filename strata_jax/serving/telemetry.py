"""The engine's telemetry snapshot: one dict, built on the engine thread (it reads device counters),
that /metrics, /v1/monitor/events and the web UI read.

Rates (decode tokens/s, host->device MB/s, the recent expert hit rate) are differences of running
totals over the last RATE_WINDOW_S seconds of snapshots, so they fall to 0 when the engine is idle.
"""

from __future__ import annotations

import collections
import time
from typing import Any

RATE_WINDOW_S = 2.0
EXPERT_KEYS = ("lookups", "hits", "misses", "hit_rate", "bytes_h2d", "expert_slots", "total_experts", "resident",
               "policy", "per_layer_hit_rate", "per_layer_lookups", "cold_experts", "cold_share", "cards")


class Telemetry:
    """Running totals fed by the engine thread (tokens delivered, requests finished) and the window of
    (time, totals) samples the rates come from."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self.tokens = 0  # generated tokens delivered to requests
        self.requests = 0  # requests (choices) finished
        self.last: dict[str, float | None] = {"prompt_per_second": None, "predicted_per_second": None}
        self._samples: collections.deque[tuple[float, int, int, int, int]] = collections.deque()

    def delivered(self, n_tokens: int) -> None:
        self.tokens += n_tokens

    def finished(self, timings: dict[str, Any] | None) -> None:
        self.requests += 1
        t = timings or {}
        self.last = {k: t.get(k) for k in self.last}

    def _rates(self, now: float, bytes_h2d: int, lookups: int, hits: int) -> dict[str, float | None]:
        """Per-second rates over the window ending now; the oldest sample kept is the last one at or
        before the window's start, so a window always spans at least RATE_WINDOW_S once it can."""
        s = self._samples
        s.append((now, self.tokens, bytes_h2d, lookups, hits))
        while len(s) > 2 and s[1][0] <= now - self.window_s:
            s.popleft()
        t0, tok0, b0, l0, h0 = s[0]
        dt = now - t0
        if dt <= 0:
            return {"decode": None, "h2d": None, "hit_rate": None}
        d_lookups = lookups - l0
        return {"decode": (self.tokens - tok0) / dt, "h2d": (bytes_h2d - b0) / dt,
                "hit_rate": (hits - h0) / d_lookups if d_lookups > 0 else None}

    def snapshot(self, *, stats: dict[str, Any], memory: dict[str, int], kv_tokens: int, ctx: int,
                 queue_depth: int, processing: int, parallel: int) -> dict[str, Any]:
        """The monitor's dict: stats is Model.stats() ({} for a dense model: "expert" is None), memory
        Model.device_memory(session), ctx the KV positions of all rows."""
        rates = self._rates(time.perf_counter(), int(stats.get("bytes_h2d") or 0), int(stats.get("lookups") or 0),
                            int(stats.get("hits") or 0))
        expert = None
        if stats:
            expert = {k: stats.get(k) for k in EXPERT_KEYS}
            expert["hit_rate_recent"] = rates["hit_rate"]
            expert["h2d_MB_per_s"] = rates["h2d"] / 1e6 if rates["h2d"] is not None else None
        return {
            "time": time.time(),
            "decode_tokens_per_second": rates["decode"],
            "last_request": dict(self.last),
            "tokens_generated": self.tokens,
            "requests_finished": self.requests,
            "queue_depth": queue_depth,
            "processing": processing,
            "parallel": parallel,
            "kv_tokens": kv_tokens,
            "ctx": ctx,
            "kv_usage": kv_tokens / ctx if ctx else 0.0,
            "memory": dict(memory, total=sum(memory.values())),
            "expert": expert,
        }
