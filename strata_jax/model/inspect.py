"""What is in a GGUF file and what of it fits on a GPU: the report behind `strata-jax inspect`."""

from __future__ import annotations

import collections
import re
from typing import Any

from strata_jax.model.config import ModelConfig
from strata_jax.core.units import fmt_bytes
from strata_jax.gguf.reader import GGUFFile

_KINDS = [
    (r"^token_embd\.", "embedding"),
    (r"^output\.", "output head"),
    (r"norm\.weight$", "norms"),
    (r"\.attn_", "attention"),
    (r"\.ffn_gate_inp\.", "routers"),
    (r"_shexp\.", "shared experts"),
    (r"_exps\.", "routed experts"),
    (r"\.ffn_", "dense mlp"),
]


def tensor_kind(name: str) -> str:
    for pattern, kind in _KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def report(gguf: GGUFFile, vram_budget: int | None = None, ctx: int = 4096, kv_bytes_per_elem: int = 2) -> dict[str, Any]:
    cfg = ModelConfig.from_gguf(gguf)
    by_kind: dict[str, int] = collections.Counter()
    types_by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in gguf.tensors.values():
        kind = tensor_kind(t.name)
        by_kind[kind] += t.nbytes
        types_by_kind[kind][t.type_name] += 1
    total = sum(by_kind.values())
    expert_total = by_kind.get("routed experts", 0)
    n_experts_all = cfg.n_experts * len(cfg.moe_layers)
    expert_bytes = expert_total / n_experts_all if n_experts_all else 0.0
    kv_bytes = 2 * cfg.n_layers * ctx * cfg.kv_dim * kv_bytes_per_elem
    out: dict[str, Any] = {
        "path": gguf.path,
        "file_bytes": gguf.file_size,
        "config": cfg,
        "bytes_by_kind": dict(by_kind),
        "types_by_kind": {k: dict(v) for k, v in types_by_kind.items()},
        "total_tensor_bytes": total,
        "dense_bytes": total - expert_total,
        "experts": n_experts_all,
        "expert_bytes": expert_bytes,
        "kv_bytes": kv_bytes,
        "ctx": ctx,
    }
    if vram_budget is not None:
        free_for_experts = vram_budget - out["dense_bytes"] - kv_bytes
        slots = int(max(free_for_experts, 0) // expert_bytes) if expert_bytes else 0
        out["vram_budget"] = vram_budget
        out["fits_dense"] = free_for_experts >= 0
        out["expert_slots"] = min(slots, n_experts_all)
    return out


def format_report(r: dict[str, Any]) -> str:
    cfg: ModelConfig = r["config"]
    lines = [
        f"file          {r['path']} ({fmt_bytes(r['file_bytes'])})",
        f"architecture  {cfg.arch}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} kv, head dim {cfg.head_dim}), vocab {cfg.vocab_size:,}, context {cfg.context_length:,}",
    ]
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
    lines.append(f"dense weights {fmt_bytes(r['dense_bytes'])} (everything but routed experts)")
    lines.append(f"kv cache      {fmt_bytes(r['kv_bytes'])} at ctx {r['ctx']:,} (16-bit)")
    if "vram_budget" in r:
        budget = fmt_bytes(r["vram_budget"])
        if not r["fits_dense"]:
            lines.append(f"vram budget   {budget}: too small for the dense weights and kv cache alone "
                         f"(need {fmt_bytes(r['dense_bytes'] + r['kv_bytes'])} before any expert)")
        elif cfg.is_moe:
            pct = 100 * r["expert_slots"] / max(r["experts"], 1)
            lines.append(f"vram budget   {budget}: {r['expert_slots']:,} expert slots ({pct:.0f}% of {r['experts']:,} "
                         f"experts) beside the dense weights and kv cache")
        else:
            lines.append(f"vram budget   {budget}: the whole model fits")
    return "\n".join(lines)
