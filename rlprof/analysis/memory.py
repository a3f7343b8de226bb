"""Memory read back offline: CUDA memory snapshots (torch's ``_dump_snapshot`` pickle, the OOM snapshot too), the
host allocation timelines of ``torch_memory`` without CUDA, and its RSS-per-range files.

Snapshots and host timelines become one :class:`AllocationHistory` (the allocations alive when recording started,
then every alloc and free in order), from which :func:`summarize` finds the peak of live bytes, what was alive at
the peak (grouped by allocation site and by the rlprof range that allocated it) and the timeline around it. Snapshot
pickles are read with an unpickler that accepts plain data only (a snapshot holds nothing else), so opening a file
someone sent you cannot run code.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

STACK_FRAMES = 3
"""Frames of an allocation site shown (innermost first, after skipping torch's own frames)."""
INTERNAL_FRAMES = ("/torch/", "<frozen ", "/site-packages/torch")


class MemoryFileError(ValueError):
    """Not a memory file rlprof can read; the message says why in one line."""


@dataclass(frozen=True)
class Allocation:
    size: int
    site: str
    """Where it was allocated: ``file:line function`` frames, innermost first."""
    tag: str
    """The rlprof range (``role/name``) active when it was allocated, or ``""``."""


@dataclass(frozen=True)
class AllocEvent:
    time_us: float
    action: str  # "alloc" or "free"
    address: int
    allocation: Allocation


@dataclass
class AllocationHistory:
    source: str
    device: str
    alive_at_start: dict[int, Allocation]
    events: list[AllocEvent]
    reserved_bytes: Optional[int] = None
    """Bytes the allocator holds from the device (CUDA segments), when known."""
    dropped: int = 0
    """Events lost to ``trace_alloc_max_entries`` (the oldest ones)."""


@dataclass(frozen=True)
class SiteBytes:
    site: str
    tag: str
    bytes: int
    count: int


@dataclass
class MemorySummary:
    source: str
    device: str
    peak_bytes: int
    peak_time_us: float
    peak_event: int
    """Index of the event at which the peak was reached (-1: already at the start)."""
    start_bytes: int
    end_bytes: int
    reserved_bytes: Optional[int]
    fragmentation: Optional[float]
    """Share of reserved bytes not allocated at the end (CUDA)."""
    by_tag: dict[str, int]
    """Live bytes at the peak per rlprof range (``""``: outside every range)."""
    top_sites: list[SiteBytes]
    timeline: list[tuple[float, int]]
    """(time in µs, live bytes), at most ``points`` samples over the whole history, the peak included."""
    timeline_by_tag: dict[str, list[int]]
    """Live bytes per rlprof range at each ``timeline`` sample (they add up to its live bytes)."""
    around_peak: list[tuple[float, int, str, int, str]]
    """(time, live bytes after, action, size, tag) of the events around the peak."""
    events: int
    dropped: int


# --------------------------------------------------------------------------------------------- readers


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise MemoryFileError(f"the pickle refers to {module}.{name}; a memory snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """A CUDA memory snapshot pickle, read as plain data (no code runs)."""
    try:
        data = _PlainData(io.BytesIO(Path(path).read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        if isinstance(exc, MemoryFileError):
            raise MemoryFileError(f"{path}: {exc}") from None
        raise MemoryFileError(f"{path} is not a readable snapshot pickle ({exc})") from None
    if not isinstance(data, dict) or "segments" not in data:
        raise MemoryFileError(f"{path} is not a torch memory snapshot (no 'segments')")
    return data


def _site(frames: Any) -> str:
    shown = []
    for frame in frames or ():
        filename = str(frame.get("filename", "?"))
        if any(marker in filename for marker in INTERNAL_FRAMES):
            continue
        shown.append(f"{filename.rsplit('/', 1)[-1]}:{frame.get('line', '?')} {frame.get('name', '?')}")
        if len(shown) == STACK_FRAMES:
            break
    return " < ".join(shown) or ("(torch internals)" if frames else "(no stack recorded)")


def cuda_history(snapshot: dict[str, Any], source: str, device: int = 0) -> AllocationHistory:
    """Allocations of one device of a snapshot: alive at the end from its segments, then its trace backwards to
    what was alive when recording started."""
    alive: dict[int, Allocation] = {}
    reserved = 0
    for segment in snapshot.get("segments", []):
        if segment.get("device", 0) != device:
            continue
        reserved += int(segment.get("total_size", 0))
        for block in segment.get("blocks", []):
            if str(block.get("state", "")).startswith("active"):
                alive[int(block["address"])] = Allocation(int(block["size"]), _site(block.get("frames")), "")
    traces = snapshot.get("device_traces") or []
    raw = traces[device] if device < len(traces) else []
    events = []
    allocated: dict[int, Allocation] = {}
    for index, entry in enumerate(raw):
        action = entry.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        address = int(entry["addr"])
        allocation = Allocation(
            int(entry.get("size", 0)), _site(entry.get("frames")), str(entry.get("user_metadata") or "")
        )
        if action == "alloc":
            allocated[address] = allocation
        elif address in allocated:  # a free belongs to the allocation it ends: its site and range
            allocation = allocated.pop(address)
        events.append(
            AllocEvent(
                float(entry.get("time_us", index)), "alloc" if action == "alloc" else "free", address, allocation
            )
        )
    return AllocationHistory(source, f"cuda:{device}", _alive_at_start(alive, events), events, reserved)


def _alive_at_start(alive_at_end: dict[int, Allocation], events: Sequence[AllocEvent]) -> dict[int, Allocation]:
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


def host_history(path: Path) -> AllocationHistory:
    """A ``*.host_alloc.json.gz`` file of the torch_memory tool (format in :mod:`rlprof.tools.host_alloc`)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, EOFError, ValueError) as exc:
        raise MemoryFileError(f"{path} is not a readable host allocation file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != "rlprof-host-alloc/1":
        raise MemoryFileError(f"{path} is not an rlprof host allocation file (format rlprof-host-alloc/1)")
    stacks = [" < ".join(frames[:STACK_FRAMES]) for frames in data.get("stacks", [])]

    def site(entry: dict[str, Any]) -> str:
        if entry.get("site"):
            return str(entry["site"])
        index = entry.get("stack")
        return stacks[index] if isinstance(index, int) and 0 <= index < len(stacks) else "(no stack recorded)"

    events = [
        AllocEvent(
            float(e["t_us"]), e["action"], int(e["addr"]), Allocation(int(e["bytes"]), site(e), e.get("range") or "")
        )
        for e in data.get("events", [])
    ]
    alive = {
        int(a["addr"]): Allocation(int(a["bytes"]), site(a), a.get("range") or "")
        for a in data.get("alive_at_start", [])
    }
    return AllocationHistory(str(path), "cpu", alive, events, dropped=int(data.get("dropped", 0)))


def read_history(path: Path) -> AllocationHistory:
    """The allocation history in a snapshot pickle or a host allocation file."""
    path = Path(path)
    if path.name.endswith(".host_alloc.json.gz"):
        return host_history(path)
    return cuda_history(load_snapshot(path), str(path))


# --------------------------------------------------------------------------------------------- the summary


def summarize(history: AllocationHistory, top: int = 10, points: int = 600, around: int = 10) -> MemorySummary:
    """The peak of live bytes and what made it (see the module doc)."""
    start = sum(a.size for a in history.alive_at_start.values())
    live, curve = start, []
    peak, peak_index, peak_time = live, -1, history.events[0].time_us if history.events else 0.0
    for index, event in enumerate(history.events):
        live += event.allocation.size if event.action == "alloc" else -event.allocation.size
        curve.append((event.time_us, live))
        if live > peak:
            peak, peak_index, peak_time = live, index, event.time_us
    samples = _sample_indices(curve, points, peak_index)
    at_peak, tag_samples = _replay(history, peak_index, samples)
    by_tag: dict[str, int] = defaultdict(int)
    by_site: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for allocation in at_peak.values():
        by_tag[allocation.tag] += allocation.size
        totals = by_site[(allocation.site, allocation.tag)]
        totals[0] += allocation.size
        totals[1] += 1
    sites = sorted((SiteBytes(site, tag, b, n) for (site, tag), (b, n) in by_site.items()), key=lambda s: -s.bytes)
    reserved = history.reserved_bytes
    fragmentation = (reserved - live) / reserved if reserved else None
    low, high = max(0, peak_index - around), min(len(history.events), peak_index + around + 1)
    nearby = [
        (
            history.events[i].time_us,
            curve[i][1],
            history.events[i].action,
            history.events[i].allocation.size,
            history.events[i].allocation.tag,
        )
        for i in range(low, high)
    ]
    tags = sorted({tag for sample in tag_samples for tag, size in sample.items() if size})
    return MemorySummary(
        source=history.source,
        device=history.device,
        peak_bytes=peak,
        peak_time_us=peak_time,
        peak_event=peak_index,
        start_bytes=start,
        end_bytes=live,
        reserved_bytes=reserved,
        fragmentation=fragmentation,
        by_tag=dict(sorted(by_tag.items(), key=lambda item: -item[1])),
        top_sites=sites[:top],
        timeline=[curve[i] for i in samples],
        timeline_by_tag={tag: [sample.get(tag, 0) for sample in tag_samples] for tag in tags},
        around_peak=nearby,
        events=len(history.events),
        dropped=history.dropped,
    )


def _replay(
    history: AllocationHistory, peak_index: int, samples: list[int]
) -> tuple[dict[int, Allocation], list[dict[str, int]]]:
    """Replay the events: what was alive at the peak, and live bytes per tag at each sampled event."""
    alive = dict(history.alive_at_start)
    by_tag_now: dict[str, int] = defaultdict(int)
    for allocation in alive.values():
        by_tag_now[allocation.tag] += allocation.size
    tag_samples: list[dict[str, int]] = []
    at_peak = dict(alive)
    for index, event in enumerate(history.events):
        if event.action == "alloc":
            alive[event.address] = event.allocation
            by_tag_now[event.allocation.tag] += event.allocation.size
        else:
            ended = alive.pop(event.address, event.allocation)
            by_tag_now[ended.tag] -= event.allocation.size
        if index == peak_index:
            at_peak = dict(alive)
        if len(tag_samples) < len(samples) and index == samples[len(tag_samples)]:
            tag_samples.append(dict(by_tag_now))
    return at_peak, tag_samples


def _sample_indices(curve: list[tuple[float, int]], points: int, keep: int) -> list[int]:
    """At most ``points`` event indices (ascending): the maximum of each bucket, so peaks survive, and ``keep``."""
    if len(curve) <= points:
        return list(range(len(curve)))
    size = len(curve) / points
    chosen = set()
    for bucket in range(points):
        low, high = int(bucket * size), int((bucket + 1) * size)
        if high > low:
            chosen.add(max(range(low, high), key=lambda i: curve[i][1]))
    if 0 <= keep < len(curve):
        chosen.add(keep)
    return sorted(chosen)


# --------------------------------------------------------------------------------------------- RSS per range


@dataclass
class RangeMemory:
    label: str
    count: int = 0
    peak_rss: int = 0
    max_growth: int = 0
    """Largest rise of the peak above the RSS at the range's start."""


@dataclass(frozen=True)
class RssRecord:
    """One closed range of a ``*.host_memory.jsonl`` file."""

    label: str
    step: Optional[int]
    rss_before: int
    rss_after: int
    peak_rss: int


@dataclass(frozen=True)
class RoleRss:
    role: str
    ranges: int
    peak_rss: int
    max_growth: int
    """Largest rise of the peak above the RSS at the start of one of the role's ranges."""


@dataclass
class HostRss:
    source: str
    ranges: list[RangeMemory] = field(default_factory=list)
    """Per range label, ordered by the largest growth."""
    by_role: dict[str, int] = field(default_factory=dict)
    """Highest RSS peak reached inside each role's ranges."""
    peak_rss: int = 0
    records: list[RssRecord] = field(default_factory=list)
    """Every closed range, in file order."""
    roles: list[RoleRss] = field(default_factory=list)
    """Per role: ranges, highest peak, largest growth in one range."""


def read_host_rss(paths: Iterable[Path]) -> HostRss:
    """``*.host_memory.jsonl`` files (RSS before/after/peak per range) merged into per-range and per-role peaks."""
    ranges: dict[str, RangeMemory] = {}
    by_role: dict[str, int] = defaultdict(int)
    records: list[RssRecord] = []
    sources = []
    for path in paths:
        sources.append(str(path))
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or record.get("kind") != "range":
                continue
            label = f"{record['role']}/{record['name']}"
            peak, before = int(record["peak_rss"]), int(record["rss_before"])
            step = record.get("step")
            records.append(
                RssRecord(label, step if isinstance(step, int) else None, before, int(record["rss_after"]), peak)
            )
            totals = ranges.setdefault(label, RangeMemory(label))
            totals.count += 1
            totals.peak_rss = max(totals.peak_rss, peak)
            totals.max_growth = max(totals.max_growth, peak - before)
            by_role[record["role"]] = max(by_role[record["role"]], peak)
    ordered = sorted(ranges.values(), key=lambda r: -r.max_growth)
    roles: dict[str, list[int]] = {}
    for r in records:
        row = roles.setdefault(r.label.split("/", 1)[0], [0, 0, 0])
        row[0] += 1
        row[1] = max(row[1], r.peak_rss)
        row[2] = max(row[2], r.peak_rss - r.rss_before)
    return HostRss(
        ", ".join(sources),
        ordered,
        dict(sorted(by_role.items(), key=lambda item: -item[1])),
        max(by_role.values(), default=0),
        records,
        [RoleRss(role, n, peak, growth) for role, (n, peak, growth) in roles.items()],
    )
