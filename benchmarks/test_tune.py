"""tune's speed target: from the demo with every micro-batch knob set badly (tests/tune_runs.py), the configuration it
returns is at least 1.5x the base's step throughput, measured by tune's own side-by-side verification (base and best
interleaved in one run, the median step time's ratio with its 95% bootstrap interval).

A miss is run again (up to :data:`ATTEMPTS` whole searches; a loaded machine slows the base and the best unevenly);
every attempt's ratio and interval are printed and kept in the benchmark's ``extra_info``. What tune computes (a best
configuration faster beyond noise, with the base's math) is tests/rlprof_train/test_tune.py's, in the README's test
command; this target, a ratio of this machine at this moment, is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tune_runs import POOR_BASE_SEARCH

pytestmark = pytest.mark.long  # about 4 minutes an attempt on 2 cores: run with -m long

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.5
ATTEMPTS = 2


def search(folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "rlprof_train.tune", *POOR_BASE_SEARCH, f"tune.dir={folder}"]
    subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env, check=True)
    return json.loads((folder / "results.json").read_text())


def test_tune_from_a_poor_base_gains_at_least_1_5x(benchmark, tmp_path, speed_target):
    attempts: list[dict] = []

    def until_the_target() -> None:
        while len(attempts) < ATTEMPTS:
            verification = search(tmp_path / f"attempt{len(attempts) + 1}")["verification"]
            attempts.append(verification["speedup"])
            value, low, high = (attempts[-1][k] for k in ("value", "low", "high"))
            print(f"\ntune from a poor base: {value:.2f}x the base's throughput (95% interval {low:.2f}-{high:.2f})")
            if value >= TARGET:
                return

    benchmark.pedantic(until_the_target, rounds=1, iterations=1)
    benchmark.extra_info["speedups"] = attempts
    best = max(a["value"] for a in attempts)
    intervals = ", ".join(f"{a['value']:.2f}x ({a['low']:.2f}-{a['high']:.2f})" for a in attempts)
    speed_target(best >= TARGET, f"tune's verified speed-up {intervals} (target >= {TARGET}x)")
