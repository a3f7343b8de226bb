"""A document as Markdown."""

from __future__ import annotations

from rlprof.analysis.document import Document


def render(document: Document) -> str:
    out = []
    for section in document.sections:
        out.append(f"## {section.title}\n")
        out += [f"- {line.strip()}" if not line.startswith("    ") else f"  - {line.strip()}" for line in section.lines]
        if section.lines:
            out.append("")
        for table in section.tables:
            if table.title:
                out.append(f"**{table.title}**\n")
            out.append("| " + " | ".join(table.columns) + " |")
            out.append("|" + "|".join("---" for _ in table.columns) + "|")
            out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table.rows]
            out.append("")
    return "\n".join(out) + "\n"
