"""One streaming pass over a Chrome trace written by torch.profiler (``*.pt.trace.json[.gz]``): per range totals,
self times and the operators inside, per-step times, and GPU kernels attributed to the ranges that launched them.

The file is never loaded whole. Kineto writes one event per indented block (``\\n  {`` ... ``\\n  },``); the reader
cuts the decompressed stream at those boundaries and parses a few megabytes of events at a time with orjson, so
memory stays flat whatever the trace's size. A trace in another layout is read with ijson's streaming parser.

Nesting: on each thread, an event's children are the events that start inside it (kineto writes each thread's
events in start order; a trace that is not is re-sorted per thread). A range's *self* time is its duration minus
its direct children's; an operator's self time counts for every rlprof range around it (``actor/update_actor``
lists the operators of its micro-batches too).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

import orjson

CHUNK = 4 << 20
MAX_EVENT_BYTES = 256 << 20
STEP_PREFIX = "ProfilerStep#"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
CPU_CATEGORIES = frozenset(
    {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "cpu_instant_event", "Trace"}
)


class TraceError(ValueError):
    """The file is not a readable Chrome trace; the message says why in one line."""


@dataclass
class RangeTotals:
    """One ``role/name`` range in one trace: how often, how long in all, how much of it outside its children."""

    label: str
    count: int = 0
    total_us: float = 0.0
    self_us: float = 0.0
    cuda_us: float = 0.0
    """GPU kernel time launched from inside the range."""
    allocated_bytes: int = 0
    """Bytes allocated inside the range (``[memory]`` events, torch tool with ``contents: [memory]``)."""
    peak_allocated: int = 0
    """Highest ``Total Allocated`` seen inside the range (same source), or 0."""


@dataclass
class OpTotals:
    name: str
    device: str
    """``cpu`` (operator self time) or ``cuda`` (kernel time)."""
    count: int = 0
    self_us: float = 0.0


@dataclass
class TraceScan:
    """What one pass over one trace found."""

    path: str
    rank: Optional[int] = None
    world_size: Optional[int] = None
    events: int = 0
    ranges: dict[str, RangeTotals] = field(default_factory=dict)
    ops: dict[tuple[str, str, str], OpTotals] = field(default_factory=dict)
    """(range label, operator name, device) -> totals; the label ``""`` holds operators outside every range."""
    steps: dict[int, float] = field(default_factory=dict)
    """ProfilerStep number -> its duration in µs."""
    memory_events: int = 0
    """``[memory]`` events seen (allocations and frees recorded with ``profile_memory``)."""
    problems: list[str] = field(default_factory=list)
    """What could not be read (a truncated file, re-sorted threads): one line each."""


# --------------------------------------------------------------------------------------------- reading events


def _open(path: Path) -> IO[bytes]:
    with path.open("rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile reads bytes
    return path.open("rb")


def _header_info(header: bytes, scan: TraceScan) -> None:
    for line in header.splitlines():
        text = line.strip()
        if text.startswith(b'"distributedInfo"'):
            try:
                info = orjson.loads(text.split(b":", 1)[1].rstrip(b","))
            except orjson.JSONDecodeError:
                continue
            if isinstance(info, dict):
                scan.rank = info.get("rank")
                scan.world_size = info.get("world_size")


class _Inflated:
    """A ``.json`` or ``.json.gz`` file read in decompressed blocks. A gzip stream cut short yields what it holds and
    then sets ``truncated`` (``gzip.GzipFile`` would drop the last block with an error)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("rb")
        gzipped = self.file.read(2) == b"\x1f\x8b"
        self.file.seek(0)
        self.inflater = zlib.decompressobj(zlib.MAX_WBITS | 16) if gzipped else None
        self.truncated = False

    def read(self, size: int) -> bytes:
        if self.inflater is None:
            return self.file.read(size)
        parts: list[bytes] = []
        produced = 0
        while produced < size:
            pending = self.inflater.unconsumed_tail or self.file.read(1 << 18)
            if not pending:
                self.truncated = not self.inflater.eof
                break
            block = self.inflater.decompress(pending, size - produced)
            if self.inflater.eof and self.inflater.unused_data:  # a file of several gzip members
                rest = self.inflater.unused_data
                self.inflater = zlib.decompressobj(zlib.MAX_WBITS | 16)
                block += self.inflater.decompress(rest, max(1, size - produced - len(block)))
            parts.append(block)
            produced += len(block)
        return b"".join(parts)

    def close(self) -> None:
        self.file.close()


def iter_event_batches(path: Path, scan: TraceScan) -> Iterator[list[Any]]:
    """The trace's events, a batch (a few MB of the file) at a time; header facts go into ``scan``."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    stream = _Inflated(path)
    try:
        head = stream.read(1 << 16)
        start = head.find(b'"traceEvents"')
        if start < 0 or not head.lstrip().startswith(b"{"):
            raise TraceError(f"{path} is not a Chrome trace (no traceEvents in its first 64 KiB)")
        _header_info(head[:start], scan)
        bracket = head.find(b"[", start)
        if bracket < 0 or head.find(b"\n  {", bracket) < 0 or head.find(b"\n  },", bracket) < 0:
            yield from _ijson_batches(path, scan)
            return
        buffer = head[bracket + 1 :]
        while True:
            block = stream.read(CHUNK)
            buffer += block
            cut = buffer.rfind(b"\n  },")
            if block and cut >= 0:
                yield orjson.loads(b"[" + buffer[: cut + 4] + b"]")
                buffer = buffer[cut + 5 :]
            elif block and len(buffer) > MAX_EVENT_BYTES:
                raise TraceError(f"{path}: no event boundary in {len(buffer) >> 20} MiB; not a torch trace layout")
            elif not block:
                break
        end = buffer.rfind(b"\n  ]")
        if end >= 0 and not stream.truncated:
            tail = buffer[:end].strip()
        else:  # cut short: the complete events before the cut
            reason = "the gzip stream ends early" if stream.truncated else "the event list is never closed"
            scan.problems.append(
                f"{path.name} is truncated or damaged ({reason}); what came before the damage is reported"
            )
            last = buffer.rfind(b"\n  }")
            tail = buffer[: last + 4].strip().rstrip(b",") if last >= 0 else b""
        if tail:
            yield orjson.loads(b"[" + tail + b"]")
    except zlib.error as exc:
        scan.problems.append(f"{path.name} is damaged ({exc}); what came before the damage is reported")
    except orjson.JSONDecodeError as exc:
        scan.problems.append(f"{path.name}: events after byte {exc.pos} of a batch are not valid JSON ({exc.msg})")
    finally:
        stream.close()


def _ijson_batches(path: Path, scan: TraceScan) -> Iterator[list[Any]]:
    """Any other layout of a Chrome trace, streamed by ijson (slower; same results)."""
    import ijson

    with _open(path) as stream:
        batch: list[Any] = []
        for event in ijson.items(stream, "traceEvents.item", use_float=True):
            batch.append(event)
            if len(batch) >= 50_000:
                yield batch
                batch = []
        if batch:
            yield batch
    if scan.rank is None:
        with _open(path) as stream:
            for info in ijson.items(stream, "distributedInfo"):
                scan.rank, scan.world_size = info.get("rank"), info.get("world_size")


# --------------------------------------------------------------------------------------------- the pass


def is_range(name: str) -> bool:
    """An rlprof range (``role/name``), as opposed to an operator or a library's own annotation."""
    return "/" in name and not name.startswith(STEP_PREFIX)


REORDER_WINDOW = 4096
"""Events carried from one batch into the next, so that events a little out of start order on a thread (kineto on
a loaded machine) are put back in order in passing; only a thread disordered by more than this is held whole and
re-sorted at the end (see ``_Walk.finish``)."""


def _start_key(event: Any) -> tuple[float, float]:
    return float(event.get("ts", 0.0)), -float(event.get("dur", 0.0))


def _in_start_order(events: list[Any]) -> bool:
    """Whether each thread's complete CPU-side events start in order (what the nesting walk needs)."""
    last: dict[Any, float] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("cat", "") in GPU_CATEGORIES:
            continue
        thread = (event.get("pid"), event.get("tid"))
        start = float(event.get("ts", 0.0))
        if start < last.get(thread, start):
            return False
        last[thread] = start
    return True


def in_start_order(batches: Iterator[list[Any]]) -> Iterator[list[Any]]:
    """The same events, with disorder of up to :data:`REORDER_WINDOW` events repaired: each batch and the last
    events of the one before are sorted by start (longest first on ties, file order after) when out of order."""
    carry: list[Any] = []
    for batch in batches:
        window = carry + batch
        if not _in_start_order(window):
            window.sort(key=_start_key)
        carry = window[-REORDER_WINDOW:]
        if len(window) > REORDER_WINDOW:
            yield window[:-REORDER_WINDOW]
    if carry:
        yield carry


def scan_trace(path: str | Path) -> TraceScan:
    """Read ``path`` once and return its :class:`TraceScan`."""
    path = Path(path)
    scan = TraceScan(str(path))
    walk = _Walk()
    for batch in in_start_order(iter_event_batches(path, scan)):
        walk.consume(batch)
    walk.finish(scan, path.name)
    return scan


# A frame: [end, duration, children's total, name, kind, ranges around it (and itself, for a range)]
RANGE, STEP, OP, OTHER = 0, 1, 2, 3


class _Walk:
    """The per-thread nesting walk (the hot loop of ``rlprof report``: plain lists and local names on purpose)."""

    def __init__(self) -> None:
        self.stacks: dict[Any, list[list[Any]]] = {}
        self.last_start: dict[Any, float] = {}
        self.unordered: dict[Any, list[dict[str, Any]]] = {}
        self.launches: dict[Any, tuple[str, ...]] = {}
        self.kernels: list[tuple[Any, str, float]] = []
        self.intervals: dict[Any, list[tuple[float, float, str]]] = {}
        self.memory: dict[Any, list[tuple[float, int, int]]] = {}
        self.op_self: dict[tuple[tuple[str, ...], str], list[float]] = {}
        """(enclosing ranges, operator) -> [count, self µs]; spread over each range at the end."""
        self.range_totals: dict[str, list[float]] = {}
        self.steps: dict[int, float] = {}
        self.events = 0

    def consume(self, events: list[Any], check_order: bool = True) -> None:
        stacks, last_start, unordered = self.stacks, self.last_start, self.unordered
        for event in events:
            phase = event.get("ph")
            if phase != "X":
                if phase == "i" and event.get("name") == "[memory]":
                    self._memory_event(event)
                continue
            self.events += 1
            category = event.get("cat", "")
            if category in GPU_CATEGORIES:
                args = event.get("args") or {}
                self.kernels.append((args.get("correlation"), event.get("name", ""), float(event.get("dur", 0.0))))
                continue
            thread = (event.get("pid"), event.get("tid"))
            start = float(event.get("ts", 0.0))
            if check_order:
                if thread in unordered or start < last_start.get(thread, start):
                    unordered.setdefault(thread, []).append(event)
                    continue
                last_start[thread] = start
            duration = float(event.get("dur", 0.0))
            name = event.get("name", "")
            stack = stacks.get(thread)
            if stack is None:
                stack = stacks[thread] = []
            while stack and stack[-1][0] <= start:
                self._finish(stack.pop())
            enclosing: tuple[str, ...] = ()
            if stack:
                parent = stack[-1]
                parent[2] += duration
                enclosing = parent[5]
            if category == "user_annotation":
                if name.startswith(STEP_PREFIX):
                    kind = STEP
                elif "/" in name:
                    kind, enclosing = RANGE, (*enclosing, name)
                    self.intervals.setdefault(thread, []).append((start, start + duration, name))
                else:
                    kind = OP
            elif category == "cpu_op":
                kind = OP
            else:
                kind = OTHER
                if category == "cuda_runtime":
                    correlation = (event.get("args") or {}).get("correlation")
                    if correlation is not None:
                        self.launches[correlation] = enclosing
            stack.append([start + duration, duration, 0.0, name, kind, enclosing])

    def _finish(self, frame: list[Any]) -> None:
        _, duration, children, name, kind, enclosing = frame
        own = duration - children if duration > children else 0.0
        if kind == OP:
            totals = self.op_self.get((enclosing, name))
            if totals is None:
                self.op_self[(enclosing, name)] = [1, own]
            else:
                totals[0] += 1
                totals[1] += own
        elif kind == RANGE:
            row = self.range_totals.get(name)
            if row is None:
                row = self.range_totals[name] = [0, 0.0, 0.0]
            row[0] += 1
            row[1] += duration
            row[2] += own
        elif kind == STEP:
            number = name[len(STEP_PREFIX) :]
            if number.isdigit():
                self.steps[int(number)] = duration

    def _memory_event(self, event: dict[str, Any]) -> None:
        args = event.get("args") or {}
        self.memory.setdefault((event.get("pid"), event.get("tid")), []).append(
            (float(event.get("ts", 0.0)), int(args.get("Bytes", 0)), int(args.get("Total Allocated", 0)))
        )

    def finish(self, scan: TraceScan, name: str) -> None:
        """Re-sort the threads that were out of order, close every frame and fill ``scan``."""
        for thread, events in self.unordered.items():
            scan.problems.append(f"thread {thread[1]} of {name} was not in start order; its events were re-sorted")
            self.consume(
                sorted(events, key=lambda e: (float(e.get("ts", 0.0)), -float(e.get("dur", 0.0)))), check_order=False
            )
        for stack in self.stacks.values():
            while stack:
                self._finish(stack.pop())
        scan.events = self.events
        scan.steps = dict(self.steps)
        for label, (count, total, own) in self.range_totals.items():
            scan.ranges[label] = RangeTotals(label, int(count), total, own)
        for (enclosing, op), (count, own) in self.op_self.items():
            for label in enclosing or ("",):
                totals = scan.ops.get((label, op, "cpu"))
                if totals is None:
                    totals = scan.ops[(label, op, "cpu")] = OpTotals(op, "cpu")
                totals.count += int(count)
                totals.self_us += own
        _attribute_kernels(scan, self.kernels, self.launches)
        _attribute_memory(scan, self.intervals, self.memory)


def _attribute_kernels(
    scan: TraceScan, kernels: list[tuple[Any, str, float]], launches: dict[Any, tuple[str, ...]]
) -> None:
    for correlation, name, duration in kernels:
        for label in launches.get(correlation, ()) or ("",):
            if label in scan.ranges:
                scan.ranges[label].cuda_us += duration
            key = (label, name, "cuda")
            totals = scan.ops.get(key)
            if totals is None:
                totals = scan.ops[key] = OpTotals(name, "cuda")
            totals.count += 1
            totals.self_us += duration


def _attribute_memory(
    scan: TraceScan,
    intervals: dict[Any, list[tuple[float, float, str]]],
    memory: dict[Any, list[tuple[float, int, int]]],
) -> None:
    """Each ``[memory]`` event counts for every rlprof range open on its thread at its time (a sweep per thread)."""
    for thread, events in memory.items():
        scan.memory_events += len(events)
        spans = sorted(intervals.get(thread, []))
        open_ranges: list[tuple[float, str]] = []
        next_span = 0
        for time, size, total in sorted(events):
            while next_span < len(spans) and spans[next_span][0] <= time:
                open_ranges.append((spans[next_span][1], spans[next_span][2]))
                next_span += 1
            open_ranges = [(end, label) for end, label in open_ranges if end >= time]
            for _, label in open_ranges:
                totals = scan.ranges.get(label)
                if totals is None:
                    continue
                if size > 0:
                    totals.allocated_bytes += size
                totals.peak_allocated = max(totals.peak_allocated, total)
