"""One configuration of the engine (resident, a cache fraction, or the cache a VRAM budget holds), loaded
once and measured under each routing mode: steady-state decode, warm prefill of long prompts, cache
and transfer telemetry, the limit ratio, and token equality with the resident run of the same mode."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import numpy as np

from strata_jax.bench.limits import ModelBytes, limit_figures
from strata_jax.bench.machine import device_peak_bytes
from strata_jax.bench.spec import forced_speculation
from strata_jax.core.units import fmt_bytes
from strata_jax.engine.config import EngineConfig

log = logging.getLogger("strata_jax")

ROUTING_SEED = 0  # the realistic trace every configuration of every run replays


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    kind: str  # resident | fraction | budget
    load_kw: dict
    cache_fraction: float | None = None


def build_configs(args, total_experts: int, budget: int | None, resident: bool) -> list[Config]:
    configs = [Config("resident", "resident", {})] if resident else []
    if not args.resident_only:
        configs += _cache_configs(args, total_experts, budget)
    shared = {"layer_scan": args.layer_scan}
    if getattr(args, "expert_fetch", "auto") != "auto":
        shared["expert_fetch"] = args.expert_fetch
    if args.decode_chunk is not None:  # else the engine's default for the device; each row records what ran
        shared["decode_chunk"] = args.decode_chunk
    if getattr(args, "prefill_chunk", None) is not None:
        shared["prefill_chunk"] = EngineConfig.create(flags=True, prefill_chunk=args.prefill_chunk).prefill_chunk
    if getattr(args, "spec", None) is not None:  # a real drafter: the decode rows carry its counts
        shared.update(spec=args.spec, spec_max=args.spec_max)
    configs = [dataclasses.replace(c, load_kw=dict(c.load_kw, **shared)) for c in configs]
    if getattr(args, "cold_experts", None) is not None:  # mixed precision: the offloaded rows only
        configs = [c if c.kind == "resident" else dataclasses.replace(
            c, name=f"{c.name}, cold after {args.promote_after}",
            load_kw=dict(c.load_kw, cold_experts=args.cold_experts, promote_after=args.promote_after)) for c in configs]
    return configs


def _cache_configs(args, total_experts: int, budget: int | None) -> list[Config]:
    configs = []
    depths = [0] if args.no_prefetch else args.prefetch_depth
    for depth in depths:
        pf = f" + prefetch {depth}" if depth else ""
        for frac in args.cache_fraction:
            configs.append(Config(f"{args.policy.upper()} {frac:.0%}{pf}", "fraction",
                                  {"expert_slots": max(1, int(total_experts * frac)), "policy": args.policy,
                                   "prefetch": depth}, frac))
        if budget is not None:
            size = fmt_bytes(budget).replace(".00 ", " ")
            configs.append(Config(f"{args.policy.upper()}, {size} budget{pf}", "budget",
                                  {"vram_budget": budget, "policy": args.policy, "prefetch": depth}))
    return configs


def routing_trace(cfg, n_tokens: int, seed: int = ROUTING_SEED) -> np.ndarray:
    """The realistic-routing trace every configuration replays: Qwen3-30B-A3B's fitted parameters at this
    model's shape (docs/routing.md), one row per cache position."""
    from strata_jax.offload.routing import QWEN3_30B_A3B, realistic_trace

    t0 = time.perf_counter()
    trace = realistic_trace(n_tokens, len(cfg.moe_layers), cfg.n_experts, cfg.n_experts_used, QWEN3_30B_A3B, seed)
    log.info("realistic routing: %d tokens x %d layers x top-%d of %d experts in %.1f s (QWEN3_30B_A3B, seed %d)",
             n_tokens, len(cfg.moe_layers), cfg.n_experts_used, cfg.n_experts, time.perf_counter() - t0, seed)
    return trace


def prompts(vocab: int, prompt_len: int, prefill_lens: list[int]) -> tuple[list[int], dict[int, list[int]]]:
    """The same random prompt ids for every configuration (random weights: no text is more typical)."""
    hi = min(vocab, 30000)
    prompt = np.random.default_rng(0).integers(0, hi, prompt_len).tolist()
    rng = np.random.default_rng(1)
    return prompt, {n: rng.integers(0, hi, n).tolist() for n in prefill_lens}


def _decode(model, mb: ModelBytes, prompt, n_tokens, probes) -> dict:
    # compile prefill + decode first (timed: the first request's compilation); cache_prompt off so the
    # timed run prefills the whole prompt again
    t0 = time.perf_counter()
    model.generate(prompt, max_tokens=4, temperature=0, cache_prompt=False)
    first_s = time.perf_counter() - t0
    model.reset_stats()
    t0 = time.perf_counter()
    gen = model.generate(prompt, max_tokens=n_tokens, temperature=0, cache_prompt=False)
    wall = time.perf_counter() - t0
    st = model.stats()
    host = model.host_timing()
    counters = model.experts.counters() if model.experts is not None and not st.get("resident") else None
    tps = gen.timings["decode_per_second"]
    n = len(gen.token_ids)
    steps = max(n - 1, 1)  # the first token comes out of prefill
    # misses served low-bit (counters[:, 6], --cold-experts) moved their cold rows' bytes
    moved = int((counters[:, 1] - counters[:, 6] + counters[:, 3]) @ np.asarray(mb.expert_M, np.int64)
                + model.experts.cold_bytes(counters)) if counters is not None else 0
    row = {
        "decode_tok_s": tps, "n_tokens": n, "wall_s": wall, "prompt_len": len(prompt), "first_request_s": first_s,
        "prompt_prefill_tok_s": gen.timings["prompt_per_second"],
        "hit_rate": st.get("hit_rate", 1.0), "misses": st.get("misses", 0), "prefetched": st.get("prefetched", 0),
        "decode_MB_per_token": moved / steps / 1e6, "decode_h2d_GB_s": moved / steps * tps / 1e9,
        "transfer_stall_fraction": st.get("transfer_stall_fraction"),
        "transfer_stall_seconds": st.get("transfer_stall_seconds"), "step_seconds": st.get("step_seconds"),
        "fetch_us_per_expert": st.get("fetch_us_per_expert"), "link_GB_s": st.get("link_GB_per_s"),
        "prefetch_precision": st.get("prefetch_precision"), "prefetch_recall": st.get("prefetch_recall"),
        "expert_slots": st.get("expert_slots"), "total_experts": st.get("total_experts"),
        "resident": st.get("resident", True), "store_memory": st.get("store_memory"),
        "expert_fetch": st.get("expert_fetch"), "cold_share": st.get("cold_share"),
        "host_dispatch_ms_per_step": host["dispatch_ms_per_step"], "host_wait_ms_per_step": host["wait_ms_per_step"],
        "decode_chunk": model.decode_chunk, "decode_calls": host.get("decode_calls"), "prefill_chunk": model.prefill_chunk,
        "token_ids": gen.token_ids,
    }
    row.update({k: gen.timings[k] for k in ("draft_n", "draft_n_accepted", "draft_passes") if k in gen.timings})
    row.update(limit_figures(mb, counters, steps, tps, len(prompt) + n / 2, np.dtype(model.dtype).itemsize, probes,
                              moved=moved if counters is not None else None))
    return row


def _prefill(model, ids) -> dict[str, float]:
    """Warm prefill tok/s of one prompt, the host->device GB/s its streamed experts took, and the wall
    seconds of the first (compiling: the chunk buckets and spans past the decode run's) and the second
    request of it."""
    t0 = time.perf_counter()
    model.generate(ids, max_tokens=1, temperature=0, cache_prompt=False)
    first = time.perf_counter() - t0
    model.reset_stats()
    t0 = time.perf_counter()
    g = model.generate(ids, max_tokens=1, temperature=0, cache_prompt=False)
    return {"prefill_tok_s": g.timings["prompt_per_second"],
            "prefill_h2d_GB_s": model.stats().get("bytes_h2d", 0) / max(g.timings["prompt_ms"], 1e-6) / 1e6,
            "prefill_first_s": first, "prefill_s": time.perf_counter() - t0}


def _error(stage: str, e: Exception) -> str:
    return f"{stage}: {type(e).__name__}: {str(e)[:500]}"


def run_config(path, conf: Config, *, ctx: int, dtype, routings, traces, prompt, long_prompts, n_tokens, mb,
               probes, skip_if_resident: bool = False, kv: str = "f16", spec=((), ()),
               kv_resident: int | None = None, devices: str | None = None) -> list[dict]:
    """Rows for one configuration, one per routing mode. A failure is recorded in its row ('error', or
    'prefill_errors' per prompt length beside the decode figures) and the model is loaded afresh for the
    next mode (a failed step loses its donated state): a one-shot GPU sitting must not lose the rest.
    spec: (verify-pass sizes, forced acceptances) of bench/spec.py's speculative decodes after the plain one."""
    import jax

    import strata_jax

    base = {"engine": "strata-jax", "config": conf.name, "config_kind": conf.kind,
            "cache_fraction": conf.cache_fraction, "policy": conf.load_kw.get("policy"),
            "prefetch_depth": conf.load_kw.get("prefetch", 0),
            "layer_scan": conf.load_kw.get("layer_scan", "on"), "vram_budget_bytes": conf.load_kw.get("vram_budget"),
            "kv": kv, "kv_resident": kv_resident, "devices": devices}
    rows, model, first = [], None, True
    for routing in routings:
        row = dict(base, routing=routing)
        rows.append(row)
        if model is None:
            gc.collect()  # the previous model's device memory, before the next takes its share
            t0 = time.perf_counter()
            try:
                model = strata_jax.load(path, ctx=ctx, dtype=dtype, kv=kv, kv_resident=kv_resident,
                                        devices=devices, **conf.load_kw).wait_loaded()
            except Exception as e:  # noqa: BLE001 - out-of-memory is an XlaRuntimeError, sizing a StrataError
                log.exception("%s: load failed", conf.name)
                row["error"] = _error("load", e)
                continue
            row["load_s"] = time.perf_counter() - t0
            if first and skip_if_resident and model.cache_plan is not None and model.cache_plan.resident:
                log.info("%s: every expert fits, the same as the resident configuration; not measured twice", conf.name)
                del model
                gc.collect()
                return []
            first = False
            # like llama-bench, decode a fixed number of tokens: random weights may well pick an end-of-text id
            model.tokenizer.stop_ids = frozenset()
        # the engine sets the on-disk compilation cache at load: with it, first_request_s can read warm
        row["compilation_cache"] = jax.config.jax_compilation_cache_dir or None
        try:
            model.force_routing(traces.get(routing))
            row.update(_decode(model, mb, prompt, n_tokens, probes))
            if spec[0]:
                row["speculation"] = forced_speculation(model, prompt, row["token_ids"], n_tokens, *spec)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.exception("%s, %s routing: decode failed", conf.name, routing)
            row["error"] = _error("decode", e)
            model = None
            continue
        figures = ("prefill_tok_s", "prefill_h2d_GB_s", "prefill_first_s", "prefill_s")
        row.update({k: {} for k in figures})
        for n_prompt, ids in long_prompts.items():
            try:
                for k, v in _prefill(model, ids).items():
                    row[k][str(n_prompt)] = v
            except Exception as e:  # noqa: BLE001 - see the docstring
                log.exception("%s, %s routing: prefill of %d tokens failed", conf.name, routing, n_prompt)
                row.setdefault("prefill_errors", {})[str(n_prompt)] = _error("prefill", e)
                model = None
                break
        # the allocator's high-water mark so far (expert cache and KV included): what of the budget the
        # prefill's activations really took, against the planner's bound (model/memory.py)
        row["device_peak_bytes"] = device_peak_bytes()
        if model is not None and model.kv_stats():  # --kv-resident: the KV cells read from VRAM, decode and prefill
            row["kv_vram_hit"] = model.kv_stats()["kv_vram_hit"]
        if model is not None and model.stats().get("cards"):  # several devices: each card's slots and misses
            row["cards"] = model.stats()["cards"]
    del model
    gc.collect()
    return rows


def mark_same_tokens(rows: list[dict]) -> None:
    """same_tokens: greedy tokens equal to the resident run of the same routing mode (None without one)."""
    ref = {r["routing"]: r.get("token_ids") for r in rows if r.get("config_kind") == "resident" and "error" not in r}
    for r in rows:
        if r.get("engine") != "strata-jax" or "error" in r:
            continue
        want = ref.get(r["routing"])
        r["same_tokens"] = None if want is None else r.get("token_ids") == want
