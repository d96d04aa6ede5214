"""Write the engine sitting's two synthetic GGUF files once, for both code trees to read (--model PATH).

    PYTHONPATH=TREE python benchmarks/engine_sitting_models.py OUTDIR [--b30-shape b30] [--dense k=v,...]

OUTDIR/b30.gguf: bench/shapes.py's SHAPES[--b30-shape] (17.2 GB for b30). OUTDIR/dense.gguf: a random qwen2
model in the shape of the default model, Qwen2.5-Coder-0.5B-Instruct (that file, 491 MB, cannot travel);
Q8_0 since 896 is no multiple of Q4_K's 256, and an untied output matrix (the writer always writes one).
--dense overrides fields (a dry run's tiny stand-in). Files are written to .partial and renamed, so a
file that exists is whole. Prints one JSON line per file: path, bytes, spec, seconds, the writer's module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import time
from pathlib import Path

# the writer may move during the refactor (strata_jax.model.synthetic -> strata_jax.dev.synthetic)
for _name in ("strata_jax.dev.synthetic", "strata_jax.model.synthetic"):
    try:
        synthetic = importlib.import_module(_name)
        break
    except ImportError:
        continue
else:
    raise SystemExit("no synthetic GGUF writer in this tree")

DENSE = dict(arch="qwen2", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864,
             vocab_size=151936, qtype="Q8_0", context_length=32768)


def _value(s: str):
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def write(path: Path, spec) -> None:
    t0 = time.perf_counter()
    if not path.exists():
        tmp = path.with_suffix(".partial")
        synthetic.write_synthetic_gguf(tmp, spec)
        tmp.rename(path)
    print(json.dumps({"path": str(path), "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 1),
                      "writer": synthetic.__name__, "spec": dataclasses.asdict(spec)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--b30-shape", default="b30", help="a bench shape name (default b30; tiny for a dry run)")
    p.add_argument("--dense", default="", help="k=v,... overriding the default model's shape")
    p.add_argument("--only", choices=["dense", "b30"], help="write one of the two")
    args = p.parse_args()
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    if args.only != "b30":  # the small one first: seconds, and the dense phases need nothing else
        over = dict(kv.split("=", 1) for kv in args.dense.split(",") if kv)
        write(out / "dense.gguf", synthetic.SyntheticSpec(**{**DENSE, **{k: _value(v) for k, v in over.items()}}))
    if args.only != "dense":
        from strata_jax.bench.shapes import SHAPES

        write(out / "b30.gguf", SHAPES[args.b30_shape])


if __name__ == "__main__":
    main()
