"""Quality of mixed-precision experts (--cold-experts) against the all-high model, on CPU.

A synthetic qwen3moe (4 layers x 256 experts, top-2, Q8_0 experts) and its low-bit copy (the same expert
values requantized to Q4_0 by gguf-py: dev/synthetic.py `experts_from`). Short prompts (at most 16 tokens,
so every lookup goes through the expert cache: 32 per layer) are scored one after another, the cache
carrying over; each prompt's logits are compared with the all-high model's: KL(high || mixed) per position
and top-1 agreement, averaged. Rows: cache fraction x promote_after (0: plain offloading; "never": every
miss low-bit). Also the share of lookups served low-bit and the bytes per lookup over PCIe.

    JAX_PLATFORMS=cpu python benchmarks/mixed_quality.py [--arch qwen3moe|qwen4exp] [--prompts 48] [--out FILE.json]

--arch qwen4exp: the seed's architecture (bench shape qtiny: DeltaNet, QSA, hyper-connections, PLE) with the same
expert count, top-k and types.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np

import strata_jax
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

HOT = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=128, head_dim=32, n_experts=256, expert_ffn_dim=64,
                    vocab_size=512, qtype="Q8_0", expert_qtype="Q8_0", seed=11)
COLD = dataclasses.replace(HOT, expert_qtype="Q4_0", experts_from="Q8_0")
TEXT = ("the tea is hot and the rain is there, so she sat on the stairs to read a book about the sea and the ships "
        "that came in at night with their lights low over the water while the town slept and the dogs barked ")


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=["qwen3moe", "qwen4exp"], default="qwen3moe")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--out")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    spec = HOT
    if args.arch == "qwen4exp":
        from strata_jax.bench.shapes import SHAPES

        spec = dataclasses.replace(SHAPES["qtiny"], n_experts=HOT.n_experts, n_experts_used=HOT.n_experts_used,
                                   expert_qtype=HOT.expert_qtype, seed=HOT.seed)
    cold_spec = dataclasses.replace(spec, expert_qtype=COLD.expert_qtype, experts_from=spec.expert_qtype)
    hot, cold = write_synthetic_gguf(d / "hot.gguf", spec), write_synthetic_gguf(d / "cold.gguf", cold_spec)
    ref = strata_jax.load(hot, ctx=64)
    ids = ref.tokenize(TEXT * 4)
    prompts = [ids[i:i + 16] for i in range(0, 8 * args.prompts, 8)][:args.prompts]
    want = [_log_softmax(np.asarray(ref.logits(p), np.float64)) for p in prompts]
    cold_ref = strata_jax.load(cold, ctx=64)
    base = [_log_softmax(np.asarray(cold_ref.logits(p), np.float64)) for p in prompts]

    def score(got):
        kl = np.mean([np.sum(np.exp(w) * (w - g), -1).mean() for w, g in zip(want, got)])
        top1 = np.mean([(w.argmax(-1) == g.argmax(-1)).mean() for w, g in zip(want, got)])
        return float(kl), float(top1)

    rows = [dict(zip(("kl", "top1"), score(base)), fraction=None, promote_after="all low-bit (the Q4_0 model)")]
    total = spec.n_layers * spec.n_experts
    for frac in (0.125, 0.25, 0.5):
        for after in (0, 1, 2, 4, -1):
            m = strata_jax.load(hot, ctx=64, expert_slots=int(total * frac), cold_experts=cold, promote_after=after)
            got = [_log_softmax(np.asarray(m.logits(p), np.float64)) for p in prompts]
            st = m.stats()
            kl, top1 = score(got)
            rows.append({"fraction": frac, "promote_after": after if after >= 0 else "never", "kl": kl,
                         "top1": top1, "hit_rate": st["hit_rate"], "cold_share": st["cold_share"],
                         "bytes_per_lookup": st["bytes_h2d"] / max(st["lookups"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    print("| cache | promote after | KL(high || mixed) | top-1 agreement | hit rate | low-bit share | bytes per lookup |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        frac = "-" if r["fraction"] is None else f"{r['fraction']:.3g} of the experts"
        tail = "| - | - | - |" if r["fraction"] is None else \
            f"| {r['hit_rate']:.1%} | {r['cold_share']:.1%} | {r['bytes_per_lookup']:,.0f} |"
        print(f"| {frac} | {r['promote_after']} | {r['kl']:.5f} | {r['top1']:.1%} {tail}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
