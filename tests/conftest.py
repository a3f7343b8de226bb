"""Shared fixtures: a clean rlprof session per test, and helpers to run the example loop as a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import rlprof

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl_loop.py"


@pytest.fixture(autouse=True)
def _no_session_leaks():
    yield
    rlprof.shutdown()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child program, minus what a process group left here (tests that run DeepSpeed in
    this process set RANK/MASTER_PORT...; a child inheriting them would try to join that group's port)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_example(
    *overrides: str,
    save_path: Path,
    prefix: tuple[str, ...] = (sys.executable,),
    timeout: float = 600,
    before: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run ``prefix + examples/rl_loop.py + before + overrides`` (prefix: python, or torchrun / nsys + python;
    before: e.g. ``--config FILE``)."""
    command = [*prefix, str(EXAMPLE), *before, f"global_profiler.save_path={save_path}", *overrides]
    env = subprocess_env(OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def torchrun(nproc: int) -> tuple[str, ...]:
    """A prefix that launches the example on ``nproc`` local processes (gloo)."""
    return (sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}")
