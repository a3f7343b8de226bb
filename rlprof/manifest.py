"""``{save_path}/manifest.jsonl``: one JSON line per file a tool wrote, so every output can be found later."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional


class Manifest:
    """Appends records to ``manifest.jsonl``; safe for several processes (one ``O_APPEND`` write per line)."""

    FILE_NAME = "manifest.jsonl"

    def __init__(self, save_path: str | os.PathLike[str]) -> None:
        self.save_path = Path(save_path)
        self.path = self.save_path / self.FILE_NAME

    def record(
        self, tool: str, path: str | os.PathLike[str], *, steps: Sequence[int], rank: int, role: Optional[str] = None
    ) -> dict[str, Any]:
        """Append one line describing ``path`` (which must exist) and return it."""
        path = Path(path)
        entry = {
            "tool": tool,
            "steps": list(steps),
            "role": role,
            "rank": rank,
            "pid": os.getpid(),
            "path": os.path.relpath(path, self.save_path),
            "bytes": path.stat().st_size,
            "time": time.time(),
        }
        line = (json.dumps(entry) + "\n").encode()
        self.save_path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return entry


def read_manifest(save_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of ``{save_path}/manifest.jsonl`` (empty when nothing was written)."""
    path = Path(save_path) / Manifest.FILE_NAME
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
