"""``file`` backend: one JSON line per step in ``{log_dir}/metrics.jsonl``."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from rlprof.tracking.base import Backend

FILE_NAME = "metrics.jsonl"


class JsonlBackend(Backend):
    """Appends ``{"step": s, "time": t, **metrics}`` per step and flushes it, so a crash loses no logged step.

    On resume, lines of steps >= ``resume_step`` are removed first (the file is rewritten atomically), so each
    step appears once.
    """

    name = "file"

    def __init__(self, log_dir: Path, resume_step: Optional[int] = None) -> None:
        self.path = Path(log_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._drop_from(resume_step)
        self._handle = self.path.open("a", encoding="utf-8")

    def _drop_from(self, step: int) -> None:
        with self.path.open(encoding="utf-8") as handle:
            kept = [line for line in handle if line.strip() and json.loads(line)["step"] < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._handle.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_jsonl(path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl``."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
