"""Prometheus metrics for one app, in a private CollectorRegistry (several apps in one process, as in
the tests, must not share counters). The same registry renders as text or as JSON."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# paths outside this map count as "other", so random URLs cannot grow the label set
ENDPOINTS = {"/health": "health", "/v1/models": "models", "/models": "models",
             "/v1/chat/completions": "chat_completions", "/chat/completions": "chat_completions",
             "/v1/completions": "completions", "/completions": "completions",
             "/v1/responses": "responses", "/responses": "responses",
             "/v1/messages": "messages", "/messages": "messages",
             "/v1/messages/count_tokens": "count_tokens", "/messages/count_tokens": "count_tokens",
             "/v1/responses/input_tokens": "input_tokens", "/responses/input_tokens": "input_tokens",
             "/v1/chat/completions/input_tokens": "input_tokens", "/chat/completions/input_tokens": "input_tokens",
             "/props": "props", "/tokenize": "tokenize", "/detokenize": "detokenize",
             "/apply-template": "apply_template", "/completion": "llamacpp", "/infill": "llamacpp",
             "/metrics": "metrics", "/metrics.json": "metrics", "/v1/monitor/events": "monitor", "/": "ui"}
CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def endpoint_label(path: str) -> str:
    return ENDPOINTS.get(path, "other")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "strata_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram(p + "request_duration_seconds", "Time from request to last byte", ["endpoint"],
                                 buckets=_LATENCY, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request to the first generated token "
                              "(queue wait and prefill included)", ["endpoint"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_cached_tokens", "Prompt tokens reused from the KV cache",
                                     registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "Generated tokens", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for the engine", registry=r)
        self.processing = Gauge(p + "requests_processing", "Requests the engine is running (up to --parallel)",
                                registry=r)
        self.kv_slots = Gauge(p + "kv_slots", "KV-cache slots: requests decoded at once (--parallel)", registry=r)
        self.kv_slots_in_use = Gauge(p + "kv_slots_in_use", "KV-cache slots holding a running request", registry=r)
        self.decode_tps = Gauge(p + "decode_tokens_per_second", "Decode speed of the last request", registry=r)
        self.drafted = Counter(p + "draft_tokens", "Speculative decoding: drafted tokens of finished requests",
                               registry=r)
        self.draft_accepted = Counter(p + "draft_accepted_tokens", "Speculative decoding: drafted tokens the "
                                      "verify passes accepted", registry=r)
        self.draft_rate = Gauge(p + "draft_acceptance_ratio", "draft_accepted_tokens / draft_tokens since load",
                                registry=r)
        self.verify_passes = Counter(p + "verify_passes", "Speculative decoding: verify passes run", registry=r)
        self.tokens_per_pass = Gauge(p + "tokens_per_verify_pass", "Tokens a verify pass emitted on average "
                                     "(accepted drafts + 1) since load", registry=r)
        self._drafts = (0, 0, 0)  # drafted, accepted, passes: the ratios' terms
        self.kv_tokens = Gauge(p + "kv_cache_tokens", "Tokens held in the KV cache (all slots; kept for prefix "
                               "reuse), as of the last request event", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "kv_cache_tokens / (context length x slots)", registry=r)
        self.expert_hit_rate = Gauge(p + "expert_cache_hit_rate", "Expert-cache hit rate since load (MoE)",
                                     registry=r)
        self.expert_lookups = Gauge(p + "expert_cache_lookups", "Expert lookups in decode since load (MoE)",
                                    registry=r)
        self.expert_misses = Gauge(p + "expert_cache_misses", "Expert-cache misses since load (MoE)", registry=r)
        self.expert_bytes = Gauge(p + "expert_cache_bytes_h2d", "Expert bytes copied host->device since load (MoE)",
                                  registry=r)
        self.expert_cold = Gauge(p + "expert_cache_cold_served", "Misses served from the low-bit copy "
                                 "(--cold-experts) since load (MoE)", registry=r)
        self.kv_vram_hit = Gauge(p + "kv_vram_hit_ratio", "KV streaming (--kv-resident): share of the KV-cache cells "
                                 "finished requests attended to that were read from VRAM (the rest crossed PCIe)",
                                 registry=r)
        self.card_misses = Gauge(p + "expert_cache_card_misses", "Several devices (--devices): misses each card "
                                 "fetched into its share of the expert cache since load (they add up to the misses "
                                 "fetched into the cache)", ["card", "device"], registry=r)
        self.card_slots = Gauge(p + "expert_cache_card_slots", "Several devices (--devices): expert slots each "
                                "card holds", ["card", "device"], registry=r)
        self.conversation = Gauge(p + "conversation_cache", "Conversation cache "
                                  "per tier (ram_, disk_): spills, hits (restores), tokens_restored, evictions, refused, "
                                  "entries, bytes, capacity, since load", ["what"], registry=r)
        self.device_memory = Gauge(p + "device_memory_bytes", "Device memory by use: dense weights, expert slots, "
                                   "KV cache", ["use"], registry=r)

    def observe_generation(self, endpoint: str, prompt_n: int, completion_n: int, cached_n: int,
                           ttft: float | None, timings: dict[str, Any]) -> None:
        self.prompt_tokens.inc(prompt_n)
        self.completion_tokens.inc(completion_n)
        self.cached_tokens.inc(cached_n)
        if ttft is not None:
            self.ttft.labels(endpoint).observe(ttft)
        if timings.get("predicted_per_second"):
            self.decode_tps.set(timings["predicted_per_second"])
        if timings.get("draft_n"):
            self.drafted.inc(timings["draft_n"])
            self.draft_accepted.inc(timings.get("draft_n_accepted", 0))
            passes = timings.get("draft_passes", 0)
            self.verify_passes.inc(passes)
            d, a, n = (x + y for x, y in zip(self._drafts, (timings["draft_n"], timings.get("draft_n_accepted", 0), passes)))
            self._drafts = (d, a, n)
            self.draft_rate.set(a / d)
            if n:
                self.tokens_per_pass.set((a + n) / n)

    def refresh(self, engine: Any) -> None:
        """Copy the engine's state into the gauges (at scrape time; the snapshot is taken on the engine thread)."""
        self.queue_depth.set(engine.queue_depth)
        self.processing.set(engine.processing)
        self.kv_slots.set(engine.parallel)
        self.kv_slots_in_use.set(engine.processing)
        # KV-read counters are host ints the engine bumps before a request's last chunk goes out: read them live,
        # so a scrape right after a response counts it (the snapshot may still be the one taken before).
        kv = engine.model.kv_stats() if hasattr(engine.model, "kv_stats") else {}
        if kv.get("kv_vram_hit") is not None:
            self.kv_vram_hit.set(kv["kv_vram_hit"])
        snap = engine.snapshot
        if snap:
            self.kv_tokens.set(snap["kv_tokens"])
            self.kv_usage.set(snap["kv_tokens"] / snap["ctx"] if snap["ctx"] else 0)
            for use, n in (snap.get("memory") or {}).items():
                if use != "total":
                    self.device_memory.labels(use).set(n)
            for what, n in (snap.get("conversation") or {}).items():
                self.conversation.labels(what).set(n)
            ex = snap.get("expert") or {}
            if ex:
                self.expert_hit_rate.set(ex.get("hit_rate") or 0)
                self.expert_lookups.set(ex.get("lookups") or 0)
                self.expert_misses.set(ex.get("misses") or 0)
                self.expert_bytes.set(ex.get("bytes_h2d") or 0)
                self.expert_cold.set(ex.get("cold_experts") or 0)
                for c in ex.get("cards") or ():
                    self.card_misses.labels(str(c["card"]), c["device"]).set(c["misses"])
                    self.card_slots.labels(str(c["card"]), c["device"]).set(c["slots"])

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def as_json(self) -> dict[str, Any]:
        """{family: {"type", "help", "samples": [{"name", "labels", "value"}]}}: the text format's content."""
        out: dict[str, Any] = {}
        for fam in self.registry.collect():
            out[fam.name] = {"type": fam.type, "help": fam.documentation,
                             "samples": [{"name": s.name, "labels": dict(s.labels), "value": s.value}
                                         for s in fam.samples]}
        return out
