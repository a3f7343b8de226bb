"""Stalls a watchdog recorded in a run's log folder (:mod:`rlprof.watchdog`; the trainer's ``trainer.watchdog``):
one folder per stalled step, ``stalls/step{N}/``, holding the event (``stall.json``: the phase that ran too long, who
saw it, the rank furthest behind and every rank's position) and each rank's thread stacks (``rank{R}.txt``, innermost
frame last).

The files come from outside: at most :data:`MAX_STALLS` events are read, each file up to :data:`MAX_BYTES`, nothing
linked out of the folder is followed, and a file that does not parse is a note, not an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rlprof.analysis.report_model import StallRecord
from rlprof.manifest import read_manifest
from rlprof.stall_files import EVENT_FILE, stall_folder

MAX_STALLS = 50
MAX_BYTES = 4 * 2**20
INNERMOST = 3
"""Frames kept per rank: the main thread's innermost."""
_FRAME = re.compile(r'^  File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>.*)$')


def read_stalls(log_dir: Path, notes: list[str]) -> list[StallRecord]:
    """The stalls recorded under ``log_dir`` by step (problems appended to ``notes``)."""
    root = stall_folder(log_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    top = root.resolve()
    folders = sorted(
        (f for f in root.iterdir() if f.is_dir() and re.fullmatch(r"step\d+", f.name)), key=lambda f: int(f.name[4:])
    )
    if len(folders) > MAX_STALLS:
        notes.append(f"{root}: {len(folders)} stalls; only the first {MAX_STALLS} were read")
    found = []
    for folder in folders[:MAX_STALLS]:
        try:
            event = json.loads(_read(folder / EVENT_FILE, top))
            found.append(_record(folder, event, top))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            notes.append(f"{folder / EVENT_FILE}: not read ({type(exc).__name__}: {exc})")
    return found


def listed_stalls(save_paths: list[Path]) -> list[str]:
    """One note per stall listed in the profiles' manifests (``"kind": "stall"``), for a report given the profile
    but not the log folder that holds the stacks (at most :data:`MAX_STALLS`; fields printed, never followed)."""
    notes = []
    for save_path in save_paths:
        for line in read_manifest(save_path, kind="stall"):
            behind = line.get("behind") if isinstance(line.get("behind"), dict) else {}
            where = f"rank {_shown(behind.get('rank'))} in {_shown(behind.get('phase'))}" if behind else "a rank"
            notes.append(
                f"the watchdog saw a stall at step {_shown(line.get('step'))} ({where}); its stacks are in "
                f"{_shown(line.get('folder'), 300)}: give rlprof report that run's log folder to list them"
            )
    if len(notes) > MAX_STALLS:
        notes = [*notes[:MAX_STALLS], f"{len(notes) - MAX_STALLS} more stalls are listed in the manifests"]
    return notes


def _shown(value: Any, limit: int = 80) -> str:
    """A value from a file, printable on one line and at most ``limit`` characters."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read(path: Path, top: Path) -> str:
    if not path.resolve().is_relative_to(top):
        raise ValueError(f"links out of {top}; not followed")
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES // 2**20} MiB")
    return path.read_text(errors="replace")


def _record(folder: Path, event: dict[str, Any], top: Path) -> StallRecord:
    behind = event["behind"]
    innermost: dict[int, list[str]] = {}
    for stacks in sorted(folder.glob("rank*.txt")):
        rank = stacks.stem[4:]
        if rank.isdigit():
            try:
                innermost[int(rank)] = main_thread_frames(_read(stacks, top))
            except (OSError, ValueError):
                innermost[int(rank)] = []
    return StallRecord(
        step=int(event["step"]),
        phase=str(event["phase"]),
        seen_by=int(event["rank"]),
        elapsed_s=float(event["elapsed_s"]),
        threshold_s=float(event["threshold_s"]),
        behind_rank=int(behind["rank"]),
        behind_phase=str(behind["phase"]),
        behind_step=int(behind["step"]),
        behind_for_s=float(behind["for_s"]),
        folder=str(folder),
        innermost=innermost,
    )


def main_thread_frames(stacks: str, keep: int = INNERMOST) -> list[str]:
    """The innermost ``keep`` frames of the main thread in a stacks file: ``file:line in name: source`` each."""
    block = re.search(r"^Thread MainThread .*?$(.*?)(?=^Thread |\Z)", stacks, re.S | re.M)
    if block is None:
        return []
    frames, lines = [], block.group(1).splitlines()
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            source = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            frames.append(f"{Path(match['file']).name}:{match['line']} in {match['name']}: {source}".rstrip(": "))
    return frames[-keep:]
