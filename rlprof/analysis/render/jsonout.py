"""The report as JSON, in the schema ``rlprof-report/1`` documented by ``rlprof/analysis/report.schema.json``
(non-finite numbers are written as null, so the output is strict JSON)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rlprof.analysis.report import Report

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "report.schema.json"


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_data(report: Report) -> dict[str, Any]:
    """Plain JSON data (tuples become lists, integer keys strings, NaN null)."""
    cleaned: dict[str, Any] = _clean(dataclasses.asdict(report))
    return cleaned


def render(report: Report) -> str:
    return json.dumps(to_data(report), indent=1, allow_nan=False)


def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return loaded
