"""The trainer under ``global_profiler.tool=memray`` (verl's newest tool): a capture per profiled step in verl's
layout, read back by ``rlprof memory`` with memray's own peak and the reward's allocations under the reward's range,
and a leak planted in the reward function named by ``rlprof report`` over three windows with its line and its
bytes a step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlprof.cli import main
from rlprof.manifest import read_manifest

from conftest import ROOT, subprocess_env, trainer_command

pytestmark = [pytest.mark.slow]
pytest.importorskip("memray")

LEAK_BYTES = 16384
PROMPTS, SAMPLES = 8, 8
LEAKY_REWARD = textwrap.dedent(
    f"""
    KEPT = []


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        KEPT.append(bytearray({LEAK_BYTES}))  # every call keeps {LEAK_BYTES} bytes: the planted leak
        return float(solution_str.strip().startswith(ground_truth))
    """
)


def test_memray_captures_name_the_rewards_allocations_and_a_leak_planted_in_it(tmp_path, capsys):
    reward = tmp_path / "leaky_reward.py"
    reward.write_text(LEAKY_REWARD)
    profile = tmp_path / "profile"
    command = trainer_command(
        tmp_path,
        f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=4",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={SAMPLES}",
        "global_profiler.tool=memray",
        "global_profiler.steps=[2,3,4]",
        f"global_profiler.save_path={profile}",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    captures = [r for r in read_manifest(profile) if r.get("format") == "memray"]
    assert [Path(r["path"]).parent.name for r in captures] == ["step2", "step3", "step4"]
    capture = profile / captures[0]["path"]

    assert main(["memory", str(capture), "--format", "json", "--top", "200"]) == 0
    (device,) = json.loads(capsys.readouterr().out)["devices"]
    summary = device["summary"]
    stats = capture.with_suffix(".stats.json")
    command = [sys.executable, "-m", "memray", "stats", "--json", "-f", "-o", str(stats), str(capture)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    assert summary["peak_bytes"] == json.loads(stats.read_text())["metadata"]["peak_memory"]
    rewards = [s for s in summary["top_sites"] if s["tag"] == "reward/reward"]
    assert any("leaky_reward.py:" in s["site"] for s in rewards), rewards  # the reward's own, under its range
    assert summary["by_role"]["reward"] >= PROMPTS * SAMPLES * LEAK_BYTES

    assert main(["report", str(tmp_path / "logs"), str(profile), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in report["findings"] if f["rule"] == "memory-growth"]
    assert "leaky_reward.py:6 compute_score" in finding["message"] and "(reward/reward)" in finding["message"]
    assert finding["evidence"]["bytes_per_step"] == pytest.approx(PROMPTS * SAMPLES * LEAK_BYTES, rel=0.05)
    assert finding["evidence"]["windows"] == 3
