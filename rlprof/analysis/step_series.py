"""A run's step records (read by :mod:`rlprof.analysis.sources.metrics_jsonl`) as series: training steps, warm-up
steps found, robust statistics over steps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Optional

STEP_KEY = "timing_s/step"


def training_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps (those with a finite step time), not validation-only ones (step 0)."""
    return [r for r in records if finite(r.get(STEP_KEY))]


def finite(value: Any) -> bool:
    """A number that is not NaN or infinite (and not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records: Iterable[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding a finite number under ``key``."""
    return [(int(record["step"]), float(record[key])) for record in records if finite(record.get(key))]


def warmup_steps(records: Sequence[dict[str, Any]], factor: float = 1.5) -> list[int]:
    """The first training steps that are slow because they are first (allocations, compilation, caches): the first
    step, and each following one whose step time exceeds ``factor`` x the median of the later steps; at most a
    tenth of the steps (and none when there are fewer than 4)."""
    times = series(records, STEP_KEY)
    if len(times) < 4:
        return []
    limit = max(1, len(times) // 10)
    steady = statistics.median(value for _, value in times[limit:])
    warm = [times[0][0]]
    for step, value in times[1:limit]:
        if value <= factor * steady:
            break
        warm.append(step)
    return warm


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def growth(values: Sequence[float]) -> Optional[float]:
    """Relative change from the first quarter's median to the last quarter's (0.25 = grew by a quarter); None
    with fewer than 8 values."""
    if len(values) < 8:
        return None
    quarter = len(values) // 4
    first, last = statistics.median(values[:quarter]), statistics.median(values[-quarter:])
    return (last - first) / first if first > 0 else None
