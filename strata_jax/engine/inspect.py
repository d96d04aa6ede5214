"""What is in a GGUF file and what of it fits on a GPU: the report behind `strata-jax inspect`.

The slot count for a VRAM budget comes from the planner `load` uses, with the same estimates.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.core.errors import ConfigError
from strata_jax.engine.config import EngineConfig
from strata_jax.model import memory
from strata_jax.model.config import ModelConfig
from strata_jax.gguf.reader import GGUFFile
from strata_jax.model.weights import WeightLoader, expert_spec
from strata_jax.model.kvquant import check_kv
from strata_jax.engine.model import (PLE_TABLE_NAME, plan_model_context, ple_placement, ple_surely_host,
                                     resolve_prefill_chunk)
from strata_jax.offload.manager import plan_model_cache
from strata_jax.offload.sizing import DEFAULT_RESERVE
from strata_jax.core.units import fmt_bytes, parse_size

_KINDS = [
    (r"^token_embd\.", "embedding"),
    (r"^output\.", "output head"),
    (r"norm\.weight$", "norms"),
    (r"\.attn_", "attention"),
    (r"\.ffn_gate_inp\.", "routers"),
    (r"_shexp\.", "shared experts"),
    (r"_exps\.bias$", "expert biases"),  # on the device beside the router (gpt-oss)
    (r"_exps\.", "routed experts"),
    (r"\.ffn_", "dense mlp"),
]


def tensor_kind(name: str) -> str:
    for pattern, kind in _KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def report(gguf: GGUFFile, vram_budget: int | str | None = None, ctx: int | None = None, *, kv: str = "f16",
           dtype: str = "auto", dequantize_dense: bool | None = None, platform: str | None = None,
           vram_reserve: int | str | None = None, parallel: int = 1, prefill_chunk: int | str = "auto",
           expert_pools: str = "per-layer", kv_resident: int | None = None, cards: int = 1) -> dict[str, Any]:
    """The file's tensors by kind and, given a VRAM budget, the context and expert slots `load` would make
    of it with the same options (offload's planners over model/memory.py's estimates). ctx None: the
    trained length, cut to fit the budget; kv: the KV cache's storage (EngineConfig.kv); dtype and
    dequantize_dense as EngineConfig's, resolved for `platform` (default: JAX's backend here) as load
    resolves them: on a CPU float32, with the dense matrices dequantized at load. kv_resident: KV streaming
    (--kv-resident), the positions of each layer's cache on the device; the rest goes to host memory. cards:
    the expert cache split over that many devices (--devices), vram_budget each, the rest on every one."""
    cfg = ModelConfig.from_gguf(gguf)
    kv = check_kv(kv)
    resolved = EngineConfig.create(dtype=dtype, dequantize_dense=dequantize_dense).resolved(
        platform or jax.default_backend())
    kv_bytes_per_elem = jnp.dtype(resolved.dtype).itemsize
    dense_itemsize = kv_bytes_per_elem if resolved.dequantize_dense else None
    by_kind: dict[str, int] = collections.Counter()
    types_by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in gguf.tensors.values():
        kind = tensor_kind(t.name)
        by_kind[kind] += t.nbytes
        types_by_kind[kind][t.type_name] += 1
    total = sum(by_kind.values())
    n_experts_all = cfg.n_experts * len(cfg.moe_layers)
    expert_total = memory.routed_expert_bytes(gguf, cfg)
    expert_bytes = expert_total / n_experts_all if n_experts_all else 0.0
    rows = max(parallel, 1)
    spec = expert_spec(WeightLoader(gguf, cfg)) if cfg.is_moe else None
    too_small = None

    def plan(chunk: int):
        return plan_model_context(gguf, cfg, spec, ctx=ctx, kv=kv, itemsize=kv_bytes_per_elem, rows=rows,
                                  prefill_chunk=chunk, expert_pools=expert_pools, vram_budget=vram_budget,
                                  vram_reserve=vram_reserve, dense_itemsize=dense_itemsize,
                                  off_device=(PLE_TABLE_NAME,) if ple_surely_host("auto", gguf, cfg) else (),
                                  kv_resident=kv_resident)

    # "auto" as load resolves it, from the budget (without one, as on a CPU: 512)
    prefill_chunk = resolve_prefill_chunk(prefill_chunk, cfg, ctx=ctx, plan=plan, budget=parse_size(
        vram_budget, "vram_budget") if vram_budget is not None else None)
    try:
        cplan = plan(prefill_chunk)
        ctx, ctx_reason = cplan.ctx, cplan.reason
    except ConfigError as e:  # what load would refuse with
        too_small, ctx_reason = str(e), "does not fit"
        ctx = ctx or cfg.context_length
    on_device = min(ctx, kv_resident) if kv_resident else ctx  # KV positions a layer keeps on the device

    def fixed(off_device: tuple[str, ...] = ()) -> int:
        return memory.fixed_device_bytes(gguf, cfg, ctx=on_device, itemsize=kv_bytes_per_elem, rows=rows,
                                         prefill_chunk=prefill_chunk, kv=kv, off_device=off_device,
                                         dense_itemsize=dense_itemsize)

    out: dict[str, Any] = {
        "path": gguf.path,
        "file_bytes": gguf.file_size,  # every shard's, for a split model
        "shards": gguf.n_shards,
        "config": cfg,
        "bytes_by_kind": dict(by_kind),
        "types_by_kind": {k: dict(v) for k, v in types_by_kind.items()},
        "total_tensor_bytes": total,
        "dense_bytes": memory.dense_weight_bytes(gguf, dense_itemsize=dense_itemsize),
        "dense_file_bytes": memory.dense_weight_bytes(gguf),
        "dtype": resolved.dtype,
        "dequantize_dense": resolved.dequantize_dense,
        "experts": n_experts_all,
        "expert_bytes": expert_bytes,
        "kv_bytes": memory.kv_cache_bytes(cfg, on_device, rows, kv_bytes_per_elem, kv),
        "kv_host_bytes": memory.kv_cache_bytes(cfg, ctx - on_device, rows, kv_bytes_per_elem, kv),
        "kv_resident": on_device if on_device < ctx else None,
        "activation_bytes": memory.activation_bytes(cfg, prefill_chunk),
        "prefill_chunk": prefill_chunk,
        "fixed_bytes": fixed(),
        "reserve_bytes": parse_size(vram_reserve, "vram_reserve") if vram_reserve is not None else DEFAULT_RESERVE,
        "ctx": ctx,
        "ctx_reason": ctx_reason,
        "rows": rows,
        "kv": kv,
        "kv_label": memory.kv_label(kv, resolved.dtype),
    }
    if vram_budget is None:
        return out
    budget = parse_size(vram_budget, "vram_budget")
    out["vram_budget"] = budget
    out["cards"] = cards
    # load's PLE decision (engine/model.py): a table kept in host memory takes no device memory
    out["ple_table"], out["ple_reason"] = ple_placement(
        "auto", gguf, cfg, spec, out["fixed_bytes"], expert_pools=expert_pools, parallel=rows, expert_slots=None,
        vram_budget=budget, vram_reserve=vram_reserve, free_bytes=None)
    if out["ple_table"] is not None:
        out["ple_bytes"] = gguf.tensor(PLE_TABLE_NAME).nbytes
    if out["ple_table"] == "host":
        out["fixed_bytes"] = fixed((PLE_TABLE_NAME,))
    if too_small is not None:
        out["fits_dense"], out["too_small"] = False, too_small
        return out
    if not cfg.is_moe:
        out["fits_dense"] = budget >= out["fixed_bytes"] + out["reserve_bytes"]
        return out
    try:
        plan = plan_model_cache(spec, fixed_bytes=out["fixed_bytes"], expert_pools=expert_pools,
                                batch_rows=rows, vram_budget=budget, vram_reserve=vram_reserve, cards=cards)
    except ConfigError as e:  # what load would refuse with
        out["fits_dense"], out["too_small"] = False, str(e)
        return out
    out["fits_dense"] = True
    out["plan"] = plan
    out["expert_slots"] = plan.n_slots
    return out


def format_report(r: dict[str, Any]) -> str:
    cfg: ModelConfig = r["config"]
    lines = [
        f"file          {r['path']} ({fmt_bytes(r['file_bytes'])}"
        + (f" in {r['shards']} shards)" if r["shards"] > 1 else ")"),
        f"architecture  {cfg.arch}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} kv, head dim {cfg.head_dim}), vocab {cfg.vocab_size:,}, context {cfg.context_length:,}",
    ]
    if cfg.mla is not None:
        d = cfg.mla
        lines.append(
            f"attention     latent (MLA): query latent {d.q_lora_rank or 'none'}, kv latent {d.kv_lora_rank}, per head "
            f"{d.nope_dim} + {d.rope_dim} rope key dims and {d.v_dim} value dims; cache {cfg.kv_values_per_position} "
            f"values per position and layer" + (f", {cfg.rope_scaling.kind} rope x{cfg.rope_scaling.factor:g}" if cfg.rope_scaling else ""))
    if cfg.is_moe:
        lines.append(
            f"experts       {len(cfg.moe_layers)} MoE layers x {cfg.n_experts} experts = {r['experts']:,}, "
            f"top-{cfg.n_experts_used}, expert ffn {cfg.expert_ffn_dim}"
            + (f", shared expert ffn {cfg.shared_expert_ffn_dim}" if cfg.shared_expert_ffn_dim else "")
        )
        lines.append(f"expert size   {fmt_bytes(r['expert_bytes'])} per expert (gate+up+down, as stored)")
    lines.append("bytes by kind:")
    for kind, n in sorted(r["bytes_by_kind"].items(), key=lambda kv: -kv[1]):
        types = ", ".join(f"{t} x{c}" for t, c in sorted(r["types_by_kind"][kind].items()))
        lines.append(f"  {kind:<15} {fmt_bytes(n):>12}  {100 * n / r['total_tensor_bytes']:5.1f}%  [{types}]")
    lines.append(f"dense weights {fmt_bytes(r['dense_bytes'])} on the device (everything but routed experts; "
                 + (f"dequantized at load to {r['dtype']}, {fmt_bytes(r['dense_file_bytes'])} in the file)"
                    if r["dequantize_dense"] else "in the file's blocks)"))
    rows = f" x {r['rows']} rows" if r["rows"] > 1 else ""
    lines.append(f"kv cache      {fmt_bytes(r['kv_bytes'])} at ctx {r['ctx']:,}{rows} ({r['kv_label']}); "
                 f"{r['ctx_reason']}")
    if r.get("kv_resident"):
        lines.append(f"              streamed: {r['kv_resident']:,} positions a layer on the device, "
                     f"{fmt_bytes(r['kv_host_bytes'])} in pinned host memory (--kv-resident)")
    lines.append(f"activations   {fmt_bytes(r['activation_bytes'])} (one prefill chunk of {r['prefill_chunk']:,} "
                 "tokens, bound)")
    if r.get("ple_table"):
        lines.append(f"ple table     {fmt_bytes(r['ple_bytes'])} in {r['ple_table']} memory ({r['ple_reason']})")
    if "vram_budget" in r:
        budget = fmt_bytes(r["vram_budget"]) + (f" a card x {r['cards']} cards" if r.get("cards", 1) > 1 else "")
        before = (f"{fmt_bytes(r['fixed_bytes'])} of dense weights, kv cache and activations, "
                  f"{fmt_bytes(r['reserve_bytes'])} reserved")
        if "too_small" in r:  # the planner's own refusal, as load would raise it
            lines.append(f"vram budget   {r['too_small']}")
        elif not r["fits_dense"]:
            lines.append(f"vram budget   {budget}: too small: {before}")
        elif cfg.is_moe:
            pct = 100 * r["expert_slots"] / max(r["experts"], 1)
            lines.append(f"vram budget   {budget}: {r['expert_slots']:,} expert slots ({pct:.0f}% of {r['experts']:,} "
                         f"experts) beside {before}"
                         + ("; all resident" if r["plan"].resident else "; offloading"))
        else:
            lines.append(f"vram budget   {budget}: the whole model fits")
    return "\n".join(lines)
