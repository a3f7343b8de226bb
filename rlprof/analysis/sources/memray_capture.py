"""memray captures (``global_profiler.tool=memray``, or any file memray wrote) read with memray's own reader into
:class:`~rlprof.analysis.allocations.AllocationHistory`: every allocation and free of the capture in memray's order
(event positions, no times), so its peak, what was alive at the peak and at the end come from the same replay as
every other memory file (:func:`~rlprof.analysis.allocations.summarize`); the peak equals memray's own (``memray
stats``: the same records).

**Sites** are the Python frames memray recorded with each allocation, the user's innermost first, shown as the other
memory files show theirs; an allocation made with no Python frame (a native thread's) says so.

**Ranges.** rlprof's memray tool writes ``<capture>.ranges.json`` beside each capture: the order of its range marks,
each a small allocation made by :func:`rlprof.tools.memray.range_mark` at a range's start or end. Read in memray's
order, the marks say which ranges are open on each thread: an allocation belongs to the innermost range open on its
own thread; one with no Python frame on a thread without ranges (a native worker: torch's, a tokenizer's) to the
innermost one of the thread that last opened or closed a range (the training thread, which it works for); one of a
Python thread without ranges (a watchdog) to none. A capture without that file (one memray wrote for another
program) has no ranges.

Bounded: memray's reader parses the file (it runs no code of the file's); at most :data:`MAX_EVENTS` records are
kept, the rest counted as dropped (the page says so).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.allocations import Allocation, AllocationHistory, AllocEvent
from rlprof.analysis.sources.base import InputFile, ReadOptions, Source, SourceError
from rlprof.analysis.sources.cuda_snapshot import Sites
from rlprof.analysis.sources.host_memory import MAX_EVENTS

LZ4_MAGIC = b"\x04\x22\x4d\x18"
NO_PYTHON_FRAME = "(no Python frame: a native thread's allocation)"
MARK_FUNCTION = ("range_mark", "rlprof/tools/memray.py")
"""The function that makes a range mark, and the end of its file's path."""
RANGES_SUFFIX = ".ranges.json"
MAX_RANGES_FILE = 64 << 20
"""The marks file is read only up to this size (a longer one is not rlprof's)."""


def marks_of(capture: Path) -> tuple[list[tuple[str, int]], Optional[int]]:
    """(label, 0 start | 1 end) of each range mark of ``capture``, and the marks' allocation size; ``([], None)``
    without a marks file or with one that does not read as rlprof's."""
    path = capture.with_suffix(RANGES_SUFFIX)
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_RANGES_FILE:
            return [], None
        data = json.loads(path.read_text(encoding="utf-8"))
        marks = [(str(label), int(stage)) for label, stage in data["marks"]]
        return marks, int(data["mark_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return [], None


def memray_history(path: Path) -> AllocationHistory:
    """The allocations and frees of the capture at ``path`` in memray's order (see the module doc)."""
    try:
        import memray
    except ImportError:
        raise SourceError(f"{path}: a memray capture; reading it needs memray (pip install memray)") from None
    reading = _Reading(*marks_of(path), memray.AllocatorType)
    try:
        for record in memray.FileReader(str(path)).get_allocation_records():
            if len(reading.raw) < MAX_EVENTS:
                reading.add(record)
            else:
                reading.dropped += 1
    except (OSError, RuntimeError, ValueError) as exc:
        raise SourceError(f"{path}: memray cannot read it ({exc})") from None
    notes = [f"memray's flame graph of the same capture: memray flamegraph {path}"]
    if not reading.marks:
        notes.append(f"no {path.with_suffix(RANGES_SUFFIX).name} beside it: no rlprof ranges")
    return reading.history(str(path), notes)


class _Reading:
    """One pass over a capture's records, in order: what is alive, which ranges are open on which thread."""

    def __init__(self, marks: list[tuple[str, int]], mark_bytes: Optional[int], allocator: Any) -> None:
        self.marks, self.mark_bytes, self.marked = marks, mark_bytes, 0
        self.frees = {allocator.FREE, allocator.PYMALLOC_FREE}
        self.munmap = allocator.MUNMAP
        self.stacks: dict[int, list[dict[str, Any]]] = {}
        self.raw: list[tuple[str, int, int, int, str]] = []
        """(action, address, size, stack id, range) of each event."""
        self.live: dict[int, tuple[int, int, str]] = {}
        """address -> (size, stack id, range) of what is alive."""
        self.open_ranges: dict[int, list[str]] = defaultdict(list)
        self.leading_thread: Optional[int] = None
        self.dropped = 0

    def add(self, record: Any) -> None:
        address, size = record.address, record.size
        if record.allocator in self.frees or record.allocator == self.munmap:
            held = self.live.pop(address, None)
            if held is None:  # allocated before the capture started: not in memray's count either
                return
            freed = min(size, held[0]) if record.allocator == self.munmap else held[0]
            self.raw.append(("free", address, freed, held[1], held[2]))
            if freed < held[0]:  # a mapping unmapped from its start: the rest stays, further on
                self.live[address + freed] = (held[0] - freed, held[1], held[2])
            return
        stack_id = record.stack_id
        if stack_id not in self.stacks:
            self.stacks[stack_id] = [{"name": f, "filename": file, "line": at} for f, file, at in record.stack_trace()]
        if size == self.mark_bytes and self.marked < len(self.marks) and _is_mark(self.stacks[stack_id]):
            self._mark(record.tid)
        own = self.open_ranges.get(record.tid)
        lead = self.open_ranges.get(self.leading_thread) if self.leading_thread is not None else None
        frameless = not self.stacks[stack_id]  # a native thread working for the training thread
        tag = own[-1] if own else lead[-1] if lead and frameless else ""
        self.live[address] = (size, stack_id, tag)
        self.raw.append(("alloc", address, size, stack_id, tag))

    def _mark(self, thread: int) -> None:
        """The next mark: a range opened or closed on ``thread``."""
        label, stage = self.marks[self.marked]
        self.marked += 1
        ranges = self.open_ranges[thread]
        if stage == 0:
            ranges.append(label)
        elif label in ranges:
            del ranges[len(ranges) - 1 - ranges[::-1].index(label)]
        self.leading_thread = thread

    def history(self, source: str, notes: list[str]) -> AllocationHistory:
        sites = Sites(self.stacks.values(), standard_library=True)
        site_of = {key: sites.site(frames) if frames else NO_PYTHON_FRAME for key, frames in self.stacks.items()}
        events = [
            AllocEvent(float(index), action, address, Allocation(size, site_of[stack_id], tag))
            for index, (action, address, size, stack_id, tag) in enumerate(self.raw)
        ]
        return AllocationHistory(source, "host (memray)", {}, events, dropped=self.dropped, timed=False, notes=notes)


def _is_mark(frames: list[dict[str, Any]]) -> bool:
    return bool(frames) and frames[0]["name"] == MARK_FUNCTION[0] and frames[0]["filename"].endswith(MARK_FUNCTION[1])


class MemraySource(Source):
    format = "memray"
    category = "memory"
    histories = True
    windows_compose = True
    description = "memray capture"

    def claims(self, path: Path, head: bytes) -> bool:
        return head.startswith(b"memray") or (head.startswith(LZ4_MAGIC) and b"memray" in head[:64])

    def read(self, file: InputFile, options: ReadOptions) -> list[AllocationHistory]:
        return [memray_history(file.path)]
