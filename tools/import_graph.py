"""The import graph of the tandem package, and its cycles.

Reads every module under tandem/ with ``ast`` and takes an edge A -> B for every ``import tandem.x`` /
``from tandem.x import y`` / relative import in A that names a tandem module B, wherever it stands: at the top,
inside a function (a lazy import), under ``if TYPE_CHECKING:`` or in a ``try``. ``from tandem.pkg import name``
counts as an edge to ``tandem.pkg.name`` when that is a module, else to ``tandem.pkg``. A package's own
``__init__`` is not an edge of its submodules (importing ``tandem.a.b`` runs ``tandem/a/__init__.py`` first, but
that is an edge only when the ``__init__`` itself imports something).

Usage: ``python3 tools/import_graph.py [--root DIR] [--edges]``. Prints each cycle (its strongly connected
component's modules and one closed path through them) and exits 1 when there is any, else prints "no cycles"
and exits 0. ``--edges`` also prints every edge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "tandem"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under ``root`` (the repository root)."""
    out: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tandem modules that ``module`` (file ``path``) imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:  # ``import tandem.a.b.c`` where c is a name: the deepest module
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            if base is None or not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    """module -> the tandem modules it imports."""
    modules = module_names(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or one importing itself), sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1 or node in edges.get(node, ()):
                        out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def closed_path(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One cycle through the component's first module (breadth-first, so the shortest)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), v, start] if v != start else [start, start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the repository root")
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    args = parser.parse_args(argv)
    edges = graph(Path(args.root))
    if args.edges:
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f"{m} -> {t}")
    found = cycles(edges)
    for comp in found:
        print(f"cycle among {len(comp)} modules: {', '.join(comp)}")
        print("  " + " -> ".join(_dedupe(closed_path(edges, comp))))
    if found:
        print(f"{len(found)} cycle(s) in {len(edges)} modules")
        return 1
    print(f"no cycles in {len(edges)} modules ({sum(len(v) for v in edges.values())} edges)")
    return 0


def _dedupe(path: list[str]) -> list[str]:
    return [m for i, m in enumerate(path) if i == 0 or m != path[i - 1]]


if __name__ == "__main__":
    sys.exit(main())
