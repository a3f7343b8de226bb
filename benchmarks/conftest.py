"""Benchmarks compare two variants measured in the same process, interleaved, and report their ratio.

A speed target is checked by the ``speed_target`` fixture, after the benchmark's own retries. How a miss ends is
chosen by ``RLPROF_SPEED_TARGETS``: ``assert`` (the default, ``pytest benchmarks``) fails the benchmark; ``report``
(``scripts/test.sh``: a busy machine must not turn the README's test command red with nothing wrong in the project)
passes it and lists every target, met or missed, with its measured figure in the session's summary.
"""

from __future__ import annotations

import os
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import rlprof

SPEED_TARGET_MODES = ("assert", "report")


@dataclass(frozen=True)
class SpeedCheck:
    """One speed target checked by a benchmark: whether it was met and the figure measured against it."""

    test: str
    met: bool
    measured: str


_checks: list[SpeedCheck] = []


def speed_target_mode() -> str:
    mode = os.environ.get("RLPROF_SPEED_TARGETS", "assert")
    if mode not in SPEED_TARGET_MODES:
        raise pytest.UsageError(f"RLPROF_SPEED_TARGETS={mode!r}: allowed values are {', '.join(SPEED_TARGET_MODES)}")
    return mode


def pytest_configure(config: pytest.Config) -> None:
    speed_target_mode()  # a bad value is refused before any benchmark runs


@pytest.fixture
def speed_target(request: pytest.FixtureRequest) -> Callable[[bool, str], None]:
    """``speed_target(met, measured)``: the benchmark's speed target, after its retries (see the module docstring)."""

    def check(met: bool, measured: str) -> None:
        _checks.append(SpeedCheck(request.node.nodeid, met, measured))
        if speed_target_mode() == "assert":
            assert met, f"speed target missed: {measured}"

    return check


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _checks:
        return
    missed = [c for c in _checks if not c.met]
    title = f"speed targets: {len(_checks) - len(missed)} met, {len(missed)} missed"
    if missed and speed_target_mode() == "report":
        title += " (reported, not failed: RLPROF_SPEED_TARGETS=report)"
    terminalreporter.section(title)
    for c in sorted(_checks, key=lambda c: c.met):
        terminalreporter.line(f"{'met   ' if c.met else 'MISSED'} {c.test}: {c.measured}")


@pytest.fixture(autouse=True)
def _fresh_session():
    yield
    rlprof.shutdown()


def best_per_call(fn: Callable[[], object], number: int = 20_000, repeat: int = 15) -> float:
    """Seconds per call: the minimum over ``repeat`` timings of ``number`` calls (least disturbed by noise)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def ratio(subject: Callable[[], object], baseline: Callable[[], object], rounds: int = 5) -> tuple[float, float, float]:
    """(subject s/call, baseline s/call, ratio), alternating the two so drift hits both alike."""
    s, b = [], []
    for _ in range(rounds):
        s.append(best_per_call(subject))
        b.append(best_per_call(baseline))
    return min(s), min(b), min(s) / min(b)
