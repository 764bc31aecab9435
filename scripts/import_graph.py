#!/usr/bin/env python3
"""pinstage's import graph, counting every ``import`` and ``from ... import`` anywhere in a
module (inside functions and ``if TYPE_CHECKING:`` blocks too): prints the cycles, if any,
and exits 1 when there is one.

    python scripts/import_graph.py [PACKAGE_DIR]   (default: pinstage/ next to this script)
"""

from __future__ import annotations

import ast
import os
import sys


def module_name(root: str, path: str, package: str) -> str:
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join([package, *rel]) if rel else package


def edges(root: str, package: str) -> dict[str, set[str]]:
    mods: dict[str, str] = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                mods[module_name(root, path, package)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = base[: len(base) - node.level + 1]
                    prefix = ".".join(parent + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith(package):
                    graph[mod].add(t)
    # importing a submodule imports its parent packages too
    for mod in list(graph):
        for t in list(graph[mod]):
            parts = t.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in graph and parent != mod and not mod.startswith(parent + "."):
                    graph[mod].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pinstage")
    graph = edges(root, os.path.basename(os.path.normpath(root)))
    found = cycles(graph)
    for comp in found:
        print("import cycle:", " <-> ".join(comp))
    if not found:
        print(f"no import cycle among {len(graph)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
