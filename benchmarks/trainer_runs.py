"""rlprof_train runs for the speed benchmarks: a trainer launched as a user launches it, its steady steps' medians
read back from its metrics file."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEADY_FROM = 3
"""The first step counted: compiles and caches are warm by then."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def train(folder: Path, module: str, processes: int, threads: int, steps: int, *overrides: str) -> dict[str, float]:
    """``python -m rlprof_train.{module}`` on the demo config for ``steps`` steps (one process, or ``processes``
    under torchrun), ``threads`` OpenMP threads each, logs under ``folder``; the medians from step STEADY_FROM on of
    the step, its wait for the batch, the rollout pool's sampling and the rollouter's busy time between two syncs
    (those it logged)."""
    arguments = [
        "--config-name=demo",
        f"trainer.log_dir={folder / 'logs'}",
        f"trainer.default_local_dir={folder / 'ckpt'}",
        'trainer.logger=["file"]',
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        *overrides,
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
    launch += [f"--master_port={free_port()}"]
    command = [*(launch if processes > 1 else [sys.executable]), "-m", f"rlprof_train.{module}", *arguments]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=ROOT, env={**env, "OMP_NUM_THREADS": str(threads)}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["step"] >= STEADY_FROM]
    return {
        key: statistics.median(r[key] for r in steady)
        for key in ("timing_s/step", "timing_s/gen", "timing_s/generate_async", "fully_async/rollouter/active_time")
        if key in steady[0]
    }
