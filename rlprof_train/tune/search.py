"""The budgeted search: diagnosis first, then successive halving within each knob group, then a noise-aware duel
with the best configuration so far.

1. The base trial runs; ``rlprof report``'s diagnosis of it (rollout-, training- or memory-bound) orders the knob
   groups (:data:`~rlprof_train.tune.space.GROUP_ORDER`).
2. Each group's candidates (one knob changed on top of the best configuration so far) run a short trial each; the
   faster half runs again, until one is left (successive halving). Trials over the memory limit, or failed, drop out.
3. The survivor and the best so far run again, interleaved; the pooled step times decide through a bootstrap
   interval of the ratio of medians: the survivor replaces the best only if it is faster beyond noise, otherwise the
   two are recorded as indistinguishable.
4. Groups are searched in order, and again from the first while budget remains and the last pass changed something;
   the time a final verification needs is held back from the start.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.analysis.compare import Interval, bootstrap_ratio
from rlprof_train.config.schema import TrainerConfig
from rlprof_train.tune.space import Knob, as_overrides, ordered_groups
from rlprof_train.tune.trial import OK, OVER_MEMORY, Launch, Trial, run_once

Progress = Callable[[str], None]


@dataclass
class Budget:
    seconds: float
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def left(self) -> float:
        return self.seconds - self.elapsed


@dataclass
class SearchSettings:
    warmup_steps: int
    trial_steps: int
    memory_limit_gb: Optional[float]
    verify_runs: int
    """Runs the final verification makes (base and best, interleaved): their time is held back from the search."""
    verify_steps: int
    """Measured steps per verification run."""
    trial_timeout_s: Optional[float] = None
    """A run taking longer fails; default 5x the base's first run, at least 120 s."""
    max_trials: Optional[int] = None
    """Configurations measured besides the base, at most (None: as many as the budget allows)."""


@dataclass
class SearchResult:
    trials: list[Trial]
    base: Trial
    best: Trial
    findings: list[str]
    groups: tuple[str, ...]
    stopped: str
    """Why the search ended: every group searched, or the budget."""


class Search:
    def __init__(
        self,
        cfg: TrainerConfig,
        world: int,
        knobs: list[Knob],
        launch: Launch,
        settings: SearchSettings,
        budget: Budget,
        progress: Progress,
    ) -> None:
        self.cfg, self.world, self.knobs = cfg, world, knobs
        self.launch, self.settings, self.budget, self.progress = launch, settings, budget, progress
        self.trials: list[Trial] = []
        self._runs = 0
        self.findings: list[str] = []
        self.groups: tuple[str, ...] = ()
        self.best: Optional[Trial] = None
        """The best configuration so far (what an interrupted search reports)."""

    def partial(self, stopped: str) -> Optional[SearchResult]:
        """What the search found before it was stopped, or None when not even the base was measured."""
        if not self.trials or not self.trials[0].runs:
            return None
        return SearchResult(
            self.trials, self.trials[0], self.best or self.trials[0], self.findings, self.groups, stopped
        )

    # ------------------------------------------------------------------------------------------------ running

    def measure(self, trial: Trial, steps: Optional[int] = None) -> bool:
        """One more run of ``trial``; False when it failed or went over the memory limit."""
        if trial.status != OK:
            return False
        self._runs += 1
        folder = self.launch.root / "trials" / f"{trial.name}-run{len(trial.runs) + 1}"
        self._say(f"trial {trial.name} (run {len(trial.runs) + 1}): {' '.join(as_overrides(trial.changes)) or 'base'}")
        run = run_once(
            self.launch,
            trial,
            as_overrides(trial.changes),
            folder,
            self.settings.warmup_steps,
            steps or self.settings.trial_steps,
        )
        if run is None:
            self._say(f"  {trial.name} failed: {trial.reason}")
            return False
        trial.runs.append(run)
        limit = self.settings.memory_limit_gb
        if limit is not None and run.peak_memory_gb is not None and run.peak_memory_gb > limit:
            trial.status, trial.reason = OVER_MEMORY, f"peak {run.peak_memory_gb:.2f} GB > limit {limit:.2f} GB"
            self._say(f"  {trial.name}: {trial.reason}")
            return False
        self._say(f"  {trial.name}: median step {trial.median_step_s * 1000:.0f} ms")
        return True

    def affordable(self, runs: int = 1) -> bool:
        """Whether ``runs`` more trial runs fit in the budget, the verification's runs held back."""
        settings = self.settings
        reserve = settings.verify_runs * self.expected_run_s(settings.warmup_steps + settings.verify_steps)
        return self.budget.left - reserve >= runs * self.expected_run_s(settings.warmup_steps + settings.trial_steps)

    def room_for_another(self) -> bool:
        """Whether one more configuration may be measured (``max_trials``; a failed one counts)."""
        limit = self.settings.max_trials
        return limit is None or sum(1 for t in self.trials[1:] if t.runs or t.status != OK) < limit

    def expected_run_s(self, steps: int) -> float:
        """The wall time of a run of ``steps`` steps: the quickest start-up so far (the first run can include
        one-off work, such as building DeepSpeed's ops) plus ``steps`` median steps of all runs so far."""
        runs = [run for trial in self.trials for run in trial.runs]
        if not runs:
            return 0.0
        step_s = statistics.median(t for run in runs for t in run.step_times)
        return min(run.startup_s for run in runs) + steps * step_s

    def _say(self, line: str) -> None:
        best = min((t for t in self.trials if t.usable), key=lambda t: t.median_step_s, default=None)
        so_far = f"best so far {best.name} {best.median_step_s * 1000:.0f} ms/step" if best else "no result yet"
        self.progress(
            f"[{self.budget.elapsed / 60:4.1f}/{self.budget.seconds / 60:.1f} min, {self._runs} runs, {so_far}] {line}"
        )

    # ------------------------------------------------------------------------------------------------ search

    def run(self) -> SearchResult:
        base = Trial("base", {})
        self.trials.append(base)
        if not self.measure(base) and base.status != OVER_MEMORY:
            if self.budget.left <= 0:  # its first run may take the whole budget, and took it
                steps = self.settings.warmup_steps + self.settings.trial_steps
                raise RuntimeError(
                    f"the budget ran out before the base configuration finished its first run ({steps} steps, "
                    f"stopped after {self.budget.elapsed:.0f} s): give a larger tune.budget_minutes "
                    f"(now {self.budget.seconds / 60:g}; see {self.launch.root}/trials)"
                )
            raise RuntimeError(f"the base configuration does not run: {base.reason} (see {self.launch.root}/trials)")
        timeout = self.settings.trial_timeout_s or max(120.0, 5 * base.runs[0].wall_s)
        self.launch = dataclasses.replace(self.launch, timeout_s=timeout)
        self.best = base
        findings = self.findings = self.diagnose(base)
        groups = self.groups = ordered_groups(findings)
        self._say(
            f"diagnosis of the base: {', '.join(findings) or 'no rule fired'}; groups in order: {', '.join(groups)}"
        )
        best, stopped = base, "every knob group was searched"
        changed = True
        while changed:
            changed = False
            for group in groups:
                candidates = self.candidates(best, group)
                if not candidates:
                    continue
                if not self.affordable():
                    stopped = "the budget ran out"
                    return SearchResult(self.trials, base, best, findings, groups, stopped)
                winner = self.halve(candidates)
                if winner is not None and self.duel(best, winner):
                    best, changed = winner, True
                    self.best = best
        if any(not t.runs and t.status == OK for t in self.trials[1:]):  # candidates left unmeasured: why
            stopped = (
                f"tune.max_trials={self.settings.max_trials} configurations were measured"
                if not self.room_for_another()
                else "the budget ran out"
            )
        return SearchResult(self.trials, base, best, findings, groups, stopped)

    def diagnose(self, base: Trial) -> list[str]:
        """The rules ``rlprof report`` fires on the base trial's run (and memory-bound near the limit)."""
        from rlprof.analysis.report import build_report
        from rlprof.analysis.report_model import ReportOptions
        from rlprof.analysis.run import find_run

        folder = self.launch.root / "trials" / f"{base.name}-run1" / "logs"
        report = build_report(find_run([folder]), ReportOptions(memory_limit_gb=self.settings.memory_limit_gb))
        return [finding.rule for finding in report.findings]

    def candidates(self, best: Trial, group: str) -> list[Trial]:
        """One trial per candidate value of each knob of ``group``, on top of ``best`` (no configuration twice)."""
        tried = {tuple(sorted(t.changes.items())) for t in self.trials}
        out: list[Trial] = []
        for knob in self.knobs:
            if knob.group != group:
                continue
            for change in knob.candidates(self.cfg, self.world if group == "pools" else self.trainer_processes(best)):
                changes = {**best.changes, **change}
                changes = {k: v for k, v in changes.items() if _base_value(self.cfg, k) != v}
                key = tuple(sorted(changes.items()))
                if key in tried or not changes:
                    continue
                tried.add(key)
                out.append(Trial(f"t{len(self.trials) + len(out):02d}", changes))
        self.trials.extend(out)
        return out

    def trainer_processes(self, trial: Trial) -> int:
        """The processes that train in ``trial``: the launch's, less the rollout pool's where it has one."""
        return self.world - int(trial.changes.get("rollout.n_gpus_per_node", self.cfg.rollout.n_gpus_per_node))

    def halve(self, candidates: list[Trial]) -> Optional[Trial]:
        """Successive halving: run all, keep the faster half, run those again, until one is left."""
        alive = [t for t in candidates if self.affordable() and self.room_for_another() and self.measure(t)]
        while len(alive) > 1:
            alive.sort(key=lambda t: t.median_step_s)
            alive = alive[: math.ceil(len(alive) / 2)]
            if len(alive) == 1 or not self.affordable(len(alive)):
                break
            alive = [t for t in alive if self.measure(t)]
        return min(alive, key=lambda t: t.median_step_s) if alive else None

    def duel(self, best: Trial, challenger: Trial) -> bool:
        """Interleave one more run of each, then compare pooled step times: True if ``challenger`` is faster beyond
        noise (its interval of median ratio below 1)."""
        if not best.usable:  # the base itself is over the memory limit: anything that fits is better
            if challenger.usable:
                challenger.note = f"fits the memory limit ({best.name}: {best.reason})"
                self._say(f"  {challenger.name} is the new best: {challenger.note}")
            return challenger.usable
        if self.affordable(2):
            for trial in (best, challenger):
                self.measure(trial)
        if not challenger.usable or not best.usable:
            return False
        interval = speed_ratio(best, challenger)
        if interval.high < 1:
            challenger.note = f"{1 / interval.value:.2f}x faster than {best.name} ({_span(interval)})"
            self._say(f"  {challenger.name} is the new best: {challenger.note}")
            return True
        challenger.note = (
            f"indistinguishable from {best.name} ({_span(interval)})"
            if interval.low <= 1 <= interval.high
            else f"slower than {best.name} ({_span(interval)})"
        )
        self._say(f"  {challenger.name}: {challenger.note}")
        return False


def speed_ratio(reference: Trial, other: Trial) -> Interval:
    """median step time of ``other`` / of ``reference``, with its 95% bootstrap interval."""
    return bootstrap_ratio(reference.step_times, other.step_times)


def _span(interval: Interval) -> str:
    return f"step time {interval.value:.2f}x, 95% interval {interval.low:.2f}-{interval.high:.2f}"


def _base_value(cfg: TrainerConfig, key: str) -> Any:
    """The base config's value of ``key``; None for a launch key that the config does not hold
    (``trainer.n_gpus_per_node``: checked against the launch, never stored)."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node
