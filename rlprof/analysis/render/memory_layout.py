"""``rlprof memory FILE``: one memory file's summary as a document: a CUDA snapshot (each device; the one that ran
out of memory first, the failure leading) or a host allocation timeline
(:class:`~rlprof.analysis.allocations.MemorySummary`), or an RSS-per-range file
(:class:`~rlprof.analysis.allocations.HostRss`), with the allocation timeline charts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from rlprof.analysis.allocations import HostRss, MemorySummary, OomMoment
from rlprof.analysis.document import Document, Section, Table
from rlprof.analysis.memory_remedies import Remedy, remedies
from rlprof.analysis.render.units import human_bytes, pct


@dataclass(frozen=True)
class DeviceMemory:
    """One device of a memory file: its summary, and what to try when it ran out of memory."""

    summary: MemorySummary
    remedies: list[Remedy]


@dataclass(frozen=True)
class MemoryReading:
    """What ``rlprof memory --format json`` writes."""

    source: str
    devices: list[DeviceMemory]


def summary_document(summaries: list[MemorySummary], source: str) -> Document:
    """The devices of one file (a failing device first)."""
    name = source.replace("\\", "/").rsplit("/", 1)[-1]
    devices = [DeviceMemory(s, remedies(s.oom) if s.oom is not None else []) for s in summaries]
    several = len(devices) > 1
    sections = [
        section
        for device in devices
        for section in summary_sections(device.summary, device.remedies, device.summary.device if several else "")
    ]

    def charts() -> dict[str, list[str]]:
        return {"Memory": [chart for s in summaries for chart in timeline_charts(s)]}

    return Document(f"rlprof memory: {name}", sections, MemoryReading(source, devices), charts)


def rss_document(rss: HostRss) -> Document:
    return Document(
        f"rlprof memory: {rss.source.rsplit('/', 1)[-1]}",
        rss_sections(rss),
        rss,
        lambda: {"Host memory (RSS) per range": rss_charts(rss)},
    )


def summary_sections(summary: MemorySummary, fixes: Sequence[Remedy], device: str = "") -> list[Section]:
    """The failure first (when the history has one), then the peak; ``device`` names them when a file has several."""
    suffix = f" ({device})" if device else ""
    sections = [oom_section(summary, summary.oom, fixes, suffix)] if summary.oom is not None else []
    head = Section(f"Memory{suffix}", [timeline_line(summary)])
    head.lines.append(f"peak reached at event {summary.peak_event} ({_when(summary, summary.peak_time_us)})")
    head.lines += summary.notes
    head.tables.append(bytes_table("role", "live at peak", summary.by_role, "Live bytes at the peak per role"))
    head.tables.append(bytes_table("rlprof range", "live at peak", summary.by_tag, "Live bytes at the peak per range"))
    head.tables.append(
        Table(
            ["allocation site (innermost first)", "range", "live at peak", "allocations"],
            [[s.site, s.tag or "-", human_bytes(s.bytes), str(s.count)] for s in summary.top_sites],
            "Top allocation sites alive at the peak",
        )
    )
    if summary.alive_at_end:
        head.tables.append(
            Table(
                ["allocation site (innermost first)", "range", "alive at the end", "allocations"],
                [[s.site, s.tag or "-", human_bytes(s.bytes), str(s.count)] for s in summary.alive_at_end],
                "Made during the recording and still alive at its end",
            )
        )
    head.tables.append(
        Table(
            ["t µs" if summary.timed else "event", "live after", "action", "size", "range"],
            [
                [f"{t:.0f}", human_bytes(live), action, human_bytes(size), tag or "-"]
                for t, live, action, size, tag in summary.around_peak
            ],
            "Around the peak",
        )
    )
    return [*sections, head]


def oom_section(summary: MemorySummary, moment: OomMoment, fixes: Sequence[Remedy], suffix: str = "") -> Section:
    """The failed request, who held the device then, and what to try."""
    failure = moment.failure
    where = f"in {failure.tag}" if failure.tag else "outside every rlprof range"
    total = f" of {human_bytes(failure.device_total)}" if failure.device_total else ""
    others = f" (and {failure.count - 1} more later)" if failure.count > 1 else ""
    lines = [
        f"{summary.device} ran out of memory{others}: {human_bytes(failure.requested)} requested {where}, with "
        f"{human_bytes(failure.device_free)} free{total} on the device (after event {failure.at_event} of "
        f"{summary.events}, {_when(summary, failure.time_us)})",
        *(
            [
                f"the request alone is larger than the device ({human_bytes(failure.requested)} of "
                f"{human_bytes(failure.device_total or 0)}): no memory freed makes room for it; only a smaller "
                f"request does (what asked for it, below, {where})"
            ]
            if failure.exceeds_device
            else []
        ),
        f"requested at: {failure.site}",
        f"alive then: {human_bytes(moment.live_bytes)} allocated"
        + (
            f", {human_bytes(moment.reserved_unallocated)} reserved but unallocated (fragmentation; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids it)"
            if moment.reserved_unallocated
            else ""
        ),
    ]
    section = Section(f"Out of memory{suffix}", lines)
    section.tables.append(bytes_table("role", "live", moment.by_role, "Live at the failure per role"))
    section.tables.append(bytes_table("range", "live", moment.by_tag, "Live at the failure per range"))
    section.tables.append(
        Table(
            ["size", "allocation site (innermost first)", "range"],
            [[human_bytes(a.bytes), a.site, a.tag or "-"] for a in moment.largest],
            "The largest live allocations",
        )
    )
    section.tables.append(
        Table(
            ["override to try", "lowers", "live bytes it acts on"],
            [[fix.override, fix.acts_on, human_bytes(fix.bytes)] for fix in fixes],
            "What to try: a smaller request" if failure.exceeds_device else "What to try, the most bytes first",
        )
    )
    return section


def rss_sections(rss: HostRss) -> list[Section]:
    section = Section("Host memory (RSS) per range", [f"{rss.source}: {len(rss.records)} ranges"])
    section.tables.append(
        Table(
            ["role", "ranges", "peak RSS", "largest growth in one range"],
            [[r.role, str(r.ranges), human_bytes(r.peak_rss), human_bytes(r.max_growth)] for r in rss.roles],
            "Per role",
        )
    )
    rows = [
        [
            r.label,
            str(r.step),
            human_bytes(r.rss_before),
            human_bytes(r.rss_after),
            human_bytes(r.peak_rss),
            human_bytes(r.peak_rss - r.rss_before),
        ]
        for r in rss.records
    ]
    section.tables.append(
        Table(["range", "step", "RSS before", "RSS after", "peak", "peak - before"], rows, "Per range")
    )
    return [section]


def rss_charts(rss: HostRss) -> list[str]:
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

    figure = go.Figure()
    figure.add_bar(
        x=[f"{i}:{r.label}" for i, r in enumerate(rss.records)],
        y=[(r.peak_rss - r.rss_before) / 2**20 for r in rss.records],
        name="peak - before",
    )
    figure.update_layout(title="RSS growth inside each range (MiB)", height=380)
    return [figure_html(figure)]


def bytes_table(key: str, column: str, sizes: dict[str, int], title: str) -> Table:
    """Bytes per role or per range (``""``: outside every range), in the order of ``sizes``."""
    rows = [[name or "(outside ranges)", human_bytes(size)] for name, size in sizes.items()]
    return Table([key, column], rows, title)


def _when(summary: MemorySummary, time_us: Optional[float]) -> str:
    """A time of the history as milliseconds since its first event, or that the file has none."""
    if time_us is None or not summary.timeline:
        return "no times in the file"
    return f"{(time_us - summary.timeline[0][0]) / 1000:.1f} ms into the recording"


def timeline_line(summary: MemorySummary) -> str:
    head = "OOM snapshot" if summary.oom is not None else f"{summary.device} allocations"
    segments = summary.segments
    extra = (
        f", reserved {human_bytes(segments.reserved)} (free between blocks {human_bytes(segments.free_external)}, "
        f"{pct(segments.free_external / segments.reserved)}; rounding {human_bytes(segments.free_internal)})"
        if segments is not None and segments.reserved
        else ""
    )
    dropped = f", {summary.dropped} oldest events dropped" if summary.dropped else ""
    order = "" if summary.timed else " (the file has no times: events are in order)"
    return (
        f"{head} {summary.source} ({summary.device}): peak {human_bytes(summary.peak_bytes)} (start "
        f"{human_bytes(summary.start_bytes)}, end {human_bytes(summary.end_bytes)}){extra}; "
        f"{summary.events} events{dropped}{order}"
    )


def timeline_charts(summary: MemorySummary) -> list[str]:
    """The allocation timeline (live bytes over time, stacked by rlprof range, the peak marked) and live bytes per
    range at the peak."""
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

    scale = 1000 if summary.timed else 1
    times = [(t - summary.timeline[0][0]) / scale for t, _ in summary.timeline] if summary.timeline else []
    figure = go.Figure(
        go.Scatter(x=times, y=[v / 2**20 for _, v in summary.timeline], mode="lines", name="live", line={"shape": "hv"})
    )
    for tag, sizes in summary.timeline_by_tag.items():  # stacked under the total: which range holds the memory
        figure.add_scatter(
            x=times,
            y=[v / 2**20 for v in sizes],
            mode="lines",
            name=tag or "(outside ranges)",
            stackgroup="ranges",
            line={"shape": "hv", "width": 0.5},
        )
    if summary.timeline:
        peak_at = summary.peak_time_us if summary.peak_time_us is not None else float(summary.peak_event)
        figure.add_scatter(
            x=[(peak_at - summary.timeline[0][0]) / scale],
            y=[summary.peak_bytes / 2**20],
            mode="markers",
            marker={"size": 10, "color": "red"},
            name="peak",
        )
    figure.update_layout(
        title=f"Live allocated memory, {summary.device} ({summary.source.rsplit('/', 1)[-1]})",
        xaxis_title="ms since recording started" if summary.timed else "event (the file has no times)",
        yaxis_title="MiB",
        height=380,
    )
    tags = go.Figure(
        go.Bar(x=[t or "(outside ranges)" for t in summary.by_tag], y=[v / 2**20 for v in summary.by_tag.values()])
    )
    tags.update_layout(title="Live at the peak per rlprof range (MiB)", height=320)
    return [figure_html(figure), figure_html(tags)]
