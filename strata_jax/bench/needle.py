"""Needle in a haystack: a passphrase hidden at a chosen depth of a long prompt of real text (this
repository's docs, repeated to length), and whether greedy decoding repeats it when asked at the end.

    python -m strata_jax.bench.needle [--model PATH] --ctx 8192 --depth 0.1,0.5,0.9 [--rope-scaling yarn
        --rope-scale 2] [--out needle.json]

What a pass means: the answer contains the passphrase's number and its two words. The prompt is the
model's chat template around [haystack with the needle] + the question, sized to `ctx` minus room for
the answer. Results are one JSON row per (context, depth): found, answer, prompt tokens, prefill and
total seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger("strata_jax")

NEEDLE = "The secret passphrase is indigo-falcon-4417. Remember it."
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with the passphrase only."
KEYS = ("indigo", "falcon", "4417")
ANSWER_TOKENS = 24
_DOCS = ("README.md", "docs/design.md", "docs/benchmarks.md", "docs/routing.md", "docs/serving.md")


def haystack_text() -> str:
    """Real prose (the repository's docs): varied enough that the needle is the only passphrase."""
    root = Path(__file__).resolve().parents[2]
    parts = [(root / p).read_text(encoding="utf-8") for p in _DOCS if (root / p).exists()]
    if not parts:
        raise FileNotFoundError(f"no haystack text: none of {', '.join(_DOCS)} under {root}")
    return "\n\n".join(parts)


def needle_prompt(model, n_tokens: int, depth: float) -> list[int]:
    """Chat-template token ids of about n_tokens: the haystack cut to fit, the needle at `depth` (0..1) of
    it (on a line boundary), then the question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must lie in [0, 1]")
    tok = model.tokenize
    frame = len(model.prompt_tokens([{"role": "user", "content": NEEDLE + "\n\n" + QUESTION}]))
    hay = tok(haystack_text(), add_special=False)
    room = max(n_tokens - frame, 0)
    while len(hay) < room:
        hay = hay + hay
    hay = hay[:room]
    text = model.detokenize(hay)
    lines = text.split("\n")
    at = min(int(depth * len(lines)), len(lines))
    body = "\n".join(lines[:at] + [NEEDLE] + lines[at:])
    return model.prompt_tokens([{"role": "user", "content": body + "\n\n" + QUESTION}])


def run_one(model, ctx: int, depth: float) -> dict:
    ids = needle_prompt(model, ctx - ANSWER_TOKENS - 8, depth)
    t0 = time.perf_counter()
    out = model.generate(ids, max_tokens=ANSWER_TOKENS, temperature=0, cache_prompt=False)
    total = time.perf_counter() - t0
    found = all(k in out.text.lower() for k in KEYS)
    t = out.timings
    row = {"ctx": ctx, "depth": depth, "prompt_tokens": len(ids), "found": found, "answer": out.text.strip(),
           "prefill_s": (t.get("prompt_ms") or 0) / 1e3, "total_s": total,
           "prefill_tok_s": t.get("prompt_per_second")}
    log.info("needle: ctx %d depth %.0f%% -> %s (%r, %.1f s)", ctx, 100 * depth, "found" if found else "MISSED",
             row["answer"][:60], total)
    return row


def main(argv=None) -> int:
    import strata_jax

    p = argparse.ArgumentParser(prog="python -m strata_jax.bench.needle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF path (default: the embedded default model)")
    p.add_argument("--ctx", action="append", type=int, required=True, help="context sizes (repeatable)")
    p.add_argument("--depth", default="0.1,0.5,0.9", help="needle depths, comma-separated fractions")
    p.add_argument("--rope-scaling", default=None)
    p.add_argument("--rope-scale", default=None, type=float)
    p.add_argument("--kv", default="f16")
    p.add_argument("--kv-resident", default=None, type=int, help="KV streaming: positions per layer on the device")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    depths = [float(d) for d in a.depth.split(",") if d.strip()]
    rows = []
    for ctx in sorted(set(a.ctx)):
        model = strata_jax.load(a.model, ctx=ctx, kv=a.kv, rope_scaling=a.rope_scaling, rope_scale=a.rope_scale,
                                kv_resident=a.kv_resident)
        for d in depths:
            rows.append(run_one(model, ctx, d) | {"kv": a.kv, "rope_scaling": a.rope_scaling,
                                                   "rope_scale": a.rope_scale, "kv_resident": a.kv_resident,
                                                   **model.kv_stats()})
            if a.out:
                Path(a.out).write_text(json.dumps(rows, indent=1))
        del model
    for r in rows:
        print(f"ctx {r['ctx']:>7,}  depth {100 * r['depth']:3.0f}%  {'found ' if r['found'] else 'MISSED'}  "
              f"{r['prompt_tokens']:>7,} tokens  prefill {r['prefill_s']:.1f} s  {r['answer'][:50]!r}")
    return 0 if all(r["found"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
