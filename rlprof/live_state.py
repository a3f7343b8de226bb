"""Each rank's live position on disk, for ``rlprof top``: the watchdog's thread (:mod:`rlprof.watchdog`) writes
``{log_dir}/live/rank{R}.json`` as it starts and once a second after (the rank's innermost phase, its step, since
when, and when it last wrote: a heartbeat), and once more, ``closed``, when the watchdog closes; ``rlprof top`` reads
them back. Written on a thread, never on the training thread; read as untrusted files (bounded, links not
followed)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from rlprof.atomic_file import write_text_atomically

LIVE_DIR = "live"
MAX_FILE_BYTES = 64 * 1024
MAX_RANKS = 4096


@dataclass(frozen=True)
class LiveState:
    rank: int
    world_size: int
    host: str
    pid: int
    step: Optional[int]
    """The step of the innermost open phase (None between steps)."""
    phase: Optional[str]
    since: Optional[float]
    """When the rank entered ``phase`` (Unix time)."""
    updated: float
    """When this was written (Unix time): a heartbeat, once a second while the process runs."""
    closed: bool = False
    """The watchdog closed (the run ended here, however it ended)."""


def live_file(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / LIVE_DIR / f"rank{rank}.json"


def write_live(log_dir: Path, state: LiveState) -> None:
    path = live_file(log_dir, state.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(asdict(state)))


def read_live(log_dir: Path) -> list[LiveState]:
    """Every rank's last state under ``log_dir``, by rank; files that are not such a state are skipped."""
    folder = Path(log_dir) / LIVE_DIR
    if not folder.is_dir() or folder.is_symlink():
        return []
    states = []
    for path in sorted(folder.glob("rank*.json"))[:MAX_RANKS]:
        state = _read(path)
        if state is not None:
            states.append(state)
    return sorted(states, key=lambda s: s.rank)


def _read(path: Path) -> Optional[LiveState]:
    try:
        if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        data: Any = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        return LiveState(
            rank=int(data["rank"]),
            world_size=int(data["world_size"]),
            host=str(data["host"])[:200],
            pid=int(data["pid"]),
            step=None if data["step"] is None else int(data["step"]),
            phase=None if data["phase"] is None else str(data["phase"])[:100],
            since=None if data["since"] is None else float(data["since"]),
            updated=float(data["updated"]),
            closed=bool(data.get("closed", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
