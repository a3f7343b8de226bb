"""The diagnosis: rules, as data in one place, that classify a run from its report and name the overrides to try.

Each :class:`Rule` has a name, a title, its thresholds and a check that reads the
:class:`~rlprof.analysis.model.Report` (and the run's saved config, for the current values of the knobs) and
returns a :class:`Finding` with the evidence numbers and the exact overrides, or None. The advice follows the seed's
tuning table (rollout slow -> raise ``max_num_batched_tokens``; training slow -> adjust
``ppo_micro_batch_size_per_gpu``; memory-limited -> ``use_dynamic_bsz``; OOM -> entropy chunking/checkpointing,
gradient checkpointing) and the trainer's knobs (docs/performance_tuning.md). Add a rule with :func:`register_rule`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.analysis.model import Finding, Report, ReportOptions
from rlprof.analysis.run import Run

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"


@dataclass(frozen=True)
class Rule:
    name: str
    title: str
    thresholds: dict[str, float]
    check: Callable[[Rule, Report, Run, ReportOptions], Optional[Finding]]
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def finding(self, message: str, evidence: dict[str, float], overrides: list[str]) -> Finding:
        return Finding(self.name, self.title, message, {k: round(v, 4) for k, v in evidence.items()}, overrides)


def _int(run: Run, key: str, default: int) -> int:
    value = run.setting(key, default)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _dominant(share: float, other: float, rule: Rule) -> bool:
    """A group dominates the step: at least ``share`` of it and ``over`` times the other group's share."""
    return share >= rule.thresholds["share"] and share >= rule.thresholds["over"] * other


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


# --------------------------------------------------------------------------------------------- the rules


def rollout_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    share = b.split.get("rollout", 0.0) if b else 0.0
    if b is None or not _dominant(share, b.split.get("training", 0.0), rule):
        return None
    gen = next((p for p in b.phases if p.phase == "gen"), None)
    evidence = {"rollout_share": share, **({"gen_median_s": gen.median_s} if gen else {})}
    if run.setting(f"{ROLLOUT}.name") == "vllm":
        tokens = _int(run, f"{ROLLOUT}.max_num_batched_tokens", 8192)
        overrides = [f"{ROLLOUT}.max_num_batched_tokens={2 * tokens}"]
        utilization = run.setting(f"{ROLLOUT}.gpu_memory_utilization", 0.5)
        if isinstance(utilization, (int, float)) and utilization < 0.85:
            overrides.append(f"{ROLLOUT}.gpu_memory_utilization={min(0.9, round(utilization + 0.2, 2))}")
    else:
        chunk = _int(run, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", 64)
        overrides = [f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu={2 * chunk}"]
    message = (
        f"rollout-bound: generation takes {_pct(share)} of the step"
        + (f" (gen {gen.median_s:.3g} s median)" if gen else "")
        + "; make generation faster first"
    )
    return rule.finding(message, evidence, overrides)


def training_bound(rule: Rule, report: Report, run: Run, options: ReportOptions) -> Optional[Finding]:
    b = report.breakdown
    share = b.split.get("training", 0.0) if b else 0.0
    if b is None or not _dominant(share, b.split.get("rollout", 0.0), rule):
        return None
    heaviest = max((p for p in b.phases if p.group == "training"), key=lambda p: p.median_s)
    evidence = {"training_share": share, f"{heaviest.phase}_share": heaviest.share}
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
    if heaviest.phase in ("old_log_prob", "ref"):
        key = (
            f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"
            if heaviest.phase == "old_log_prob"
            else "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
        )
        overrides.insert(0, f"{key}={2 * _int(run, key, 64)}")
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
    if memory.oom:
        top = memory.oom[0]
        culprit = next(iter(top.by_tag), "")
        message = (
            f"out of memory: an OOM snapshot was written ({top.peak_bytes / 2**30:.2f} GiB live at the peak"
            + (f", most in {culprit}" if culprit else "")
            + "); lower the memory per micro-batch"
        )
        return rule.finding(message, {"oom_peak_gb": top.peak_bytes / 2**30}, overrides)
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


RULES: list[Rule] = [
    Rule("rollout-bound", "Generation dominates the step", {"share": 0.6, "over": 1.75}, rollout_bound),
    Rule("training-bound", "Training passes dominate the step", {"share": 0.6, "over": 1.75}, training_bound),
    Rule("memory-bound", "Memory is near its limit (or ran out)", {"fraction": 0.9}, memory_bound),
    Rule("straggler-bound", "One rank holds the others back", {"ratio": 1.25, "share": 0.05}, straggler_bound),
    Rule("overhead-bound", "Time outside the training work", {"idle": 0.25, "unaccounted": 0.2}, overhead_bound),
]
"""Every rule the diagnosis applies, in order."""


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to :data:`RULES` (replacing one of the same name)."""
    RULES[:] = [r for r in RULES if r.name != rule.name] + [rule]
    return rule


def diagnose(report: Report, run: Run, options: ReportOptions) -> list[Finding]:
    """The findings of every rule that fires, in rule order."""
    findings = []
    for rule in RULES:
        found = rule.check(rule, report, run, options)
        if found is not None:
            findings.append(found)
    return findings
