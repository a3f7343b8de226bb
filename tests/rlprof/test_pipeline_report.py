"""``rlprof report`` reads an asynchronous pipeline: real two-thread loops (test_pipeline_metrics.AsyncLoop) made
rollout-bound, train-bound, sync-bound and staleness-bound on purpose, each logged through a Tracker; the report
lists the pipeline's metrics and names each bound, alone among the pipeline rules, with its evidence and the
overrides to try; verl's own keys (no waits by reason) name train-bound with verl's caveat; a synchronous run has no
pipeline section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlprof.cli import main
from rlprof.tracking import Tracker
from tests.rlprof.test_pipeline_metrics import AsyncLoop

POOLS = {"trainer": {"nnodes": 1, "n_gpus_per_node": 4}, "rollout": {"nnodes": 1, "n_gpus_per_node": 4}}
ASYNC_RULES = ("async-rollout-bound", "async-train-bound", "async-sync-bound", "async-staleness-bound")


def logged_run(folder: Path, records: list[dict[str, float]], async_training: dict) -> Path:
    logs = folder / "logs"
    with Tracker("p", folder.name, ["file"], log_dir=logs) as tracker:
        for step, record in enumerate(records, start=1):
            tracker.log(record, step)
    (logs / "config.yaml").write_text(yaml.safe_dump({**POOLS, "async_training": async_training}))
    return logs


def report(logs: Path, capsys) -> dict:
    assert main(["report", str(logs), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def async_findings(found: dict) -> dict[str, dict]:
    return {f["rule"]: f for f in found["findings"] if f["rule"] in ASYNC_RULES}


def test_a_rollout_bound_loop_names_the_pool_split_toward_the_rollout(tmp_path, capsys):
    records = AsyncLoop(gen_s=0.02, update_s=0.004, slow_update_s=0.004).run(12)
    logs = logged_run(tmp_path / "rollout", records, {"staleness_threshold": 0.5, "trigger_parameter_sync_step": 2})
    found = report(logs, capsys)
    (finding,) = async_findings(found).values()
    assert finding["rule"] == "async-rollout-bound"
    assert finding["evidence"]["trainer_idle_ratio"] >= 0.5
    assert finding["overrides"] == ["trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=5"]
    assert "async_training.staleness_threshold=0.5 lets the rollouter run only that far ahead" in finding["message"]
    listed = {t["metric"] for t in found["pipeline"]}
    assert {"fully_async/trainer/idle_ratio", "training/off_policy/trajectory_staleness/mean"} <= listed
    assert main(["report", str(logs)]) == 0
    assert "Asynchronous pipeline" in capsys.readouterr().out


def test_a_train_bound_loop_names_the_updates_own_knobs_then_the_pool_split_toward_the_trainer(tmp_path, capsys):
    records = AsyncLoop(gen_s=0.001, update_s=0.03, slow_update_s=0.03, sync_every=4).run(12)
    found = report(logged_run(tmp_path / "train", records, {"partial_rollout": False}), capsys)
    (finding,) = async_findings(found).values()
    assert finding["rule"] == "async-train-bound"
    assert finding["evidence"]["rollouter_idle_ratio"] >= 0.5 and finding["evidence"]["trainer_idle_ratio"] < 0.1
    assert finding["evidence"]["rollouter_wait_s/queue_full"] > finding["evidence"].get("rollouter_wait_s/weights", 0)
    assert finding["overrides"] == [  # the update's own speed knobs, then a process the other way
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "rollout.n_gpus_per_node=3",
        "trainer.n_gpus_per_node=5",
    ]
    assert "use_remove_padding=true" in " ".join(finding["not_offered"])  # measured slower on a CPU
    assert "queue_full" in finding["message"]


def test_a_loop_held_by_its_syncs_names_the_sync_interval_and_partial_rollouts(tmp_path, capsys):
    """A sync 40 times the update: on a busy machine the threads' other steps stretch (a full queue at a sync's start
    then reads queue_full), still far short of the sync."""
    records = AsyncLoop(gen_s=0.002, update_s=0.004, slow_update_s=0.004, sync_s=0.16, sync_every=1).run(12)
    async_training = {"trigger_parameter_sync_step": 1, "partial_rollout": False}
    found = report(logged_run(tmp_path / "sync", records, async_training), capsys)
    (finding,) = async_findings(found).values()
    assert finding["rule"] == "async-sync-bound"
    assert finding["evidence"]["rollouter_waits_for_weights_share"] >= 0.25
    assert finding["overrides"] == [
        "async_training.trigger_parameter_sync_step=2",
        "async_training.partial_rollout=True",
    ]
    assert "it changes what is learned" in finding["message"]


@pytest.mark.parametrize(
    ("sync_s", "expected"),
    [(6.0, {"async-sync-bound"}), (4.0, {"async-sync-bound", "async-train-bound"})],
)
def test_a_rollouter_waiting_on_a_full_queue_through_the_trainers_syncs_is_sync_bound_not_train_bound(
    tmp_path, capsys, sync_s, expected
):
    """The rollouter idle, its queue full longer than it waits for weights, the trainer hardly idle: train-bound's
    pattern, but the trainer spends 6 s of its 10-s step publishing weights (more than the rest of its work): the
    sync sets the pace. At 4 s of 10 the update does, and both rules speak."""
    records = [
        {
            "timing_s/step": 10.0,
            "timing_s/sync_rollout_weights": sync_s,
            "fully_async/trainer/idle_ratio": 0.01,
            "fully_async/rollouter/idle_ratio": 0.7,
            "fully_async/rollouter/version_time": 10.0,
            "fully_async/rollouter/wait_s/queue_full": 4.5,
            "fully_async/rollouter/wait_s/weights": 2.5,
        }
        for _ in range(6)
    ]
    found = async_findings(report(logged_run(tmp_path / "run", records, {"partial_rollout": False}), capsys))
    assert set(found) == expected


def test_samples_dropped_as_stale_name_the_staleness_budget(tmp_path, capsys):
    loop = AsyncLoop(gen_s=0.008, update_s=0.004, slow_update_s=0.004, sync_every=1, max_staleness=0)
    records = loop.run(12)
    budget = {"staleness_threshold": 0.0, "partial_rollout": False}
    found = report(logged_run(tmp_path / "stale", records, budget), capsys)
    finding = async_findings(found)["async-staleness-bound"]
    last = records[-1]
    dropped, generated = (
        last["fully_async/count/dropped_stale_samples"],
        last["fully_async/count/total_generated_samples"],
    )
    assert finding["evidence"]["dropped_share"] == round(dropped / generated, 4) and dropped > 0  # evidence: 4 places
    assert finding["overrides"] == ["async_training.staleness_threshold=0.5", "async_training.partial_rollout=True"]
    assert "it changes what is learned" in finding["message"]


def test_verls_own_keys_name_train_bound_with_its_caveat_and_a_sync_run_has_no_pipeline(tmp_path, capsys):
    verl = [  # what verl's fully-async trainer logs: its rollouter ratio, no waits by reason
        {
            "timing_s/step": 10.0,
            "timing_s/gen": 0.2,
            "fully_async/trainer/idle_ratio": 0.02,
            "fully_async/rollouter/idle_ratio": 0.6,
            "fully_async/rollouter/active_time": 4.0,
            "fully_async/rollouter/version_time": 10.0,
        }
        for _ in range(6)
    ]
    found = report(logged_run(tmp_path / "verl", verl, {}), capsys)
    (finding,) = async_findings(found).values()
    assert finding["rule"] == "async-train-bound" and "verl #6693" in finding["message"]
    syncing = [  # verl's trainer publishing its weights 30% of its step, its rollouter hardly idle
        {**verl[0], "timing_s/sync_rollout_weights": 3.0, "fully_async/rollouter/idle_ratio": 0.1} for _ in range(6)
    ]
    finding = async_findings(report(logged_run(tmp_path / "verl_sync", syncing, {}), capsys))["async-sync-bound"]
    assert finding["evidence"]["trainer_sync_share"] == pytest.approx(0.3)
    assert "weight syncs take 30% of the trainer's step" in finding["message"]
    synchronous = [{"timing_s/step": 1.0, "timing_s/gen": 0.5, "timing_s/update_actor": 0.4} for _ in range(6)]
    found = report(logged_run(tmp_path / "sync_run", synchronous, {}), capsys)
    assert found["pipeline"] == [] and not async_findings(found)
    # generation half of the step: overlapped, a step would take the longer half, at most 2x faster
    assert found["breakdown"]["overlap_gain"] == pytest.approx(2.0)
    assert main(["report", str(tmp_path / "sync_run" / "logs")]) == 0
    assert "would make a step at most 2.00x faster" in capsys.readouterr().out
    assert report(tmp_path / "verl" / "logs", capsys)["breakdown"]["overlap_gain"] is None  # asynchronous already


def test_a_one_step_off_run_names_the_rollouts_own_speed_knobs_then_moves_a_process_by_its_run_record(tmp_path, capsys):
    """rlprof_train's one-step-off config has no trainer.n_gpus_per_node (the launch says it): its run.json's
    processes do (4 a node, 1 of them the rollout pool's). Rollout-bound: the hf rollout's own knobs (twice its prompts
    per generate call, its compiled decode step), then one process moved to the rollout pool."""
    records = AsyncLoop(gen_s=0.02, update_s=0.004, slow_update_s=0.004).run(12)
    logs = logged_run(tmp_path / "pooled", records, {})
    config = {"rollout": {"nnodes": 1, "n_gpus_per_node": 1}, "actor_rollout_ref": {"rollout": {"micro_batch_size": 4}}}
    (logs / "config.yaml").write_text(yaml.safe_dump(config))
    run_record = {
        "processes": {"trainer": 3, "rollout": 1, "per_node": 4},
        "rollout": {"name": "hf", "reads": ["micro_batch_size", "enforce_eager"], "returns_log_probs": False},
    }
    (logs / "run.json").write_text(json.dumps(run_record))
    (finding,) = async_findings(report(logs, capsys)).values()
    assert finding["rule"] == "async-rollout-bound"
    assert finding["overrides"] == [
        "actor_rollout_ref.rollout.micro_batch_size=8",
        "actor_rollout_ref.rollout.enforce_eager=false",
        "trainer.n_gpus_per_node=2",
        "rollout.n_gpus_per_node=2",
    ]
