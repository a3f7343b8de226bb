"""Host memory with memray (Bloomberg's memory profiler; verl's ``global_profiler.tool=memray``): every native and
Python allocation of the process with its stack, over the selected steps.

Files, as verl lays them out: ``{save_path}/step{S}/memray_rank{R}_pid{P}.bin`` for a capture of one step,
``{save_path}/steps{S}-{E}/...`` for several (``memory_snapshot_num_steps`` selected steps a capture, verl's key;
a capture stays open across windows until it holds them). Each is memray's own file: ``memray stats``,
``memray flamegraph`` and ``rlprof memory`` read it. The capture is written under a hidden name and moved into place
when it is complete, then listed in the manifest.

rlprof's ranges in a capture: memray records no annotations, so each range's start and end is recorded as a small
allocation made (and freed at once) by :func:`range_mark`, a function of this module: in memray's ordered record of
allocations, the marks say which range was open on which thread when each allocation was made
(:mod:`rlprof.analysis.sources.memray_capture`). A mark is a few kilobytes for a few microseconds, in the file as any
allocation.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlprof.tools.base import RangeOps, RangeSite, Tool, ToolContext
from rlprof.tools.registry import register_tool
from rlprof.typed_config import bounds
from rlprof.window import StepWindow

MARK_BYTES = 4093
"""A range mark's buffer: ``bytearray(MARK_BYTES)`` is one ``malloc`` of ``MARK_BYTES + 1`` bytes (above pymalloc's
512, so memray sees it), recognised by its size and by :func:`range_mark` on its stack."""
START, END = 0, 1


@dataclass
class MemraySettings:
    """memray's recording (verl's ``MemrayToolConfig``)."""

    memory_snapshot_num_steps: int = field(default=1, metadata=bounds(ge=1))
    """Selected steps recorded into one capture (verl's key; a capture of several is ``steps{S}-{E}``)."""
    native_traces: bool = True
    """Record native (C/C++) frames beside the Python ones, as verl does (``memray flamegraph`` shows them)."""


def on_helper_thread(call: Callable[[], Any]) -> None:
    """Run ``call`` (memray's start or stop) on a thread of its own and wait for it. memray captures the Python
    stacks of the threads other than the one that starts it as they are; started from the training thread inside a
    call that then returns (the session's step), the frames that return go missing from every later stack (seen with
    memray 1.20: an allocation in ``f`` called by ``main`` showed neither)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="rlprof-memray")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def range_mark() -> None:
    """One mark in memray's record: a buffer allocated and freed (see the module doc)."""
    bytearray(MARK_BYTES)


class MemrayTool(Tool):
    """One memray capture per ``memory_snapshot_num_steps`` selected steps."""

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        import memray

        self.memray = memray
        self.settings: MemraySettings = context.settings
        self.name_on_disk = f"memray_rank{context.rank}_pid{os.getpid()}.bin"
        self.tracker: Any = None
        self.staging: Optional[Path] = None
        self.first = self.last = self.steps = self.index = 0
        self.marks: list[tuple[str, int]] = []
        """(range label, START or END) of each mark of the open capture, in order."""
        self.lock = threading.Lock()
        """A mark and its entry are made together, so that threads' marks keep their order."""

    def start_window(self, window: StepWindow) -> None:
        if self.tracker is None:
            self.staging = self.context.temp_path(self.context.save_path / self.name_on_disk)
            self.staging.unlink(missing_ok=True)
            tracker = self.memray.Tracker(str(self.staging), native_traces=self.settings.native_traces)
            on_helper_thread(tracker.__enter__)
            self.tracker, self.first, self.steps = tracker, window.first, 0
        self.last, self.index = window.last, window.index

    def advance(self, window: StepWindow) -> None:
        self.last = window.last

    def stop_window(self, window: StepWindow) -> None:
        self.last = window.last
        self.steps += len(window.steps)
        if self.steps >= self.settings.memory_snapshot_num_steps:
            self._publish()

    def _publish(self) -> None:
        """End the open capture and move it, with its ranges' marks, into its window's folder."""
        with self.lock:
            tracker, staging, self.tracker = self.tracker, self.staging, None
            marks, self.marks[:] = list(self.marks), []
        if tracker is None or staging is None:
            return
        on_helper_thread(lambda: tracker.__exit__(None, None, None))
        folder = f"step{self.first}" if self.first == self.last else f"steps{self.first}-{self.last}"
        final = self.context.save_path / folder / self.name_on_disk
        final.parent.mkdir(parents=True, exist_ok=True)
        window = StepWindow(self.index, self.first, self.last)
        ranges, ranges_tmp = (
            final.with_suffix(".ranges.json"),
            self.context.temp_path(final.with_suffix(".ranges.json")),
        )
        ranges_tmp.write_text(json.dumps({"mark_bytes": MARK_BYTES + 1, "marks": marks}), encoding="utf-8")
        self.context.publish("memray", ranges_tmp, ranges, window, format="memray_ranges")
        self.context.publish("memray", staging, final, window, format="memray")

    def range_ops(self, site: RangeSite) -> RangeOps:
        label, marks, lock = site.label, self.marks, self.lock

        def enter() -> None:
            if self.tracker is not None:
                with lock:
                    marks.append((label, START))
                    range_mark()

        def exit_() -> None:
            if self.tracker is not None:
                with lock:
                    marks.append((label, END))
                    range_mark()

        return enter, exit_

    def close(self) -> None:
        self._publish()


register_tool("memray", config=MemraySettings)(MemrayTool)
