"""verl's fully-async trainer (``python -m rlprof_train.fully_async_main``): prompt groups streamed from the rollout
pool's queues within the staleness budget, a step of several local updates and one weight sync, and the pipeline's
metrics counted again from the run's own records. (Faults: test_one_step_off.py's kill and Ctrl-C tests run both
asynchronous trainers.)"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from rlprof.tracking.jsonl import read_jsonl
from rlprof_train.config.load import load
from rlprof_train.config.schema import AsyncTrainingConfig
from rlprof_train.fully_async_main import main as fully_async_main
from rlprof_train.fully_async_trainer import aggregate_updates
from rlprof_train.main_ppo import main as main_ppo
from rlprof_train.one_step_off_policy import main as one_step_off_main
from rlprof_train.preflight import validate
from rlprof_train.rollout_stream import Budget

from conftest import ROOT, subprocess_env
from test_one_step_off import one_step_off_command, recounted_figures, rlprof_cli, sample_lives


def test_the_budget_is_verls_required_and_max_required_samples():
    """verl's FullyAsyncRollouter: ``required_samples = ppo_mini_batch_size * require_batches``, ``max_required_samples
    = int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step)`` (also its queue's bound)."""
    for mini, require, staleness, trigger in ((32, 4, 0.1, 4), (4, 1, 0.5, 2), (8, 2, 0.0, 1), (3, 1, 0.33, 3)):
        pipeline = AsyncTrainingConfig(staleness, trigger, require, False)
        budget = Budget.of(mini, pipeline)
        assert budget.required == mini * require
        assert budget.max_required == int(mini * require * (staleness + 1) * trigger)
        assert budget.per_version == mini * require * trigger


def test_a_steps_metrics_aggregate_its_local_updates_as_verl_does():
    """verl's MetricsAggregator: times summed, means averaged, maxima and minima kept, counts the last, anything
    else averaged; the throughput recomputed over the step; a metric of one update alone is that update's."""
    updates = [
        {
            "timing_s/gen": 1.0,
            "perf/time_per_step": 2.0,
            "perf/total_num_tokens": 100.0,
            "perf/throughput": 50.0,
            "critic/score/mean": 0.2,
            "response_length/max": 7.0,
            "response_length/min": 3.0,
            "fully_async/count/total_generated_samples": 8.0,
            "actor/pg_loss": 1.0,
        },
        {
            "timing_s/gen": 0.5,
            "perf/time_per_step": 1.0,
            "perf/total_num_tokens": 80.0,
            "perf/throughput": 80.0,
            "critic/score/mean": 0.4,
            "response_length/max": 5.0,
            "response_length/min": 1.0,
            "fully_async/count/total_generated_samples": 12.0,
            "actor/pg_loss": 3.0,
            "timing_s/sync_rollout_weights": 0.25,
        },
    ]
    step = aggregate_updates(updates, world_size=2)
    assert step == {
        "timing_s/gen": 1.5,
        "perf/time_per_step": 3.0,
        "perf/total_num_tokens": 180.0,
        "perf/throughput": 180.0 / (3.0 * 2),
        "critic/score/mean": pytest.approx(0.3),
        "response_length/max": 7.0,
        "response_length/min": 1.0,
        "fully_async/count/total_generated_samples": 12.0,
        "actor/pg_loss": 2.0,
        "timing_s/sync_rollout_weights": 0.25,
    }


def test_the_pipelines_keys_are_the_fully_async_trainers_and_its_limits_are_named(capsys):
    """The fully-async keys are refused by the other trainers (naming the one that takes them); verl's scripts'
    ``data.train_batch_size=0`` becomes the local update's prompts; other ``gen_batch_size`` values are refused,
    all in one line; partial rollouts of multi-turn trajectories are taken."""
    assert main_ppo(["--config-name=demo", "async_training.require_batches=2", "--cfg", "job"]) == 2
    assert "python -m rlprof_train.fully_async_main" in capsys.readouterr().err
    pool = ["rollout.n_gpus_per_node=1", "rollout.total_rollout_steps=64"]
    assert one_step_off_main(["--config-name=demo", *pool, "--cfg", "job"]) == 2
    assert "rollout.total_rollout_steps=64" in capsys.readouterr().err

    loaded = load(
        ["--config-name=demo", "data.train_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
        mode="fully_async",
    )
    assert loaded.cfg.data.train_batch_size == 8 * loaded.cfg.async_training.require_batches
    assert any("data.train_batch_size=0: the fully-async trainer's local update takes" in n for n in loaded.notes)

    bad = ["data.gen_batch_size=4", "async_training.staleness_threshold=-1"]
    code = fully_async_main(["--config-name=demo", *pool, *bad, "--cfg", "job"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "async_training.staleness_threshold: -1.0 is out of range; allowed: a number >= 0" in err  # types first
    code = fully_async_main(["--config-name=demo", *pool, *bad[:1], "--cfg", "job"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "data.gen_batch_size=4: the fully-async trainer's rollout pool samples one prompt group at a time" in err
    tools = load(["--config-name=tool_demo", *pool], 2, mode="fully_async").cfg  # multi-turn, partial rollouts
    assert tools.async_training.partial_rollout and tools.actor_rollout_ref.rollout.multi_turn.enable
    validate(tools, 2, "fully_async")


RUN = (
    "rollout.n_gpus_per_node=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # required: 4 groups a local update
    "async_training.trigger_parameter_sync_step=2",  # 8 a step
    "async_training.staleness_threshold=0.5",  # max_required: int(4 * 1.5 * 2) = 12
    "trainer.total_training_steps=3",
    "trainer.val_before_train=true",
    "trainer.test_freq=2",
    "actor_rollout_ref.actor.ppo_epochs=8",  # updates far longer than a group's sampling: the budget holds the rollout
    "async_training.partial_rollout=false",  # a sync waits for the groups in flight (below: partial rollouts)
    "async_training.concurrent_samples_per_replica=3",  # below a local update's 4: 3 groups sampled at once
)
PER_STEP, MAX_REQUIRED = 8, 12


@pytest.mark.slow
def test_two_train_on_groups_streamed_within_the_staleness_budget_and_the_metrics_recount(tmp_path):
    """2 trainer + 1 rollout processes, 3 steps of 2 local updates on 4 groups each (2 responses), staleness 0.5,
    no partial rollouts, at most 3 groups sampled at once, validation before and at steps 2 and 3, the torch tool on
    step 2 in every process: the first 3 groups fed are sampled in one call; every
    stream position is trained on once; by each sync the rollout pool has sampled at most 12 groups past those
    trained on (verl's ``max_required_samples``), so no trajectory is more than one version old; the staleness and
    both idle ratios equal an independent count of the run's own pipeline records; every process records step 2."""
    command = one_step_off_command(
        tmp_path,
        *RUN,
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        "actor_rollout_ref.rollout.profiler.all_ranks=true",
        module="rlprof_train.fully_async_main",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    assert sorted(steps) == [0, 1, 2, 3]
    assert all("val-core/rlprof/arithmetic/reward/mean@1" in steps[s] for s in (0, 2, 3))

    folder = tmp_path / "logs" / "pipeline"
    samples = [r for rank in (0, 1) for r in read_jsonl(folder / f"rank{rank}.jsonl") if r["event"] == "sample"]
    positions = sorted(r["uid"] for r in samples)
    assert positions == sorted([p for p in range(1, 3 * PER_STEP + 1)] * 2)  # each trained once (2 responses)
    for s in (1, 2, 3):
        consumed = {r["uid"] for r in samples if r["step"] == s}
        assert consumed == set(range((s - 1) * PER_STEP + 1, s * PER_STEP + 1))  # the stream in order
        assert {r["consumed_version"] for r in samples if r["step"] == s} == {s - 1}
        generated = steps[s]["fully_async/count/total_generated_samples"]  # reported at step s's sync
        assert generated <= (s - 1) * PER_STEP + MAX_REQUIRED  # what the sync before it fed
        assert steps[s]["training/off_policy/trajectory_staleness/max"] <= 1.0
        assert steps[s]["fully_async/count/current_param_version"] == s - 1
        assert steps[s]["fully_async/partial/partial_ratio"] == 0.0
        assert steps[s]["fully_async/count/dropped_stale_samples"] == 0.0  # the queue's bound is the budget's
    assert steps[1]["training/off_policy/trajectory_staleness/max"] == 0.0  # the first version's samples
    sampled = [g for g in read_jsonl(folder / "rank2.jsonl") if g["event"] == "generate" and "uid" in g]
    calls = Counter(g["began"] for g in sampled)  # the groups of one batched call share its times
    assert max(calls.values()) == 3 and [g["uid"] for g in sampled][:3] == [1, 2, 3]

    recounted = recount(folder, trainer_ranks=(0, 1), rollout_rank0=2)
    for s in (1, 2, 3):
        assert {k: steps[s][k] for k in recounted[s]} == pytest.approx(recounted[s], abs=1e-9), s

    entries = [json.loads(line) for line in (tmp_path / "profile" / "manifest.jsonl").read_text().splitlines()]
    sessions = [e for e in entries if e.get("kind") == "session"]
    assert sorted((e["rank"], e["world_size"]) for e in sessions) == [(0, 3), (1, 3), (2, 3)]
    traces = sorted(path.name for path in (tmp_path / "profile").rglob("rank*.pt.trace.json*"))
    assert len(traces) == 3, traces  # step 2's window in each process of both pools

    # each group's life on the merged timeline: sampled a group at a time, queued, trained in the step that took it
    timeline = tmp_path / "timeline.json"
    merged = rlprof_cli("timeline", str(tmp_path / "logs"), str(tmp_path / "profile"), "-o", str(timeline))
    assert merged.returncode == 0, merged.stderr
    events = json.loads(timeline.read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    lives = sample_lives(events, next(pid for pid, label in lanes.items() if label == "sample lives"))
    assert sorted((life["args"]["step"], int(life["uid"])) for life in lives) == sorted(
        {(r["step"], r["uid"]) for r in samples}
    )
    for life in lives:
        (generating, queued, training) = life["phases"]
        assert [generating[0], queued[0], training[0]] == ["generating", "queued", "training"]
        assert generating[1] <= generating[2] <= queued[1] <= queued[2] <= training[1] <= training[2]
        assert life["args"]["consumed_version"] - life["args"]["version"] in (0, 1)

    report = rlprof_cli("report", str(tmp_path / "logs"), "--format", "json")
    pipeline = {row["metric"] for row in json.loads(report.stdout)["pipeline"]}
    assert {"training/off_policy/trajectory_staleness/mean", "fully_async/rollouter/idle_ratio"} <= pipeline


def recount(folder: Path, trainer_ranks: tuple[int, ...], rollout_rank0: int) -> dict[int, dict[str, float]]:
    """Each step's staleness and idle ratios from the run's pipeline records, by their definitions in
    rlprof.metrics.pipeline: staleness over every trajectory the step consumed (each trainer rank recorded its own),
    the trainer's idle ratio each trainer rank's waits inside its step's window over the window (their mean over the
    ranks), the rollouter's rollout rank 0's waits inside the window the step's weight sync ended, over that
    window. A trajectory was drawn under the version its rollout process recorded for its group."""
    records = {int(path.stem.removeprefix("rank")): read_jsonl(path) for path in folder.glob("rank*.jsonl")}
    samples = [r for rank in trainer_ranks for r in records[rank] if r["event"] == "sample"]
    generated = {g["uid"]: g for g in records[rollout_rank0] if g["event"] == "generate" and "uid" in g}
    out: dict[int, dict[str, float]] = {}
    for step in sorted({r["step"] for r in samples}):
        consumed = [r for r in samples if r["step"] == step]
        assert all(generated[r["uid"]]["version"] == r["version"] for r in consumed)
        staleness = [r["consumed_version"] - r["version"] for r in consumed]
        (rollouter,) = [r for r in records[rollout_rank0] if r["event"] == "window" and r["version"] == step]
        out[step] = recounted_figures(records, trainer_ranks, rollout_rank0, step, staleness, rollouter)
    return out


@pytest.mark.slow
def test_a_resumed_run_starts_both_pools_at_the_saved_version_with_no_group_trained_twice(tmp_path):
    """1 + 1 processes, a sync every update of 4 groups, staleness 1 (8 groups ahead): stopped after step 3 with its
    checkpoint, started again to step 6. The rollout process gets the saved weights, so step 4's groups are sampled
    by version 3 (staleness 0, as a first step) and the versions go on; the stream resumes after the 12 groups trained
    on (those sampled ahead before the stop are sampled again, by the saved weights): each of positions 1-24 is
    trained on once across the two launches (the records of both, one file)."""
    run = (
        "rollout.n_gpus_per_node=1",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1",
        "actor_rollout_ref.actor.ppo_epochs=4",
    )
    for last in ("trainer.total_training_steps=3", "trainer.total_training_steps=6"):
        command = one_step_off_command(
            tmp_path, *run, last, "trainer.save_freq=3", processes=2, module="rlprof_train.fully_async_main"
        )
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint: resumed from" in result.stderr
    metrics = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    assert metrics[4]["training/off_policy/trajectory_staleness/max"] == 0.0
    assert [metrics[s]["fully_async/count/current_param_version"] for s in range(1, 7)] == [0, 1, 2, 3, 4, 5]
    samples = [r for r in read_jsonl(tmp_path / "logs" / "pipeline" / "rank0.jsonl") if r["event"] == "sample"]
    assert {(r["version"], r["consumed_version"]) for r in samples if r["step"] == 4} == {(3, 3)}
    assert sorted(r["uid"] for r in samples) == sorted([p for p in range(1, 25)] * 2)  # 2 responses each
    assert all(0 <= r["consumed_version"] - r["version"] <= 1 for r in samples)


def partial_run(tmp_path: Path, *run: str, config: str = "demo") -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """A fully-async run of 1 + 1 processes (``config``, then ``run``): its metrics by step and the pipeline records
    of the trainer (rank 0) and the rollout process (rank 1)."""
    command = one_step_off_command(tmp_path, *run, processes=2, module="rlprof_train.fully_async_main")
    command[command.index("--config-name=demo")] = f"--config-name={config}"
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    return steps, {rank: read_jsonl(tmp_path / "logs" / "pipeline" / f"rank{rank}.jsonl") for rank in (0, 1)}


@pytest.mark.slow
def test_multi_turn_trajectories_pause_mid_conversation_for_a_sync_and_go_on_with_the_new_weights(tmp_path):
    """The calculator tool demo, fully async with partial rollouts in segments of 4 tokens (1 + 1 processes, a sync
    every update): syncs come while conversations are in flight, so they pause between two calls of the multi-turn
    loop and go on with the new weights; each trajectory records its versions, the pauses are recorded, the turns
    and tool calls are counted, and the partial metrics equal a count of the records."""
    run = (
        "rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "async_training.partial_rollout_segment=4",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1",
        "trainer.total_training_steps=4",
    )
    steps, records = partial_run(tmp_path, *run, config="tool_demo")
    samples = [r for r in records[0] if r["event"] == "sample"]
    pauses = [r for r in records[1] if r["event"] == "pause"]
    partial = [r for r in samples if r["version"] > r["first_version"]]
    assert pauses and partial, "syncs came while conversations were in flight"
    assert {r["uid"] for r in partial} <= {p["uid"] for p in pauses}
    assert all(steps[s]["num_turns/max"] >= 3 and steps[s]["tools/calculator/calls"] > 0 for s in steps)
    for step, metrics in steps.items():
        spans = [r["version"] - r["first_version"] for r in samples if r["step"] == step]
        assert metrics["fully_async/partial/partial_ratio"] == pytest.approx(sum(s > 0 for s in spans) / len(spans))
        assert metrics["fully_async/partial/max_partial_span"] == max(spans)


@pytest.mark.slow
def test_partial_rollouts_pause_a_group_in_flight_for_a_sync_and_go_on_with_the_new_weights(tmp_path):
    """A rollout-bound run (1 + 1 processes; a random-weight model that seldom stops early, 4 responses of up to 48
    tokens in segments of 8; one quick update a step): syncs come while a group is being sampled, so its
    trajectories pause and go on with the new weights; a call samples at most a local update's 4 groups. Each
    trajectory records its first and last versions; the
    pauses are recorded; the partial and staleness metrics equal a count of the records (``partial_ratio``,
    ``max_partial_span``, ``trajectory_spans``, ``trajectory_staleness_worst``)."""
    from rlprof_train.tiny_model import create_tiny_model

    model = create_tiny_model(tmp_path / "model", sft_steps=0)
    run = (
        "rollout.n_gpus_per_node=1",
        f"actor_rollout_ref.model.path={model}",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.n=4",
        "async_training.partial_rollout_segment=8",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1",
        "trainer.total_training_steps=6",
    )
    steps, records = partial_run(tmp_path, *run)
    samples = [r for r in records[0] if r["event"] == "sample"]
    pauses = [r for r in records[1] if r["event"] == "pause"]
    partial = [r for r in samples if r["version"] > r["first_version"]]
    assert pauses and partial, "syncs came while groups were in flight"
    sampled = [g for g in records[1] if g["event"] == "generate" and "uid" in g]
    assert max(Counter(g["began"] for g in sampled).values()) == 4  # a local update's share, not the 16 allowed
    assert {r["uid"] for r in partial} <= {p["uid"] for p in pauses}  # a trajectory spans versions only if paused
    for step in range(1, 7):
        consumed = [r for r in samples if r["step"] == step]
        spans = [r["version"] - r["first_version"] for r in consumed]
        worst = [r["consumed_version"] - r["first_version"] for r in consumed]
        recounted = {
            "fully_async/partial/partial_ratio": sum(span > 0 for span in spans) / len(spans),
            "fully_async/partial/max_partial_span": max(spans),
            "training/off_policy/trajectory_spans/max": max(spans) + 1,
            "training/off_policy/trajectory_staleness_worst/max": max(worst),
            "training/off_policy/trajectory_staleness/max": max(r["consumed_version"] - r["version"] for r in consumed),
        }
        assert {k: steps[step][k] for k in recounted} == pytest.approx(recounted), step
