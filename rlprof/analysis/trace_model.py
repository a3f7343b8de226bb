"""The one trace model every trace source fills and every trace analysis reads (HTA's shape): CPU frames per
thread, the launches that queue device work, and the device operations themselves.

A source (a torch/kineto Chrome trace, an nsys report) feeds a :class:`~rlprof.analysis.trace_builder.TraceBuilder`
event by event, in any file order. Once every thread is walked, the builder holds a :class:`BuiltTrace` (compact:
typed arrays, interned names, so memory grows with a few dozen bytes per event, never with the event objects), and
each registered trace analysis (:func:`register_trace_analysis`; the built-in ones are the modules of
:mod:`rlprof.analysis.trace_analyses`: per-range totals, device time, GPU projections, memory, captures, steps) adds
its part to the :class:`TraceScan` the builder returns.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from rlprof.analysis.gpu import GpuSummary

STEP_PREFIX = "ProfilerStep#"
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


def captured_idle_us(captures: list[CaptureWindow]) -> float:
    """The device's idle time inside stream captures (a graph being recorded: nothing to run yet)."""
    return sum(c.device_idle_us for c in captures)


def judged_span_us(gpu: GpuSummary, captures: list[CaptureWindow]) -> float:
    """The device's traced span less its idle time inside stream captures: the time it could have been kept busy."""
    return gpu.span_us - captured_idle_us(captures)


def judged_idle_share(gpu: GpuSummary, captures: list[CaptureWindow]) -> float:
    """The device's idle share of its judged span (:func:`judged_span_us`: the device idles while a graph is
    recorded, nothing to run yet, not a starved device); 0 for an empty span."""
    span = judged_span_us(gpu, captures)
    return (gpu.idle_us - captured_idle_us(captures)) / span if span > 0 else 0.0


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
    """CPU frames nested past :data:`~rlprof.analysis.trace_builder.MAX_FRAME_DEPTH` on their thread: counted, not
    kept."""
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
    cut_short: bool = False
    """The file is truncated or damaged: what came before the damage is all the scan holds (one of ``problems``
    says where)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What trace analyses registered outside rlprof found, by the name each keeps it under."""

    def count_op(self, context: tuple[tuple[str, str], ...], name: str, device: str, count: int, us: float) -> None:
        """An operator's calls and time (``device``: cpu self time, cuda device time) under every tracked frame of
        ``context`` (the label ``""`` when there is none)."""
        for label in [key[1] for key in context] or [""]:
            row = self.ops.get((label, name, device))
            if row is None:
                row = self.ops[(label, name, device)] = OpTotals(name, device)
            row.count += count
            row.self_us += us

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


# --------------------------------------------------------------------------------------------- the built trace


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


@dataclass
class BuiltTrace:
    """A trace once its threads are walked (:class:`~rlprof.analysis.trace_builder.TraceBuilder`): what the trace
    analyses read. Arrays are numpy views over the builder's typed columns; a field no analysis still to run reads is
    released (set to None) as the analyses go."""

    file: str
    names: list[str]
    """Interned names (operators, device operations) by id."""
    contexts: list[tuple[tuple[str, str], ...]]
    """Interned contexts by id: the tracked ``(kind, label)`` keys around a frame, outermost first."""
    empty_context: int
    buckets: list[tuple[str, str, int]]
    """Where frames' time goes, by id: ``(kind, name, context of the parent)``."""
    bucket_counts: Any
    """Frames per bucket; ``bucket_totals`` their durations, ``bucket_selfs`` their own (self) times."""
    bucket_totals: Any
    bucket_selfs: Any
    instances: list[tuple[Any, float, float, float, str, str]]
    """(thread, start, end, duration, kind, label) of every range, annotation and step."""
    memory: dict[Any, list[tuple[float, int, int]]]
    """Thread -> its allocator events (time, size, total allocated after)."""
    graph_calls: list[tuple[int, float, float, int]]
    """(thread id, start, end, code of :data:`GRAPH_CALLS`) of each capture begin, end and graph launch."""
    thread_ids: dict[Any, int]
    launch_thread: Any
    """Per launch: its thread's id, start, duration, correlation id, and the context of its innermost frame."""
    launch_start: Any
    launch_duration: Any
    launch_correlation: Any
    launch_context: Any
    op_start: Any
    """Per device operation: start, duration, name id, kind code (:data:`DEVICE_CODES`), stream, correlation, bytes,
    and the index of its launch (-1: none in the trace)."""
    op_duration: Any
    op_name: Any
    op_kind: Any
    op_stream: Any
    op_correlation: Any
    op_bytes: Any
    launch_of_op: Any

    def release(self, keep: frozenset[str]) -> None:
        """Let go of every array and list not in ``keep`` (what the analyses still to run read)."""
        for name in _RELEASABLE - keep:
            setattr(self, name, None)


_RELEASABLE = frozenset(
    {
        "bucket_counts",
        "bucket_totals",
        "bucket_selfs",
        "instances",
        "memory",
        "graph_calls",
        "launch_thread",
        "launch_start",
        "launch_duration",
        "launch_correlation",
        "launch_context",
        "op_start",
        "op_duration",
        "op_name",
        "op_kind",
        "op_stream",
        "op_correlation",
        "op_bytes",
        "launch_of_op",
    }
)


@dataclass(frozen=True)
class TraceAnalysis:
    """One analysis over a built trace: ``run(trace, scan)`` adds its part to the scan."""

    name: str
    run: Callable[[BuiltTrace, TraceScan], None]
    reads: frozenset[str]
    """The :class:`BuiltTrace` fields it reads (the others may be released before it runs)."""
    after: Optional[str] = None
    """The analysis whose part of the scan it reads (it runs later); None: in registration order."""


_ANALYSES: dict[str, TraceAnalysis] = {}


def register_trace_analysis(
    name: str, *, reads: tuple[str, ...], after: Optional[str] = None
) -> Callable[[Callable[[BuiltTrace, TraceScan], None]], Callable[[BuiltTrace, TraceScan], None]]:
    """Register the decorated ``run(trace, scan)`` as the trace analysis ``name``, reading the :class:`BuiltTrace`
    fields ``reads`` and run after the analysis ``after`` (whose results it reads); a later registration of a name
    replaces it."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_trace_analysis: name={name!r} must be an identifier such as 'longest_kernel'")
    unknown = sorted(set(reads) - set(BuiltTrace.__dataclass_fields__))
    if unknown:
        raise ValueError(f"register_trace_analysis({name!r}): reads={unknown} are not fields of BuiltTrace")

    def register(run: Callable[[BuiltTrace, TraceScan], None]) -> Callable[[BuiltTrace, TraceScan], None]:
        _ANALYSES[name] = TraceAnalysis(name, run, frozenset(reads), after)
        return run

    return register


def trace_analyses() -> list[TraceAnalysis]:
    """The registered analyses in the order they run: registration order, each after the one it names."""
    ordered: list[TraceAnalysis] = []
    placed: set[str] = set()
    remaining = list(_ANALYSES.values())
    while remaining:
        ready = next((a for a in remaining if a.after is None or a.after in placed), None)
        if ready is None:
            waiting = ", ".join(f"{a.name} (after={a.after!r})" for a in remaining)
            raise ValueError(f"trace analyses wait for analyses that are not registered: {waiting}")
        ordered.append(ready)
        placed.add(ready.name)
        remaining.remove(ready)
    return ordered
