"""Kernels in the body of each while loop of an optimized XLA:GPU HLO dump (`*after_optimizations.txt`,
from XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text): by kind, and by fusion name with --names.
Two trees' decode programs compared this way show whether a slowdown is more kernels per step.

    python benchmarks/hlo_kernels.py FILE [--names]
"""

from __future__ import annotations

import collections
import re
import sys

# instructions that launch nothing on their own
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "reshape", "after-all", "opt-barrier"}


def parse(path: str) -> dict[str, list[tuple[str, str]]]:
    """computation name -> [(opcode, instruction line)]."""
    comps: dict[str, list[tuple[str, str]]] = {}
    cur = None
    for line in open(path):
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur and " = " in line:
            op = re.search(r"(?:^|[\s}])([a-z][a-z0-9\-]*)\(", line.split(" = ", 1)[1])
            comps[cur].append((op.group(1) if op else "?", line))
    return comps


def walk(comps, name: str, kinds: collections.Counter, fusions: collections.Counter) -> None:
    for op, line in comps.get(name, []):
        if op in _FREE:
            continue
        if op in ("call", "while", "conditional"):  # count what they run, not the call itself
            for callee in re.findall(r"(?:to_apply|calls|body|branch_computations)=\{?%?([\w.\-]+)", line):
                walk(comps, callee, kinds, fusions)
            if op != "call":
                kinds[op] += 1
            continue
        key = op
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            key = "fusion:" + (kind.group(1) if kind else "?")
            callee = re.search(r"calls=%?([\w.\-]+)", line).group(1)
            fusions[re.sub(r"[.\d_]+computation$|[.\d]+$", "", callee)] += 1
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            key = "custom-call:" + (target.group(1) if target else "?")
        kinds[key] += 1


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    comps = parse(sys.argv[1])
    for ins in comps.values():
        for op, line in ins:
            if op != "while":
                continue
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            kinds, fusions = collections.Counter(), collections.Counter()
            walk(comps, body, kinds, fusions)
            print(f"while body {body}: {sum(kinds.values())} kernels")
            for k, v in kinds.most_common():
                print(f"  {k:40s}{v}")
            if "--names" in sys.argv:
                for k, v in sorted(fusions.items()):
                    print(f"    {k} {v}")


if __name__ == "__main__":
    main()
