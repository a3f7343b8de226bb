"""Stream captures (CUDA graphs being recorded): each thread's capture windows (a begin to the next end), the
launches inside them that queued no device work, and the device's idle time inside them within its traced span;
graph replays counted."""

from __future__ import annotations

import numpy as np

from rlprof.analysis.gpu import intersection_length, merged
from rlprof.analysis.trace_model import (
    BEGIN_CAPTURE,
    END_CAPTURE,
    GRAPH_LAUNCH,
    BuiltTrace,
    CaptureWindow,
    TraceScan,
    register_trace_analysis,
)


@register_trace_analysis(
    "captures",
    reads=(
        "graph_calls",
        "launch_thread",
        "launch_start",
        "launch_correlation",
        "op_correlation",
        "op_start",
        "op_duration",
    ),
)
def captures(trace: BuiltTrace, scan: TraceScan) -> None:
    calls = trace.graph_calls
    scan.graph_launches = sum(1 for *_, call in calls if call == GRAPH_LAUNCH)
    begun: dict[int, float] = {}
    windows = []
    for thread, start, end, call in sorted(calls, key=lambda c: c[1]):
        if call == BEGIN_CAPTURE:
            begun.setdefault(thread, start)
        elif call == END_CAPTURE and thread in begun:
            windows.append((thread, begun.pop(thread), end))
    if not windows:
        return
    threads, starts = trace.launch_thread, trace.launch_start
    worked = np.isin(trace.launch_correlation, trace.op_correlation)
    ops_start = trace.op_start
    ops_end = ops_start + trace.op_duration
    busy = merged(np, ops_start, ops_end)
    first, last = (float(ops_start.min()), float(ops_end.max())) if len(ops_start) else (0.0, 0.0)
    for thread, start, end in windows:
        inside = (threads == thread) & (starts >= start) & (starts <= end) & ~worked
        made = sum(1 for t, s, _, c in calls if t == thread and start <= s <= end and c != GRAPH_LAUNCH)
        low, high = max(start, first), min(end, last)
        idle = 0.0
        if high > low:
            window = (np.array([low]), np.array([high]))
            idle = (high - low) - intersection_length(np, window, busy)
        scan.captures.append(CaptureWindow(start, end, int(inside.sum()) - made, idle))
