"""Cold start as a user sees it: `strata-jax generate` in a fresh process, timed from the process's start to
the first byte of the answer on stdout, with an empty compilation cache (a first start: every program
compiles, and the engine may compile a step ahead of its expert store's load through that cache).

    python benchmarks/cold_start.py --model PATH [--tokens 32] [--out FILE] [-- ENGINE FLAGS...]

Each line the child writes to stderr is stamped with seconds since its start; JAX_LOG_COMPILES=1 makes
JAX log each program's compile time there, so the row splits the wait into loading, each program's
compilation and the rest. The child's own summary (prefill and decode tok/s) is kept as printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = ("Write a Python function that merges two sorted lists into one sorted list, then explain its running "
          "time in two sentences.")
COMPILED = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.]+) sec")


def cold_start(model: str, tokens: int, flags: list[str]) -> dict:
    cache = tempfile.TemporaryDirectory(prefix="cold-start-xla-")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache.name, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "strata_jax.cli", "generate", "--model", model, "--prompt", PROMPT,
           "--max-tokens", str(tokens), "--temperature", "0", *flags]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []

    def read_stderr():
        for raw in p.stderr:
            lines.append((round(time.perf_counter() - t0, 2), raw.decode(errors="replace").rstrip()[:400]))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    first = p.stdout.read(1)
    first_s = time.perf_counter() - t0 if first else None
    rest = p.stdout.read()
    rc = p.wait()
    total_s = time.perf_counter() - t0
    reader.join(5)
    cache.cleanup()
    compiles = [(t, m.group(1)[:80], float(m.group(2))) for t, line in lines for m in [COMPILED.search(line)] if m]
    # the model's "loaded ..." line, then (an offloading model's store loads in the background) its experts'
    model_at = next((t for t, line in lines if re.search(r"\bloaded \S+ \(", line)), None)
    experts_at = next((t for t, line in lines if "experts loaded:" in line), None)
    return {"command": " ".join(cmd), "rc": rc, "first_token_s": None if first_s is None else round(first_s, 2),
            "total_s": round(total_s, 2), "loaded_at_s": max((t for t in (model_at, experts_at) if t), default=None),
            "model_loaded_at_s": model_at, "experts_loaded_at_s": experts_at,
            "compile_s": round(sum(c[2] for c in compiles), 2),
            "largest_compiles": sorted(({"at_s": t, "program": n, "s": s} for t, n, s in compiles),
                                       key=lambda c: -c["s"])[:6],
            "stdout_chars": len(first + rest),
            "stderr": [x for x in lines if "Compiling " not in x[1] and "Finished " not in x[1]][-60:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "data-cold-start.json"))
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="engine flags for generate, after --")
    a = ap.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    row = cold_start(a.model, a.tokens, flags)
    Path(a.out).write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k != "stderr"}, indent=1))
    for t, line in row["stderr"][-25:]:
        print(f"{t:8.2f}  {line}")


if __name__ == "__main__":
    main()
