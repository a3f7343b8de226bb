"""An asynchronous run's pipeline records (:mod:`rlprof.metrics.pipeline_records`) drawn as lanes of the merged
timeline (:mod:`rlprof.analysis.timeline`).

Each process that wrote records gets a lane, ``rank R trainer pipeline`` or ``rank R rollout pipeline``: its waits
(named by reason), its metrics windows (the trainer's steps, the rollouter's time between syncs) and its samplings,
each on a thread of its own. The ``sample lives`` lane follows each prompt's trajectories (a group: sampled together,
trained together) from sampling to update: a slice per group named for its ``uid``, on the first of the lane's rows
free at its start, holding three:

- ``generating``: the rollout process's sampling of the batch (under weights ``version``); the fully-async
  trainer's rollout processes record each group's sampling with its ``uid``, and with partial rollouts it is cut by
  ``paused for a sync`` where the group waited for new weights;
- ``queued``: from the end of that sampling until the trainer rank received the group (the end of its first wait
  for samples in the step's window that ended after the sampling; its last one, or the window's start when it did
  not wait, where none did);
- ``training``: from then to the end of the trainer's step, the update from weights ``consumed_version`` (a
  fully-async step: its local updates and the sync that ends it).

Times: each record's seconds are on its process's monotonic clock; the ``clock`` line that opens its segment ties
them to the wall clock, so every process's records land on the one clock of the merged traces.

The files come from outside: at most :data:`MAX_LINES` lines in all and :data:`MAX_FILES` files are read, a line
longer than :data:`MAX_LINE` bytes or not a JSON object with numbers where times go is skipped (counted in a note),
and a link in the folder is not followed.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rlprof.metrics.pipeline_records import FOLDER

MAX_FILES = 4096
MAX_LINES = 500_000
"""Lines read over all files (about 0.5 GB of records at most): a longer run's lanes end there, said in a note."""
MAX_LINE = 1 << 16
_FILE = re.compile(r"rank(\d+)\.jsonl")
SIDE_LANES = {"trainer": "trainer", "rollouter": "rollout"}
THREADS = {"wait": (1, "waits"), "window": (2, "windows"), "generate": (3, "samplings")}


@dataclass
class ProcessRecords:
    """One process's records, their times (``began``, ``ended``) as wall-clock seconds."""

    rank: int
    """Its launch rank (the file's)."""
    side: str
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Pipeline:
    processes: list[ProcessRecords]
    notes: list[str]

    @property
    def start_us(self) -> Optional[float]:
        began = [e["began"] for p in self.processes for e in p.events if "began" in e]
        return min(began) * 1e6 if began else None


def read_pipeline(log_dir: Path) -> Optional[Pipeline]:
    """The records under ``log_dir/pipeline`` (None: the run wrote none)."""
    folder = log_dir / FOLDER
    if not folder.is_dir() or folder.is_symlink():
        return None
    notes: list[str] = []
    processes = []
    files = sorted((p for p in folder.iterdir() if _FILE.fullmatch(p.name)), key=lambda p: int(p.name[4:-6]))
    budget = [MAX_LINES]  # lines left to read, over every file
    for path in files[:MAX_FILES]:
        if path.is_symlink() or not path.is_file():
            notes.append(f"{path.name}: not a plain file; not read")
            continue
        process = _read(path, int(path.name[4:-6]), notes, budget)
        if process is not None:
            processes.append(process)
    if len(files) > MAX_FILES:
        notes.append(f"{folder}: {len(files) - MAX_FILES} record files past the first {MAX_FILES} not read")
    return Pipeline(processes, notes) if processes else None


def _read(path: Path, rank: int, notes: list[str], budget: list[int]) -> Optional[ProcessRecords]:
    process: Optional[ProcessRecords] = None
    offset: Optional[float] = None  # wall - monotonic of the current segment
    skipped = 0
    with path.open("rb") as handle:
        for raw in handle:
            if budget[0] <= 0:
                notes.append(
                    f"{path.name}: not read to its end (the pipeline lanes hold {MAX_LINES:,} records at most)"
                )
                break
            budget[0] -= 1
            record = _record(raw)
            if record is None:
                skipped += 1
            elif record.get("event") == "clock":
                monotonic, wall = _number(record.get("monotonic")), _number(record.get("wall"))
                side = record.get("side")
                if monotonic is None or wall is None or side not in SIDE_LANES:
                    skipped += 1
                    continue
                offset = wall - monotonic
                process = process or ProcessRecords(rank, side)
            elif process is None or offset is None:
                skipped += 1  # no clock line before it: it cannot be placed
            else:
                times = {key: _number(record.get(key)) for key in ("began", "ended")}
                if record.get("event") == "sample":
                    process.events.append(record)
                elif None in times.values():
                    skipped += 1
                else:
                    process.events.append({**record, **{k: v + offset for k, v in times.items() if v is not None}})
    if skipped:
        notes.append(f"{path.name}: {skipped} lines without a clock, times or JSON skipped")
    return process


def _record(raw: bytes) -> Optional[dict[str, Any]]:
    if len(raw) > MAX_LINE:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def chrome_events(
    pipeline: Pipeline, origin_us: float, first_pid: int, span: Optional[tuple[float, float]] = None
) -> list[dict[str, Any]]:
    """``pipeline`` as Chrome trace events: ``ts`` in µs after ``origin_us`` (wall-clock µs), process ids from
    ``first_pid``; with ``span`` (output µs), only what overlaps it, cut to it."""
    out: list[dict[str, Any]] = []

    def place(began: float, ended: float) -> Optional[tuple[float, float]]:
        start, end = began * 1e6 - origin_us, ended * 1e6 - origin_us
        if span is not None:
            if end < span[0] or start > span[1]:
                return None
            start, end = max(start, span[0]), min(end, span[1])
        return round(max(start, 0.0), 3), round(max(end - max(start, 0.0), 0.0), 3)

    pid = first_pid
    for process in pipeline.processes:
        out.append(_meta("process_name", pid, 0, name=f"rank {process.rank} {SIDE_LANES[process.side]} pipeline"))
        out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        for tid, name in THREADS.values():
            out.append(_meta("thread_name", pid, tid, name=name))
        for event in process.events:
            kind = event.get("event")
            if kind not in THREADS:
                continue
            placed = place(event["began"], event["ended"])
            if placed is None:
                continue
            out.append(
                {
                    "ph": "X",
                    "cat": "pipeline",
                    "name": _name(event),
                    "pid": pid,
                    "tid": THREADS[kind][0],
                    "ts": placed[0],
                    "dur": placed[1],
                    "args": {k: v for k, v in event.items() if k not in ("event", "began", "ended")},
                }
            )
        pid += 1
    lives = [(life, place(life.phases[0][1], life.phases[-1][2])) for life in sample_lives(pipeline)]
    rows: list[float] = []  # each row's latest end: a prompt goes on the first row free at its start
    for life, whole in lives:
        if whole is None:
            continue
        row = next((i for i, end in enumerate(rows) if end <= whole[0]), len(rows))
        if row == len(rows):
            rows.append(0.0)
            out.append(_meta("thread_name", pid, row + 1, name=f"prompts {row + 1}"))
        rows[row] = whole[0] + whole[1]
        common = {"ph": "X", "cat": "sample", "pid": pid, "tid": row + 1}
        who = {"uid": life.uid, "step": life.args["step"], "trainer_rank": life.args["trainer_rank"]}
        out.append({**common, "name": f"prompt {life.uid}", "ts": whole[0], "dur": whole[1], "args": life.args})
        for name, began, ended in life.phases:
            placed = place(began, ended)
            if placed is not None:
                out.append({**common, "name": name, "ts": placed[0], "dur": placed[1], "args": who})
    if rows:
        out.append(_meta("process_name", pid, 0, name="sample lives"))
        out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    return out


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _name(event: dict[str, Any]) -> str:
    kind = event["event"]
    if kind == "wait":
        return f"wait: {event.get('reason')}"
    if kind == "window":
        return f"step {event['step']}" if "step" in event else f"until version {event.get('version')}"
    return f"sample step {event.get('step')}" if event.get("step") is not None else "sample (validation)"


@dataclass
class SampleLife:
    """One prompt's trajectories on one trainer rank: their phases as (name, began, ended) in wall seconds."""

    uid: str
    phases: list[tuple[str, float, float]]
    args: dict[str, Any]


def sample_lives(pipeline: Pipeline) -> list[SampleLife]:
    """Each prompt group consumed by a trainer rank, from its sampling to its update (see the module doc)."""
    rollouts = [p for p in pipeline.processes if p.side == "rollouter"]
    sampled: dict[tuple[int, Any], dict[str, Any]] = {}  # (rollout pool rank, step or group) -> its sampling
    paused: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)  # a streamed group's pauses
    for pool_rank, process in enumerate(rollouts):  # launch ranks in order: the pool's ranks
        for event in process.events:
            if event.get("event") == "generate" and isinstance(event.get("step"), int):
                # a batch's sampling by its step; a streamed group's by its uid (a resumed run's later one wins)
                sampled[(pool_rank, f"uid {event['uid']}" if "uid" in event else event["step"])] = event
            elif event.get("event") == "pause" and "uid" in event:
                paused[(pool_rank, f"uid {event['uid']}")].append((event["began"], event["ended"]))
    lives = []
    for process in pipeline.processes:
        if process.side != "trainer":
            continue
        windows = {
            e["step"]: e for e in process.events if e.get("event") == "window" and isinstance(e.get("step"), int)
        }
        waits = [e for e in process.events if e.get("event") == "wait" and e.get("reason") == "samples"]
        groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
        for event in process.events:
            if event.get("event") == "sample" and isinstance(event.get("step"), int):
                groups[(event["step"], str(event.get("uid")))].append(event)
        for (step, uid), trajectories in groups.items():
            window = windows.get(step)
            rollout_rank = trajectories[0].get("rollout_rank")
            generated = None
            if isinstance(rollout_rank, int):
                generated = sampled.get((rollout_rank, f"uid {uid}"), sampled.get((rollout_rank, step)))
            if window is None or generated is None:
                continue
            inside = [w["ended"] for w in waits if window["began"] <= w["ended"] <= window["ended"]]
            after = [ended for ended in inside if ended >= generated["ended"]]  # the wait that brought it in
            received = min(after) if after else max(inside, default=window["began"])
            pauses = paused.get((rollout_rank, f"uid {uid}"), []) if isinstance(rollout_rank, int) else []
            lives.append(
                SampleLife(
                    uid,
                    [
                        *_sampling(generated["began"], generated["ended"], pauses),
                        ("queued", generated["ended"], max(received, generated["ended"])),
                        ("training", max(received, generated["ended"]), window["ended"]),
                    ],
                    {
                        "step": step,
                        "trainer_rank": process.rank,
                        "rollout_rank": rollout_rank,
                        "version": trajectories[0].get("version"),
                        "consumed_version": trajectories[0].get("consumed_version"),
                        "trajectories": len(trajectories),
                        "response_tokens": sum(int(_number(t.get("response_tokens")) or 0) for t in trajectories),
                    },
                )
            )
    return sorted(lives, key=lambda life: life.phases[0][1])


def _sampling(began: float, ended: float, pauses: list[tuple[float, float]]) -> list[tuple[str, float, float]]:
    """``generating`` from ``began`` to ``ended``, cut by each pause for a weight sync inside it (partial
    rollouts)."""
    phases, start = [], began
    for pause_began, pause_ended in sorted(p for p in pauses if began <= p[0] and p[1] <= ended):
        phases += [("generating", start, pause_began), ("paused for a sync", pause_began, pause_ended)]
        start = pause_ended
    return [*phases, ("generating", start, ended)]
