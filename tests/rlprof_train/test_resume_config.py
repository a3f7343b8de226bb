"""A resumed run is what it says: settings that change the experiment (optimizer, n, batch geometry, seed, estimator,
models) differing from the checkpoint's stop the resume in one line listing them, unless
``trainer.resume_allow_changes`` names them; then they are applied for real (the optimizer's learning rate after
the load) and recorded. The run's length and the speed knobs change freely."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from rlprof.tracking.jsonl import read_jsonl

from conftest import ROOT, subprocess_env, trainer_command

pytestmark = pytest.mark.slow

BASE = ("trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false")
LR = "actor_rollout_ref.actor.optim.lr"


def run(folder, *overrides) -> subprocess.CompletedProcess:
    command = trainer_command(folder, *BASE, *overrides)
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_resume_that_changes_the_experiment_is_refused_or_applied_when_allowed(tmp_path):
    first = run(tmp_path, "trainer.total_training_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    refused = run(tmp_path, "trainer.total_training_steps=4", f"{LR}=1e-2", "actor_rollout_ref.rollout.n=4")
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("config error:")]
    assert "would change the experiment it trained: " in line
    assert f"{LR}: 0.0005 there, 0.01 now" in line and "actor_rollout_ref.rollout.n: 8 there, 4 now" in line
    assert f"trainer.resume_allow_changes=[{LR},actor_rollout_ref.rollout.n]" in line
    assert "trainer.total_training_steps" not in line  # a longer run is the same experiment
    assert [r["step"] for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")] == [1, 2]  # nothing ran
    allowed = run(tmp_path, "trainer.total_training_steps=4", f"{LR}=1e-2", f"trainer.resume_allow_changes=[{LR}]")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert f"checkpoint: resuming with {LR}=0.01 (the checkpoint trained with 0.0005; allowed)" in allowed.stderr
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[2]["actor/lr"] == pytest.approx(5e-4) and rows[3]["actor/lr"] == pytest.approx(1e-2)  # applied
    recorded = yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())
    assert recorded["actor_rollout_ref"]["actor"]["optim"]["lr"] == pytest.approx(1e-2)  # what ran


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_checkpoint_whose_weights_changed_on_disk_is_skipped_for_the_previous_one(tmp_path):
    """An exponent bit flipped in 1024 float32 weights of the newest checkpoint, the file's size unchanged: the
    resume names the file and resumes from the checkpoint before (it used to load it and train on NaN losses)."""
    first = run(tmp_path, "trainer.total_training_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    (weights,) = (tmp_path / "ckpt" / "global_step_4" / "actor").rglob("mp_rank_00_model_states.pt")
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2 // 4 * 4
    for offset in range(middle + 3, middle + 4 * 1024, 4):  # the high byte of each little-endian float32
        data[offset] ^= 0x40
    weights.write_bytes(bytes(data))
    resumed = run(tmp_path, "trainer.total_training_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "global_step_4 is skipped: actor/" in resumed.stderr
    assert "mp_rank_00_model_states.pt does not hold what was written" in resumed.stderr
    assert "checkpoint: resumed from " in resumed.stderr and "global_step_2 (next step 3)" in resumed.stderr
