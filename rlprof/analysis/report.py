"""``rlprof report``: a run's metrics, traces and memory files (read by their sources,
:mod:`rlprof.analysis.sources`) turned into one immutable :class:`~rlprof.analysis.report_model.Report`: where the step
goes, what happens inside the profiled windows (ranges, operators and the device's work), memory per role,
throughput, and a diagnosis (:mod:`rlprof.analysis.diagnose`). Renderers (:mod:`rlprof.analysis.render`) only
format it.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any, Optional

from rlprof.analysis.allocations import MemorySummary, memory_growth, role_of, summarize
from rlprof.analysis.diagnose import diagnose
from rlprof.analysis.memory_remedies import remedies
from rlprof.analysis.report_model import (
    SCHEMA,
    Breakdown,
    MemoryReport,
    OpStat,
    PhaseStat,
    RangeStat,
    RankStraggler,
    Report,
    ReportOptions,
    Throughput,
    WindowTrace,
)
from rlprof.analysis.report_sections import built_parts
from rlprof.analysis.run import Run
from rlprof.analysis.sources import InputFile, SourceError, source
from rlprof.analysis.sources.base import window_name
from rlprof.analysis.sources.host_memory import read_host_rss
from rlprof.analysis.stalls import listed_stalls, read_stalls
from rlprof.analysis.step_series import STEP_KEY, growth, quantile, series, training_records, warmup_steps
from rlprof.analysis.trace_model import ANNOTATION, OPERATOR, RANGE, STEP, TraceScan
from rlprof.metrics.pipeline import PIPELINE_KEYS
from rlprof.metrics.timing import phase_group

GROWTH_FLAG = 0.2
"""A phase whose last-quarter median exceeds its first-quarter median by this much is flagged as growing."""
GROWTH_FLOOR = 64 * 1024.0
"""Bytes a step below which a site kept alive window after window is not listed as growing memory (what a step
leaves for the next one to free is alive at a window's end too: a few kilobytes)."""


def build_report(run: Run, options: Optional[ReportOptions] = None) -> Report:
    """Read everything ``run`` holds (one streaming pass per trace) and diagnose it."""
    options = options or ReportOptions()
    metrics = run.metrics
    notes, missing, unreadable = [*run.notes, *metrics.notes], [], list[str]()
    training = training_records(metrics.records)
    if not training:
        missing.append(
            "no step metrics: run the trainer with trainer.logger including 'file' (metrics.jsonl), or "
            "log timing_s/* with rlprof.tracking.Tracker(..., ['file'])"
        )
    asynchronous = _is_async(training)
    breakdown = _breakdown(training, options, asynchronous) if training else None
    throughput = _throughput(training, breakdown)
    engine = _engine(training, breakdown)
    tools = _tools(training, breakdown)
    pipeline = _medians(training, breakdown, PIPELINE_KEYS, "fully_async/") if asynchronous else []
    traces, stragglers = _traces(run, options, unreadable, missing)
    if not run.traces:
        missing.append(
            "no traces: record some with global_profiler.tool=torch global_profiler.steps=[5] "
            "(a few steps after warm-up), or run under rlprof nsys profile with global_profiler.tool=nsys"
        )
    memory = _memory(run, training, traces, notes, unreadable)
    if memory is None:
        missing.append("no memory files: record them with global_profiler.tool=torch_memory global_profiler.steps=[5]")
    stalls = read_stalls(run.log_dir, notes) if run.log_dir is not None else []
    if not stalls:
        notes += listed_stalls(run.save_paths)
    sources = {
        "metrics": str(run.metrics_path) if run.metrics_path else None,
        "save_paths": [str(p) for p in run.save_paths],
        "traces": len(run.traces),
        "memory_files": len(run.of_category("memory")),
    }
    report = Report(
        schema=SCHEMA,
        run=run.name,
        run_id=run.run_id,
        sources=sources,
        missing=missing,
        notes=notes + unreadable,
        breakdown=breakdown,
        throughput=throughput,
        traces=traces,
        stragglers=stragglers,
        memory=memory,
        unreadable=unreadable,
        stalls=stalls,
        engine=engine,
        tools=tools,
        pipeline=pipeline,
    )
    report = replace(report, findings=diagnose(report, run, options))
    return replace(report, extra=built_parts(run, report, options))


# --------------------------------------------------------------------------------------------- from metrics


def _breakdown(records: list[dict[str, Any]], options: ReportOptions, asynchronous: bool) -> Breakdown:
    warm = warmup_steps(records)
    used = records if options.include_warmup else [r for r in records if r["step"] not in warm] or records
    steps = [v for _, v in series(used, STEP_KEY)]
    step_median = statistics.median(steps)
    phases = []
    names = sorted({k[len("timing_s/") :] for r in used for k in r if k.startswith("timing_s/")} - {"step"})
    for name in names:
        values = [v for _, v in series(used, f"timing_s/{name}")]
        if not values:
            continue
        median = statistics.median(values)
        phases.append(
            PhaseStat(
                name,
                phase_group(name),
                median,
                quantile(values, 0.9),
                median / step_median if step_median > 0 else 0.0,
                growth(values),
            )
        )
    phases.sort(key=lambda p: -p.median_s)
    split = {}
    for group in ("rollout", "training", "other", "unaccounted"):
        values = [v for _, v in series(used, f"timing_share/{group}")]
        if values:
            split[group] = statistics.median(values)
    if not split:  # older logs: from the phases
        for group in ("rollout", "training", "other"):
            split[group] = sum(p.share for p in phases if p.group == group)
        split["unaccounted"] = max(0.0, 1.0 - sum(split.values()))
    work_split = _work_split(used) or {g: v for g, v in split.items() if g != "unaccounted"}
    stragglers, slowest, slowest_rank = {}, {}, {}
    for key in {k for r in used for k in r if k.startswith("timing_ranks/") and k.endswith("/straggler")}:
        phase = key.split("/")[1]
        stragglers[phase] = statistics.median(v for _, v in series(used, key))
        maxima = [v for _, v in series(used, f"timing_ranks/{phase}/max")]
        if maxima and step_median > 0:
            slowest[phase] = statistics.median(maxima) / step_median
        ranks = [int(v) for _, v in series(used, f"timing_ranks/{phase}/slowest_rank")]
        if ranks:
            slowest_rank[phase] = statistics.mode(ranks)
    per_step = {name: series(records, f"timing_s/{name}") for name in ["step", *names]}
    return Breakdown(
        steps=[int(r["step"]) for r in used],
        warmup=warm,
        step_median_s=step_median,
        step_p90_s=quantile(steps, 0.9),
        phases=phases,
        split=split,
        work_split=work_split,
        idle_share=_idle_share(used),
        overlap_gain=None if asynchronous else _overlap_gain(work_split.get("rollout", 0.0)),
        stragglers=dict(sorted(stragglers.items(), key=lambda item: -item[1])),
        slowest_rank_share=slowest,
        slowest_rank=slowest_rank,
        per_step=per_step,
    )


def _work_split(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median over steps of each group's share of the step, every phase counted at its fastest rank's time where
    the ranks' times were logged (``timing_ranks/{phase}/min``), else at the logging rank's own. The rank that
    reached a collective last did not wait in it, so its time is the phase's work; the others' extra is the wait
    for it. Empty when no step logged the spread over ranks."""
    shares: dict[str, list[float]] = {"rollout": [], "training": [], "other": []}
    for record in records:
        step = record.get(STEP_KEY)
        if not isinstance(step, (int, float)) or step <= 0 or not any(k.startswith("timing_ranks/") for k in record):
            continue
        sums = dict.fromkeys(shares, 0.0)
        for key, seconds in record.items():
            if not key.startswith("timing_s/") or key == STEP_KEY or not isinstance(seconds, (int, float)):
                continue
            phase = key[len("timing_s/") :]
            if phase_group(phase) not in sums:  # another pool's work beside the step
                continue
            fastest = record.get(f"timing_ranks/{phase}/min", seconds)
            sums[phase_group(phase)] += min(float(seconds), float(fastest))
        for group, seconds in sums.items():
            shares[group].append(seconds / step)
    return {group: statistics.median(values) for group, values in shares.items() if values}


def _idle_share(records: list[dict[str, Any]]) -> Optional[float]:
    """Median over consecutive logged steps of (wall time between their records - step time) / wall time."""
    shares = []
    for previous, current in itertools.pairwise(records):
        if current["step"] != previous["step"] + 1 or "time" not in current or "time" not in previous:
            continue
        wall = current["time"] - previous["time"]
        if wall > 0:
            shares.append(max(0.0, wall - current[STEP_KEY]) / wall)
    return statistics.median(shares) if len(shares) >= 3 else None


THROUGHPUT_KEYS = (
    "throughput/tokens_per_sec",
    "throughput/samples_per_sec",
    "perf/throughput",
    "perf/rollout_samples_per_s",
)


ENGINE_KEYS = ("rollout/slowest_response_s", "response_length/p99")
"""Generation's long tail, listed with the engine's counters (``rollout/engine/*``)."""


def _throughput(records: list[dict[str, Any]], breakdown: Optional[Breakdown]) -> list[Throughput]:
    return _medians(records, breakdown, THROUGHPUT_KEYS, "perf/mfu/")


def _engine(records: list[dict[str, Any]], breakdown: Optional[Breakdown]) -> list[Throughput]:
    """The engine's counters, when the run logged them (else nothing, the long tail included)."""
    if not any(k.startswith("rollout/engine/") for r in records for k in r):
        return []
    return _medians(records, breakdown, ENGINE_KEYS, "rollout/engine/")


TOOL_KEYS = (
    "rollout/tool_wait_share",
    "rollout/generation_share",
    "num_turns/mean",
    "tool_call_counts/mean",
    "rollout/slowest_trajectory/seconds",
    "rollout/slowest_trajectory/turns",
    "rollout/slowest_trajectory/tool_calls",
    "rollout/slowest_trajectory/length",
    "tools/malformed_calls",
)
"""A multi-turn rollout's summary, listed before each tool's own ``tools/<name>/*``."""


def _tools(records: list[dict[str, Any]], breakdown: Optional[Breakdown]) -> list[Throughput]:
    """The turns and tool calls of a multi-turn rollout, when the run logged them."""
    if not any("num_turns/mean" in r for r in records):
        return []
    return _medians(records, breakdown, TOOL_KEYS, "tools/")


def _overlap_gain(rollout_share: float) -> Optional[float]:
    """A step's speed-up bound with generation overlapped with the rest: ``1 / max(r, 1 - r)`` (None without both)."""
    longer = max(rollout_share, 1.0 - rollout_share)
    return 1.0 / longer if 0.0 < rollout_share < 1.0 else None


def _is_async(records: list[dict[str, Any]]) -> bool:
    """A pipeline's metrics (verl's fully-async trainer's), or generation timed beside the step (its one-step-off
    trainer's ``timing_s/generate_async``)."""
    return any(key.startswith("fully_async/") or key == "timing_s/generate_async" for r in records for key in r)


def _medians(
    records: list[dict[str, Any]], breakdown: Optional[Breakdown], keys: tuple[str, ...], prefix: str
) -> list[Throughput]:
    """Median and trend of each of ``keys``, then of every key starting with ``prefix``, over the breakdown's
    steps."""
    used = [r for r in records if breakdown is None or r["step"] in set(breakdown.steps)]
    keys = (*keys, *sorted({k for r in used for k in r if k.startswith(prefix)} - set(keys)))
    out = []
    for key in keys:
        values = [v for _, v in series(used, key)]
        if values:
            out.append(Throughput(key, statistics.median(values), growth(values)))
    return out


# --------------------------------------------------------------------------------------------- from traces


RANGE_KINDS = (RANGE, ANNOTATION, STEP, OPERATOR)
"""What a window lists as its ranges, the first kind its trace has: rlprof ranges, else user annotations, else
ProfilerStep spans, else top-level operators."""


def _traces(
    run: Run, options: ReportOptions, unreadable: list[str], missing: list[str]
) -> tuple[list[WindowTrace], list[RankStraggler]]:
    windows = []
    for file in sorted(run.traces, key=lambda f: (f.steps, f.rank if f.rank is not None else -1, str(f.path))):
        reader = source(file.format)
        if reader is None:
            continue
        try:
            scans: list[TraceScan] = reader.read(file, run.options)
        except SourceError as exc:
            unreadable.append(str(exc).splitlines()[0])
            continue
        for scan in scans:
            windows.append(_window(file, scan, options.top_ops))
            missing += [line for line in scan.lacks if line not in missing]
    return windows, _rank_stragglers(windows)


def _window(file: InputFile, scan: TraceScan, top: int) -> WindowTrace:
    rank = scan.rank if scan.rank is not None else file.rank if file.rank is not None else 0
    kind = next((k for k in RANGE_KINDS if scan.ranges_of(k)), RANGE)
    return WindowTrace(
        path=scan.path,
        source=scan.source,
        window=file.window_name if file.steps else window_name(sorted(scan.steps)),
        rank=rank,
        host=file.host,
        device=scan.device,
        step_ms={s: d / 1000 for s, d in sorted(scan.steps.items())},
        range_kind=kind,
        ranges=_ranges(scan, kind, top),
        annotations=_ranges(scan, ANNOTATION, top) if kind == RANGE else [],
        captures=scan.captures,
        graph_launches=scan.graph_launches,
        gpu=scan.gpu,
        gpu_by_step=scan.gpu_by_step,
        unlaunched=scan.unlaunched,
        skipped_events=scan.skipped,
        problems=scan.problems
        + (
            [
                f"{scan.unlaunched} device operations ({scan.unlaunched_us / 1000:,.1f} ms) have no launch in the "
                "trace; they are kept, outside every range (HTA drops them)"
            ]
            if scan.unlaunched
            else []
        ),
    )


def _ranges(scan: TraceScan, kind: str, top: int) -> list[RangeStat]:
    ops: dict[tuple[str, str], list[OpStat]] = defaultdict(list)
    for (label, name, device), op in scan.ops.items():
        ops[(label, device)].append(OpStat(name, device, op.count, op.self_us / 1000))
    stats = [
        RangeStat(
            label,
            role_of(label) if kind == RANGE else kind,
            r.count,
            r.total_us / 1000,
            r.self_us / 1000,
            r.cuda_us / 1000,
            r.gpu_span_us / 1000,
            r.allocated_bytes,
            r.peak_allocated,
            sorted(ops.get((label, "cpu"), []), key=lambda o: -o.self_ms)[:top],
            sorted(ops.get((label, "cuda"), []), key=lambda o: -o.self_ms)[:top],
        )
        for label, r in scan.ranges.items()
        if r.kind == kind
    ]
    return sorted(stats, key=lambda r: -r.total_ms)


def _rank_stragglers(windows: list[WindowTrace]) -> list[RankStraggler]:
    """Per window and range, the slowest rank against the median of the ranks that ran the range (a rank whose
    trace lacks the range is listed as absent, not as a straggler)."""
    by_window: dict[str, dict[int, WindowTrace]] = defaultdict(dict)
    for window in windows:
        by_window[window.window][window.rank] = window
    found = []
    for name, ranks in by_window.items():
        if len(ranks) < 2:
            continue
        labels = {r.label for w in ranks.values() for r in w.ranges}
        for label in labels:
            per_rank = {
                rank: r.total_ms for rank, w in ranks.items() for r in w.ranges if r.label == label and r.total_ms > 0
            }
            if len(per_rank) < 2:
                continue
            median = statistics.median(per_rank.values())
            slowest = max(per_rank, key=lambda rank: per_rank[rank])
            absent = sorted(set(ranks) - set(per_rank))
            if median > 0:
                found.append(RankStraggler(name, label, slowest, per_rank[slowest] / median, per_rank, absent))
    return sorted(found, key=lambda s: -s.ratio)


# --------------------------------------------------------------------------------------------- memory


def _memory(
    run: Run, records: list[dict[str, Any]], traces: list[WindowTrace], notes: list[str], unreadable: list[str]
) -> Optional[MemoryReport]:
    rss_files = run.of("host_rss")
    rss = read_host_rss([f.path for f in rss_files]) if rss_files else None
    timelines: list[MemorySummary] = []
    oom: list[MemorySummary] = []
    windows: dict[Optional[int], list[tuple[tuple[int, ...], MemorySummary]]] = defaultdict(list)
    for file in run.of_category("memory"):
        reader = source(file.format)
        if reader is None or not reader.histories:
            continue
        try:
            summaries = [summarize(history) for history in reader.read(file, run.options)]
        except SourceError as exc:
            unreadable.append(str(exc).splitlines()[0])
            continue
        for summary in summaries:  # a snapshot with an OOM in its history is one, whatever its name
            (oom if summary.oom is not None else timelines).append(summary)
        if reader.windows_compose and file.steps:
            windows[file.rank] += [(file.steps, summary) for summary in summaries]
    grown = [g for rank in windows.values() for g in memory_growth(sorted(rank, key=lambda w: w[0]), GROWTH_FLOOR)]
    cuda = any(k == "perf/max_memory_reserved_gb" for r in records for k in r)
    key = "perf/max_memory_reserved_gb" if cuda else "perf/process_rss_gb"
    first_recorded = min((step for file in run.of("host_alloc") for step in file.steps), default=None)
    before = [r for r in records if first_recorded is not None and r["step"] < first_recorded]
    if before and not cuda:  # the profiler's buffers count in the process's RSS from the window on
        notes.append(
            f"the host memory peak over the steps is taken before step {first_recorded}: from there on the "
            "process's memory holds torch_memory's recording buffers"
        )
        records = before
    peaks = [v for _, v in series(records, key)]
    capacity_key = "perf/device_memory_total_gb" if cuda else "perf/cpu_memory_total_gb"
    capacities = [v for _, v in series(records, capacity_key)]
    traced: dict[str, int] = defaultdict(int)
    for window in traces:
        for r in window.ranges:
            if r.peak_allocated:
                traced[r.role] = max(traced[r.role], r.peak_allocated)
    if rss is None and not timelines and not oom and not peaks and not traced:
        return None
    failure = next((s.oom for s in oom if s.oom is not None), None)
    return MemoryReport(
        rss,
        timelines,
        oom,
        remedies(failure, run.setting) if failure is not None else [],
        max(peaks) if peaks else None,
        max(capacities) if capacities else None,
        "cuda" if cuda or run.of("cuda_snapshot") else "cpu",
        dict(sorted(traced.items(), key=lambda item: -item[1])),
        sorted(grown, key=lambda g: -g.bytes_per_step),
    )
