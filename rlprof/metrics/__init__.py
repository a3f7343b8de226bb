"""Metric builders (pure functions over counts, timings and tensors) with verl's metric names."""

from rlprof.metrics.aggregate import MetricAggregator, Reduce
from rlprof.metrics.data import compute_data_metrics
from rlprof.metrics.flops import FlopsEstimate, estimate_flops, mfu_metrics, peak_flops
from rlprof.metrics.memory import compute_memory_metrics
from rlprof.metrics.ranks import reduce_timing_across_ranks, timing_spread
from rlprof.metrics.timing import compute_throughput_metrics, compute_timing_metrics, timing_shares

__all__ = [
    "FlopsEstimate",
    "MetricAggregator",
    "Reduce",
    "compute_data_metrics",
    "compute_memory_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "estimate_flops",
    "mfu_metrics",
    "peak_flops",
    "reduce_timing_across_ranks",
    "timing_shares",
    "timing_spread",
]
