"""What every renderer takes: a :class:`Document` of titled sections (lines and tables), the result's data for
JSON, and its charts for HTML. Each analysis result gets one layout function that builds its document
(:mod:`rlprof.analysis.render`); the renderers (terminal, Markdown, JSON, HTML) only format documents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    title: str = ""


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


def no_charts() -> dict[str, list[str]]:
    return {}


@dataclass
class Document:
    """One result, ready to render."""

    title: str
    """The page title (HTML)."""
    sections: list[Section]
    data: Any
    """The result itself (a dataclass or plain data), written by the JSON renderer."""
    charts: Callable[[], dict[str, list[str]]] = no_charts
    """HTML chart fragments per section title, built only when a page is written (plotly is imported then)."""
    exit_code: int = 0
    """What the command returns after rendering (1: a regression was found)."""
