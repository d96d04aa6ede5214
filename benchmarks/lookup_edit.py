"""Prompt lookup (`--spec lookup`) on a real model for code-editing prompts (issue 18, figure (a)): each prompt
greedy with and without speculation in one process, after a warm-up that compiles every program the request
needs; tok/s, drafts accepted, and whether the tokens are the same. Prints one JSON object (also --out).

    python benchmarks/lookup_edit.py --model Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf [--tokens 96] [--out F]
"""

from __future__ import annotations

import argparse
import json
import time

import strata_jax
from strata_jax.bench.machine import machine_info, nvidia_smi

SNIPPETS = {
    "rename": ("Rewrite this function with `subtotal` renamed to `net`. Reply with the code only.",
               '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''),
    "type-hints": ("Add type hints to every function below. Reply with the code only.",
                   '''def parse_line(line, sep=","):
    fields = line.strip().split(sep)
    return [f.strip() for f in fields if f]


def read_rows(path, sep=","):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            rows.append(parse_line(line, sep))
    return rows
'''),
    "docstring": ("Add a one-line docstring to this class and each of its methods. Reply with the code only.",
                  '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n

    def most_common(self, k):
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:k]
'''),
}


def run(model, messages, tokens: int) -> dict:
    model.generate(messages, max_tokens=tokens, temperature=0)  # compiles every program this request takes
    t0 = time.perf_counter()
    g = model.generate(messages, max_tokens=tokens, temperature=0)
    wall = time.perf_counter() - t0
    t = g.timings
    return {"tokens": len(g.token_ids), "wall_s": wall, "tok_s": len(g.token_ids) / wall,
            "decode_tok_s": t.get("decode_per_second"), "draft_n": t.get("draft_n", 0),
            "draft_n_accepted": t.get("draft_n_accepted", 0), "token_ids": list(g.token_ids)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--spec-max", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args(argv)
    plain = strata_jax.load(args.model, ctx=1024)
    spec = strata_jax.load(args.model, ctx=1024, spec="lookup", spec_max=args.spec_max)
    rows = []
    for name, (ask, code) in SNIPPETS.items():
        msgs = [{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}]
        a, b = run(plain, msgs, args.tokens), run(spec, msgs, args.tokens)
        rows.append({"prompt": name, "plain": a, "lookup": b, "same_tokens": a.pop("token_ids") == b.pop("token_ids"),
                     "speedup": b["tok_s"] / a["tok_s"],
                     "accept_rate": b["draft_n_accepted"] / b["draft_n"] if b["draft_n"] else None})
    out = {"model": args.model, "tokens": args.tokens, "spec_max": args.spec_max, "machine": machine_info(nvidia_smi()),
           "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return out


if __name__ == "__main__":
    main()
