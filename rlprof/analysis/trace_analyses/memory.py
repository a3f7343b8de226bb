"""Allocations by range: each ``[memory]`` event counts for every rlprof range open on its thread at its time; on a
thread that opens no range (autograd's backward thread, a worker a range hands work to), for the ranges open at its
time on the others (a sweep per thread)."""

from __future__ import annotations

from rlprof.analysis.trace_model import RANGE, BuiltTrace, TraceScan, register_trace_analysis


@register_trace_analysis("memory", reads=("instances", "memory"), after="frame_totals")
def memory(trace: BuiltTrace, scan: TraceScan) -> None:
    ranges = sorted((start, end, label, t) for t, start, end, _, kind, label in trace.instances if kind == RANGE)
    with_ranges = {t for *_, t in ranges}
    for thread, events in trace.memory.items():
        scan.memory_events += len(events)
        own = thread in with_ranges
        spans = [(start, end, label) for start, end, label, t in ranges if t == thread or not own]
        open_ranges: list[tuple[float, str]] = []
        following = 0
        for time, size, total in sorted(events):
            while following < len(spans) and spans[following][0] <= time:
                open_ranges.append((spans[following][1], spans[following][2]))
                following += 1
            open_ranges = [(end, label) for end, label in open_ranges if end >= time]
            for _, label in open_ranges:
                totals = scan.ranges[label]
                if size > 0:
                    totals.allocated_bytes += size
                totals.peak_allocated = max(totals.peak_allocated, total)
