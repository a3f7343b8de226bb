"""CUDA memory snapshots (``torch.cuda.memory._dump_snapshot``, the OOM snapshot too) read into
:mod:`rlprof.analysis.allocations`'s model: an :class:`~rlprof.analysis.allocations.AllocationHistory` per device.

Read with an unpickler that accepts plain data only, so opening a file someone sent you runs no code. Every format
since torch 2.0 is read: blocks without ``address`` (their address is their segment's plus the sizes before them)
and stacks under ``history`` (torch 2.0), events without ``time_us`` (before 2.1: their order is shown as order),
``external_annotations`` (2.5 on).

**Sites.** An allocation's site is where the user's code allocated: the first Python frames outside torch's own code
and rlprof's wrappers, innermost first, as paths relative to the folder the program's own frames share (Windows paths
too; an installed library's from its package). Native frames (C++ and CUDA sources, object files, libraries, the
threading runtime, unknown ``??``) are never a site: a stack without a Python frame of the user's says so, and names
autograd's engine when its frames are there. A block alive when recording started has no stack.

**Ownership.** An allocation carries the rlprof range active on its thread (``user_metadata``). One made on another
thread carries none: autograd runs the backward on its own thread, with no Python stack either. Such an allocation
belongs to the range open at its time on the thread that waits for it: the innermost range of the snapshot's
``external_annotations`` (rlprof's torch_memory tool writes its ranges there; torch writes ``record_function``
ranges there) open at that time; when the allocations carry ranges, only those count (torch's own ranges, such as
``Optimizer.step#AdamW.step``, own nothing). Without such annotations (snapshots older than that, or annotations of
torch's own ranges only), a stackless allocation between two allocations of the same range belongs to it.

**Out of memory.** An ``oom`` action (torch records the request, the device's free bytes, the stack and the range)
is the history's failure, whatever the file is called; with several, the first, and how many.

Work per snapshot is bounded by the file's size: a stack shared by many events (pickle references) is read once.
"""

from __future__ import annotations

import bisect
import io
import pickle
import posixpath
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.allocations import Allocation, AllocationHistory, AllocEvent, OutOfMemory, SegmentUsage
from rlprof.analysis.sources.base import InputFile, ReadOptions, Source
from rlprof.analysis.sources.host_memory import MAX_EVENTS, NO_STACK, STACK_FRAMES, MemoryFileError

TORCH_FRAMES = (
    "site-packages/torch/",
    "dist-packages/torch/",
    "/torchinductor_",
    "<frozen ",
    "/rlprof/annotate.py",
    "/rlprof/timer.py",
    "/threading.py",
    "/concurrent/futures/",
)
"""Python frames that are not the user's code (matched in the path with ``/`` separators): torch's own, the code
its compiler generates, the interpreter's frozen modules, the standard threading frames, rlprof's wrappers."""
PYTHON_SOURCES = (".py", ".pyx", ".pyw")
PYTHON_PSEUDO_FILES = ("<ipython-input", "<stdin>", "<string>", "<console>")
"""Python code without a file of its own (notebook cells, ``python -c``)."""
NO_USER_FRAME = "(torch and C++ frames only)"
AUTOGRAD_ENGINE = "(no Python stack: autograd's backward)"
NO_PYTHON_STACK = "(no Python stack: autograd's backward or another thread)"
BEFORE_RECORDING = "(allocated before recording started: no stack)"
LIBRARY_FOLDERS = ("site-packages/", "dist-packages/")
STANDARD_LIBRARY = re.compile(r"/lib/python3\.\d+/")
"""The standard library's folder in a path (shown from ``python3.X/``)."""
"""A library's frames are shown from its package (``einops/einops.py``), not from where it is installed."""
AUTOGRAD_FRAMES = ("torch::autograd::Engine", "autograd::Engine::thread_main", "evaluate_function")
"""Native frames that say the allocation ran in autograd's engine (stacks recorded with ``stacks="all"``)."""


# --------------------------------------------------------------------------------------------- stacks


def _path(frame: Any) -> str:
    return str(frame.get("filename", "")).replace("\\", "/") if isinstance(frame, dict) else ""


def is_user_frame(frame: Any) -> bool:
    """A Python frame of the user's code: not torch's own, not the standard threading frames, not native (C++ and
    CUDA sources, object files, libraries, unknown ``??``)."""
    path = _path(frame)
    lowered = path.lower()
    if not (lowered.endswith(PYTHON_SOURCES) or lowered.startswith(PYTHON_PSEUDO_FILES)):
        return False
    slashed = "/" + lowered
    return not any(marker in slashed for marker in TORCH_FRAMES)


class Sites:
    """Allocation sites of one snapshot's stacks, each stack read once (by identity: pickle shares them).
    ``standard_library``: the interpreter's own modules are a library too (shown from ``python3.X/``, left out of
    the folder the user's frames share): the stacks of a whole process (memray) pass through them."""

    def __init__(self, stacks: Iterable[Any], standard_library: bool = False) -> None:
        self.standard_library = standard_library
        folders = set()
        seen: set[int] = set()
        for frames in stacks:
            if not isinstance(frames, list) or id(frames) in seen:
                continue
            seen.add(id(frames))
            for frame in frames:
                path = _path(frame)
                absolute = path.startswith("/") or path[1:3] == ":/"
                if absolute and is_user_frame(frame) and not _library(path, standard_library):
                    folders.add(posixpath.dirname(path))
        self.root = _common_folder(folders)
        self._sites: dict[int, str] = {}

    def site(self, frames: Any) -> str:
        if not isinstance(frames, list) or not frames:
            return NO_STACK
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
        if shown:
            return " < ".join(shown)
        names = (str(f.get("name", "")) for f in frames if isinstance(f, dict))
        return AUTOGRAD_ENGINE if any(marker in name for name in names for marker in AUTOGRAD_FRAMES) else NO_USER_FRAME

    def _relative(self, path: str) -> str:
        library = _library(path, self.standard_library)
        if library:
            return library
        if self.root and path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return path


def _library(path: str, standard_library: bool = False) -> str:
    """``.../site-packages/einops/einops.py`` -> ``einops/einops.py``; with ``standard_library`` also
    ``.../lib/python3.11/inspect.py`` -> ``python3.11/inspect.py``; "" outside them."""
    lowered = path.lower()
    for folder in LIBRARY_FOLDERS:
        at = lowered.rfind(folder)
        if at >= 0:
            return path[at + len(folder) :]
    standard = STANDARD_LIBRARY.search(path) if standard_library else None
    return path[standard.start() + len("/lib/") :] if standard else ""


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


# --------------------------------------------------------------------------------------------- the file


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


def devices(snapshot: dict[str, Any]) -> list[int]:
    """The devices a snapshot holds anything of (segments or history), in order."""
    traces = snapshot.get("device_traces") or []
    found = {i for i, trace in enumerate(traces) if isinstance(trace, list) and trace}
    found |= {int(s.get("device", 0)) for s in snapshot["segments"] if isinstance(s, dict)}
    return sorted(found) or [0]


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


def _blocks(segments: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any], Any]]:
    """Each block with its address and stack: its own (torch 2.1 on), or, in torch 2.0's format, its segment's
    address plus the sizes of the blocks before it, and the stack of its latest ``history`` entry."""
    for segment in segments:
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", []):
            if not isinstance(block, dict):
                continue
            history = block.get("history")
            frames = block.get("frames")
            if frames is None and isinstance(history, list) and history and isinstance(history[-1], dict):
                frames = history[-1].get("frames")
            yield int(block.get("address", address)), block, frames
            address += int(block.get("size", 0))


class RangeClock:
    """Which range was open when: the innermost of the snapshot's ``external_annotations`` (START/END pairs) at a
    time, of those named ``names`` (None: every one)."""

    def __init__(self, annotations: Any, device: int, names: Optional[set[str]] = None) -> None:
        changes: list[tuple[float, str]] = []  # (time, innermost open range from then on)
        open_ranges: list[str] = []
        marks = [a for a in annotations if isinstance(a, dict)] if isinstance(annotations, list) else []
        for mark in sorted(marks, key=lambda a: _number(a.get("time_us"))):
            if mark.get("device", device) != device or not isinstance(mark.get("time_us"), (int, float)):
                continue
            name = str(mark.get("name", ""))
            if names is not None and name not in names:
                continue
            if mark.get("stage") == "START":
                open_ranges.append(name)
            elif mark.get("stage") == "END" and name in open_ranges:
                del open_ranges[len(open_ranges) - 1 - open_ranges[::-1].index(name)]
            else:
                continue
            changes.append((float(mark["time_us"]), open_ranges[-1] if open_ranges else ""))
        self._times = [t for t, _ in changes]
        self._ranges = [r for _, r in changes]

    def __bool__(self) -> bool:
        return bool(self._times)

    def at(self, time_us: float) -> str:
        index = bisect.bisect_right(self._times, time_us) - 1
        return self._ranges[index] if index >= 0 else ""


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def cuda_histories(snapshot: dict[str, Any], source: str) -> list[AllocationHistory]:
    """One history per device of the snapshot, the device that ran out of memory first."""
    histories = [cuda_history(snapshot, source, device) for device in devices(snapshot)]
    return sorted(histories, key=lambda h: h.oom is None)


def cuda_history(snapshot: dict[str, Any], source: str, device: int = 0) -> AllocationHistory:
    """Allocations of one device of a snapshot: alive at the end from its segments, then its trace backwards to
    what was alive when recording started (see the module doc for sites, ownership and failures)."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) and isinstance(traces[device], list) else []
    raw = [entry for entry in trace[:MAX_EVENTS] if isinstance(entry, dict)]
    segments = [s for s in snapshot["segments"] if isinstance(s, dict) and s.get("device", 0) == device]
    blocks = list(_blocks(segments))
    sites = Sites([frames for _, _, frames in blocks] + [e.get("frames") for e in raw])
    alive: dict[int, Allocation] = {}
    for address, block, frames in blocks:
        if str(block.get("state", "")).startswith("active"):
            site = sites.site(frames) if frames else BEFORE_RECORDING
            alive[address] = Allocation(int(block.get("size", 0)), site, "")
    timed = all(isinstance(entry.get("time_us"), (int, float)) for entry in raw)
    owner = _owner(raw, _range_clock(snapshot, raw, device), timed)
    events: list[AllocEvent] = []
    allocated: dict[int, Allocation] = {}
    failures: list[tuple[int, dict[str, Any]]] = []
    for index, entry in enumerate(raw):
        action = entry.get("action")
        if action == "oom":
            failures.append((index, entry))
            continue
        if action not in ("alloc", "free_completed"):
            continue
        address, tag = int(entry["addr"]), owner(index)
        allocation = Allocation(int(entry.get("size", 0)), _site(sites, entry, tag), tag)
        if action == "alloc":
            allocated[address] = allocation
        elif address in allocated:  # a free belongs to the allocation it ends: its site and range
            allocation = allocated.pop(address)
        time = float(entry["time_us"]) if timed else float(len(events))
        events.append(AllocEvent(time, "alloc" if action == "alloc" else "free", address, allocation))
    usage = segment_usage(segments, device)
    oom = None
    if failures:
        index, entry = failures[0]
        before = sum(1 for e in raw[:index] if e.get("action") in ("alloc", "free_completed"))
        tag = owner(index)
        oom = OutOfMemory(
            requested=int(entry.get("size", 0)),
            device_free=int(entry.get("device_free", 0)),
            device_total=_device_total(snapshot, device),
            reserved=_reserved_at(raw, index, usage.reserved),
            at_event=before,
            time_us=float(entry["time_us"]) if timed else None,
            tag=tag,
            site=_site(sites, entry, tag),
            count=len(failures),
        )
    return AllocationHistory(
        source,
        f"cuda:{device}",
        _alive_at_start(alive, events),
        events,
        segments=usage,
        dropped=max(0, len(trace) - MAX_EVENTS),
        timed=timed,
        oom=oom,
    )


def _range_clock(snapshot: dict[str, Any], raw: list[dict[str, Any]], device: int) -> RangeClock:
    """The annotations' clock of ranges: of the ranges the allocations carry when they carry some (torch writes its
    own ranges beside them, ``Optimizer.step#AdamW.step``: no owner of another thread's allocation), else of every
    annotation (a program's own ``record_function`` ranges)."""
    tags = {str(entry.get("user_metadata")) for entry in raw if entry.get("user_metadata")}
    return RangeClock(snapshot.get("external_annotations"), device, tags or None)


def _owner(raw: list[dict[str, Any]], clock: RangeClock, timed: bool) -> Any:
    """``owner(index)``: the range event ``index`` belongs to (see the module doc's ownership)."""
    tags = [str(entry.get("user_metadata") or "") for entry in raw]
    if clock and timed:
        return lambda index: tags[index] or clock.at(float(raw[index]["time_us"]))
    tagged = [i for i, tag in enumerate(tags) if tag]

    def neighbours(index: int) -> str:
        if tags[index] or raw[index].get("frames"):
            return tags[index]
        at = bisect.bisect_left(tagged, index)
        if 0 < at < len(tagged) and tags[tagged[at - 1]] == tags[tagged[at]]:
            return tags[tagged[at]]
        return ""

    return neighbours


def _site(sites: Sites, entry: dict[str, Any], owner: str) -> str:
    """The entry's site; a stackless one owned by a range (by time) ran on another thread: said so."""
    if not entry.get("frames") and owner and not entry.get("user_metadata"):
        return NO_PYTHON_STACK
    return sites.site(entry.get("frames"))


def _reserved_at(raw: list[dict[str, Any]], index: int, reserved_at_end: int) -> Optional[int]:
    """Bytes the allocator held just before event ``index``: those at the end without the segments mapped after it
    and with those released after it; None when the history has no segment events (then it cannot tell)."""
    later = raw[index + 1 :]
    if not any(str(e.get("action", "")).startswith("segment_") for e in raw):
        return None
    mapped = sum(int(e.get("size", 0)) for e in later if e.get("action") in ("segment_alloc", "segment_map"))
    released = sum(int(e.get("size", 0)) for e in later if e.get("action") in ("segment_free", "segment_unmap"))
    return max(0, reserved_at_end - mapped + released)


def _device_total(snapshot: dict[str, Any], device: int) -> Optional[int]:
    """The device's memory, where rlprof recorded it in the snapshot (``rlprof.devices``)."""
    recorded = snapshot.get("rlprof")
    found = recorded.get("devices", {}).get(device, {}) if isinstance(recorded, dict) else {}
    total = found.get("total_memory") if isinstance(found, dict) else None
    return int(total) if isinstance(total, int) else None


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
    histories = True
    description = "a CUDA memory snapshot (torch.cuda.memory._dump_snapshot pickle)"

    def claims(self, path: Path, head: bytes) -> bool:
        """A pickle (protocol 2 or later) that names ``segments`` early, or any pickle named ``*.pickle``."""
        return head[:1] == b"\x80" and (b"segments" in head or path.suffix == ".pickle")

    def read(self, file: InputFile, options: ReadOptions) -> list[AllocationHistory]:
        return read_snapshot(file.path)


def read_snapshot(path: Path) -> list[AllocationHistory]:
    """The histories of the snapshot at ``path`` (:func:`cuda_histories`); a file that is not one raises
    :class:`~rlprof.analysis.sources.host_memory.MemoryFileError` naming it."""
    try:
        return cuda_histories(load_snapshot(path), str(path))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, MemoryFileError):
            raise
        raise MemoryFileError(f"{path} is not a readable snapshot ({type(exc).__name__}: {exc})") from None
