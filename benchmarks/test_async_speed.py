"""The asynchronous trainers' updates per second against the synchronous trainer's on the same 2 cores, measured
in one run, alternating the layouts.

Layouts (2 cores for each): synchronous in one process with two threads, synchronous in two processes of one
thread (data parallel), one-step-off and fully async, one process training and one generating (one thread each).
Every layout's update takes the same prompt groups (``data.train_batch_size``; the fully-async trainer's
``ppo_mini_batch_size``, the same); the fully-async run is the issue's (staleness 0.5, a sync every 2 updates: its
step is 2 updates, timed per update here). The baseline is the faster synchronous layout of each repetition.
Setups:

- ``generation-heavy``: the demo's GRPO on the embedded tiny model with random weights (no warm start: it does not
  stop early, so every response is ``data.max_response_length`` tokens long), 8 prompts x 4 responses of 48 tokens.
  Its one-process synchronous step spends 62-69% of its time generating (runs of 2026-12-06 and -07; checked: at
  least 60%), near real runs' (72% in verl #6747; the issue asks 65%). Stated targets, for each asynchronous
  trainer: at least 1.3x the synchronous updates per second; its update at most 1.15x the longer of its generation
  and the trainer's own work (one-step-off: ``timing_s/generate_async`` and the step less its wait for the batch;
  fully async: the rollouter's busy time between two syncs and the step less its waits, per update).
- ``demo``: the demo's own setup (update-bound on a CPU: generation about a sixth of its step): the ratio reported,
  no target (``rlprof report`` on the synchronous run says overlapping would gain little there).

Each run trains 12 steps; its step time is the median of steps 3-12 (compiles and caches warm by then: trainer_runs).
A missed target is measured once more (ATTEMPTS) before it counts as missed."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import pytest
from trainer_runs import train

from rlprof_train.tiny_model import create_tiny_model

pytestmark = pytest.mark.long

REPETITIONS = 5
ATTEMPTS = 2
STEPS = 12
SETUPS = {
    "generation-heavy": (
        "data.max_response_length=48",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
    ),
    "demo": (),
}
LAYOUTS = (
    "sync, 1 process x 2 threads",
    "sync, 2 processes",
    "one-step-off, 1 + 1 processes",
    "fully async, 1 + 1 processes",
)
ASYNC = LAYOUTS[2:]
FULLY_ASYNC = ("async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=2")
UPDATES_PER_STEP = {LAYOUTS[3]: 2}


def run(folder: Path, layout: str, model: Path | None, *overrides: str) -> dict[str, float]:
    """Train STEPS steps in ``layout`` (:func:`trainer_runs.train`'s medians)."""
    common = [
        "algorithm.rollout_correction.bypass_mode=true",  # one-step-off's default, set for every layout
        *([f"actor_rollout_ref.model.path={model}"] if model else []),
        *overrides,
    ]
    module, processes, threads, extra = {
        LAYOUTS[0]: ("main_ppo", 1, 2, ()),
        LAYOUTS[1]: ("main_ppo", 2, 1, ()),
        LAYOUTS[2]: ("one_step_off_policy", 2, 1, ("rollout.n_gpus_per_node=1",)),
        LAYOUTS[3]: ("fully_async_main", 2, 1, ("rollout.n_gpus_per_node=1", *FULLY_ASYNC)),
    }[layout]
    per_step = UPDATES_PER_STEP.get(layout, 1)
    medians = train(folder, module, processes, threads, STEPS // per_step, *common, *extra)
    return {key: value / per_step for key, value in medians.items()}  # per update


def busy(measured: dict[str, float]) -> float:
    """The rollout pool's busy time per update: its sampling (one-step-off) or its time between syncs less its
    waits (fully async)."""
    return measured.get("fully_async/rollouter/active_time", measured.get("timing_s/generate_async", 0.0))


Figures = dict[str, tuple[list[float], list[float]]]
"""Each asynchronous layout's ratios to the faster synchronous layout and overlap efficiencies, a repetition each."""


def measure(setup: str, folder: Path, model: Optional[Path]) -> tuple[Figures, list[float], str]:
    """REPETITIONS of the layouts, alternating: each asynchronous layout's ratio to the faster synchronous layout and
    overlap efficiency, the one-process generation share, a repetition each, and their summary."""
    figures: Figures = {layout: ([], []) for layout in ASYNC}
    shares = []
    for repetition in range(REPETITIONS):
        order = LAYOUTS if repetition % 2 == 0 else LAYOUTS[::-1]  # alternating: drift hits both sides alike
        measured = {
            layout: run(folder / f"{repetition}-{i}", layout, model, *SETUPS[setup]) for i, layout in enumerate(order)
        }
        synchronous = min((measured[layout] for layout in LAYOUTS[:2]), key=lambda m: m["timing_s/step"])
        for layout in ASYNC:
            overlapped = measured[layout]
            own_work = overlapped["timing_s/step"] - overlapped["timing_s/gen"]  # the trainer's, less its waits
            figures[layout][0].append(synchronous["timing_s/step"] / overlapped["timing_s/step"])
            figures[layout][1].append(overlapped["timing_s/step"] / max(busy(overlapped), own_work))
        one_process = measured[LAYOUTS[0]]  # the synchronous trainer as most run it: what the setup is
        shares.append(one_process["timing_s/gen"] / one_process["timing_s/step"])
        print(
            f"\n{setup} #{repetition + 1}: "
            + "; ".join(f"{layout} {m['timing_s/step'] * 1e3:.0f} ms an update" for layout, m in measured.items())
            + "".join(
                f" -> {layout.split(',')[0]} {ratios[-1]:.2f}x, overlap efficiency {efficiencies[-1]:.2f}"
                for layout, (ratios, efficiencies) in figures.items()
            )
            + f"; generation {shares[-1]:.0%} of the one-process synchronous step"
        )
    summary = (
        f"{setup}: "
        + "; ".join(
            f"{layout.split(',')[0]} {statistics.median(ratios):.2f}x the faster synchronous layout's updates per "
            f"second (median of {REPETITIONS}, {min(ratios):.2f}-{max(ratios):.2f}x), its update "
            f"{statistics.median(efficiencies):.2f}x the longer of generation and the trainer's own work "
            f"({min(efficiencies):.2f}-{max(efficiencies):.2f})"
            for layout, (ratios, efficiencies) in figures.items()
        )
        + f"; generation {statistics.median(shares):.0%} of the one-process synchronous step"
    )
    print(summary)
    return figures, shares, summary


def met(figures: Figures) -> bool:
    return all(
        statistics.median(ratios) >= 1.3 and statistics.median(efficiencies) <= 1.15
        for ratios, efficiencies in figures.values()
    )


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_the_async_trainers_against_the_faster_synchronous_layout_on_two_cores(setup, tmp_path, speed_target):
    model = None
    if setup == "generation-heavy":
        model = tmp_path / "random_model"
        create_tiny_model(model, sft_steps=0)
    for attempt in range(1, ATTEMPTS + 1):  # a miss on a noisy machine is measured again, the bound kept
        figures, shares, summary = measure(setup, tmp_path / f"attempt{attempt}", model)
        if setup != "generation-heavy" or met(figures):
            break
    if setup == "generation-heavy":
        assert statistics.median(shares) >= 0.6, summary  # the setup is what it says
        for layout, (ratios, efficiencies) in figures.items():
            name = layout.split(",")[0]
            speed_target(statistics.median(ratios) >= 1.3, f"{summary}, attempt {attempt} ({name}: target >= 1.3x)")
            speed_target(
                statistics.median(efficiencies) <= 1.15, f"{summary}, attempt {attempt} ({name}: target <= 1.15x)"
            )
