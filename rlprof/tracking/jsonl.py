"""``file`` backend: one JSON line per step in ``{log_dir}/metrics.jsonl``."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlprof.tracking.base import Backend, BackendContext, register_backend

FILE_NAME = "metrics.jsonl"
ARCHIVE_DIR = "previous"


@register_backend("file")
class JsonlBackend(Backend):
    """Appends ``{"step": s, "time": t, **metrics}`` per step and flushes it, so a crash loses no logged step.

    The log never mixes runs: a new run (no ``resume_step``) that finds records in ``metrics.jsonl`` moves them to
    ``{log_dir}/previous/metrics.{time}.jsonl`` first (said in a warning); a resumed run drops the lines of steps
    >= ``resume_step`` (the file is rewritten atomically), so each step appears once. A last line cut short by a
    crash is dropped with a warning, and appends never glue onto a partial line.
    """

    def __init__(self, context: BackendContext) -> None:
        self.path = Path(context.log_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_last_line(self.path)
        if self.path.exists() and self.path.stat().st_size:
            if context.resume_step is None:
                archive(self.path)
            else:
                self._drop_from(context.resume_step)
        self._handle = self.path.open("a", encoding="utf-8")

    def _drop_from(self, step: int) -> None:
        kept = [json.dumps(record) + "\n" for record in read_jsonl(self.path) if record.get("step", 0) < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._handle.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def archive(path: Path) -> Path:
    """Move a previous run's log out of the way (kept, never overwritten) and return where it went."""
    folder = path.parent / ARCHIVE_DIR
    folder.mkdir(exist_ok=True)
    target = folder / f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl"
    n = 1
    while target.exists():
        n += 1
        target = target.with_name(f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}-{n}.jsonl")
    os.replace(path, target)
    warnings.warn(
        f"rlprof tracking: {path} held the records of an earlier run; they were moved to {target} and this "
        "run starts a new log (resume from a checkpoint to continue a run's log)",
        RuntimeWarning,
        stacklevel=3,
    )
    return target


BLOCK = 1 << 20


def repair_last_line(path: Path) -> None:
    """Make ``path`` end on a complete line: a cut-short last record (a crash mid-write) is dropped, with a warning;
    a complete one missing its newline gets it."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return
        size = handle.seek(0, os.SEEK_END)
        line_start, position = 0, size
        while position > 0:  # back to the last newline, a block at a time (the line may be any length)
            start = max(0, position - BLOCK)
            handle.seek(start)
            found = handle.read(position - start).rfind(b"\n")
            if found >= 0:
                line_start = start + found + 1
                break
            position = start
        length = size - line_start
        complete = False
        if length <= BLOCK:
            handle.seek(line_start)
            try:
                json.loads(handle.read())
                complete = True
            except ValueError:
                pass
        if not complete:  # the whole line goes, however long, so the next record starts a line of its own
            handle.truncate(line_start)
            warnings.warn(
                f"rlprof tracking: the last line of {path} was cut short ({length} bytes, e.g. by a crash "
                "while writing); it was dropped",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``; a line that is not JSON (a cut-short last line) is skipped."""
    records = []
    with Path(path).open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    return records
