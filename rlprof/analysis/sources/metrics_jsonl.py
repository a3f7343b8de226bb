"""``metrics.jsonl`` (the ``file`` tracking backend): one JSON record per logged step. Read once per run, line by
line: a cut-short last line (a crash while writing) is dropped with a note, other lines that are not records are
counted, a line longer than :data:`MAX_LINE_BYTES` is skipped whole, and of several records of one step (a resumed
run) the last written wins."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlprof.analysis.sources.base import InputFile, ReadOptions, Source

MAX_LINE_BYTES = 16 << 20


@dataclass(frozen=True)
class Metrics:
    path: str
    records: list[dict[str, Any]]
    """One record per step, in step order."""
    notes: list[str] = field(default_factory=list)
    """What was skipped while reading, one line each."""


def read_metrics(path: Path) -> Metrics:
    """The records of ``path`` (see the module doc)."""
    notes: list[str] = []
    by_step: dict[int, dict[str, Any]] = {}
    bad = long = 0
    last_bad = False
    with Path(path).open("rb") as handle:
        while True:
            line = handle.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                long += 1
                while line and not line.endswith(b"\n"):  # the rest of the long line
                    line = handle.readline(MAX_LINE_BYTES + 1)
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                bad += 1
                last_bad = True
                continue
            last_bad = False
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                by_step[step] = record
            else:
                bad += 1
    if last_bad:
        bad -= 1
        notes.append(f"{path}: the last line is cut short (a crash while writing); it was skipped")
    if bad:
        notes.append(f"{path}: {bad} lines are not metric records and were skipped")
    if long:
        notes.append(f"{path}: {long} lines longer than {MAX_LINE_BYTES >> 20} MiB were skipped")
    non_finite = sum(
        1
        for record in by_step.values()
        if any(isinstance(v, float) and not math.isfinite(v) for k, v in record.items() if k.startswith("timing_s/"))
    )
    if non_finite:
        notes.append(f"{path}: {non_finite} steps hold NaN or infinite timings; those values are left out")
    return Metrics(str(path), [by_step[step] for step in sorted(by_step)], notes)


class MetricsSource(Source):
    format = "metrics"
    category = "metrics"
    description = "a metrics.jsonl of the file tracking backend"

    def claims(self, path: Path, head: bytes) -> bool:
        first = head.split(b"\n", 1)[0]
        return first.startswith(b"{") and b'"step"' in first and b'"rss_before"' not in first

    def read(self, file: InputFile, options: ReadOptions) -> Metrics:
        return read_metrics(file.path)
