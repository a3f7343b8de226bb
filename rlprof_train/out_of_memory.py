"""The line a run ends with when the device runs out of memory inside a step: where (step, role, phase), what
(the bytes asked for and the device's free bytes, from torch's message; what the device held before the run started:
other processes, this process's CUDA context), the OOM snapshot the ``torch_memory`` tool
wrote (or that it was off), and an override to try: the memory analysis of that snapshot
(:func:`rlprof.analysis.memory_remedies.remedies`, with the run's own settings), else the seed's first memory setting
for the failing role that is not on. The run's last complete checkpoint is left as it is: resuming with the override
goes on from it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from rlprof.analysis.allocations import OomMoment, OutOfMemory, summarize
from rlprof.analysis.memory_remedies import remedies
from rlprof.analysis.render.units import human_bytes
from rlprof.analysis.run import setting_of
from rlprof.analysis.sources.base import SourceError
from rlprof.analysis.sources.cuda_snapshot import read_snapshot
from rlprof.tools import tool_names, tool_spec, tool_specs

EXIT_CODE = 3
"""A run stopped by the device's memory (1: any other error in training; 2: a configuration problem)."""
_SIZE = r"([\d.]+) ([KMGTP]?i?B)"
_REQUESTED = re.compile(r"Tried to allocate " + _SIZE)
_FREE = re.compile(r"of which " + _SIZE + r" is free")
_TOTAL = re.compile(r"total capacity of " + _SIZE)
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}


def _bytes(pattern: re.Pattern[str], message: str) -> Optional[int]:
    found = pattern.search(message)
    return int(float(found.group(1)) * _UNITS.get(found.group(2), 1)) if found else None


def _snapshot(save_path: Path, rank: int) -> Optional[Path]:
    """The newest OOM snapshot of ``rank`` under ``save_path`` (the torch_memory tool writes one on an OOM)."""
    found = sorted((save_path / "torch_memory").glob(f"oom_rank{rank}_*.pickle"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _moment(snapshot: Optional[Path], requested: int, free: int, total: Optional[int], tag: str) -> OomMoment:
    """What the snapshot says was alive at the failure; without one, the failure alone (so that the remedies are
    the failing role's, in the seed's order)."""
    if snapshot is not None:
        try:
            for history in read_snapshot(snapshot):
                moment = summarize(history).oom
                if moment is not None:
                    return moment
        except SourceError:
            pass  # a snapshot cut short by the failure: the failure alone
    failure = OutOfMemory(requested, free, total, None, 0, None, tag, "", 1)
    return OomMoment(failure, 0, None, {}, {}, [], [])


def out_of_memory_line(
    error: BaseException,
    config: dict[str, Any],
    rank: int,
    step: int,
    role: str,
    phase: str,
    held_at_start: Optional[int] = None,
) -> str:
    """The one line for ``error``, a device OOM in ``phase`` of ``role`` at ``step`` (see the module doc)."""
    message = str(error)
    requested, free, total = _bytes(_REQUESTED, message), _bytes(_FREE, message), _bytes(_TOTAL, message)
    profiler = config.get("global_profiler") or {}
    tool = profiler.get("tool")
    recording = isinstance(tool, str) and tool in tool_names() and tool_spec(tool).oom_snapshot
    snapshots = next(spec.name for spec in tool_specs() if spec.oom_snapshot)  # the tool that writes one
    snapshot = _snapshot(Path(profiler.get("save_path") or "outputs/profile"), rank) if recording else None
    moment = _moment(snapshot, requested or 0, free or 0, total, f"{role}/{phase}")
    fixes = remedies(moment, lambda key: setting_of(config, key))
    facts = ((requested, "requested"), (free, "free"), (held_at_start, "held on the device before the run started"))
    amounts = ", ".join(f"{human_bytes(value)} {what}" for value, what in facts if value is not None)

    where = f"in step {step}, {role} {phase}" if role else f"in step {step}, {phase}"
    recorded = (
        f"its OOM snapshot: {snapshot} (rlprof memory {snapshot} says what held the memory)"
        if snapshot is not None
        else f"{snapshots} was "
        + ("on but wrote no OOM snapshot" if recording else "off")
        + f" (record one: global_profiler.tool={snapshots} 'global_profiler.steps=[{step}]')"
    )
    larger = (
        f"; the request alone is more than the device's {human_bytes(moment.failure.device_total or 0)}: no memory "
        "freed makes room for it, only a smaller request does"
        if moment.failure.exceeds_device
        else ""
    )
    advice = f"; try {fixes[0].override}, then resume: the last checkpoint is intact" if fixes else ""
    return (
        f"out of memory on the device {where}" + (f" ({amounts})" if amounts else "") + f"{larger}; {recorded}{advice}"
    )
