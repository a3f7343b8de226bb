"""``rlprof memory FILE``: one memory file's summary as a document: a CUDA or OOM snapshot, a host allocation
timeline (:class:`~rlprof.analysis.memory.MemorySummary`) or an RSS-per-range file
(:class:`~rlprof.analysis.memory.HostRss`), with the allocation timeline charts."""

from __future__ import annotations

from rlprof.analysis.document import Document, Section, Table
from rlprof.analysis.memory import HostRss, MemorySummary
from rlprof.analysis.render.units import human_bytes, pct


def summary_document(summary: MemorySummary, oom: bool) -> Document:
    name = summary.source.replace("\\", "/").rsplit("/", 1)[-1]
    return Document(
        f"rlprof memory: {name}",
        summary_sections(summary, oom),
        summary,
        lambda: {"Memory": timeline_charts(summary)},
    )


def rss_document(rss: HostRss) -> Document:
    return Document(
        f"rlprof memory: {rss.source.rsplit('/', 1)[-1]}",
        rss_sections(rss),
        rss,
        lambda: {"Host memory (RSS) per range": rss_charts(rss)},
    )


def summary_sections(summary: MemorySummary, oom: bool) -> list[Section]:
    head = Section("Memory", [timeline_line(summary, oom)])
    when = f"t = {summary.peak_time_us:.0f} µs" if summary.timed else "no times in the file"
    head.lines.append(f"peak reached at event {summary.peak_event} ({when})")
    head.tables.append(
        Table(
            ["rlprof range", "live at peak"],
            [[tag or "(outside ranges)", human_bytes(size)] for tag, size in summary.by_tag.items()],
            "Live bytes at the peak per range",
        )
    )
    head.tables.append(
        Table(
            ["allocation site (innermost first)", "range", "live at peak", "allocations"],
            [[s.site, s.tag or "-", human_bytes(s.bytes), str(s.count)] for s in summary.top_sites],
            "Top allocation sites alive at the peak",
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
    return [head]


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


def timeline_line(summary: MemorySummary, oom: bool) -> str:
    head = "OOM snapshot" if oom else f"{summary.device} allocations"
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
        f"{head} {summary.source}: peak {human_bytes(summary.peak_bytes)} (start "
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
        figure.add_scatter(
            x=[(summary.peak_time_us - summary.timeline[0][0]) / scale],
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
