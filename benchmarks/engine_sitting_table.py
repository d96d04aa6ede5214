"""The engine sitting's results (benchmarks/engine_sitting.sh) as one markdown table, OLD against NEW.

    python benchmarks/engine_sitting_table.py FILE_OR_DIR...

Reads results-b30-{old,new}[-rN].json (bench: decode tok/s of the resident row; the median of the runs), loads.json or load-*.json
(server_load.py: aggregate tok/s, latency, TTFT, per-request decode) and phases.tsv (why a row is missing:
a failed phase's rc, a skipped one). Rows are (workload, tree); new/old is the ratio of the tok/s column.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

MODELS = {"b30": "B30 (synthetic qwen3moe, 48 layers, 128 experts top-8)",
          "dense": "dense (synthetic qwen2, default model's shape)"}


def _num(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def load_inputs(args: list[str]) -> tuple[dict, dict, dict]:
    benches, loads, phases = {}, {}, {}
    files = []
    for a in args:
        p = Path(a)
        files += sorted(p.iterdir()) if p.is_dir() else [p]
    for f in files:
        if f.name == "phases.tsv":
            for line in f.read_text().splitlines():
                name, status, rc, secs = (line.split("\t") + ["", "", ""])[:4]
                phases[name] = (status, rc, secs)  # the last line of a name wins (a re-run)
        elif m := re.fullmatch(r"results-(\w+?)-(old|new)(?:-r\d+)?\.json", f.name):
            benches.setdefault((m[1], m[2]), []).append(json.loads(f.read_text()))  # one per run
        elif f.name == "loads.json":
            loads.update(json.loads(f.read_text()))
        elif re.fullmatch(r"load-.*\.json", f.name):
            loads[f.stem] = json.loads(f.read_text())
    return benches, loads, phases


def _missing(phases: dict, phase: str) -> str:
    status, rc, secs = phases.get(phase, ("not run", "", ""))
    if status == "ok":
        return "no result (phase rc 0: see its log)"
    return f"{status}" + (f" (rc {rc}{', cut at its limit' if rc == '124' else ''}, {secs} s)" if rc else "")


def table(benches: dict, loads: dict, phases: dict) -> str:
    head = ["workload", "tree", "tok/s", "latency p50 ms", "TTFT p50 ms", "per-request decode p50 tok/s",
            "errors", "new/old"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def emit(workload: str, cells: dict) -> None:
        tps = {t: c[0] for t, c in cells.items() if isinstance(c, tuple)}
        ratio = f"{tps['new'] / tps['old']:.2f}x" if tps.get("old") and tps.get("new") else "-"
        for t in ("old", "new"):
            c = cells[t]
            if isinstance(c, str):  # why it is missing
                out.append(f"| {workload} | {t} | {c} | | | | | {ratio if t == 'new' else ''} |")
            else:
                out.append(f"| {workload} | {t} | {_num(c[0])} | {_num(c[1])} | {_num(c[2])} | {_num(c[3])} | {c[4]} "
                           f"| {ratio if t == 'new' else ''} |")

    for shape in sorted({s for s, _ in benches} | {"b30"}):
        cells, runs = {}, {}
        for t in ("old", "new"):
            docs = benches.get((shape, t), [])
            rows = [r for doc in docs for r in doc.get("rows", []) if r.get("engine", "strata-jax") == "strata-jax"
                    and r.get("decode_tok_s")]
            if rows:  # several runs: the median, every run listed in the workload
                tps = sorted(r["decode_tok_s"] for r in rows)
                runs[t] = " / ".join(_num(x) for x in tps)
                cells[t] = (statistics.median(tps), None, None, None, "-")
            else:
                err = next((r.get("error") for doc in docs for r in doc.get("rows", []) if r.get("error")), None)
                missing = [_missing(phases, name) for name in phases if name.startswith(f"bench-{shape}-{t}")]
                cells[t] = f"failed: {str(err)[:80]}" if err else (missing or [_missing(phases, f"bench-{shape}-{t}")])[0]
        each = "; ".join(f"{t} runs {v}" for t, v in runs.items() if v.count("/"))
        emit(f"bench {shape}: resident, batch 1, decode 128 tokens (16-step calls)" + (f" ({each})" if each else ""),
             cells)
    keys = {}
    for name in loads:
        if m := re.fullmatch(r"load-(old|new)-(\w+)-p(\d+)-c(\d+)", name):
            keys[(m[2], int(m[3]), int(m[4]))] = True
    for model in ("dense", "b30"):
        for par in (4, 1):
            for c in ((4, 1) if par == 4 else (1, 4)):
                keys.setdefault((model, par, c), False)
    order = lambda k: (k[1] != 4, k[1] == 4 and k[2] != 4, k[0] != "dense", k[2])  # noqa: E731 (the sitting's order)
    for model, par, c in sorted(keys, key=order):
        cells = {}
        for t in ("old", "new"):
            d = loads.get(f"load-{t}-{model}-p{par}-c{c}")
            if d and "tok_per_s" in d:
                cells[t] = (d["tok_per_s"], d["latency_ms"]["p50"], d["ttft_ms"]["p50"],
                            d.get("per_request_decode_tok_s_p50"), len(d.get("errors") or []))
            else:
                cells[t] = (d or {}).get("error") or _missing(phases, f"serve-{model}-p{par}-{t}")
        emit(f"serve --parallel {par}, {c} client{'s' if c > 1 else ''}: {MODELS.get(model, model)}", cells)
    notes = ["", "tok/s: decode tok/s for bench rows; aggregate completion tok/s over the timed requests for serve "
             "rows (greedy, 64 tokens, 8 requests per client, after an untimed warm-up). The dense model has random "
             "weights in the default model's shape (Qwen2.5-Coder-0.5B-Instruct: 24 layers, d_model 896, 14/2 heads, "
             "ffn 4864, vocab 151936), Q8_0 and an untied output matrix: not the real Q4_K_M file."]
    return "\n".join(out + notes)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(table(*load_inputs(sys.argv[1:])))


if __name__ == "__main__":
    main()
