"""The built-in trace analyses, one module each, registered in the order they run over a built trace
(:func:`rlprof.analysis.trace_model.register_trace_analysis`): totals of ranges and CPU operators, device time
by range and operator, ranges' GPU projections, allocations by range, stream captures, steps and the GPU summaries.
Your own is one decorated function in a module of yours (docs/extending.md)."""

from rlprof.analysis.trace_analyses import captures, device_time, frame_totals, gpu_projection, memory, steps

__all__ = ["captures", "device_time", "frame_totals", "gpu_projection", "memory", "steps"]
