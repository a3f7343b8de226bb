"""Chrome traces written by torch.profiler / kineto (``.json``, ``.json.gz``, whatever the name): torch 1.8's
categories (``Operator``, ``Runtime``, ``Kernel``, ``Memcpy``) to current ones, CUDA, ROCm and MTIA devices, one
rank per file. Read in one streaming pass into the :mod:`rlprof.analysis.trace_model`; a large file by two
processes, the second one decoding most batches (see :func:`scan_trace`), with the decompression on a thread.

The file is never loaded whole. Kineto writes one event per indented block (``\n  {`` ... ``\n  },``); the reader
cuts the decompressed stream at those boundaries and decodes a megabyte of events at a time with msgspec into
:class:`Event` structs holding only the fields the model reads (the rest of an event, such as its operator's
arguments, is skipped, not built). A trace in another layout is streamed by ijson. Damage costs only what it
touches: an event with wrong types (``"ts": "abc"``, a list as category, a non-object) is skipped and counted, an
event the decoder cannot take (``NaN``, an integer beyond 64 bits, nesting deeper than 1024) is read alone by
Python's parser or skipped, and a truncated file is read up to the damage. One event larger than
:data:`MAX_EVENT_BYTES` stops the reading with one line (the events before it are kept). CPU frames a little out
of start order are put back in order by the model (:class:`~rlprof.analysis.trace_builder.TraceBuilder`).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import queue
import re
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import IO, Any, Optional, TypeVar

import msgspec

from rlprof.analysis.sources.base import InputFile, ReadOptions, Source, SourceError
from rlprof.analysis.trace_builder import TraceBuilder
from rlprof.analysis.trace_columns import ColumnsReplay
from rlprof.analysis.trace_model import (
    GRAPH_CALLS,
    KERNEL,
    MEMCPY,
    MEMSET,
    NESTING,
    EventSink,
    TraceScan,
    frame_kind,
)

CHUNK = 1 << 20
MAX_EVENT_BYTES = 64 << 20
"""The largest single event read; a longer one (a multi-GB string) ends the reading."""
MAX_NESTING = 64
"""Deepest nesting of values inside one event read; an event nested deeper (kineto's are 3 levels) is skipped and
counted, read in memory that does not grow with its depth."""
METADATA_KEYS = ("distributedInfo", "deviceProperties", "rlprof")
"""The trace-level values read beside the events, before or after them."""

T = TypeVar("T")

DEVICE_OPS = {
    "kernel": KERNEL,
    "Kernel": KERNEL,
    "gpu_memcpy": MEMCPY,
    "Memcpy": MEMCPY,
    "gpu_memset": MEMSET,
    "Memset": MEMSET,
    "mtia_ccp_events": KERNEL,
}
"""Device-side categories (torch >= 1.9, torch 1.8, MTIA)."""
LAUNCHES = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "mtia_runtime", "privateuse1_runtime"})
"""CPU calls into a device runtime (CUDA, HIP: ``cuda_runtime`` on ROCm too; torch 1.8's ``Runtime``)."""
ANNOTATIONS = frozenset({"user_annotation"})
OPERATORS = frozenset({"cpu_op", "Operator"})
"""CPU operators; in torch 1.8 ``record_function`` ranges are ``Operator`` events too (told apart by their name)."""
NESTED = frozenset({"python_function"})
_LIST_END = re.compile(rb"\}\s*\n\s*\]")
"""The end of the event list: the last event's brace, a line break and the closing bracket."""
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_DEVICE_NAME = re.compile(rb'"deviceProperties"\s*:\s*\[\s*\{[^}]*?"name"\s*:\s*"((?:[^"\\]|\\.)*)"', re.S)


class TraceError(SourceError):
    """The file is not a readable Chrome trace; the message says why in one line."""


class Args(msgspec.Struct, gc=False):
    """The arguments of an event that the model reads (any type: a wrong one is the model's to skip). Structs hold
    no reference cycles: untracked by the garbage collector (a million of them a second would otherwise make it walk
    them over and over)."""

    correlation: Any = None
    stream: Any = None
    bytes: Any = None
    allocated: Any = msgspec.field(default=None, name="Bytes")
    total_allocated: Any = msgspec.field(default=None, name="Total Allocated")


class Event(msgspec.Struct, gc=False):
    """One trace event, as much of it as the model reads (untracked by the garbage collector, as :class:`Args`)."""

    ph: Any = None
    cat: Any = None
    name: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    args: Optional[Args] = None


_BATCH = msgspec.json.Decoder(list[Event])
_EVENT = msgspec.json.Decoder(Event)


# --------------------------------------------------------------------------------------------- reading events


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


def _read_ahead(stream: _Inflated, size: int) -> Generator[bytes, None, None]:
    """``stream``'s blocks of ``size`` bytes, read and decompressed by a thread a few blocks ahead: zlib and the file
    release the GIL, so the decompression runs on another core while the events are decoded. An error of the stream
    is raised here; closing this generator stops the thread."""
    blocks: queue.Queue[bytes | Exception] = queue.Queue(maxsize=4)
    stop = threading.Event()

    def produce() -> None:
        try:
            while not stop.is_set():
                block = stream.read(size)
                blocks.put(block)
                if not block:
                    return
        except Exception as exc:  # noqa: BLE001  (handed over: raised by the reader)
            blocks.put(exc)

    thread = threading.Thread(target=produce, name="rlprof-inflate", daemon=True)
    thread.start()
    try:
        while (block := blocks.get()) != b"":
            if isinstance(block, Exception):
                raise block
            yield block
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting for room
            with contextlib.suppress(queue.Empty):
                blocks.get(timeout=0.05)


def read_head(path: Path, size: int) -> bytes:
    """The first ``size`` bytes of ``path``, decompressed when it is gzipped ("" when it cannot be read)."""
    try:
        stream = _Inflated(path)
    except OSError:
        return b""
    try:
        return stream.read(size)
    except (OSError, zlib.error, EOFError):
        return b""
    finally:
        stream.close()


def raw_blocks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    """``path``'s bytes, decompressed when it is gzipped, ``size`` at a time (ends early where it cannot be read)."""
    try:
        stream = _Inflated(path)
    except OSError:
        return
    try:
        while block := stream.read(size):
            yield block
    except (OSError, zlib.error, EOFError):
        return
    finally:
        stream.close()


def _header(outside: bytes, scan: TraceScan, after: bool = False) -> None:
    """The trace-level values (:data:`METADATA_KEYS`) in the part of a kineto-layout file outside its event list:
    the object's members before ``"traceEvents"`` or, ``after``, those after its closing bracket, read as JSON
    (kineto spreads some over several lines). A part that does not read so (a damaged file) is searched line by
    line for ``distributedInfo`` and by pattern for the device's name."""
    members = outside.strip()
    members = members.lstrip(b",").removesuffix(b"}") if after else members.removeprefix(b"{").rstrip().rstrip(b",")
    try:
        values = msgspec.json.decode(b"{" + members + b"}")
    except (msgspec.DecodeError, RecursionError):
        values = None
    if isinstance(values, dict):
        for key in METADATA_KEYS:
            if key in values:
                take_metadata(scan, key, values[key])
        return
    for line in outside.splitlines():
        text = line.strip()
        if text.startswith(b'"distributedInfo"'):
            try:
                take_metadata(scan, "distributedInfo", msgspec.json.decode(text.split(b":", 1)[1].rstrip(b",")))
            except msgspec.DecodeError:
                continue
    found = _DEVICE_NAME.search(outside)
    if found:
        take_metadata(scan, "deviceProperties", [{"name": found.group(1).decode("utf-8", "replace")}])


def take_metadata(scan: TraceScan, key: str, value: Any) -> None:
    """A trace-level value (one of :data:`METADATA_KEYS`) into ``scan``, whatever layout it was read from: the rank
    and world size of ``distributedInfo``, the first device's name of ``deviceProperties``, rlprof's mark."""
    if key == "rlprof":
        ranges = value.get("ranges") if isinstance(value, dict) else None
        if isinstance(ranges, list):
            scan.rlprof_ranges = frozenset(r for r in ranges if isinstance(r, str))
    if key == "distributedInfo" and isinstance(value, dict):
        rank, world = value.get("rank"), value.get("world_size")
        scan.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else scan.rank
        scan.world_size = world if isinstance(world, int) and not isinstance(world, bool) else scan.world_size
    elif key == "deviceProperties" and isinstance(value, list) and value and scan.device is None:
        name = value[0].get("name") if isinstance(value[0], dict) else None
        scan.device = name if isinstance(name, str) else None


def decoded(listed: bytes | memoryview, scan: TraceScan) -> list[Event]:
    """The events of one batch, ``listed`` as a JSON list (``[`` events ``]``); when the batch does not decode, event
    by event: what msgspec cannot take (NaN, an integer beyond 64 bits) by Python's parser, and what that cannot
    either skipped and counted."""
    try:
        return _BATCH.decode(listed)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    events = []
    for piece in bytes(listed[1:-1]).split(b"\n  },\n"):
        text = piece.strip().rstrip(b",")
        if not text:
            continue
        if not text.endswith(b"}"):
            text += b"\n  }"
        event = as_event(text)
        if event is None:
            scan.skipped += 1
        else:
            events.append(event)
    return events


def as_event(text: bytes) -> Optional[Event]:
    """One event's JSON as an :class:`Event`, or None when it is not an object either parser takes."""
    try:
        return _EVENT.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:
        return _from_object(json.loads(text))
    except (ValueError, RecursionError):
        return None


def _from_object(value: Any) -> Optional[Event]:
    """A parsed JSON object as an :class:`Event` (None for anything else)."""
    if not isinstance(value, dict):
        return None
    args = value.get("args")
    if isinstance(args, dict):
        value = {**value, "args": Args(args.get("correlation"), args.get("stream"), args.get("bytes"),
                                      args.get("Bytes"), args.get("Total Allocated"))}  # fmt: skip
    elif args is not None:
        value = {**value, "args": None}
    fields = {key: value.get(key) for key in Event.__struct_fields__}
    return Event(**fields)


def iter_batches(
    path: Path, scan: TraceScan, chunk: Optional[int] = None, whole: bool = False
) -> Iterator[memoryview | bytes | list[Any]]:
    """The trace's events, a batch (about ``chunk`` bytes of the file, :data:`CHUNK` by default) at a time: as a JSON
    list to decode (:func:`decoded`; a view valid until the next batch is asked for), or, in a layout other than
    kineto's, already decoded: as :class:`Event` structs, or with ``whole`` as the events' own dicts, every field
    kept. Header facts go into ``scan``. The same file is always cut in the same batches."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    stream = _Inflated(path)
    blocks = _read_ahead(stream, chunk or CHUNK)
    try:
        head = stream.read(1 << 16)
        start = head.find(b'"traceEvents"')
        if start < 0 or not head.lstrip().startswith(b"{"):
            raise TraceError(f"{path} is not a Chrome trace (no traceEvents in its first 64 KiB)")
        _header(head[:start], scan)
        bracket = head.find(b"[", start)
        if bracket < 0 or head.find(b"\n  {", bracket) < 0 or head.find(b"\n  },", bracket) < 0:
            yield from _ijson_batches(path, scan, _as_object if whole else _from_object)
            return
        # The events not yet decoded, after a "[": a batch is handed out in place as a JSON list, its last comma
        # turned into the closing bracket (no copy of the megabyte), then dropped from the buffer.
        buffer = bytearray(b"[") + head[bracket + 1 :]
        for block in blocks:
            buffer += block
            cut = buffer.rfind(b"\n  },")
            if cut >= 0:
                comma = cut + 4
                buffer[comma] = ord("]")
                with memoryview(buffer) as view, view[: comma + 1] as listed:
                    yield listed
                del buffer[1 : comma + 1]
            elif len(buffer) > MAX_EVENT_BYTES:
                scan.cut_short = True
                scan.problems.append(
                    f"{path.name}: one event is larger than {MAX_EVENT_BYTES >> 20} MiB (a damaged or hostile "
                    "file); the events before it are reported"
                )
                return
        closed = _LIST_END.search(buffer)
        if closed is not None and not stream.truncated:  # kineto's "}\n  ]," or torch 1.8's "}\n]}"
            tail = bytes(buffer[1 : closed.start() + 1]).strip()
            _header(bytes(buffer[closed.end() :]), scan, after=True)
        else:  # cut short: the complete events before the cut
            reason = "the gzip stream ends early" if stream.truncated else "the event list is never closed"
            scan.cut_short = True
            scan.problems.append(
                f"{path.name} is truncated or damaged ({reason}); what came before the damage is reported"
            )
            last = buffer.rfind(b"\n  }")
            tail = bytes(buffer[1 : last + 4]).strip().rstrip(b",") if last >= 0 else b""
        if tail:
            yield b"[" + tail + b"]"
    except zlib.error as exc:
        scan.cut_short = True
        scan.problems.append(f"{path.name} is damaged ({exc}); what came before the damage is reported")
    finally:
        blocks.close()
        stream.close()


class _Bounded:
    """A byte stream that refuses to deliver more than ``limit`` bytes between two calls of :meth:`mark`."""

    def __init__(self, stream: IO[bytes], limit: int, name: str) -> None:
        self.stream, self.limit, self.name = stream, limit, name
        self.since = 0

    def read(self, size: int = -1) -> bytes:
        if size == 0:  # ijson asks for 0 bytes to learn the stream's type
            return b""
        data = self.stream.read(size if size > 0 else 1 << 16)
        self.since += len(data)
        if self.since > self.limit:
            raise TraceError(f"{self.name}: one event is larger than {self.limit >> 20} MiB")
        return data

    def mark(self) -> None:
        self.since = 0


def _gzipped(path: Path) -> bool:
    with path.open("rb") as probe:
        return probe.read(2) == b"\x1f\x8b"


def _open(path: Path) -> IO[bytes]:
    if _gzipped(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile reads bytes
    return path.open("rb")


def _as_object(value: Any) -> Optional[dict[str, Any]]:
    return value if isinstance(value, dict) else None


def _ijson_batches(path: Path, scan: TraceScan, convert: Callable[[Any], Optional[T]]) -> Iterator[list[T]]:
    """Any other layout of a Chrome trace, streamed by ijson's parser events (slower; same results), in bounded
    memory: each event built as a value no deeper than :data:`MAX_NESTING` (deeper: skipped and counted, never built),
    then made what ``convert`` makes it (None: skipped and counted); the trace-level values of :data:`METADATA_KEYS`
    taken wherever they are. yajl's C parser stops at an integer beyond 64 bits (HTA's ``large_integer_trace``): the
    file is then read again with ijson's pure-Python parser from the event where it stopped."""
    import ijson

    yielded = 0
    for backend in (ijson, ijson.get_backend("python")):
        batch: list[T] = []
        try:
            with _open(path) as raw:
                stream = _Bounded(raw, MAX_EVENT_BYTES, path.name)
                for index, item in enumerate(_trace_values(backend.basic_parse(stream, use_float=True), scan)):
                    stream.mark()
                    if index < yielded:
                        continue
                    event = convert(item) if item is not _TOO_DEEP else None
                    if event is None:
                        scan.skipped += 1
                    else:
                        batch.append(event)
                    if len(batch) >= 50_000:
                        yielded += len(batch)
                        yield batch
                        batch = []
            if batch:
                yield batch
            break
        except TraceError as exc:
            scan.cut_short = True
            scan.problems.append(f"{exc}; the events before it are reported")
        except (ijson.JSONError, ijson.IncompleteJSONError, OSError, EOFError, RecursionError) as exc:
            if "integer overflow" in str(exc) and backend is ijson:
                yielded += len(batch)
                if batch:
                    yield batch
                continue
            message = " ".join(str(exc).split())[:200]
            scan.cut_short = True
            scan.problems.append(f"{path.name} is truncated or damaged ({message}); what came before is reported")
        if batch:
            yield batch
        break


_TOO_DEEP = object()
"""An event nested past :data:`MAX_NESTING`: skipped."""
_STARTS = {"start_map": dict, "start_array": list}
_ENDS = ("end_map", "end_array")


def _trace_values(parsed: Iterator[tuple[str, Any]], scan: TraceScan) -> Iterator[Any]:
    """The items of the trace's ``traceEvents`` list, each built from ijson's ``basic_parse`` events (or
    :data:`_TOO_DEEP`), with the top-level :data:`METADATA_KEYS` taken into ``scan`` as they pass."""
    depth = 0
    key: Optional[str] = None
    for event, value in parsed:
        starts_a_value = event not in _ENDS and event != "map_key"
        if depth == 1 and event == "map_key":
            key = value
        elif starts_a_value and ((depth == 2 and key == "traceEvents") or (depth == 1 and key in METADATA_KEYS)):
            built = _value(event, value, parsed)
            if depth == 2:
                yield built
            elif built is not _TOO_DEEP:
                take_metadata(scan, str(key), built)
        elif event in _STARTS:
            depth += 1
        elif event in _ENDS:
            depth -= 1


def _value(first: str, scalar: Any, parsed: Iterator[tuple[str, Any]]) -> Any:
    """The JSON value that starts with parser event ``first`` (``scalar``: its value when it is one), the rest of it
    read from ``parsed``; :data:`_TOO_DEEP` (read to its end, not built) when it nests past :data:`MAX_NESTING`."""
    if first not in _STARTS:
        return scalar
    stack: list[Any] = [_STARTS[first]()]
    keys: list[Optional[str]] = [None]
    depth, too_deep = 1, False
    for event, value in parsed:
        if event in _ENDS:
            depth -= 1
            if too_deep:
                if depth == 0:
                    return _TOO_DEEP
                continue
            done = stack.pop()
            keys.pop()
            if not stack:
                return done
            _put(stack[-1], keys, done)
        elif event in _STARTS:
            depth += 1
            too_deep = too_deep or depth > MAX_NESTING
            if not too_deep:
                stack.append(_STARTS[event]())
                keys.append(None)
        elif too_deep:
            continue
        elif event == "map_key":
            keys[-1] = value
        else:
            _put(stack[-1], keys, value)
    return _TOO_DEEP  # the stream ended inside it


def _put(container: Any, keys: list[Optional[str]], value: Any) -> None:
    if isinstance(container, dict):
        container[str(keys[-1])] = value
    else:
        container.append(value)


# --------------------------------------------------------------------------------------------- into the model


def feed(builder: EventSink, events: list[Event]) -> None:
    """Hand each event of a batch to the builder (the hot loop of ``rlprof report``: local names on purpose)."""
    frame, launch, device_op = builder.frame, builder.launch, builder.device_op
    device_ops, launches, annotations, operators, nested = DEVICE_OPS, LAUNCHES, ANNOTATIONS, OPERATORS, NESTED
    graph_calls = GRAPH_CALLS
    kind_of = frame_kind
    counted = skipped = 0
    for event in events:
        try:
            if event.ph != "X":
                memory = event.args
                if event.ph == "i" and event.name == "[memory]" and memory is not None:
                    sizes = int(memory.allocated or 0), int(memory.total_allocated or 0)
                    builder.memory_event((event.pid, event.tid), float(event.ts), *sizes)
                continue
            category = event.cat
            start = float(event.ts)
            duration = float(event.dur or 0.0)
            if start - start != 0.0 or duration - duration != 0.0:  # NaN or infinite
                raise ValueError("not a finite time")
            counted += 1
            if category in operators or category in annotations:
                name = event.name
                if name.__class__ is not str:
                    raise TypeError("name")
                kind = kind_of(name, category in annotations, category == "Operator")
                frame((event.pid, event.tid), start, duration, name, kind)
            elif category in launches:
                correlation = event.args.correlation if event.args is not None else None
                launch((event.pid, event.tid), start, duration, correlation if correlation.__class__ is int else -1)
                call = graph_calls.get(event.name) if event.name.__class__ is str else None
                if call is not None:
                    builder.graph_call((event.pid, event.tid), start, duration, call)
            elif category in device_ops:
                args = event.args
                correlation, size, stream = (args.correlation, args.bytes, args.stream) if args else (None, 0, None)
                if stream.__class__ is not int:
                    stream = event.tid if event.tid.__class__ is int else -1
                device_op(
                    start,
                    duration,
                    str(event.name),
                    device_ops[category],
                    stream,
                    correlation if correlation.__class__ is int else None,
                    size if size.__class__ is int else 0,
                )
            elif category in nested:
                frame((event.pid, event.tid), start, duration, "", NESTING)
        except (AttributeError, TypeError, ValueError, OverflowError):
            skipped += 1
    builder.scan.events += counted
    builder.scan.skipped += skipped


def scan_trace(path: str | Path, helper: Optional[bool] = None, by_rlprof: bool = False) -> TraceScan:
    """Read ``path`` once and return its :class:`TraceScan`; its ``role/name`` frames are rlprof's ranges as
    :meth:`~rlprof.analysis.trace_model.TraceScan.settle_ranges` says (``by_rlprof``: its manifest says rlprof's
    torch tool wrote it). A large trace is read by two processes when two CPUs
    are free (``helper``: None decides so, True and False force it): a helper process
    (:mod:`rlprof.analysis.sources.trace_helper`) decodes two batches in three and sends their events back as
    columns, this one decodes the rest and walks every frame in file order; the result is the same as one process's.
    Should the helper fail (or not start), this process reads its batches itself."""
    path = Path(path)
    scan = TraceScan(str(path))
    builder = TraceBuilder(scan)
    helping = _Helper.start(path) if (helper if helper is not None else _worth_a_helper(path)) else None
    collecting = gc.isenabled()
    gc.disable()  # the pass allocates millions of short-lived tuples and no cycle: collections would only cost time
    try:
        for index, batch in enumerate(iter_batches(path, scan)):
            if isinstance(batch, list):
                feed(builder, batch)
            elif helping is None or not helping.replay(index, len(batch), builder):
                feed(builder, decoded(batch, scan))
    finally:
        if collecting:
            gc.enable()
        if helping is not None:
            helping.stop()
    if scan.rank is None:
        scan.rank = rank_from_name(path.name)
    if scan.skipped:
        scan.problems.append(
            f"{path.name}: {scan.skipped} events could not be read (wrong types, or values nested deeper than "
            f"{MAX_NESTING} levels); skipped"
        )
    finished = builder.finish(path.name)
    finished.settle_ranges(by_rlprof)
    return finished


HELPER_FIRST_BATCH = 32
"""Batches before it are all this process's: about the time a helper takes to start (a test sets it lower)."""
HELPER_MIN_BYTES = (4 << 20, 64 << 20)
"""The size on disk from which a trace gets a helper: gzipped, plain."""
HELPER_TIMEOUT_S = 60.0
"""Waiting longer than this for one batch from the helper, this process stops it and reads on alone."""
HELPER_HEADER = struct.Struct("<qqq")
"""Before each batch's columns: the batch's index, its length in bytes, the length of the columns."""


def helped(index: int, first: int) -> bool:
    """Whether batch ``index`` is decoded by the helper: two in three from batch ``first`` on."""
    return index >= first and index % 3 != 0


def _worth_a_helper(path: Path) -> bool:
    """A large file, and two CPUs this process may use (Linux: the helper's pipe is read with ``select``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        size, gzipped = path.stat().st_size, _gzipped(path)
    except OSError:
        return False
    return len(os.sched_getaffinity(0)) >= 2 and size >= HELPER_MIN_BYTES[0 if gzipped else 1]


class _Helper:
    """The helper process of one reading: started at once, stopped (killed if need be) by :meth:`stop`."""

    def __init__(self, path: Path) -> None:
        import fcntl

        self.first, chunk = HELPER_FIRST_BATCH, CHUNK
        root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.process: Optional[subprocess.Popen[bytes]] = subprocess.Popen(
            [sys.executable, "-m", "rlprof.analysis.sources.trace_helper", str(path), str(self.first), str(chunk)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )
        assert self.process.stdout is not None
        self.pipe = self.process.stdout.fileno()
        with contextlib.suppress(OSError):  # room for a few batches ahead
            fcntl.fcntl(self.pipe, fcntl.F_SETPIPE_SZ, 1 << 20)
        self.columns = ColumnsReplay()

    @classmethod
    def start(cls, path: Path) -> Optional[_Helper]:
        """A helper for ``path``, or None when it cannot start (no Python executable to run, no process left)."""
        try:
            return cls(path)
        except OSError:
            return None

    def replay(self, index: int, length: int, builder: TraceBuilder) -> bool:
        """Whether the helper's events of batch ``index`` (``length`` bytes) went into ``builder``; False: not the
        helper's batch, or the helper is gone (or out of step, then stopped): the batch is this process's to read."""
        if self.process is None or not helped(index, self.first):
            return False
        header = self._read(HELPER_HEADER.size)
        if header is not None:
            got, got_length, size = HELPER_HEADER.unpack(header)
            packed = self._read(size) if (got, got_length) == (index, length) else None
            if packed is not None:
                self.columns.replay(packed, builder)
                return True
        self.stop()
        return False

    def _read(self, size: int) -> Optional[bytes]:
        import select

        parts, left = [], size
        while left:
            ready, _, _ = select.select([self.pipe], [], [], HELPER_TIMEOUT_S)
            part = os.read(self.pipe, left) if ready else b""
            if not part:
                return None
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


class ChromeTraceSource(Source):
    format = "chrome_trace"
    category = "trace"
    timeline = True
    description = "a torch/kineto Chrome trace (.json or .json.gz)"

    def claims(self, path: Path, head: bytes) -> bool:
        text = head.lstrip()
        return text.startswith(b"{") and b'"traceEvents"' in head

    def read(self, file: InputFile, options: ReadOptions) -> list[TraceScan]:
        return [scan_trace(file.path, by_rlprof=file.tool is not None and file.engine is None)]


def rank_from_name(name: str) -> Optional[int]:
    """``rank-3.json.gz``, ``prof_rank_3.json.gz`` -> 3 (HTA's and verl's file names)."""
    found = _RANK_IN_NAME.search(name)
    return int(found.group(1)) if found else None
