"""One trial: a short run of the real trainer in its own process (same data, same seed), measured by rlprof's
timers and memory probes. A crash, an out-of-memory kill or a timeout is a failed trial with its reason, never the
end of the search."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.sources.metrics_jsonl import read_metrics
from rlprof.analysis.step_series import training_records

OK = "ok"
FAILED = "failed"
OVER_MEMORY = "over memory limit"


@dataclass
class Measurement:
    """What one run of a trial measured."""

    step_times: list[float]
    """``timing_s/step`` of the measured steps (warm-up left out)."""
    tokens_per_s: list[float]
    peak_memory_gb: Optional[float]
    """CUDA peak reserved on GPU, process RSS on CPU; the highest over all steps."""
    wall_s: float
    startup_s: float
    """The wall time outside the steps (imports, model and engine set-up, shutdown)."""
    first_steps: list[dict[str, float]]
    """The learning metrics of the first steps (for the equivalence check)."""


@dataclass
class Trial:
    name: str
    changes: dict[str, Any]
    """The overrides on top of the base config (empty for the base)."""
    runs: list[Measurement] = field(default_factory=list)
    status: str = OK
    reason: str = ""
    note: str = ""
    """How it compared with the best so far (e.g. indistinguishable from it)."""

    @property
    def step_times(self) -> list[float]:
        return [t for run in self.runs for t in run.step_times]

    @property
    def median_step_s(self) -> float:
        times = sorted(self.step_times)
        if not times:
            return math.inf
        middle = len(times) // 2
        return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2

    @property
    def tokens_per_s(self) -> Optional[float]:
        values = sorted(v for run in self.runs for v in run.tokens_per_s)
        return values[len(values) // 2] if values else None

    @property
    def peak_memory_gb(self) -> Optional[float]:
        peaks = [run.peak_memory_gb for run in self.runs if run.peak_memory_gb is not None]
        return max(peaks) if peaks else None

    @property
    def usable(self) -> bool:
        return self.status == OK and bool(self.step_times)


LEARNING_KEYS = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "critic/vf_loss",
    "critic/score/mean",
    "response_length/mean",
)


@dataclass(frozen=True)
class Launch:
    """How trials are started."""

    base: list[str]
    """The user's trainer overrides."""
    root: Path
    """The tune directory (one folder per trial run under ``trials/``)."""
    nproc: int
    """Processes per trial (``torchrun --nproc_per_node``)."""
    timeout_s: float
    module: str = "rlprof_train.main_ppo"
    """The trainer's module (``python -m``): the synchronous trainer's or the one-step-off one's."""


def command(launch: Launch, overrides: list[str], folder: Path, steps: int) -> list[str]:
    prefix = [sys.executable]
    if launch.nproc > 1:
        prefix += ["-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc}", f"--master_port={_free_port()}"]
    return [
        *prefix,
        "-m",
        launch.module,
        *launch.base,
        *overrides,
        f"trainer.total_training_steps={steps}",
        f"trainer.log_dir={folder / 'logs'}",
        f"trainer.default_local_dir={folder / 'checkpoints'}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        'trainer.logger=["file"]',
        "global_profiler.tool=null",
    ]


def run_once(
    launch: Launch, trial: Trial, overrides: list[str], folder: Path, warmup: int, steps: int
) -> Optional[Measurement]:
    """Run the trainer for ``warmup + steps`` steps; the measurement, or None with ``trial`` marked failed."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RLPROF_TUNE_TRIAL=trial.name, RLPROF_TUNE_OVERRIDES=" ".join(overrides))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launch.nproc)))
    started = time.monotonic()
    with (folder / "trainer.log").open("w") as log:
        process = subprocess.Popen(
            command(launch, overrides, folder, warmup + steps),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=launch.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            trial.status, trial.reason = FAILED, f"timed out after {launch.timeout_s:.0f} s"
            return None
        except BaseException:  # tune interrupted (Ctrl-C, SIGTERM, SIGHUP): the trial's whole process group goes too
            stop_group(process)
            trial.status, trial.reason = FAILED, "interrupted"
            raise
    wall = time.monotonic() - started
    if code != 0:
        trial.status, trial.reason = FAILED, _failure(code, folder / "trainer.log")
        return None
    metrics = folder / "logs" / "metrics.jsonl"
    records = training_records(read_metrics(metrics).records) if metrics.exists() else []
    measured = [r for r in records if r["step"] > warmup]
    if not measured:
        trial.status, trial.reason = FAILED, "no step metrics were written"
        return None
    peak_key = "perf/max_memory_reserved_gb" if any("perf/max_memory_reserved_gb" in r for r in records) else None
    peaks = [r[peak_key or "perf/process_rss_gb"] for r in records if (peak_key or "perf/process_rss_gb") in r]
    return Measurement(
        step_times=[float(r["timing_s/step"]) for r in measured],
        tokens_per_s=[float(r["throughput/tokens_per_sec"]) for r in measured if "throughput/tokens_per_sec" in r],
        peak_memory_gb=max(peaks) if peaks else None,
        wall_s=wall,
        startup_s=max(0.0, wall - sum(float(r["timing_s/step"]) for r in records)),
        first_steps=[{k: float(r[k]) for k in LEARNING_KEYS if k in r} for r in records[:3]],
    )


def stop_group(process: subprocess.Popen[Any], grace_s: float = 20) -> None:
    """SIGTERM to the trial's process group (the trainer writes what it holds), SIGKILL after ``grace_s``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _failure(code: int, log: Path) -> str:
    """Why a trial process ended badly, in one line."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if code < 0 or code in (137, -9):
        killed = f"killed by signal {-code if code < 0 else 9}"
        return f"{killed} (out of memory?)" if abs(code) in (9, 137) else killed
    if "OutOfMemoryError" in text or "CUDA out of memory" in text or "MemoryError" in text:
        return "out of memory"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    said = (
        next((line for line in lines if line.startswith(("error on rank", "config error:"))), None)  # the trainer's
        or next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), None)
        or (lines[-1] if lines else "no output")
    )
    return f"exit {code}: {said[:300]}"


EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:")
"""A traceback's last line (``RuntimeError: ...``)."""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def save(trials: list[Trial], path: Path, extra: dict[str, Any]) -> None:
    """``results.json``: every trial, its status and measurements."""
    data = {
        **extra,
        "trials": [
            {
                "name": t.name,
                "changes": t.changes,
                "status": t.status,
                "reason": t.reason,
                "note": t.note,
                "median_step_s": t.median_step_s if t.usable else None,
                "tokens_per_s": t.tokens_per_s,
                "peak_memory_gb": t.peak_memory_gb,
                "runs": [run.__dict__ for run in t.runs],
            }
            for t in trials
        ],
    }
    path.write_text(json.dumps(data, indent=1, default=str))
