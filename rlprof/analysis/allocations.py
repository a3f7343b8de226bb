"""Memory read back offline, as one model: an :class:`AllocationHistory` (the allocations alive when recording
started, then every alloc and free in order) from a CUDA memory snapshot or a host allocation timeline, and
:class:`HostRss` from the RSS-per-range files. :func:`summarize` finds the peak of live bytes, what was alive at the
peak (grouped by allocation site and by the rlprof range that allocated it) and the timeline around it. The readers
are sources (:mod:`rlprof.analysis.sources.host_memory`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional


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


@dataclass(frozen=True)
class SegmentUsage:
    """How the caching allocator's segments are filled at the snapshot (torch's ``_memory_viz.segsum``)."""

    reserved: int
    """Bytes the allocator holds from the device (its segments)."""
    allocated: int
    """Bytes requested by the live allocations."""
    free_internal: int
    """Free inside live blocks: the allocator rounded their sizes up."""
    free_external: int
    """Free blocks between live ones: the fragmentation that can make a large allocation fail."""


@dataclass(frozen=True)
class OutOfMemory:
    """An allocation the device could not serve: torch's ``oom`` action in a snapshot's history."""

    requested: int
    """Bytes asked for."""
    device_free: int
    """Bytes the device had free then (CUDA's own count, which other processes' use lowers too)."""
    device_total: Optional[int]
    """The device's memory, where the file records it (rlprof's snapshots do; torch's own do not)."""
    reserved: Optional[int]
    """Bytes the allocator held from the device then (its segments), where the history allows to tell."""
    at_event: int
    """Alloc and free events before it in :attr:`AllocationHistory.events`."""
    time_us: Optional[float]
    """None when the file gives no times."""
    tag: str
    """The range it failed in (its own metadata, else the range open at its time), or ``""``."""
    site: str
    """Where it was asked for (the user's frames, as allocation sites are shown)."""
    count: int = 1
    """OOM events in the history (the first is this one)."""

    @property
    def exceeds_device(self) -> bool:
        """The request alone is more than the device's whole memory (where the file records it): no memory freed
        makes room for it, only a smaller request does."""
        return self.device_total is not None and self.requested > self.device_total


@dataclass
class AllocationHistory:
    source: str
    device: str
    alive_at_start: dict[int, Allocation]
    events: list[AllocEvent]
    segments: Optional[SegmentUsage] = None
    """The device segments at the snapshot (CUDA), when known."""
    dropped: int = 0
    """Events lost to ``trace_alloc_max_entries`` (the oldest ones)."""
    timed: bool = True
    """False when the file gives no times: ``time_us`` is then each event's position in the history."""
    oom: Optional[OutOfMemory] = None
    """The first allocation that failed, when the history has one."""
    notes: list[str] = field(default_factory=list)
    """What the reader wants said beside the summary (how to see the file with its own tool, what it lacks)."""


@dataclass(frozen=True)
class SiteBytes:
    site: str
    tag: str
    bytes: int
    count: int


@dataclass(frozen=True)
class OomMoment:
    """What was alive when an allocation failed: who held the device's memory then."""

    failure: OutOfMemory
    live_bytes: int
    """Bytes allocated (alive) at that moment."""
    reserved_unallocated: Optional[int]
    """Reserved by the allocator but not allocated (torch's OOM message: "reserved by PyTorch but unallocated"; large
    means fragmentation, which ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` avoids)."""
    by_tag: dict[str, int]
    """Live bytes per range (``""``: outside every range), largest first."""
    by_role: dict[str, int]
    """The same per role."""
    largest: list[SiteBytes]
    """The largest live allocations, one row each (count 1)."""
    sites: list[SiteBytes]
    """Live bytes per allocation site and range."""


@dataclass
class MemorySummary:
    source: str
    device: str
    peak_bytes: int
    peak_time_us: Optional[float]
    """None when the file gives no times (then only :attr:`peak_event` says when)."""
    peak_event: int
    """Index of the event at which the peak was reached (-1: already at the start)."""
    start_bytes: int
    end_bytes: int
    segments: Optional[SegmentUsage]
    """How the device segments are filled at the snapshot (CUDA)."""
    by_tag: dict[str, int]
    """Live bytes at the peak per rlprof range (``""``: outside every range)."""
    by_role: dict[str, int]
    """Live bytes at the peak per role (the ranges' roles; ``""``: outside every range)."""
    top_sites: list[SiteBytes]
    timeline: list[tuple[float, int]]
    """(time in µs, live bytes), at most ``points`` samples over the whole history, the peak included."""
    timeline_by_tag: dict[str, list[int]]
    """Live bytes per rlprof range at each ``timeline`` sample (they add up to its live bytes)."""
    around_peak: list[tuple[float, int, str, int, str]]
    """(time, live bytes after, action, size, tag) of the events around the peak."""
    events: int
    dropped: int
    timed: bool
    """False when the file gives no times: the timeline's times are event positions."""
    oom: Optional[OomMoment] = None
    """The moment an allocation failed, when the history has one."""
    alive_at_end: list[SiteBytes] = field(default_factory=list)
    """Allocations made during the history and alive at its end, per site and range, largest first: what a window
    kept (a growing list, a cache; a leak when it comes back window after window)."""
    notes: list[str] = field(default_factory=list)
    """The reader's notes (:attr:`AllocationHistory.notes`)."""


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
    oom_index = history.oom.at_event - 1 if history.oom is not None else None
    at_peak, tag_samples, at_oom, at_end = _replay(history, peak_index, samples, oom_index)
    by_tag = _by_tag(at_peak)
    sites = _sites(at_peak)
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
        peak_time_us=peak_time if history.timed else None,
        peak_event=peak_index,
        start_bytes=start,
        end_bytes=live,
        segments=history.segments,
        by_tag=by_tag,
        by_role=by_role(by_tag),
        top_sites=sites[:top],
        timeline=[curve[i] for i in samples],
        timeline_by_tag={tag: [sample.get(tag, 0) for sample in tag_samples] for tag in tags},
        around_peak=nearby,
        events=len(history.events),
        dropped=history.dropped,
        timed=history.timed,
        oom=None if history.oom is None else _oom_moment(history.oom, at_oom, top),
        alive_at_end=_sites({a: alloc for a, alloc in at_end.items() if a not in history.alive_at_start})[:top],
        notes=list(history.notes),
    )


def role_of(tag: str) -> str:
    """The role of a range label (``actor/update_actor`` -> ``actor``; ``""`` stays ``""``)."""
    return tag.split("/", 1)[0]


def by_role(by_tag: dict[str, int]) -> dict[str, int]:
    """Bytes per range summed per role, largest first."""
    roles: dict[str, int] = defaultdict(int)
    for tag, size in by_tag.items():
        roles[role_of(tag)] += size
    return dict(sorted(roles.items(), key=lambda item: -item[1]))


def _by_tag(alive: dict[int, Allocation]) -> dict[str, int]:
    tags: dict[str, int] = defaultdict(int)
    for allocation in alive.values():
        tags[allocation.tag] += allocation.size
    return dict(sorted(tags.items(), key=lambda item: -item[1]))


def _sites(alive: dict[int, Allocation]) -> list[SiteBytes]:
    by_site: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for allocation in alive.values():
        totals = by_site[(allocation.site, allocation.tag)]
        totals[0] += allocation.size
        totals[1] += 1
    return sorted((SiteBytes(site, tag, b, n) for (site, tag), (b, n) in by_site.items()), key=lambda s: -s.bytes)


def _oom_moment(failure: OutOfMemory, alive: dict[int, Allocation], top: int) -> OomMoment:
    live = sum(a.size for a in alive.values())
    tags = _by_tag(alive)
    largest = sorted(alive.values(), key=lambda a: -a.size)[:top]
    return OomMoment(
        failure,
        live,
        None if failure.reserved is None else max(0, failure.reserved - live),
        tags,
        by_role(tags),
        [SiteBytes(a.site, a.tag, a.size, 1) for a in largest],
        _sites(alive)[:top],
    )


def _replay(
    history: AllocationHistory, peak_index: int, samples: list[int], oom_index: Optional[int] = None
) -> tuple[dict[int, Allocation], list[dict[str, int]], dict[int, Allocation], dict[int, Allocation]]:
    """Replay the events: what was alive at the peak, live bytes per tag at each sampled event, what was alive
    after event ``oom_index`` (-1: at the start), and what was alive at the end."""
    alive = dict(history.alive_at_start)
    by_tag_now: dict[str, int] = defaultdict(int)
    for allocation in alive.values():
        by_tag_now[allocation.tag] += allocation.size
    tag_samples: list[dict[str, int]] = []
    at_peak = dict(alive)
    at_oom = dict(alive)
    for index, event in enumerate(history.events):
        if event.action == "alloc":
            alive[event.address] = event.allocation
            by_tag_now[event.allocation.tag] += event.allocation.size
        else:
            ended = alive.pop(event.address, event.allocation)
            by_tag_now[ended.tag] -= event.allocation.size
        if index == peak_index:
            at_peak = dict(alive)
        if index == oom_index:
            at_oom = dict(alive)
        if len(tag_samples) < len(samples) and index == samples[len(tag_samples)]:
            tag_samples.append(dict(by_tag_now))
    return at_peak, tag_samples, at_oom, alive


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


# --------------------------------------------------------------------------------------------- growth


@dataclass(frozen=True)
class MemoryGrowth:
    """An allocation site that ends window after window with more bytes alive: memory that grows with the steps."""

    site: str
    tag: str
    bytes_per_step: float
    """The least over the windows of (bytes it made and kept alive to the window's end) / (the window's steps): what
    every step of every window added at least."""
    windows: list[tuple[str, int]]
    """(window, bytes alive at its end) for each window of the rank."""


def memory_growth(windows: list[tuple[tuple[int, ...], MemorySummary]], least_per_step: float) -> list[MemoryGrowth]:
    """Sites alive at the end of every one of a rank's ``windows`` (at least two: ``(steps, summary)`` each, in
    step order), at least ``least_per_step`` bytes a step in each: what a step adds and never frees (a list the loop
    appends to, a cache without a bound). What one window makes once (a lazy setup) is alive at the end of that
    window only."""
    if len(windows) < 2:
        return []
    kept: dict[tuple[str, str], list[tuple[str, int, int]]] = defaultdict(list)
    for steps, summary in windows:
        name = f"step{steps[0]}" if len(steps) == 1 else f"step{steps[0]}-{steps[-1]}"
        for alive in summary.alive_at_end:
            kept[(alive.site, alive.tag)].append((name, alive.bytes, len(steps) or 1))
    found = []
    for (site, tag), seen in kept.items():
        per_step = [size / steps for _, size, steps in seen]
        if len(seen) == len(windows) and min(per_step) >= least_per_step:
            found.append(MemoryGrowth(site, tag, min(per_step), [(name, size) for name, size, _ in seen]))
    return sorted(found, key=lambda g: -g.bytes_per_step)


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
