"""``{save_path}/manifest.jsonl``: one JSON line per file a tool wrote, so every output can be found later, with
its format (which reader takes it: ``rlprof report`` never guesses it from the name).

Every line names the run (``run``), the host and the rank that wrote it, so processes of several runs, hosts or
ranks can share one folder without their outputs being confused. Files are published without ever replacing an
existing one: a second file for the same window and rank (a step number seen twice, a second run into the same
folder) gets a numbered name, ``rank0.pt.trace.json.gz`` -> ``rank0-2.pt.trace.json.gz``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

FILE_NAME = "manifest.jsonl"


def numbered(path: Path, n: int) -> Path:
    """``dir/rank0.pt.trace.json.gz`` -> ``dir/rank0-{n}.pt.trace.json.gz`` (n >= 2); n == 1 is ``path`` itself."""
    if n == 1:
        return path
    stem, dot, suffixes = path.name.partition(".")
    return path.with_name(f"{stem}-{n}{dot}{suffixes}")


def free_name(path: Path) -> Path:
    """The first of ``path``, ``path-2``, ``path-3`` ... (see :func:`numbered`) that does not exist yet."""
    n = 1
    while numbered(path, n).exists():
        n += 1
    return numbered(path, n)


def place(tmp: Path, final: Path) -> Path:
    """Move the finished ``tmp`` to ``final``, or to the next free numbered name when ``final`` exists (even when
    another process takes it at the same moment); returns where it went."""
    candidate = free_name(final)
    while True:
        try:
            os.link(tmp, candidate)
        except FileExistsError:
            candidate = free_name(final)
            continue
        except OSError:  # a filesystem without hard links
            os.replace(tmp, candidate)
            return candidate
        os.unlink(tmp)
        return candidate


class Manifest:
    """Appends records to ``manifest.jsonl``; safe for several processes (one ``O_APPEND`` write per line)."""

    FILE_NAME = FILE_NAME

    def __init__(
        self, save_path: str | os.PathLike[str], run: Optional[str] = None, pool: Optional[str] = None
    ) -> None:
        self.save_path = Path(save_path)
        self.path = self.save_path / FILE_NAME
        self.run = run
        self.pool = pool
        """The writing process's pool (``trainer``, ``rollout``), added to each line when set."""
        self.host = socket.gethostname()

    def record(
        self,
        tool: str,
        path: str | os.PathLike[str],
        *,
        steps: Sequence[int],
        rank: int,
        role: Optional[str] = None,
        window: Optional[int] = None,
        format: Optional[str] = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Append one line describing ``path`` (which must exist) and return it; ``format`` names the source that
        reads the file (``chrome_trace``, ``nsys_report``, ``cuda_snapshot``, ``host_alloc``, ``host_rss``)."""
        path = Path(path)
        entry = {
            "tool": tool,
            "format": format,
            "steps": list(steps),
            "window": window,
            "role": role,
            "rank": rank,
            "host": self.host,
            "pid": os.getpid(),
            "run": self.run,
            "path": os.path.relpath(path, self.save_path),
            "bytes": path.stat().st_size,
            "time": time.time(),
            **extra,
        }
        self._append(entry)
        return entry

    def record_session(self, *, tool: str, rank: int, world_size: int, steps: Any) -> None:
        """A ``"kind": "session"`` line: this rank started recording with ``tool`` (read back by ``rlprof report``)."""
        self.record_event("session", rank=rank, tool=tool, world_size=world_size, steps=steps)

    def record_event(self, kind: str, *, rank: int, **fields: Any) -> None:
        """A line about the run rather than a file, of ``kind`` (``session``: a rank started recording; ``stall``:
        the watchdog saw one), with the rank, host, pid, run and time."""
        self._append(
            {"kind": kind, "rank": rank, "host": self.host, "pid": os.getpid(), "run": self.run, **fields}
            | {"time": time.time()}
        )

    def _append(self, entry: dict[str, Any]) -> None:
        if self.pool is not None:
            entry = {**entry, "pool": self.pool}
        line = (json.dumps(entry) + "\n").encode()
        self.save_path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_manifest(save_path: str | os.PathLike[str], *, kind: str = "file") -> list[dict[str, Any]]:
    """The records of ``{save_path}/manifest.jsonl`` of one kind: ``"file"`` (outputs), ``"session"`` or ``"stall"``.

    A damaged line (a crash mid-write) is skipped; an absent manifest reads as empty."""
    path = Path(save_path) / FILE_NAME
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("kind", "file") == kind:
                records.append(record)
    return records
