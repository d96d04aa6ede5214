"""The dynamic-slice fusions of an optimized XLA:GPU HLO dump (`*after_optimizations.txt`, from
XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text): each such fusion (a DynamicSliceFusionV2 thunk, the
reason XLA logs for leaving a while loop out of the command buffers) with the first ops of its fused
computation and their JAX source (op_name metadata), then a count of the sources.

    python benchmarks/dsf_report.py DUMP_DIR
"""

from __future__ import annotations

import collections
import pathlib
import re
import sys


def report(dump: pathlib.Path) -> None:
    sources: collections.Counter[str] = collections.Counter()
    for f in sorted(dump.glob("*after_optimizations.txt")):
        text = f.read_text()
        comps = {m.group(1): m.start() for m in re.finditer(r"^%?([\w.\-]+) .*\{$", text, re.M)}
        # a loop fusion of a dynamic slice, or a custom one of a library call at a dynamic address
        # (XLA's dynamic-slice fusion rewriter: "dynamic_address_computation", "address_computation")
        for m in re.finditer(r"^\s*(%[\w.\-]+) = .*fusion\(.*calls=(%?[\w.\-]+).*(dynamic|address).*$", text, re.M):
            print(f"== {f.name}: {m.group(0).strip()[:400]}")
            at = comps.get(m.group(2).lstrip("%"))
            if at is None:
                continue
            body = text[at: text.index("\n}", at)].splitlines()
            print("\n".join(line.strip()[:400] for line in body[:14]))
            names = {n for line in body for n in re.findall(r'op_name="([^"]+)"', line)}
            sources.update(names)
    print("== sources (op_name: fusions)")
    for name, n in sources.most_common(40):
        print(f"{n:5d}  {name}")


if __name__ == "__main__":
    report(pathlib.Path(sys.argv[1]))
