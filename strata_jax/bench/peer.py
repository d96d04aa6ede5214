"""llama.cpp beside strata-jax in one `strata-jax bench` run: benchmarks/llamacpp.py's placements on the
same GGUF, run as a subprocess, its rows merged into ours.

When: after our rows if llama.cpp fits beside us, else before JAX starts. JAX's allocator keeps the
device memory it took until the process exits: the cap under --vram-budget, else 75% of the card
(XLA's default preallocation). So llama.cpp's all-GPU placement fits after our rows when the file plus
PEER_MARGIN fits in the rest of the card (BSEED under a 32 GiB cap: 43 GB of ~108 left; B30 uncapped:
17 GB of ~34); otherwise it runs first, with the card to itself.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("strata_jax")

GiB = 1 << 30
LLAMACPP_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llamacpp.py"


PEER_PLACEMENTS = ("all-gpu", "cpu-experts", "budget")  # benchmarks/llamacpp.py's placement names
PEER_MARGIN = 3 * GiB  # KV cache and compute buffers at a 4k context, CUDA context, slack
XLA_DEFAULT_FRACTION = 0.75


def fits_after(model_bytes: int, total_bytes: int | None, cap_fraction: float | None) -> bool:
    """Whether llama.cpp's all-GPU placement fits in the device memory this process's JAX leaves."""
    if total_bytes is None:
        return True  # no GPU to share
    share = cap_fraction or float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
                                  or os.environ.get("XLA_CLIENT_MEM_FRACTION") or XLA_DEFAULT_FRACTION)
    return model_bytes + PEER_MARGIN <= total_bytes * (1 - share) - GiB


def peer_command(binary: str, model: str, *, budget: int | None, prefill_lens: list[int], n_gen: int, reps: int,
                 out: str, threads: int | None = None, script: Path = LLAMACPP_SCRIPT,
                 placements: list[str] | None = None, depth: int = 0, kv: str = "f16") -> list[str]:
    placements = [p for p in (placements or PEER_PLACEMENTS) if p != "budget" or budget]
    # the longest prompt is llama-bench's main -p, so the budget plan's context covers it; the others
    # ride along as extra -p values (llama-bench appends repeated -p lists) and come back in "raw"
    lens = sorted(set(prefill_lens)) or [512]
    cmd = [sys.executable, str(script), "run", "--bin", binary, "--model", model, "--placement", ",".join(placements),
           "--n-prompt", str(lens[-1]), "--n-gen", str(n_gen), "--reps", str(reps), "--raw", "--out", out]
    if budget:
        cmd += ["--budget-gib", f"{budget / GiB:g}"]
    if depth:  # llama-bench -d: prefill and decode after this many tokens in the cache
        cmd += ["--depth", str(depth)]
    if kv != "f16":
        cmd += ["--cache-type", kv]
    if threads:
        cmd += ["--threads", str(threads)]
    if len(lens) > 1:
        cmd += ["--extra", "-p", ",".join(str(n) for n in lens[:-1])]
    return cmd


def peer_rows(raw_rows: list[dict], budget: int | None) -> list[dict]:
    """benchmarks/llamacpp.py's rows with prefill tok/s per prompt length (from llama-bench's raw rows) and
    whether the placement fits the budget (all-gpu: the file plus the budget plan's margin)."""
    margin = next((r["budget_plan"]["margin"]["total"] for r in raw_rows if r.get("budget_plan")), 0)
    out = []
    for r in raw_rows:
        r = dict(r)
        by_len = {}
        for x in r.pop("raw", None) or []:
            if x.get("n_prompt", 0) > 0 and x.get("n_gen", 0) == 0:
                by_len[str(x["n_prompt"])] = x.get("avg_ts")
        if not by_len and r.get("prefill_tok_s") is not None:
            by_len[str(r.get("n_prompt"))] = r["prefill_tok_s"]
        r["prefill_tok_s_by_len"] = by_len
        if budget:
            if r.get("placement") == "budget":
                r["fits_budget"] = bool((r.get("budget_plan") or {}).get("fits"))
            elif r.get("placement") == "cpu-experts":
                r["fits_budget"] = True  # only dense weights, KV cache and buffers on the GPU
            elif r.get("placement") == "all-gpu" and r.get("model_size"):
                r["fits_budget"] = r["model_size"] + margin <= budget
        out.append(r)
    return out


def wait_for_binary(binary: str, seconds: float) -> bool:
    """Wait up to `seconds` for a llama-bench that a background build is still making (give the path of a
    link made once the build succeeds: the linker writes the binary itself in pieces)."""
    deadline = time.monotonic() + seconds
    if not os.access(binary, os.X_OK) and seconds > 0:
        log.info("peer: waiting up to %.0f s for %s", seconds, binary)
    while not os.access(binary, os.X_OK) and time.monotonic() < deadline:
        time.sleep(5)
    return os.access(binary, os.X_OK)


def run_peer(binary: str, model: str, *, budget: int | None, prefill_lens: list[int], n_gen: int, reps: int,
             threads: int | None = None, wait_s: float = 0, placements: list[str] | None = None, depth: int = 0,
             kv: str = "f16") -> list[dict]:
    if not wait_for_binary(binary, wait_s):
        log.error("peer: %s is not an executable; no llama.cpp rows", binary)
        return [{"engine": "llama.cpp", "error": f"{binary}: no such executable"}]
    if not LLAMACPP_SCRIPT.exists():
        log.error("peer: %s not found (run from a checkout of the repository)", LLAMACPP_SCRIPT)
        return [{"engine": "llama.cpp", "error": f"{LLAMACPP_SCRIPT} not found"}]
    fd, out = tempfile.mkstemp(prefix="llama-peer-", suffix=".json")
    os.close(fd)
    cmd = peer_command(binary, model, budget=budget, prefill_lens=prefill_lens, n_gen=n_gen, reps=reps, out=out,
                       threads=threads, placements=placements, depth=depth, kv=kv)
    log.info("peer: %s", " ".join(cmd))
    proc = subprocess.run(cmd)  # its progress goes straight to our stdout/stderr
    try:
        rows = json.loads(Path(out).read_text() or "[]")
    except (OSError, json.JSONDecodeError):
        rows = []
    finally:
        Path(out).unlink(missing_ok=True)
    if not rows:
        return [{"engine": "llama.cpp", "error": f"benchmarks/llamacpp.py run exited {proc.returncode} with no rows"}]
    return peer_rows(rows, budget)
