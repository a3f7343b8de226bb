"""The torch_memory tool where CUDA is absent: host memory per range instead of allocator snapshots, and (unless
``host_allocations: false``) the host allocation timeline of :mod:`rlprof.tools.host_alloc`.

File: ``{save_path}/torch_memory/step{S}[-{E}]/rank{R}_pid{P}.host_memory.jsonl``, one line per closed range
(``role``, ``name``, ``step``, ``rss_before``, ``rss_after``, ``peak_rss``, in bytes) and one summary line per role
(``"kind": "role_summary"``). The peak is the true high-water mark inside the range: Linux's ``VmHWM`` is reset
at each range start (``/proc/self/clear_refs``), and the mark reached so far is first folded into every range
still open, so nested ranges keep correct peaks. Where the reset is not allowed, ``peak_rss`` is the process's
lifetime peak and each line says ``"peak_scope": "process"``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any, Optional

from rlprof.tools.base import RangeOps, RangeSite, Tool, ToolContext
from rlprof.tools.host_alloc import HostAllocations
from rlprof.window import StepWindow

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def read_rss() -> tuple[int, int]:
    """(current RSS, high-water mark RSS) of this process in bytes, from one ``pread`` of ``/proc/self/status``.

    Every range enter and exit reads it; read line by line (an ``open``, a ``startswith`` per line) under torch's
    Python tracer, those reads made each torch_memory window keep native memory (issue 27's growth: +12.6 MiB over
    150 windows in the soak loop, +7.2 with one ``pread``, +5.6 with no read at all)."""
    global _status
    try:
        with _status_lock:
            pid, fd = _status
            if pid != os.getpid():  # first use, or a forked child: /proc/self is resolved when opened
                fd = os.open(_STATUS, os.O_RDONLY | os.O_CLOEXEC)
                _status = (os.getpid(), fd)
        data = os.pread(fd, 16384, 0)
        rss, hwm = _kib(data, b"VmRSS:"), _kib(data, b"VmHWM:")
        return rss, max(hwm, rss)
    except (OSError, ValueError, IndexError):
        import psutil

        rss = psutil.Process().memory_info().rss
        return rss, rss


_status: tuple[int, int] = (0, -1)
"""(pid, descriptor) of ``/proc/self/status`` as opened by that process."""
_status_lock = threading.Lock()


def _kib(status: bytes, key: bytes) -> int:
    """The ``key`` line's value of a ``/proc/*/status`` text, in bytes (0 where the line is absent)."""
    at = status.find(key)
    if at < 0:
        return 0
    end = status.find(b"\n", at)
    return int(status[at + len(key) : end if end >= 0 else None].split()[0]) * 1024


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where that is not allowed."""
    try:
        with open(_CLEAR_REFS, "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class _OpenRange:
    """A range being measured; compared by identity (two ranges of one site with equal numbers stay distinct)."""

    __slots__ = ("peak", "rss_before", "site", "step")

    def __init__(self, site: RangeSite, step: Optional[int], rss_before: int) -> None:
        self.site = site
        self.step = step
        self.rss_before = rss_before
        self.peak = rss_before


class HostMemoryTool(Tool):
    """Measures RSS before, after and at peak for every range of an enabled role inside the window."""

    def __init__(self, context: ToolContext, host_allocations: bool = True) -> None:
        super().__init__(context)
        self.host = HostAllocations(context) if host_allocations else None
        self._lock = threading.Lock()
        self._open: dict[int, _OpenRange] = {}  # by id(): every thread's open ranges, for nested peaks
        self._stacks = threading.local()
        self._records: list[dict[str, Any]] = []
        self._step: Optional[int] = None
        self._peak_scope = "range" if reset_peak() else "process"

    def start_window(self, window: StepWindow) -> None:
        self._step = window.first
        if self.host is not None:
            self.host.start_window(window)

    def advance(self, window: StepWindow) -> None:
        self._step = window.last

    def range_ops(self, site: RangeSite) -> RangeOps:
        if self.host is None:
            return functools.partial(self._enter, site), self._exit
        recorder, label = self.host.recorder, site.label

        def enter() -> None:
            self._enter(site)
            recorder.enter(label)

        def exit_() -> None:
            recorder.exit()
            self._exit()

        return enter, exit_

    def _enter(self, site: RangeSite) -> None:
        with self._lock:
            rss, hwm = read_rss()
            for other in self._open.values():
                other.peak = max(other.peak, hwm)
            if self._peak_scope == "range":
                reset_peak()
            token = _OpenRange(site, self._step, rss)
            self._open[id(token)] = token
        stack = getattr(self._stacks, "open", None)
        if stack is None:
            stack = self._stacks.open = []
        stack.append(token)

    def _exit(self) -> None:
        token = self._stacks.open.pop()
        with self._lock:
            rss, hwm = read_rss()
            del self._open[id(token)]
            self._records.append(
                {
                    "kind": "range",
                    "role": token.site.role,
                    "name": token.site.name,
                    "step": token.step,
                    "rss_before": token.rss_before,
                    "rss_after": rss,
                    "peak_rss": max(token.peak, hwm),
                    "peak_scope": self._peak_scope,
                }
            )

    def stop_window(self, window: StepWindow) -> None:
        try:
            self._write_rss(window)
        finally:
            if self.host is not None:
                self.host.stop_window(window, self.name)

    def close(self) -> None:
        if self.host is not None:
            self.host.recorder.abandon()

    def _write_rss(self, window: StepWindow) -> None:
        with self._lock:
            records, self._records = self._records, []
        final = (
            self.context.window_dir(self.name, window) / f"rank{self.context.rank}_pid{os.getpid()}.host_memory.jsonl"
        )
        tmp = self.context.temp_path(final)
        try:
            with tmp.open("w", encoding="utf-8") as handle:
                for record in records + summarize_by_role(records):
                    handle.write(json.dumps(record) + "\n")
            self.context.publish(self.name, tmp, final, window, format="host_rss")
        finally:
            if tmp.exists():
                tmp.unlink()


def summarize_by_role(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``role_summary`` per role: number of ranges, highest peak, largest RSS growth across one range."""
    summaries: dict[str, dict[str, Any]] = {}
    for record in records:
        summary = summaries.setdefault(
            record["role"],
            {"kind": "role_summary", "role": record["role"], "ranges": 0, "peak_rss": 0, "max_rss_growth": 0},
        )
        summary["ranges"] += 1
        summary["peak_rss"] = max(summary["peak_rss"], record["peak_rss"])
        summary["max_rss_growth"] = max(summary["max_rss_growth"], record["rss_after"] - record["rss_before"])
    return list(summaries.values())
