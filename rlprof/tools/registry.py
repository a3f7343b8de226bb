"""The one registry of recording tools: a name, a settings dataclass and a factory per tool.

::

    @rlprof.register_tool("mytool", config=MyToolSettings)
    class MyTool(rlprof.Tool):
        def range_ops(self, site): ...

The name becomes a valid ``global_profiler.tool``, the settings dataclass the schema of
``global_profiler.global_tool_config.mytool`` (checked like every other block), and the class (or any function
``(ToolContext) -> Tool``) is what the session starts. Nothing else in rlprof lists tool names: code that depends
on what the running tool does asks its spec (:func:`tool_spec`) for the capability, never for its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional, TypeVar

from rlprof.roles import RoleBlocks
from rlprof.tools.base import NoSettings, Tool, ToolContext
from rlprof.typed_config import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    config: type
    """Dataclass of the tool's settings (``global_profiler.global_tool_config.<name>``)."""
    factory: Callable[[ToolContext], Tool]
    per_role: tuple[str, ...] = ()
    """Settings a role's ``profiler.tool_config.<name>`` may set apart from the global block (nsys: ``discrete``);
    every other one must equal the global value, as one profiler runs per process."""
    launcher: Optional[str] = None
    """The program the training process must run under for the tool to record (nsys: ``nsys``, which ``rlprof
    nsys`` launches); None: it records in-process."""
    engine_profiler: Optional[str] = None
    """The profiler an inference engine beside the trainer runs on its own side while the tool records the rollout
    (torch: vLLM's torch profiler, same contents); None: the engine records nothing."""
    oom_snapshot: bool = False
    """It writes a CUDA memory snapshot when the process runs out of device memory (the OOM line names it)."""
    check: Optional[Callable[[Any, RoleBlocks], list[str]]] = None
    """``(settings, role blocks) -> problems``: what the settings' schema cannot check (settings that must agree
    across roles, one process running one profiler), each problem one line naming its key."""


_TOOLS: dict[str, ToolSpec] = {}


def register_tool(
    name: str,
    *,
    config: type = NoSettings,
    per_role: tuple[str, ...] = (),
    launcher: Optional[str] = None,
    engine_profiler: Optional[str] = None,
    oom_snapshot: bool = False,
    check: Optional[Callable[[Any, RoleBlocks], list[str]]] = None,
) -> Callable[[T], T]:
    """Register a :class:`Tool` subclass (or a factory ``(ToolContext) -> Tool``) under ``name``, with what it can
    do (see :class:`ToolSpec`)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_tool: name={name!r} must be an identifier such as 'nsys' or 'my_tool'")
    if not (isinstance(config, type) and is_dataclass(config)):
        raise TypeError(f"register_tool({name!r}): config={config!r} must be a dataclass of the tool's settings")
    unknown = sorted(set(per_role) - {f.name for f in fields(config)})
    if unknown:
        raise ValueError(f"register_tool({name!r}): per_role={unknown} are not fields of {config.__name__}")

    def register(factory: T) -> T:
        if not callable(factory):
            raise TypeError(f"register_tool({name!r}): {factory!r} is neither a Tool class nor a factory function")
        if isinstance(factory, type):
            if not issubclass(factory, Tool):
                raise TypeError(f"register_tool({name!r}): {factory.__name__} does not subclass rlprof.Tool")
            factory.name = name
        _TOOLS[name] = ToolSpec(name, config, factory, tuple(per_role), launcher, engine_profiler, oom_snapshot, check)
        return factory

    return register


def tool_specs() -> list[ToolSpec]:
    return list(_TOOLS.values())


def tool_names() -> list[str]:
    return sorted(_TOOLS)


def tool_spec(name: str) -> ToolSpec:
    try:
        return _TOOLS[name]
    except KeyError:
        raise ConfigError(
            f"global_profiler.tool: {name!r} is not a registered tool; choose one of: {', '.join(tool_names())}"
        ) from None


def create_tool(name: str, context: ToolContext) -> Tool:
    """Start the tool registered as ``name``; the instance's ``name`` is the registered one."""
    tool = tool_spec(name).factory(context)
    tool.name = name  # type: ignore[misc]  # a factory function's tool takes the registered name too
    return tool
