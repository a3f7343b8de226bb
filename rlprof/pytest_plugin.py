"""pytest plugin (registered as ``rlprof`` when rlprof is installed): the ``rlprof_benchmark`` fixture.

It is pytest-benchmark's ``benchmark`` fixture with rlprof's ranges timed during the measured calls: the time per
call spent in each ``role/name`` range, and per role, lands in the benchmark's ``extra_info["rlprof"]``, so a saved
benchmark run says where the time went and ``rlprof compare OLD.json NEW.json`` says which role regressed::

    def test_step(rlprof_benchmark):
        rlprof_benchmark(train_step, batch)          # or rlprof_benchmark.pedantic(train_step, args=(batch,), ...)

Each measured call runs as one rlprof step under the ``range_times`` tool (every role, rank 0); the fixture starts its
own session (replacing one the test started) and shuts it down after the benchmark.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

import rlprof
from rlprof.analysis.bench_compare import ROLE_KEY
from rlprof.tools.range_times import RangeTimesTool


class RlprofBenchmark:
    """Calls like ``benchmark`` (and ``.pedantic``), timing rlprof's ranges in the measured calls."""

    def __init__(self, benchmark: Any, save_path: str) -> None:
        self.benchmark = benchmark
        self.save_path = save_path
        self._steps = itertools.count(1)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._measured(lambda wrapped: self.benchmark(wrapped, *args, **kwargs), fn)

    def pedantic(self, fn: Callable[..., Any], **options: Any) -> Any:
        return self._measured(lambda wrapped: self.benchmark.pedantic(wrapped, **options), fn)

    def _measured(self, run: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any]) -> Any:
        config: dict[str, Any] = {
            "global_profiler": {
                "tool": "range_times",
                "save_path": self.save_path,
                "global_tool_config": {"range_times": {}},
                "steps": None,
            }
        }
        session = rlprof.init(config)
        tool = session.tool
        calls = 0

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            with rlprof.step(next(self._steps)):
                return fn(*args, **kwargs)

        try:
            result = run(wrapped)
            totals = tool.take() if isinstance(tool, RangeTimesTool) else {"ranges": {}, "roles": {}}
        finally:
            rlprof.shutdown()
        self.benchmark.extra_info[ROLE_KEY] = breakdown(totals, calls)
        return result

    @property
    def extra_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.benchmark.extra_info
        return info


def breakdown(totals: dict[str, Any], calls: int) -> dict[str, Any]:
    """Milliseconds per measured call in each range and each role (a role: its outermost ranges), and ranges per
    call."""
    per_call = max(calls, 1)
    ranges = totals["ranges"]
    return {
        "calls": calls,
        "ms_per_call": {label: 1000 * t["seconds"] / per_call for label, t in ranges.items()},
        "ms_per_call_by_role": {role: 1000 * seconds / per_call for role, seconds in totals["roles"].items()},
        "ranges_per_call": {label: t["count"] / per_call for label, t in ranges.items()},
    }


@pytest.fixture
def rlprof_benchmark(benchmark: Any, tmp_path_factory: pytest.TempPathFactory) -> RlprofBenchmark:
    """pytest-benchmark's ``benchmark``, with the time per rlprof range and role in ``extra_info["rlprof"]``."""
    return RlprofBenchmark(benchmark, str(tmp_path_factory.mktemp("rlprof_benchmark")))
