"""Self-contained HTML pages: the report's tables and plotly charts, with plotly.js inlined, so a page opens on a
machine without network access and fetches nothing."""

from __future__ import annotations

import html
from typing import Any

from rlprof.analysis.memory import MemorySummary
from rlprof.analysis.render.sections import Section
from rlprof.analysis.report import Report

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } .line { margin: 3px 0; font-size: 14px; } .finding { color: #8a1c00; }
.chart { margin: 8px 0 20px; }
"""


def plotly_js() -> str:
    """The plotly.js bundle shipped with the plotly package (no CDN)."""
    from plotly.offline import get_plotlyjs

    return str(get_plotlyjs())


def figure_html(figure: Any) -> str:
    return f'<div class="chart">{figure.to_html(full_html=False, include_plotlyjs=False)}</div>'


def page(title: str, body: str) -> str:
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style><script type='text/javascript'>{plotly_js()}</script></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>"
    )


def sections_html(sections: list[Section], charts: dict[str, list[str]]) -> str:
    parts = []
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        for line in section.lines:
            css = "line finding" if line.startswith("[") else "line"
            parts.append(f"<div class='{css}'>{html.escape(line)}</div>")
        parts += charts.get(section.title, [])
        for table in section.tables:
            if table.title:
                parts.append(f"<div class='line'><b>{html.escape(table.title)}</b></div>")
            head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
            rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table.rows)
            parts.append(f"<table><tr>{head}</tr>{rows}</table>")
    return "".join(parts)


def render(report: Report, sections: list[Section]) -> str:
    return page(f"rlprof report: {report.run}", sections_html(sections, report_charts(report)))


def report_charts(report: Report) -> dict[str, list[str]]:
    """Charts per section title: step time stacked by phase over the steps, the heaviest range's operators, memory
    per role and the allocation timelines."""
    import plotly.graph_objects as go

    charts: dict[str, list[str]] = {}
    b = report.breakdown
    if b is not None:
        figure = go.Figure()
        for phase in [p.phase for p in b.phases]:
            points = b.per_step.get(phase, [])
            figure.add_bar(x=[s for s, _ in points], y=[v for _, v in points], name=phase)
        step = b.per_step.get("step", [])
        figure.add_scatter(
            x=[s for s, _ in step],
            y=[v for _, v in step],
            name="step (total)",
            mode="lines",
            line={"color": "black", "width": 1},
        )
        figure.update_layout(
            barmode="stack",
            title="Step time per phase (s)",
            xaxis_title="training step",
            yaxis_title="seconds",
            height=420,
        )
        charts["Step breakdown (timing_s/*)"] = [figure_html(figure)]
    if report.traces:
        window = report.traces[0]
        heaviest = next(
            (r for r in window.ranges if r.top_ops and not r.label.startswith("trainer/")),
            window.ranges[0] if window.ranges else None,
        )
        if heaviest is not None and heaviest.top_ops:
            ops = list(reversed(heaviest.top_ops))
            figure = go.Figure(
                go.Bar(x=[o.self_ms for o in ops], y=[f"{o.name} ({o.device})" for o in ops], orientation="h")
            )
            figure.update_layout(
                title=f"Top operators in {heaviest.label} ({window.window}, rank {window.rank}), self ms",
                height=320,
                margin={"l": 260},
            )
            charts["Inside the profiled windows (torch traces)"] = [figure_html(figure)]
    if report.memory is not None:
        charts["Memory"] = memory_charts(report)
    return charts


def memory_charts(report: Report) -> list[str]:
    import plotly.graph_objects as go

    memory = report.memory
    assert memory is not None
    out = []
    if memory.host_rss is not None and memory.host_rss.by_role:
        roles = memory.host_rss.by_role
        figure = go.Figure(go.Bar(x=list(roles), y=[v / 2**20 for v in roles.values()]))
        figure.update_layout(title="Host RSS peak per role (MiB)", height=320)
        out.append(figure_html(figure))
    for summary in memory.timelines + memory.oom:
        out += timeline_charts(summary)
    return out


def timeline_charts(summary: MemorySummary) -> list[str]:
    """The allocation timeline (live bytes over time, stacked by rlprof range, the peak marked) and live bytes per
    range at the peak."""
    import plotly.graph_objects as go

    times = [(t - summary.timeline[0][0]) / 1000 for t, _ in summary.timeline] if summary.timeline else []
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
            x=[(summary.peak_time_us - summary.timeline[0][0]) / 1000],
            y=[summary.peak_bytes / 2**20],
            mode="markers",
            marker={"size": 10, "color": "red"},
            name="peak",
        )
    figure.update_layout(
        title=f"Live allocated memory, {summary.device} ({summary.source.rsplit('/', 1)[-1]})",
        xaxis_title="ms since recording started",
        yaxis_title="MiB",
        height=380,
    )
    tags = go.Figure(
        go.Bar(x=[t or "(outside ranges)" for t in summary.by_tag], y=[v / 2**20 for v in summary.by_tag.values()])
    )
    tags.update_layout(title="Live at the peak per rlprof range (MiB)", height=320)
    return [figure_html(figure), figure_html(tags)]
