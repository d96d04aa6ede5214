"""`strata-jax bench`: decode speed, hit rate and host->device traffic of the offload path on a
synthetic random-weight MoE, against the all-resident run of the same file.

Shapes: b30 (Qwen3-30B-A3B: 48 layers, 128 experts top-8, expert ffn 768, Q4_K, ~17 GB) and bseed
(the 125B-class target's expert scale: 512 experts top-10, expert ffn 512, ~43 GB); `small` for a quick
check. The GGUF is written once into the cache, keyed by its spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import time

import numpy as np

from strata_jax.model.synthetic import SyntheticSpec, write_synthetic_gguf

log = logging.getLogger("strata_jax")

SHAPES = {
    "small": SyntheticSpec(arch="qwen3moe", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=2, head_dim=128,
                           n_experts=64, n_experts_used=8, expert_ffn_dim=512, vocab_size=32768, qtype="Q4_K"),
    "b30": SyntheticSpec(arch="qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                         n_experts=128, n_experts_used=8, expert_ffn_dim=768, vocab_size=151936, qtype="Q4_K",
                         context_length=40960),
    "bseed": SyntheticSpec(arch="qwen3moe", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                           n_experts=512, n_experts_used=10, expert_ffn_dim=512, vocab_size=151936, qtype="Q4_K",
                           context_length=40960),
}


def synthetic_model_path(shape: str):
    from strata_jax.model.default_model import cache_dir, file_lock

    spec = SHAPES[shape]
    key = hashlib.sha256(repr(dataclasses.astuple(spec)).encode()).hexdigest()[:16]
    path = cache_dir() / "synthetic" / f"{shape}-{key}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if not path.exists():
            t0 = time.perf_counter()
            tmp = path.with_suffix(".partial")
            write_synthetic_gguf(tmp, spec)
            tmp.rename(path)
            log.info("wrote %s (%.1f GB) in %.0f s", path, path.stat().st_size / 1e9, time.perf_counter() - t0)
    return path


def _decode_run(model, prompt_ids, n_tokens):
    # compile prefill + decode; cache_prompt off so the timed run prefills the whole prompt again
    model.generate(prompt_ids, max_tokens=4, temperature=0, cache_prompt=False)
    model.reset_stats()
    t0 = time.perf_counter()
    gen = model.generate(prompt_ids, max_tokens=n_tokens, temperature=0, cache_prompt=False)
    wall = time.perf_counter() - t0
    st = model.stats()
    return gen, wall, st


def run(args) -> dict:
    import strata_jax

    path = synthetic_model_path(args.shape) if not args.model else args.model
    rng = np.random.default_rng(0)
    results: dict = {"shape": args.shape, "model": str(path), "tokens": args.tokens, "runs": []}
    ref_tokens = None
    configs = [("resident", {})] if args.resident else []
    for frac in args.cache_fraction:
        for depth in [0] if args.no_prefetch else args.prefetch_depth:
            configs.append((f"offload {frac:.0%} {args.policy} prefetch {depth}", {"cache_fraction": frac,
                                                                                   "prefetch": depth}))
    from strata_jax.model.config import ModelConfig
    from strata_jax.model.gguf_file import GGUFFile

    cfg = ModelConfig.from_gguf(GGUFFile(path))
    total = len(cfg.moe_layers) * cfg.n_experts
    for name, opts in configs:
        kw = {"ctx": args.ctx}
        if "cache_fraction" in opts:
            kw.update(expert_slots=max(1, int(total * opts["cache_fraction"])), policy=args.policy,
                      prefetch=opts["prefetch"])
        model = strata_jax.load(path, **kw)
        prompt = rng.integers(0, min(model.config.vocab_size, 30000), args.prompt_len).tolist()
        rng = np.random.default_rng(0)  # same prompt for every configuration
        gen, wall, st = _decode_run(model, prompt, args.tokens)
        tps = gen.timings["decode_per_second"]
        n = len(gen.token_ids)
        per_expert = int(model.experts.bytes_per_expert_M[0]) if model.experts is not None else 0
        moved = (st.get("misses", 0) + st.get("prefetched", 0)) * per_expert  # decode traffic only
        run = {"config": name, "decode_tok_s": tps, "prefill_tok_s": gen.timings["prompt_per_second"],
               "wall_s": wall, "n_tokens": n, "hit_rate": st.get("hit_rate"),
               "decode_MB_per_token": moved / max(n - 1, 1) / 1e6,
               "decode_h2d_GB_s": moved / max(n - 1, 1) * tps / 1e9,
               "prefetch": st.get("prefetch"),
               "prefetch_precision": st.get("prefetch_precision"), "prefetch_recall": st.get("prefetch_recall"),
               "fetch_us_per_expert": st.get("fetch_us_per_expert"), "link_GB_s": st.get("link_GB_per_s"),
               "transfer_stall_fraction": st.get("transfer_stall_fraction"),
               "expert_slots": st.get("expert_slots"), "total_experts": st.get("total_experts")}
        if ref_tokens is None:
            ref_tokens = gen.token_ids
        run["same_tokens_as_first"] = gen.token_ids == ref_tokens
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
        del model
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="strata-jax bench")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--model", help="benchmark this GGUF instead of a synthetic one")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--cache-fraction", type=float, action="append", default=None)
    p.add_argument("--policy", default="lru")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--prefetch-depth", type=int, action="append", default=None,
                   help="prefetch depth; repeat to compare several (0 = off)")
    p.add_argument("--no-resident", dest="resident", action="store_false")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    args.cache_fraction = args.cache_fraction or [0.5]
    args.prefetch_depth = args.prefetch_depth or [0]
    logging.basicConfig(level=logging.INFO, format="strata-jax: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)
    res = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
