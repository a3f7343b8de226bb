"""The formats ``rlprof`` reads, one :class:`~rlprof.analysis.sources.base.Source` each, found by one registry.

::

    @register_source
    class MySource(Source):
        format = "my_trace"          # what a tool writes into the manifest for its files
        category = "trace"           # trace (-> TraceScan list), memory (-> AllocationHistory/HostRss), metrics
        description = "my tool's trace"
        def claims(self, path, head): return head.startswith(b"MYTRACE")
        def read(self, file, options): ...

Built in: ``chrome_trace`` (torch/kineto traces), ``nsys_report`` (Nsight Systems), ``cuda_snapshot`` (torch's
memory snapshots), ``host_alloc`` and ``host_rss`` (torch_memory without CUDA), ``memray`` (memray captures) and
``metrics`` (metrics.jsonl).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Optional, TypeVar

from rlprof.analysis.allocations import AllocationHistory
from rlprof.analysis.sources.base import HEAD_BYTES, InputFile, ReadOptions, Source, SourceError
from rlprof.analysis.sources.chrome_trace import ChromeTraceSource, read_head
from rlprof.analysis.sources.cuda_snapshot import CudaSnapshotSource
from rlprof.analysis.sources.host_memory import HostAllocationSource, HostRssSource, MemoryFileError
from rlprof.analysis.sources.memray_capture import MemraySource
from rlprof.analysis.sources.metrics_jsonl import MetricsSource
from rlprof.analysis.sources.nsys_report import NsysReportSource

__all__ = [
    "InputFile",
    "ReadOptions",
    "Source",
    "SourceError",
    "identify",
    "read_histories",
    "register_source",
    "source",
    "sources",
]

S = TypeVar("S", bound=type[Source])
_SOURCES: dict[str, Source] = {}


def register_source(cls: S) -> S:
    """Register a :class:`Source` subclass under its ``format`` (a later registration of a format replaces it)."""
    if not (isinstance(cls, type) and issubclass(cls, Source)):
        raise TypeError(f"register_source: {cls!r} does not subclass rlprof.analysis.sources.Source")
    if not isinstance(getattr(cls, "format", None), str) or not cls.format.isidentifier():
        raise ValueError(f"register_source({cls.__name__}): format must be an identifier such as 'my_trace'")
    if getattr(cls, "category", None) not in ("trace", "memory", "metrics"):
        raise ValueError(f"register_source({cls.__name__}): category must be trace, memory or metrics")
    _SOURCES[cls.format] = cls()
    return cls


def sources() -> list[Source]:
    return list(_SOURCES.values())


def source(format_name: str) -> Optional[Source]:
    return _SOURCES.get(format_name)


def identify(path: Path, read: Callable[[Path, int], bytes] = read_head) -> Optional[Source]:
    """The registered source that claims ``path`` from its content, or None."""
    head = read(path, HEAD_BYTES)
    for candidate in _SOURCES.values():
        if candidate.claims(path, head):
            return candidate
    return None


def read_histories(path: str | os.PathLike[str]) -> list[AllocationHistory]:
    """The allocation histories in a CUDA snapshot pickle (one per device, the one that ran out of memory first) or
    a host allocation timeline (one), recognised by content."""
    path = Path(path)
    found = identify(path)
    if found is None or not found.histories:
        raise MemoryFileError(
            f"{path}: not a memory file rlprof reads (a CUDA snapshot .pickle, an OOM snapshot or a "
            "*.host_alloc.json.gz)"
        )
    histories: list[AllocationHistory] = found.read(InputFile(found.format, path), ReadOptions())
    return histories


for _builtin in (
    ChromeTraceSource,
    NsysReportSource,
    CudaSnapshotSource,
    HostAllocationSource,
    HostRssSource,
    MemraySource,
    MetricsSource,
):
    register_source(_builtin)
