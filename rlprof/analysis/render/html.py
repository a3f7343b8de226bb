"""Self-contained HTML pages of documents: their tables and plotly charts, with plotly.js inlined, so a page opens
on a machine without network access and fetches nothing."""

from __future__ import annotations

import html
from typing import Any

from rlprof.analysis.document import Document, Section

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


def render(document: Document) -> str:
    return page(document.title, sections_html(document.sections, document.charts()))
