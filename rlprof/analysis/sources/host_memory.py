"""Host memory files read into :mod:`rlprof.analysis.allocations`'s model (CUDA snapshots:
:mod:`~rlprof.analysis.sources.cuda_snapshot`):

- ``host_alloc``: the host allocation timeline of ``torch_memory`` without CUDA (format in
  :mod:`rlprof.tools.host_alloc`), streamed, at most :data:`MAX_DECOMPRESSED` bytes and :data:`MAX_EVENTS` events.
- ``host_rss``: its RSS before/after/peak per range (``*.host_memory.jsonl``).
"""

from __future__ import annotations

import json
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.allocations import (
    Allocation,
    AllocationHistory,
    AllocEvent,
    HostRss,
    RangeMemory,
    RoleRss,
    RssRecord,
    role_of,
)
from rlprof.analysis.sources.base import InputFile, ReadOptions, Source, SourceError

HOST_ALLOC_FORMAT = "rlprof-host-alloc/1"
MAX_DECOMPRESSED = 256 << 20
"""Largest host allocation timeline read (decompressed): a bigger one is refused in one line."""
MAX_EVENTS = 2_000_000
"""Most events read from one memory file; later ones are dropped and said."""
NO_STACK = "(no stack recorded)"
STACK_FRAMES = 3
"""Frames of an allocation site shown (innermost first, from the first frame of the user's code)."""


class MemoryFileError(SourceError):
    """Not a memory file rlprof can read; the message says why in one line."""


# --------------------------------------------------------------------------------------------- host timelines


def _decompressed(path: Path) -> bytes:
    """The gzipped JSON at ``path``, refused past :data:`MAX_DECOMPRESSED` bytes (a gzip bomb stops there)."""
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 16)
    parts: list[bytes] = []
    size = 0
    with path.open("rb") as handle:
        pending = handle.read(1 << 20)
        while pending:
            data = inflater.decompress(pending, MAX_DECOMPRESSED + 1 - size)
            parts.append(data)
            size += len(data)
            if size > MAX_DECOMPRESSED:
                raise MemoryFileError(
                    f"{path} decompresses to more than {MAX_DECOMPRESSED >> 20} MiB: not a host allocation "
                    "timeline rlprof wrote (refused)"
                )
            pending = inflater.unconsumed_tail or handle.read(1 << 20)
    return b"".join(parts)


def host_history(path: Path) -> AllocationHistory:
    """A ``*.host_alloc.json.gz`` file of the torch_memory tool (format in :mod:`rlprof.tools.host_alloc`)."""
    try:
        data = json.loads(_decompressed(path))
    except (OSError, EOFError, ValueError, zlib.error, RecursionError) as exc:
        if isinstance(exc, MemoryFileError):
            raise
        raise MemoryFileError(f"{path} is not a readable host allocation file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != HOST_ALLOC_FORMAT:
        raise MemoryFileError(f"{path} is not an rlprof host allocation file (format {HOST_ALLOC_FORMAT})")
    stacks = [
        " < ".join(str(f) for f in frames[:STACK_FRAMES]) if isinstance(frames, list) else NO_STACK
        for frames in data.get("stacks", [])
    ]

    def site(entry: dict[str, Any]) -> str:
        if entry.get("site"):
            return str(entry["site"])
        index = entry.get("stack")
        return stacks[index] if isinstance(index, int) and 0 <= index < len(stacks) else NO_STACK

    try:
        raw = data.get("events", [])
        events = [
            AllocEvent(float(e["t_us"]), e["action"], int(e["addr"]), Allocation(int(e["bytes"]), site(e), _tag(e)))
            for e in raw[:MAX_EVENTS]
        ]
        alive = {int(a["addr"]): Allocation(int(a["bytes"]), site(a), _tag(a)) for a in data.get("alive_at_start", [])}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MemoryFileError(f"{path}: a malformed event ({type(exc).__name__}: {exc})") from None
    dropped = int(data.get("dropped", 0)) + max(0, len(raw) - MAX_EVENTS)
    return AllocationHistory(str(path), "cpu", alive, events, dropped=dropped)


def _tag(entry: dict[str, Any]) -> str:
    return str(entry.get("range") or "")


class HostAllocationSource(Source):
    format = "host_alloc"
    category = "memory"
    histories = True
    description = "a host allocation timeline of torch_memory (*.host_alloc.json.gz)"

    def claims(self, path: Path, head: bytes) -> bool:
        return HOST_ALLOC_FORMAT.encode() in head[:256]

    def read(self, file: InputFile, options: ReadOptions) -> list[AllocationHistory]:
        return [host_history(file.path)]


# --------------------------------------------------------------------------------------------- RSS per range


def read_host_rss(paths: Iterable[Path]) -> HostRss:
    """``*.host_memory.jsonl`` files (RSS before/after/peak per range) merged into per-range and per-role peaks;
    lines that are not range records are skipped."""
    ranges: dict[str, RangeMemory] = {}
    by_role: dict[str, int] = defaultdict(int)
    records: list[RssRecord] = []
    sources = []
    for path in paths:
        sources.append(str(path))
        with Path(path).open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                record = _range_record(line)
                if record is None:
                    continue
                role, name, step, before, after, peak = record
                label = f"{role}/{name}"
                records.append(RssRecord(label, step, before, after, peak))
                totals = ranges.setdefault(label, RangeMemory(label))
                totals.count += 1
                totals.peak_rss = max(totals.peak_rss, peak)
                totals.max_growth = max(totals.max_growth, peak - before)
                by_role[role] = max(by_role[role], peak)
    roles: dict[str, list[int]] = {}
    for r in records:
        row = roles.setdefault(role_of(r.label), [0, 0, 0])
        row[0] += 1
        row[1] = max(row[1], r.peak_rss)
        row[2] = max(row[2], r.peak_rss - r.rss_before)
    return HostRss(
        ", ".join(sources),
        sorted(ranges.values(), key=lambda r: -r.max_growth),
        dict(sorted(by_role.items(), key=lambda item: -item[1])),
        max(by_role.values(), default=0),
        records,
        [RoleRss(role, n, peak, growth) for role, (n, peak, growth) in roles.items()],
    )


def _range_record(line: str) -> Optional[tuple[str, str, Optional[int], int, int, int]]:
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or record.get("kind") != "range":
            return None
        step = record.get("step")
        return (
            str(record["role"]),
            str(record["name"]),
            step if isinstance(step, int) else None,
            int(record["rss_before"]),
            int(record["rss_after"]),
            int(record["peak_rss"]),
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


class HostRssSource(Source):
    format = "host_rss"
    category = "memory"
    description = "host RSS per range of torch_memory (*.host_memory.jsonl)"

    def claims(self, path: Path, head: bytes) -> bool:
        first = head.split(b"\n", 1)[0]
        return first.startswith(b"{") and b'"rss_before"' in first

    def read(self, file: InputFile, options: ReadOptions) -> HostRss:
        return read_host_rss([file.path])
