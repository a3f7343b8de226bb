"""``python -m rlprof_train.tune [trainer overrides] tune.budget_minutes=10 ...`` (also ``rlprof-train tune``).

Searches the trainer's speed/memory knobs that leave the math unchanged (:mod:`rlprof_train.tune.space`) with short
trials of the real trainer, then verifies the best configuration against the base side by side. Writes to
``tune.dir`` (default ``outputs/tune/{time}``): ``results.md`` and ``results.json`` (every trial), ``best.yaml`` and
``best_command.txt`` (the overrides to paste), ``trials/*/logs`` and ``verify/*/logs`` (metrics of every run, for
``rlprof compare``).

Exit codes: 0 done (also when nothing beat the base, or nothing fits the memory limit: the output says so);
2 a configuration problem (one line, before any trial); 1 the base configuration itself fails to run.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from rlprof.typed_config import ConfigError, bounds, build
from rlprof_train.config.load import load
from rlprof_train.config.schema import TrainerMode
from rlprof_train.config.verl_compat import ONE_STEP_OFF_DEFAULTS
from rlprof_train.preflight import validate
from rlprof_train.tune.search import Budget, Search, SearchResult, SearchSettings, speed_ratio
from rlprof_train.tune.space import as_overrides, knobs_for
from rlprof_train.tune.trial import OVER_MEMORY, Launch, Trial, save
from rlprof_train.tune.verify import ATOL, RTOL, Verification, verify

MEMORY_MARGIN = 0.1
"""The default memory limit leaves this share of the device's (or host's) memory free."""


@dataclass
class TuneConfig:
    """The ``tune.*`` keys."""

    budget_minutes: float = field(default=10.0, metadata=bounds(gt=0))
    """Wall-clock budget of the whole search, the final verification included."""
    memory_limit_gb: Optional[float] = field(default=None, metadata=bounds(gt=0))
    """Peak memory a configuration may reach: CUDA reserved memory on GPU, process RSS on CPU. Null: the device's
    (on CPU the host's) memory less 10%."""
    space: Optional[list[str]] = None
    """Keys to search (default: every tunable key that applies to the config); other keys are refused."""
    warmup_steps: int = field(default=1, metadata=bounds(ge=0))
    """Steps each trial runs before measuring (allocations, caches)."""
    trial_steps: int = field(default=3, metadata=bounds(ge=2))
    """Measured steps per trial run."""
    verify_steps: int = field(default=6, metadata=bounds(ge=2))
    """Measured steps per verification run."""
    verify_repeats: int = field(default=2, metadata=bounds(ge=1))
    """Verification runs of base and best each, interleaved."""
    max_trials: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Configurations to measure besides the base, at most (null: as many as the budget allows)."""
    nproc_per_node: int = field(default=1, metadata=bounds(ge=1))
    """Processes per trial (each trial runs under torchrun when more than 1); the one-step-off trainer's are both
    pools'."""
    trainer: str = "sync"
    """The trainer the trials run: ``sync`` (``rlprof_train.main_ppo``) or ``one_step_off``
    (``rlprof_train.one_step_off_policy``, whose split between the pools is searched too). Not ``fully_async``: its
    samples depend on when each sync lands, so two runs of one config differ and no trial can be checked against
    the base."""
    trial_timeout_s: Optional[float] = field(default=None, metadata=bounds(gt=0))
    """A trial run taking longer fails (default: 5x the base's first run, at least 120 s)."""
    dir: Optional[str] = None
    """Where the results go (default ``outputs/tune/{time}``)."""


TRAINERS: dict[str, tuple[TrainerMode, str, tuple[str, ...]]] = {
    "sync": ("sync", "rlprof_train.main_ppo", ()),
    "one_step_off": ("one_step_off", "rlprof_train.one_step_off_policy", ONE_STEP_OFF_DEFAULTS),
}
"""``tune.trainer``: its mode, its module and the defaults that module puts before the command line."""


def parse(argv: list[str]) -> tuple[TuneConfig, list[str]]:
    """Split ``tune.*`` keys from the trainer's overrides."""
    tune_args = [a.removeprefix("tune.") for a in argv if a.startswith("tune.")]
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist(tune_args))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"tune: {' '.join(str(exc).split())}") from None
    tune = build(TuneConfig, data, "tune")
    if tune.trainer not in TRAINERS:
        why = (
            ": its samples depend on when each weight sync lands, so two runs of one config differ and a trial cannot "
            "be checked against the base"
            if tune.trainer == "fully_async"
            else ""
        )
        raise ConfigError(f"tune.trainer={tune.trainer!r} is not tuned{why}; allowed: {', '.join(TRAINERS)}")
    return tune, [a for a in argv if not a.startswith("tune.")]


def default_memory_limit_gb() -> float:
    import psutil
    import torch

    total = (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else psutil.virtual_memory().total
    )
    return total * (1 - MEMORY_MARGIN) / 1e9


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """tune was asked to stop (a signal): its trial is stopped and what it found is written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        tune, overrides = parse(argv)
        mode, module, defaults = TRAINERS[tune.trainer]
        cfg = load([*defaults, *overrides], tune.nproc_per_node, mode=mode).cfg
        validate(cfg, tune.nproc_per_node, mode)
        knobs = knobs_for(cfg, tune.space)
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    root = Path(tune.dir or Path("outputs") / "tune" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    limit = tune.memory_limit_gb or default_memory_limit_gb()
    budget = Budget(tune.budget_minutes * 60)
    launch = Launch(overrides, root, tune.nproc_per_node, tune.trial_timeout_s or budget.seconds, module)
    settings = SearchSettings(
        tune.warmup_steps,
        tune.trial_steps,
        limit,
        2 * tune.verify_repeats,
        tune.verify_steps,
        tune.trial_timeout_s,
        tune.max_trials,
    )

    def progress(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    progress(f"tuning {len(knobs)} knobs in {tune.budget_minutes:g} min, memory limit {limit:.2f} GB -> {root}")
    search = Search(cfg, tune.nproc_per_node, knobs, launch, settings, budget, progress)
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        result = search.run()
    except RuntimeError as exc:
        save(search.trials, root / "results.json", {"error": str(exc)})
        print(f"tune: {exc}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        for sig in STOP_SIGNALS:  # a second Ctrl-C must not cut the writing short
            signal.signal(sig, signal.SIG_IGN)
        partial = search.partial(f"interrupted by {stop.name}")
        if partial is None:
            save(search.trials, root / "results.json", {"stopped": f"interrupted by {stop.name}"})
        else:
            write_results(root, launch, partial, None, limit, budget)
        print(
            f"tune: interrupted by {stop.name} after {len(search.trials)} configurations; the trial running was "
            f"stopped; {'results so far' if partial else 'no result yet'} in {root}",
            file=sys.stderr,
        )
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    verification = None
    if result.best is not result.base and result.best.usable:
        verification = verify(
            search.launch, result.base, result.best, tune.warmup_steps, tune.verify_steps, tune.verify_repeats, progress
        )
    write_results(root, launch, result, verification, limit, budget)
    print((root / "results.md").read_text())
    return 0


# --------------------------------------------------------------------------------------------------- output


def ranked(result: SearchResult) -> list[Trial]:
    """Usable trials fastest first, then those over the memory limit, then failed ones."""
    return sorted(
        result.trials,
        key=lambda t: (not t.usable, t.status != OVER_MEMORY, t.median_step_s if t.usable else 0.0),
    )


def table_rows(result: SearchResult) -> list[list[str]]:
    rows = []
    for rank, trial in enumerate(ranked(result), start=1):
        if not trial.runs and trial.status == "ok":
            continue  # never ran (the budget ended first)
        vs_base = ""
        if trial.usable and result.base.usable and trial is not result.base:
            vs_base = f"{1 / speed_ratio(result.base, trial).value:.2f}x"
        rows.append(
            [
                str(rank),
                trial.name,
                " ".join(as_overrides(trial.changes)) or "(base)",
                f"{trial.median_step_s * 1000:.0f}" if trial.usable else "-",
                vs_base,
                f"{trial.tokens_per_s:.0f}" if trial.tokens_per_s else "-",
                f"{trial.peak_memory_gb:.2f}" if trial.peak_memory_gb is not None else "-",
                str(len(trial.runs)),
                trial.status if trial.status != "ok" else "ok",
                trial.reason or trial.note,
            ]
        )
    return rows


HEADER = ["#", "trial", "changes vs base", "median step ms", "speed vs base", "tokens/s", "peak GB", "runs"]
HEADER += ["status", "notes"]


def write_results(
    root: Path,
    launch: Launch,
    result: SearchResult,
    verification: Optional[Verification],
    limit: float,
    budget: Budget,
) -> None:
    best, overrides = result.best, launch.base
    best_overrides = as_overrides(best.changes)
    start = f"torchrun --nproc_per_node {launch.nproc} -m" if launch.nproc > 1 else "python -m"
    command = " ".join([start, launch.module, *_each_key_once([*overrides, *best_overrides])])
    yaml = OmegaConf.to_yaml(OmegaConf.from_dotlist(best_overrides)) if best_overrides else "{}\n"
    (root / "best.yaml").write_text(yaml)
    (root / "best_command.txt").write_text(command + "\n")
    lines = [
        "# rlprof_train.tune",
        "",
        f"- base: `{' '.join(overrides) or '(defaults)'}`",
        f"- diagnosis of the base: {', '.join(result.findings) or 'no rule fired'}; knob groups searched in the order "
        f"{', '.join(result.groups)}",
        f"- {len([t for t in result.trials if t.runs])} configurations, "
        f"{sum(len(t.runs) for t in result.trials)} trial runs in {budget.elapsed / 60:.1f} min ({result.stopped})",
        f"- memory limit: {limit:.2f} GB",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(result)),
        "",
    ]
    lines += _conclusion(result, verification, limit, command, yaml, root)
    (root / "results.md").write_text("\n".join(lines) + "\n")
    extra: dict[str, Any] = {
        "base_overrides": overrides,
        "best": best.name,
        "best_overrides": best_overrides,
        "memory_limit_gb": limit,
        "findings": result.findings,
        "stopped": result.stopped,
    }
    if verification is not None:
        extra["verification"] = {
            "speedup": verification.speedup.__dict__ if verification.speedup else None,
            "same_math": verification.same_math,
            "compared": verification.compared,
            "mismatches": verification.mismatches,
            "failed": verification.failed,
            "rtol": RTOL,
            "atol": ATOL,
        }
    save(result.trials, root / "results.json", extra)


def _each_key_once(overrides: list[str]) -> list[str]:
    """``key=value`` arguments with each key once, the last value kept, in first-seen order (the base's
    ``micro_batch=2`` and the best's ``=256`` used to both appear)."""
    last: dict[str, str] = {}
    for override in overrides:
        last[override.split("=", 1)[0] if "=" in override else override] = override
    return list(last.values())


def _conclusion(
    result: SearchResult, verification: Optional[Verification], limit: float, command: str, yaml: str, root: Path
) -> list[str]:
    best = result.best
    if not best.usable:
        over = [t for t in result.trials if t.status == OVER_MEMORY and t.peak_memory_gb is not None]
        closest = min(over, key=lambda t: t.peak_memory_gb or 0.0, default=None)
        near = (
            f"; closest: {closest.name} ({' '.join(as_overrides(closest.changes)) or 'base'}) at "
            f"{closest.peak_memory_gb:.2f} GB"
            if closest
            else ""
        )
        return [f"**No configuration fits under {limit:.2f} GB**{near}."]
    if best is result.base:
        tried = [t for t in result.trials if t is not result.base and t.runs]
        if not tried:
            typical = max(run.wall_s for run in result.base.runs)
            return [
                f"**Nothing but the base was measured** ({result.stopped}): no other configuration was tried. One "
                f"trial took {typical / 60:.1f} min here; a search needs several per knob group (give "
                f"tune.budget_minutes={max(10, round(12 * typical / 60))} or more)."
            ]
        return [
            f"**The base is the fastest configuration found** among {len(tried) + 1}: no knob made it faster beyond "
            "noise."
        ]
    out = [
        f"**Best: {best.name}** ({best.note})",
        "",
        "```bash",
        command,
        "```",
        "",
        "```yaml",
        yaml.rstrip(),
        "```",
        "",
    ]
    if verification is None:
        return out
    if verification.failed:
        return [*out, f"Verification failed: {verification.failed}"]
    speedup = verification.speedup
    assert speedup is not None
    out.append(
        f"**Verified** side by side ({len(verification.base)} runs each, interleaved): "
        f"{speedup.value:.2f}x the base's step throughput (95% interval {speedup.low:.2f}-{speedup.high:.2f}); "
        + (
            f"first steps' metrics equal to the base's ({verification.compared} values, rtol {RTOL:g}, atol {ATOL:g})."
            if verification.same_math
            else "first steps' metrics DIFFER: " + "; ".join(verification.mismatches[:5])
        )
    )
    out += ["", f"Compare them: `rlprof compare {root}/verify/base-1/logs {root}/verify/{best.name}-1/logs`"]
    return out
