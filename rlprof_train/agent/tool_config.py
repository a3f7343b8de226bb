"""verl's tool config (``multi_turn.tool_config_path``), read into :class:`~rlprof_train.agent.tool.Tool` objects::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool     # a dotted class name
        config: {type: native}                          # handed to the class
        tool_schema:                                    # OpenAI function format; its name is what the policy calls
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}

verl's own class names of the tools built in here (``verl.tools.gsm8k_tool.Gsm8kTool``) load the built-in
equivalent; any other dotted name is imported (your module on ``PYTHONPATH``, a subclass of
:class:`~rlprof_train.agent.tool.Tool`). Every problem of the file is named in one error, before any work starts.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import yaml

from rlprof_train.agent.builtin import CALCULATOR_SCHEMA, CalculatorTool, Gsm8kTool
from rlprof_train.agent.tool import Tool

BUILTIN_CLASSES: dict[str, type[Tool]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
    "rlprof_train.agent.builtin.Gsm8kTool": Gsm8kTool,
    "rlprof_train.agent.builtin.CalculatorTool": CalculatorTool,
}
"""Class names that load a built-in tool (verl's name of the same tool included)."""
SETTING = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
MAX_FILE_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


TASK_TOOLS = {"calculator": "rlprof_train.agent.builtin.CalculatorTool"}
"""Built-in tasks that come with their tool, offered when no tool config is given."""


def task_tools(task: str) -> list[Tool]:
    """The tool a built-in task comes with (the ``calculator`` task: the calculator), or none."""
    if task not in TASK_TOOLS:
        return []
    return [BUILTIN_CLASSES[TASK_TOOLS[task]]({}, CALCULATOR_SCHEMA)]


def load_tools(path: str) -> list[Tool]:
    """The tools of the config file at ``path``, created; a ValueError listing every problem otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{SETTING}={path!r}: no such file")
    if file.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{SETTING}={path!r}: {file.stat().st_size} bytes, more than a tool config's {MAX_FILE_BYTES}")
    try:
        document = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{SETTING}={path!r} is not YAML: {str(exc).splitlines()[0]}") from None
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{SETTING}={path!r}: expected a 'tools:' list of class_name, config and tool_schema")
    problems: list[str] = []
    tools: list[Tool] = []
    for index, entry in enumerate(entries):
        where = f"tools[{index}]"
        try:
            tools.append(_create(entry, where))
        except ValueError as exc:
            problems.append(str(exc))
    names = [tool.name for tool in tools]
    problems += [f"two tools are named {name!r}" for name in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ValueError(f"{SETTING}={path!r}: " + "; ".join(problems))
    return tools


def _create(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a mapping of class_name, config and tool_schema")
    class_name, config, schema = entry.get("class_name"), entry.get("config") or {}, entry.get("tool_schema")
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"{where}.class_name is missing")
    if not isinstance(config, dict):
        raise ValueError(f"{where}.config must be a mapping, not {config!r:.60}")
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) or schema.get("type") != "function":
        raise ValueError(f"{where}.tool_schema must be an OpenAI function schema (type: function, function: {{...}})")
    function = schema["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}.tool_schema.function.name={name!r} is not a name (letters, digits, _ . -)")
    if not isinstance(function.get("parameters", {}), dict):
        raise ValueError(f"{where}.tool_schema.function.parameters must be a JSON schema object")
    cls = _resolve(class_name, where)
    try:
        return cls(dict(config), schema)
    except Exception as exc:  # the user's class: say which one failed and how
        raise ValueError(f"{where}: {class_name}(config, tool_schema) raised {type(exc).__name__}: {exc}") from exc


def _resolve(class_name: str, where: str) -> type[Tool]:
    if class_name in BUILTIN_CLASSES:
        return BUILTIN_CLASSES[class_name]
    module_name, _, attribute = class_name.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}.class_name={class_name!r} is not a dotted module.Class name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        known = ", ".join(sorted(BUILTIN_CLASSES))
        raise ValueError(
            f"{where}.class_name={class_name!r}: module {module_name} does not import ({type(exc).__name__}: {exc}); "
            f"built in: {known}"
        ) from None
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type) or not issubclass(cls, Tool):
        raise ValueError(
            f"{where}.class_name={class_name!r} is not a subclass of rlprof_train.agent.Tool (verl's lifecycle: "
            "create, execute, calc_reward, release)"
        )
    return cls
