"""The import graph of rlprof and rlprof_train: every ``import`` between their modules (at module level, inside
functions and under ``TYPE_CHECKING`` alike), checked for cycles and for arrows that point up the layers.

    python scripts/import_graph.py            # one line: modules, edges, cycles; exit 1 on a cycle or an arrow up
    python scripts/import_graph.py --edges    # also every edge, "a -> b"

An edge goes to the module named by the import (``from rlprof.tools import base`` -> ``rlprof.tools.base``;
``from rlprof.tools.base import Tool`` -> ``rlprof.tools.base``) and to the packages above it that the importer is
not in: Python runs ``rlprof/tools/__init__.py`` before ``rlprof.tools.base``, so a package whose ``__init__``
imports back into the importer is a cycle too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlprof", "rlprof_train")
FORBIDDEN = (
    ("rlprof.", "rlprof_train", "the library never imports the trainer"),
    ("rlprof.tools", "rlprof.session", "tools sit below the session"),
    ("rlprof.tools", "rlprof.annotate", "tools sit below the decorators"),
    ("rlprof.tools", "rlprof.config", "tools receive their settings, not the config"),
    ("rlprof.analysis", "rlprof.cli", "the analysis layer never reaches up into the command line"),
    ("rlprof.analysis", "rlprof.session", "reading runs back never starts a session"),
    ("rlprof.analysis", "rlprof.watchdog", "reading runs back never imports the runtime watchdog (or its session)"),
    ("rlprof_train.config", "rlprof_train.workers", "the config is loaded below the workers that read it"),
)
"""(importer prefix, imported prefix, why): arrows that point up the layers."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    targets: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                if name in known:
                    targets.add(name)
                elif base in known:
                    targets.add(base)
    for target in list(targets):  # the packages Python initialises first
        parts = target.split(".")
        for depth in range(1, len(parts)):
            package = ".".join(parts[:depth])
            if package in known and not (module + ".").startswith(package + "."):
                targets.add(package)
    targets.discard(module)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, children_of_root in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(children_of_root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            for importer, forbidden, why in FORBIDDEN:
                if (source + ".").startswith(importer) and (target + ".").startswith(forbidden + "."):
                    problems.append(f"{source} -> {target}: {why}")
    return problems


def main(argv: list[str]) -> int:
    known = modules()
    graph = {module: imported(module, path, known) for module, path in known.items()}
    found, up = cycles(graph), arrows_up(graph)
    if "--edges" in argv:
        for source in sorted(graph):
            for target in sorted(graph[source]):
                print(f"{source} -> {target}")
    for component in found:
        print("cycle: " + " <-> ".join(component))
    for problem in up:
        print(f"arrow up: {problem}")
    edges = sum(len(targets) for targets in graph.values())
    print(f"import graph: {len(graph)} modules, {edges} edges, {len(found)} cycles, {len(up)} arrows up")
    return 1 if found or up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
