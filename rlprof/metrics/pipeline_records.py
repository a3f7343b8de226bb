"""An asynchronous pipeline's records: every process of both sides writes what happened to it, one JSON line per
event as it happens (flushed: a crash loses nothing written), to ``{log_dir}/pipeline/rank{R}.jsonl`` (``R``: its
launch rank, the rank rlprof records it under). They are what its metrics (:mod:`rlprof.metrics.pipeline`) were
computed from, kept so that anyone can count them again, and each sample's life can be followed.

Times are seconds on the writing process's monotonic clock (one clock for every process of a host); each start of a
process writes a ``clock`` line first, which ties that clock to the wall clock (a resumed run appends its own
segment, starting with its own ``clock`` line; a new run moves an earlier run's file to ``pipeline/previous/``).

Events:

- ``{"event": "clock", "side", "rank", "monotonic", "wall"}``: this segment's clock, read once at its start.
- ``{"event": "wait", "side", "reason", "began", "ended"}``: one wait, whole, written when it ends (a window that ends
  during a wait counts its part in each window).
- ``{"event": "window", "side", "began", "ended", "step" | "version"}``: a metrics window: the trainer's step
  (``step``), the rollouter's time since its previous sync, ended by the sync to ``version``.
- ``{"event": "generate", "step", "beside", "version", "rows", "began", "ended"}``: a rollout process sampled
  ``rows`` of step ``step``'s batch (``null``: validation) under weights ``version``, beside step ``beside``.
- ``{"event": "sample", "step", "uid", "version", "consumed_version", "rollout_rank", "response_tokens"}``: one
  trajectory, consumed by step ``step``'s update from weights ``consumed_version``; drawn under ``version`` by
  rollout rank ``rollout_rank``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlprof.tracking.jsonl import archive, repair_last_line

FOLDER = "pipeline"


def records_path(log_dir: str | Path, rank: int) -> Path:
    """Where launch rank ``rank`` writes its records."""
    return Path(log_dir) / FOLDER / f"rank{rank}.jsonl"


class PipelineLog:
    """One process's records (thread-safe: a side's waits may end on any of its threads)."""

    def __init__(
        self,
        log_dir: str | Path,
        rank: int,
        side: str,
        resumed: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = records_path(log_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_last_line(self.path)
        if not resumed and self.path.exists() and self.path.stat().st_size:
            archive(self.path)
        self._lock = threading.Lock()
        self._handle = self.path.open("a", encoding="utf-8")
        self.write({"event": "clock", "side": side, "rank": rank, "monotonic": clock(), "wall": time.time()})

    def write(self, record: dict[str, Any]) -> None:
        self.write_all([record])

    def write_all(self, records: Iterable[dict[str, Any]]) -> None:
        """``records`` in one write (a step's trajectories: one flush, not one a line)."""
        lines = "".join(json.dumps(record) + "\n" for record in records)
        with self._lock:
            if not self._handle.closed:
                self._handle.write(lines)
                self._handle.flush()

    def close(self) -> None:
        with self._lock:
            self._handle.close()
