"""Each range and annotation instance's GPU projection (:attr:`~rlprof.analysis.trace_model.RangeTotals.gpu_span_us`),
thread by thread: an instance spans the device operations of the launches made while it is open."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from rlprof.analysis.trace_model import ANNOTATION, RANGE, BuiltTrace, TraceScan, register_trace_analysis


@register_trace_analysis(
    "gpu_projection",
    reads=("op_start", "op_duration", "launch_of_op", "launch_thread", "launch_start", "instances"),
    after="frame_totals",
)
def gpu_projection(trace: BuiltTrace, scan: TraceScan) -> None:
    launches = len(trace.launch_start)
    if not launches or not len(trace.op_start):
        return
    first = np.full(launches, np.inf)
    last = np.full(launches, -np.inf)
    launch_of_op = trace.launch_of_op
    launched = launch_of_op >= 0
    starts = trace.op_start
    np.minimum.at(first, launch_of_op[launched], starts[launched])
    np.maximum.at(last, launch_of_op[launched], (starts + trace.op_duration)[launched])
    with_ops = np.isfinite(first)
    by_thread: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for thread, start, end, _, kind, label in trace.instances:
        if kind in (RANGE, ANNOTATION):
            by_thread[thread].append((start, end, label))
    for thread, spans in by_thread.items():
        thread_id = trace.thread_ids.get(thread)
        if thread_id is None:
            continue
        mine = np.nonzero((trace.launch_thread == thread_id) & with_ops)[0]
        if not len(mine):
            continue
        mine = mine[np.argsort(trace.launch_start[mine], kind="stable")]
        times, lows, highs = trace.launch_start[mine], first[mine], last[mine]
        for start, end, label in spans:  # the launches at start <= time < end, a slice of the sorted ones
            low, high = np.searchsorted(times, (start, end), side="left").tolist()
            if high > low and (span := float(highs[low:high].max() - lows[low:high].min())) > 0:
                scan.ranges[label].gpu_span_us += span
