"""Where compilation time goes as a model gets deeper: trace, lowering and XLA backend compile of the
first request's programs (prefill + decode chunk), at several layer counts and under several settings.

    python benchmarks/compile_probe.py [--shape qmid] [--layers 4,12] [--variants default,xla,...]
                                       [--slots-per-layer N] [--out FILE]

Each (variant, layer count) runs in a child process (XLA flags are per process) with the persistent
compilation cache off, loads a synthetic GGUF of the shape with that many layers (written once under
the cache), and times the first generate (every program compiled) against the second (none). JAX's
monitoring events give the split: jaxpr trace, jaxpr -> MLIR, backend compile. The slope between
layer counts is the cost per layer. --slots-per-layer offloads the experts (N slots per MoE layer, the
default per-layer caches) so the programs carry the policy and the miss loop; each row names the
layer plan the engine logged (which layers compiled once).

Variants: default (the engine's settings), unrolled (layer_scan off: every layer compiled, the engine
before model/runs.py), xla (STRATA_JAX_QMATVEC=0: no Pallas kernels), noautotune
(--xla_gpu_autotune_level=0), nocmdbuf (command buffers off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# each variant's environment, and its engine options (the child's load keywords) under "options"
VARIANTS = {
    "default": {},
    "unrolled": {"options": {"layer_scan": "off"}},
    "xla": {"STRATA_JAX_QMATVEC": "0"},
    "noautotune": {"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
    "nocmdbuf": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
}


def _spec(shape: str, layers: int):
    from strata_jax.bench.shapes import SHAPES

    if shape == "qmid":  # qseed's layer at 64 experts and a small vocab and PLE table: a file of a few GB
        base = dataclasses.replace(SHAPES["qseed"], n_experts=64, vocab_size=32768, ple_head_vocab=4096)
    else:
        base = SHAPES[shape]
    return dataclasses.replace(base, n_layers=layers)


def child(shape: str, layers: int, options: dict) -> dict:
    import jax
    import jax.monitoring

    from strata_jax.core.paths import cache_dir
    from strata_jax.dev.synthetic import write_synthetic_gguf
    import strata_jax

    events: dict[str, float] = {}
    counts: dict[str, int] = {}
    backend: list[float] = []  # each program's backend compile, in order

    def on_duration(name, secs, **_):
        events[name] = events.get(name, 0.0) + secs
        counts[name] = counts.get(name, 0) + 1
        if name.endswith("backend_compile_duration"):
            backend.append(secs)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    path = cache_dir() / "synthetic" / f"probe-{shape}-{layers}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        write_synthetic_gguf(path.with_suffix(".partial"), _spec(shape, layers))
        path.with_suffix(".partial").rename(path)
    t0 = time.perf_counter()
    model = strata_jax.load(str(path), ctx=1024, compilation_cache=False, **options)
    load_s = time.perf_counter() - t0
    from strata_jax.model import runs

    plan = runs.describe(model.layer_runs) if model.layer_runs is not None else "every layer unrolled"
    table = model.experts.slots if model.experts is not None else None
    before, n_before = dict(events), len(backend)
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        model.generate("the quick brown fox jumps over", max_tokens=24, temperature=0)
        walls.append(time.perf_counter() - t0)
    first = {k: round(v - before.get(k, 0.0), 3) for k, v in events.items() if "compile" in k or "trace" in k
             or "mlir" in k}
    return {"shape": shape, "layers": layers, "load_s": round(load_s, 2), "first_s": round(walls[0], 2),
            "second_s": round(walls[1], 2), "events_s": first, "event_counts": counts,
            "largest_backend_s": sorted((round(x, 2) for x in backend[n_before:]), reverse=True)[:4],
            "device": str(jax.devices()[0]), "layer_plan": plan,
            "expert_slots": None if table is None or table.resident else table.n_slots,
            "expert_pools": None if table is None else len(table.pools)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qmid")
    ap.add_argument("--layers", default="4,12")
    ap.add_argument("--variants", default="default,xla,noautotune")
    ap.add_argument("--slots-per-layer", type=int, default=None,
                    help="offload the experts: this many cache slots per MoE layer (default: all resident)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "data-compile.json"))
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "LAYERS", "OPTIONS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], int(a.child[1]), json.loads(a.child[2]))), flush=True)
        return
    variants, bad = a.variants.split(","), [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        ap.error(f"--variants {','.join(bad)}: unknown; choose from {','.join(VARIANTS)}")
    try:
        layer_counts = [int(n) for n in a.layers.split(",")]
    except ValueError:
        ap.error(f"--layers {a.layers!r}: give layer counts separated by commas, e.g. 4,8")
    rows = []
    root = str(Path(__file__).resolve().parents[1])  # the child imports strata_jax from this tree
    sys.path.insert(0, root)  # and so does this process (_spec reads the bench shapes)
    base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    for v in variants:
        for n in layer_counts:
            env = dict(base)
            options = dict(VARIANTS[v].get("options", {}))
            if a.slots_per_layer:
                options["expert_slots"] = a.slots_per_layer * _spec(a.shape, n).n_layers
            for k, val in VARIANTS[v].items():
                if k != "options":
                    env[k] = (env.get(k, "") + " " + val).strip() if k == "XLA_FLAGS" else val
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--child", a.shape, str(n), json.dumps(options)], env=env,
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            row = json.loads(line[-1][7:]) if line else {"error": p.stderr[-2000:]}
            row.update(variant=v, layers=n, wall_s=round(time.perf_counter() - t0, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
