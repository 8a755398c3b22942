"""Cycles in dcsched's import graph, read from the source.

A module's imports are its module-level import statements, those under ``if TYPE_CHECKING:`` included;
imports inside functions (deferred on purpose, mostly to keep torch out of ``dcsched --help``) are left
out unless ``--deferred`` is given.

    python tools/import_cycles.py                # cycles between modules
    python tools/import_cycles.py --packages     # cycles between subpackages (dcsched.costmodels <-> ...)
    python tools/import_cycles.py --deferred ... # imports inside functions count too

Exit code 1 where a cycle is found.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dcsched"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _module_level(body):
    """The statements run when the module is imported: ``if``/``try``/``with`` bodies, not ``def``s."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level(getattr(node, field, []) or [])


def imports(path: Path, known: set[str], deferred: bool = False) -> set[str]:
    """The dcsched modules ``path`` imports (a ``from pkg import name`` counts as pkg.name where that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = ast.walk(tree) if deferred else _module_level(tree.body)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def graph(key, deferred: bool = False) -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        src = key(name)
        for target in imports(path, set(mods), deferred):
            if key(target) != src:
                edges.setdefault(src, set()).add(key(target))
        edges.setdefault(src, set())
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def package_of(name: str) -> str:
    """dcsched.costmodels.base -> dcsched.costmodels; dcsched.units -> dcsched.units."""
    parts = name.split(".")
    return ".".join(parts[:2])


def main(argv: list[str]) -> int:
    deferred = "--deferred" in argv
    key = package_of if "--packages" in argv else (lambda name: name)
    found = cycles(graph(key, deferred))
    what = (f"cycles between {'subpackages' if '--packages' in argv else 'modules'} "
            f"({'all imports' if deferred else 'module-level imports, TYPE_CHECKING included'})")
    print(f"{what}: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
