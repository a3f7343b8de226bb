"""Recording tools behind one interface (:class:`rlprof.tools.base.Tool`), created by name from the registry.

The built-in tools register themselves here: ``nsys``, ``torch``, ``torch_memory`` and ``range_times`` (none imports
torch or nvtx before it is started).
"""

from rlprof.tools import memray, nsys, range_times, torch_memory, torch_profiler  # noqa: F401  (registers the built-in tools)
from rlprof.tools.base import RangeOps, RangeSite, StepWindowSettings, Tool, ToolContext
from rlprof.tools.registry import ToolSpec, create_tool, register_tool, tool_names, tool_spec, tool_specs

__all__ = [
    "RangeOps",
    "RangeSite",
    "StepWindowSettings",
    "Tool",
    "ToolContext",
    "ToolSpec",
    "create_tool",
    "register_tool",
    "tool_names",
    "tool_spec",
    "tool_specs",
]
