"""CUDA memory snapshots: the caching allocator's alloc/free history over each step window.

Files: ``{save_path}/torch_memory/step{S}[-{E}]/rank{R}_pid{P}.pickle`` (open it at pytorch.org/memory_viz),
plus ``oom_rank{R}_pid{P}_step{N}.pickle`` when CUDA runs out of memory while recording (once per window; the
observer never raises). Each allocation made inside a range carries ``role/name`` as its user metadata, and
recorded stacks are cut to ``stack_depth`` frames.
"""

from __future__ import annotations

import functools
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rlprof.tools.base import RangeSite, Tool, ToolContext


def trim_stacks(snapshot: dict[str, Any], depth: int) -> dict[str, Any]:
    """Cut every ``frames`` list of a ``torch.cuda.memory._snapshot()`` to its innermost ``depth`` frames (in place)."""
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if "frames" in block:
                block["frames"] = block["frames"][:depth]
    for device_trace in snapshot.get("device_traces", []):
        for entry in device_trace:
            if "frames" in entry:
                entry["frames"] = entry["frames"][:depth]
    return snapshot


class CudaMemoryTool(Tool):
    """Records allocator history on the selected ranks, only inside step windows."""

    name = "torch_memory"

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        self.settings = context.config.global_profiler.global_tool_config.torch_memory
        self.recording = False
        self._oom_written = False

    def start_window(self, step: int) -> None:
        super().start_window(step)
        torch.cuda.memory._record_memory_history(
            "all", context="all", stacks="python", max_entries=self.settings.trace_alloc_max_entries
        )
        self.recording = True
        self._oom_written = False
        if self.settings.oom_snapshot:
            _watch_oom(self)

    def stop_window(self) -> None:
        try:
            folder = self.window_dir()
            folder.mkdir(parents=True, exist_ok=True)
            name = f"rank{self.context.rank}_pid{os.getpid()}.pickle"
            self._write_snapshot(folder / f".{name}.tmp", folder / name)
        finally:
            self.recording = False
            _watch_oom(None)
            torch.cuda.memory._record_memory_history(None)
            super().stop_window()

    def _write_snapshot(self, tmp: Path, final: Path) -> Path:
        snapshot = trim_stacks(torch.cuda.memory._snapshot(), self.settings.stack_depth)
        with tmp.open("wb") as handle:
            pickle.dump(snapshot, handle)
        return self.publish(tmp, final)

    def enter_range(self, site: RangeSite) -> Callable[[], Any]:
        previous = torch.cuda.memory._get_memory_metadata()
        torch.cuda.memory._set_memory_metadata(site.label)
        return functools.partial(torch.cuda.memory._set_memory_metadata, previous)

    def close(self) -> None:
        if self.recording:  # turned off mid-window: stop recording, write nothing
            self.recording = False
            _watch_oom(None)
            torch.cuda.memory._record_memory_history(None)

    def write_oom_snapshot(self) -> None:
        """Called by the OOM observer: one ``oom_rank{R}_pid{P}_step{N}.pickle`` per window."""
        if not self.recording or self._oom_written:
            return
        self._oom_written = True
        folder = self.context.save_path / self.name
        folder.mkdir(parents=True, exist_ok=True)
        name = f"oom_rank{self.context.rank}_pid{os.getpid()}_step{self.window_last}.pickle"
        self._write_snapshot(folder / f".{name}.tmp", folder / name)


_oom_tool: Optional[CudaMemoryTool] = None
_oom_observer_attached = False


def _watch_oom(tool: Optional[CudaMemoryTool]) -> None:
    """Point the process's one OOM observer at ``tool`` (None: ignore OOMs). torch cannot detach observers."""
    global _oom_tool, _oom_observer_attached
    _oom_tool = tool
    if tool is not None and not _oom_observer_attached:
        torch._C._cuda_attach_out_of_memory_observer(_on_oom)
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
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not hasattr(torch.cuda.memory, "_record_memory_history"):
        return f"torch {torch.__version__} has no CUDA memory history"
    return None
