"""A document's data as JSON. Reports and comparisons follow the schemas ``rlprof-report/2`` and
``rlprof-compare/2`` documented by ``rlprof/analysis/{report,compare}.schema.json``; non-finite numbers are written
as null, so the output is strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rlprof.analysis.document import Document

SCHEMAS = Path(__file__).resolve().parents[1]
"""Where ``report.schema.json`` and ``compare.schema.json`` live."""


def _clean(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _clean({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_data(result: Any) -> Any:
    """Plain JSON data of a result: dataclasses become objects, tuples lists, keys strings, NaN null."""
    return _clean(result)


def render(document: Document) -> str:
    return json.dumps(to_data(document.data), indent=1, allow_nan=False)


def schema(name: str = "report") -> dict[str, Any]:
    """The JSON schema of ``rlprof {name} --format json``."""
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    return loaded
