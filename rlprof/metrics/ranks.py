"""Timing across data-parallel ranks: who is slow, and by how much."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional


def timing_spread(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """For each phase timed on any rank (``per_rank`` in rank order): ``timing_ranks/{phase}/{min,max,mean}``
    (seconds over the ranks that timed it), ``timing_ranks/{phase}/straggler`` = max / mean (1.0 = perfectly
    balanced) and ``timing_ranks/{phase}/slowest_rank``."""
    phases = sorted({name for timings in per_rank for name in timings})
    metrics: dict[str, float] = {}
    for phase in phases:
        timed = [(rank, timings[phase]) for rank, timings in enumerate(per_rank) if phase in timings]
        seconds = [s for _, s in timed]
        mean = sum(seconds) / len(seconds)
        metrics[f"timing_ranks/{phase}/slowest_rank"] = float(max(timed, key=lambda item: item[1])[0])
        metrics[f"timing_ranks/{phase}/min"] = min(seconds)
        metrics[f"timing_ranks/{phase}/max"] = max(seconds)
        metrics[f"timing_ranks/{phase}/mean"] = mean
        metrics[f"timing_ranks/{phase}/straggler"] = max(seconds) / mean if mean > 0 else 1.0
    return metrics


def reduce_timing_across_ranks(timing_raw: Mapping[str, float], group: Optional[Any] = None) -> dict[str, float]:
    """Gather every rank's ``timing_raw`` (a collective: all ranks must call it) and return :func:`timing_spread`.

    Without an initialised torch.distributed the spread is over this process alone.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return timing_spread([dict(timing_raw)])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(timing_raw), group=group)
    return timing_spread(gathered)
