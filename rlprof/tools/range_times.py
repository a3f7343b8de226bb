"""``range_times``: the time spent in each ``role/name`` range and each role, kept in memory (no file), for code
that wants the breakdown itself: the ``rlprof_benchmark`` pytest fixture reads it after each benchmark.

A range's time is the wall clock between its enter and exit on its thread (a nested range counts in its parent too);
a role's time is the time in its outermost ranges (a range inside another of the same role is not counted twice).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from rlprof.tools.base import NoSettings, RangeOps, RangeSite, Tool, ToolContext
from rlprof.tools.registry import register_tool


@register_tool("range_times", config=NoSettings)
class RangeTimesTool(Tool):
    """Counts and sums the wall time of every range, and of every role, inside the selected steps."""

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ranges: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self._roles: dict[str, float] = defaultdict(float)

    def range_ops(self, site: RangeSite) -> RangeOps:
        label, role, local, clock = site.label, site.role, self._local, time.perf_counter

        def enter() -> None:
            open_ranges = getattr(local, "open", None)
            if open_ranges is None:
                open_ranges = local.open = []
            open_ranges.append((role, clock()))

        def exit_() -> None:
            _, started = local.open.pop()
            elapsed = clock() - started
            outermost_of_role = all(other != role for other, _ in local.open)
            with self._lock:
                entry = self._ranges[label]
                entry[0] += 1
                entry[1] += elapsed
                if outermost_of_role:
                    self._roles[role] += elapsed

        return enter, exit_

    def take(self) -> dict[str, Any]:
        """``{"ranges": {label: {"count": n, "seconds": s}}, "roles": {role: seconds}}`` so far, then start from
        zero."""
        with self._lock:
            taken = {
                "ranges": {label: {"count": int(n), "seconds": s} for label, (n, s) in sorted(self._ranges.items())},
                "roles": dict(sorted(self._roles.items())),
            }
            self._ranges.clear()
            self._roles.clear()
        return taken
