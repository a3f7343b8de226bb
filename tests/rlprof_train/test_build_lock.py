"""A build lock of torch's JIT extensions left by a start killed while building: every later start waited on it
forever, silently (found when a test run was stopped while a trainer in it started DeepSpeed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlprof_train.workers.build_lock import extensions_root, unheld_locks

from conftest import ROOT, subprocess_env, trainer_command


def test_a_lock_no_process_holds_is_found_and_one_held_open_is_not(tmp_path):
    left = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"  # torch's default layout
    held_here = tmp_path / "fused_adam" / "lock"  # under $TORCH_EXTENSIONS_DIR: no python/CUDA folder
    held_elsewhere = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (left, held_here, held_elsewhere):
        lock.parent.mkdir(parents=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # as torch's FileBaton makes it
    descriptor = os.open(held_here, os.O_RDONLY)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import os, sys, time; os.open({str(held_elsewhere)!r}, os.O_RDONLY); print(1); "
         "sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"1\n"
        assert unheld_locks(tmp_path) == [left]
        holder.kill()
        holder.wait()
        assert unheld_locks(tmp_path) == sorted([left, held_elsewhere])
    finally:
        holder.kill()
        os.close(descriptor)
    assert unheld_locks(tmp_path) == sorted([held_here, left, held_elsewhere])
    assert unheld_locks(tmp_path / "missing") == []


def test_the_locks_are_looked_for_where_torch_builds(monkeypatch, tmp_path):
    """``$TORCH_EXTENSIONS_DIR`` when set, else ``~/.cache/torch_extensions`` (the docs' two places)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert extensions_root() == tmp_path / "home" / ".cache" / "torch_extensions"


@pytest.mark.slow
def test_a_start_that_would_wait_on_a_lock_nobody_holds_says_which_file_to_remove(tmp_path):
    """The lock of DeepSpeed's shared-memory op, as a start killed in its build leaves it: the trainer names it
    before it waits (torch's wait has no end, so the test stops the run)."""
    extensions = tmp_path / "extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        run = subprocess.Popen(
            trainer_command(tmp_path, "trainer.total_training_steps=1"),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=subprocess_env(TORCH_EXTENSIONS_DIR=str(extensions)),
        )
    try:
        deadline = time.monotonic() + 120
        while "is a build lock" not in log.read_text() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert f"RuntimeWarning: {lock} (made 0 min ago) is a build lock of torch's JIT extensions that no " in text
        assert "Remove it, unless a run on another machine sharing this folder is building that extension" in text
        time.sleep(2)
        assert run.poll() is None and lock.exists()  # still waiting: the lock is the user's to remove
    finally:
        run.kill()
        run.wait()
