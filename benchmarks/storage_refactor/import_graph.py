"""kvtrim's import graph from the source (ast, nothing imported): cycles, and what the storage files import.

    python benchmarks/storage_refactor/import_graph.py [SRC_DIR]   (default: this checkout's src/)

An edge A -> B for every `import` / `from ... import` of a kvtrim module B in A, at module level or inside
a function (`--top-level` counts module-level imports only: the ones that run at import time). Importing
`kvtrim.x.y` also runs the package `kvtrim.x`, so that is an edge too, except from a module inside
`kvtrim.x` (the package is already loading then) and for the root package `kvtrim` (every module would
otherwise be in one cycle through it). Prints the strongly connected components
with more than one module (import cycles) and the kvtrim imports of every file under kvtrim/storage/.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtrim"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import submodule`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvtrim"))
    return found


def graph(src: Path, top_level: bool) -> dict[str, set[str]]:
    files = {module_name(src, p): p for p in (src / "kvtrim").rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = set()
        for m in imports(path, top_level):
            parts = m.split(".")
            for i in range(2, len(parts) + 1):  # the module and its packages, not the root `kvtrim`
                target = ".".join(parts[:i])
                inside = name.startswith(target + ".")  # a package's own module: the package is already loading
                if target in files and (i == len(parts) or not inside):
                    targets.add(target)
        edges[name] = targets - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str]) -> int:
    top_level = "--top-level" in argv
    args = [a for a in argv if not a.startswith("--")]
    src = Path(args[0]) if args else Path(__file__).resolve().parents[2] / "src"
    edges = graph(src, top_level)
    print(f"{src}: {len(edges)} modules, {sum(map(len, edges.values()))} edges"
          f" ({'module-level imports' if top_level else 'all imports'})")
    found = cycles(edges)
    print(f"import cycles: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    for name in sorted(n for n in edges if n.startswith("kvtrim.storage")):
        print(f"{name} imports: {sorted(edges[name]) or 'nothing of kvtrim'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
