"""Code asks a registered thing for what it can do, never for its name: no comparison of a tool, source format,
renderer, tracking backend, rollout backend, estimator or policy loss with one of their registered names outside the
module that registers it (the tools' ``per_role`` / ``launcher`` / ``engine_profiler`` / ``oom_snapshot``, the sources'
``category`` / ``histories`` / ``timeline``, the rollouts' ``reads``, a manifest line's ``engine`` instead)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlprof.analysis.render
import rlprof.tracking
from rlprof.analysis.render.registry import renderer_names
from rlprof.analysis.sources import sources
from rlprof.tools import tool_names
from rlprof.tracking.base import backend_names
from rlprof_train import algos
from rlprof_train.workers.rollout.registry import rollout_names

from conftest import ROOT

HOLDERS = frozenset(
    {
        "tool",
        "tool_name",
        "format",
        "format_name",
        "fmt",
        "renderer",
        "backend",
        "logger",
        "name",
        "rollout_name",
        "adv_estimator",
        "estimator",
        "loss_mode",
        "parse_backends",
    }
)
"""Identifiers that hold a registered name (``file.format``, ``gp.tool``, ``rollout.name``, ...): a comparison of one
with a registered name is a dispatch by name."""


def registered() -> dict[str, str]:
    """Registered name -> what it names."""
    assert rlprof.analysis.render and rlprof.tracking  # the built-in renderers and backends are registered
    import rlprof_train.workers.rollout  # noqa: F401  (registers the built-in rollouts)

    kinds = {
        "tool": tool_names(),
        "source format": [s.format for s in sources()],
        "renderer": renderer_names(),
        "tracking backend": backend_names(),
        "rollout": rollout_names(),
        "estimator": list(algos.ADV_ESTIMATORS),
        "policy loss": list(algos.POLICY_LOSSES),
    }
    return {name: kind for kind, names in kinds.items() for name in names}


def holder(node: ast.expr) -> str | None:
    """The identifier an operand ends in (``run.file.format`` -> format, ``spec(x).launcher`` -> launcher,
    ``block.get("tool")`` and ``block["tool"]`` -> tool)."""
    if isinstance(node, ast.Subscript) and literals(node.slice):
        return literals(node.slice)[0]
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args and literals(node.args[0]):
            return literals(node.args[0])[0]
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def literals(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in literals(element)]
    return []


def dispatches(path: Path, names: dict[str, str], root: Path = ROOT) -> list[str]:
    """``path:line: source`` of each comparison of a name holder with a registered name in the module (but for the
    names the module registers itself)."""
    text = path.read_text()
    own = {name for name in names if re.search(rf"""(register_\w+\(|format = )["']{re.escape(name)}["']""", text)}
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = [s for operand in operands for s in literals(operand) if s in names and s not in own]
        if named and any(holder(operand) in HOLDERS for operand in operands):
            kinds = ", ".join(f"{s!r} is a {names[s]}" for s in named)
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)} ({kinds})")
    return found


def test_nothing_outside_a_registry_dispatches_on_a_registered_name():
    names = registered()
    modules = sorted([*(ROOT / "rlprof").rglob("*.py"), *(ROOT / "rlprof_train").rglob("*.py")])
    found = [line for path in modules for line in dispatches(path, names)]
    assert found == [], "\n".join(found)


def test_the_check_sees_a_dispatch_by_name(tmp_path):
    """The check itself: each form a dispatch by name takes is caught, and the capability forms pass."""
    names = registered()
    module = tmp_path / "m.py"
    module.write_text(
        "a = file.format == 'chrome_trace'\n"
        "b = session.tool_name != 'torch'\n"
        "c = cfg.rollout.name in ('hf', 'other')\n"
        "d = spec.engine_profiler == 'torch'\n"  # a capability's value, not the tool's name
        "e = reader.histories\n"
        "f = profiler.get('tool') == 'torch_memory'\n"
        "g = entry['format'] != 'host_rss'\n"
    )
    found = [line.split(": ", 1)[1] for line in dispatches(module, names, tmp_path)]
    assert [f.rsplit(" (", 1)[0] for f in found] == [
        "file.format == 'chrome_trace'",
        "session.tool_name != 'torch'",
        "cfg.rollout.name in ('hf', 'other')",
        "profiler.get('tool') == 'torch_memory'",
        "entry['format'] != 'host_rss'",
    ], found
