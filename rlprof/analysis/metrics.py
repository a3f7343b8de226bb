"""Read a run's ``metrics.jsonl`` back: tolerant of a cut-short last line, one record per step, warm-up steps found,
series and robust statistics over steps."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

STEP_KEY = "timing_s/step"


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(records sorted by step, one per step: the last written wins, notes on what was skipped)."""
    notes: list[str] = []
    by_step: dict[int, dict[str, Any]] = {}
    bad = 0
    with Path(path).open(encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                notes.append(f"{path}: the last line is cut short (a crash while writing); it was skipped")
            else:
                bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
        else:
            bad += 1
    if bad:
        notes.append(f"{path}: {bad} lines are not metric records and were skipped")
    return [by_step[step] for step in sorted(by_step)], notes


def training_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps (those with a step time), not validation-only ones (step 0)."""
    return [r for r in records if isinstance(r.get(STEP_KEY), (int, float))]


def series(records: Iterable[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding a finite number under ``key``."""
    out = []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(record["step"]), float(value)))
    return out


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
