"""The packages import downwards only: core <- gguf <- model and offload <- engine <- serving; model and
offload never import each other (the MoE block reaches experts through core.experts.ExpertProvider).
Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "strata_jax"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every strata_jax module path this file imports (absolute or relative, any nesting)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}  # `from strata_jax import offload`
    return {n for n in out if n == "strata_jax" or n.startswith("strata_jax.")}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


FILES = sorted(ROOT.rglob("*.py"))

# what each layer may import (itself included); bench, dev, the CLI and the package root may import anything
MAY_IMPORT = {
    "core": {"core"},
    "gguf": {"core", "gguf"},
    "model": {"core", "gguf", "model"},
    "offload": {"core", "gguf", "offload"},
    "engine": {"core", "gguf", "model", "offload", "engine", "runtime", "dev"},  # dev: the default model's file
    "serving": {"core", "gguf", "model", "offload", "engine", "serving", "dev"},
    "hub": {"core", "hub"},  # downloads know nothing of models; the CLI and check.py join them
}


def _allowed(src: str, dst: str | None) -> bool:
    if src not in MAY_IMPORT:
        return True
    return dst in MAY_IMPORT[src]


def test_the_rule_itself():
    assert not _allowed("core", "gguf") and not _allowed("gguf", "model") and not _allowed("model", "offload")
    assert not _allowed("offload", "model") and _allowed("offload", "core") and _allowed("model", "gguf")
    assert not _allowed("model", "engine") and not _allowed("engine", "serving") and _allowed("engine", "offload")
    assert not _allowed("core", None)  # `import strata_jax` from core would run the whole package


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_downwards(path):
    src = _layer(_module(path))
    bad = []
    for name in sorted(_imports(path)):
        dst = _layer(name)
        if dst is not None and not (ROOT / dst).is_dir() and not (ROOT / f"{dst}.py").exists():
            dst = None  # `from strata_jax import StrataError`: a name of the package itself
        if not _allowed(src, dst) and not (dst is None and src not in ("core", "gguf", "model", "offload")):
            bad.append(name)
    assert not bad, f"{path.relative_to(ROOT)} ({src}) imports {bad}"


def test_every_layer_exists():
    for pkg in ("core", "gguf", "model", "offload", "engine", "serving", "dev", "hub"):
        assert (ROOT / pkg / "__init__.py").exists()


def _module_edges() -> dict[str, set[str]]:
    """module -> the strata_jax modules it imports, inside functions too. `from P import N` is module P.N
    where there is one (a submodule), else P (a name P defines)."""
    mods = {_module(f) for f in FILES}
    edges = {}
    for f in FILES:
        mod = _module(f)
        package = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                src = ".".join(base + ([node.module] if node.module else []))
                out |= {f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names}
        edges[mod] = {n for n in out if n in mods} - {mod}
    return edges


def test_no_import_cycles():
    """No module reaches itself through imports, inside a package too (model/weights once imported the layer
    modules that imported it back)."""
    edges = _module_edges()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
