"""Tracked frames' counts, total and self times, and CPU operators' self time under every tracked frame around
them (the ``""`` label: outside every range)."""

from __future__ import annotations

from rlprof.analysis.trace_model import (
    NESTING,
    OP,
    OPERATOR,
    BuiltTrace,
    RangeTotals,
    TraceScan,
    register_trace_analysis,
)


@register_trace_analysis("frame_totals", reads=("bucket_counts", "bucket_totals", "bucket_selfs"))
def frame_totals(trace: BuiltTrace, scan: TraceScan) -> None:
    counts, totals, selfs = trace.bucket_counts, trace.bucket_totals, trace.bucket_selfs
    for bucket in counts.nonzero()[0].tolist():
        kind, name, outer = trace.buckets[bucket]
        count, total, own = int(counts[bucket]), float(totals[bucket]), float(selfs[bucket])
        if kind in (OP, OPERATOR):
            scan.count_op(trace.contexts[outer], name, "cpu", count, own)
        if kind in (OP, NESTING):
            continue
        row_totals = scan.ranges.get(name)
        if row_totals is None:
            row_totals = scan.ranges[name] = RangeTotals(name, kind)
        row_totals.count += count
        row_totals.total_us += total
        row_totals.self_us += own
