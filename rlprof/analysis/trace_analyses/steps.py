"""Steps (``ProfilerStep#N``): each one's duration, the device's work over the whole trace and per step (a device
operation belongs to the step whose span holds its launch, on any thread, or without a launch its own start), and
each step's device time."""

from __future__ import annotations

from typing import Any

import numpy as np

from rlprof.analysis.gpu import DeviceOps, summarize_device
from rlprof.analysis.trace_model import (
    STEP,
    STEP_PREFIX,
    BuiltTrace,
    TraceScan,
    register_trace_analysis,
    step_number,
)


@register_trace_analysis(
    "steps",
    reads=(
        "instances",
        "op_start",
        "op_duration",
        "op_name",
        "op_kind",
        "op_stream",
        "op_bytes",
        "launch_of_op",
        "launch_start",
        "launch_duration",
    ),
    after="frame_totals",
)
def steps(trace: BuiltTrace, scan: TraceScan) -> None:
    spans = sorted(
        (start, end, number, duration)
        for _, start, end, duration, kind, label in trace.instances
        if kind == STEP and (number := step_number(label)) is not None
    )
    scan.steps = {number: duration for _, _, number, duration in spans}
    if not len(trace.op_start):
        return
    ops = _device_ops(trace)
    of_step = _step_of_each_op(trace, ops, spans)
    scan.gpu = summarize_device(ops, trace.names)
    for _, _, number, _ in spans:
        selected = of_step == number
        if selected.any():
            scan.gpu_by_step[number] = summarize_device(ops.select(selected), trace.names)
            scan.ranges[f"{STEP_PREFIX}{number}"].cuda_us = float(ops.duration[selected].sum())


def _device_ops(trace: BuiltTrace) -> DeviceOps:
    starts, durations, launch_of_op = trace.op_start, trace.op_duration, trace.launch_of_op
    launched = launch_of_op >= 0
    index = np.maximum(launch_of_op, 0)
    launch_start, launch_duration = trace.launch_start, trace.launch_duration
    nan = np.full(len(starts), np.nan)
    return DeviceOps(
        start=starts,
        end=starts + durations,
        name=trace.op_name,
        kind=trace.op_kind,
        stream=trace.op_stream,
        bytes=trace.op_bytes,
        launch_end=np.where(launched, (launch_start + launch_duration)[index], np.nan) if len(launch_start) else nan,
        launch_duration=np.where(launched, launch_duration[index], np.nan) if len(launch_start) else nan,
        duration=durations,
    )


def _step_of_each_op(trace: BuiltTrace, ops: DeviceOps, spans: list[tuple[float, float, int, float]]) -> Any:
    """The step of each device operation (-1: none): by its launch's start, else its own."""
    launch_start, launch_of_op = trace.launch_start, trace.launch_of_op
    times = ops.start
    if len(launch_start):
        times = np.where(launch_of_op >= 0, launch_start[np.maximum(launch_of_op, 0)], ops.start)
    of_step = np.full(len(times), -1, dtype=np.int64)
    for start, end, number, _ in spans:
        of_step[(times >= start) & (times < end)] = number
    return of_step
