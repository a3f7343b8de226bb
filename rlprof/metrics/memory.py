"""Memory metrics: device peaks on CUDA, host memory always."""

from __future__ import annotations

import psutil

GB = 1024**3


def compute_memory_metrics(reset_peaks: bool = True) -> dict[str, float]:
    """``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb`` and ``perf/device_memory_total_gb``
    (CUDA only: peaks since the last reset, which this call does when ``reset_peaks``), plus
    ``perf/cpu_memory_used_gb`` / ``perf/cpu_memory_total_gb`` (the host's used and total RAM) and
    ``perf/process_rss_gb`` (this process's resident memory)."""
    host = psutil.virtual_memory()
    metrics = {
        "perf/cpu_memory_used_gb": (host.total - host.available) / GB,
        "perf/cpu_memory_total_gb": host.total / GB,
        "perf/process_rss_gb": psutil.Process().memory_info().rss / GB,
    }
    try:
        import torch
    except ImportError:
        return metrics
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        metrics["perf/device_memory_total_gb"] = torch.cuda.get_device_properties(0).total_memory / GB
        if reset_peaks:
            torch.cuda.reset_peak_memory_stats()
    return metrics
