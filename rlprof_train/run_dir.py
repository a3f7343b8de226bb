"""The run directory (``trainer.log_dir``): one run at a time, and what ``rlprof report`` needs to read it back.

- **Lock.** ``.rlprof.lock`` in the log and checkpoint folders, held (``flock``) by rank 0 for the whole run: a
  second run on the same folders stops at once, naming the holder (pid, host, start time). The kernel releases the
  lock when its holder dies, so a stale lock never blocks; the new holder says whose run it took over.
- **Run record.** ``run.json`` (run id, start, host, world size, command, where the profile and checkpoints go)
  and ``config.yaml`` (the resolved configuration), rewritten at each start and resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from rlprof.typed_config import ConfigError

LOCK = ".rlprof.lock"
RUN_RECORD = "run.json"
CONFIG = "config.yaml"


class RunInUse(ConfigError):
    """Another run holds the folder."""


_HELD: set[int] = set()
"""Descriptors of the locks this process holds: a forked child closes its copies at once (a helper process a reward
function forks must not keep the folder locked after the run ends; closing a copy leaves the parent's lock held)."""


def _forget_locks_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class RunLock:
    """An exclusive lock on a folder for this process's lifetime (or until :meth:`release`); not inherited by
    children (``O_CLOEXEC`` for programs they run, closed at fork)."""

    def __init__(self, folder: Path, setting: str) -> None:
        self.folder = Path(folder)
        self.setting = setting
        self.path = self.folder / LOCK
        self.previous: Optional[dict[str, Any]] = None
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self._fd)
            os.close(self._fd)
            raise RunInUse(
                f"{setting}={folder} is in use by another run ({_describe(holder)}); wait for it to "
                "finish, stop it, or choose another trainer.experiment_name"
            ) from None
        _HELD.add(self._fd)
        self.previous = _read_holder(self._fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": time.time(), "command": sys.argv}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(me).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None  # type: ignore[assignment]


def _read_holder(fd: int) -> Optional[dict[str, Any]]:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None


def _describe(holder: Optional[dict[str, Any]]) -> str:
    if not holder:
        return "holder unknown"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("start", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}"


def stale_note(lock: RunLock) -> Optional[str]:
    """A log line when the lock was left by a run that ended without releasing it (killed), else None."""
    if lock.previous is None:
        return None
    return f"run: took over {lock.path} from a run that ended without releasing it ({_describe(lock.previous)})"


def write_run_record(log_dir: Path, config: dict[str, Any], **facts: Any) -> None:
    """``run.json`` and ``config.yaml`` in ``log_dir`` (atomically)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "command": sys.argv, **facts}
    for name, text in ((RUN_RECORD, json.dumps(record, indent=2)), (CONFIG, yaml.safe_dump(config, sort_keys=False))):
        tmp = log_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, log_dir / name)
