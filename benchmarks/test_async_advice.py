"""The report's advice on an imbalanced one-step-off run, applied and measured: two runs made rollout-bound and
train-bound on purpose, each read by ``rlprof report``; the bound it names must be the one made, and its first
override, applied, must raise the steps per second.

Both runs are one-step-off launches of 3 processes on the same 2 cores (one OpenMP thread each), as a user would
split them. The first override is the first key of the finding's list, or both keys of a pool move (the launch keeps
its size: a process moves from one pool to the other).

- ``rollout-bound``: 2 train, 1 generates; the embedded tiny model with random weights (it does not stop early:
  every response is ``data.max_response_length`` tokens long) samples 8 prompts x 4 responses of 192 tokens.
- ``train-bound``: 1 trains, 2 generate; the demo's short responses, an update of 8 PPO epochs.

Speed: the step time (median of steps 3-8, trainer_runs) as it was and with the override, alternated in PAIRS
(as it was, applied; then applied, as it was; ...); target: the median of the pairs' ratios above 1 (the override
raises steps per second), the spread reported. A miss is measured once more (ATTEMPTS)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_runs import ROOT, train

from rlprof_train.tiny_model import create_tiny_model

pytestmark = pytest.mark.long

STEPS = 8
PAIRS = 3
ATTEMPTS = 2
ASYNC_RULES = ("async-rollout-bound", "async-train-bound", "async-sync-bound", "async-staleness-bound")
POOL_KEYS = ("trainer.n_gpus_per_node", "rollout.n_gpus_per_node")
SETUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "rollout-bound": (
        "async-rollout-bound",
        (
            "trainer.n_gpus_per_node=2",
            "rollout.n_gpus_per_node=1",
            "data.max_response_length=192",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
        ),
    ),
    "train-bound": (
        "async-train-bound",
        ("trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_epochs=8"),
    ),
}


def one_step_off(folder: Path, *overrides: str) -> float:
    """The median step time of a one-step-off run of 3 processes."""
    return train(folder, "one_step_off_policy", 3, 1, STEPS, *overrides)["timing_s/step"]


def first_override(overrides: list[str]) -> list[str]:
    """The finding's first change: its first key, or both keys of a pool move."""
    if overrides[0].split("=")[0] in POOL_KEYS:
        return overrides[:2]
    return overrides[:1]


def advice(logs: Path) -> dict:
    """The asynchronous rules' findings of ``rlprof report`` on ``logs``, by rule."""
    result = subprocess.run(
        [sys.executable, "-m", "rlprof.cli", "report", str(logs), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {f["rule"]: f for f in json.loads(result.stdout)["findings"] if f["rule"] in ASYNC_RULES}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_the_reports_first_override_on_an_imbalanced_run_raises_its_steps_per_second(setup, tmp_path, speed_target):
    expected, overrides = SETUPS[setup]
    if setup == "rollout-bound":
        model = tmp_path / "random_model"
        create_tiny_model(model, sft_steps=0)
        overrides = (*overrides, f"actor_rollout_ref.model.path={model}")
    one_step_off(tmp_path / "read", *overrides)
    findings = advice(tmp_path / "read" / "logs")
    assert list(findings) == [expected], {rule: f["message"] for rule, f in findings.items()}
    finding = findings[expected]
    applied = first_override(finding["overrides"])
    for attempt in range(1, ATTEMPTS + 1):  # a miss on a noisy machine is measured again, the target kept
        ratios = []
        for pair in range(PAIRS):
            folder = tmp_path / f"attempt{attempt}-pair{pair}"
            runs = [("as it was", ()), ("applied", tuple(applied))]
            measured = {
                name: one_step_off(folder / name.replace(" ", "-"), *overrides, *extra)
                for name, extra in (runs if pair % 2 == 0 else runs[::-1])  # alternated: drift hits both alike
            }
            ratios.append(measured["as it was"] / measured["applied"])
            print(
                f"\n{setup} pair {pair + 1}: step {measured['as it was'] * 1e3:.0f} ms as it was, "
                f"{measured['applied'] * 1e3:.0f} ms with {' '.join(applied)} -> {ratios[-1]:.2f}x"
            )
        summary = (
            f"{setup}: the report names {expected} (evidence {finding['evidence']}); its first override "
            f"{' '.join(applied)} makes {statistics.median(ratios):.2f}x the steps per second (median of {PAIRS} "
            f"alternated pairs, {min(ratios):.2f}-{max(ratios):.2f}x), attempt {attempt}"
        )
        print(summary)
        if statistics.median(ratios) > 1:
            break
    speed_target(statistics.median(ratios) > 1, f"{summary} (target > 1x)")
