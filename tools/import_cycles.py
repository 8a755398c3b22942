"""Cycles in dcsched's import graph, read from the source.

A module's imports are its module-level import statements, those under ``if TYPE_CHECKING:`` included;
imports inside functions (deferred on purpose, mostly to keep torch out of ``dcsched --help``) are left
out unless ``--deferred`` is given.

    python tools/import_cycles.py                # cycles between modules
    python tools/import_cycles.py --packages     # cycles between subpackages (dcsched.costmodels <-> ...)
    python tools/import_cycles.py --deferred ... # imports inside functions count too
    python tools/import_cycles.py --layers       # imports from a lower floor up (see FLOORS)

Exit code 1 where a cycle is found, or (``--layers``) an import runs from a lower floor to a higher one.
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


#: The package's floors, lowest first: a module imports (at module level) only from its own floor and those
#: below. Each floor names modules and packages (a package stands for every module in it).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("dcsched", "dcsched.errors", "dcsched.units", "dcsched.safeparse", "dcsched.lazy",
                "dcsched.outputs", "dcsched.budget", "dcsched.plan", "dcsched.collectives")),
    ("graph", ("dcsched.graph",)),
    ("bundle", ("dcsched.bundle",)),
    ("runtime, cost models, simulator, synthetic graphs", ("dcsched.runtime", "dcsched.costmodels", "dcsched.sim",
                                                            "dcsched.synthetic")),
    ("schedulers", ("dcsched.schedulers", "dcsched.reorder")),
    ("profile, report, DeepSpeed drop-in", ("dcsched.profile", "dcsched.report", "dcsched.deepspeed")),
    ("replay", ("dcsched.replay",)),
    ("train", ("dcsched.train",)),
    ("cli and examples", ("dcsched.cli", "dcsched.__main__", "dcsched.examples")),
)


def floor_of(name: str) -> int | None:
    """The floor (index in :data:`FLOORS`) of module ``name``: its longest named prefix's; None if unnamed."""
    best, floor = -1, None
    for level, (_, members) in enumerate(FLOORS):
        for member in members:
            if (name == member or name.startswith(member + ".")) and len(member) > best:
                best, floor = len(member), level
    return floor


def upward_imports(deferred: bool = False) -> list[str]:
    """Every import from a lower floor to a higher one, and every module on no floor, as lines to print."""
    mods = modules()
    found = [f"{name}: on no floor (add it to FLOORS)" for name in mods if floor_of(name) is None]
    for name, path in mods.items():
        source = floor_of(name)
        for target in sorted(imports(path, set(mods), deferred)):
            up = floor_of(target)
            if source is not None and up is not None and up > source:
                found.append(f"{name} ({FLOORS[source][0]}) imports {target} ({FLOORS[up][0]})")
    return found


def main(argv: list[str]) -> int:
    deferred = "--deferred" in argv
    if "--layers" in argv:
        found = upward_imports(deferred)
        print(f"imports from a lower floor up ({'all imports' if deferred else 'module-level imports'}): "
              f"{len(found)}")
        for line in found:
            print("  " + line)
        return 1 if found else 0
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
