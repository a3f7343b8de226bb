"""CUDA memory snapshots: the caching allocator's alloc/free history over each step window (and, without CUDA or
when ``host_allocations`` is true, the host allocation timeline of :mod:`rlprof.tools.host_alloc`).

Files: ``{save_path}/torch_memory/step{S}[-{E}]/rank{R}_pid{P}.pickle`` (open it at pytorch.org/memory_viz),
plus ``oom_rank{R}_pid{P}_step{N}.pickle`` when CUDA runs out of memory while recording (once per window; the
observer never raises). Each is torch's own snapshot as ``_dump_snapshot`` writes it (every frame recorded kept),
with two additions torch's readers ignore: each rlprof range's start and end in ``external_annotations`` (torch's
own format for ranges: ``{"stage": "START"|"END", "name", "device", "time_us"}``, on the allocator's clock), so
that an allocation made on a thread without the range's metadata (autograd's backward) is owned by the range open
at its time (:mod:`rlprof.analysis.sources.cuda_snapshot`); and ``rlprof.devices``: each device's name and total
memory, which an OOM's analysis needs and torch does not record. Each allocation made inside a range carries
``role/name`` as its user metadata.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from rlprof.tools.base import RangeOps, RangeSite, StepWindowSettings, Tool, ToolContext
from rlprof.tools.host_alloc import HostAllocations
from rlprof.tools.registry import register_tool
from rlprof.typed_config import ConfigError, bounds
from rlprof.window import StepWindow


@dataclass
class TorchMemorySettings(StepWindowSettings):
    """CUDA caching-allocator history over each step window, one snapshot pickle per window per rank."""

    trace_alloc_max_entries: int = field(default=100_000, metadata=bounds(ge=1))
    """Most alloc/free events kept per window (the newest; older ones are dropped and counted)."""
    stack_depth: int = field(default=32, metadata=bounds(ge=0))
    """verl's setting, which torch has no counterpart for: every frame torch records is kept (the reader shows the
    user's innermost ones); 0 records no stacks, which is cheaper."""
    host_allocations: Optional[bool] = None
    """Record the host (CPU) allocation timeline of each window with torch.profiler (``profile_memory``):
    null = where CUDA is absent, true = beside the CUDA snapshots too, false = never (RSS per range only)."""
    oom_snapshot: bool = True
    """Write ``oom_rank{R}_*.pickle`` when CUDA runs out of memory while recording (once per window)."""
    context: Optional[Literal["alloc", "state", "all"]] = "all"
    """torch's ``context``: the stacks each event keeps: ``all`` (allocations and frees), ``alloc`` (allocations
    only), ``state`` (the live blocks' only), null (none; so does ``stack_depth: 0``)."""
    stacks: Literal["python", "all"] = "python"
    """torch's ``stacks``: ``python`` frames (the reader's, and cheaper) or ``all`` (C++ frames too; verl's
    ``enable_memory_visualize`` records all)."""
    kw_args: dict[str, Any] = field(default_factory=dict)
    """verl's key: more keyword arguments of ``torch.cuda.memory._record_memory_history`` (``clear_history``,
    ``compile_context``, ``skip_actions``, ...), passed as given; those set above are refused here."""

    def __post_init__(self) -> None:
        if not self.kw_args:
            return
        import inspect

        import torch

        accepted = set(inspect.signature(torch.cuda.memory._record_memory_history).parameters)
        owned = {"enabled": None, "context": "context", "stacks": "stacks", "max_entries": "trace_alloc_max_entries"}
        for key in self.kw_args:
            if key in owned:
                raise ConfigError(
                    f"global_profiler.global_tool_config.torch_memory.kw_args.{key}: set by rlprof"
                    + (f"; use torch_memory.{owned[key]}" if owned[key] else " (the window starts and stops it)")
                )
            if key not in accepted:
                allowed = ", ".join(sorted(accepted - set(owned)))
                raise ConfigError(
                    f"global_profiler.global_tool_config.torch_memory.kw_args.{key}: not an argument of this torch's "
                    f"_record_memory_history; allowed: {allowed}"
                )


@register_tool("torch_memory", config=TorchMemorySettings, oom_snapshot=True)
def torch_memory_tool(context: ToolContext) -> Tool:
    """CUDA snapshots where CUDA memory history exists; host memory per range otherwise (said once)."""
    reason = cuda_memory_unavailable_reason()
    host = context.settings.host_allocations
    if reason is None:
        return CudaMemoryTool(context, host_allocations=bool(host))
    from rlprof.tools.host_memory import HostMemoryTool

    recorded = "the host allocation timeline and RSS" if host is not False else "RSS"
    context.warn(
        "torch_memory:host",
        f"rlprof: torch_memory: {reason}, so no CUDA memory snapshot is written; recording {recorded} per range "
        f"to {context.save_path}/torch_memory/step*/ instead",
    )
    return HostMemoryTool(context, host_allocations=host is not False)


class CudaMemoryTool(Tool):
    """Records allocator history on the selected ranks, only inside step windows."""

    def __init__(self, context: ToolContext, host_allocations: bool = False) -> None:
        super().__init__(context)
        self.settings = context.settings
        self.host = HostAllocations(context) if host_allocations else None
        self.recording = False
        self.window: Optional[StepWindow] = None
        self._oom_written = False
        self._previous = threading.local()
        self._annotations: list[dict[str, Any]] = []
        """The window's range starts and ends, in torch's ``external_annotations`` format."""

    def start_window(self, window: StepWindow) -> None:
        import torch

        torch.cuda.memory._record_memory_history(
            "all",
            context=self.settings.context if self.settings.stack_depth else None,
            stacks=self.settings.stacks,
            max_entries=self.settings.trace_alloc_max_entries,
            **self.settings.kw_args,
        )
        self.recording = True
        self._annotations = []
        if self.host is not None:
            self.host.start_window(window)
        self.window = window
        self._oom_written = False
        if self.settings.oom_snapshot:
            _watch_oom(self)

    def stop_window(self, window: StepWindow) -> None:
        import torch

        try:
            if self.host is not None:
                self.host.stop_window(window, self.name)
            final = self.context.window_dir(self.name, window) / f"rank{self.context.rank}_pid{os.getpid()}.pickle"
            self._write_snapshot(final, window)
        finally:
            self.recording = False
            self.window = None
            _watch_oom(None)
            torch.cuda.memory._record_memory_history(None)

    def _write_snapshot(self, final: Path, window: StepWindow, **extra: Any) -> Path:
        import torch

        tmp = self.context.temp_path(final)
        try:
            snapshot = torch.cuda.memory._snapshot()
            ranges = sorted(self._annotations, key=lambda mark: mark["time_us"])
            snapshot["external_annotations"] = [*snapshot.get("external_annotations", []), *ranges]
            snapshot["rlprof"] = {"devices": _devices(torch)}
            with tmp.open("wb") as handle:
                pickle.dump(snapshot, handle)
            return self.context.publish(self.name, tmp, final, window, format="cuda_snapshot", **extra)
        finally:
            if tmp.exists():
                tmp.unlink()

    def range_ops(self, site: RangeSite) -> RangeOps:
        import torch

        memory, label, local, host = torch.cuda.memory, site.label, self._previous, self.host
        marks, device = self._annotations, torch.cuda.current_device()

        def enter() -> None:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(memory._get_memory_metadata())
            memory._set_memory_metadata(label)
            marks.append({"stage": "START", "name": label, "device": device, "time_us": time.time_ns() // 1000})
            if host is not None:
                host.recorder.enter(label)

        def exit_() -> None:
            if host is not None:
                host.recorder.exit()
            marks.append({"stage": "END", "name": label, "device": device, "time_us": time.time_ns() // 1000})
            memory._set_memory_metadata(local.stack.pop())

        return enter, exit_

    def close(self) -> None:
        if self.host is not None:
            self.host.recorder.abandon()
        if self.recording:  # turned off mid-window: stop recording, write nothing
            import torch

            self.recording = False
            _watch_oom(None)
            torch.cuda.memory._record_memory_history(None)

    def write_oom_snapshot(self) -> None:
        """Called by the OOM observer: one ``oom_rank{R}_pid{P}_step{N}.pickle`` per window."""
        if not self.recording or self._oom_written or self.window is None:
            return
        self._oom_written = True
        folder = self.context.save_path / self.name
        folder.mkdir(parents=True, exist_ok=True)
        name = f"oom_rank{self.context.rank}_pid{os.getpid()}_step{self.window.last}.pickle"
        self._write_snapshot(folder / name, self.window, oom=True)


def _devices(torch: Any) -> dict[int, dict[str, Any]]:
    """Each visible device's name and total memory (bytes)."""
    found = {}
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        found[index] = {"name": properties.name, "total_memory": int(properties.total_memory)}
    return found


_oom_tool: Optional[CudaMemoryTool] = None
_oom_observer_attached = False


def _watch_oom(tool: Optional[CudaMemoryTool]) -> None:
    """Point the process's one OOM observer at ``tool`` (None: ignore OOMs). torch cannot detach observers."""
    global _oom_tool, _oom_observer_attached
    _oom_tool = tool
    if tool is not None and not _oom_observer_attached:
        import torch

        torch._C._cuda_attach_out_of_memory_observer(_on_oom)  # type: ignore[attr-defined]  # exists in CUDA builds
        _oom_observer_attached = True


def _on_oom(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    """Runs inside the CUDA allocator when an allocation fails: it must never raise."""
    try:
        if _oom_tool is not None:
            _oom_tool.write_oom_snapshot()
    except Exception as exc:
        warnings.warn(f"rlprof torch_memory: could not write the OOM snapshot: {exc}", RuntimeWarning, stacklevel=1)


def cuda_memory_unavailable_reason() -> Optional[str]:
    """Why CUDA memory history cannot be recorded here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not hasattr(torch.cuda.memory, "_record_memory_history"):
        return f"torch {torch.__version__} has no CUDA memory history"
    return None
