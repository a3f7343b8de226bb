"""``rlprof memory FILE``: one memory file as sections and charts (CUDA snapshots, host timelines, RSS per range)."""

from __future__ import annotations

import json
from pathlib import Path

from rlprof.analysis.memory import MemorySummary
from rlprof.analysis.render.sections import Section, Table, human_bytes, timeline_line


def summary_sections(summary: MemorySummary, oom: bool) -> list[Section]:
    head = Section("Memory", [timeline_line(summary, oom)])
    head.lines.append(f"peak reached at event {summary.peak_event} (t = {summary.peak_time_us:.0f} µs)")
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
            ["t µs", "live after", "action", "size", "range"],
            [
                [f"{t:.0f}", human_bytes(live), action, human_bytes(size), tag or "-"]
                for t, live, action, size, tag in summary.around_peak
            ],
            "Around the peak",
        )
    )
    return [head]


def rss_sections(path: Path) -> list[Section]:
    rows, roles = [], {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("kind") == "range":
            rows.append(
                [
                    f"{record['role']}/{record['name']}",
                    str(record.get("step")),
                    human_bytes(record["rss_before"]),
                    human_bytes(record["rss_after"]),
                    human_bytes(record["peak_rss"]),
                    human_bytes(record["peak_rss"] - record["rss_before"]),
                ]
            )
        elif record.get("kind") == "role_summary":
            roles[record["role"]] = record
    section = Section("Host memory (RSS) per range", [f"{path}: {len(rows)} ranges"])
    section.tables.append(
        Table(
            ["role", "ranges", "peak RSS", "largest growth in one range"],
            [
                [role, str(r["ranges"]), human_bytes(r["peak_rss"]), human_bytes(r["max_rss_growth"])]
                for role, r in roles.items()
            ],
            "Per role",
        )
    )
    section.tables.append(
        Table(["range", "step", "RSS before", "RSS after", "peak", "peak - before"], rows, "Per range")
    )
    return [section]


def rss_chart(path: Path) -> list[str]:
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    ranges = [r for r in records if r.get("kind") == "range"]
    figure = go.Figure()
    figure.add_bar(
        x=[f"{i}:{r['role']}/{r['name']}" for i, r in enumerate(ranges)],
        y=[(r["peak_rss"] - r["rss_before"]) / 2**20 for r in ranges],
        name="peak - before",
    )
    figure.update_layout(title="RSS growth inside each range (MiB)", height=380)
    return [figure_html(figure)]
