"""Read NVTX ranges back from an Nsight Systems report, with their domain and category (rlprof's role)."""

from __future__ import annotations

import sqlite3
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

NAME_DOMAIN = 75  # nvtxDomainCreate: text is the domain's name
NAME_CATEGORY = 33  # nvtxDomainNameCategory: category id -> name
RANGE_EVENTS = (59, 60)  # push/pop and start/end ranges


@dataclass(frozen=True)
class NvtxRange:
    domain: str
    category: str
    name: str
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def export_sqlite(nsys: str, report: str | Path, timeout_s: float = 300) -> Path:
    """Export ``report`` (``.nsys-rep``) to SQLite beside it with ``nsys export`` and return its path."""
    report = Path(report)
    out = report.with_suffix(".sqlite")
    subprocess.run(
        [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out), str(report)],
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )
    return out


def read_nvtx_ranges(sqlite_path: str | Path) -> list[NvtxRange]:
    """Every completed NVTX range in an exported report, resolving registered strings and category names (none when
    the report holds no NVTX events at all: nsys then exports no ``NVTX_EVENTS`` table)."""
    with sqlite3.connect(str(sqlite_path)) as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "NVTX_EVENTS" not in tables:
            return []
        strings = dict(db.execute("SELECT id, value FROM StringIds"))
        domains: dict[int, str] = {}
        categories: dict[tuple[int, int], str] = {}
        for event_type, domain_id, category, text in db.execute(
            "SELECT eventType, domainId, category, text FROM NVTX_EVENTS WHERE eventType IN (?, ?)",
            (NAME_DOMAIN, NAME_CATEGORY),
        ):
            if event_type == NAME_DOMAIN:
                domains[domain_id] = text
            else:
                categories[(domain_id, category)] = text
        rows = db.execute(
            "SELECT domainId, category, text, textId, start, end FROM NVTX_EVENTS "
            f"WHERE eventType IN ({','.join('?' * len(RANGE_EVENTS))}) AND end IS NOT NULL",
            RANGE_EVENTS,
        ).fetchall()
    return [
        NvtxRange(
            domain=domains.get(domain_id or 0, ""),
            category=categories.get((domain_id or 0, category), "") if category is not None else "",
            name=text if text is not None else strings.get(text_id, ""),
            start_ns=start,
            end_ns=end,
        )
        for domain_id, category, text, text_id, start, end in rows
    ]


@dataclass(frozen=True)
class RangeTotals:
    role: str
    name: str
    count: int
    total_ns: int


def range_totals(ranges: list[NvtxRange], domain: str = "rlprof") -> list[RangeTotals]:
    """Count and total time of each (role, name) range of ``domain``, the longest total first."""
    durations: dict[tuple[str, str], list[int]] = {}
    for r in ranges:
        if r.domain == domain:
            durations.setdefault((r.category, r.name), []).append(r.duration_ns)
    totals = [RangeTotals(role, name, len(d), sum(d)) for (role, name), d in durations.items()]
    return sorted(totals, key=lambda t: -t.total_ns)


def count_by_role(ranges: list[NvtxRange], domain: str = "rlprof") -> Counter[tuple[str, str]]:
    """How many ranges of each (role, name) the report holds in ``domain``."""
    return Counter((r.category, r.name) for r in ranges if r.domain == domain)
