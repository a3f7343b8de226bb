"""verl's one-step-off trainer (``python -m rlprof_train.one_step_off_policy``): the launch split into a trainer pool
and a rollout pool, the link between them, the step order (wait for batch k, send the weights, start batch k + 1,
train on k) and what the run logs."""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest
import torch
import torch.distributed as dist

from rlprof.analysis.render.jsonout import schema
from rlprof.metrics.timing import timing_shares
from rlprof.tracking.jsonl import read_jsonl
from rlprof.typed_config import ConfigError
from rlprof_train.one_step_off_policy import main as one_step_off_main
from rlprof_train.pools import (
    Link,
    device_index,
    pool_of,
    rollout_pool_size,
    sharing_problem,
    weights_on_gpus,
)
from rlprof_train.rollout_pool import part
from rlprof_train.tune.trial import LEARNING_KEYS
from rlprof_train.tune.verify import ATOL, RTOL

from conftest import ROOT, SMALL_RUN, foreground_sigint, free_port, subprocess_env, torchrun, trainer_command


def test_on_gpus_each_process_has_its_own_where_the_node_has_enough_and_the_pools_share_them_where_not():
    """GPU indices by layout (no GPU needed: the count is an argument): a GPU for each process, the local rank; one
    GPU for a trainer and a rollout process, both on it; 2 GPUs a node for 3 processes, the trainer's two on 0 and 1,
    the rollout's on 0; a pool with more processes on a node than it has GPUs is a problem, named; the weights cross
    GPU to GPU only where no GPU is shared."""

    def indices(world: int, rollout: int, per_node: int, visible: int) -> list[int]:
        pools = [pool_of(rank, world, rollout) for rank in range(world)]
        return [device_index(p, per_node, p.global_rank % per_node, visible) for p in pools]

    assert indices(8, 2, 8, 8) == list(range(8))
    assert indices(2, 1, 2, 1) == [0, 0]
    assert indices(3, 1, 3, 2) == [0, 1, 0]
    assert sharing_problem(3, 3, 1, 2) is None and sharing_problem(8, 8, 2, 8) is None
    assert sharing_problem(8, 4, 3, 2) == (
        "4 processes on a node with 2 GPUs: the pools share a node's GPUs, each needing one for each of its processes "
        "there, and node 0 has 4 trainer and 0 rollout processes; launch fewer, or give each pool at most 2 a node"
    )
    # two nodes of 2 processes with a GPU each, 2 + 2: launch ranks fill node 0 with the trainer's two
    assert "node 0 has 2 trainer and 0 rollout processes" in (sharing_problem(4, 2, 2, 1) or "")
    # the weights cross GPU to GPU (NCCL) where each process has a GPU of its own; where the pools share, trainer rank
    # 0 and a rollout process hold one GPU, which an NCCL group cannot: host copies over gloo, as on a CPU
    assert weights_on_gpus("cuda", 8, 8) and weights_on_gpus("cuda", 2, 4)
    assert not weights_on_gpus("cuda", 2, 1) and not weights_on_gpus("cuda", 3, 2) and not weights_on_gpus("cpu", 2, 0)


def test_a_one_gpu_machine_takes_a_trainer_and_a_rollout_process_and_not_two_of_one_pool(monkeypatch, capsys):
    """The device count is mocked (a hardware boundary): one GPU, a launch of 2 (1 + 1) passes the device check (and
    fails at the next, torchrun's rendezvous missing, past it), one of 3 (2 + 1) is refused by name, in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for world in ("2", "3"):
        for name, value in {"RANK": "0", "WORLD_SIZE": world, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": world}.items():
            monkeypatch.setenv(name, value)
        arguments = ["--config-name=demo", "trainer.device=cuda", "rollout.n_gpus_per_node=1", "--cfg", "job"]
        code = one_step_off_main([*arguments, "data.train_batch_size=32"])
        err = capsys.readouterr().err
        if world == "2":
            assert code == 0 and "trainer.device" not in err, err
        else:
            assert code == 2 and err.count("\n") == 1, err
            assert "trainer.device='cuda': 3 processes on a node with 1 GPU: the pools share a node's GPUs" in err
            assert "node 0 has 2 trainer and 1 rollout processes" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("trainer", ["one-step-off", "fully-async"])
def test_on_the_gpu_one_trains_while_one_generates_the_pools_sharing_a_gpu_or_on_their_own(tmp_path, trainer):
    """The real device (scripts/gpu_kit.sh run --part async): a trainer and a rollout process, on one GPU when the
    machine has one (they share it), on two otherwise; 3 steps with the torch tool on step 2 (cuda activities): the
    staleness is verl's (one-step-off: 0, then 1; fully async, a sync every update, staleness 1: 0, then at most 1),
    the weights cross each step (GPU to GPU over NCCL on two GPUs, as host copies on one), and both pools' traces hold
    kernels of their GPU."""
    module, *settings = ASYNC_TRAINERS[trainer]
    command = one_step_off_command(
        tmp_path,
        *settings,
        *(("async_training.staleness_threshold=1",) if trainer == "fully-async" else ()),
        "rollout.n_gpus_per_node=1",
        "trainer.device=cuda",
        "trainer.total_training_steps=3",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        "global_profiler.global_tool_config.torch.contents=[cpu,cuda]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        "actor_rollout_ref.rollout.profiler.all_ranks=true",
        processes=2,
        module=module,
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    staleness = [steps[s]["training/off_policy/trajectory_staleness/max"] for s in (1, 2, 3)]
    if trainer == "one-step-off":
        assert staleness == [0.0, 1.0, 1.0]
    else:
        assert staleness[0] == 0.0 and max(staleness) <= 1.0
    assert all(steps[s]["timing_s/sync_rollout_weights"] > 0 for s in (2, 3))
    own_gpus = torch.cuda.device_count() >= 2  # one GPU each: over NCCL; one shared: host copies over gloo
    assert ("GPU to GPU over NCCL" if own_gpus else "as host copies over gloo") in result.stderr
    kernels = {}
    for trace in sorted((tmp_path / "profile").rglob("rank*.pt.trace.json*")):  # one a process of either pool
        data = gzip.decompress(trace.read_bytes()) if trace.suffix == ".gz" else trace.read_bytes()
        kernels[trace.name] = sum(1 for e in json.loads(data)["traceEvents"] if e.get("cat") == "kernel")
    assert len(kernels) == 2 and all(count > 0 for count in kernels.values()), kernels


def test_the_last_processes_of_the_launch_are_the_rollout_pool():
    pools = [pool_of(rank, 8, 2) for rank in range(8)]
    assert [p.name for p in pools] == ["trainer"] * 6 + ["rollout"] * 2
    assert [(p.rank, p.size) for p in pools] == [(r, 6) for r in range(6)] + [(0, 2), (1, 2)]
    assert {p.rollout_size for p in pools} == {2}
    assert rollout_pool_size(1, 2, 8) == 2 and rollout_pool_size(2, 1, 3) == 2
    for nodes, per_node, world in ((1, 0, 3), (1, 3, 3), (2, 2, 4)):
        with pytest.raises(ConfigError) as error:
            rollout_pool_size(nodes, per_node, world)
        assert str(error.value) == (
            f"rollout.nnodes={nodes} x rollout.n_gpus_per_node={per_node}: the rollout pool must have 1 to "
            f"{world - 1} of the launch's {world} processes (the others train); launch more processes (torchrun "
            "--nproc_per_node) or give the rollout fewer"
        )


def test_a_batchs_prompts_are_split_into_near_equal_contiguous_parts():
    items = list(range(7))
    assert [part(items, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [part(items[:2], r, 3) for r in range(3)] == [[0], [1], []]


def test_the_link_carries_orders_weights_and_batches_between_the_pools():
    """Three ranks of one launch (two train, one generates) as threads, each with its own store client and groups:
    trainer rank 0's order reaches the rollout process, the weights of two dtypes arrive bit for bit, and the rollout
    process's batch reaches both trainer ranks."""
    port, world, timeout = free_port(), 3, datetime.timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", port, None, True, timeout=timeout, use_libuv=False, wait_for_workers=False)
    weights = [torch.randn(5, 3), torch.randn(4).to(torch.bfloat16), torch.randn(2, 2)]
    seen: dict[int, Any] = {}

    def member(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout, use_libuv=False)
        link = Link(store, pool_of(rank, world, 1), timeout)
        if rank == 0:
            link.send({"order": "weights", "version": 3})
            seen["bytes sent"] = link.send_weights(weights)
        if rank == 2:
            seen["order"] = link.receive()
            received = [torch.zeros_like(w) for w in weights]
            seen["bytes received"] = link.receive_weights(received)
            seen["weights"] = received
        seen[rank] = link.exchange({"rows": [1, 2], "from": rank} if rank == 2 else None)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    del master
    assert seen["order"] == {"order": "weights", "version": 3}
    assert all(torch.equal(got, sent) for got, sent in zip(seen["weights"], weights, strict=True))
    assert seen["bytes sent"] == seen["bytes received"] == (15 + 4) * 4 + 4 * 2
    assert seen[0] == seen[1] == seen[2] == [{"rows": [1, 2], "from": 2}]


def rlprof_cli(*arguments: str) -> subprocess.CompletedProcess:
    """``python -m rlprof.cli ARGUMENTS`` as a user runs it, its output captured."""
    command = [sys.executable, "-m", "rlprof.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=ROOT)


def one_step_off_command(
    folder: Path, *overrides: str, processes: int = 3, module: str = "rlprof_train.one_step_off_policy"
) -> list[str]:
    """An asynchronous trainer's launch (``module``: the one-step-off one's, or the fully-async one's)."""
    command = trainer_command(folder, *SMALL_RUN, *overrides, prefix=(*torchrun(processes), "-m"))
    command[command.index("rlprof_train.main_ppo")] = module
    return command


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_runs_learning_does_not_depend_on_how_its_processes_are_split_between_the_pools(tmp_path):
    """Three processes, one generating or two (the split ``tune`` searches), the trainer computing the old log-probs:
    every learning metric tune's verification compares (GAE: the critic's too) is equal for the first 3 steps within
    its tolerance. The rollout samples each prompt from its own noise key (the same tokens whichever process samples
    it) and the losses are normalised by the whole batch's counts (the same gradient, and the same logged loss, on 1
    or 2 trainer processes)."""
    runs = []
    for rollout in (1, 2):
        folder = tmp_path / f"rollout{rollout}"
        command = one_step_off_command(
            folder,
            f"rollout.n_gpus_per_node={rollout}",
            "trainer.total_training_steps=3",
            "algorithm.rollout_correction.bypass_mode=false",
            "algorithm.adv_estimator=gae",  # a critic's loss too
            "actor_rollout_ref.actor.ppo_epochs=2",  # a second pass: a policy loss that is not 0 (on-policy it is)
        )
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [r for r in read_jsonl(folder / "logs" / "metrics.jsonl") if "actor/pg_loss" in r]
        runs.append([{key: r[key] for key in LEARNING_KEYS if key in r} for r in records])
    one, two = runs
    assert len(one) == len(two) == 3 and all(len(step) == 6 for step in one)
    assert all(step["actor/pg_loss"] != 0 and step["critic/vf_loss"] != 0 for step in one)
    for step, (a, b) in enumerate(zip(one, two, strict=True), start=1):
        assert a.keys() == b.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=RTOL, abs_tol=ATOL), (step, key, a[key], b[key])


@pytest.mark.slow
def test_two_train_while_one_generates_the_next_batch_a_version_behind(tmp_path):
    """2 trainer + 1 rollout processes, 3 steps, validation before and at steps 2 and 3 (the second with a batch in
    flight): each step waits for its batch, sends the weights and trains; batch 1 was sampled by the initial
    weights (staleness 0), every later one by the weights one update older than those it trains (1), as verl's
    one-step-off trainer; the rollout pool's sampling time is logged beside the step, not in its shares."""
    command = one_step_off_command(
        tmp_path,
        "rollout.n_gpus_per_node=1",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        "actor_rollout_ref.rollout.profiler.all_ranks=true",
        "actor_rollout_ref.actor.ppo_epochs=8",  # an update far longer than a generation: the trainer sets the pace
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[:3000]
    assert "rollout pool: the weights cross as host copies over gloo" in result.stderr  # the CPU's way
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records}
    assert sorted(steps) == [0, 1, 2, 3]
    assert all("val-core/rlprof/arithmetic/reward/mean@1" in steps[s] for s in (0, 2, 3))
    staleness = [steps[s]["training/off_policy/trajectory_staleness/max"] for s in (1, 2, 3)]
    assert staleness == [0.0, 1.0, 1.0]
    for s in (1, 2, 3):
        record = steps[s]
        assert {"timing_s/gen", "timing_s/sync_rollout_weights", "timing_s/generate_async"} <= set(record)
        assert "timing_s/update_weights" not in record  # the weights go at the next step, once its batch is in
        shares = sum(record[f"timing_share/{g}"] for g in ("rollout", "training", "other", "unaccounted"))
        assert shares == pytest.approx(1.0)
        assert record["timing_s/sync_rollout_weights"] < record["timing_s/step"]
    report = rlprof_cli("report", str(tmp_path / "logs"), "--format", "json")
    document = json.loads(report.stdout)
    assert document["breakdown"]["overlap_gain"] is None  # it overlaps already
    pipeline = {row["metric"]: row["median"] for row in document["pipeline"]}
    assert {
        "training/off_policy/trajectory_staleness/mean",
        "fully_async/trainer/idle_ratio",
        "fully_async/rollouter/idle_ratio",
        "fully_async/rollouter/wait_s/queue_full",
    } <= set(pipeline)
    (bound,) = [f for f in document["findings"] if f["rule"].startswith("async-")]
    assert bound["rule"] == "async-train-bound", document["findings"]  # the rollout waits, its batch handed over
    assert bound["evidence"]["rollouter_idle_ratio"] > 0.5 > bound["evidence"]["trainer_idle_ratio"]
    (sampling,) = [p for p in document["breakdown"]["phases"] if p["phase"] == "generate_async"]
    assert sampling["group"] == "concurrent"

    # every process of both pools records step 2's window, under its launch rank: on one clock, the rollout
    # process samples batch 3 while trainer rank 0 runs step 2
    entries = [json.loads(line) for line in (tmp_path / "profile" / "manifest.jsonl").read_text().splitlines()]
    sessions = [e for e in entries if e.get("kind") == "session"]
    assert sorted((e["rank"], e["world_size"]) for e in sessions) == [(0, 3), (1, 3), (2, 3)]
    timeline = tmp_path / "timeline.json"
    merged = rlprof_cli("timeline", str(tmp_path / "logs"), str(tmp_path / "profile"), "-o", str(timeline))
    assert merged.returncode == 0, merged.stderr
    assert "pipeline records of 3 processes" in merged.stdout
    events = json.loads(timeline.read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = {
        (lanes[e["pid"]].split(" ")[1], e["name"]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e["name"] in ("trainer/step", "rollout/generate_async")
    }
    step, sampled = spans[("0", "trainer/step")], spans[("2", "rollout/generate_async")]
    assert step[0] < sampled[0] < sampled[1] < step[1]
    traced = {label: pid for pid, label in lanes.items() if "pipeline" not in label and label != "sample lives"}
    named = {label.split(" ")[1]: label.split(" ")[2] for label in traced}  # each lane by its pool
    assert named == {"0": "trainer", "1": "trainer", "2": "rollout"}
    assert {label for label in lanes.values() if "pipeline" in label} == {
        "rank 0 trainer pipeline",
        "rank 1 trainer pipeline",
        "rank 2 rollout pipeline",
    }

    # each prompt's samples, from their sampling to their update, on the traces' clock: step 2's batch is sampled
    # while step 1 trains and trained in step 2 (the traced step: its trainer/step span holds the training)
    lives = sample_lives(events, next(pid for pid, label in lanes.items() if label == "sample lives"))
    consumed = [r for rank in (0, 1) for r in read_jsonl(tmp_path / "logs" / "pipeline" / f"rank{rank}.jsonl")]
    groups = {(r["step"], str(r["uid"])) for r in consumed if r["event"] == "sample"}
    assert sorted((life["args"]["step"], life["uid"]) for life in lives) == sorted(groups)  # each group once
    for life in lives:
        phases = life["phases"]
        assert [name for name, _, _ in phases] == ["generating", "queued", "training"]
        assert all(began <= ended for _, began, ended in phases)
        assert phases[0][2] <= phases[1][1] and phases[1][2] <= phases[2][1]  # one after the other
        assert life["args"]["consumed_version"] - life["args"]["version"] == (life["args"]["step"] > 1)
    traced_step = [life for life in lives if life["args"]["step"] == 2 and life["args"]["trainer_rank"] == 0]
    assert traced_step
    for life in traced_step:
        _, began, ended = life["phases"][2]
        assert step[0] - 1e3 <= began and ended <= step[1] + 1e3  # within trainer/step 2 (1 ms: two clocks' reads)

    # the pipeline's metrics are what an independent count of the run's own records gives
    recounted = recount(tmp_path / "logs" / "pipeline", trainer_ranks=(0, 1), rollout_rank0=2)
    for s in (1, 2, 3):
        assert {k: steps[s][k] for k in recounted[s]} == pytest.approx(recounted[s], abs=1e-9), s


def sample_lives(events: list[dict], pid: int) -> list[dict]:
    """The ``sample lives`` lane's prompts: each one's uid, args and (phase, began, ended) in trace µs, its phases
    found by their args (the prompt's uid, step and trainer rank) on its row."""
    lives: dict[tuple, dict] = {}
    mine = [e for e in events if e.get("pid") == pid and e.get("ph") == "X"]
    for event in (e for e in mine if e["name"].startswith("prompt ")):
        uid, args = event["name"].removeprefix("prompt "), event["args"]
        lives[(uid, args["step"], args["trainer_rank"])] = {"uid": uid, "args": args, "phases": [], "row": event["tid"]}
    for event in (e for e in mine if not e["name"].startswith("prompt ")):
        life = lives[(event["args"]["uid"], event["args"]["step"], event["args"]["trainer_rank"])]
        assert event["tid"] == life["row"]
        life["phases"].append((event["name"], event["ts"], event["ts"] + event["dur"]))
    return list(lives.values())


POOL_BACKENDS = {
    "vllm": (
        "--config-name=demo",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "algorithm.rollout_correction.bypass_mode=false",  # the actor recomputes the old log-probs: compared
    ),
    "multi-turn hf": ("--config-name=tool_demo", "actor_rollout_ref.rollout.n=2"),
}
POOL_CASES = [
    # CI time: in the test command's long runs; a vLLM rollout process also runs in the test command, in verl's
    # one-step-off GRPO script (test_verl_scripts.py)
    pytest.param("vllm", marks=pytest.mark.long),
    # multi-turn in a rollout process also runs in the test command, in the fully-async trainer's partial rollouts
    pytest.param("multi-turn hf", marks=pytest.mark.long),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", POOL_CASES)
def test_the_rollout_pool_runs_vllm_and_multi_turn_tool_rollouts(tmp_path, backend):
    """One process trains, one generates, 2 steps: with a vLLM engine in the rollout process, and the hf backend
    over several turns calling the calculator tool there. Each batch arrives with what the backend returned (the tool
    calls and turns; the engine's log-probs, equal to the actor's on batch 1, sampled by the same initial weights)
    and the staleness is verl's."""
    if backend == "vllm":
        pytest.importorskip("vllm")
    config, *overrides = POOL_BACKENDS[backend]
    command = one_step_off_command(
        tmp_path, "rollout.n_gpus_per_node=1", "trainer.total_training_steps=2", *overrides, processes=2
    )
    command[command.index("--config-name=demo")] = config
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {r["step"]: r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")}
    assert [steps[s]["training/off_policy/trajectory_staleness/max"] for s in (1, 2)] == [0.0, 1.0]
    if backend == "vllm":
        assert json.loads((tmp_path / "logs" / "run.json").read_text())["rollout"]["name"] == "vllm"
        assert steps[1]["rollout/log_prob_abs_diff"] < 1e-4  # on-policy: the engine's log-probs are the actor's
        assert steps[2]["rollout/log_prob_abs_diff"] > steps[1]["rollout/log_prob_abs_diff"]  # one update behind
    else:
        assert all(steps[s]["num_turns/max"] >= 3 and steps[s]["tools/calculator/calls"] > 0 for s in (1, 2))


def overlap(waits: list[dict], window: dict) -> float:
    """The seconds of ``waits`` inside ``window`` (records of one process: one clock)."""
    return sum(max(0.0, min(w["ended"], window["ended"]) - max(w["began"], window["began"])) for w in waits)


def recount(folder: Path, trainer_ranks: tuple[int, ...], rollout_rank0: int) -> dict[int, dict[str, float]]:
    """Each step's staleness and idle ratios counted again from the run's pipeline records
    (rlprof.metrics.pipeline_records), by their definitions in rlprof.metrics.pipeline: staleness over every
    trajectory the step consumed, the trainer's idle ratio each trainer rank's waits inside its step's window over the
    window (their mean over the ranks), the rollouter's: rollout rank 0's waits inside its window that the step's
    weight sync ended, over that window. Every trajectory is consumed once, by the step its rows were sampled for,
    and was drawn under the weights the rollout process had."""
    records = {int(path.stem.removeprefix("rank")): read_jsonl(path) for path in folder.glob("rank*.jsonl")}
    assert sorted(records) == sorted((*trainer_ranks, rollout_rank0))
    samples = [r for rank in trainer_ranks for r in records[rank] if r["event"] == "sample"]
    assert len({(r["step"], r["uid"], i) for i, r in enumerate(samples)}) == len(samples)
    generated = [r for r in records[rollout_rank0] if r["event"] == "generate" and r["step"] is not None]
    out: dict[int, dict[str, float]] = {}
    for step in sorted({r["step"] for r in samples}):
        consumed = [r for r in samples if r["step"] == step]
        assert sum(g["rows"] for g in generated if g["step"] == step) == len(consumed)  # one rollout process here
        staleness = [r["consumed_version"] - r["version"] for r in consumed]
        (sampling,) = [g for g in generated if g["step"] == step]
        assert {r["version"] for r in consumed} == {sampling["version"]}
        (step_window,) = [r for r in records[trainer_ranks[0]] if r["event"] == "window" and r["step"] == step]
        (rollouter,) = [  # the rollouter's window the step's sync ended (one host: one monotonic clock)
            r
            for r in records[rollout_rank0]
            if r["event"] == "window" and step_window["began"] < r["ended"] < step_window["ended"]
        ]
        out[step] = recounted_figures(records, trainer_ranks, rollout_rank0, step, staleness, rollouter)
    return out


def recounted_figures(
    records: dict[int, list[dict]],
    trainer_ranks: tuple[int, ...],
    rollout_rank0: int,
    step: int,
    staleness: list[int],
    rollouter: dict,
) -> dict[str, float]:
    """A step's staleness spread over ``staleness`` (each trajectory it consumed), the trainer's idle ratio (each
    trainer rank's waits inside its step's window over the window, their mean over the ranks) and the rollouter's
    (rollout rank 0's waits inside ``rollouter``, its window that the step's weight sync ended, over that window)."""
    ratios = []
    for rank in trainer_ranks:
        (window,) = [r for r in records[rank] if r["event"] == "window" and r["step"] == step]
        waits = [r for r in records[rank] if r["event"] == "wait"]
        ratios.append(overlap(waits, window) / (window["ended"] - window["began"]))
    rollouter_waits = [r for r in records[rollout_rank0] if r["event"] == "wait"]
    version_time = rollouter["ended"] - rollouter["began"]
    return {
        "training/off_policy/trajectory_staleness/mean": statistics.fmean(staleness),
        "training/off_policy/trajectory_staleness/max": max(staleness),
        "training/off_policy/trajectory_staleness/min": min(staleness),
        "fully_async/trainer/idle_ratio": statistics.fmean(ratios),
        "fully_async/rollouter/version_time": version_time,
        "fully_async/rollouter/idle_ratio": overlap(rollouter_waits, rollouter) / version_time,
    }


SAME = (*SMALL_RUN, "trainer.total_training_steps=6", "algorithm.rollout_correction.bypass_mode=true")
"""One config for the runs of :func:`small_runs` (verl's one-step-off bypass mode, set for the synchronous run too)."""


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory) -> Path:
    """The config SAME run on two processes each: ``first`` one-step-off (one trains, one generates), ``resumed``
    the same stopped after step 3 (its checkpoint) and started again, ``sync`` synchronous (both train and
    generate); their log folders under the returned folder."""
    root = tmp_path_factory.mktemp("runs")
    one_step_off = (*SAME, "rollout.n_gpus_per_node=1")
    runs = [
        ("first", one_step_off_command(root / "first", *one_step_off, processes=2)),
        ("resumed", one_step_off_command(root / "resumed", *one_step_off, *STOP_AT_3, processes=2)),
        ("resumed", one_step_off_command(root / "resumed", *one_step_off, processes=2)),
        ("sync", trainer_command(root / "sync", *SAME, prefix=(*torchrun(2), "-m"))),
    ]
    for name, command in runs:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return root


STOP_AT_3 = ("trainer.total_training_steps=3", "trainer.save_freq=3")
"""The first launch of ``resumed``: 3 steps and their checkpoint (the second launch resumes from it, to step 6)."""


@pytest.mark.long  # CI time: in the test command's long runs
def test_the_same_seed_samples_the_same_batches(small_runs):
    """Two runs of one config (one process trains, one generates): every step's rewards and response lengths agree
    up to step 3, where ``resumed`` stopped, as two runs of the synchronous trainer do (each response's sampling
    noise is keyed by its round and prompt)."""
    runs = []
    for name in ("first", "resumed"):
        records = read_jsonl(small_runs / name / "logs" / "metrics.jsonl")
        runs.append([(r["step"], r["critic/score/mean"], r["response_length/mean"]) for r in records])
    assert len(runs[0]) == 6 and runs[0][:3] == runs[1][:3]


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_resumed_run_continues_the_parameter_versions_with_no_prompt_trained_twice(small_runs):
    """``resumed`` started again from its step-3 checkpoint: both pools start at parameter version 3 (the rollout
    process gets the saved weights: batch 4 is sampled by them, staleness 0, as a first step), then the versions go
    on (batch 5 by version 3, trained from 4, ...); the prompts of steps 4-6 are the uninterrupted run's, and no
    prompt is consumed twice across the two launches (the records of both segments, one file)."""
    metrics = {r["step"]: r for r in read_jsonl(small_runs / "resumed" / "logs" / "metrics.jsonl")}
    staleness = [metrics[s]["training/off_policy/trajectory_staleness/max"] for s in range(1, 7)]
    assert staleness == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]

    def consumed(name: str) -> list[dict]:
        records = read_jsonl(small_runs / name / "logs" / "pipeline" / "rank0.jsonl")
        return [r for r in records if r["event"] == "sample"]

    resumed, first = consumed("resumed"), consumed("first")
    versions = {s: {(r["version"], r["consumed_version"]) for r in resumed if r["step"] == s} for s in range(1, 7)}
    assert versions == {1: {(0, 0)}, 2: {(0, 1)}, 3: {(1, 2)}, 4: {(3, 3)}, 5: {(3, 4)}, 6: {(4, 5)}}
    prompts = {s: sorted({r["uid"] for r in resumed if r["step"] == s}) for s in range(1, 7)}
    assert prompts == {s: sorted({r["uid"] for r in first if r["step"] == s}) for s in range(1, 7)}
    assert len({uid for p in prompts.values() for uid in p}) == sum(len(p) for p in prompts.values())  # once each


@pytest.mark.long  # CI time: in the test command's long runs
def test_compare_sets_a_synchronous_run_beside_a_one_step_off_run_of_the_same_config(small_runs):
    """The same config on two processes each: synchronous (both train and generate) and one-step-off (one trains,
    one generates; verl's bypass mode in both). ``rlprof compare`` names each run's processes, finds the rollout
    pool's key alone in the config diff, no note (equal processes), the step time's ratio with its interval, and the
    asynchronous run's pipeline metrics beside none for the synchronous one."""
    compared = rlprof_cli(
        "compare", *(str(small_runs / name / "logs") for name in ("sync", "first")), "--format", "json"
    )
    assert compared.returncode == 0, compared.stderr
    data = json.loads(compared.stdout)
    assert data["processes"] == [
        {"trainer": 2, "rollout": 0, "per_node": 2},
        {"trainer": 1, "rollout": 1, "per_node": 2},
    ]
    jsonschema.validate(data, schema("compare"))
    assert data["notes"] == []
    assert [d["key"] for d in data["config_diff"]] == ["rollout.n_gpus_per_node"]
    (step,) = [v for v in data["speed"] if v["metric"] == "timing_s/step"]
    assert step["versus_first"][1]["low"] <= step["versus_first"][1]["value"] <= step["versus_first"][1]["high"]
    pipeline = {row["metric"]: row["medians"] for row in data["pipeline"]}
    assert pipeline["training/off_policy/trajectory_staleness/mean"] == [None, 1.0]
    assert pipeline["fully_async/trainer/idle_ratio"][0] is None and pipeline["fully_async/trainer/idle_ratio"][1] >= 0
    assert f"timing_s/generate_async: not logged by {small_runs / 'sync' / 'logs'}" in data["missing"]


def test_the_rollout_pools_sampling_beside_the_step_is_in_no_share_of_it():
    shares = timing_shares({"step": 1.0, "gen": 0.2, "generate_async": 0.9, "update_actor": 0.5})
    assert shares == pytest.approx(
        {
            "timing_share/rollout": 0.2,
            "timing_share/training": 0.5,
            "timing_share/other": 0.0,
            "timing_share/unaccounted": 0.3,
        }
    )


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_a_rollout_pool_is_the_one_step_off_trainers_and_its_limits_are_named(tmp_path):
    """main_ppo refuses a rollout pool and hybrid_engine=False, naming the one-step-off entry; the one-step-off
    trainer names each setting its rollout pool does not run yet, with its pool size checked against the launch,
    all in one line."""
    env = subprocess_env(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="3")

    def checked(module: str, *overrides: str) -> subprocess.CompletedProcess:
        """The config of a launch of 3 processes, checked and printed (``--cfg job``), nothing run."""
        command = [sys.executable, "-m", module, "--config-name=demo", "--cfg", "job", *overrides]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)

    result = checked("rlprof_train.main_ppo", "rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=False")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    for key in ("rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=False"):
        assert f"{key}: a rollout pool apart from the trainer's is verl's one-step-off and fully-async" in line
    assert "python -m rlprof_train.one_step_off_policy (with rollout.nnodes" in line
    assert "python -m rlprof_train.fully_async_main" in line
    off = "rlprof_train.one_step_off_policy"
    result = checked(
        off,
        "rollout.n_gpus_per_node=3",
        "actor_rollout_ref.model.lora_rank=8",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    for expected in (
        "rollout.nnodes=1 x rollout.n_gpus_per_node=3: the rollout pool must have 1 to 2 of the launch's 3",
        "actor_rollout_ref.model.lora_rank=8: LoRA is not built for the one-step-off trainer's rollout pool yet",
        "algorithm.filter_groups.enable=True: is not built for the one-step-off trainer's rollout pool yet",
    ):
        assert expected in line
    result = checked(off, "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=3")
    assert result.returncode == 2
    assert (
        "trainer.n_gpus_per_node=3: this launch has 3 processes per node, 1 of them the rollout pool's "
        "(rollout.n_gpus_per_node), so 2 train; start it with torchrun --nproc_per_node 4 or set "
        "trainer.n_gpus_per_node=2"
    ) in result.stderr
    result = checked(
        off, "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=False"
    )
    assert result.returncode == 0, result.stderr
    assert "bypass_mode: true" in result.stdout  # verl's one-step-off default


ASYNC_TRAINERS = {
    "one-step-off": ("rlprof_train.one_step_off_policy",),
    "fully-async": ("rlprof_train.fully_async_main", "async_training.trigger_parameter_sync_step=1"),
}
"""Each asynchronous trainer's module and what makes its steps as short as the other's (one update a step)."""


def started_run(
    tmp_path: Path, steps_done: int, trainer: str = "one-step-off"
) -> tuple[subprocess.Popen, dict[int, psutil.Process], Path]:
    """A long run of an asynchronous ``trainer`` (one process trains, one generates) once it logged ``steps_done``
    steps, with its processes by launch rank (read from each one's environment as torchrun started it) and its
    stderr's file."""
    module, *settings = ASYNC_TRAINERS[trainer]
    command = one_step_off_command(
        tmp_path,
        "rollout.n_gpus_per_node=1",
        "trainer.total_training_steps=100000",
        *settings,
        processes=2,
        module=module,
    )
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            env=subprocess_env(),
            cwd=ROOT,
            preexec_fn=foreground_sigint,  # noqa: PLW1509  (one call before exec)
            start_new_session=True,
        )
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps_done):
        assert process.poll() is None and time.time() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.5)
    ranks = {}
    for child in psutil.Process(process.pid).children(recursive=True):
        rank = child.environ().get("RANK")
        if rank is not None and module in child.cmdline():
            ranks[int(rank)] = child
    assert sorted(ranks) == [0, 1]
    return process, ranks, stderr


def left_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_a_killed_trainer_process_ends_the_launch_with_nothing_left(tmp_path):
    process, ranks, _ = started_run(tmp_path, 3)
    ranks[0].kill()
    process.wait(timeout=120)
    assert process.returncode != 0
    assert not left_running(list(ranks.values()))


NAMED_ON_SIGTERM = """
import os, signal, socket, subprocess, sys, time, types
from rlprof_train.rollout_pool import Member, PooledRollout
reaped = subprocess.Popen([sys.executable, "-c", "pass"])
reaped.wait()
zombie = subprocess.Popen([sys.executable, "-c", "pass"])
time.sleep(2)  # it ends; nobody reaps it
host = socket.gethostname()
pooled = PooledRollout(None, types.SimpleNamespace(rank=0), lambda: None, 0)
pooled.members = [Member(0, 1, host, reaped.pid), Member(1, 2, host, zombie.pid), Member(2, 3, host, os.getpid())]
pooled.members += [Member(3, 4, "elsewhere", 1)] if sys.argv[1] == "ended" else []
if sys.argv[1] == "alive":
    pooled.members = pooled.members[2:]
pooled.name_the_ended_on_sigterm()
print(reaped.pid, zombie.pid, os.getpid(), flush=True)
if sys.argv[1] == "failing":  # this rank's error unwinds (the pool closed) when torchrun's SIGTERM comes
    pooled.abandon()
    pooled.close()
    os.kill(os.getpid(), signal.SIGTERM)
    print("error on rank 0: its own line", file=sys.stderr)
    sys.exit(1)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


@pytest.mark.parametrize("members", ["ended", "alive", "failing"])
def test_sigterm_names_the_rollout_processes_of_this_host_that_ended(members):
    """torchrun ends a node's processes within 0.1 s of one dying, often before the trainer's next exchange with the
    dead rollout process fails: its SIGTERM names the rollout processes of this host that ended (exited or a zombie),
    then the process dies of it as before; none ended (a Ctrl-C, a stopped job): no line. A rank whose exchange
    failed first and that is unwinding its own error (the pool closed, its line not yet printed) is not cut short:
    it ends with its own line alone (CI on 2026-12-07 lost that line to the SIGTERM)."""
    run = subprocess.run([sys.executable, "-c", NAMED_ON_SIGTERM, members], capture_output=True, text=True, timeout=60)
    if members == "failing":
        assert (run.returncode, run.stderr) == (1, "error on rank 0: its own line\n")
        return
    assert run.returncode == -signal.SIGTERM, run.stderr
    host = socket.gethostname()
    if members == "alive":
        assert run.stderr == ""
        return
    reaped, zombie, me = (int(pid) for pid in run.stdout.split())
    members = [(0, 1, reaped), (1, 2, zombie), (2, 3, me)]
    everyone = "; ".join(f"rollout rank {r} (launch rank {g}, pid {p} on {host})" for r, g, p in members)
    everyone += "; rollout rank 3 (launch rank 4, pid 1 on elsewhere)"
    ended = "; ".join(f"rollout rank {r} (launch rank {g}, pid {p} on {host})" for r, g, p in members[:2])
    assert run.stderr.splitlines() == [
        f"error on rank 0: PoolLost: the rollout pool ({everyone}) stopped answering while this process worked on its "
        f"step: {ended} ended, and the launcher ends this process (SIGTERM)"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ASYNC_TRAINERS)
def test_a_killed_rollout_process_stops_the_trainer_naming_it(tmp_path, trainer):
    """kill -9 of the rollout process: the trainer stops within seconds with one line naming it (its pool rank,
    launch rank, pid and host) and what it was waiting for; the launch exits non-zero, nothing left."""
    process, ranks, stderr = started_run(tmp_path, 3, trainer)
    killed = ranks[1].pid
    ranks[1].kill()
    began = time.time()
    process.wait(timeout=120)
    took = time.time() - began
    print(f"\nthe launch ended {took:.1f} s after kill -9 of the rollout process, exit {process.returncode}")
    assert process.returncode != 0 and took < 30
    named = (
        f"the rollout pool (rollout rank 0 (launch rank 1, pid {killed} on {socket.gethostname()})) stopped answering"
    )
    (line,) = [line for line in stderr.read_text().splitlines() if line.startswith("error on rank 0: ")]
    assert line.startswith(f"error on rank 0: PoolLost: {named} while this process "), line
    assert not left_running(list(ranks.values()))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ASYNC_TRAINERS)
def test_ctrl_c_leaves_no_process_of_either_pool(tmp_path, trainer):
    """Ctrl-C (SIGINT to the launch's process group, as a terminal sends it): both pools' processes end."""
    process, ranks, _ = started_run(tmp_path, 2, trainer)
    os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=120)
    assert process.returncode != 0
    assert not left_running(list(ranks.values()))


LEARNING_UPDATES = 60
SYNC_SEEDS = (1, 2, 3, 4, 5, 6)
"""Six: the run-to-run spread of three seeds can be far below the runs' own noise (seeds 1-3 of the synchronous
trainer's mean training reward lay 0.0007 apart on 2026-12-07, seeds 4-6 0.283-0.291 beside them, a step's reward
varying about 0.04 between seeds)."""
ASYNC_SEEDS = (1, 2)
VAL_KEY = "val-core/rlprof/arithmetic/reward/mean@1"
FULLY_ASYNC_LEARNING = ("async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=2")
"""The fully-async run the issue asks to learn as the synchronous one: staleness 0.5, a sync every 2 updates (each
of the demo's 32 prompt groups: a synchronous step's)."""


def learning_run(folder: Path, seed: int, trainer: str) -> list[dict]:
    """The demo's GRPO for :data:`LEARNING_UPDATES` policy updates of 32 prompt groups each, validated at the end:
    ``sync`` one process; ``one-step-off`` one that trains and one that generates; ``fully-async`` so too, a step of
    2 updates (:data:`FULLY_ASYNC_LEARNING`): the same samples in all."""
    steps = LEARNING_UPDATES // (2 if trainer == "fully-async" else 1)
    base = ("trainer.val_before_train=false", f"trainer.seed={seed}", f"trainer.total_training_steps={steps}")
    base += (f"trainer.test_freq={steps}",)
    if trainer == "sync":
        command = trainer_command(folder, *base)
    else:
        module, *_ = ASYNC_TRAINERS[trainer]
        extra = FULLY_ASYNC_LEARNING if trainer == "fully-async" else ()
        command = trainer_command(folder, *base, *extra, "rollout.n_gpus_per_node=1", prefix=(*torchrun(2), "-m"))
        command[command.index("rlprof_train.main_ppo")] = module
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]


def learning_figures(records: list[dict], trainer: str) -> tuple[float, float]:
    """(mean training reward over the updates, final validation reward) of a learning run."""
    rewards = [r["critic/score/mean"] for r in records if r["step"] > 0 and "critic/score/mean" in r]
    assert len(rewards) * (2 if trainer == "fully-async" else 1) == LEARNING_UPDATES  # a step: its updates' mean
    (last,) = [r[VAL_KEY] for r in records if VAL_KEY in r]
    return statistics.fmean(rewards), last


@pytest.fixture(scope="module")
def sync_learning(tmp_path_factory) -> list[tuple[float, float]]:
    root = tmp_path_factory.mktemp("learning")
    return [learning_figures(learning_run(root / f"sync{seed}", seed, "sync"), "sync") for seed in SYNC_SEEDS]


@pytest.mark.long  # six synchronous 60-update runs, then two of each asynchronous trainer: about 4 minutes
@pytest.mark.parametrize("trainer", ASYNC_TRAINERS)
def test_an_async_trainer_learns_as_the_synchronous_trainer_within_the_run_to_run_spread(
    trainer, sync_learning, tmp_path
):
    """The demo's GRPO, 60 updates of 32 prompt groups: six seeds of the synchronous trainer give the run-to-run
    spread of the final validation reward; two seeds of each asynchronous trainer (one-step-off: each batch sampled by
    weights one update old; fully async: staleness 0.5, a sync every 2 updates; the rollout's log-probs as the old
    ones) land within it, widened by the spread itself, and their mean training reward is no lower than the
    synchronous runs' lowest less their spread."""
    runs = [learning_run(tmp_path / f"{trainer}{seed}", seed, trainer) for seed in ASYNC_SEEDS]
    figures = [learning_figures(r, trainer) for r in runs]
    print(f"\n(mean reward, final validation reward): synchronous {sync_learning}; {trainer} {figures}")
    means, finals = [f[0] for f in sync_learning], [f[1] for f in sync_learning]
    spread = max(finals) - min(finals)
    for mean, final in figures:
        assert min(finals) - spread <= final <= max(finals) + spread, (final, finals)
        assert mean >= min(means) - (max(means) - min(means)), (mean, means)
    stalest = [r["training/off_policy/trajectory_staleness/max"] for r in runs[0] if r["step"] > 1]
    assert stalest and all(value == 1.0 for value in stalest)
