"""The builder of the one trace model (:mod:`rlprof.analysis.trace_model`): it takes a trace's events from a source,
walks each thread's frames in start order, attributes each launch to the innermost frame open on its thread at its
start, and hands the built trace to the registered trace analyses (:mod:`rlprof.analysis.trace_analyses`)."""

from __future__ import annotations

import array
import bisect
from collections import defaultdict, deque
from typing import Any, Optional

import rlprof.analysis.trace_analyses  # noqa: F401  (registers the built-in analyses)
from rlprof.analysis.trace_model import (
    ANNOTATION,
    DEVICE_CODES,
    FRAME_KINDS,
    NESTING,
    OP,
    OPERATOR,
    RANGE,
    STEP,
    BuiltTrace,
    Interner,
    TraceScan,
    trace_analyses,
)

MAX_FRAME_DEPTH = 512
"""Frames open at once on one thread that are kept; a frame nested deeper (a real trace's stacks are a few dozen
deep) is counted, not kept: its time is its parent's children's, its own frames and launches go to its deepest kept
ancestor."""
REORDER_WINDOW = 256
"""CPU frames of a thread held back and sorted before they are walked (see :meth:`TraceBuilder.frame`)."""


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
        """Close every frame, attribute launches to frames by time, and run the trace analyses over the built trace
        (each adds its part to the scan)."""
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
        trace = self._built(np, name)
        self._release_columns()  # the built trace holds them now, to be let go as the analyses are done with them
        analyses = trace_analyses()
        for done, analysis in enumerate(analyses):
            trace.release(frozenset().union(*(later.reads for later in analyses[done:])))
            analysis.run(trace, self.scan)
        return self.scan

    def _release_columns(self) -> None:
        self.launch_thread, self.launch_correlation = array.array("i"), array.array("q")
        self.launch_start, self.launch_duration = array.array("d"), array.array("d")
        self.op_start, self.op_duration = array.array("d"), array.array("d")
        self.op_name, self.op_kind = array.array("i"), array.array("b")
        self.op_stream, self.op_correlation, self.op_bytes = array.array("q"), array.array("q"), array.array("q")
        self.instances, self.graph_calls = [], []
        self.memory = defaultdict(list)

    def _built(self, np: Any, name: str) -> BuiltTrace:
        launch_context, counts, totals, selfs = self._frames_and_launches(np)
        return BuiltTrace(
            file=name,
            names=self.names.values,
            contexts=self.contexts.values,
            empty_context=self.empty_context,
            buckets=self.buckets.values,
            bucket_counts=counts,
            bucket_totals=totals,
            bucket_selfs=selfs,
            instances=self.instances,
            memory=self.memory,
            graph_calls=self.graph_calls,
            thread_ids=self.thread_ids.ids,
            launch_thread=np.frombuffer(self.launch_thread, dtype=np.int32),
            launch_start=np.frombuffer(self.launch_start, dtype=np.float64),
            launch_duration=np.frombuffer(self.launch_duration, dtype=np.float64),
            launch_correlation=np.frombuffer(self.launch_correlation, dtype=np.int64),
            launch_context=launch_context,
            op_start=np.frombuffer(self.op_start, dtype=np.float64),
            op_duration=np.frombuffer(self.op_duration, dtype=np.float64),
            op_name=np.frombuffer(self.op_name, dtype=np.int32),
            op_kind=np.frombuffer(self.op_kind, dtype=np.int8),
            op_stream=np.frombuffer(self.op_stream, dtype=np.int64),
            op_correlation=np.frombuffer(self.op_correlation, dtype=np.int64),
            op_bytes=np.frombuffer(self.op_bytes, dtype=np.int64),
            launch_of_op=self._launch_of_each_op(np),
        )

    def _frames_and_launches(self, np: Any) -> tuple[Any, Any, Any, Any]:
        """Thread by thread: each launch's innermost frame (a merge of the thread's frames, in start order, with its
        launches, sorted by time), its time out of that frame's own time, and the totals of every bucket. Returns the
        context of each launch's frame and the buckets' counts, total and own times; the threads' arrays are released
        as they are done."""
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
        return launch_context, counts, totals, selfs

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
