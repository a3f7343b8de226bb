"""Where a stall is on disk: the watchdog (:mod:`rlprof.watchdog`) writes each rank's stacks to
``{log_dir}/stalls/step{N}/rank{R}.txt`` and rank 0's event to ``stall.json`` beside them; ``rlprof report``
(:mod:`rlprof.analysis.stalls`) reads them back without importing the runtime."""

from __future__ import annotations

from pathlib import Path

STALLS_DIR = "stalls"
EVENT_FILE = "stall.json"


def stall_folder(log_dir: Path) -> Path:
    """Where a run's stalls go: one ``step{N}`` folder each."""
    return log_dir / STALLS_DIR
