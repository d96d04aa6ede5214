"""A one-minute check that the engine runs on a device before a sitting spends its time: a small MoE,
resident and offloaded (greedy tokens must agree), one request in 16-step decode calls, and a 4-row
Session. Prints one line per check; exits non-zero on the first failure.

    python benchmarks/gpu_smoke.py [DIR]
"""

from __future__ import annotations

import sys
import tempfile
import time

import strata_jax
from strata_jax.dev.synthetic import SyntheticSpec, write_synthetic_gguf

SPEC = SyntheticSpec(arch="qwen3moe", n_layers=4, d_model=512, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=512,
                     n_experts=32, n_experts_used=4, expert_ffn_dim=256, vocab_size=4096, qtype="Q4_K", seed=1)


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    path = write_synthetic_gguf(f"{folder}/smoke.gguf", SPEC)
    resident = strata_jax.load(path, ctx=512)
    resident.tokenizer.stop_ids = frozenset()
    ref = resident.generate("the tea is hot", max_tokens=48, temperature=0)
    t0 = time.perf_counter()
    again = resident.generate("the tea is hot and", max_tokens=64, temperature=0)
    print(f"resident: {len(again.token_ids)} tokens, {again.timings['decode_per_second']:.0f} tok/s steady, "
          f"{resident.host_timing()['decode_calls']} decode calls ({time.perf_counter() - t0:.1f} s)")
    off = strata_jax.load(path, ctx=512, expert_slots=SPEC.n_layers * 12)
    off.tokenizer.stop_ids = frozenset()
    got = off.generate("the tea is hot", max_tokens=48, temperature=0)
    st = off.stats()
    print(f"offloaded: hit rate {st['hit_rate']:.1%}, {st['misses']} misses, same tokens as resident: "
          f"{got.token_ids == ref.token_ids}")
    if got.token_ids != ref.token_ids:
        return 1
    s = strata_jax.Session(resident, 4)
    outs, req = {}, {}
    for i in range(4):
        row, chunks = s.admit(f"prompt {i} the tea", max_tokens=32, temperature=0 if i % 2 else 0.8, seed=i)
        outs[row], req[i] = [t for c in chunks for t in c.token_ids], row
    t0 = time.perf_counter()
    while s.active_rows:
        for row, chunks in s.step().items():
            outs[row] += [t for c in chunks for t in c.token_ids]
    n = sum(map(len, outs.values()))
    alone = resident.generate("prompt 1 the tea", max_tokens=32, temperature=0, cache_prompt=False)
    print(f"session of 4 rows: {n} tokens in {time.perf_counter() - t0:.2f} s (compilation included); "
          f"request 1 equals its lone run: {outs[req[1]] == alone.token_ids}")
    print("SMOKE OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
