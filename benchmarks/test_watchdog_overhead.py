"""What the stall watchdog (``trainer.watchdog``, on by default) costs a step when nothing stalls: its work per phase
(timing the phase: enter and exit) times the phases of a step, plus its thread's check every ``POLL_S`` (the open
phase's threshold and one read of the stall counter in a real TCP store, as with several ranks) over the step's
duration, against the trainer's own step: the demo config's, the smallest real step there is (a bigger model's step
is longer, the watchdog's work the same). Target: under 1% of a step."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rlprof.watchdog import POLL_S, Position, Watchdog, WatchdogConfig

from conftest import best_per_call

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WANDB_SERVICE")
ENV = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER}, "OMP_NUM_THREADS": "1"}
TARGET = 0.01

pytestmark = pytest.mark.slow


def demo_step(tmp_path: Path) -> tuple[float, int]:
    """(median step seconds after the first, phases per step) of 6 demo steps, the watchdog on."""
    command = [
        sys.executable,
        "-m",
        "rlprof_train.main_ppo",
        "--config-name=demo",
        "trainer.total_training_steps=6",
        "trainer.val_before_train=false",
        'trainer.logger=["file"]',
        f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing_s/step" in r]
    phases = max(len([k for k in r if k.startswith("timing_s/")]) for r in steps)
    return statistics.median(r["timing_s/step"] for r in steps[1:]), phases


def test_the_watchdog_costs_under_1_percent_of_a_step(tmp_path, speed_target):
    step_s, phases = demo_step(tmp_path)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=30))  # type: ignore[attr-defined]
    watchdog = Watchdog(  # as the trainer makes it: positions come from its progress beacons
        WatchdogConfig(enable=False), tmp_path, 0, 2, store, positions=lambda: [Position(0, 21, "gen", 0.0)]
    )
    watchdog.durations["gen"] = [(s, 0.5) for s in range(1, 21)]
    watchdog.durations["update_actor"] = [(s, 0.5) for s in range(1, 21)]

    def one_phase() -> None:
        with watchdog.phase(21, "gen"):
            pass

    def one_check() -> None:
        watchdog._check_own_phase()
        watchdog._new_events()

    with watchdog.phase(21, "update_actor"):  # the check looks at an open phase, as during a step
        per_check = best_per_call(one_check, number=2000, repeat=7)
    per_phase = best_per_call(one_phase, number=20_000, repeat=7)
    share = (phases * per_phase + step_s / POLL_S * per_check) / step_s
    print(
        f"\nwatchdog: {per_phase * 1e6:.1f} us per phase x {phases} phases, {per_check * 1e6:.0f} us per check every "
        f"{POLL_S:g} s; demo step {step_s * 1e3:.0f} ms: {share:.4%} of a step (target < {TARGET:.0%})"
    )
    speed_target(share < TARGET, f"{share:.4%} of a demo step (target < {TARGET:.0%})")
