"""What the device did, from a trace's device operations (:class:`DeviceOps`): the
analyses Holistic Trace Analysis gives for one rank, with HTA's definitions, so the numbers compare.

- **Kinds** by name (HTA's ``get_kernel_type``): communication = ``nccl...Kernel`` (NCCL and RCCL); memcpy =
  ``Memcpy...``/``dma...``; memset = ``Memset...``; compute = every other name, except names holding ``Memcpy`` or
  ``Sync`` (those are *other*).
- **Temporal breakdown** (HTA's ``get_temporal_breakdown``): span = last end - first start of all device operations;
  busy = the union of their intervals; idle = span - busy; compute = the union of compute kernels; non-compute =
  span - compute - idle.
- **Overlap** (HTA's ``get_comm_comp_overlap``): the time communication and compute run at once, over the
  communication time (unions of each).
- **Launch delay** (HTA's ``get_cuda_kernel_launch_stats``): device start - launch call end, per launched operation,
  0 when the device started before the call returned.
- **Memory copies**: per copy kind (HTA's memory kernel types: the first 11 characters, ``Memcpy HtoD``; ``Memset``),
  the count, the bytes, the union of their intervals and bytes per second of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class KernelStat:
    name: str
    kind: str
    """compute, communication, memcpy, memset or other (see :func:`rlprof.analysis.gpu.device_op_kind`)."""
    count: int
    total_us: float


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True)
class MemcpyStat:
    kind: str
    """``Memcpy HtoD``, ``Memcpy DtoH``, ``Memcpy DtoD``, ``Memset`` ... (HTA's memory kernel types)."""
    count: int
    bytes: int
    busy_us: float
    """Union of the operations' intervals."""
    gbps: Optional[float]
    """Bytes moved per second of busy time (GB/s, 1e9), when the trace gives the sizes."""


@dataclass(frozen=True)
class GpuSummary:
    """What the device did, over a whole trace or one step (HTA's temporal breakdown, kernel breakdown, overlap,
    launch statistics and memory bandwidth, for one rank)."""

    span_us: float
    """From the first device operation's start to the last one's end."""
    busy_us: float
    """Union of every device operation's interval (any stream)."""
    idle_us: float
    """``span_us - busy_us``."""
    time_by_kind: dict[str, float]
    """Union of the intervals of each kind: compute, communication, memcpy, memset, other."""
    sum_by_kind: dict[str, float]
    """Sum of the durations of each kind (concurrent streams count twice)."""
    compute_us: float
    """Union of compute kernels (HTA's ``compute_time``)."""
    non_compute_us: float
    """``span - compute - idle`` (HTA's ``non_compute_time``)."""
    communication_overlap: Optional[float]
    """Share of communication time during which compute runs too (HTA's comm/comp overlap), or None."""
    top_kernels: list[KernelStat]
    launch_delay_us: Optional[Distribution]
    """Device start - launch end, per launched operation (HTA's launch delay)."""
    launch_us: Optional[Distribution]
    """Duration of the launch calls on the CPU."""
    memcpy: list[MemcpyStat]
    operations: int
    streams: int

    @property
    def idle_share(self) -> Optional[float]:
        return self.idle_us / self.span_us if self.span_us > 0 else None


@dataclass
class DeviceOps:
    """A trace's device operations (or one step's) as arrays, for :mod:`rlprof.analysis.gpu`."""

    start: Any
    end: Any
    name: Any
    """Name ids (into the builder's names)."""
    kind: Any
    """0 kernel, 1 memcpy, 2 memset (as the trace names them)."""
    stream: Any
    bytes: Any
    launch_end: Any
    """End of each operation's launch call (NaN without one)."""
    launch_duration: Any
    duration: Any
    """Each operation's duration as the trace gives it (``end - start`` loses digits at epoch-µs timestamps)."""

    def select(self, mask: Any) -> DeviceOps:
        return DeviceOps(**{name: getattr(self, name)[mask] for name in self.__dataclass_fields__})


COMPUTE, COMMUNICATION, MEMCPY, MEMSET, OTHER = "compute", "communication", "memcpy", "memset", "other"
KINDS = (COMPUTE, COMMUNICATION, MEMCPY, MEMSET, OTHER)
TOP_KERNELS = 10
_COMMUNICATION = re.compile(r"^nccl.*Kernel")
_MEMCPY = re.compile(r"^(Memcpy|dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def device_op_kind(name: str) -> str:
    """compute, communication, memcpy, memset or other (see the module doc)."""
    if _COMMUNICATION.match(name):
        return COMMUNICATION
    if name.startswith("Memset"):
        return MEMSET
    if _MEMCPY.match(name):
        return MEMCPY
    return OTHER if _NOT_COMPUTE.match(name) else COMPUTE


def memory_kind(name: str) -> str:
    """HTA's memory kernel type: ``Memset``, or the first 11 characters of a copy (``Memcpy HtoD``)."""
    if name.startswith("Memset"):
        return "Memset"
    return name[:11] if name.startswith("Memcpy") else "Memcpy Unknown"


def union_length(np: Any, starts: Any, ends: Any) -> float:
    """Length of the union of intervals [start, end)."""
    if not len(starts):
        return 0.0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    gaps = np.maximum(0.0, starts[1:] - ends[:-1])
    return float(ends[-1] - starts[0] - gaps.sum())


def merged(np: Any, starts: Any, ends: Any) -> tuple[Any, Any]:
    """The union of intervals as disjoint [start, end) intervals, in order."""
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    new = np.empty(len(starts), dtype=bool)
    new[0] = True
    new[1:] = starts[1:] > ends[:-1]
    group = np.cumsum(new) - 1
    merged_starts = starts[new]
    merged_ends = np.zeros(len(merged_starts))
    np.maximum.at(merged_ends, group, ends)
    return merged_starts, merged_ends


def intersection_length(np: Any, a: tuple[Any, Any], b: tuple[Any, Any]) -> float:
    """Length of the intersection of two unions of disjoint sorted intervals."""
    (a_start, a_end), (b_start, b_end) = a, b
    if not len(a_start) or not len(b_start):
        return 0.0
    points = np.concatenate([a_start, a_end, b_start, b_end])
    change = np.concatenate(
        [np.ones(len(a_start)), -np.ones(len(a_end)), 2 * np.ones(len(b_start)), -2 * np.ones(len(b_end))]
    )
    order = np.lexsort((change, points))
    points, running = points[order], np.cumsum(change[order])
    both = running[:-1] == 3
    return float((points[1:] - points[:-1])[both].sum())


def distribution(np: Any, values: Any) -> Optional[Distribution]:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return Distribution(len(values), float(values.mean()), p50, p90, p99, float(values.max()))


def summarize_device(ops: DeviceOps, names: list[str]) -> GpuSummary:
    """The device's work in ``ops`` (see the module doc); ``names`` resolves the name ids."""
    import numpy as np

    kind_of = [device_op_kind(name) for name in names]
    kinds = np.array([KINDS.index(kind) for kind in kind_of], dtype=np.int8)[ops.name]
    durations = ops.duration
    span = float(ops.end.max() - ops.start.min()) if len(ops.start) else 0.0
    busy = union_length(np, ops.start, ops.end)
    time_by_kind, sum_by_kind, unions = {}, {}, {}
    for code, kind in enumerate(KINDS):
        mask = kinds == code
        if mask.any():
            unions[kind] = merged(np, ops.start[mask], ops.end[mask])
            time_by_kind[kind] = float((unions[kind][1] - unions[kind][0]).sum())
            sum_by_kind[kind] = float(durations[mask].sum())
    compute = time_by_kind.get(COMPUTE, 0.0)
    overlap = None
    if COMMUNICATION in unions and time_by_kind[COMMUNICATION] > 0:
        shared = intersection_length(np, unions[COMMUNICATION], unions.get(COMPUTE, (np.array([]), np.array([]))))
        overlap = shared / time_by_kind[COMMUNICATION]
    keys, inverse = np.unique(ops.name, return_inverse=True)
    totals, counts = np.bincount(inverse, weights=durations), np.bincount(inverse)
    top = np.argsort(-totals, kind="stable")[:TOP_KERNELS].tolist()
    top_kernels = [KernelStat(names[keys[i]], kind_of[keys[i]], int(counts[i]), float(totals[i])) for i in top]
    memcpy = []
    labels = sorted({memory_kind(names[i]) for i in keys.tolist() if kind_of[i] in (MEMCPY, MEMSET)})
    if labels:
        lookup = np.full(len(names), -1, dtype=np.int64)
        for i in keys.tolist():
            if kind_of[i] in (MEMCPY, MEMSET):
                lookup[i] = labels.index(memory_kind(names[i]))
        label_of = lookup[ops.name]
        for code, label in enumerate(labels):
            mask = label_of == code
            busy_us = union_length(np, ops.start[mask], ops.end[mask])
            moved = int(ops.bytes[mask].sum())
            gbps = moved / busy_us / 1e3 if moved and busy_us else None
            memcpy.append(MemcpyStat(label, int(mask.sum()), moved, busy_us, gbps))
    return GpuSummary(
        span_us=span,
        busy_us=busy,
        idle_us=span - busy,
        time_by_kind=time_by_kind,
        sum_by_kind=sum_by_kind,
        compute_us=compute,
        non_compute_us=span - compute - (span - busy),
        communication_overlap=overlap,
        top_kernels=top_kernels,
        launch_delay_us=distribution(np, np.maximum(0.0, ops.start - ops.launch_end)),
        launch_us=distribution(np, ops.launch_duration),
        memcpy=memcpy,
        operations=len(ops.start),
        streams=len(np.unique(ops.stream)),
    )
