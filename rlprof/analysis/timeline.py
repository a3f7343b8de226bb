"""One Chrome trace of a whole run (``rlprof timeline RUN -o merged.pt.trace.json.gz``): every torch trace of the
run -- each rank's trainer process, vLLM's engine beside it, or any folder of rank files -- on one clock, for
Perfetto, chrome://tracing and TensorBoard's trace viewer.

Lanes. Each file's processes become lanes of their own, named for the file's rank and side (``rank 0 trainer``,
``rank 0 vLLM engine``, and the host when the run spans several), in rank order with each engine below its trainer.
Process ids are renumbered (two hosts can use one pid; kineto numbers GPUs from 0 in every file), and flow and async
ids are renumbered per file, so no arrow joins events of two files by accident.

Clocks. Kineto writes an event's time in µs after the header's ``baseTimeNanoseconds`` (the host's wall clock at the
start, whole seconds); older traces carry wall-clock µs themselves. Either way a file is placed on its host's wall
clock, and the output counts µs from the earliest event of all files. A file on neither (an old steady clock, µs
since boot) cannot be placed: it starts at 0 and a note says so. Processes of one host share its clock. Hosts' clocks
differ by their synchronisation error, which the merge measures from the collectives all ranks take part in: the
n-th collective of a name ends at about the same moment on every rank (none finishes before the last one joins), so
the median difference of those ends between the first host and another estimates their skew (reported, not
corrected; it includes the ranks' own spread at the end of a collective).

Marks. Each ``ProfilerStep#N`` of the lowest-rank trainer becomes a global instant event too (a line across all
lanes), and each outermost trainer range of the ``rollout`` role gets a flow arrow to the first event of the same
rank's engine that starts inside it: the engine work the trainer waits on.

Pipeline. An asynchronous run's pipeline records (``{trainer.log_dir}/pipeline``, when the run's log folder is
given) are drawn too, on the same clock: each process's waits, windows and samplings, and each prompt's samples from
their sampling to their update (:mod:`rlprof.analysis.pipeline_lanes`); with ``--step``, within that window's traces.

Memory stays bounded as in ``rlprof report``: a file is read a megabyte of events at a time, each batch written out
at once; across files the merge keeps one number per step, per collective (at most :data:`MAX_KEPT` a file) and
per rollout range. Times are read, never trusted: an event without a number for ``ts`` is written as it is.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import itertools
import json
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

import msgspec

from rlprof.analysis.pipeline_lanes import Pipeline, chrome_events, read_pipeline
from rlprof.analysis.run import Run
from rlprof.analysis.sources import source
from rlprof.analysis.sources.base import InputFile
from rlprof.analysis.sources.chrome_trace import (
    DEVICE_OPS,
    TraceError,
    iter_batches,
    rank_from_name,
    raw_blocks,
    read_head,
)
from rlprof.analysis.trace_model import TraceScan

WALL_CLOCK_US = 1e15
"""Times at least this large are wall-clock µs (after September 2001); smaller ones count from something else."""
MAX_KEPT = 100_000
"""Collective ends and rollout ranges kept per file, at most (for the skew estimate and the flow arrows), and the
processes given lanes of their own (the rest share one)."""
ID_SPACE = 1 << 40
"""Flow and async ids of file ``i`` become ``i * ID_SPACE + id``."""
ID_PHASES = frozenset("stfbenSTFp")
COLLECTIVE = re.compile(r"nccl|rccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.IGNORECASE)
_BASE_TIME = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')
_HOST_NAME = re.compile(rb'"host_name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_RANK = re.compile(rb'"distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*(\d+)', re.S)
_TS = re.compile(rb'"ts"\s*:\s*(-?\d+(?:\.\d+)?)')


class TimelineError(ValueError):
    """Nothing to merge, or the output cannot be written; one line."""


@dataclass
class Lane:
    """One input file: where its events go and what was kept of them."""

    file: InputFile
    rank: Optional[int]
    host: Optional[str]
    engine: bool
    base_us: Optional[float]
    """``baseTimeNanoseconds`` in µs, when the header has it."""
    first_ts: Optional[float]
    """The earliest ``ts`` of the file's first events (its start, as the file counts)."""
    label: str = ""
    offset_us: float = 0.0
    """Added to each ``ts`` of the file."""
    placed: bool = True
    """On its host's wall clock (False: a clock of its own, started at 0)."""
    events: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    """The file's process ids (as text) -> their ids in the output."""
    named: set[int] = field(default_factory=set)
    """Output pids the file names itself (``process_name``)."""
    collectives: dict[tuple[bool, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    """(on the device, collective name) -> the ends of its runs, in output µs."""
    kept: int = 0

    @property
    def wall_start_us(self) -> Optional[float]:
        if self.first_ts is None:
            return None
        if self.base_us is not None:
            return self.base_us + self.first_ts
        return self.first_ts if self.first_ts >= WALL_CLOCK_US else None


@dataclass
class Timeline:
    """What :func:`merge` wrote."""

    output: Path
    lanes: list[Lane]
    events: int
    steps: dict[int, float]
    """Step number -> its start in output µs (the lowest-rank trainer's ``ProfilerStep#N``)."""
    flows: int
    """Arrows from a trainer's rollout range to its engine's work."""
    skew_us: dict[str, Optional[float]]
    """Host -> the median difference of its collective ends from the first host's (None: no collective in common)."""
    notes: list[str] = field(default_factory=list)
    pipeline_lanes: int = 0
    """Processes whose pipeline records were drawn."""
    sample_lives: int = 0
    """Prompt groups followed from their sampling to their update."""


def plan(
    run: Run, step: Optional[int] = None, pipeline: Optional[Pipeline] = None
) -> tuple[list[Lane], list[str], float]:
    """The run's Chrome traces (those of the window holding ``step``, when given) as lanes, placed on one clock; and
    that clock's 0 in wall-clock µs (the earliest trace's start, or the ``pipeline`` records' without ``step``)."""
    notes: list[str] = []
    mergeable = [f for f in run.inputs if _merges(f)]
    files = mergeable
    if step is not None:
        files = [f for f in files if f.steps and f.steps[0] <= step <= f.steps[-1]]
    others = sorted({f.format for f in run.traces if not _merges(f)})
    if others:
        notes.append(f"not merged: {', '.join(others)} files (a timeline merges Chrome traces)")
    if not files and (pipeline is None or step is not None):
        windows = sorted({f.window_name for f in mergeable})
        where = (
            f" of the window holding step {step} (windows: {', '.join(windows) or 'none'})" if step is not None else ""
        )
        raise TimelineError(f"{run.name}: no Chrome trace{where} to merge")
    lanes = [_lane(f) for f in files]
    starts = [s for s in (lane.wall_start_us for lane in lanes) if s is not None]
    pipeline_start = pipeline.start_us if pipeline is not None and step is None else None
    if pipeline_start is not None:
        starts.append(pipeline_start)
    origin = min(starts) if starts else 0.0
    hosts = {lane.host for lane in lanes}
    for lane in lanes:
        if lane.wall_start_us is None:
            lane.placed = False
            lane.offset_us = -(lane.first_ts or 0.0)
            notes.append(f"{lane.file.path.name}: its times are not wall-clock times; it is placed to start at 0")
        else:
            lane.offset_us = (lane.base_us or 0.0) - origin
    lanes.sort(key=lambda lane: (lane.rank is None, lane.rank or 0, lane.engine, lane.host or "", lane.file.path))
    for lane in lanes:
        who = f"rank {lane.rank}" if lane.rank is not None else lane.file.path.name
        process = lane.file.pool or "trainer"  # a synchronous run's process trains and generates: "trainer"
        side = f" {lane.file.engine} engine" if lane.engine else (f" {process}" if lane.file.tool is not None else "")
        window = f" {lane.file.window_name}" if lane.file.steps else ""
        lane.label = f"{lane.host} · " * (len(hosts) > 1) + f"{who}{side}{window}"
    return lanes, notes, origin


def _merges(file: InputFile) -> bool:
    """Whether the file's source reads Chrome trace events the timeline can place."""
    reader = source(file.format)
    return reader is not None and reader.timeline


def _lane(file: InputFile) -> Lane:
    head = read_head(file.path, 1 << 16)
    base = _BASE_TIME.search(head)
    host = _HOST_NAME.search(head)
    rank = _RANK.search(head)
    return Lane(
        file,
        rank=file.rank if file.rank is not None else int(rank.group(1)) if rank else rank_from_name(file.path.name),
        host=file.host or (host.group(1).decode("utf-8", "replace") if host else None),
        engine=file.engine is not None,
        base_us=int(base.group(1)) / 1000 if base else None,
        first_ts=_earliest_ts(file.path),
    )


def _earliest_ts(path: Path) -> Optional[float]:
    """The smallest ``ts`` anywhere in the file (one pass over its bytes): kineto writes some events after later
    ones (the profiler's own span and a step's range come last), and an event placed before the output's 0 is
    dropped by Perfetto."""
    earliest: Optional[float] = None
    carry = b""
    for block in itertools.chain(raw_blocks(path), [b","]):  # the last comma reads what is left
        text = carry + block
        cut = text.rfind(b",")  # no number holds a comma: the numbers before it are whole
        if cut < 0 and len(text) < 1 << 20:
            carry = text
            continue
        end = cut if cut >= 0 else len(text)
        carry = text[end:]
        found = [float(t) for t in _TS.findall(text, 0, end)]
        if found:
            earliest = min(found) if earliest is None else min(earliest, *found)
    return earliest


def merge(run: Run, output: Path, step: Optional[int] = None) -> Timeline:
    """Write the run's traces (see the module doc) to ``output`` (gzipped when it ends in ``.gz``), and its pipeline
    records when it wrote some (:mod:`rlprof.analysis.pipeline_lanes`)."""
    pipeline = read_pipeline(run.log_dir) if run.log_dir is not None else None
    lanes, notes, origin = plan(run, step, pipeline)
    output = output.absolute()
    if any(lane.file.path.absolute() == output for lane in lanes):
        raise TimelineError(f"{output}: the output would overwrite one of the traces it merges")
    partial = output.with_name(f".{output.name}.partial")
    merger = _Merger(lanes)
    pipeline_events: list[dict[str, Any]] = []
    try:
        with _open(partial, output) as stream:
            writer = _Writer(stream)
            for index, lane in enumerate(lanes):
                merger.copy(index, lane, writer, notes)
            if pipeline is not None:  # with a step, the span of that window's traces only
                span = (0.0, merger.latest) if step is not None else None
                pipeline_events = chrome_events(pipeline, origin, merger.next_pid, span)
                for event in pipeline_events:
                    writer.write(event)
                notes.extend(pipeline.notes)
            merger.finish(writer)
        os.replace(partial, output)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise TimelineError(f"{output}: cannot be written ({exc.strerror or exc})") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Timeline(
        output,
        lanes,
        sum(lane.events for lane in lanes) + len(pipeline_events),
        merger.steps,
        merger.flows,
        estimate_skew(lanes),
        notes,
        len(pipeline.processes) if pipeline is not None else 0,
        sum(1 for e in pipeline_events if e.get("cat") == "sample" and e["name"].startswith("prompt ")),
    )


@contextlib.contextmanager
def _open(partial: Path, output: Path) -> Iterator[IO[bytes]]:
    """``partial`` for writing, gzipped (level 3: a tenth of the time of level 9 for a few % more bytes) with the
    output's name in the gzip header when the output's name ends in ``.gz``."""
    with open(partial, "wb") as raw:
        if output.name.endswith(".gz"):
            with gzip.GzipFile(output.name, "wb", compresslevel=3, fileobj=raw) as packed:
                yield packed  # type: ignore[misc]  # a GzipFile writes bytes
        else:
            yield raw


class _Writer:
    """The output's JSON: the header, then events separated by commas, then the closing brackets."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.count = 0
        stream.write(b'{\n  "schemaVersion": 1,\n  "displayTimeUnit": "ms",\n  "traceName": "rlprof timeline",\n')
        stream.write(b'  "traceEvents": [\n')

    def write(self, event: dict[str, Any]) -> None:
        self.stream.write((b",\n  " if self.count else b"  ") + msgspec.json.encode(event))
        self.count += 1

    def close(self) -> None:
        self.stream.write(b"\n  ]\n}\n")


@dataclass
class _Range:
    """An outermost rollout range of a trainer, and the first engine event that starts inside it."""

    start: float
    end: float
    pid: int
    tid: Any
    engine: Optional[tuple[float, int, Any]] = None


class _Merger:
    """Copies lanes into the output and keeps what the marks need."""

    def __init__(self, lanes: list[Lane]) -> None:
        self.next_pid = 1
        self.steps: dict[int, float] = {}
        self.step_pid: Optional[int] = None
        trainers = [lane for lane in lanes if not lane.engine and lane.rank is not None]
        self.step_lane = trainers[0] if trainers else None
        self.ranges: dict[Optional[int], list[_Range]] = defaultdict(list)
        self.flows = 0
        self.latest = 0.0
        """The latest end of an event written, in output µs."""

    def copy(self, index: int, lane: Lane, writer: _Writer, notes: list[str]) -> None:
        scan = TraceScan(str(lane.file.path))
        try:
            for batch in iter_batches(lane.file.path, scan, whole=True):
                for event in _events(batch, scan):
                    self._write(index, lane, event, writer)
        except TraceError as exc:
            notes.append(str(exc))
        notes.extend(scan.problems)
        if scan.skipped:
            notes.append(f"{lane.file.path.name}: {scan.skipped} events could not be read; skipped")
        for pid in lane.pids.values():
            sort = {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            writer.write(sort)
            if pid not in lane.named:
                writer.write({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": lane.label}})
        if not lane.engine:
            self._outermost(lane.rank)

    def _write(self, index: int, lane: Lane, event: dict[str, Any], writer: _Writer) -> None:
        lane.events += 1
        key = str(event.get("pid"))
        if len(lane.pids) >= MAX_KEPT and key not in lane.pids:
            key = "(more processes)"  # a file naming a million processes does not make a million lanes
        pid = lane.pids.get(key)
        if pid is None:
            pid = lane.pids[key] = self.next_pid
            self.next_pid += 1
        event["pid"] = pid
        ph, name, ts = event.get("ph"), event.get("name"), _number(event.get("ts"))
        if ts is not None and ph != "M":  # metadata keep theirs (kineto's 0 would fall below the output's 0)
            # every file starts at or after the output's 0 by construction: below it is only the rounding of
            # wall-clock µs (about 1.7e15, a quarter-µs apart as floats)
            ts = event["ts"] = max(0.0, round(ts + lane.offset_us, 3))
        if ph == "M":
            args = event.get("args")
            if name == "process_name" and isinstance(args, dict):
                event["args"] = {**args, "name": f"{lane.label} · {args.get('name', key)}"}
                lane.named.add(pid)
            elif name == "process_sort_index":
                return  # the lanes' order is the merge's
        elif isinstance(ph, str) and ph in ID_PHASES:
            for id_key in ("id", "bind_id"):
                if id_key in event:
                    event[id_key] = _renumbered(event[id_key], index)
        writer.write(event)
        if ph != "X" or ts is None or not isinstance(name, str):
            return
        end = ts + (_number(event.get("dur")) or 0.0)
        self.latest = max(self.latest, end)
        if lane is self.step_lane and name.startswith("ProfilerStep#") and name[13:].isdigit():
            self.steps.setdefault(int(name[13:]), ts)
            self.step_pid = pid
        elif lane.kept >= MAX_KEPT:
            return
        elif lane.engine:
            self._engine_event(lane.rank, ts, pid, event.get("tid"))
        elif name.startswith("rollout/") and event.get("cat") == "user_annotation":
            self.ranges[lane.rank].append(_Range(ts, end, pid, event.get("tid")))
            lane.kept += 1
        elif COLLECTIVE.search(name):
            lane.collectives[(event.get("cat") in DEVICE_OPS, name)].append(end)
            lane.kept += 1

    def _outermost(self, rank: Optional[int]) -> None:
        """Keep the outermost rollout ranges of ``rank``, in start order (engine events are matched to them)."""
        ranges = sorted(self.ranges[rank], key=lambda r: (r.start, -r.end))
        kept: list[_Range] = []
        for candidate in ranges:
            if not kept or candidate.start >= kept[-1].end:
                kept.append(candidate)
        self.ranges[rank] = kept

    def _engine_event(self, rank: Optional[int], ts: float, pid: int, tid: Any) -> None:
        ranges = self.ranges.get(rank)
        if not ranges:
            return
        at = bisect.bisect_right(ranges, ts, key=lambda r: r.start) - 1
        if at < 0:
            return
        found = ranges[at]
        if ts <= found.end and (found.engine is None or ts < found.engine[0]):
            found.engine = (ts, pid, tid)

    def finish(self, writer: _Writer) -> None:
        if self.step_pid is not None:
            for number, start in sorted(self.steps.items()):
                mark = {"ph": "i", "s": "g", "cat": "rlprof", "name": f"step {number}", "ts": start}
                writer.write({**mark, "pid": self.step_pid, "tid": 0})
        flow_id = 0
        for ranges in self.ranges.values():
            for r in ranges:
                if r.engine is None:
                    continue
                flow_id += 1
                ts, pid, tid = r.engine
                common = {"cat": "rlprof", "name": "waits on engine", "id": -flow_id}
                writer.write({**common, "ph": "s", "pid": r.pid, "tid": r.tid, "ts": r.start})
                writer.write({**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts})
        self.flows = flow_id
        writer.close()


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _renumbered(value: Any, index: int) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < ID_SPACE:
        return index * ID_SPACE + value
    return f"{index}:{value}"


_ANY = msgspec.json.Decoder()


def _events(batch: memoryview | bytes | list[Any], scan: TraceScan) -> list[dict[str, Any]]:
    """A batch of :func:`~rlprof.analysis.sources.chrome_trace.iter_batches` (``whole``) as event objects, every
    field kept; what does not decode is skipped and counted."""
    if isinstance(batch, list):  # another layout than kineto's, streamed by ijson
        return batch
    try:
        decoded = _ANY.decode(batch)
        if isinstance(decoded, list):
            return [e for e in decoded if isinstance(e, dict)]
    except msgspec.DecodeError:
        pass
    events = []
    for piece in bytes(batch[1:-1]).split(b"\n  },\n"):
        text = piece.strip().rstrip(b",")
        if not text:
            continue
        try:
            value = json.loads(text if text.endswith(b"}") else text + b"\n  }")
        except (ValueError, RecursionError):
            scan.skipped += 1
            continue
        if isinstance(value, dict):
            events.append(value)
        else:
            scan.skipped += 1
    return events


def estimate_skew(lanes: list[Lane]) -> dict[str, Optional[float]]:
    """Host -> median (its collective end - the first host's) in µs over the collectives both saw, matched by
    window, name and order: the device's collective kernels where both have them (a CPU call of an asynchronous
    collective returns before the others join), else the CPU's (gloo's calls block). {} for a run on one host."""
    hosts = sorted({lane.host or "?" for lane in lanes if lane.placed})
    if len(hosts) < 2:
        return {}
    ends: dict[tuple[str, tuple[int, ...]], dict[tuple[bool, str], list[float]]] = defaultdict(dict)
    for lane in lanes:
        if lane.placed:
            for key, times in lane.collectives.items():
                ends[(lane.host or "?", lane.file.steps)].setdefault(key, times)
    skew: dict[str, Optional[float]] = {}
    for host in hosts[1:]:
        differences: dict[bool, list[float]] = {True: [], False: []}
        for (h, window), mine in ends.items():
            theirs = ends.get((hosts[0], window), {})
            if h != host:
                continue
            for key, times in mine.items():
                pairs = zip(times, theirs.get(key, []), strict=False)  # the runs both saw
                differences[key[0]] += [a - b for a, b in pairs]
        found = differences[True] or differences[False]
        skew[host] = statistics.median(found) if found else None
    return skew
