"""Nsight Systems reports: ``.sqlite`` exports (any nsys version's schema: 2022.4 to 2026.x seen) and ``.nsys-rep``
reports, exported to SQLite with the nsys the user has (``nsys export --type sqlite``, found as ``rlprof nsys
profile`` finds it). Read into the :mod:`rlprof.analysis.trace_model`, one :class:`TraceScan` per process that
recorded something:

- NVTX push/pop and start/end ranges are frames of their thread: in domain ``rlprof`` a range ``role/name`` (the
  category is the role), the markers ``step N`` of category ``step`` the steps, the mark ``rank R`` the process's
  rank; in any other domain an annotation named ``domain:text`` as nsys names it (``cuBLAS:cublasCreate_v2``), in
  the default domain by its text.
- CUDA runtime calls (``CUPTI_ACTIVITY_KIND_RUNTIME``) are the launches; kernels, copies and sets
  (``CUPTI_ACTIVITY_KIND_KERNEL/MEMCPY/MEMSET``) the device operations, matched by ``correlationId``. So each range
  gets the GPU time of the kernels launched inside it and its GPU projection (what ``nsys stats --report
  nvtxgpuproj`` computes), and the report the same GPU analyses as a torch trace.

Times are nanoseconds in the report, microseconds in the model. The database is opened read-only; reading is
bounded by the report's own size.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.sources.base import InputFile, ReadOptions, Source, SourceError
from rlprof.analysis.trace_builder import TraceBuilder
from rlprof.analysis.trace_model import (
    ANNOTATION,
    KERNEL,
    MEMCPY,
    MEMSET,
    RANGE,
    STEP,
    STEP_PREFIX,
    TraceScan,
)

DOMAIN = "rlprof"
NAME_DOMAIN = 75  # nvtxDomainCreate: text is the domain's name
NAME_CATEGORY = 33  # nvtxDomainNameCategory: category id -> name
MARK = 34  # nvtxMark
RANGE_EVENTS = (59, 60)  # push/pop and start/end ranges
SQLITE_MAGIC = b"SQLite format 3\x00"
_STEP_MARKER = re.compile(r"^step (\d+)$")
_RANK_MARK = re.compile(r"^rank (\d+) of (\d+)$")
COPY_KINDS = {
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
}
"""CUPTI's memcpy kinds (``copyKind``), named as kineto names its copies (``Memcpy HtoD``)."""


class NsysReportError(SourceError):
    """Not a readable nsys report; the message says why in one line."""


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


@dataclass(frozen=True)
class RangeTotals:
    role: str
    name: str
    count: int
    total_ns: int


def export_sqlite(nsys: str, report: str | Path, timeout_s: float = 300) -> Path:
    """Export ``report`` (``.nsys-rep``) to SQLite beside it with ``nsys export`` and return its path."""
    report = Path(report)
    out = report.with_suffix(".sqlite")
    try:
        subprocess.run(
            [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out), str(report)],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.CalledProcessError as exc:
        said = " ".join((exc.stdout + exc.stderr).decode("utf-8", "replace").split())[:300]
        raise NsysReportError(
            f"{report}: {nsys} cannot export it ({said}); export it with the nsys that recorded it "
            f"(nsys export --type sqlite {report}) and give the .sqlite"
        ) from None
    except subprocess.TimeoutExpired:
        raise NsysReportError(f"{report}: {nsys} export took more than {timeout_s:.0f} s") from None
    return out


def connect(path: Path) -> sqlite3.Connection:
    """The exported report, read-only (no write, no journal), text decoded leniently."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        raise NsysReportError(f"{path} is not a readable SQLite report ({exc})") from None
    db.text_factory = lambda raw: raw.decode("utf-8", "replace")
    return db


def _tables(db: sqlite3.Connection) -> dict[str, set[str]]:
    names = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {name: {row[1] for row in db.execute(f"PRAGMA table_info({name})")} for name in names}


def _nvtx_names(db: sqlite3.Connection) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    domains: dict[int, str] = {}
    categories: dict[tuple[int, int], str] = {}
    for event_type, domain_id, category, text in db.execute(
        "SELECT eventType, domainId, category, text FROM NVTX_EVENTS WHERE eventType IN (?, ?)",
        (NAME_DOMAIN, NAME_CATEGORY),
    ):
        if event_type == NAME_DOMAIN:
            domains[domain_id] = text
        else:
            categories[(domain_id or 0, category)] = text
    return domains, categories


def read_nvtx_ranges(sqlite_path: str | Path) -> list[NvtxRange]:
    """Every completed NVTX range in an exported report, resolving registered strings and category names (none when
    the report holds no NVTX events at all: nsys then exports no ``NVTX_EVENTS`` table)."""
    with connect(Path(sqlite_path)) as db:
        if "NVTX_EVENTS" not in _tables(db):
            return []
        strings = dict(db.execute("SELECT id, value FROM StringIds"))
        domains, categories = _nvtx_names(db)
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


def range_totals(ranges: list[NvtxRange], domain: str = DOMAIN) -> list[RangeTotals]:
    """Count and total time of each (role, name) range of ``domain``, the longest total first."""
    durations: dict[tuple[str, str], list[int]] = {}
    for r in ranges:
        if r.domain == domain:
            durations.setdefault((r.category, r.name), []).append(r.duration_ns)
    totals = [RangeTotals(role, name, len(d), sum(d)) for (role, name), d in durations.items()]
    return sorted(totals, key=lambda t: -t.total_ns)


def count_by_role(ranges: list[NvtxRange], domain: str = DOMAIN) -> Counter[tuple[str, str]]:
    """How many ranges of each (role, name) the report holds in ``domain``."""
    return Counter((r.category, r.name) for r in ranges if r.domain == domain)


# --------------------------------------------------------------------------------------------- into the model


def _process(global_id: int) -> int:
    """The process of an nsys ``globalTid``/``globalPid`` (``... | pid << 24 | tid``)."""
    return (global_id >> 24) & 0xFFFFFF


def scan_report(path: Path) -> list[TraceScan]:
    """One :class:`TraceScan` per process of the exported report ``path`` that holds NVTX ranges or CUDA work (one
    empty scan when none does), each saying which of the tables a reader looks for the export lacks."""
    with connect(path) as db:
        try:
            tables = _tables(db)
        except sqlite3.DatabaseError as exc:
            raise NsysReportError(f"{path} is not a readable SQLite report ({exc})") from None
        if "StringIds" not in tables:
            raise NsysReportError(f"{path} is a SQLite file but not an nsys report (no StringIds table)")
        strings = dict(db.execute("SELECT id, value FROM StringIds"))
        builders: dict[int, TraceBuilder] = {}

        def builder(process: int) -> TraceBuilder:
            found = builders.get(process)
            if found is None:
                found = builders[process] = TraceBuilder(TraceScan(str(path), source="nsys_report"))
            return found

        if "NVTX_EVENTS" in tables:
            _read_nvtx(db, strings, builder)
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            for start, end, thread, correlation in db.execute(
                "SELECT start, end, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME ORDER BY start"
            ):
                builder(_process(thread)).launch(thread, start / 1e3, (end - start) / 1e3, correlation)
        _read_device_ops(db, tables, strings, builder)
        gpu = _gpu_names(db, tables)
    lacks = [
        f"{path.name} has no {table} table: {meaning}"
        for table, meaning in (
            ("CUPTI_ACTIVITY_KIND_KERNEL", "the capture recorded no GPU activity (profile with nsys -t cuda,nvtx, "
             "on a machine whose GPU nsys can trace)"),
            ("NVTX_EVENTS", "no ranges were recorded (global_profiler.tool=nsys under rlprof nsys profile, or "
             "nsys -t nvtx)"),
        )
        if table not in tables
    ]  # fmt: skip
    if not builders:
        builder(0)
    scans = []
    for process, found in sorted(builders.items()):
        found.scan.device = found.scan.device or gpu
        found.scan.lacks = lacks
        scan = found.finish(f"{path.name} (process {process})")
        scans.append(scan)
    for index, scan in enumerate(scans):  # without a rank mark: the processes in pid order
        if scan.rank is None:
            scan.rank = index if len(scans) > 1 else 0
    return scans


def _read_nvtx(db: sqlite3.Connection, strings: dict[int, str], builder: Any) -> None:
    domains, categories = _nvtx_names(db)
    rows = db.execute(
        "SELECT start, end, eventType, domainId, category, text, textId, globalTid FROM NVTX_EVENTS "
        f"WHERE eventType IN ({MARK}, {', '.join(map(str, RANGE_EVENTS))}) ORDER BY globalTid, start, end DESC"
    )
    for start, end, event_type, domain_id, category, text, text_id, thread in rows:
        name = text if text is not None else strings.get(text_id, "")
        domain = domains.get(domain_id or 0, "")
        role = categories.get((domain_id or 0, category), "") if category is not None else ""
        if thread is None:
            continue
        target = builder(_process(thread))
        if event_type == MARK:
            found = _RANK_MARK.match(name or "")
            if domain == DOMAIN and role == "rank" and found:
                target.scan.rank, target.scan.world_size = int(found.group(1)), int(found.group(2))
            continue
        if end is None or end < start:
            continue
        step = _STEP_MARKER.match(name or "") if domain == DOMAIN and role == "step" else None
        if step is not None:
            label, kind = f"{STEP_PREFIX}{step.group(1)}", STEP
        elif domain == DOMAIN and role:
            label, kind = f"{role}/{name}", RANGE
        else:  # another library's range: named as nsys names it, domain:name (the default domain: name)
            label, kind = f"{domain}:{name}" if domain else name or "(unnamed NVTX range)", ANNOTATION
        target.frame(thread, start / 1e3, (end - start) / 1e3, label, kind)
        target.scan.events += 1


def _kernel_names(tables: dict[str, set[str]]) -> str:
    columns = tables.get("CUPTI_ACTIVITY_KIND_KERNEL", set())
    return next((c for c in ("demangledName", "shortName", "mangledName") if c in columns), "")


def _read_device_ops(
    db: sqlite3.Connection, tables: dict[str, set[str]], strings: dict[int, str], builder: Any
) -> None:
    name_column = _kernel_names(tables)
    if name_column:
        for start, end, stream, correlation, process, name_id in db.execute(
            f"SELECT start, end, streamId, correlationId, globalPid, {name_column} FROM CUPTI_ACTIVITY_KIND_KERNEL"
        ):
            name = strings.get(name_id, str(name_id))
            builder(_process(process)).device_op(start / 1e3, (end - start) / 1e3, name, KERNEL, stream, correlation, 0)
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        for start, end, stream, correlation, process, size, kind in db.execute(
            "SELECT start, end, streamId, correlationId, globalPid, bytes, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"
        ):
            name = f"Memcpy {COPY_KINDS.get(kind, 'Unknown')}"
            builder(_process(process)).device_op(
                start / 1e3, (end - start) / 1e3, name, MEMCPY, stream, correlation, size or 0
            )
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        for start, end, stream, correlation, process, size in db.execute(
            "SELECT start, end, streamId, correlationId, globalPid, bytes FROM CUPTI_ACTIVITY_KIND_MEMSET"
        ):
            builder(_process(process)).device_op(
                start / 1e3, (end - start) / 1e3, "Memset (Device)", MEMSET, stream, correlation, size or 0
            )


def _gpu_names(db: sqlite3.Connection, tables: dict[str, set[str]]) -> Optional[str]:
    if "TARGET_INFO_GPU" in tables and "name" in tables["TARGET_INFO_GPU"]:
        row = db.execute("SELECT name FROM TARGET_INFO_GPU LIMIT 1").fetchone()
        return str(row[0]) if row else None
    return None


class NsysReportSource(Source):
    format = "nsys_report"
    category = "trace"
    description = "an Nsight Systems report (.nsys-rep, or its .sqlite export)"

    def claims(self, path: Path, head: bytes) -> bool:
        if head.startswith(SQLITE_MAGIC):
            return b"StringIds" in head or b"NVTX_EVENTS" in head or b"CUPTI_ACTIVITY" in head
        return path.suffix in (".nsys-rep", ".qdrep")

    def read(self, file: InputFile, options: ReadOptions) -> list[TraceScan]:
        path = file.path
        if path.suffix in (".nsys-rep", ".qdrep"):
            path = exported(path, options)
        return scan_report(path)


def exported(report: Path, options: ReadOptions) -> Path:
    """The SQLite export of ``report``: the one beside it when it is newer than the report, else a fresh export by
    the nsys the user has (``--nsys``, else ``nsys`` on PATH)."""
    sqlite = report.with_suffix(".sqlite")
    if sqlite.exists() and sqlite.stat().st_mtime >= report.stat().st_mtime:
        return sqlite
    nsys = options.nsys or shutil.which("nsys")
    if nsys is None:
        raise NsysReportError(
            f"{report}: reading an .nsys-rep needs nsys to export it (pass --nsys PATH, or give its .sqlite export: "
            f"nsys export --type sqlite {report})"
        )
    return export_sqlite(nsys, report)
