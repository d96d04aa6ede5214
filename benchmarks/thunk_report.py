"""What XLA:GPU runs a compiled program as, from a dump's `*thunk_sequence.txt` (XLA_FLAGS=--xla_dump_to=DIR):
the thunks by kind, then each dynamic-slice fusion thunk (the kind that keeps a while loop out of the command
buffers when its offset depends on the loop) with the lines around it (its embedded thunks follow it), and the HLO instruction each names with
its JAX source (op_name) from the dump's `*after_optimizations.txt`.

    python benchmarks/thunk_report.py DUMP_DIR
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys

_KIND = re.compile(r"\bk[A-Z][A-Za-z0-9]+\b")
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")


def _instructions(dump: pathlib.Path) -> dict[str, str]:
    """HLO instruction name -> its line (the optimized modules of the dump)."""
    out = {}
    for f in dump.glob("*after_optimizations.txt"):
        for line in f.read_text(errors="ignore").splitlines():
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
            if m:
                out.setdefault(m.group(1), line.strip())
    return out


def _source(line: str) -> str:
    m = re.search(r'op_name="([^"]+)"', line)
    return m.group(1) if m else "?"


def report(dump: pathlib.Path, before: int = 2, after: int = 8, limit: int = 60) -> None:
    hlo = _instructions(dump)
    for f in sorted(dump.glob("*thunk_sequence.txt")):
        lines = f.read_text(errors="ignore").splitlines()
        kinds = collections.Counter(k for line in lines for k in _KIND.findall(line))
        print(f"== {f.name}: {len(lines)} lines")
        for k, n in kinds.most_common(30):
            print(f"{n:7d}  {k}")
        hits = [i for i, line in enumerate(lines) if "DynamicSlice" in line or "dynamic_slice" in line.lower()]
        print(f"== {len(hits)} lines name a dynamic-slice fusion (first {limit})")
        sources: collections.Counter[str] = collections.Counter()
        for i in hits[:limit]:
            print("--")
            print("\n".join(x[:300] for x in lines[max(0, i - before): i + after + 1]))
            for name in _NAME.findall(lines[i]):
                if name in hlo:
                    print(f"   HLO {name}: {_source(hlo[name])}")
                    print(f"       {hlo[name][:300]}")
                    sources[_source(hlo[name])] += 1
        print("== their JAX sources")
        for s, n in sources.most_common(40):
            print(f"{n:5d}  {s}")


if __name__ == "__main__":
    report(pathlib.Path(sys.argv[1]))
