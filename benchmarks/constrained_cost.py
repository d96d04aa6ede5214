"""What constrained decoding costs per token: the same request unconstrained and under a JSON schema
(greedy, the default model unless --model), decode ms per token and llguidance's mask ms per token.

    python benchmarks/constrained_cost.py [--model PATH] [--tokens 48] [--decode-chunk N]
"""

from __future__ import annotations

import argparse
import json
import time

import strata_jax
from strata_jax.engine.constrained import Constraint, request_grammar

SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "required": ["name", "price"],
    "properties": {"name": {"type": "string"}, "price": {"type": "number"}}}}}}
ASK = [{"role": "user", "content": "List ten groceries with prices as JSON."}]


def run(model, tokens: int, constraint: str | None) -> dict:
    s = model.session()
    t0 = time.perf_counter()
    row, chunks = s.admit(ASK, max_tokens=tokens, temperature=0, cache_prompt=True, constraint=constraint)
    t1, ids = time.perf_counter(), [t for ch in chunks for t in ch.token_ids]
    while row in s.active_rows:
        ids += [t for ch in s.step().get(row, []) for t in ch.token_ids]
    dt = time.perf_counter() - t1
    out = {"tokens": len(ids), "prefill_s": round(t1 - t0, 3),
           "decode_ms_per_token": round(1e3 * dt / max(len(ids) - 1, 1), 2)}
    if constraint is not None:  # the host's share: llguidance's masks over the same tokens, replayed
        c = Constraint(constraint, model.tokenizer, model.config.vocab_size)
        for t in ids:
            c.mask()
            c.take(t)
        out["mask_ms_per_token"] = round(1e3 * c.mask_s / c.masks, 3)
        out["text"] = model.detokenize(ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--decode-chunk", type=int)
    a = ap.parse_args()
    opts = {"decode_chunk": a.decode_chunk} if a.decode_chunk else {}
    model = strata_jax.load(a.model, ctx=1024, **opts)
    grammar = request_grammar(json_schema=SCHEMA)
    for _ in range(2):  # the first round compiles
        out = {"free": run(model, a.tokens, None), "json_schema": run(model, a.tokens, grammar)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
