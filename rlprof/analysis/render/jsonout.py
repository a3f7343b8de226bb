"""Reports and comparisons as JSON, in the schemas ``rlprof-report/1`` and ``rlprof-compare/1`` documented by
``rlprof/analysis/{report,compare}.schema.json`` (non-finite numbers are written as null: the output is strict JSON)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rlprof.analysis.report import Report

SCHEMAS = Path(__file__).resolve().parents[1]
"""Where ``report.schema.json`` and ``compare.schema.json`` live."""


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_data(result: Any) -> dict[str, Any]:
    """Plain JSON data of a report, a comparison or any dataclass (tuples become lists, integer keys strings, NaN
    null)."""
    plain = dataclasses.asdict(result) if dataclasses.is_dataclass(result) and not isinstance(result, type) else result
    cleaned: dict[str, Any] = _clean(plain)
    return cleaned


def render(report: Report) -> str:
    return json.dumps(to_data(report), indent=1, allow_nan=False)


def schema(name: str = "report") -> dict[str, Any]:
    """The JSON schema of ``rlprof {name} --format json``."""
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    return loaded
