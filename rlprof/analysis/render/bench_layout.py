"""``rlprof compare OLD.json NEW.json``: a :class:`~rlprof.analysis.bench_compare.BenchComparison` as a document
(no charts); the command exits 1 when a benchmark regressed."""

from __future__ import annotations

from typing import Optional

from rlprof.analysis.bench_compare import BenchComparison, BenchmarkChange, slowest_growth
from rlprof.analysis.compare import verdict
from rlprof.analysis.document import Document, Section, Table


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.2f}"


def document(comparison: BenchComparison) -> Document:
    title = f"rlprof compare: {' vs '.join(map(str, comparison.files))}"
    return Document(title, sections(comparison), comparison, exit_code=1 if comparison.regressed else 0)


def sections(comparison: BenchComparison) -> list[Section]:
    files = Section(
        "Benchmark files",
        [
            f"{label}: {path} ({machine})"
            for label, path, machine in zip("AB", comparison.files, comparison.machines, strict=True)
        ]
        + (["different machines: medians compare poorly"] if len(set(comparison.machines)) > 1 else [])
        + [f"only in {line}" for line in comparison.only_in_one],
    )
    out = [files, _medians(comparison)]
    stored = [(b.name, s) for b in comparison.benchmarks for s in b.stored_ratios]
    if stored:
        rows = [[name, s.key, f"{s.old:.4g}", f"{s.new:.4g}", f"{s.growth:.2f}x"] for name, s in stored]
        out.append(Section("Ratios the benchmarks stored", tables=[Table(["benchmark", "key", "A", "B", "B/A"], rows)]))
    with_roles = [b for b in comparison.benchmarks if b.roles]
    if with_roles:
        out.append(_roles(with_roles))
    out.append(_verdict(comparison))
    return out


def _medians(comparison: BenchComparison) -> Section:
    rows = [
        [
            b.name,
            _ms(1000 * b.old_median_s),
            _ms(1000 * b.new_median_s),
            verdict(b.interval) if b.interval is not None else f"{b.ratio:.2f}x",
        ]
        for b in comparison.benchmarks
    ]
    section = Section("Median time per round (ms)", tables=[Table(["benchmark", "A", "B", "B/A"], rows)])
    if any(b.interval is None for b in comparison.benchmarks):
        section.lines.append("no interval where a file lacks the rounds (save with --benchmark-save-data)")
    return section


def _roles(benchmarks: list[BenchmarkChange]) -> Section:
    rows = []
    for b in benchmarks:
        for i, role in enumerate(b.roles):
            grew = f"{role.new_ms - role.old_ms:+,.2f}" if role.old_ms is not None and role.new_ms is not None else "-"
            rows.append([b.name if i == 0 else "", role.role, _ms(role.old_ms), _ms(role.new_ms), grew])
    return Section(
        "Time per call by rlprof role (ms; a role's outermost ranges)",
        tables=[Table(["benchmark", "role", "A", "B", "B-A"], rows)],
    )


def _verdict(comparison: BenchComparison) -> Section:
    section = Section("Verdict")
    if comparison.fail_above is None:
        section.lines.append("no threshold given (--fail-above RATIO makes a regression exit 1)")
    elif not comparison.regressed:
        section.lines.append(f"no regression beyond {comparison.fail_above:g}x")
    for b in comparison.regressed:
        culprit = slowest_growth(b)
        where = (
            f"; most of it in role {culprit.role} ({_ms(culprit.old_ms)} -> {_ms(culprit.new_ms)} ms per call)"
            if culprit is not None
            else ""
        )
        section.lines.append(f"REGRESSED {b.name}: " + "; ".join(b.regressions) + where)
    return section
