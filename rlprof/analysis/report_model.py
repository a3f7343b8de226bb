"""The report's data model: what ``rlprof report`` found in a run, as immutable values. The builder
(:mod:`rlprof.analysis.report`) fills it, the diagnosis (:mod:`rlprof.analysis.diagnose`) reads it, and the
layout (:mod:`rlprof.analysis.render.report_layout`) formats it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.analysis.allocations import HostRss, MemoryGrowth, MemorySummary
from rlprof.analysis.gpu import GpuSummary
from rlprof.analysis.memory_remedies import Remedy
from rlprof.analysis.trace_model import CaptureWindow

SCHEMA = "rlprof-report/2"


@dataclass(frozen=True)
class PhaseStat:
    phase: str
    group: str
    """rollout, training or other (see ``rlprof.metrics.timing.PHASE_GROUPS``)."""
    median_s: float
    p90_s: float
    share: float
    """Median phase time / median step time."""
    growth: Optional[float]
    """Relative change first quarter -> last quarter of the steps; None with fewer than 8 steps."""


@dataclass(frozen=True)
class Breakdown:
    steps: list[int]
    """Training steps used (warm-up excluded unless asked)."""
    warmup: list[int]
    step_median_s: float
    step_p90_s: float
    phases: list[PhaseStat]
    split: dict[str, float]
    """Median share of the step per group: rollout, training, other, unaccounted."""
    work_split: dict[str, float]
    """Median share of the step per group (rollout, training, other) with each phase at its fastest rank's time
    (``timing_ranks/{phase}/min``): the groups' own work, without the time the logging rank spent in a collective
    waiting for a slower one. Equals ``split`` on one rank. The rollout- and training-bound rules compare these."""
    idle_share: Optional[float]
    """Median share of wall time between logged steps spent outside the step (validation, checkpoints, logging)."""
    overlap_gain: Optional[float]
    """At most how much faster a step would be with generation overlapped with the rest of it (one-step-off or
    fully async: a step then takes the longer of the two): ``1 / max(r, 1 - r)``, ``r`` the rollout share of
    :attr:`work_split`; None for a run that is asynchronous already (its ``gen`` is a wait for samples)."""
    stragglers: dict[str, float]
    """Median over steps of max/mean time across ranks, per phase (several ranks only)."""
    slowest_rank_share: dict[str, float]
    """Median over steps of the slowest rank's time in the phase / the step time, per phase (several ranks)."""
    slowest_rank: dict[str, int]
    """The rank most often slowest in each phase (``timing_ranks/{phase}/slowest_rank``)."""
    per_step: dict[str, list[tuple[int, float]]]
    """Every logged training step's seconds per phase (``step`` included, warm-up too), for plots."""


@dataclass(frozen=True)
class Throughput:
    metric: str
    median: float
    growth: Optional[float]


@dataclass(frozen=True)
class OpStat:
    name: str
    device: str
    count: int
    self_ms: float


@dataclass(frozen=True)
class RangeStat:
    label: str
    role: str
    """The role of an rlprof range (``role/name``); the kind of any other tracked frame."""
    count: int
    total_ms: float
    self_ms: float
    cuda_ms: float
    """Device time launched from inside the range (see :mod:`rlprof.analysis.trace_model`)."""
    gpu_span_ms: float
    """The range's GPU projection summed over its instances (nsys's ``nvtx_gpu_proj``)."""
    allocated_bytes: int
    """Bytes allocated inside the range (the torch tool with ``contents: [memory]``); 0 without."""
    peak_allocated: int
    """Highest total allocated memory seen inside the range (same source)."""
    top_ops: list[OpStat]
    top_kernels: list[OpStat]
    """The device operations launched inside the range, by total time."""


@dataclass(frozen=True)
class WindowTrace:
    path: str
    source: str
    """The file's format: chrome_trace (torch/kineto) or nsys_report."""
    window: str
    rank: int
    host: Optional[str]
    device: Optional[str]
    """The device's name, when the trace gives it."""
    step_ms: dict[int, float]
    range_kind: str
    """What ``ranges`` lists: range (rlprof's ``role/name``), annotation (a trace without rlprof ranges: its user
    annotations), step (nor those: its ProfilerStep spans) or operator (its top-level operators)."""
    ranges: list[RangeStat]
    annotations: list[RangeStat]
    """The trace's other user annotations beside rlprof's ranges (empty when ``ranges`` lists annotations or there
    are none)."""
    captures: list[CaptureWindow]
    """Stream captures (CUDA graphs recorded): their launches queue no device work."""
    graph_launches: int
    """Replays of captured graphs in the trace."""
    gpu: Optional[GpuSummary]
    """What the device did in the window (None without device operations)."""
    gpu_by_step: dict[int, GpuSummary]
    unlaunched: int
    """Device operations whose launch is not in the trace (kept, outside every range)."""
    skipped_events: int
    problems: list[str]


@dataclass(frozen=True)
class RankStraggler:
    window: str
    label: str
    slowest_rank: int
    ratio: float
    """Slowest rank's time / median over the ranks that ran the range."""
    per_rank_ms: dict[int, float]
    absent_on: list[int]
    """Ranks of the window whose trace has no such range."""


@dataclass(frozen=True)
class MemoryReport:
    host_rss: Optional[HostRss]
    timelines: list[MemorySummary]
    oom: list[MemorySummary]
    """Histories with an allocation that failed (the OOM snapshots, and any snapshot whose history has one)."""
    remedies: list[Remedy]
    """What to try for the first failure: the seed's memory settings not already on in this run."""
    peak_from_metrics_gb: Optional[float]
    """Highest ``perf/max_memory_reserved_gb`` (CUDA) or ``perf/process_rss_gb`` over the steps."""
    capacity_gb: Optional[float]
    """The device's (CUDA) or host's total memory, from the metrics."""
    device: str
    """cuda or cpu."""
    traced_by_role: dict[str, int]
    """Highest total allocated memory inside each role's ranges, from the torch traces' ``[memory]`` events."""
    growth: list[MemoryGrowth] = field(default_factory=list)
    """Sites that end every memray window of a rank with bytes they made and kept (:func:`~rlprof.analysis.
    allocations.memory_growth`), the largest a step first."""


@dataclass(frozen=True)
class StallRecord:
    """A stall the watchdog recorded (:mod:`rlprof.analysis.stalls`)."""

    step: int
    phase: str
    """The phase that ran too long, on ``seen_by``."""
    seen_by: int
    elapsed_s: float
    threshold_s: float
    behind_rank: int
    """The rank furthest behind when it was seen (in its phase longest): the one the others wait for."""
    behind_phase: str
    behind_step: int
    behind_for_s: float
    folder: str
    """Where every rank's thread stacks are."""
    innermost: dict[int, list[str]]
    """Per rank, its main thread's innermost frames (``file:line in function: source``), innermost last."""


@dataclass(frozen=True)
class Finding:
    rule: str
    title: str
    message: str
    evidence: dict[str, float]
    overrides: list[str]
    not_offered: list[str] = field(default_factory=list)
    """Overrides the rule would name that were measured slower on this kind of machine: ``override: measurement``."""


@dataclass(frozen=True)
class Report:
    schema: str
    run: str
    run_id: Optional[str]
    sources: dict[str, Any]
    missing: list[str]
    notes: list[str]
    breakdown: Optional[Breakdown]
    throughput: list[Throughput]
    traces: list[WindowTrace]
    stragglers: list[RankStraggler]
    memory: Optional[MemoryReport]
    unreadable: list[str] = field(default_factory=list)
    """Files of the run that could not be read: one line each (also in ``notes``)."""
    findings: list[Finding] = field(default_factory=list)
    stalls: list[StallRecord] = field(default_factory=list)
    """Stalls the trainer's watchdog recorded in the log folder."""
    engine: list[Throughput] = field(default_factory=list)
    """The rollout engine's counters and generation's long tail (``rollout/engine/*``, ``rollout/slowest_response_s``,
    ``response_length/p99``): the median over the steps of the breakdown."""
    tools: list[Throughput] = field(default_factory=list)
    """A multi-turn rollout's turns and tool calls (``num_turns/mean``, ``tool_call_counts/mean``, the time split,
    the slowest trajectory, ``tools/*``): the median over the steps of the breakdown."""
    pipeline: list[Throughput] = field(default_factory=list)
    """An asynchronous pipeline's metrics (``fully_async/*``, ``training/off_policy/*``: idle ratios, waits by
    reason, staleness, partial rollouts, dropped samples): the median over the steps of the breakdown."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The parts registered report sections built (:mod:`rlprof.analysis.report_sections`): name -> part."""


@dataclass(frozen=True)
class ReportOptions:
    include_warmup: bool = False
    memory_limit_gb: Optional[float] = None
    top_ops: int = 5
