"""The one trace model every trace source fills and every trace analysis reads (HTA's shape): CPU frames per
thread, the launches that queue device work, and the device operations themselves, reduced in one pass to per-range
totals, operators, steps and the GPU summaries of :mod:`rlprof.analysis.gpu`.

A source (a torch/kineto Chrome trace, an nsys report) feeds a :class:`TraceBuilder` event by event, in any file
order; :meth:`TraceBuilder.finish` returns the :class:`TraceScan`. What is kept meanwhile is compact (typed arrays,
interned names), so memory grows with a few dozen bytes per event, never with the event objects.

Semantics, the same for every source:

- **Ranges.** A *tracked* frame is an rlprof range (``role/name``), any other user annotation, a step
  (``ProfilerStep#N``) or a top-level operator (an operator with no operator around it). On each thread a frame's
  children are the frames that start inside it; a frame's *self* time is its duration minus its children's, launch
  calls included (``cudaLaunchKernel`` is a child of the operator that called it).
- **Attribution by time, not by file order.** A device operation belongs to the launch with its correlation id; the
  launch belongs to the innermost frame open on its thread at its start time, wherever the events sit in the file
  (kineto writes a thread's launches after that thread's operators). Its time counts for every tracked frame around
  that frame; a frame nested in a frame of the same name counts it once. Device operations whose launch is missing
  (a launch outside the recorded window, a library's own stream) are kept, outside every range, and counted.
- **Steps.** A device operation belongs to the step whose ``ProfilerStep#N`` span holds its launch (any thread), or,
  without a launch, its own start.
"""

from __future__ import annotations

import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.analysis.gpu import DeviceOps, GpuSummary, summarize_device

STEP_PREFIX = "ProfilerStep#"
RANGE, ANNOTATION, STEP, OPERATOR = "range", "annotation", "step", "operator"
"""Kinds of tracked frames (see the module doc)."""
OP, NESTING = "op", "nesting"
"""Kinds of CPU frames a source gives besides the tracked ones: an operator (top-level ones become tracked), and a
frame that only nests (a Python call: it takes time from its parent and records nothing itself)."""
FRAME_KINDS = (RANGE, ANNOTATION, STEP, OP, NESTING)
KERNEL, MEMCPY, MEMSET = "kernel", "memcpy", "memset"
"""Kinds of device operations as the trace names them."""


def frame_kind(name: str, annotation: bool) -> str:
    """The kind of a torch.profiler frame called ``name``: a user annotation's (``record_function``) or an
    operator's. torch 1.8 wrote both as operators, so an operator named ``role/name`` (no ``::``) is a range too."""
    if name.startswith(STEP_PREFIX):
        return STEP
    if "/" in name and (annotation or "::" not in name):
        return RANGE
    return ANNOTATION if annotation else OP


def step_number(name: str) -> Optional[int]:
    """``ProfilerStep#12`` -> 12."""
    number = name[len(STEP_PREFIX) :] if name.startswith(STEP_PREFIX) else ""
    return int(number) if number.isdigit() else None


def is_range(name: str) -> bool:
    """An rlprof range (``role/name``), as opposed to an operator, a step or a library's own annotation."""
    return frame_kind(name, True) == RANGE


# --------------------------------------------------------------------------------------------- results


@dataclass
class RangeTotals:
    """One tracked frame name in one trace: how often, how long in all, how much of it outside its children."""

    label: str
    kind: str = RANGE
    """range (rlprof's ``role/name``), annotation, step or operator (top-level)."""
    count: int = 0
    total_us: float = 0.0
    self_us: float = 0.0
    cuda_us: float = 0.0
    """Device time (kernels, copies, sets) launched from inside the frame (nested same-name frames once)."""
    gpu_span_us: float = 0.0
    """The frame's GPU projection (nsys's ``nvtx_gpu_proj``): for each instance, from the first start to the last
    end of the device operations launched inside it, summed over instances (ranges and annotations)."""
    allocated_bytes: int = 0
    """Bytes allocated inside the frame (``[memory]`` events, torch tool with ``contents: [memory]``)."""
    peak_allocated: int = 0
    """Highest ``Total Allocated`` seen inside the frame (same source), or 0."""


@dataclass
class OpTotals:
    name: str
    device: str
    """``cpu`` (operator self time) or ``cuda`` (device time)."""
    count: int = 0
    self_us: float = 0.0


@dataclass
class TraceScan:
    """What one pass over one trace found."""

    path: str
    source: str = "chrome_trace"
    """The format of the file (see :mod:`rlprof.analysis.sources`)."""
    rank: Optional[int] = None
    world_size: Optional[int] = None
    device: Optional[str] = None
    """The device's name as the trace gives it (``NVIDIA A100-SXM4-80GB``, ``AMD Instinct MI250X``, ...)."""
    events: int = 0
    skipped: int = 0
    """Events that could not be read (wrong types, non-objects, a bad number): skipped and counted."""
    ranges: dict[str, RangeTotals] = field(default_factory=dict)
    """Tracked frames by label (see the module doc), every kind."""
    ops: dict[tuple[str, str, str], OpTotals] = field(default_factory=dict)
    """(range label, operator name, device) -> totals; the label ``""`` holds operators outside every range."""
    steps: dict[int, float] = field(default_factory=dict)
    """ProfilerStep number -> its duration in µs."""
    memory_events: int = 0
    """``[memory]`` events seen (allocations and frees recorded with ``profile_memory``)."""
    gpu: Optional[GpuSummary] = None
    """The device's work over the whole trace (None without device operations)."""
    gpu_by_step: dict[int, GpuSummary] = field(default_factory=dict)
    unlaunched: int = 0
    """Device operations whose launch is not in the trace (kept, outside every range)."""
    unlaunched_us: float = 0.0
    problems: list[str] = field(default_factory=list)
    """What could not be read (a truncated file, re-sorted threads): one line each."""

    def ranges_of(self, kind: str) -> list[RangeTotals]:
        return [r for r in self.ranges.values() if r.kind == kind]


# --------------------------------------------------------------------------------------------- the builder


class _Interner:
    """Values (strings, tuples) to small integers and back."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.values: list[Any] = []

    def __call__(self, value: Any) -> int:
        found = self.ids.get(value)
        if found is None:
            found = self.ids[value] = len(self.values)
            self.values.append(value)
        return found


class _Thread:
    """One thread: its open frames, each closed frame (start, end, own time, bucket, context) in typed arrays, and,
    once it broke its start order, the frames held for a sort at the end."""

    __slots__ = ("bucket", "context", "duration", "held", "last", "own", "stack", "start")

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []
        self.last = (float("-inf"), 0.0)
        """(start, -duration) of the last frame walked: frames come in that order (longest first on a tie)."""
        self.held: Optional[list[tuple[float, float, int, int]]] = None
        self.start = array.array("d")
        self.duration = array.array("d")
        self.own = array.array("d")
        """Duration minus the children's (launch calls not yet taken out: see :meth:`TraceBuilder._sweep`)."""
        self.bucket = array.array("i")
        self.context = array.array("i")


_END, _DURATION, _CHILDREN, _BUCKET, _CONTEXT, _DEPTH, _START = range(7)
"""A frame on a thread's stack: [end, duration, children's total, bucket id, context id, operator depth, start]
(durations are kept as given: ``end - start`` loses sub-µs digits at epoch-µs timestamps)."""


class TraceBuilder:
    """Takes a trace's events (see the module doc) and reduces them to a :class:`TraceScan`.

    A *context* is the tuple of tracked ``(kind, label)`` keys around a frame (itself included when tracked); a
    *bucket* is where a closed frame's time goes: ``(kind, label, context of its parent)``.
    """

    def __init__(self, scan: TraceScan) -> None:
        self.scan = scan
        self.names = _Interner()
        self.contexts = _Interner()
        self.buckets = _Interner()
        self.empty_context = self.contexts(())
        self.threads: dict[Any, _Thread] = {}
        self.thread_ids = _Interner()
        self.memory: dict[Any, list[tuple[float, int, int]]] = defaultdict(list)
        self.launch_thread = array.array("i")
        self.launch_start = array.array("d")
        self.launch_duration = array.array("d")
        self.launch_correlation = array.array("q")
        self.op_start = array.array("d")
        self.op_duration = array.array("d")
        self.op_name = array.array("i")
        self.op_kind = array.array("b")
        self.op_stream = array.array("q")
        self.op_correlation = array.array("q")
        self.op_bytes = array.array("q")
        self._file = ""

    # ----------------------------------------------------------------------------------------- inputs

    def frame(self, thread: Any, start: float, duration: float, name: str, kind: str) -> None:
        """A CPU frame of ``kind`` (one of :data:`FRAME_KINDS`; a step's name is ``ProfilerStep#N``). Frames come in
        each thread's start order (the longer first on a tie); a frame out of that order makes the thread's frames
        wait, compactly, to be walked again in order at the end."""
        state = self.threads.get(thread)
        if state is None:
            state = self.threads[thread] = _Thread()
        key = (start, -duration)
        if state.held is not None or key < state.last:
            if state.held is None:
                state.held = []
            state.held.append((start, duration, self.names(name), FRAME_KINDS.index(kind)))
            return
        state.last = key
        self._walk(state, start, duration, name, kind)

    def launch(self, thread: Any, start: float, duration: float, correlation: int) -> None:
        """A CPU call that queued device work (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...), in any order."""
        self.launch_thread.append(self.thread_ids(thread))
        self.launch_start.append(start)
        self.launch_duration.append(duration)
        self.launch_correlation.append(correlation)

    def device_op(
        self, start: float, duration: float, name: str, kind: str, stream: int, correlation: Optional[int], size: int
    ) -> None:
        """A kernel, copy or set on the device (``kind``: kernel, memcpy, memset; ``size`` in bytes or 0)."""
        self.op_start.append(start)
        self.op_duration.append(duration)
        self.op_name.append(self.names(name))
        self.op_kind.append(0 if kind == KERNEL else 1 if kind == MEMCPY else 2)
        self.op_stream.append(stream)
        self.op_correlation.append(correlation if correlation is not None else -1)
        self.op_bytes.append(size)

    def memory_event(self, thread: Any, time: float, size: int, total_allocated: int) -> None:
        """An allocator event (``[memory]``): ``size`` bytes (negative: freed), ``total_allocated`` after it."""
        self.memory[thread].append((time, size, total_allocated))

    # ----------------------------------------------------------------------------------------- the walk

    def _walk(self, state: _Thread, start: float, duration: float, name: str, kind: str) -> None:
        stack = state.stack
        while stack and stack[-1][_END] <= start:
            self._close(state, stack.pop())
        if stack:
            parent = stack[-1]
            parent[_CHILDREN] += duration
            outer, depth = parent[_CONTEXT], parent[_DEPTH]
        else:
            outer, depth = self.empty_context, 0
        context = outer
        if kind == OP:
            kind = OPERATOR if depth == 0 else OP
            depth += 1
        if kind not in (OP, NESTING):  # tracked: its label is in the context of everything inside it (once per name)
            key = (kind, name)
            keys = self.contexts.values[outer]
            if key not in keys:
                context = self.contexts((*keys, key))
        stack.append([start + duration, duration, 0.0, self.buckets((kind, name, outer)), context, depth, start])

    def _close(self, state: _Thread, frame: list[Any]) -> None:
        _, duration, children, bucket, context, _, start = frame
        state.start.append(start)
        state.duration.append(duration)
        state.own.append(duration - children)
        state.bucket.append(bucket)
        state.context.append(context)

    def _rewalk(self, thread: Any, state: _Thread) -> None:
        """Walk a thread that broke its start order again, all its frames in order (the ones walked before too)."""
        frames = list(state.held or [])
        closed = zip(state.start, state.duration, state.bucket, strict=True)
        open_frames = ((f[_START], f[_DURATION], f[_BUCKET]) for f in state.stack)
        for start, duration, bucket in [*closed, *open_frames]:
            kind, name, _ = self.buckets.values[bucket]
            frames.append((start, duration, self.names(name), FRAME_KINDS.index(OP if kind == OPERATOR else kind)))
        fresh = self.threads[thread] = _Thread()
        for start, duration, name, kind in sorted(frames, key=lambda f: (f[0], -f[1])):
            self._walk(fresh, start, duration, self.names.values[name], FRAME_KINDS[kind])
        while fresh.stack:
            self._close(fresh, fresh.stack.pop())
        label = thread[1] if isinstance(thread, tuple) else thread
        self.scan.problems.append(f"thread {label} of {self._file} was not in start order; its events were re-sorted")

    # ----------------------------------------------------------------------------------------- the end

    def finish(self, name: str) -> TraceScan:
        """Close every frame, attribute launches and device operations by time, and fill the scan."""
        import numpy as np

        self._file = name
        for thread, state in list(self.threads.items()):
            if state.held is not None:
                self._rewalk(thread, state)
            else:
                while state.stack:
                    self._close(state, state.stack.pop())
        frames = self._frames(np)
        launch_frame = self._sweep(np, frames)
        self._fill_frames(np, frames, launch_frame)
        launch_of_op = self._launch_of_each_op(np)
        self._attribute_device_ops(np, frames, launch_frame, launch_of_op)
        self._project_instances(np, frames, launch_of_op)
        self._attribute_memory(np, frames)
        steps = self._step_spans(np, frames)
        self.scan.steps = {number: duration for _, _, number, duration in steps}
        if len(self.op_start):
            ops = self._device_ops(np, launch_of_op)
            self.scan.gpu = summarize_device(ops, self.names.values)
            of_step = self._step_of_each_op(np, ops, launch_of_op, steps)
            for _, _, number, _ in steps:
                selected = of_step == number
                if selected.any():
                    self.scan.gpu_by_step[number] = summarize_device(ops.select(selected), self.names.values)
        return self.scan

    def _frames(self, np: Any) -> _Frames:
        """Every closed frame of every thread, each thread's sorted by start (the longer first on a tie)."""
        columns: list[list[Any]] = [[], [], [], [], [], []]
        for thread, state in self.threads.items():
            starts = np.frombuffer(state.start, dtype=np.float64)
            durations = np.frombuffer(state.duration, dtype=np.float64)
            order = np.lexsort((-durations, starts))
            thread_id = self.thread_ids(thread)
            for column, values in zip(
                columns,
                (
                    starts[order],
                    durations[order],
                    np.frombuffer(state.own, dtype=np.float64)[order],
                    np.frombuffer(state.bucket, dtype=np.int32)[order].astype(np.int64),
                    np.frombuffer(state.context, dtype=np.int32)[order].astype(np.int64),
                    np.full(len(order), thread_id, dtype=np.int64),
                ),
                strict=True,
            ):
                column.append(values)
        start, duration, own, bucket, context, thread = (
            np.concatenate(c) if c else np.zeros(0, dtype=np.int64 if i > 2 else np.float64)
            for i, c in enumerate(columns)
        )
        codes = np.array([FRAME_KINDS.index(OP if k == OPERATOR else k) for k, _, _ in self.buckets.values] or [0])
        return _Frames(start, duration, start + duration, own, bucket, context, thread, codes[bucket])

    def _sweep(self, np: Any, frames: _Frames) -> Any:
        """For each launch, the index of the innermost frame open on its thread at its start, or -1 (one merge per
        thread of its frames, sorted by start, with its launches, sorted by time)."""
        count = len(self.launch_start)
        found = np.full(count, -1, dtype=np.int64)
        if not count or not len(frames.start):
            return found
        launch_thread = np.frombuffer(self.launch_thread, dtype=np.int32)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        for thread_id in np.unique(frames.thread).tolist():
            mine = np.nonzero(launch_thread == thread_id)[0]
            if not len(mine):
                continue
            mine = mine[np.argsort(launch_start[mine], kind="stable")]
            rows = np.nonzero(frames.thread == thread_id)[0]
            starts, ends = frames.start[rows].tolist(), frames.end[rows].tolist()
            innermost: list[int] = []
            open_frames: list[int] = []
            following, total = 0, len(starts)
            for time in launch_start[mine].tolist():
                while following < total and starts[following] <= time:
                    while open_frames and ends[open_frames[-1]] <= starts[following]:
                        open_frames.pop()
                    open_frames.append(following)
                    following += 1
                while open_frames and ends[open_frames[-1]] <= time:
                    open_frames.pop()
                innermost.append(int(rows[open_frames[-1]]) if open_frames else -1)
            found[mine] = innermost
        return found

    def _fill_frames(self, np: Any, frames: _Frames, launch_frame: Any) -> None:
        """Totals of tracked frames and operators; a launch call's time comes out of its frame's own time."""
        scan = self.scan
        taken = np.zeros(len(frames.start))
        inside = launch_frame >= 0
        if inside.any():
            durations = np.frombuffer(self.launch_duration, dtype=np.float64)
            np.add.at(taken, launch_frame[inside], durations[inside])
        own = np.maximum(0.0, frames.own - taken)
        buckets = len(self.buckets.values)
        counts = np.bincount(frames.bucket, minlength=buckets)
        totals = np.bincount(frames.bucket, weights=frames.duration, minlength=buckets)
        selfs = np.bincount(frames.bucket, weights=own, minlength=buckets)
        for bucket in np.nonzero(counts)[0].tolist():
            kind, name, outer = self.buckets.values[bucket]
            count, total, own_us = int(counts[bucket]), float(totals[bucket]), float(selfs[bucket])
            if kind in (OP, OPERATOR):  # an operator row under every tracked frame around it
                for label in [key[1] for key in self.contexts.values[outer]] or [""]:
                    row = scan.ops.get((label, name, "cpu"))
                    if row is None:
                        row = scan.ops[(label, name, "cpu")] = OpTotals(name, "cpu")
                    row.count += count
                    row.self_us += own_us
            if kind in (OP, NESTING):
                continue
            row_totals = scan.ranges.get(name)
            if row_totals is None:
                row_totals = scan.ranges[name] = RangeTotals(name, kind)
            row_totals.count += count
            row_totals.total_us += total
            row_totals.self_us += own_us

    def _launch_of_each_op(self, np: Any) -> Any:
        """For each device operation, the index of the launch with its correlation id, or -1."""
        correlation = np.frombuffer(self.op_correlation, dtype=np.int64)
        launches = np.frombuffer(self.launch_correlation, dtype=np.int64)
        found = np.full(len(correlation), -1, dtype=np.int64)
        if len(launches) and len(correlation):
            order = np.argsort(launches, kind="stable")
            ordered = launches[order]
            position = np.minimum(np.searchsorted(ordered, correlation), len(ordered) - 1)
            matched = (ordered[position] == correlation) & (correlation >= 0)
            found[matched] = order[position[matched]]
        return found

    def _attribute_device_ops(self, np: Any, frames: _Frames, launch_frame: Any, launch_of_op: Any) -> None:
        """Each device operation's time to the tracked frames around its launch (see the module doc)."""
        scan = self.scan
        if not len(self.op_start):
            return
        durations = np.frombuffer(self.op_duration, dtype=np.float64)
        names = np.frombuffer(self.op_name, dtype=np.int32).astype(np.int64)
        launched = launch_of_op >= 0
        context = np.full(len(durations), self.empty_context, dtype=np.int64)
        frame = np.where(launched, launch_frame[np.maximum(launch_of_op, 0)] if len(launch_frame) else -1, -1)
        context[frame >= 0] = frames.context[frame[frame >= 0]]
        scan.unlaunched = int((~launched).sum())
        scan.unlaunched_us = float(durations[~launched].sum())
        width = len(self.names.values)
        keys, inverse = np.unique(context * width + names, return_inverse=True)
        totals = np.bincount(inverse, weights=durations)
        counts = np.bincount(inverse)
        for key, total, n in zip(keys.tolist(), totals.tolist(), counts.tolist(), strict=True):
            context_id, name_id = divmod(key, width)
            op_name = self.names.values[name_id]
            for label in [k[1] for k in self.contexts.values[context_id]] or [""]:
                row = scan.ops.get((label, op_name, "cuda"))
                if row is None:
                    row = scan.ops[(label, op_name, "cuda")] = OpTotals(op_name, "cuda")
                row.count += n
                row.self_us += total
                if label in scan.ranges:
                    scan.ranges[label].cuda_us += total

    def _instances(self, np: Any, frames: _Frames, kinds: tuple[str, ...]) -> Any:
        """Indices of the closed frames of ``kinds`` (ranges, annotations, steps)."""
        codes = [FRAME_KINDS.index(kind) for kind in kinds]
        return np.nonzero(np.isin(frames.kind, codes))[0]

    def _project_instances(self, np: Any, frames: _Frames, launch_of_op: Any) -> None:
        """Each range and annotation instance's GPU projection (see :attr:`RangeTotals.gpu_span_us`): a sweep per
        thread over its instances and its launches, each launch widening every instance open around it."""
        launches = len(self.launch_start)
        if not launches or not len(self.op_start):
            return
        first = np.full(launches, np.inf)
        last = np.full(launches, -np.inf)
        launched = launch_of_op >= 0
        starts = np.frombuffer(self.op_start, dtype=np.float64)
        ends = starts + np.frombuffer(self.op_duration, dtype=np.float64)
        np.minimum.at(first, launch_of_op[launched], starts[launched])
        np.maximum.at(last, launch_of_op[launched], ends[launched])
        with_ops = np.isfinite(first)
        launch_thread = np.frombuffer(self.launch_thread, dtype=np.int32)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        instances = self._instances(np, frames, (RANGE, ANNOTATION))
        for thread_id in np.unique(frames.thread[instances]).tolist():
            mine = np.nonzero((launch_thread == thread_id) & with_ops)[0]
            if not len(mine):
                continue
            mine = mine[np.argsort(launch_start[mine], kind="stable")]
            rows = instances[frames.thread[instances] == thread_id]
            span_start, span_end = frames.start[rows].tolist(), frames.end[rows].tolist()
            low, high = [np.inf] * len(rows), [-np.inf] * len(rows)
            open_spans: list[int] = []
            following = 0
            for time, lo, hi in zip(
                launch_start[mine].tolist(), first[mine].tolist(), last[mine].tolist(), strict=True
            ):
                while following < len(rows) and span_start[following] <= time:
                    open_spans.append(following)
                    following += 1
                open_spans = [i for i in open_spans if span_end[i] > time]
                for i in open_spans:
                    low[i] = min(low[i], lo)
                    high[i] = max(high[i], hi)
            for row, lo, hi in zip(rows.tolist(), low, high, strict=True):
                label = self.buckets.values[int(frames.bucket[row])][1]
                if hi > lo:
                    self.scan.ranges[label].gpu_span_us += hi - lo

    def _attribute_memory(self, np: Any, frames: _Frames) -> None:
        """Each ``[memory]`` event counts for every rlprof range open on its thread at its time (a sweep per
        thread)."""
        scan = self.scan
        ranges = self._instances(np, frames, (RANGE,))
        for thread, events in self.memory.items():
            scan.memory_events += len(events)
            thread_id = self.thread_ids.ids.get(thread)
            rows = ranges[frames.thread[ranges] == thread_id] if thread_id is not None else ranges[:0]
            spans = [
                (float(frames.start[r]), float(frames.end[r]), self.buckets.values[int(frames.bucket[r])][1])
                for r in rows.tolist()
            ]
            open_ranges: list[tuple[float, str]] = []
            following = 0
            for time, size, total in sorted(events):
                while following < len(spans) and spans[following][0] <= time:
                    open_ranges.append((spans[following][1], spans[following][2]))
                    following += 1
                open_ranges = [(end, label) for end, label in open_ranges if end >= time]
                for _, label in open_ranges:
                    totals = scan.ranges[label]
                    if size > 0:
                        totals.allocated_bytes += size
                    totals.peak_allocated = max(totals.peak_allocated, total)

    def _step_spans(self, np: Any, frames: _Frames) -> list[tuple[float, float, int, float]]:
        """(start, end, number, duration) of each ProfilerStep span, in order."""
        spans = []
        for row in self._instances(np, frames, (STEP,)).tolist():
            number = step_number(self.buckets.values[int(frames.bucket[row])][1])
            if number is not None:
                spans.append((float(frames.start[row]), float(frames.end[row]), number, float(frames.duration[row])))
        return sorted(spans)

    def _device_ops(self, np: Any, launch_of_op: Any) -> DeviceOps:
        starts = np.frombuffer(self.op_start, dtype=np.float64)
        launched = launch_of_op >= 0
        index = np.maximum(launch_of_op, 0)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        launch_duration = np.frombuffer(self.launch_duration, dtype=np.float64)
        nan = np.full(len(starts), np.nan)
        return DeviceOps(
            start=starts,
            end=starts + np.frombuffer(self.op_duration, dtype=np.float64),
            name=np.frombuffer(self.op_name, dtype=np.int32),
            kind=np.frombuffer(self.op_kind, dtype=np.int8),
            stream=np.frombuffer(self.op_stream, dtype=np.int64),
            bytes=np.frombuffer(self.op_bytes, dtype=np.int64),
            launch_end=np.where(launched, (launch_start + launch_duration)[index], np.nan)
            if len(launch_start)
            else nan,
            launch_duration=np.where(launched, launch_duration[index], np.nan) if len(launch_start) else nan,
            duration=np.frombuffer(self.op_duration, dtype=np.float64),
        )

    def _step_of_each_op(
        self, np: Any, ops: DeviceOps, launch_of_op: Any, steps: list[tuple[float, float, int, float]]
    ) -> Any:
        """The step of each device operation (-1: none): by its launch's start, else its own."""
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        times = ops.start
        if len(launch_start):
            times = np.where(launch_of_op >= 0, launch_start[np.maximum(launch_of_op, 0)], ops.start)
        of_step = np.full(len(times), -1, dtype=np.int64)
        for start, end, number, _ in steps:
            of_step[(times >= start) & (times < end)] = number
        return of_step


@dataclass
class _Frames:
    """Every closed frame of a trace as arrays, each thread's rows together and sorted by start."""

    start: Any
    duration: Any
    end: Any
    own: Any
    bucket: Any
    context: Any
    thread: Any
    kind: Any
    """Index into :data:`FRAME_KINDS` (a top-level operator as ``op``)."""
