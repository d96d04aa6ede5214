"""Where a decode step's (or a prefill's) GPU time goes, by the model's named scopes (attn, linear, moe, ple,
head, ...).

Writes a bench shape with fewer layers, loads it, and profiles 8 decode steps (--prefill N: one prefill of
an N-token prompt in one chunk instead, its program's kernels and copies). Command buffers are off
for the profile (XLA_FLAGS, set here before JAX starts) so that each kernel event names its HLO fusion;
the decode program's optimized HLO (dumped) maps each fusion to its JAX source (op_name), and the time is
summed per scope path and primitive. The wall tok/s with command buffers off is not the engine's figure:
the kernel times are.

    python benchmarks/scope_profile.py --shape qseed --layers 8 [--slots-fraction 0.5] [--tokens 32]
    python benchmarks/scope_profile.py --shape qseed --layers 8 --slots-fraction 0.5 --prefill 4096

Results: $OUT/scope_profile.json (top scopes, top fusions, totals per step).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys
import time

OUT = os.environ.get("OUT", "/tmp")
DUMP = os.path.join(OUT, "scope-dump")
PROGRAM = "prefill" if "--prefill" in sys.argv else "decode"  # the program profiled (its modules dumped)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer= "
                           f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{PROGRAM}.*"
                           ).strip()
os.environ.setdefault("STRATA_JAX_COMPILATION_CACHE", "0")  # a cached program is not dumped
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from decode_profile import gpu_events  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import strata_jax  # noqa: E402
from strata_jax.bench.shapes import SHAPES  # noqa: E402
from strata_jax.dev.synthetic import write_synthetic_gguf  # noqa: E402

_NOISE = re.compile(r"^(jit\([^)]*\)|while|body|cond|eval_jaxpr|closed_call|pjit|checkpoint|remat|"
                    r"branch_\d+_fun|cond\.\d+|_[a-z_]+)$")


def scope_of(op_name: str) -> str:
    """'jit(decode)/while/body/eval_jaxpr/layers0+/moe/jit(_take)/gather' -> 'layers+/moe/gather'."""
    parts = [p for p in op_name.split("/") if p and not _NOISE.match(p)]
    parts = [re.sub(r"\d+", "", p) if p.startswith("layer") else p for p in parts]
    return "/".join(parts[:4]) or "?"


def fusion_sources(dump: str) -> tuple[dict[str, str], dict[str, str]]:
    """Fusion (or op) name -> its op_name metadata, and -> its instruction's shape and operands, from the
    profiled program's optimized HLO."""
    src, head = {}, {}
    for f in glob.glob(os.path.join(dump, f"*{PROGRAM}*after_optimizations.txt")):
        for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^\n]*)$", open(f).read(), re.M):
            name, rest = m.group(1), m.group(2)
            head.setdefault(name, re.sub(r", (metadata|backend_config)=.*", "", rest)[:240])
            op = re.search(r"op_name=\"([^\"]+)\"", rest)
            if op:
                src.setdefault(name, op.group(1))
    return src, head


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qseed")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--slots-fraction", type=float, default=0.0, help="0: resident; else expert slots as a fraction")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens (one chunk)")
    a = p.parse_args()
    spec = dataclasses.replace(SHAPES[a.shape], n_layers=a.layers)
    path = f"/tmp/{a.shape}-{a.layers}L.gguf"
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_synthetic_gguf(path, spec)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    kw = {}
    if a.slots_fraction:
        kw = {"expert_slots": int(a.layers * spec.n_experts * a.slots_fraction), "policy": "lru"}
    if a.prefill:
        kw["prefill_chunk"] = a.prefill
    model = strata_jax.load(path, ctx=max(1024, a.prefill + 64), **kw)
    model.tokenizer.stop_ids = frozenset()
    prompt = list(range(100, 132))
    if a.prefill:  # a different prompt each time (no prefix reuse), each one chunk
        V = model.config.vocab_size - 100
        prompts = [[100 + (i * 7919 + j * 31) % V for j in range(a.prefill)] for i in range(3)]
        model.generate(prompts[0], max_tokens=1, temperature=0, cache_prompt=False)
        g = model.generate(prompts[1], max_tokens=1, temperature=0, cache_prompt=False)
        n = 1

        def run():
            model.generate(prompts[2], max_tokens=1, temperature=0, cache_prompt=False)
            return jnp.zeros(())
    else:
        model.generate(prompt, max_tokens=4, temperature=0, cache_prompt=False)
        g = model.generate(prompt, max_tokens=a.tokens, temperature=0, cache_prompt=False)
        n = a.steps

        def run():
            model.generate(prompt, max_tokens=n + 1, temperature=0, cache_prompt=True)
            return jnp.zeros(())

    evs = gpu_events(run, 1)
    evs = [e for e in evs if PROGRAM in str(e[2].get("hlo_module", PROGRAM))]
    src, head = fusion_sources(DUMP)
    by_scope, by_op, count = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
    unnamed = 0.0
    for name, us, stats, *_ in evs:
        op = str(stats.get("hlo_op", name))
        by_op[op] += us / n
        where = src.get(op)
        if where is None:
            unnamed += us / n
        by_scope[scope_of(where) if where else "(no source) " + re.sub(r"[._0-9]+$", "", op)] += us / n
        count[scope_of(where) if where else "?"] += 1
    total = sum(by_scope.values())
    # the GPU's busy span over the profiled run(s): its excess over the kernel sum is idle time (or the host)
    span = (max(e[4] + e[1] * 1e3 for e in evs) - min(e[4] for e in evs)) / 1e3 / n if evs else 0.0
    res = {"shape": a.shape, "layers": a.layers, "slots_fraction": a.slots_fraction,
           "stats": {k: v for k, v in model.stats().items() if isinstance(v, (int, float, str))},
           "program": PROGRAM, "prefill_tokens": a.prefill,
           "decode_tok_s_cmdbuf_off": g.timings.get("decode_per_second"),
           "prefill_tok_s_cmdbuf_off": g.timings.get("prompt_per_second"), "kernel_us_per_step": total,
           "span_us_per_step": span, "kernels_per_step": len(evs) / n, "unattributed_us_per_step": unnamed,
           "scopes_us_per_step": {k: round(v, 1) for k, v in sorted(by_scope.items(), key=lambda kv: -kv[1])[:60]},
           "launches_per_step": {k: v / n for k, v in count.most_common(40)},
           "ops_us_per_step": {f"{k} <- {src.get(k, '?')[-90:]}": round(v, 1)
                               for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:40]},
           "ops_hlo": {k: head.get(k, "?") for k, _ in sorted(by_op.items(), key=lambda kv: -kv[1])[:40]}}
    tag = os.environ.get("TAG", "")  # several runs of one shape in one $OUT
    what = f"-prefill{a.prefill}" if a.prefill else ""
    with open(os.path.join(OUT, f"scope_profile-{a.shape}-{a.layers}L-{a.slots_fraction}{what}{tag and '-' + tag}.json"),
              "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("kernel_us_per_step", "span_us_per_step", "kernels_per_step",
                                          "unattributed_us_per_step", "prefill_tok_s_cmdbuf_off")}))
    for k, v in list(res["scopes_us_per_step"].items())[:30]:
        print(f"{v:9.1f} us  {k}")


if __name__ == "__main__":
    main()
