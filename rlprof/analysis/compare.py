"""``rlprof compare``: two or more runs side by side — what differs in their configs, how their learning curves
compare, and which phases got faster or slower, with an interval that says when a difference is only noise.

Speed verdicts are bootstrap intervals of the ratio of medians (run B / run A) over each run's steps (warm-up
excluded): ``update_actor 0.71x (0.66-0.76)``, or "no significant difference" when the interval holds 1. Learning
verdicts compare the last steps' mean of each curve the same way (a difference, with its interval).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.analysis.run import Run
from rlprof.analysis.step_series import series, training_records, warmup_steps
from rlprof.metrics.pipeline import PIPELINE_KEYS

SCHEMA = "rlprof-compare/2"
LEARNING_KEYS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "actor/kl_loss",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/entropy",
    "response_length/mean",
)
"""Learning curves compared (and every ``val-core/*`` metric the runs logged)."""
HIGHER_IS_BETTER = ("critic/score/mean", "critic/rewards/mean", "val-core/")
LOWER_IS_BETTER = ("critic/vf_loss",)
"""Curves with a "best" value; the others (KL, entropy, lengths, the policy loss) have no better direction."""
SPEED_KEYS = ("throughput/tokens_per_sec", "throughput/samples_per_sec", "perf/throughput")
MEMORY_KEYS = ("perf/max_memory_reserved_gb", "perf/max_memory_allocated_gb", "perf/process_rss_gb")
IDENTITY_PREFIXES = (
    "trainer.log_dir",
    "trainer.default_local_dir",
    "trainer.experiment_name",
    "trainer.project_name",
    "global_profiler.save_path",
)
"""Keys that name or place a run rather than change what it does: listed apart in the config diff."""
RESAMPLES = 2000
LAST_FRACTION = 0.1
LAST_MIN_STEPS = 5
"""A curve's final value is the mean of its last tenth of steps, and of at least its last 5."""


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    @property
    def significant_ratio(self) -> bool:
        return not (self.low <= 1.0 <= self.high)

    @property
    def significant_difference(self) -> bool:
        return not (self.low <= 0.0 <= self.high)


@dataclass(frozen=True)
class ConfigDiff:
    key: str
    values: list[Any]


@dataclass(frozen=True)
class Curve:
    metric: str
    points: list[list[Optional[float]]]
    """One series per run, aligned on ``steps`` (None where a run has no value)."""
    steps: list[int]
    final: list[Optional[float]]
    """Mean of each run's last tenth of steps (at least its last 5)."""
    best: list[Optional[float]]
    """Best smoothed value of each run (max for scores and rewards, min for the value loss; None otherwise)."""
    target: Optional[float]
    """The ``--target`` given for this metric."""
    reached: list[Optional[int]]
    """First step where the smoothed curve reaches the target (from below when it starts below it, else from
    above)."""
    versus_first: list[Optional[Interval]]
    """Difference of each run's final value to the first run's, with its bootstrap interval."""


@dataclass(frozen=True)
class SpeedVerdict:
    metric: str
    medians: list[Optional[float]]
    versus_first: list[Optional[Interval]]
    """Ratio of each run's median to the first run's (1.0 for the first), with its bootstrap interval."""


@dataclass(frozen=True)
class Comparison:
    schema: str
    runs: list[str]
    config_diff: list[ConfigDiff]
    identity_diff: list[ConfigDiff]
    curves: list[Curve]
    speed: list[SpeedVerdict]
    memory: list[SpeedVerdict]
    missing: list[str]
    """Metrics one run has and another lacks, and runs without a saved config."""
    step_counts: list[int] = field(default_factory=list)
    """How many training steps each run logged."""
    processes: list[Optional[dict[str, int]]] = field(default_factory=list)
    """Each run's processes, ``{"trainer": T, "rollout": R}`` (``R`` > 0: an asynchronous run, its rollout in a pool
    of its own), from its ``run.json``; None where it has none."""
    pipeline: list[SpeedVerdict] = field(default_factory=list)
    """An asynchronous run's pipeline metrics (:data:`~rlprof.metrics.pipeline.PIPELINE_KEYS`, who waited for whom
    and how stale), median over steps, ratios to the first run's where it has them."""
    notes: list[str] = field(default_factory=list)
    """What makes the runs unequal beyond their configs (their processes)."""


# --------------------------------------------------------------------------------------------- statistics


def bootstrap_ratio(a: Sequence[float], b: Sequence[float], seed: int = 0) -> Interval:
    """median(b) / median(a) with a 95% percentile-bootstrap interval."""
    rng = random.Random(seed)
    point = statistics.median(b) / statistics.median(a)
    draws = []
    for _ in range(RESAMPLES):
        resampled_a = statistics.median(rng.choices(a, k=len(a)))
        resampled_b = statistics.median(rng.choices(b, k=len(b)))
        if resampled_a > 0:
            draws.append(resampled_b / resampled_a)
    draws.sort()
    return Interval(point, draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1])


def bootstrap_difference(a: Sequence[float], b: Sequence[float], seed: int = 0) -> Interval:
    """mean(b) - mean(a) with a 95% percentile-bootstrap interval."""
    rng = random.Random(seed)
    point = statistics.fmean(b) - statistics.fmean(a)
    draws = sorted(
        statistics.fmean(rng.choices(b, k=len(b))) - statistics.fmean(rng.choices(a, k=len(a)))
        for _ in range(RESAMPLES)
    )
    return Interval(point, draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1])


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# --------------------------------------------------------------------------------------------- the comparison


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def compare(runs: list[Run], targets: Optional[dict[str, float]] = None, smooth_window: int = 10) -> Comparison:
    """Compare ``runs`` (the first is the reference of every ratio and difference)."""
    targets = targets or {}
    missing: list[str] = []
    records = []
    for run in runs:
        rows = training_records(run.metrics.records)
        if not rows:
            missing.append(f"{run.name}: no step metrics (metrics.jsonl)")
        records.append(rows)
    config_diff, identity_diff = _config_diff(runs, missing)
    validation = sorted({k for rows in records for r in rows for k in r if k.startswith("val-core/")})
    curves = [
        _curve(key, records, targets.get(key), smooth_window)
        for key in (*LEARNING_KEYS, *validation)
        if any(series(rows, key) for rows in records)
    ]
    unknown = sorted(set(targets) - {curve.metric for curve in curves})
    if unknown:
        missing.append(f"--target {', '.join(unknown)}: no run logged it")
    steady = [[r for r in rows if r["step"] not in set(warmup_steps(rows))] for rows in records]
    phases = sorted(
        {k for rows in steady for r in rows for k in r if k.startswith("timing_s/")},
        key=lambda k: (k != "timing_s/step", k),
    )
    speed = [
        _speed(key, steady)
        for key in (
            *phases,
            *SPEED_KEYS,
            *sorted({k for rows in steady for r in rows for k in r if k.startswith("perf/mfu/")}),
        )
        if any(series(rows, key) for rows in steady)
    ]
    memory = [_speed(key, steady) for key in MEMORY_KEYS if any(series(rows, key) for rows in steady)]
    pipeline = [_speed(key, steady) for key in PIPELINE_KEYS if any(series(rows, key) for rows in steady)]
    processes = [_processes(run) for run in runs]
    notes = []
    totals = {run.name: p["trainer"] + p["rollout"] for run, p in zip(runs, processes, strict=True) if p is not None}
    if len(set(totals.values())) > 1:
        notes.append(
            "the runs ran on different numbers of processes ("
            + ", ".join(f"{name}: {total}" for name, total in totals.items())
            + "): their speed compares unequal resources"
        )
    for key in sorted(
        {
            k
            for rows in records
            for r in rows
            for k in r
            if k in LEARNING_KEYS or k.startswith(("timing_s/", "perf/mfu/", "val-core/"))
        }
    ):
        lacking = [run.name for run, rows in zip(runs, records, strict=True) if rows and not series(rows, key)]
        if lacking:
            missing.append(f"{key}: not logged by {', '.join(lacking)}")
    return Comparison(
        SCHEMA,
        [run.name for run in runs],
        config_diff,
        identity_diff,
        curves,
        speed,
        memory,
        missing,
        [len(rows) for rows in records],
        processes,
        pipeline,
        notes,
    )


def _processes(run: Run) -> Optional[dict[str, int]]:
    """The run's processes as its ``run.json`` says, its whole numbers only (the file comes from outside; a run
    recorded before the rollout pool: its world size, all training)."""
    record = run.record or {}
    given = record.get("processes")
    if isinstance(given, dict):
        counts = {side: n for side, n in given.items() if isinstance(n, int) and not isinstance(n, bool)}
        if {"trainer", "rollout"} <= set(counts):
            return counts
    if isinstance(record.get("world_size"), int):
        return {"trainer": record["world_size"], "rollout": 0}
    return None


def _config_diff(runs: list[Run], missing: list[str]) -> tuple[list[ConfigDiff], list[ConfigDiff]]:
    flats = []
    for run in runs:
        if run.config is None:
            missing.append(f"{run.name}: no saved config (config.yaml), so no config diff for it")
        flats.append(flatten(run.config or {}))
    configured = [f for f, run in zip(flats, runs, strict=True) if run.config is not None]
    if len(configured) < 2:
        return [], []
    keys = sorted({k for flat in configured for k in flat})
    settings: list[ConfigDiff] = []
    identity: list[ConfigDiff] = []
    for key in keys:
        values = [flat.get(key) for flat in flats]
        if len({repr(v) for v, run in zip(values, runs, strict=True) if run.config is not None}) > 1:
            (identity if key.startswith(IDENTITY_PREFIXES) else settings).append(ConfigDiff(key, values))
    return settings, identity


def _curve(key: str, records: list[list[dict[str, Any]]], target: Optional[float], window: int) -> Curve:
    per_run = [dict(series(rows, key)) for rows in records]
    steps = sorted({s for values in per_run for s in values})
    finals: list[Optional[float]] = []
    bests: list[Optional[float]] = []
    reached: list[Optional[int]] = []
    lasts: list[list[float]] = []
    for values in per_run:
        ordered = [values[s] for s in sorted(values)]
        last = ordered[-max(LAST_MIN_STEPS, math.ceil(LAST_FRACTION * len(ordered))) :]
        lasts.append(last)
        finals.append(statistics.fmean(last) if last else None)
        smoothed = smooth(ordered, window)
        bests.append(
            (max(smoothed) if key.startswith(HIGHER_IS_BETTER) else min(smoothed))
            if smoothed and key.startswith(HIGHER_IS_BETTER + LOWER_IS_BETTER)
            else None
        )
        reached.append(_first_reaching(sorted(values), smoothed, target) if target is not None else None)
    versus = [bootstrap_difference(lasts[0], last) if len(lasts[0]) > 1 and len(last) > 1 else None for last in lasts]
    points = [[values.get(s) for s in steps] for values in per_run]
    return Curve(key, points, steps, finals, bests, target, reached, versus)


def _first_reaching(steps: list[int], smoothed: list[float], target: float) -> Optional[int]:
    if not smoothed:
        return None
    rising = smoothed[0] < target
    for step, value in zip(steps, smoothed, strict=True):
        if (value >= target) if rising else (value <= target):
            return step
    return None


def _speed(key: str, records: list[list[dict[str, Any]]]) -> SpeedVerdict:
    values = [[v for _, v in series(rows, key)] for rows in records]
    medians = [statistics.median(v) if v else None for v in values]
    versus = [
        bootstrap_ratio(values[0], v) if values[0] and v and statistics.median(values[0]) > 0 else None for v in values
    ]
    return SpeedVerdict(key, medians, versus)


NOT_SIGNIFICANT = "n.s."
"""Prefix of a verdict whose 95% interval holds 1x (ratios) or 0 (differences): no significant difference."""


def verdict(interval: Optional[Interval], ratio: bool = True) -> str:
    """``0.71x (0.66-0.76)`` / ``+0.05 (+0.02 to +0.08)``, prefixed ``n.s.`` when the interval says the difference
    may be noise. Ratios get a third decimal when two would print a significant interval as ``1.00-1.00``."""
    if interval is None:
        return "-"
    if ratio:
        significant = interval.significant_ratio
        digits = 3 if significant and round(interval.low, 2) == round(interval.high, 2) else 2
        text = f"{interval.value:.{digits}f}x ({interval.low:.{digits}f}-{interval.high:.{digits}f})"
    else:
        significant = interval.significant_difference
        text = f"{interval.value:+.3g} ({interval.low:+.3g} to {interval.high:+.3g})"
    return text if significant else f"{NOT_SIGNIFICANT} {text}"
