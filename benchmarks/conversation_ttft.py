"""Time to first token of a conversation's second turn: cold, from the RAM tier, from the disk tier after a
restart (issue 34; engine/convcache.py).

Turn 1 is `--turn1` random token ids plus 16 generated tokens; another conversation then takes the only
row, so turn 2 (turn 1's tokens plus `--new` more) cannot reuse the row and comes from the conversation
cache, or is prefilled whole (cold). Each figure is the wall time of a generate of one token, after a
first run of the same path (its compilation) on another turn 2 of the same length. The disk tier is
measured in a second load of the model with only the disk tier (a restart; the first model is freed
first): `disk_first_s` is its first request (programs from the compilation cache), `disk_s` a later one.

    python benchmarks/conversation_ttft.py --model PATH [--turn1 16384] [--new 64] [--ctx N]
        [--vram-budget 32GiB] [--out result.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time

import numpy as np

import strata_jax


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--turn1", type=int, default=16384, help="turn 1's prompt tokens")
    p.add_argument("--new", type=int, default=64, help="turn 2's new tokens")
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--vram-budget", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    ctx = a.ctx or a.turn1 + a.new + 64
    folder = tempfile.mkdtemp(prefix="conv-ttft-")
    opts = dict(ctx=ctx, vram_budget=a.vram_budget)
    m = strata_jax.load(a.model, conversation_cache_mib=1 << 20, conversation_cache_dir=folder, **opts)
    rng = np.random.default_rng(0)
    V = m.config.vocab_size
    ids = lambda n: rng.integers(100, V - 100, n).tolist()  # noqa: E731 - plain tokens, no specials
    other = ids(32)

    def take_row(model):  # another conversation takes the only row: turn 1 goes to the conversation cache
        model.generate(other, max_tokens=1, temperature=0)

    def ttft(model, prompt, **kw):
        t0 = time.perf_counter()
        out = model.generate(prompt, max_tokens=1, temperature=0, **kw)
        return time.perf_counter() - t0, out.timings["cache_n"]

    m.generate(ids(a.turn1), max_tokens=16, temperature=0)
    turn1 = m.session().cached_tokens(0)
    turn2 = lambda: turn1 + ids(a.new)  # noqa: E731 - a fresh turn 2 each time: no row or entry holds it whole
    take_row(m)
    ttft(m, turn2(), cache_prompt=False)
    cold_s, _ = ttft(m, turn2(), cache_prompt=False)
    take_row(m)
    ttft(m, turn2())
    take_row(m)
    ram_s, ram_n = ttft(m, turn2())
    m.conversation_cache.flush()
    del m
    gc.collect()
    d = strata_jax.load(a.model, conversation_cache_dir=folder, **opts)  # a restart: RAM tier empty
    disk_first_s, disk_n = ttft(d, turn2())
    take_row(d)
    disk_s, _ = ttft(d, turn2())
    r = {"model": a.model, "turn1_tokens": len(turn1), "turn2_tokens": len(turn1) + a.new, "ctx": ctx,
         "vram_budget": a.vram_budget, "cold_s": cold_s, "ram_s": ram_s, "ram_cached_tokens": ram_n,
         "disk_first_s": disk_first_s, "disk_s": disk_s, "disk_cached_tokens": disk_n,
         "disk_bytes": d.conversation_cache.disk.nbytes}
    print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f)
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
