"""Checkpoints: ``{default_local_dir}/global_step_{N}/`` with the actor's and critic's DeepSpeed states and the
trainer's own state; ``latest_checkpointed_iteration.txt`` names the last complete one and is written last, so a
run killed while saving resumes from the previous checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def save(root: Path, step: int, engines: dict[str, Any], state: dict[str, Any], is_main: bool,
         barrier: Any, keep: Optional[int]) -> Path:
    """Save every engine (a collective: all ranks call it) and the trainer state, then mark the step complete."""
    target = step_dir(root, step)
    for tag, engine in engines.items():
        engine.save_checkpoint(str(target), tag=tag, save_latest=False)
    if is_main:
        (target / STATE).write_text(json.dumps({**state, "global_step": step}), encoding="utf-8")
        tmp = Path(root) / f".{LATEST}.tmp"
        tmp.write_text(str(step), encoding="utf-8")
        os.replace(tmp, Path(root) / LATEST)
        if keep:
            prune(root, keep)
    barrier()
    return target


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; return what was deleted."""
    steps = sorted(int(m.group(1)) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)))
    doomed = [step_dir(root, s) for s in steps[:-keep]] if len(steps) > keep else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def find_resume_dir(root: Path, resume_mode: str) -> Optional[Path]:
    """The checkpoint to resume from: ``disable`` -> None; ``auto`` -> the latest complete one, if any; a path."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        return Path(resume_mode)
    latest = Path(root) / LATEST
    if not latest.exists():
        return None
    return step_dir(root, int(latest.read_text(encoding="utf-8").strip()))


def load(path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore every engine (optimizer included) from ``path`` and return the trainer state."""
    for tag, engine in engines.items():
        loaded, _ = engine.load_checkpoint(str(path), tag=tag, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
        if loaded is None:
            raise FileNotFoundError(f"checkpoint {path} has no {tag!r} state")
    return json.loads((Path(path) / STATE).read_text(encoding="utf-8"))
