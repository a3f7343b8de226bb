"""verl's own functions, taken from its published source files kept in tests/data/verl (Apache-2.0, see
SOURCES.tsv): each function's code alone, without its registration decorator or the imports of the rest of verl,
run in a namespace that gives it what it uses. The peer computation of the tests that compare with verl."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any


def verl_functions(source: Path, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The functions ``names`` of ``source``, defined in one copy of ``namespace`` (so that they call each other)."""
    tree = ast.parse(source.read_text())
    nodes = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in nodes}
    assert not missing, f"{source} has no function {sorted(missing)}"
    for node in nodes:
        node.decorator_list = []
    defined = dict(namespace)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(source), "exec"), defined)
    return {name: defined[name] for name in names}
