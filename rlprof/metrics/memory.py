"""Memory metrics: device peaks on CUDA, host memory always."""

from __future__ import annotations

import psutil

GB = 1024**3


def compute_memory_metrics(reset_peaks: bool = False) -> dict[str, float]:
    """``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb`` and ``perf/device_memory_total_gb``
    (CUDA only), plus ``perf/cpu_memory_used_gb`` / ``perf/cpu_memory_total_gb`` (the host's used and total RAM),
    ``perf/process_rss_gb`` (this process's resident memory) and the seed's ``memory/allocated`` (GB: the CUDA
    peak allocated, or the process's resident memory without CUDA).

    The CUDA peaks are torch's process-wide counters: since the start, or since the last
    ``torch.cuda.reset_peak_memory_stats()``. ``reset_peaks=True`` resets them after reading (per-step peaks; note
    that this changes global state other code may read); the default leaves them alone."""
    host = psutil.virtual_memory()
    metrics = {
        "perf/cpu_memory_used_gb": (host.total - host.available) / GB,
        "perf/cpu_memory_total_gb": host.total / GB,
        "perf/process_rss_gb": psutil.Process().memory_info().rss / GB,
    }
    metrics["memory/allocated"] = metrics["perf/process_rss_gb"]
    try:
        import torch
    except ImportError:
        return metrics
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        metrics["memory/allocated"] = metrics["perf/max_memory_allocated_gb"]
        metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        metrics["perf/device_memory_total_gb"] = torch.cuda.get_device_properties(0).total_memory / GB
        if reset_peaks:
            torch.cuda.reset_peak_memory_stats()
    return metrics
