"""Memory files read into :mod:`rlprof.analysis.memory`'s model:

- ``cuda_snapshot``: torch's CUDA memory snapshot pickle (``torch.cuda.memory._dump_snapshot``, the OOM snapshot
  too), read with an unpickler that accepts plain data only, so opening a file someone sent you runs no code.
- ``host_alloc``: the host allocation timeline of ``torch_memory`` without CUDA (format in
  :mod:`rlprof.tools.host_alloc`), streamed, at most :data:`MAX_DECOMPRESSED` bytes and :data:`MAX_EVENTS` events.
- ``host_rss``: its RSS before/after/peak per range (``*.host_memory.jsonl``).

An allocation's *site* is where the user's code allocated: the first frames outside torch's own Python code and
outside C++ frames (unwinding, the interpreter, ``??``), innermost first, as paths relative to the folder the
program's own frames share (Windows paths too; an installed library's from its package). A stack with no such frame
says so; a block alive when recording started has none. Work per snapshot is bounded by the file's size: a stack
shared by many events (pickle references) is read once.
"""

from __future__ import annotations

import io
import json
import pickle
import posixpath
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.memory import (
    Allocation,
    AllocationHistory,
    AllocEvent,
    HostRss,
    RangeMemory,
    RoleRss,
    RssRecord,
    SegmentUsage,
)
from rlprof.analysis.sources.base import InputFile, ReadOptions, Source, SourceError

STACK_FRAMES = 3
"""Frames of an allocation site shown (innermost first, from the first frame of the user's code)."""
TORCH_FRAMES = (
    "site-packages/torch/",
    "dist-packages/torch/",
    "/torchinductor_",
    "<frozen ",
    "/rlprof/annotate.py",
    "/rlprof/timer.py",
)
"""Python frames that are not the user's code (matched in the path with ``/`` separators): torch's own, the code
its compiler generates, the interpreter's frozen modules, rlprof's wrappers."""
CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh", ".s")
"""Native frames (C++, CUDA, C and assembly: unwinding, the allocator, the interpreter, libc)."""
NO_USER_FRAME = "(torch and C++ frames only)"
BEFORE_RECORDING = "(allocated before recording started: no stack)"
LIBRARY_FOLDERS = ("site-packages/", "dist-packages/")
"""A library's frames are shown from its package (``einops/einops.py``), not from where it is installed."""
HOST_ALLOC_FORMAT = "rlprof-host-alloc/1"
MAX_DECOMPRESSED = 256 << 20
"""Largest host allocation timeline read (decompressed): a bigger one is refused in one line."""
MAX_EVENTS = 2_000_000
"""Most events read from one memory file; later ones are dropped and said."""


class MemoryFileError(SourceError):
    """Not a memory file rlprof can read; the message says why in one line."""


# --------------------------------------------------------------------------------------------- stacks


def _path(frame: Any) -> str:
    return str(frame.get("filename", "")).replace("\\", "/") if isinstance(frame, dict) else ""


def is_user_frame(frame: Any) -> bool:
    """A frame of the user's code: not torch's own Python, not C++ (unwinding, the interpreter, unknown ``??``)."""
    path = _path(frame)
    if not path or path == "??" or path.lower().endswith(CPP_SUFFIXES):
        return False
    slashed = "/" + path.lower()
    return not any(marker in slashed for marker in TORCH_FRAMES)


class Sites:
    """Allocation sites of one snapshot's stacks, each stack read once (by identity: pickle shares them)."""

    def __init__(self, stacks: Iterable[Any]) -> None:
        folders = set()
        self._seen: set[int] = set()
        for frames in stacks:
            if not isinstance(frames, list) or id(frames) in self._seen:
                continue
            self._seen.add(id(frames))
            for frame in frames:
                path = _path(frame)
                absolute = path.startswith("/") or path[1:3] == ":/"
                if absolute and is_user_frame(frame) and not _library(path):
                    folders.add(posixpath.dirname(path))
        self.root = _common_folder(folders)
        self._sites: dict[int, str] = {}

    def site(self, frames: Any) -> str:
        if not isinstance(frames, list) or not frames:
            return "(no stack recorded)"
        found = self._sites.get(id(frames))
        if found is None:
            found = self._sites[id(frames)] = self._format(frames)
        return found

    def _format(self, frames: list[Any]) -> str:
        shown = []
        for frame in frames:
            if is_user_frame(frame):
                path = _path(frame)
                shown.append(f"{self._relative(path)}:{frame.get('line', '?')} {frame.get('name', '?')}")
                if len(shown) == STACK_FRAMES:
                    break
        return " < ".join(shown) or NO_USER_FRAME

    def _relative(self, path: str) -> str:
        library = _library(path)
        if library:
            return library
        if self.root and path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return path


def _library(path: str) -> str:
    """``.../site-packages/einops/einops.py`` -> ``einops/einops.py``; "" outside installed packages."""
    lowered = path.lower()
    for folder in LIBRARY_FOLDERS:
        at = lowered.rfind(folder)
        if at >= 0:
            return path[at + len(folder) :]
    return ""


def _common_folder(folders: set[str]) -> str:
    """The folder every one of ``folders`` is in ("" when they share none)."""
    if not folders:
        return ""
    parts = [folder.split("/") for folder in folders]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return "/".join(common)


# --------------------------------------------------------------------------------------------- CUDA snapshots


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise MemoryFileError(f"the pickle refers to {module}.{name}; a memory snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """A CUDA memory snapshot pickle, read as plain data (no code runs)."""
    try:
        data = _PlainData(io.BytesIO(Path(path).read_bytes())).load()
    except MemoryFileError as exc:
        raise MemoryFileError(f"{path}: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, MemoryError) as exc:
        raise MemoryFileError(f"{path} is not a readable snapshot pickle ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise MemoryFileError(f"{path} is not a torch memory snapshot (no 'segments')")
    return data


def segment_usage(segments: list[Any], device: int) -> SegmentUsage:
    """torch's ``_memory_viz.segsum`` totals of the segments of ``device``."""
    reserved = allocated = free_internal = free_external = 0
    for segment in segments:
        if not isinstance(segment, dict) or segment.get("device", 0) != device:
            continue
        reserved += int(segment.get("total_size", 0))
        for block in segment.get("blocks", []):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                requested = int(block.get("requested_size", size))
                allocated += requested
                free_internal += size - requested
            else:
                free_external += size
    return SegmentUsage(reserved, allocated, free_internal, free_external)


def cuda_history(snapshot: dict[str, Any], source: str, device: int = 0) -> AllocationHistory:
    """Allocations of one device of a snapshot: alive at the end from its segments, then its trace backwards to
    what was alive when recording started."""
    traces = snapshot.get("device_traces") or []
    raw = traces[device] if device < len(traces) and isinstance(traces[device], list) else []
    raw = [entry for entry in raw[:MAX_EVENTS] if isinstance(entry, dict)]
    segments = [s for s in snapshot.get("segments", []) if isinstance(s, dict) and s.get("device", 0) == device]
    blocks = [b for s in segments for b in s.get("blocks", []) if isinstance(b, dict)]
    sites = Sites([b.get("frames") for b in blocks] + [e.get("frames") for e in raw])
    alive: dict[int, Allocation] = {}
    for block in blocks:
        if str(block.get("state", "")).startswith("active"):
            frames = block.get("frames")
            site = sites.site(frames) if frames else BEFORE_RECORDING
            alive[int(block["address"])] = Allocation(int(block["size"]), site, "")
    timed = all(isinstance(entry.get("time_us"), (int, float)) for entry in raw)
    events: list[AllocEvent] = []
    allocated: dict[int, Allocation] = {}
    for entry in raw:
        action = entry.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        address = int(entry["addr"])
        allocation = Allocation(
            int(entry.get("size", 0)), sites.site(entry.get("frames")), str(entry.get("user_metadata") or "")
        )
        if action == "alloc":
            allocated[address] = allocation
        elif address in allocated:  # a free belongs to the allocation it ends: its site and range
            allocation = allocated.pop(address)
        time = float(entry["time_us"]) if timed else float(len(events))
        events.append(AllocEvent(time, "alloc" if action == "alloc" else "free", address, allocation))
    return AllocationHistory(
        source,
        f"cuda:{device}",
        _alive_at_start(alive, events),
        events,
        segments=segment_usage(segments, device),
        dropped=max(0, len(traces[device]) - MAX_EVENTS) if device < len(traces) else 0,
        timed=timed,
    )


def _alive_at_start(alive_at_end: dict[int, Allocation], events: list[AllocEvent]) -> dict[int, Allocation]:
    """Undo ``events`` backwards from what is alive at the end. An allocation's site and tag come from its alloc
    event (a block at the end knows its frames, not its range)."""
    alive = dict(alive_at_end)
    for event in events:
        if event.action == "alloc" and event.address in alive:
            alive[event.address] = event.allocation  # richer: the event knows the range
    for event in reversed(events):
        if event.action == "alloc":
            alive.pop(event.address, None)
        else:
            alive[event.address] = event.allocation
    return alive


class CudaSnapshotSource(Source):
    format = "cuda_snapshot"
    category = "memory"
    description = "a CUDA memory snapshot (torch.cuda.memory._dump_snapshot pickle)"

    def claims(self, path: Path, head: bytes) -> bool:
        """A pickle (protocol 2 or later) that names ``segments`` early, or any pickle named ``*.pickle``."""
        return head[:1] == b"\x80" and (b"segments" in head or path.suffix == ".pickle")

    def read(self, file: InputFile, options: ReadOptions) -> AllocationHistory:
        try:
            return cuda_history(load_snapshot(file.path), str(file.path))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, MemoryFileError):
                raise
            raise MemoryFileError(f"{file.path} is not a readable snapshot ({type(exc).__name__}: {exc})") from None


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
        " < ".join(str(f) for f in frames[:STACK_FRAMES]) if isinstance(frames, list) else "(no stack recorded)"
        for frames in data.get("stacks", [])
    ]

    def site(entry: dict[str, Any]) -> str:
        if entry.get("site"):
            return str(entry["site"])
        index = entry.get("stack")
        return stacks[index] if isinstance(index, int) and 0 <= index < len(stacks) else "(no stack recorded)"

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
    description = "a host allocation timeline of torch_memory (*.host_alloc.json.gz)"

    def claims(self, path: Path, head: bytes) -> bool:
        return HOST_ALLOC_FORMAT.encode() in head[:256]

    def read(self, file: InputFile, options: ReadOptions) -> AllocationHistory:
        return host_history(file.path)


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
        row = roles.setdefault(r.label.split("/", 1)[0], [0, 0, 0])
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
