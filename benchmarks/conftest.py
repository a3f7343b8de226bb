"""Benchmarks compare two variants measured in the same process, interleaved, and report their ratio."""

from __future__ import annotations

import timeit
from collections.abc import Callable

import pytest

import rlprof


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
