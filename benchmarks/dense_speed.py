"""Decode and prefill speed of a dense GGUF (default-model figures in docs/benchmarks.md):
    python benchmarks/dense_speed.py MODEL.gguf
Runs with dequantize_dense False and True; warms each shape before timing it."""
import sys, time, json, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
import jax, numpy as np
import strata_jax
path = sys.argv[1]
res = {"jax": jax.__version__, "device": str(jax.devices()[0])}
for dd in (False, True):
    m = strata_jax.load(path, ctx=4096, dequantize_dense=dd)
    msgs = [{"role": "user", "content": "Write a Python function that reverses a singly linked list, with a docstring and tests."}]
    m.generate(msgs, max_tokens=8, temperature=0)  # warm decode + this bucket
    g = m.generate(msgs, max_tokens=128, temperature=0)
    r = {"decode_tok_s": g.timings["decode_per_second"], "n": len(g.token_ids), "text": g.text[:300]}
    for n in (512, 2048):
        ids = (m.tokenize("def f(x):\n    return x * 2\n") * 400)[:n]
        m.generate(ids, max_tokens=1, temperature=0)  # compile this bucket
        t = time.perf_counter(); m.generate(ids, max_tokens=1, temperature=0); dt = time.perf_counter() - t
        r[f"prefill_{n}_tok_s"] = n / dt
    res[f"dequantize_dense={dd}"] = r
    print(json.dumps(r), flush=True)
    del m
print(json.dumps(res, indent=1))
