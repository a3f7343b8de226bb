"""Recording tools behind one interface (:class:`rlprof.tools.base.Tool`), created by name."""

from __future__ import annotations

from typing import Optional

from rlprof.tools.base import RangeSite, Tool, ToolContext

__all__ = ["RangeSite", "Tool", "ToolContext", "create_tool"]


def create_tool(name: str, context: ToolContext) -> tuple[Tool, Optional[str]]:
    """The tool called ``name`` and, when it had to fall back to a lesser recorder, a note saying why."""
    if name == "nsys":
        from rlprof.tools.nsys import NsysTool

        return NsysTool(context), None
    if name == "torch":
        from rlprof.tools.torch_profiler import TorchProfilerTool

        return TorchProfilerTool(context), None
    if name == "torch_memory":
        from rlprof.tools.torch_memory import CudaMemoryTool, cuda_memory_unavailable_reason

        reason = cuda_memory_unavailable_reason()
        if reason is None:
            return CudaMemoryTool(context), None
        from rlprof.tools.host_memory import HostMemoryTool

        note = (
            f"torch_memory: {reason}, so no CUDA memory snapshot is written; recording host memory (RSS before, "
            f"after and peak of each range) to {context.save_path}/torch_memory/step*/*.host_memory.jsonl instead"
        )
        return HostMemoryTool(context), note
    raise ValueError(f"unknown tool {name!r}")
