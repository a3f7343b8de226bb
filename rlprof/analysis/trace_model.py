"""The one trace model every trace source fills and every trace analysis reads (HTA's shape): CPU frames per
thread, the launches that queue device work, and the device operations themselves, reduced in one pass to per-range
totals, operators, steps and the GPU summaries of :mod:`rlprof.analysis.gpu`.

A source (a torch/kineto Chrome trace, an nsys report) feeds a :class:`TraceBuilder` event by event, in any file
order; :meth:`TraceBuilder.finish` returns the :class:`TraceScan`. What is kept meanwhile is compact (typed arrays,
interned names), so memory grows with a few dozen bytes per event, never with the event objects.

Semantics, the same for every source:

- **Ranges.** A *tracked* frame is an rlprof range (``role/name``), any other user annotation, a step
  (``ProfilerStep#N``) or a top-level operator (an operator with no operator around it). ``role/name`` frames are
  rlprof's only in a trace rlprof wrote (its mark in the trace, or its manifest): elsewhere they are the program's
  own annotations (:meth:`TraceScan.settle_ranges`). On each thread a frame's
  children are the frames that start inside it; a frame's *self* time is its duration minus its children's, launch
  calls included (``cudaLaunchKernel`` is a child of the operator that called it).
- **Attribution by time, not by file order.** A device operation belongs to the launch with its correlation id; the
  launch belongs to the innermost frame open on its thread at its start time, wherever the events sit in the file
  (kineto writes a thread's launches after that thread's operators). Its time counts for every tracked frame around
  that frame; a frame nested in a frame of the same name counts it once. Device operations whose launch is missing
  (a launch outside the recorded window, a library's own stream) are kept, outside every range, and counted.
- **CUDA-graph capture.** Between a thread's ``cudaStreamBeginCapture`` and ``cudaStreamEndCapture`` (HIP's and the
  driver's too), launches queue no device work: they are captured, replayed later by each ``cudaGraphLaunch``. A
  capture window is counted (its launches, the device's idle time inside it), and an idle device during it is not
  a starved one.
- **Steps.** A device operation belongs to the step whose ``ProfilerStep#N`` span holds its launch (any thread: the
  autograd engine's backward thread too), or, without a launch, its own start: a step's device time and its GPU
  summary count those.
"""

from __future__ import annotations

import array
import bisect
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from rlprof.analysis.gpu import DeviceOps, GpuSummary, intersection_length, merged, summarize_device

STEP_PREFIX = "ProfilerStep#"
MAX_FRAME_DEPTH = 512
"""Frames open at once on one thread that are kept; a frame nested deeper (a real trace's stacks are a few dozen
deep) is counted, not kept: its time is its parent's children's, its own frames and launches go to its deepest kept
ancestor."""
REORDER_WINDOW = 256
"""CPU frames of a thread held back and sorted before they are walked (see :meth:`TraceBuilder.frame`)."""
RANGE, ANNOTATION, STEP, OPERATOR = "range", "annotation", "step", "operator"
"""Kinds of tracked frames (see the module doc)."""
OP, NESTING = "op", "nesting"
"""Kinds of CPU frames a source gives besides the tracked ones: an operator (top-level ones become tracked), and a
frame that only nests (a Python call: it takes time from its parent and records nothing itself)."""
FRAME_KINDS = (RANGE, ANNOTATION, STEP, OP, NESTING)
BEGIN_CAPTURE, END_CAPTURE, GRAPH_LAUNCH = range(3)
GRAPH_CALLS = {
    **dict.fromkeys(
        ("cudaStreamBeginCapture", "cudaStreamBeginCaptureToGraph", "hipStreamBeginCapture"), BEGIN_CAPTURE
    ),
    **dict.fromkeys(("cuStreamBeginCapture", "cuStreamBeginCapture_v2", "cuStreamBeginCaptureToGraph"), BEGIN_CAPTURE),
    **dict.fromkeys(("cudaStreamEndCapture", "hipStreamEndCapture", "cuStreamEndCapture"), END_CAPTURE),
    **dict.fromkeys(("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch"), GRAPH_LAUNCH),
}
"""Runtime and driver calls that begin and end a stream capture, and that replay a captured graph."""
KERNEL, MEMCPY, MEMSET = "kernel", "memcpy", "memset"
"""Kinds of device operations as the trace names them."""
DEVICE_CODES = {KERNEL: 0, MEMCPY: 1, MEMSET: 2}
"""A device operation's kind as stored (:attr:`DeviceOps.kind`)."""


def frame_kind(name: str, annotation: bool, legacy: bool = False) -> str:
    """The kind of a torch.profiler frame called ``name``: a user annotation's (``record_function``) or an
    operator's. torch 1.8 (``legacy``: its ``Operator`` category) wrote both as operators, so there an operator named
    ``role/name`` (no ``::``) is a range too; a later operator never is (torch.compile's ``Torch-Compiled Region:
    0/1``)."""
    if name.startswith(STEP_PREFIX):
        return STEP
    if "/" in name and (annotation or (legacy and "::" not in name)):
        return RANGE
    return ANNOTATION if annotation else OP


def step_number(name: str) -> Optional[int]:
    """``ProfilerStep#12`` -> 12."""
    number = name[len(STEP_PREFIX) :] if name.startswith(STEP_PREFIX) else ""
    return int(number) if number.isdigit() else None


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


@dataclass(frozen=True)
class CaptureWindow:
    """A thread's stream capture: launches queued into a CUDA graph instead of onto the device."""

    start_us: float
    end_us: float
    launches: int
    """Launch calls inside it that queued no device work (the captured ones)."""
    device_idle_us: float
    """The device's idle time inside it, within the device's traced span."""


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
    too_deep: int = 0
    """CPU frames nested past :data:`MAX_FRAME_DEPTH` on their thread: counted, not kept."""
    captures: list[CaptureWindow] = field(default_factory=list)
    """Stream captures (CUDA graphs being recorded), in time order."""
    graph_launches: int = 0
    """Replays of captured graphs (``cudaGraphLaunch``)."""
    lacks: list[str] = field(default_factory=list)
    """What the file does not hold that a reader would look for, and how to record it (one line each: the report's
    "missing" lines)."""
    rlprof_ranges: Optional[frozenset[str]] = None
    """The ranges rlprof's torch tool lists in the traces it writes (None: the trace lists none)."""
    problems: list[str] = field(default_factory=list)
    """What could not be read (a truncated file, re-sorted threads): one line each."""

    def ranges_of(self, kind: str) -> list[RangeTotals]:
        return [r for r in self.ranges.values() if r.kind == kind]

    def settle_ranges(self, by_rlprof: bool) -> None:
        """Which ``role/name`` frames are rlprof's ranges: those the trace lists as rlprof's; without such a list, all
        of them in a trace rlprof wrote (``by_rlprof``: its manifest says so), none in any other. The rest are the
        program's own annotations."""
        if self.rlprof_ranges is None and by_rlprof:
            return
        ours = self.rlprof_ranges or frozenset()
        for totals in self.ranges.values():
            if totals.kind == RANGE and totals.label not in ours:
                totals.kind = ANNOTATION


# --------------------------------------------------------------------------------------------- the builder


class Interner:
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


class _Held:
    """A thread's frames held for a sort at the end (it broke its start order): typed arrays, 21 bytes a frame."""

    __slots__ = ("duration", "kind", "name", "start")

    def __init__(self) -> None:
        self.start = array.array("d")
        self.duration = array.array("d")
        self.name = array.array("i")
        self.kind = array.array("b")

    def append(self, start: float, duration: float, name: int, kind: int) -> None:
        self.start.append(start)
        self.duration.append(duration)
        self.name.append(name)
        self.kind.append(kind)


class _Thread:
    """One thread: its open frames, and every frame in start order (start, duration, own time, bucket, the frame it
    was walked inside: 32 bytes a frame, the own time written when the frame closes)."""

    __slots__ = ("arrived", "bucket", "duration", "held", "last", "outer", "own", "pending", "stack", "start")

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []
        self.pending: deque[tuple[float, float, int, str, str]] = deque()
        """The last frames given, sorted, waiting to be walked."""
        self.arrived = 0
        self.last = (float("-inf"), 0.0)
        """(start, -duration) of the last frame walked: frames come in that order (the longer first on a tie)."""
        self.held: Optional[_Held] = None
        self.start = array.array("d")
        self.duration = array.array("d")
        self.own = array.array("d")
        """Duration minus the children's (the launch calls inside are taken out at the end)."""
        self.bucket = array.array("i")
        self.outer = array.array("i")
        """The index of the frame around each (-1: none)."""


_END, _CHILDREN, _CONTEXT, _DEPTH, _INDEX = range(5)
"""A frame on a thread's stack: [end, children's total, context id, operator depth, index in the thread's arrays]."""


class EventSink(Protocol):
    """What a source feeds events into: a :class:`TraceBuilder`, or columns that a builder replays later
    (:class:`rlprof.analysis.trace_columns.EventColumns`)."""

    scan: TraceScan

    def frame(self, thread: Any, start: float, duration: float, name: str, kind: str) -> None: ...

    def launch(self, thread: Any, start: float, duration: float, correlation: int) -> None: ...

    def device_op(
        self, start: float, duration: float, name: str, kind: str, stream: int, correlation: Optional[int], size: int
    ) -> None: ...

    def memory_event(self, thread: Any, time: float, size: int, total_allocated: int) -> None: ...

    def graph_call(self, thread: Any, start: float, duration: float, call: int) -> None: ...


class TraceBuilder:
    """Takes a trace's events (see the module doc) and reduces them to a :class:`TraceScan`.

    A *context* is the tuple of tracked ``(kind, label)`` keys around a frame (itself included when tracked); a
    *bucket* is where a frame's time goes: ``(kind, label, context of its parent)``, and determines the frame's own
    context (:attr:`bucket_context`).
    """

    def __init__(self, scan: TraceScan) -> None:
        self.scan = scan
        self.names = Interner()
        self.contexts = Interner()
        self.buckets = Interner()
        self.bucket_context = array.array("i")
        """The context of a frame of each bucket."""
        self.empty_context = self.contexts(())
        self.threads: dict[Any, _Thread] = {}
        self.thread_ids = Interner()
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
        self.graph_calls: list[tuple[int, float, float, int]] = []
        """(thread id, start, end, one of :data:`GRAPH_CALLS`' codes) of each capture begin, end and graph launch."""
        self.instances: list[tuple[Any, float, float, float, str, str]] = []
        """(thread, start, end, duration, kind, label) of every range, annotation and step (few: kept as tuples)."""
        self._file = ""

    # ----------------------------------------------------------------------------------------- inputs

    def frame(self, thread: Any, start: float, duration: float, name: str, kind: str) -> None:
        """A CPU frame of ``kind`` (one of :data:`FRAME_KINDS`; a step's name is ``ProfilerStep#N``), in the thread's
        start order (the longer first on a tie) up to :data:`REORDER_WINDOW` frames: each thread's last frames wait
        in a sorted delay line, so that a frame written a little late (kineto on a loaded machine) is walked in its
        place. A frame later than that makes the thread's frames wait, compactly, to be walked again in order at the
        end."""
        state = self.threads.get(thread)
        if state is None:
            state = self.threads[thread] = _Thread()
        item = (start, -duration, state.arrived, name, kind)
        state.arrived += 1
        pending = state.pending
        if not pending or item > pending[-1]:
            pending.append(item)
        else:
            bisect.insort(pending, item)
        if len(pending) > REORDER_WINDOW:
            self._ordered(thread, state, pending.popleft())

    def _ordered(self, thread: Any, state: _Thread, item: tuple[float, float, int, str, str]) -> None:
        start, negative_duration, _, name, kind = item
        key = (start, negative_duration)
        if state.held is not None or key < state.last:
            if state.held is None:
                state.held = _Held()
            state.held.append(start, -negative_duration, self.names(name), FRAME_KINDS.index(kind))
            return
        state.last = key
        self._walk(thread, state, start, -negative_duration, name, kind)

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
        self.op_kind.append(DEVICE_CODES[kind])
        self.op_stream.append(stream)
        self.op_correlation.append(correlation if correlation is not None else -1)
        self.op_bytes.append(size)

    def memory_event(self, thread: Any, time: float, size: int, total_allocated: int) -> None:
        """An allocator event (``[memory]``): ``size`` bytes (negative: freed), ``total_allocated`` after it."""
        self.memory[thread].append((time, size, total_allocated))

    def graph_call(self, thread: Any, start: float, duration: float, call: int) -> None:
        """A call that begins or ends a stream capture or replays a graph (a code of :data:`GRAPH_CALLS`); it is a
        launch call too (given to :meth:`launch` as well)."""
        self.graph_calls.append((self.thread_ids(thread), start, start + duration, call))

    # ----------------------------------------------------------------------------------------- the walk

    def _walk(self, thread: Any, state: _Thread, start: float, duration: float, name: str, kind: str) -> None:
        stack = state.stack
        while stack and stack[-1][_END] <= start:
            self._close(state, stack.pop())
        if len(stack) >= MAX_FRAME_DEPTH:
            stack[-1][_CHILDREN] += duration
            self.scan.too_deep += 1
            return
        if stack:
            parent = stack[-1]
            parent[_CHILDREN] += duration
            outer, depth, around = parent[_CONTEXT], parent[_DEPTH], parent[_INDEX]
        else:
            outer, depth, around = self.empty_context, 0, -1
        if kind == OP:
            kind = OPERATOR if depth == 0 else OP
            depth += 1
        bucket = self.buckets.ids.get((kind, name, outer))
        if bucket is None:
            bucket = self._new_bucket(kind, name, outer)
        if kind in (RANGE, ANNOTATION, STEP):
            self.instances.append((thread, start, start + duration, duration, kind, name))
        index = len(state.start)
        state.start.append(start)
        state.duration.append(duration)
        state.own.append(duration)
        state.bucket.append(bucket)
        state.outer.append(around)
        stack.append([start + duration, 0.0, self.bucket_context[bucket], depth, index])

    def _new_bucket(self, kind: str, name: str, outer: int) -> int:
        context = outer
        if kind not in (OP, NESTING, STEP):  # tracked: its label is in the context of all inside it (once per name)
            keys = self.contexts.values[outer]
            if (kind, name) not in keys:
                context = self.contexts((*keys, (kind, name)))
        self.bucket_context.append(context)
        return self.buckets((kind, name, outer))

    def _close(self, state: _Thread, frame: list[Any]) -> None:
        state.own[frame[_INDEX]] -= frame[_CHILDREN]

    def _rewalk(self, thread: Any, state: _Thread) -> None:
        """Walk a thread that broke its start order again, every frame of it in order (those walked before too), a
        slice of the sorted frames at a time so that the transient copies stay small."""
        import numpy as np

        held = state.held
        assert held is not None
        kinds = np.array(
            [FRAME_KINDS.index(OP if kind == OPERATOR else kind) for kind, _, _ in self.buckets.values], dtype=np.int8
        )
        names = np.array([self.names(name) for _, name, _ in self.buckets.values], dtype=np.int32)
        walked = np.frombuffer(state.bucket, dtype=np.int32)
        start = np.concatenate([np.frombuffer(state.start), np.frombuffer(held.start)])
        duration = np.concatenate([np.frombuffer(state.duration), np.frombuffer(held.duration)])
        name = np.concatenate([names[walked], np.frombuffer(held.name, dtype=np.int32)])
        kind = np.concatenate([kinds[walked], np.frombuffer(held.kind, dtype=np.int8)])
        del walked
        state.held, state.start, state.duration, state.own, state.bucket, state.outer = (
            None,
            *(array.array("d"),) * 3,
            array.array("i"),
            array.array("i"),
        )
        self.instances = [i for i in self.instances if i[0] != thread]
        order = np.lexsort((-duration, start))
        fresh = self.threads[thread] = _Thread()
        labels = self.names.values
        for low in range(0, len(order), 1 << 16):
            part = order[low : low + (1 << 16)]
            for when, length, label, code in zip(
                start[part].tolist(), duration[part].tolist(), name[part].tolist(), kind[part].tolist(), strict=True
            ):
                self._walk(thread, fresh, when, length, labels[label], FRAME_KINDS[code])
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
            while state.pending:
                self._ordered(thread, state, state.pending.popleft())
            if state.held is not None:
                self._rewalk(thread, state)
            else:
                while state.stack:
                    self._close(state, state.stack.pop())
        if self.scan.too_deep:
            self.scan.problems.append(
                f"{name}: {self.scan.too_deep} CPU frames nested more than {MAX_FRAME_DEPTH} deep on their thread were "
                "counted, not kept (their time is their parent's children's)"
            )
        launch_context = self._frames_and_launches(np)
        launch_of_op = self._launch_of_each_op(np)
        self._attribute_device_ops(np, launch_context, launch_of_op)
        del launch_context
        self._project_instances(np, launch_of_op)
        self._attribute_memory()
        self._captures(np)
        steps = sorted(
            (start, end, number, duration)
            for _, start, end, duration, kind, label in self.instances
            if kind == STEP and (number := step_number(label)) is not None
        )
        self.scan.steps = {number: duration for _, _, number, duration in steps}
        if len(self.op_start):
            ops = self._device_ops(np, launch_of_op)
            of_step = self._step_of_each_op(np, ops, launch_of_op, steps)
            del launch_of_op
            self.launch_start = self.launch_duration = array.array("d")
            self.scan.gpu = summarize_device(ops, self.names.values)
            for _, _, number, _ in steps:
                selected = of_step == number
                if selected.any():
                    self.scan.gpu_by_step[number] = summarize_device(ops.select(selected), self.names.values)
                    self.scan.ranges[f"{STEP_PREFIX}{number}"].cuda_us = float(ops.duration[selected].sum())
        return self.scan

    def _captures(self, np: Any) -> None:
        """Each thread's capture windows (a begin to the next end), the launches inside them that queued no device
        work, and the device's idle time inside them within its traced span; graph replays counted."""
        self.scan.graph_launches = sum(1 for *_, call in self.graph_calls if call == GRAPH_LAUNCH)
        begun: dict[int, float] = {}
        windows = []
        for thread, start, end, call in sorted(self.graph_calls, key=lambda c: c[1]):
            if call == BEGIN_CAPTURE:
                begun.setdefault(thread, start)
            elif call == END_CAPTURE and thread in begun:
                windows.append((thread, begun.pop(thread), end))
        if not windows:
            return
        threads = np.frombuffer(self.launch_thread, dtype=np.int32)
        starts = np.frombuffer(self.launch_start, dtype=np.float64)
        worked = np.isin(
            np.frombuffer(self.launch_correlation, dtype=np.int64), np.frombuffer(self.op_correlation, dtype=np.int64)
        )
        ops_start = np.frombuffer(self.op_start)
        ops_end = ops_start + np.frombuffer(self.op_duration)
        busy = merged(np, ops_start, ops_end)
        first, last = (float(ops_start.min()), float(ops_end.max())) if len(ops_start) else (0.0, 0.0)
        for thread, start, end in windows:
            inside = (threads == thread) & (starts >= start) & (starts <= end) & ~worked
            calls = sum(1 for t, s, _, c in self.graph_calls if t == thread and start <= s <= end and c != GRAPH_LAUNCH)
            low, high = max(start, first), min(end, last)
            idle = 0.0
            if high > low:
                window = (np.array([low]), np.array([high]))
                idle = (high - low) - intersection_length(np, window, busy)
            self.scan.captures.append(CaptureWindow(start, end, int(inside.sum()) - calls, idle))

    def _frames_and_launches(self, np: Any) -> Any:
        """Thread by thread: each launch's innermost frame (a merge of the thread's frames, in start order, with its
        launches, sorted by time), its time out of that frame's own time, and the totals of every bucket. Returns the
        context of each launch's frame; the threads' arrays are released as they are done."""
        count = len(self.launch_start)
        launch_context = np.full(count, self.empty_context, dtype=np.int32)
        launch_thread = np.frombuffer(self.launch_thread, dtype=np.int32)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        launch_duration = np.frombuffer(self.launch_duration, dtype=np.float64)
        buckets = len(self.buckets.values)
        counts = np.zeros(buckets, dtype=np.int64)
        totals, selfs = np.zeros(buckets), np.zeros(buckets)
        contexts = np.frombuffer(self.bucket_context, dtype=np.int32)
        for thread in list(self.threads):
            state = self.threads.pop(thread)
            bucket = np.frombuffer(state.bucket, dtype=np.int32)
            duration = np.frombuffer(state.duration, dtype=np.float64)
            own = np.frombuffer(state.own, dtype=np.float64).copy()
            thread_id = self.thread_ids.ids.get(thread)
            mine = np.nonzero(launch_thread == thread_id)[0] if thread_id is not None and count else []
            if len(mine) and len(bucket):
                innermost = _innermost(np, state, launch_start[mine])
                inside = innermost >= 0
                np.subtract.at(own, innermost[inside], launch_duration[mine][inside])
                launch_context[mine[inside]] = contexts[bucket[innermost[inside]]]
            counts += np.bincount(bucket, minlength=buckets)
            totals += np.bincount(bucket, weights=duration, minlength=buckets)
            selfs += np.bincount(bucket, weights=np.maximum(0.0, own), minlength=buckets)
            del state, bucket, duration, own
        self._fill(counts, totals, selfs)
        return launch_context

    def _fill(self, counts: Any, totals: Any, selfs: Any) -> None:
        """Totals of tracked frames, and operator rows under every tracked frame around them."""
        scan = self.scan
        for bucket in counts.nonzero()[0].tolist():
            kind, name, outer = self.buckets.values[bucket]
            count, total, own = int(counts[bucket]), float(totals[bucket]), float(selfs[bucket])
            if kind in (OP, OPERATOR):
                for label in [key[1] for key in self.contexts.values[outer]] or [""]:
                    row = scan.ops.get((label, name, "cpu"))
                    if row is None:
                        row = scan.ops[(label, name, "cpu")] = OpTotals(name, "cpu")
                    row.count += count
                    row.self_us += own
            if kind in (OP, NESTING):
                continue
            row_totals = scan.ranges.get(name)
            if row_totals is None:
                row_totals = scan.ranges[name] = RangeTotals(name, kind)
            row_totals.count += count
            row_totals.total_us += total
            row_totals.self_us += own

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

    def _attribute_device_ops(self, np: Any, launch_context: Any, launch_of_op: Any) -> None:
        """Each device operation's time to the tracked frames around its launch (see the module doc)."""
        scan = self.scan
        if not len(self.op_start):
            return
        durations = np.frombuffer(self.op_duration, dtype=np.float64)
        names = np.frombuffer(self.op_name, dtype=np.int32).astype(np.int64)
        launched = launch_of_op >= 0
        context = np.full(len(durations), self.empty_context, dtype=np.int64)
        context[launched] = launch_context[launch_of_op[launched]]
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

    def _project_instances(self, np: Any, launch_of_op: Any) -> None:
        """Each range and annotation instance's GPU projection (see :attr:`RangeTotals.gpu_span_us`), thread
        by thread: each instance spans the device operations of the launches made while it is open."""
        launches = len(self.launch_start)
        if not launches or not len(self.op_start):
            return
        first = np.full(launches, np.inf)
        last = np.full(launches, -np.inf)
        launched = launch_of_op >= 0
        starts = np.frombuffer(self.op_start, dtype=np.float64)
        np.minimum.at(first, launch_of_op[launched], starts[launched])
        np.maximum.at(last, launch_of_op[launched], (starts + np.frombuffer(self.op_duration))[launched])
        with_ops = np.isfinite(first)
        launch_thread = np.frombuffer(self.launch_thread, dtype=np.int32)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        by_thread: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
        for thread, start, end, _, kind, label in self.instances:
            if kind in (RANGE, ANNOTATION):
                by_thread[thread].append((start, end, label))
        for thread, spans in by_thread.items():
            thread_id = self.thread_ids.ids.get(thread)
            mine = np.nonzero((launch_thread == thread_id) & with_ops)[0] if thread_id is not None else []
            if not len(mine):
                continue
            mine = mine[np.argsort(launch_start[mine], kind="stable")]
            times, lows, highs = launch_start[mine], first[mine], last[mine]
            for start, end, label in spans:  # the launches at start <= time < end, a slice of the sorted ones
                low, high = np.searchsorted(times, (start, end), side="left").tolist()
                if high > low and (span := float(highs[low:high].max() - lows[low:high].min())) > 0:
                    self.scan.ranges[label].gpu_span_us += span

    def _attribute_memory(self) -> None:
        """Each ``[memory]`` event counts for every rlprof range open on its thread at its time; on a thread that
        opens no range (autograd's backward thread, a worker a range hands work to), for the ranges open at its time
        on the others (a sweep per thread)."""
        scan = self.scan
        ranges = sorted((start, end, label, t) for t, start, end, _, kind, label in self.instances if kind == RANGE)
        with_ranges = {t for *_, t in ranges}
        for thread, events in self.memory.items():
            scan.memory_events += len(events)
            own = thread in with_ranges
            spans = [(start, end, label) for start, end, label, t in ranges if t == thread or not own]
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

    def _device_ops(self, np: Any, launch_of_op: Any) -> DeviceOps:
        starts = np.frombuffer(self.op_start, dtype=np.float64)
        durations = np.frombuffer(self.op_duration, dtype=np.float64)
        launched = launch_of_op >= 0
        index = np.maximum(launch_of_op, 0)
        launch_start = np.frombuffer(self.launch_start, dtype=np.float64)
        launch_duration = np.frombuffer(self.launch_duration, dtype=np.float64)
        nan = np.full(len(starts), np.nan)
        return DeviceOps(
            start=starts,
            end=starts + durations,
            name=np.frombuffer(self.op_name, dtype=np.int32),
            kind=np.frombuffer(self.op_kind, dtype=np.int8),
            stream=np.frombuffer(self.op_stream, dtype=np.int64),
            bytes=np.frombuffer(self.op_bytes, dtype=np.int64),
            launch_end=np.where(launched, (launch_start + launch_duration)[index], np.nan)
            if len(launch_start)
            else nan,
            launch_duration=np.where(launched, launch_duration[index], np.nan) if len(launch_start) else nan,
            duration=durations,
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


def _innermost(np: Any, state: _Thread, times: Any) -> Any:
    """For each time, the index of the innermost of the thread's frames holding it (``start <= time < end``), -1 for
    none: the last frame to start at or before the time, or the nearest frame around it still open then (the frames
    are in walk order: by start, the longer first on a tie, each inside ``outer``)."""
    starts = np.frombuffer(state.start, dtype=np.float64)
    ends = starts + np.frombuffer(state.duration, dtype=np.float64)
    outer = np.frombuffer(state.outer, dtype=np.int32)
    found = np.searchsorted(starts, times, side="right") - 1
    pending = np.nonzero(found >= 0)[0]
    while len(pending):  # once per level of nesting
        frame = found[pending]
        closed = ends[frame] <= times[pending]
        pending, frame = pending[closed], frame[closed]
        found[pending] = outer[frame]
        pending = pending[found[pending] >= 0]
    return found
