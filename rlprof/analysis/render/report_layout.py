"""``rlprof report``: the :class:`~rlprof.analysis.report_model.Report` as a document: sections of lines and tables,
and its charts (step time per phase, the heaviest range's operators, memory)."""

from __future__ import annotations

from typing import Any

from rlprof.analysis.document import Document, Section, Table
from rlprof.analysis.gpu import GpuSummary
from rlprof.analysis.render.memory_layout import bytes_table, oom_section, timeline_charts, timeline_line
from rlprof.analysis.render.units import human_bytes, ms, pct, seconds, short_name, trend
from rlprof.analysis.report_model import Report, Throughput
from rlprof.analysis.report_sections import register_section, shown


def document(report: Report) -> Document:
    """The report, ready for every renderer: the registered sections that apply to it, in order."""
    return Document(f"rlprof report: {report.run}", shown(report), report, lambda: report_charts(report))


@register_section("failures", applies=lambda report: report.memory is not None and bool(report.memory.oom))
def _failures(report: Report) -> list[Section]:
    """An out-of-memory failure leads: it is what the run ended on."""
    memory = report.memory
    assert memory is not None
    return [oom_section(s, s.oom, memory.remedies) for s in memory.oom if s.oom is not None]


@register_section("overview")
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


def _medians(title: str, rows: list[Throughput]) -> Section:
    table = Table(["metric", "median", "trend"], [[t.metric, f"{t.median:,.4g}", trend(t.growth)] for t in rows])
    return Section(title, tables=[table])


@register_section("stalls", applies=lambda report: bool(report.stalls))
def _stalls(report: Report) -> Section:
    """The watchdog's stalls: who was behind, and where each rank's main thread was."""
    section = Section("Stalls")
    for stall in report.stalls:
        section.lines.append(
            f"step {stall.step}: rank {stall.behind_rank} in {stall.behind_phase} of step {stall.behind_step} for "
            f"{stall.behind_for_s:.0f} s (rank {stall.seen_by} saw {stall.phase} run {stall.elapsed_s:.0f} s, "
            f"threshold {stall.threshold_s:.0f} s); stacks: {stall.folder}"
        )
        section.tables.append(
            Table(
                ["rank", "innermost frames of the main thread (innermost last)"],
                [[str(rank), " <- ".join(reversed(frames)) or "-"] for rank, frames in sorted(stall.innermost.items())],
            )
        )
    return section


@register_section("diagnosis", applies=lambda report: bool(report.findings))
def _diagnosis(report: Report) -> Section:
    section = Section("Diagnosis")
    for finding in report.findings:
        section.lines.append(f"[{finding.rule}] {finding.message}")
        evidence = ", ".join(f"{k}={v:g}" for k, v in finding.evidence.items())
        section.lines.append(f"    evidence: {evidence}")
        if finding.overrides:
            section.lines.append(f"    try: {' '.join(finding.overrides)}")
        section.lines += [f"    not offered: {line}" for line in finding.not_offered]
    return section


LITTLE_GAIN = 1.25
"""An overlap bound under this is called little to gain (a quarter faster at best, before the sync's cost)."""


@register_section("breakdown", applies=lambda report: report.breakdown is not None)
def _breakdown(report: Report) -> Section:
    b = report.breakdown
    assert b is not None
    lines = [
        f"{len(b.steps)} steps (warm-up excluded: {', '.join(map(str, b.warmup)) or 'none'}); step median "
        f"{seconds(b.step_median_s)} s, p90 {seconds(b.step_p90_s)} s",
        "split of the step: " + " | ".join(f"{group} {pct(share)}" for group, share in b.split.items()),
    ]
    if b.idle_share is not None:
        lines.append(f"between steps (validation, checkpoints, logging): {pct(b.idle_share)} of wall time")
    if b.overlap_gain is not None:
        rollout = b.work_split.get("rollout", 0.0)
        little = " (little to gain here)" if b.overlap_gain < LITTLE_GAIN else ""
        lines.append(
            f"overlap bound: generation is {pct(rollout)} of the step, so overlapping it with the rest (one-step-off, "
            f"fully async) would make a step at most {b.overlap_gain:.2f}x faster{little}"
        )
    table = Table(
        ["phase", "group", "median s", "p90 s", "share", "trend"],
        [[p.phase, p.group, seconds(p.median_s), seconds(p.p90_s), pct(p.share), trend(p.growth)] for p in b.phases],
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


@register_section("throughput", applies=lambda report: bool(report.throughput))
def _throughput(report: Report) -> Section:
    return _medians("Throughput", report.throughput)


@register_section("engine", applies=lambda report: bool(report.engine))
def _engine(report: Report) -> Section:
    return _medians("Rollout engine", report.engine)


@register_section("tools", applies=lambda report: bool(report.tools))
def _tools(report: Report) -> Section:
    return _medians("Tool calls", report.tools)


@register_section("pipeline", applies=lambda report: bool(report.pipeline))
def _pipeline(report: Report) -> Section:
    return _medians("Asynchronous pipeline", report.pipeline)


TRACES_TITLE = "Inside the profiled windows (traces)"
RANGE_TITLES = {
    "range": "Ranges",
    "annotation": "User annotations (the trace has no rlprof ranges)",
    "step": "Steps (the trace has neither rlprof ranges nor user annotations)",
    "operator": "Top-level operators (the trace has no ranges, annotations or steps)",
}


@register_section("traces", applies=lambda report: bool(report.traces))
def _traces(report: Report) -> Section:
    section = Section(TRACES_TITLE)
    for window in report.traces:
        steps = ", ".join(f"#{s} {ms(step_ms)} ms" for s, step_ms in window.step_ms.items())
        what = window.source + (f", {window.device}" if window.device else "")
        host = f" on {window.host}" if window.host else ""
        section.lines.append(
            f"{window.window} rank {window.rank}{host} ({what}): steps {steps} ({window.path})"
            if steps
            else f"{window.window}, rank {window.rank}{host} ({what}): no step markers ({window.path})"
        )
        section.lines += [f"    {p}" for p in window.problems]
        if window.captures:
            captured = sum(c.launches for c in window.captures)
            length = sum(c.end_us - c.start_us for c in window.captures)
            idle = sum(c.device_idle_us for c in window.captures)
            section.lines.append(
                f"    CUDA-graph capture: {len(window.captures)} window(s), {ms(length / 1000)} ms, {captured} "
                f"launches captured (no device work: the device idle {ms(idle / 1000)} ms meanwhile, not counted as "
                f"starved); replayed by {window.graph_launches} graph launches"
            )
        where = f"{window.window}, rank {window.rank}"
        device = any(r.cuda_ms for r in window.ranges)
        columns = ["range", "count", "total ms", "self ms", *(["gpu ms", "gpu span ms"] if device else [])]
        rows = [
            [
                short_name(r.label),
                str(r.count),
                ms(r.total_ms),
                ms(r.self_ms),
                *([ms(r.cuda_ms), ms(r.gpu_span_ms)] if device else []),
            ]
            for r in window.ranges
        ]
        section.tables.append(Table(columns, rows, f"{RANGE_TITLES[window.range_kind]}, {where}"))
        if window.annotations:
            rows = [
                [short_name(a.label), str(a.count), ms(a.total_ms), ms(a.self_ms), *([ms(a.cuda_ms)] if device else [])]
                for a in window.annotations
            ]
            columns = ["annotation", "count", "total ms", "self ms", *(["gpu ms"] if device else [])]
            section.tables.append(Table(columns, rows, f"User annotations beside the ranges, {where}"))
        operators = [
            [short_name(r.label), short_name(o.name), o.device, str(o.count), ms(o.self_ms)]
            for r in window.ranges
            for o in [*r.top_ops, *r.top_kernels]
        ]
        if operators:
            title = f"Top operators and kernels under each range (self time; kernels: device time), {where}"
            section.tables.append(Table(["range", "operator", "device", "calls", "self ms"], operators, title))
        if window.gpu is not None:
            section.tables += _gpu_tables(window.gpu, window.gpu_by_step, where)
    if report.stragglers:
        section.tables.append(
            Table(
                ["window", "range", "slowest rank", "slowest / median", "per rank ms", "absent on"],
                [
                    [
                        s.window,
                        s.label,
                        str(s.slowest_rank),
                        f"{s.ratio:.2f}",
                        ", ".join(f"{rank}: {ms(rank_ms)}" for rank, rank_ms in sorted(s.per_rank_ms.items())),
                        ", ".join(map(str, s.absent_on)),
                    ]
                    for s in report.stragglers[:10]
                ],
                "Per rank (median of the ranks that ran the range)",
            )
        )
    return section


def _gpu_tables(gpu: GpuSummary, by_step: dict[int, GpuSummary], where: str) -> list[Table]:
    """The device's work: time by kind, idle share, overlap, launch delay, copies; per step; top kernels."""
    overview = [
        ["span (first start to last end)", ms(gpu.span_us / 1000), ""],
        ["busy (any stream)", ms(gpu.busy_us / 1000), pct(gpu.busy_us / gpu.span_us if gpu.span_us else None)],
        ["idle", ms(gpu.idle_us / 1000), pct(gpu.idle_share)],
        *[
            [f"{kind} (union; sum {ms(gpu.sum_by_kind[kind] / 1000)})", ms(time / 1000), pct(time / gpu.span_us)]
            for kind, time in gpu.time_by_kind.items()
            if gpu.span_us
        ],
    ]
    if gpu.communication_overlap is not None:
        overview.append(["communication overlapped by compute", "", pct(gpu.communication_overlap)])
    if gpu.launch_delay_us is not None:
        delay = gpu.launch_delay_us
        overview.append(
            [
                "launch delay (device start - launch end) p50 / p90",
                f"{delay.p50 / 1000:.3f} / {delay.p90 / 1000:.3f}",
                "",
            ]
        )
    if gpu.launch_us is not None:
        overview.append(
            ["launch call p50 / p90", f"{gpu.launch_us.p50 / 1000:.3f} / {gpu.launch_us.p90 / 1000:.3f}", ""]
        )
    overview.append(["device operations / streams", f"{gpu.operations} / {gpu.streams}", ""])
    tables = [Table(["device", "ms", "share of span"], overview, f"GPU, {where}")]
    if by_step:
        tables.append(
            Table(
                ["step", "span ms", "busy", "idle", "compute ms", "communication ms", "comm. overlapped"],
                [
                    [
                        str(step),
                        ms(s.span_us / 1000),
                        pct(s.busy_us / s.span_us if s.span_us else None),
                        pct(s.idle_share),
                        ms(s.compute_us / 1000),
                        ms(s.time_by_kind.get("communication", 0.0) / 1000),
                        pct(s.communication_overlap),
                    ]
                    for step, s in by_step.items()
                ],
                f"GPU per step (operations by the step their launch fell in), {where}",
            )
        )
    tables.append(
        Table(
            ["kernel", "kind", "count", "total ms"],
            [[short_name(k.name), k.kind, str(k.count), ms(k.total_us / 1000)] for k in gpu.top_kernels],
            f"Top kernels, {where}",
        )
    )
    if gpu.memcpy:
        tables.append(
            Table(
                ["copy", "count", "bytes", "busy ms", "GB/s"],
                [
                    [
                        m.kind,
                        str(m.count),
                        human_bytes(m.bytes),
                        ms(m.busy_us / 1000),
                        f"{m.gbps:.1f}" if m.gbps else "",
                    ]
                    for m in gpu.memcpy
                ],
                f"Memory copies and sets, {where}",
            )
        )
    return tables


@register_section("memory", applies=lambda report: report.memory is not None)
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
    if memory.growth:
        section.tables.append(
            Table(
                ["allocation site", "range", "kept a step", "alive at each window's end"],
                [
                    [
                        g.site,
                        g.tag or "-",
                        human_bytes(int(g.bytes_per_step)),
                        ", ".join(f"{name}: {human_bytes(size)}" for name, size in g.windows),
                    ]
                    for g in memory.growth[:10]
                ],
                "Kept window after window (memray): what each step adds and never frees",
            )
        )
    for summary in memory.timelines + memory.oom:
        section.lines.append(timeline_line(summary))
        name = summary.source.rsplit("/", 1)[-1]
        title = f"Memory per role at the peak of {name} ({summary.device})"
        section.tables.append(bytes_table("role", "live at peak", summary.by_role, title))
        section.tables.append(
            Table(
                ["allocation site", "range", "live at peak", "count"],
                [[s.site, s.tag or "-", human_bytes(s.bytes), str(s.count)] for s in summary.top_sites],
                f"Alive at the peak of {summary.source.rsplit('/', 1)[-1]}",
            )
        )
        section.tables.append(
            bytes_table("range", "live at peak", summary.by_tag, "Live bytes at the peak per rlprof range")
        )
    return section


def report_charts(report: Report) -> dict[str, list[str]]:
    """Charts per section title: step time stacked by phase over the steps, the heaviest range's operators, memory
    per role and the allocation timelines."""
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

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
                go.Bar(
                    x=[o.self_ms for o in ops], y=[f"{short_name(o.name)} ({o.device})" for o in ops], orientation="h"
                )
            )
            figure.update_layout(
                title=f"Top operators in {heaviest.label} ({window.window}, rank {window.rank}), self ms",
                height=320,
                margin={"l": 260},
            )
            charts[TRACES_TITLE] = [figure_html(figure)]
        temporal = _gpu_temporal_chart(report)
        if temporal is not None:
            charts.setdefault(TRACES_TITLE, []).append(figure_html(temporal))
    if report.memory is not None:
        charts["Memory"] = memory_charts(report)
    return charts


def _gpu_temporal_chart(report: Report) -> Any:
    """HTA's temporal breakdown per rank and step: compute, non-compute (communication, copies, sets not under
    compute) and idle, which add up to the device's span."""
    import plotly.graph_objects as go

    bars: list[tuple[str, GpuSummary]] = []
    for window in report.traces:
        steps = window.gpu_by_step or ({} if window.gpu is None else {-1: window.gpu})
        for step, gpu in steps.items():
            bars.append((f"rank {window.rank}" + (f" #{step}" if step >= 0 else f" {window.window}"), gpu))
    if not bars:
        return None
    figure = go.Figure()
    labels = [label for label, _ in bars]
    for name, part in (("compute", "compute_us"), ("non-compute", "non_compute_us"), ("idle", "idle_us")):
        figure.add_bar(x=labels, y=[getattr(gpu, part) / 1e3 for _, gpu in bars], name=name)
    figure.update_layout(
        barmode="stack", title="GPU time per rank and step (ms): compute, non-compute, idle", height=380
    )
    return figure


def memory_charts(report: Report) -> list[str]:
    import plotly.graph_objects as go

    from rlprof.analysis.render.html import figure_html

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
