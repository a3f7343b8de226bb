"""``rlprof top RUN_LOG_DIR``: a live view of a run from its folder (over SSH, no server): each rank's step and phase
and how long it has been in it, the last step's breakdown as bars, throughput, the remaining time, the reward, KL,
entropy and response-length trends, and the stalls and stragglers, named. It reads what the run writes there
(``metrics.jsonl``, ``run.json``, the watchdog's ``live/rank{R}.json`` and ``stalls/``), once a second, as untrusted
files; it works on a finished run and on a folder not made yet. ``q`` or Ctrl-C quits (exit 0); SIGTERM and SIGHUP
(a closed SSH session) too. ``--once`` prints one frame and exits (what it does without a terminal)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from rlprof.live_state import LiveState, read_live
from rlprof.stall_files import stall_folder

HELP = "a live view of a run from its log folder: ranks, phases, step breakdown, trends, stalls"
EXAMPLE = "rlprof top outputs/logs/rlprof/ppo-demo           # q quits; --once prints one frame"
KEPT_STEPS = 200
"""Steps of metrics kept for trends and the remaining time."""
MAX_LINE_BYTES = 4 * 2**20
"""A metrics line longer than this is skipped (files from outside are bounded)."""
SILENT_S = 5.0
"""A rank whose live file was not rewritten for this long (it is, each second) is shown silent."""
STRAGGLER = 1.25
"""A rank whose step took this many times the ranks' mean is named a straggler (the report's rule)."""
TRENDS = (
    ("reward", ("critic/score/mean", "critic/rewards/mean")),
    ("KL", ("actor/ppo_kl", "actor/kl_loss")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
)
SPARK = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", type=Path, metavar="RUN_LOG_DIR", help="the run's trainer.log_dir")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")


class MetricsTail:
    """The records of a growing ``metrics.jsonl``, read from where the last read stopped (a cut-short last line is
    read again once whole; a file that shrank, a new run's, is read from its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rows: deque[dict[str, Any]] = deque(maxlen=KEPT_STEPS)

    def read(self) -> None:
        try:
            if self.path.is_symlink():
                return
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset = 0
                self.rows.clear()
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                while True:
                    line = handle.readline(MAX_LINE_BYTES + 1)
                    if not line.endswith(b"\n"):
                        if len(line) > MAX_LINE_BYTES:  # skip the rest of an overlong line
                            self.offset = handle.tell()
                            continue
                        break
                    self.offset = handle.tell()
                    self._keep(line)
        except OSError:
            return

    def _keep(self, line: bytes) -> None:
        try:
            row = json.loads(line)
        except ValueError:
            return
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            self.rows.append(row)


@dataclass
class RunView:
    """What one frame shows, read from the run's folder."""

    log_dir: Path
    record: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[LiveState] = field(default_factory=list)
    stalls: list[str] = field(default_factory=list)
    now: float = 0.0


def read_record(log_dir: Path) -> dict[str, Any]:
    path = log_dir / "run.json"
    try:
        if path.is_symlink() or path.stat().st_size > MAX_LINE_BYTES:
            return {}
        record = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_stall_lines(log_dir: Path) -> list[str]:
    from rlprof.analysis.stalls import read_stalls

    return [
        f"stall at step {s.step}: rank {s.behind_rank} in {s.behind_phase} for {s.behind_for_s:.0f} s (stacks in "
        f"{s.folder})"
        for s in read_stalls(log_dir, [])
    ]


def number(row: dict[str, Any], *keys: str) -> Optional[float]:
    for key in keys:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {rest:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low
    return "".join(SPARK[0 if span == 0 else min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def status(view: RunView) -> str:
    if not view.log_dir.exists():
        return "waiting: the folder does not exist yet"
    if not view.rows and not view.ranks:
        return "waiting: no step logged yet"
    if view.ranks and all(r.closed for r in view.ranks):
        return "ended"
    if view.ranks and all(view.now - r.updated > SILENT_S for r in view.ranks):
        return f"silent: no rank has written for {duration(min(view.now - r.updated for r in view.ranks))}"
    return "running"


def header(view: RunView) -> Text:
    record = view.record
    name = "/".join(str(record[k]) for k in ("project", "experiment") if k in record) or view.log_dir.name
    text = Text.assemble(
        ("rlprof top ", "bold"), (name, "bold cyan"), "  ", (status(view), "yellow"), f"\n{view.log_dir}"
    )
    if view.rows:
        step = view.rows[-1]["step"]
        total = record.get("total_steps")
        text.append(f"\nstep {step}" + (f"/{total}" if isinstance(total, int) and total > 0 else ""))
        times = [t for t in (number(r, "timing_s/step") for r in view.rows[-20:]) if t is not None]
        if isinstance(total, int) and total > step and times:
            text.append(f"  remaining about {duration(statistics.median(times) * (total - step))}")
        last = view.rows[-1]
        for label, key, unit in (
            ("throughput", "perf/throughput", " tokens/s per rank"),
            ("MFU", "perf/mfu/actor", ""),
            ("step", "timing_s/step", " s"),
        ):
            value = number(last, key)
            if value is not None:
                shown = (
                    f"{value:.1%}" if label == "MFU" else (f"{value:,.0f}" if value >= 100 else f"{value:.3g}") + unit
                )
                text.append(f"  {label} {shown}")
    return text


def ranks_table(view: RunView) -> Table:
    table = Table(title="ranks", title_justify="left", expand=False)
    for column in ("rank", "host:pid", "step", "phase", "in it for", "state"):
        table.add_column(column, justify="right" if column in ("rank", "step", "in it for") else "left")
    last = view.rows[-1] if view.rows else {}
    slowest = number(last, "timing_ranks/step/slowest_rank")
    world_size = view.record.get("world_size")
    seen = {r.rank for r in view.ranks}
    for rank in range(world_size if isinstance(world_size, int) and 0 < world_size <= 4096 else 0):
        if rank not in seen:
            table.add_row(str(rank), "", "", "", "", "not started (no live file)")
    for r in view.ranks:
        silent = view.now - r.updated
        state = "ended" if r.closed else (f"silent {duration(silent)}" if silent > SILENT_S else "running")
        if not r.closed and slowest is not None and int(slowest) == r.rank and straggler(last) is not None:
            state += " (straggler)"
        table.add_row(
            str(r.rank),
            f"{r.host}:{r.pid}",
            "" if r.step is None else str(r.step),
            r.phase or "between steps",
            "" if r.since is None or r.closed else duration(view.now - r.since),
            state,
        )
    return table


def straggler(row: dict[str, Any]) -> Optional[str]:
    ratio = number(row, "timing_ranks/step/straggler")
    slowest = number(row, "timing_ranks/step/slowest_rank")
    if ratio is None or slowest is None or ratio < STRAGGLER:
        return None
    return f"straggler: rank {int(slowest)} took {ratio:.2f}x the ranks' mean step at step {row['step']}"


def breakdown(row: dict[str, Any]) -> Table:
    step = number(row, "timing_s/step")
    table = Table(title=f"step {row['step']}: where its {step or 0:.3g} s went", title_justify="left", box=None)
    for column in ("phase", "share", "seconds"):
        table.add_column(column, justify="left" if column != "seconds" else "right")
    phases = [
        (key.removeprefix("timing_s/"), value)
        for key, value in row.items()
        if key.startswith("timing_s/") and key != "timing_s/step" and isinstance(value, (int, float))
    ]
    for phase, seconds in sorted(phases, key=lambda item: -item[1]):
        share = seconds / step if step else 0.0
        filled = max(0, min(BAR_WIDTH, round(share * BAR_WIDTH)))
        table.add_row(phase, "█" * filled + "░" * (BAR_WIDTH - filled) + f" {share:4.0%}", f"{seconds:.3g}")
    return table


def trends(view: RunView) -> Table:
    table = Table(title=f"trends (last {min(len(view.rows), 40)} steps)", title_justify="left", box=None)
    for column in ("metric", "", "last", "change"):
        table.add_column(column, justify="right" if column in ("last", "change") else "left")
    recent = view.rows[-40:]
    for label, keys in TRENDS:
        values = [v for v in (number(r, *keys) for r in recent) if v is not None]
        if values:
            table.add_row(label, sparkline(values), f"{values[-1]:.4g}", f"{values[-1] - values[0]:+.3g}")
    return table


def frame(view: RunView) -> RenderableType:
    parts: list[RenderableType] = [header(view)]
    if view.ranks:
        parts.append(ranks_table(view))
    if view.rows:
        parts += [breakdown(view.rows[-1]), trends(view)]
    troubles = [*view.stalls, *([s] if view.rows and (s := straggler(view.rows[-1])) else [])]
    if troubles:
        parts.append(Text("\n".join(troubles), style="red"))
    parts.append(Text("q quits", style="dim"))
    return Group(*parts)


def snapshot(log_dir: Path, tail: MetricsTail) -> RunView:
    tail.read()
    return RunView(
        log_dir,
        read_record(log_dir),
        list(tail.rows),
        read_live(log_dir),
        read_stall_lines(log_dir) if stall_folder(log_dir).is_dir() else [],
        time.time(),
    )


@contextlib.contextmanager
def keys() -> Iterator[Optional[int]]:
    """stdin in cbreak mode (a key read as it is typed, not echoed) for the view's life; its file descriptor, or
    None when stdin is not a terminal. The terminal's settings come back however the view ends."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class Quit(Exception):
    pass


def _quit(signum: int, frame: Any) -> None:
    raise Quit


def command(args: argparse.Namespace, console: Console) -> int:
    if not math.isfinite(args.interval) or args.interval <= 0:
        from rlprof.cli.common import UsageError

        raise UsageError(f"--interval {args.interval}: give a number of seconds above 0")
    tail = MetricsTail(args.log_dir / "metrics.jsonl")
    if args.once or not console.is_terminal:
        console.print(frame(snapshot(args.log_dir, tail)))
        return 0
    from rich.live import Live

    previous = {s: signal.signal(s, _quit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with keys() as fd, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                live.update(frame(snapshot(args.log_dir, tail)), refresh=True)
                if fd is None:
                    time.sleep(args.interval)
                    continue
                ready, _, _ = select.select([fd], [], [], args.interval)
                if ready and b"q" in os.read(fd, 64).lower():
                    return 0
    except (KeyboardInterrupt, Quit):
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
