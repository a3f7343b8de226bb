"""The report as sections of lines and tables, the one layout every text renderer prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlprof.analysis.memory import MemorySummary
from rlprof.analysis.report import Report


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


def _ms(value: float) -> str:
    return f"{value:,.1f}"


def _s(value: float) -> str:
    return f"{value:.3g}"


def _pct(value: Optional[float]) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def _growth(value: Optional[float]) -> str:
    if value is None:
        return ""
    return f"{100 * value:+.0f}%" + (" (grows)" if value >= 0.2 else "")


def human_bytes(value: float) -> str:
    """``512 B``, ``1.5 KiB``, ``12.0 MiB``, ``1.234 GiB``."""
    size = abs(value)
    if size >= 2**30:
        return f"{value / 2**30:.3f} GiB"
    if size >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB" if size >= 2**10 else f"{value:.0f} B"


def sections(report: Report) -> list[Section]:
    out = [_overview(report)]
    if report.findings:
        out.append(_diagnosis(report))
    if report.breakdown is not None:
        out.append(_breakdown(report))
    if report.throughput:
        out.append(
            Section(
                "Throughput",
                tables=[
                    Table(
                        ["metric", "median", "trend"],
                        [[t.metric, f"{t.median:,.4g}", _growth(t.growth)] for t in report.throughput],
                    )
                ],
            )
        )
    if report.traces:
        out.append(_traces(report))
    if report.memory is not None:
        out.append(_memory(report))
    return out


def _overview(report: Report) -> Section:
    lines = [f"run: {report.run}" + (f" (id {report.run_id})" if report.run_id else "")]
    sources = report.sources
    lines.append(
        f"metrics: {sources.get('metrics') or 'none'}; traces: {sources.get('traces', 0)}; memory files: "
        f"{sources.get('memory_files', 0)}"
    )
    lines += [f"missing: {m}" for m in report.missing]
    lines += [f"note: {n}" for n in report.notes]
    return Section("Report", lines)


def _diagnosis(report: Report) -> Section:
    section = Section("Diagnosis")
    for finding in report.findings:
        section.lines.append(f"[{finding.rule}] {finding.message}")
        evidence = ", ".join(f"{k}={v:g}" for k, v in finding.evidence.items())
        section.lines.append(f"    evidence: {evidence}")
        if finding.overrides:
            section.lines.append(f"    try: {' '.join(finding.overrides)}")
    return section


def _breakdown(report: Report) -> Section:
    b = report.breakdown
    assert b is not None
    lines = [
        f"{len(b.steps)} steps (warm-up excluded: {', '.join(map(str, b.warmup)) or 'none'}); step median "
        f"{_s(b.step_median_s)} s, p90 {_s(b.step_p90_s)} s",
        "split of the step: " + " | ".join(f"{group} {_pct(share)}" for group, share in b.split.items()),
    ]
    if b.idle_share is not None:
        lines.append(f"between steps (validation, checkpoints, logging): {_pct(b.idle_share)} of wall time")
    table = Table(
        ["phase", "group", "median s", "p90 s", "share", "trend"],
        [[p.phase, p.group, _s(p.median_s), _s(p.p90_s), _pct(p.share), _growth(p.growth)] for p in b.phases],
    )
    section = Section("Step breakdown (timing_s/*)", lines, [table])
    if b.stragglers:
        section.tables.append(
            Table(
                ["phase", "max / mean over ranks", "slowest rank"],
                [[phase, f"{ratio:.2f}", str(b.slowest_rank.get(phase, ""))] for phase, ratio in b.stragglers.items()],
                "Ranks (timing_ranks/*/straggler, median over steps)",
            )
        )
    return section


def _traces(report: Report) -> Section:
    section = Section("Inside the profiled windows (torch traces)")
    for window in report.traces:
        steps = ", ".join(f"#{s} {_ms(ms)} ms" for s, ms in window.step_ms.items())
        section.lines.append(
            f"{window.window} rank {window.rank}{f' on {window.host}' if window.host else ''}: "
            f"steps {steps or 'none'} ({window.path})"
        )
        section.lines += [f"    {p}" for p in window.problems]
        cuda = any(r.cuda_ms for r in window.ranges)
        columns = ["range", "count", "total ms", "self ms", *(["cuda ms"] if cuda else [])]
        rows = [
            [r.label, str(r.count), _ms(r.total_ms), _ms(r.self_ms), *([_ms(r.cuda_ms)] if cuda else [])]
            for r in window.ranges
        ]
        section.tables.append(Table(columns, rows, f"Ranges, {window.window}, rank {window.rank}"))
        operators = [
            [r.label, o.name, o.device, str(o.count), _ms(o.self_ms)] for r in window.ranges for o in r.top_ops
        ]
        if operators:
            title = f"Top operators under each range (self time), {window.window}, rank {window.rank}"
            section.tables.append(Table(["range", "operator", "device", "calls", "self ms"], operators, title))
    if report.stragglers:
        section.tables.append(
            Table(
                ["window", "range", "slowest rank", "slowest / median", "per rank ms"],
                [
                    [
                        s.window,
                        s.label,
                        str(s.slowest_rank),
                        f"{s.ratio:.2f}",
                        ", ".join(f"{rank}: {_ms(ms)}" for rank, ms in sorted(s.per_rank_ms.items())),
                    ]
                    for s in report.stragglers[:10]
                ],
                "Per rank",
            )
        )
    return section


def _memory(report: Report) -> Section:
    memory = report.memory
    assert memory is not None
    section = Section("Memory")
    if memory.peak_from_metrics_gb is not None:
        capacity = f" of {memory.capacity_gb:.1f} GB" if memory.capacity_gb else ""
        section.lines.append(f"peak over the steps ({memory.device}): {memory.peak_from_metrics_gb:.2f} GB{capacity}")
    if memory.traced_by_role:
        section.tables.append(
            Table(
                ["role", "peak allocated"],
                [[role, human_bytes(peak)] for role, peak in memory.traced_by_role.items()],
                "Memory per role (allocator total inside its ranges, torch traces)",
            )
        )
    if memory.host_rss is not None:
        rss = memory.host_rss
        section.lines.append(f"host RSS peak inside a range: {human_bytes(rss.peak_rss)}")
        section.tables.append(
            Table(
                ["role", "peak RSS"],
                [[role, human_bytes(peak)] for role, peak in rss.by_role.items()],
                "Host memory per role (RSS peak inside its ranges)",
            )
        )
        section.tables.append(
            Table(
                ["range", "count", "peak RSS", "largest growth in one range"],
                [[r.label, str(r.count), human_bytes(r.peak_rss), human_bytes(r.max_growth)] for r in rss.ranges[:10]],
                "Ranges that grow memory most",
            )
        )
    for summary in memory.timelines + memory.oom:
        section.lines.append(timeline_line(summary, oom=summary in memory.oom))
        section.tables.append(
            Table(
                ["allocation site", "range", "live at peak", "count"],
                [[s.site, s.tag or "-", human_bytes(s.bytes), str(s.count)] for s in summary.top_sites],
                f"Alive at the peak of {summary.source.rsplit('/', 1)[-1]}",
            )
        )
        section.tables.append(
            Table(
                ["range", "live at peak"],
                [[tag or "(outside ranges)", human_bytes(size)] for tag, size in summary.by_tag.items()],
                "Live bytes at the peak per rlprof range",
            )
        )
    return section


def timeline_line(summary: MemorySummary, oom: bool) -> str:
    head = "OOM snapshot" if oom else f"{summary.device} allocations"
    extra = f", reserved {human_bytes(summary.reserved_bytes)}" if summary.reserved_bytes else ""
    frag = f", fragmentation {_pct(summary.fragmentation)}" if summary.fragmentation is not None else ""
    dropped = f", {summary.dropped} oldest events dropped" if summary.dropped else ""
    return (
        f"{head} {summary.source}: peak {human_bytes(summary.peak_bytes)} (start "
        f"{human_bytes(summary.start_bytes)}, end {human_bytes(summary.end_bytes)}){extra}{frag}; "
        f"{summary.events} events{dropped}"
    )
