"""The final check of a search: base and best run side by side (interleaved) for more steps, the speed-up with its
noise interval, and the first steps' learning metrics equal within the equivalence tolerance (the same math)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rlprof.analysis.compare import Interval, bootstrap_ratio
from rlprof_train.tune.space import as_overrides
from rlprof_train.tune.trial import Launch, Measurement, Trial, run_once

RTOL, ATOL = 1e-4, 1e-6
"""The equivalence tolerance: ``tests/rlprof_train/test_knobs.py``'s per-operation tolerance (rtol 1e-4, atol of
1e-6), applied to the first steps' metrics of two whole runs (measured differences between knob settings: below
1e-8)."""
COMPARED_STEPS = 3


@dataclass
class Verification:
    base: list[Measurement] = field(default_factory=list)
    best: list[Measurement] = field(default_factory=list)
    speedup: Interval | None = None
    """median step time of the base / of the best, with its 95% bootstrap interval."""
    mismatches: list[str] = field(default_factory=list)
    """First-step metrics that differ beyond the tolerance (``step 2 actor/pg_loss: base 0.1, best 0.2``)."""
    compared: int = 0
    """How many values were compared."""
    failed: str = ""

    @property
    def same_math(self) -> bool:
        return not self.failed and self.compared > 0 and not self.mismatches


def verify(
    launch: Launch, base: Trial, best: Trial, warmup: int, steps: int, repeats: int, progress: Callable[[str], None]
) -> Verification:
    result = Verification()
    for repeat in range(1, repeats + 1):
        for trial, runs in ((base, result.base), (best, result.best)):
            witness = Trial(f"verify-{trial.name}", trial.changes)
            progress(f"verification run {repeat}/{repeats} of {trial.name}")
            folder = launch.root / "verify" / f"{trial.name}-{repeat}"
            run = run_once(launch, witness, as_overrides(trial.changes), folder, warmup, steps)
            if run is None:
                result.failed = f"{trial.name}: {witness.reason}"
                return result
            runs.append(run)
    base_times = [t for run in result.base for t in run.step_times]
    best_times = [t for run in result.best for t in run.step_times]
    ratio = bootstrap_ratio(best_times, base_times)  # median(base) / median(best): the speed-up
    result.speedup = ratio
    compare_first_steps(result)
    return result


def compare_first_steps(result: Verification) -> None:
    """The first :data:`COMPARED_STEPS` steps of the first base and best runs, every learning metric both logged."""
    for index, (a, b) in enumerate(zip(result.base[0].first_steps, result.best[0].first_steps, strict=False)):
        for key in sorted(set(a) & set(b)):
            result.compared += 1
            if not math.isclose(a[key], b[key], rel_tol=RTOL, abs_tol=ATOL):
                result.mismatches.append(f"step {index + 1} {key}: base {a[key]:.9g}, best {b[key]:.9g}")
