"""``rlprof compare OLD.json NEW.json`` on two pytest-benchmark files: which benchmarks got slower, by how much, and
which rlprof role the time went to.

For each benchmark in both files: the ratio of medians (new / old) — with a 95% bootstrap interval when both files
hold the raw rounds (``--benchmark-save-data``) — every number the benchmark stored in ``extra_info`` under a key
ending in ``_ratio`` (old and new), and, for benchmarks run through the ``rlprof_benchmark`` fixture, the
milliseconds per call of each role (``extra_info["rlprof"]``).

A benchmark *regressed* beyond a threshold ``R`` when its median ratio exceeds ``R`` (and its interval, if any, lies
above 1: the slowdown is not noise), or when one of its stored ratios grew more than ``R`` times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.compare import Interval, bootstrap_ratio

SCHEMA = "rlprof-bench-compare/1"
RATIO_SUFFIX = "_ratio"
ROLE_KEY = "rlprof"
"""``extra_info`` key written by the ``rlprof_benchmark`` fixture (see :mod:`rlprof.pytest_plugin`)."""


class BenchmarkFileError(ValueError):
    """A file that is not a readable pytest-benchmark JSON file (the message names it)."""


@dataclass(frozen=True)
class StoredRatio:
    key: str
    old: float
    new: float

    @property
    def growth(self) -> float:
        """new / old (how many times the stored ratio grew)."""
        return self.new / self.old if self.old > 0 else float("inf")


@dataclass(frozen=True)
class RoleTime:
    role: str
    old_ms: Optional[float]
    new_ms: Optional[float]
    """Milliseconds per measured call spent in the role's outermost ranges (None where a file lacks the role)."""


@dataclass(frozen=True)
class BenchmarkChange:
    name: str
    old_median_s: float
    new_median_s: float
    ratio: float
    """new median / old median."""
    interval: Optional[Interval]
    """Bootstrap interval of the ratio over the rounds, when both files hold them."""
    stored_ratios: list[StoredRatio]
    roles: list[RoleTime]
    regressions: list[str] = field(default_factory=list)
    """Why this benchmark counts as regressed (empty: it did not, or no threshold was given)."""


@dataclass(frozen=True)
class BenchComparison:
    schema: str
    files: list[str]
    machines: list[str]
    """Each file's ``machine_info`` node and CPU; medians of different machines compare poorly."""
    benchmarks: list[BenchmarkChange]
    only_in_one: list[str]
    """Benchmarks present in one file only (``old: NAME`` / ``new: NAME``)."""
    fail_above: Optional[float]

    @property
    def regressed(self) -> list[BenchmarkChange]:
        return [b for b in self.benchmarks if b.regressions]


def is_benchmark_file(path: Path) -> bool:
    """Whether ``path`` is a JSON file written by pytest-benchmark (``--benchmark-json`` / ``--benchmark-save``)."""
    if not path.is_file() or path.suffix != ".json":
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("benchmarks"), list) and "machine_info" in data


def read_benchmarks(path: Path) -> tuple[dict[str, dict[str, Any]], str]:
    """The benchmarks of a pytest-benchmark file by full name, and a one-line description of its machine."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = {entry["fullname"]: entry for entry in data["benchmarks"]}
        for name, entry in entries.items():
            if not isinstance(entry["stats"]["median"], (int, float)):
                raise TypeError(f"benchmark {name}: stats.median is not a number")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BenchmarkFileError(f"{path}: not a pytest-benchmark JSON file ({error})") from None
    machine = data.get("machine_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw", "") if isinstance(machine.get("cpu"), dict) else ""
    return entries, f"{machine.get('node', '?')} {cpu}".strip()


def compare_benchmarks(old_path: Path, new_path: Path, fail_above: Optional[float] = None) -> BenchComparison:
    """Compare every benchmark two pytest-benchmark files share; flag regressions beyond ``fail_above``."""
    if fail_above is not None and not fail_above >= 1.0:
        raise ValueError(f"--fail-above {fail_above}: expected a ratio of at least 1.0, e.g. 1.2")
    old, old_machine = read_benchmarks(old_path)
    new, new_machine = read_benchmarks(new_path)
    changes = [_change(name, old[name], new[name], fail_above) for name in old if name in new]
    only = [f"old: {name}" for name in old if name not in new] + [f"new: {name}" for name in new if name not in old]
    return BenchComparison(
        SCHEMA, [str(old_path), str(new_path)], [old_machine, new_machine], changes, only, fail_above
    )


def _change(name: str, old: dict[str, Any], new: dict[str, Any], fail_above: Optional[float]) -> BenchmarkChange:
    old_median, new_median = float(old["stats"]["median"]), float(new["stats"]["median"])
    ratio = new_median / old_median if old_median > 0 else float("inf")
    old_rounds, new_rounds = old["stats"].get("data"), new["stats"].get("data")
    interval = bootstrap_ratio(old_rounds, new_rounds) if old_rounds and new_rounds and old_median > 0 else None
    stored = _stored_ratios(old.get("extra_info") or {}, new.get("extra_info") or {})
    reasons: list[str] = []
    if fail_above is not None:
        if ratio > fail_above and (interval is None or interval.low > 1.0):
            reasons.append(f"median {ratio:.2f}x the old one (limit {fail_above:g}x)")
        reasons += [
            f"{s.key} {s.old:.4g} -> {s.new:.4g} ({s.growth:.2f}x, limit {fail_above:g}x)"
            for s in stored
            if s.growth > fail_above
        ]
    roles = _role_times(old.get("extra_info") or {}, new.get("extra_info") or {})
    return BenchmarkChange(name, old_median, new_median, ratio, interval, stored, roles, reasons)


def _stored_ratios(old: dict[str, Any], new: dict[str, Any]) -> list[StoredRatio]:
    def numbers(info: dict[str, Any]) -> dict[str, float]:
        return {
            key: float(value)
            for key, value in info.items()
            if key.endswith(RATIO_SUFFIX) and isinstance(value, (int, float)) and not isinstance(value, bool)
        }

    old_ratios, new_ratios = numbers(old), numbers(new)
    return [StoredRatio(key, old_ratios[key], new_ratios[key]) for key in sorted(old_ratios) if key in new_ratios]


def _role_times(old: dict[str, Any], new: dict[str, Any]) -> list[RoleTime]:
    def by_role(info: dict[str, Any]) -> dict[str, float]:
        section = info.get(ROLE_KEY)
        roles = section.get("ms_per_call_by_role") if isinstance(section, dict) else None
        return {str(k): float(v) for k, v in roles.items()} if isinstance(roles, dict) else {}

    old_roles, new_roles = by_role(old), by_role(new)
    names = sorted(set(old_roles) | set(new_roles))
    return [RoleTime(role, old_roles.get(role), new_roles.get(role)) for role in names]


def slowest_growth(change: BenchmarkChange) -> Optional[RoleTime]:
    """The role whose time per call grew the most (None when no role grew or the benchmark has no roles)."""
    grown = [r for r in change.roles if r.old_ms is not None and r.new_ms is not None and r.new_ms > r.old_ms]
    return max(grown, key=lambda r: (r.new_ms or 0.0) - (r.old_ms or 0.0), default=None)
