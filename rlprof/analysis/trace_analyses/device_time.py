"""Each device operation's time to the tracked frames around its launch, and to the device operators under them
(nested frames of one name count it once); operations whose launch is not in the trace are counted apart."""

from __future__ import annotations

import numpy as np

from rlprof.analysis.trace_model import BuiltTrace, TraceScan, register_trace_analysis


@register_trace_analysis(
    "device_time", reads=("op_duration", "op_name", "launch_of_op", "launch_context"), after="frame_totals"
)
def device_time(trace: BuiltTrace, scan: TraceScan) -> None:
    durations = trace.op_duration
    if not len(durations):
        return
    names = trace.op_name.astype(np.int64)
    launch_of_op = trace.launch_of_op
    launched = launch_of_op >= 0
    context = np.full(len(durations), trace.empty_context, dtype=np.int64)
    context[launched] = trace.launch_context[launch_of_op[launched]]
    scan.unlaunched = int((~launched).sum())
    scan.unlaunched_us = float(durations[~launched].sum())
    width = len(trace.names)
    keys, inverse = np.unique(context * width + names, return_inverse=True)
    totals = np.bincount(inverse, weights=durations)
    counts = np.bincount(inverse)
    for key, total, n in zip(keys.tolist(), totals.tolist(), counts.tolist(), strict=True):
        context_id, name_id = divmod(key, width)
        around = trace.contexts[context_id]
        scan.count_op(around, trace.names[name_id], "cuda", n, total)
        for _, label in around:
            if label in scan.ranges:
                scan.ranges[label].cuda_us += total
