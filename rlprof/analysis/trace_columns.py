"""A trace's events recorded as columns, to be replayed into a :class:`~rlprof.analysis.trace_builder.TraceBuilder`
in another process: what the helper process of a large trace's reading (:mod:`rlprof.analysis.sources.trace_helper`)
sends back for the batches it decoded.

:class:`EventColumns` takes events through the builder's input methods (an :class:`EventSink`: a source's feed
fills it as it would a builder) and packs what it took into bytes with :mod:`marshal` (plain numbers, strings and
typed arrays' bytes: reading them back runs nothing). :class:`ColumnsReplay` unpacks them on the other side, in the
order they were taken: frames through :meth:`TraceBuilder.frame` (a thread's walk stays in file order), launches and
device operations appended to the builder's columns at once. Names and threads are sent once each, as small
integers after that.
"""

from __future__ import annotations

import array
import marshal
from typing import Any, Optional

from rlprof.analysis.trace_builder import TraceBuilder
from rlprof.analysis.trace_model import DEVICE_CODES, FRAME_KINDS, Interner, TraceScan

_FRAME, _LAUNCH, _OP = ("i", "d", "d", "i", "b"), ("i", "d", "d", "q"), ("d", "d", "i", "b", "q", "q", "q")
"""Typecodes of the columns: a frame (thread, start, duration, name, kind), a launch (thread, start, duration,
correlation), a device operation (start, duration, name, kind, stream, correlation, bytes)."""


class EventColumns:
    """Events taken since the last :meth:`take`, as columns (an :class:`~rlprof.analysis.trace_model.EventSink`)."""

    def __init__(self) -> None:
        self.scan = TraceScan("")
        """Counts of events read and skipped, as a builder's scan would have them."""
        self.names = Interner()
        self.threads = Interner()
        self._sent_names = self._sent_threads = 0
        self._clear()

    def _clear(self) -> None:
        self.frames: tuple[array.array[Any], ...] = tuple(array.array(code) for code in _FRAME)
        self.launches: tuple[array.array[Any], ...] = tuple(array.array(code) for code in _LAUNCH)
        self.ops: tuple[array.array[Any], ...] = tuple(array.array(code) for code in _OP)
        self.memory: list[tuple[int, float, int, int]] = []
        self.graph_calls: list[tuple[int, float, float, int]] = []
        self.scan.events = self.scan.skipped = 0

    def frame(self, thread: Any, start: float, duration: float, name: str, kind: str) -> None:
        threads, starts, durations, names, kinds = self.frames
        threads.append(self.threads(thread))
        starts.append(start)
        durations.append(duration)
        names.append(self.names(name))
        kinds.append(FRAME_KINDS.index(kind))

    def launch(self, thread: Any, start: float, duration: float, correlation: int) -> None:
        threads, starts, durations, correlations = self.launches
        threads.append(self.threads(thread))
        starts.append(start)
        durations.append(duration)
        correlations.append(correlation)

    def device_op(
        self, start: float, duration: float, name: str, kind: str, stream: int, correlation: Optional[int], size: int
    ) -> None:
        starts, durations, names, kinds, streams, correlations, sizes = self.ops
        starts.append(start)
        durations.append(duration)
        names.append(self.names(name))
        kinds.append(DEVICE_CODES[kind])
        streams.append(stream)
        correlations.append(correlation if correlation is not None else -1)
        sizes.append(size)

    def memory_event(self, thread: Any, time: float, size: int, total_allocated: int) -> None:
        self.memory.append((self.threads(thread), time, size, total_allocated))

    def graph_call(self, thread: Any, start: float, duration: float, call: int) -> None:
        self.graph_calls.append((self.threads(thread), start, duration, call))

    def take(self) -> bytes:
        """What was taken since the last call, packed; the columns start empty again."""
        names, threads = self.names.values[self._sent_names :], self.threads.values[self._sent_threads :]
        self._sent_names, self._sent_threads = len(self.names.values), len(self.threads.values)
        packed = marshal.dumps(
            (
                names,
                threads,
                [column.tobytes() for column in (*self.frames, *self.launches, *self.ops)],
                self.memory,
                self.graph_calls,
                self.scan.events,
                self.scan.skipped,
            )
        )
        self._clear()
        return packed


class ColumnsReplay:
    """The receiving side of one :class:`EventColumns`: its names and threads so far, and :meth:`replay`."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.threads: list[Any] = []
        self.name_ids: list[int] = []
        """The builder's id of each name."""
        self.thread_ids: list[int] = []

    def replay(self, packed: bytes, builder: TraceBuilder) -> None:
        """Feed ``builder`` the events of one :meth:`EventColumns.take`, as if the source had fed them itself."""
        names, threads, raw, memory, graph_calls, events, skipped = marshal.loads(packed)
        self.names += names
        self.threads += threads
        self.name_ids += [builder.names(name) for name in names]
        self.thread_ids += [builder.thread_ids(thread) for thread in threads]
        columns = []
        for code, data in zip((*_FRAME, *_LAUNCH, *_OP), raw, strict=True):
            column = array.array(code)
            column.frombytes(data)
            columns.append(column)
        frames, launches, ops = columns[:5], columns[5:9], columns[9:]
        frame, all_names, all_threads = builder.frame, self.names, self.threads
        for thread, start, duration, name, kind in zip(*frames, strict=True):
            frame(all_threads[thread], start, duration, all_names[name], FRAME_KINDS[kind])
        thread_ids, name_ids = self.thread_ids, self.name_ids
        builder.launch_thread.extend(array.array("i", map(thread_ids.__getitem__, launches[0])))
        builder.launch_start.extend(launches[1])
        builder.launch_duration.extend(launches[2])
        builder.launch_correlation.extend(launches[3])
        builder.op_start.extend(ops[0])
        builder.op_duration.extend(ops[1])
        builder.op_name.extend(array.array("i", map(name_ids.__getitem__, ops[2])))
        builder.op_kind.extend(ops[3])
        builder.op_stream.extend(ops[4])
        builder.op_correlation.extend(ops[5])
        builder.op_bytes.extend(ops[6])
        for thread, time, size, total in memory:
            builder.memory_event(all_threads[thread], time, size, total)
        for thread, start, duration, call in graph_calls:
            builder.graph_call(all_threads[thread], start, duration, call)
        builder.scan.events += events
        builder.scan.skipped += skipped
