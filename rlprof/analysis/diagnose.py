"""The diagnosis: rules, as data in one place, that classify a run from its report and name the overrides to try.

Each :class:`Rule` has a name, a title, its thresholds and a check that reads the
:class:`~rlprof.analysis.report_model.Report` (and the run's saved config, for the current values of the knobs) and
returns a :class:`Finding` with the evidence numbers and the exact overrides, or None. The advice follows the seed's
tuning table (rollout slow -> raise ``max_num_batched_tokens``; training slow -> adjust
``ppo_micro_batch_size_per_gpu``; memory-limited -> ``use_dynamic_bsz``; OOM -> entropy chunking/checkpointing,
gradient checkpointing) and the trainer's knobs (docs/performance_tuning.md); the GPU rules read the traces' device
analyses (:mod:`rlprof.analysis.gpu`). Add a rule with :func:`register_rule`.

A rule that makes the run faster (``purpose="speed"``) does not offer an override that this project measured slower
on the run's kind of machine (:data:`MEASURED_SLOWER`); the finding names it as not offered, with the measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from rlprof.analysis.gpu import GpuSummary
from rlprof.analysis.report_model import Finding, PhaseStat, Report, ReportOptions, WindowTrace
from rlprof.analysis.run import Run
from rlprof.analysis.trace_model import captured_idle_us, judged_idle_share, judged_span_us

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"


MEASURED_SLOWER: dict[tuple[str, str], str] = {
    (f"{MODEL}.use_remove_padding=true", "cpu"): (
        "measured 1.51x slower per step on a 2-core CPU by rlprof_train.tune (PyTorch's math attention over the "
        "packed row; docs/tuning.md)"
    ),
    (f"{MODEL}.enable_gradient_checkpointing=true", "cpu"): (
        "measured 1.40x slower per step by rlprof_train.tune and 0.78x-0.87x the update speed by the knob "
        "benchmark on a 2-core CPU (each layer runs twice)"
    ),
}
"""(override, device kind) -> what was measured: overrides that a speed rule does not offer on that kind of machine.
Device kinds: cpu, cuda (see :func:`device_kind`)."""


@dataclass(frozen=True)
class Rule:
    name: str
    title: str
    thresholds: dict[str, float]
    check: Callable[[Rule, Report, Run, ReportOptions], Optional[Finding]]
    purpose: str = "speed"
    """speed (its overrides make a step faster: measured-slower ones are dropped) or memory (they trade speed)."""
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def finding(self, message: str, evidence: dict[str, float], overrides: list[str]) -> Finding:
        return Finding(self.name, self.title, message, {k: round(v, 4) for k, v in evidence.items()}, overrides)


def device_kind(report: Report) -> str:
    """cuda when the run's metrics or traces show a GPU, else cpu (the kind of machine the run measured)."""
    if report.memory is not None and report.memory.device == "cuda":
        return "cuda"
    if any(t.gpu is not None for t in report.traces):
        return "cuda"
    return "cpu"


def _offered(finding: Finding, rule: Rule, device: str) -> Finding:
    """``finding`` without the overrides measured slower on ``device`` (speed rules only)."""
    if rule.purpose != "speed":
        return finding
    slower = {o: MEASURED_SLOWER[(o, device)] for o in finding.overrides if (o, device) in MEASURED_SLOWER}
    if not slower:
        return finding
    kept = [o for o in finding.overrides if o not in slower]
    not_offered = [f"{o}: {why}" for o, why in slower.items()]
    return replace(finding, overrides=kept, not_offered=finding.not_offered + not_offered)


VERL_ROLLOUTS_WITHOUT_ENGINE = frozenset({"hf"})
"""verl's ``rollout.name`` values that generate with the actor's own module (no engine settings apply): how a run
verl recorded, with no run record, is read."""


def _rollout_reads(run: Run, setting: str) -> bool:
    """Whether the run's rollout backend uses ``actor_rollout_ref.rollout.<setting>``: as rlprof_train's run record
    says (``run.json``: ``rollout.reads``, from the backend's registration). A run recorded elsewhere (verl) names an
    engine in ``rollout.name`` (vllm, sglang), which reads verl's engine settings; only its ``hf`` does not."""
    record = run.record.get("rollout") if isinstance(run.record, dict) else None
    if isinstance(record, dict) and isinstance(record.get("reads"), list):
        return setting in record["reads"]
    name = run.setting(f"{ROLLOUT}.name")
    return isinstance(name, str) and name not in VERL_ROLLOUTS_WITHOUT_ENGINE


def _compiled_decode_allowed(run: Run) -> bool:
    """Whether ``rollout.enforce_eager=false`` (CUDA graphs in an engine, the compiled decode in rlprof_train's
    ``hf``) is a setting the run could take: its rollout reads it, and it is not ``hf`` under ZeRO 3, which
    rlprof_train refuses (the compiled decode replays on the weights' buffers; ZeRO 3 gathers them for every call)."""
    if not _rollout_reads(run, "enforce_eager"):
        return False
    return not (run.setting(f"{ROLLOUT}.name") == "hf" and _int(run, f"{ACTOR}.zero_stage", 1) == 3)


def _int(run: Run, key: str, default: int) -> int:
    value = run.setting(key, default)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _dominant(share: float, other: float, rule: Rule) -> bool:
    """A group dominates the step: at least ``share`` of it and ``over`` times the other group's share (the shares
    of :attr:`~rlprof.analysis.report_model.Breakdown.work_split`: waiting in a collective for a slower rank is the
    straggler rule's evidence, not work of the phase it is spent in)."""
    return share >= rule.thresholds["share"] and share >= rule.thresholds["over"] * other


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


# --------------------------------------------------------------------------------------------- the rules


def rollout_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    share = b.work_split.get("rollout", 0.0) if b else 0.0
    if b is None or not _dominant(share, b.work_split.get("training", 0.0), rule):
        return None
    gen = next((p for p in b.phases if p.phase == "gen"), None)
    evidence = {"rollout_share": share, **({"gen_median_s": gen.median_s} if gen else {})}
    if _rollout_reads(run, "max_num_batched_tokens"):
        overrides = _engine_speedups(run)
    else:
        chunk = _int(run, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", 64)
        overrides = [f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu={2 * chunk}"]
    message = (
        f"rollout-bound: generation takes {_pct(share)} of the step"
        + (f" (gen {gen.median_s:.3g} s median)" if gen else "")
        + "; make generation faster first"
    )
    return rule.finding(message, evidence, overrides)


def _engine_speedups(run: Run) -> list[str]:
    """A rollout engine's batch of tokens x2 and, below 0.85, more of the device's memory for its cache."""
    tokens = _int(run, f"{ROLLOUT}.max_num_batched_tokens", 8192)
    overrides = [f"{ROLLOUT}.max_num_batched_tokens={2 * tokens}"]
    utilization = run.setting(f"{ROLLOUT}.gpu_memory_utilization", 0.5)
    if isinstance(utilization, (int, float)) and utilization < 0.85:
        overrides.append(f"{ROLLOUT}.gpu_memory_utilization={min(0.9, round(utilization + 0.2, 2))}")
    return overrides


def _generation_speedups(run: Run) -> list[str]:
    """What makes the rollout's generation itself faster: an engine's settings (:func:`_engine_speedups`), or
    rlprof_train's hf rollout's: twice the prompts per ``generate`` call where it chunks them
    (``rollout.micro_batch_size``), its compiled decode step where allowed."""
    if _rollout_reads(run, "max_num_batched_tokens"):
        return _engine_speedups(run)
    overrides = []
    chunk = run.setting(f"{ROLLOUT}.micro_batch_size")
    if _rollout_reads(run, "micro_batch_size") and isinstance(chunk, int) and not isinstance(chunk, bool):
        overrides.append(f"{ROLLOUT}.micro_batch_size={2 * chunk}")
    if run.setting(f"{ROLLOUT}.enforce_eager", True) is True and _compiled_decode_allowed(run):
        overrides.append(f"{ROLLOUT}.enforce_eager=false")
    return overrides


def _training_speedups(run: Run, heaviest: str, evidence: dict[str, float]) -> list[str]:
    """What makes the training passes faster, the heaviest phase ``heaviest``'s own micro-batch first: fuller
    micro-batches, no padding, micro-batches by token budget (``evidence`` gets the micro-batches per optimizer
    step)."""
    micro = _int(run, f"{ACTOR}.ppo_micro_batch_size_per_gpu", 32)
    mini = _int(run, f"{ACTOR}.ppo_mini_batch_size", 32) * _int(run, f"{ROLLOUT}.n", 1)
    overrides = []
    if not run.setting(f"{ACTOR}.use_dynamic_bsz", False) and micro < mini:
        overrides.append(f"{ACTOR}.ppo_micro_batch_size_per_gpu={min(2 * micro, mini)}")
        evidence["micro_batches_per_optimizer_step"] = mini / micro
    if not run.setting(f"{MODEL}.use_remove_padding", False):
        overrides.append(f"{MODEL}.use_remove_padding=true")
    if not run.setting(f"{ACTOR}.use_dynamic_bsz", False):
        overrides.append(f"{ACTOR}.use_dynamic_bsz=true")
    if heaviest in ("old_log_prob", "ref"):
        key = (
            f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
            if heaviest == "old_log_prob"
            else "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
        )
        overrides.insert(0, f"{key}={2 * _int(run, key, 64)}")
    return overrides


def training_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    share = b.work_split.get("training", 0.0) if b else 0.0
    if b is None or not _dominant(share, b.work_split.get("rollout", 0.0), rule):
        return None
    heaviest = max((p for p in b.phases if p.group == "training"), key=lambda p: p.median_s)
    evidence = {"training_share": share, f"{heaviest.phase}_share": heaviest.share}
    overrides = _training_speedups(run, heaviest.phase, evidence)
    message = (
        f"training-bound: the training passes take {_pct(share)} of the step, {heaviest.phase} the most "
        f"({_pct(heaviest.share)}); fewer, fuller micro-batches and no padding make them faster"
    )
    return rule.finding(message, evidence, overrides)


def memory_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    memory = report.memory
    if memory is None:
        return None
    budget = _int(run, f"{ACTOR}.ppo_max_token_len_per_gpu", 16384)
    overrides = [
        f"{ACTOR}.use_dynamic_bsz=true",
        f"{ACTOR}.ppo_max_token_len_per_gpu={max(1, budget // 2)}",
        f"{MODEL}.enable_gradient_checkpointing=true",
        f"{ACTOR}.entropy_from_logits_with_chunking=true",
        f"{ACTOR}.entropy_checkpointing=true",
    ]
    failure = next((s for s in memory.oom if s.oom is not None), None)
    if failure is not None and failure.oom is not None:
        moment = failure.oom
        holder = next(iter(moment.by_tag), "")
        larger = (
            f" (more than the device's {moment.failure.device_total / 2**30:.2f} GiB: no memory freed makes room for "
            "it, only a smaller request does)"
            if moment.failure.exceeds_device and moment.failure.device_total
            else ""
        )
        message = (
            f"out of memory: {failure.device} could not allocate {moment.failure.requested / 2**30:.2f} GiB{larger} in "
            f"{moment.failure.tag or 'no rlprof range'} with {moment.failure.device_free / 2**30:.2f} GiB free; "
            f"{moment.live_bytes / 2**30:.2f} GiB were alive"
            + (f", most in {holder} ({moment.by_tag[holder] / 2**30:.2f} GiB)" if holder else "")
        )
        evidence = {
            "requested_gb": moment.failure.requested / 2**30,
            "device_free_gb": moment.failure.device_free / 2**30,
            "live_gb": moment.live_bytes / 2**30,
        }
        fixes = [fix.override for fix in memory.remedies]
        if not fixes and not moment.failure.exceeds_device:  # the seed's memory settings, where freeing can help
            fixes = overrides
        return rule.finding(message, evidence, fixes)
    limit = options.memory_limit_gb or memory.capacity_gb
    peak_gb = memory.peak_from_metrics_gb or 0.0
    if memory.host_rss is not None:
        peak_gb = max(peak_gb, memory.host_rss.peak_rss / 2**30)
    for timeline in memory.timelines:
        peak_gb = max(peak_gb, timeline.peak_bytes / 2**30)
    if not limit or peak_gb < rule.thresholds["fraction"] * limit:
        return None
    evidence = {"peak_gb": peak_gb, "limit_gb": limit, "fraction": peak_gb / limit}
    where = ""
    if memory.host_rss is not None and memory.host_rss.ranges:
        grower = memory.host_rss.ranges[0]
        where = f"; {grower.label} raises it most (+{grower.max_growth / 2**20:.0f} MiB in one range)"
        evidence["largest_range_growth_mb"] = grower.max_growth / 2**20
    source = "--memory-limit-gb" if options.memory_limit_gb else f"the {memory.device} total"
    message = (
        f"memory-bound: the peak, {peak_gb:.2f} GB, is {_pct(peak_gb / limit)} of {limit:.2f} GB ({source})"
        f"{where}; at this size a longer response or a bigger batch runs out of memory"
    )
    return rule.finding(message, evidence, overrides)


def straggler_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    if b is None or not b.stragglers:
        return None
    shares = {p.phase: b.slowest_rank_share.get(p.phase, p.share) for p in b.phases}
    limits = rule.thresholds
    candidates = [
        (phase, ratio)
        for phase, ratio in b.stragglers.items()
        if phase != "step" and ratio >= limits["ratio"] and shares.get(phase, 0) >= limits["share"]
    ]
    if not candidates:
        return None
    # The phase where one rank lags has the largest spread; the others then show it as waiting in the next phase
    # with a collective (there the lagging rank is the fast one), which is named as the consequence.
    phase, ratio = max(candidates, key=lambda item: item[1])
    traced = next((s for s in report.stragglers if s.label.endswith(f"/{phase}")), None)
    rank = b.slowest_rank.get(phase, traced.slowest_rank if traced else None)
    who = f"rank {rank}" if rank is not None else "one rank"
    evidence = {"straggler_ratio": ratio, f"{phase}_share": shares.get(phase, 0.0)}
    if rank is not None:
        evidence["slowest_rank"] = float(rank)
    waits = [p for p, r in candidates if p != phase and rank is not None and b.slowest_rank.get(p, rank) != rank]
    message = (
        f"straggler-bound: in {phase} {who} takes {ratio:.2f}x the mean of the ranks "
        f"({_pct(shares.get(phase, 0.0))} of the step)"
        + (f"; the others wait for it in {', '.join(waits)}" if waits else ", and the others wait for it")
        + "; check that host for other load, and balance the work per rank"
    )
    overrides = [f"{ACTOR}.use_dynamic_bsz=true", f"{MODEL}.use_remove_padding=true"]
    return rule.finding(message, evidence, overrides)


def overhead_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    if b is None:
        return None
    idle = b.idle_share or 0.0
    unaccounted = b.split.get("unaccounted", 0.0)
    if idle < rule.thresholds["idle"] and unaccounted < rule.thresholds["unaccounted"]:
        return None
    overrides = []
    test_freq, save_freq = _int(run, "trainer.test_freq", -1), _int(run, "trainer.save_freq", -1)
    if 0 < test_freq < 50:
        overrides.append(f"trainer.test_freq={max(50, 10 * test_freq)}")
    if 0 < save_freq < 50:
        overrides.append(f"trainer.save_freq={max(50, 10 * save_freq)}")
    if run.setting("global_profiler.tool") and run.setting("global_profiler.steps") is None:
        overrides.append("global_profiler.steps=[5]")
    message = (
        f"overhead-bound: {_pct(idle)} of the wall time passes between steps (validation, checkpoints, logging)"
        if idle >= rule.thresholds["idle"]
        else f"overhead-bound: {_pct(unaccounted)} of the step is in no timed phase"
    )
    return rule.finding(
        message + "; do that work less often", {"idle_share": idle, "unaccounted_share": unaccounted}, overrides
    )


def memory_growth(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """A site that ends every memray window of a rank with what it made and kept, at least ``kib_per_step`` KiB a
    step: memory that grows with the steps (host memory: a list or cache the loop keeps adding to)."""
    memory = report.memory
    grown = [g for g in memory.growth if g.bytes_per_step >= 1024 * rule.thresholds["kib_per_step"]] if memory else []
    if not grown:
        return None
    top = grown[0]
    where = top.tag or "outside every rlprof range"
    names = ", ".join(name for name, _ in top.windows)
    message = (
        f"memory grows: {top.site} ({where}) ends each of {len(top.windows)} windows ({names}) with "
        f"{top.bytes_per_step / 2**20:.2f} MiB a step it made and never freed: a list or cache the loop keeps "
        "adding to?" + (f" ({len(grown) - 1} more sites grow, listed under Memory)" if len(grown) > 1 else "")
    )
    evidence = {"bytes_per_step": top.bytes_per_step, "windows": float(len(top.windows))}
    return rule.finding(message, evidence, [])


def _gpu_windows(report: Report, rule: Rule) -> list[tuple[WindowTrace, GpuSummary]]:
    """The traces whose device ran long enough to judge: a judged span
    (:func:`~rlprof.analysis.trace_model.judged_span_us`) of at least ``min_span_ms``."""
    return [
        (t, t.gpu)
        for t in report.traces
        if t.gpu is not None and judged_span_us(t.gpu, t.captures) >= 1e3 * rule.thresholds["min_span_ms"]
    ]


def _where(trace: WindowTrace) -> str:
    """``rank 0 (step3)``, ``rank 0 (whole trace)``: the trace a finding is about."""
    return f"rank {trace.rank}" + (f" ({trace.window})" if trace.window else "")


def gpu_idle(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """The device waits for the host: idle (no kernel, copy or set on any stream) for most of the traced span, stream
    captures left out."""
    judged = [(t, g, judged_idle_share(g, t.captures)) for t, g in _gpu_windows(report, rule)]
    windows = [w for w in judged if w[2] >= rule.thresholds["idle"]]
    if not windows:
        return None
    trace, gpu, idle = max(windows, key=lambda w: w[2])
    span_ms, captured_ms = judged_span_us(gpu, trace.captures) / 1e3, captured_idle_us(trace.captures) / 1e3
    evidence = {"gpu_idle_share": idle, "gpu_span_ms": span_ms, "traces_idle": float(len(windows))}
    if captured_ms:
        evidence["capture_idle_ms_left_out"] = captured_ms
    if gpu.launch_delay_us is not None:
        evidence["launch_delay_p50_us"] = gpu.launch_delay_us.p50
    if gpu.operations:
        evidence["busy_us_per_operation"] = gpu.busy_us / gpu.operations
    overrides = []
    micro = _int(run, f"{ACTOR}.ppo_micro_batch_size_per_gpu", 32)
    mini = _int(run, f"{ACTOR}.ppo_mini_batch_size", 32) * _int(run, f"{ROLLOUT}.n", 1)
    if not run.setting(f"{ACTOR}.use_dynamic_bsz", False) and micro < mini:
        overrides.append(f"{ACTOR}.ppo_micro_batch_size_per_gpu={min(2 * micro, mini)}")
    if _compiled_decode_allowed(run) and run.setting(f"{ROLLOUT}.enforce_eager", True):
        overrides.append(f"{ROLLOUT}.enforce_eager=false")
    outside = f" outside its {captured_ms:.3g} ms of CUDA-graph capture" if captured_ms else ""
    message = (
        f"GPU idle: on {_where(trace)} the device is idle {_pct(idle)} of the {span_ms:.3g} ms it was traced{outside}"
        f" ({len(windows)} of {len(report.traces)} traces at least {_pct(rule.thresholds['idle'])}); the host does not"
        " keep it fed: the launches (many small kernels: larger micro-batches, CUDA graphs) or the data loading and"
        " Python work between them (see the top operators by self time)"
    )
    return rule.finding(message, evidence, overrides)


def communication_exposed(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """Collectives (NCCL/RCCL kernels) take a large part of the device's busy time and compute rarely runs beside
    them: the ranks wait for each other's gradients instead of computing."""
    windows = []
    for trace, gpu in _gpu_windows(report, rule):
        comm = gpu.time_by_kind.get("communication", 0.0)
        share = comm / gpu.busy_us if gpu.busy_us > 0 else 0.0
        overlap = gpu.communication_overlap
        if share >= rule.thresholds["share"] and overlap is not None and overlap < rule.thresholds["overlap"]:
            windows.append((trace, gpu, share, overlap))
    if not windows:
        return None
    trace, gpu, share, overlap = max(windows, key=lambda w: w[2] * (1 - w[3]))
    evidence = {
        "communication_share_of_busy": share,
        "communication_overlap": overlap,
        "communication_ms": gpu.time_by_kind.get("communication", 0.0) / 1e3,
    }
    overrides = []
    zero_stage = _int(run, f"{ACTOR}.zero_stage", 1)
    if zero_stage > 0 and not run.setting(f"{ACTOR}.overlap_comm"):
        overrides.append(f"{ACTOR}.overlap_comm=true")
    micro = _int(run, f"{ACTOR}.ppo_micro_batch_size_per_gpu", 32)
    mini = _int(run, f"{ACTOR}.ppo_mini_batch_size", 32) * _int(run, f"{ROLLOUT}.n", 1)
    if not run.setting(f"{ACTOR}.use_dynamic_bsz", False) and micro < mini:
        overrides.append(f"{ACTOR}.ppo_micro_batch_size_per_gpu={min(2 * micro, mini)}")
    message = (
        f"communication exposed: on {_where(trace)} collectives take {_pct(share)} of the device's busy time and "
        f"compute runs beside them only {_pct(overlap)} of it; reduce gradients during backward, and fewer, larger "
        "micro-batches mean fewer reductions waited for"
    )
    return rule.finding(message, evidence, overrides)


ENGINE = "rollout/engine/"


def _engine(report: Report) -> dict[str, float]:
    """The engine counters' medians by name (without the prefix)."""
    return {t.metric.removeprefix(ENGINE): t.median for t in report.engine}


def engine_queue_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """Requests wait to be scheduled for most of their time to the first token while generation is a large part of
    the step: the engine runs fewer sequences at once than it is given."""
    engine = _engine(report)
    queue, ttft = engine.get("queue_time_ms_p50"), engine.get("ttft_ms_p50")
    share = report.breakdown.split.get("rollout", 0.0) if report.breakdown else 0.0
    limits = rule.thresholds
    if queue is None or not ttft or queue < limits["queue_of_ttft"] * ttft or share < limits["rollout_share"]:
        return None
    seqs = _int(run, f"{ROLLOUT}.max_num_seqs", 256)
    tokens = _int(run, f"{ROLLOUT}.max_num_batched_tokens", 8192)
    message = (
        f"engine-queue-bound: requests wait {queue:.3g} ms (median) to be scheduled, {_pct(queue / ttft)} of their "
        f"time to the first token, while generation takes {_pct(share)} of the step; let the engine run more "
        "sequences at once (its KV cache must hold them: watch rollout/engine/num_preemptions)"
    )
    evidence = {"queue_time_ms_p50": queue, "ttft_ms_p50": ttft, "rollout_share": share}
    return rule.finding(
        message, evidence, [f"{ROLLOUT}.max_num_seqs={2 * seqs}", f"{ROLLOUT}.max_num_batched_tokens={2 * tokens}"]
    )


def engine_preempting(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """The engine preempts requests every step: its KV cache cannot hold the sequences it runs at once, and a
    preempted request's tokens are computed again."""
    engine = _engine(report)
    preemptions = engine.get("num_preemptions", 0.0)
    if preemptions < rule.thresholds["preemptions"]:
        return None
    evidence = {"num_preemptions": preemptions}
    full = ""
    if "kv_cache_usage" in engine:  # the step's peak share of the cache's blocks (median over steps)
        evidence["kv_cache_usage"] = engine["kv_cache_usage"]
        full = f" with its KV cache {_pct(engine['kv_cache_usage'])} full at the peak"
    seqs = _int(run, f"{ROLLOUT}.max_num_seqs", 256)
    if device_kind(report) == "cuda":
        utilization = run.setting(f"{ROLLOUT}.gpu_memory_utilization", 0.5)
        level = utilization if isinstance(utilization, (int, float)) else 0.5
        more_cache = f"{ROLLOUT}.gpu_memory_utilization={min(0.95, round(level + 0.1, 2))}"
    else:  # vLLM on CPU sizes its KV cache in GB
        more_cache = f"{ROLLOUT}.kv_cache_space_gb={2 * _int(run, f'{ROLLOUT}.kv_cache_space_gb', 1)}"
    message = (
        f"engine-preempting: the engine preempts {preemptions:.0f} requests a step (median){full}, recomputing "
        "them; give its KV cache more memory, or run fewer sequences at once"
    )
    return rule.finding(message, evidence, [more_cache, f"{ROLLOUT}.max_num_seqs={max(1, seqs // 2)}"])


MULTI_TURN = f"{ROLLOUT}.multi_turn"


def tool_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """A multi-turn rollout waits on its tool calls for most of its time while the rollout is a large part of the
    step: the slowest tool sets the pace (every call of a turn already runs at once)."""
    medians = {t.metric: t.median for t in report.tools}
    wait = medians.get("rollout/tool_wait_share")
    share = report.breakdown.split.get("rollout", 0.0) if report.breakdown else 0.0
    limits = rule.thresholds
    if wait is None or wait < limits["tool_wait"] or share < limits["rollout_share"]:
        return None
    p99 = {k.split("/")[1]: v for k, v in medians.items() if k.startswith("tools/") and k.endswith("/latency_ms_p99")}
    slowest = max(p99, key=p99.__getitem__) if p99 else None
    evidence = {"tool_wait_share": wait, "rollout_share": share}
    overrides = []
    where = ""
    if slowest is not None:
        p50, tail = medians.get(f"tools/{slowest}/latency_ms_p50", 0.0), p99[slowest]
        evidence |= {f"{slowest}_latency_ms_p50": p50, f"{slowest}_latency_ms_p99": tail}
        where = f"; the slowest tool, {slowest}, takes {p50:.4g} ms per call (median), {tail:.4g} ms at p99"
        timeout = run.setting(f"{MULTI_TURN}.tool_timeout_s", 30.0)
        cut = max(1, math.ceil(2 * p50 / 1000))  # twice the median call: the tail past it gets an error reply
        if isinstance(timeout, (int, float)) and tail > 2 * p50 and cut < timeout:
            overrides.append(f"{MULTI_TURN}.tool_timeout_s={cut}")
    turns = medians.get("num_turns/mean")
    if turns is not None and turns > 4:  # 1 + assistant + reply turns: more than two calls per trajectory
        assistant = max(2, int(turns // 2) - 1)
        overrides.append(f"{MULTI_TURN}.max_assistant_turns={assistant}")
    message = (
        f"tool-bound: the rollout waits on tool calls for {_pct(wait)} of its time, while it takes {_pct(share)} of "
        f"the step{where}; make the tool faster or closer (it runs every call of a turn at once already), cut its "
        "long tail with a timeout, or allow fewer turns"
    )
    return rule.finding(message, evidence, overrides)


# ------------------------------------------------------------------------- asynchronous pipelines

ASYNC = "async_training"


def _pipeline(report: Report) -> dict[str, float]:
    return {t.metric: t.median for t in report.pipeline}


def _per_node(run: Run, pool: str) -> int:
    """The ``pool``'s processes per node (``trainer`` or ``rollout``), verl's ``{pool}.n_gpus_per_node``: as the
    run's config says (verl's records it), else, for the trainer's, as rlprof_train's run record does (``run.json``:
    the launch's processes per node less the rollout pool's); 0 when neither says."""
    configured = _int(run, f"{pool}.n_gpus_per_node", 0)
    processes = run.record.get("processes") if isinstance(run.record, dict) else None
    if configured or pool == "rollout" or not isinstance(processes, dict) or not processes.get("rollout"):
        return configured
    per_node = processes.get("per_node")
    return per_node - _int(run, "rollout.n_gpus_per_node", 0) if isinstance(per_node, int) else 0


def _move_processes(run: Run, to: str) -> list[str]:
    """One process per node moved from the other pool to ``to`` (``trainer`` or ``rollout``), verl's
    ``{trainer,rollout}.n_gpus_per_node``; none when the other pool has one per node."""
    other = "rollout" if to == "trainer" else "trainer"
    have, give = _per_node(run, to), _per_node(run, other)
    if have < 1 or give < 2:
        return []
    return [f"{other}.n_gpus_per_node={give - 1}", f"{to}.n_gpus_per_node={have + 1}"]


def async_rollout_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """An asynchronous trainer waits for samples for a large share of its step: the rollout pool does not keep
    up. Its own speed knobs first (they take nothing from the trainer), then a process moved to it: more processes
    only help a generation whose time grows with its rows, not one bound by its per-token latency
    (benchmarks/test_async_advice.py measures the first override)."""
    medians = _pipeline(report)
    idle = medians.get("fully_async/trainer/idle_ratio")
    if idle is None or idle < rule.thresholds["idle"]:
        return None
    evidence = {"trainer_idle_ratio": idle}
    if "fully_async/total_wait_time" in medians:
        evidence["wait_for_samples_s"] = medians["fully_async/total_wait_time"]
    overrides = _generation_speedups(run) + _move_processes(run, "rollout")
    staleness = run.setting(f"{ASYNC}.staleness_threshold")
    ahead = ""
    if isinstance(staleness, (int, float)) and staleness < 1:
        ahead = (
            f"; {ASYNC}.staleness_threshold={staleness:g} lets the rollouter run only that far ahead (more changes "
            "what is learned: older samples)"
        )
    message = (
        f"async-rollout-bound: the trainer waits for samples {_pct(idle)} of its step (median); the rollout pool "
        f"does not keep up: make generation faster, or give it processes the trainer pool can spare{ahead}"
    )
    return rule.finding(message, evidence, overrides)


def async_train_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """The rollouter of an asynchronous run waits (its queue full, its staleness budget spent) while the trainer
    hardly does: the trainer pool sets the pace. The update's own speed knobs first, then a process moved to the
    trainer pool (as :func:`async_rollout_bound`). Where the rollouter waits mostly for weights, or the trainer's
    sync takes as long as the rest of its work, the pace is the sync's (:func:`async_sync_bound`), not this rule's."""
    medians = _pipeline(report)
    idle = medians.get("fully_async/rollouter/idle_ratio")
    trainer_idle = medians.get("fully_async/trainer/idle_ratio", 0.0)
    if idle is None or idle < rule.thresholds["idle"] or trainer_idle >= rule.thresholds["trainer_idle"]:
        return None
    waits = {k.rsplit("/", 1)[1]: v for k, v in medians.items() if k.startswith("fully_async/rollouter/wait_s/")}
    evidence = {"rollouter_idle_ratio": idle, "trainer_idle_ratio": trainer_idle}
    evidence |= {f"rollouter_wait_s/{reason}": seconds for reason, seconds in waits.items()}
    if waits and waits.get("weights", 0.0) >= max(waits.values()):
        return None  # its waits are for weights: the sync rule's
    if _sync_outweighs_the_update(report, trainer_idle):
        return None  # the trainer's pace is its sync's: the sync rule's (a full queue through a sync reads queue_full)
    why = (
        " (" + ", ".join(f"{reason} {seconds:.3g} s" for reason, seconds in sorted(waits.items())) + " a window)"
        if waits
        else " (verl's ratio: it counts from the rollouter's last pause, verl #6693; read it as a hint)"
    )
    phases = [p for p in report.breakdown.phases if p.group == "training"] if report.breakdown else []
    heaviest = max(phases, key=lambda p: p.median_s).phase if phases else "update_actor"
    message = (
        f"async-train-bound: the rollouter is idle {_pct(idle)} of each version's time{why} while the trainer waits "
        f"{_pct(trainer_idle)} of its step; the trainer pool sets the pace: make the update faster ({heaviest} the "
        "heaviest of its passes), or give it processes the rollout pool can spare"
    )
    overrides = _training_speedups(run, heaviest, evidence) + _move_processes(run, "trainer")
    return rule.finding(message, evidence, overrides)


def _sync_phase(report: Report) -> Optional[PhaseStat]:
    """The trainer's ``sync_rollout_weights`` phase (``timing_s/sync_rollout_weights``), where it logged one."""
    phases = report.breakdown.phases if report.breakdown else []
    return next((p for p in phases if p.phase == "sync_rollout_weights"), None)


def _sync_outweighs_the_update(report: Report, trainer_idle: float) -> bool:
    """The trainer spends at least as long publishing its weights (its sync phase's median) as on the rest of its
    busy time, ``step * (1 - idle)`` (the median step, the trainer's idle ratio)."""
    sync = _sync_phase(report)
    if sync is None or report.breakdown is None:
        return False
    busy = report.breakdown.step_median_s * (1 - trainer_idle)
    return sync.median_s > 0 and sync.median_s >= busy - sync.median_s


def async_sync_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """Weight syncs take a large share: the rollouter waits for weights most of its idle time, or the trainer's
    ``timing_s/sync_rollout_weights`` is a large share of its step."""
    medians = _pipeline(report)
    version_time = medians.get("fully_async/rollouter/version_time")
    weights = medians.get("fully_async/rollouter/wait_s/weights")
    sync = _sync_phase(report)
    rollouter_share = weights / version_time if weights is not None and version_time else 0.0
    trainer_share = sync.share if sync is not None else 0.0
    if max(rollouter_share, trainer_share) < rule.thresholds["share"]:
        return None
    evidence = {"rollouter_waits_for_weights_share": rollouter_share, "trainer_sync_share": trainer_share}
    every = _int(run, f"{ASYNC}.trigger_parameter_sync_step", 1)
    overrides = [f"{ASYNC}.trigger_parameter_sync_step={2 * every}"]
    if run.setting(f"{ASYNC}.partial_rollout") is False:
        overrides.append(f"{ASYNC}.partial_rollout=True")
    message = (
        f"async-sync-bound: weight syncs take {_pct(max(rollouter_share, trainer_share))} of "
        + ("the rollouter's time" if rollouter_share >= trainer_share else "the trainer's step")
        + "; sync less often (staler samples: it changes what is learned), and let samples in flight pause for a "
        "sync rather than finish first (partial rollouts)"
    )
    return rule.finding(message, evidence, overrides)


def async_staleness_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    """The staleness budget drops a large share of what the rollouter generated: generation spent on nothing."""
    records = run.metrics.records
    dropped = _last_value(records, "fully_async/count/dropped_stale_samples")
    generated = _last_value(records, "fully_async/count/total_generated_samples")
    if dropped is None or not generated or dropped / generated < rule.thresholds["dropped"]:
        return None
    share = dropped / generated
    evidence = {"dropped_share": share, "dropped": dropped, "generated": generated}
    overrides = []
    staleness = run.setting(f"{ASYNC}.staleness_threshold")
    if isinstance(staleness, (int, float)):
        overrides.append(f"{ASYNC}.staleness_threshold={staleness + 0.5:g}")
    if run.setting(f"{ASYNC}.partial_rollout") is False:
        overrides.append(f"{ASYNC}.partial_rollout=True")
    message = (
        f"async-staleness-bound: {_pct(share)} of the samples generated ({dropped:.0f} of {generated:.0f}) were "
        "dropped as too stale; allow older samples (it changes what is learned) or sync more often"
    )
    return rule.finding(message, evidence, overrides)


def _last_value(records: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return float(values[-1]) if values else None


RULES: list[Rule] = [
    Rule("rollout-bound", "Generation dominates the step", {"share": 0.6, "over": 1.75}, rollout_bound),
    Rule("training-bound", "Training passes dominate the step", {"share": 0.6, "over": 1.75}, training_bound),
    Rule("memory-bound", "Memory is near its limit (or ran out)", {"fraction": 0.9}, memory_bound, "memory"),
    Rule("memory-growth", "Memory grows step after step", {"kib_per_step": 64.0}, memory_growth, "memory"),
    Rule("straggler-bound", "One rank holds the others back", {"ratio": 1.25, "share": 0.05}, straggler_bound),
    Rule("overhead-bound", "Time outside the training work", {"idle": 0.25, "unaccounted": 0.2}, overhead_bound),
    Rule("gpu-idle", "The GPU waits for the host", {"idle": 0.5, "min_span_ms": 10.0}, gpu_idle),
    Rule(
        "communication-exposed",
        "Collectives not overlapped with compute",
        {"share": 0.1, "overlap": 0.3, "min_span_ms": 10.0},
        communication_exposed,
    ),
    Rule(
        "engine-queue-bound",
        "Requests wait for the engine",
        {"queue_of_ttft": 0.5, "rollout_share": 0.25},
        engine_queue_bound,
    ),
    Rule("engine-preempting", "The engine preempts requests", {"preemptions": 1.0}, engine_preempting),
    Rule("tool-bound", "The rollout waits on tool calls", {"tool_wait": 0.5, "rollout_share": 0.25}, tool_bound),
    Rule("async-rollout-bound", "The async trainer waits for samples", {"idle": 0.3}, async_rollout_bound),
    Rule(
        "async-train-bound",
        "The async rollouter waits for the trainer",
        {"idle": 0.3, "trainer_idle": 0.1},
        async_train_bound,
    ),
    Rule("async-sync-bound", "Weight syncs hold the pipeline", {"share": 0.25}, async_sync_bound),
    Rule("async-staleness-bound", "Samples are dropped as stale", {"dropped": 0.1}, async_staleness_bound),
]
"""Every rule the diagnosis applies, in order."""


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to :data:`RULES` (replacing one of the same name)."""
    RULES[:] = [r for r in RULES if r.name != rule.name] + [rule]
    return rule


def diagnose(report: Report, run: Run, options: ReportOptions) -> list[Finding]:
    """The findings of every rule that fires, in rule order."""
    device = device_kind(report)
    findings = []
    for rule in RULES:
        found = rule.check(rule, report, run, options)
        if found is not None:
            findings.append(_offered(found, rule, device))
    return findings
