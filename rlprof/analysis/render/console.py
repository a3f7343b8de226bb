"""A document in the terminal (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table as RichTable

from rlprof.analysis.document import Document


def render(document: Document, console: Console) -> None:
    for section in document.sections:
        console.rule(f"[bold]{section.title}")
        for line in section.lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        for table in section.tables:
            rich_table = RichTable(title=table.title or None, title_justify="left")
            for i, column in enumerate(table.columns):
                rich_table.add_column(
                    column, justify="left" if i == 0 or not _numeric(table.rows, i) else "right", overflow="fold"
                )
            for row in table.rows:
                rich_table.add_row(*row)
            console.print(rich_table)


def _numeric(rows: list[list[str]], column: int) -> bool:
    values = [row[column] for row in rows if row[column]]
    return bool(values) and all(
        v.replace(",", "").replace(".", "").replace("%", "").lstrip("+-").split(" ")[0].isdigit() for v in values
    )
