"""The trainer under faults, run for real (issues found by trying to break it): a second run on the same folders,
a fresh start over an earlier run's log, damaged checkpoints, a NaN reward, a diverging learning rate, an error on
one of two ranks, and a dashboard keyed on the seed's metric names."""

from __future__ import annotations

import gzip
import json
import math
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlprof.manifest import read_manifest
from rlprof.tracking.jsonl import read_jsonl
from rlprof_train import checkpoint

from conftest import ROOT, SMALL_RUN, foreground_sigint, free_port, subprocess_env

pytestmark = pytest.mark.slow


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


def held_by(pid: int) -> bool:
    """Whether process ``pid`` still holds a CUDA context, asked from this (a second) process of the machine."""
    listed = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, check=True
    )
    return str(pid) in listed.stdout.split()


def command(folder: Path, *overrides: str, prefix: tuple[str, ...] = (sys.executable, "-m")) -> list[str]:
    return [
        *prefix,
        "rlprof_train.main_ppo",
        "--config-name=demo",
        *SMALL_RUN,
        'trainer.logger=["file"]',
        f"trainer.log_dir={folder}/logs",
        f"trainer.default_local_dir={folder}/ckpt",
        f"global_profiler.save_path={folder}/profile",
        *overrides,
    ]


def run(folder: Path, *overrides: str, expect: int = 0, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command(folder, *overrides, **kwargs),
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        cwd=ROOT,
    )
    assert result.returncode == expect, f"rc={result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def steps(folder: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(folder / "logs" / "metrics.jsonl")]


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_fresh_start_never_appends_to_an_earlier_runs_log(tmp_path):
    run(tmp_path, "trainer.total_training_steps=2")
    result = run(tmp_path, "trainer.total_training_steps=4")
    assert steps(tmp_path) == [1, 2, 3, 4]  # not 1 2 1 2 3 4
    (archived,) = (tmp_path / "logs" / "previous").iterdir()
    assert [r["step"] for r in read_jsonl(archived)] == [1, 2]
    assert "held the records of an earlier run" in result.stderr


def test_a_second_run_on_the_same_folders_is_refused_naming_the_first(tmp_path):
    env = subprocess_env(OMP_NUM_THREADS="1")
    first = subprocess.Popen(
        command(tmp_path, "trainer.total_training_steps=6", "trainer.save_freq=2"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "logs" / ".rlprof.lock").exists() or not (tmp_path / "logs" / ".rlprof.lock").stat().st_size:
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.1)
    first.send_signal(signal.SIGSTOP)  # held while the second starts: on a loaded machine the first could finish
    try:
        second = run(tmp_path, "trainer.total_training_steps=6", expect=2)
    finally:
        first.send_signal(signal.SIGCONT)
    assert f"is in use by another run (pid {first.pid} on host" in second.stderr
    assert len(second.stderr.strip().splitlines()[-1]) < 400
    _out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert checkpoint.saved_steps(tmp_path / "ckpt") == [2, 4, 6]


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run(tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=1")
    newest = tmp_path / "ckpt" / "global_step_3"
    model = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    model.write_bytes(model.read_bytes()[:100])  # truncated
    (tmp_path / "ckpt" / checkpoint.LATEST).write_text("")
    result = run(tmp_path, "trainer.total_training_steps=4", "trainer.save_freq=1")
    assert f"checkpoint {newest} is skipped" in result.stderr and "resumed from" in result.stderr
    assert "global_step_2 (next step 3)" in result.stderr
    assert steps(tmp_path) == [1, 2, 3, 4]


def test_a_full_disk_during_a_save_is_one_line_naming_the_folder_and_the_bytes_needed(tmp_path, small_disk):
    """Issue 27: a disk that fills during a checkpoint said "unexpected pos 2636992 vs 2636880" under a traceback.
    On a real 7 MiB tmpfs (a checkpoint here is 4.7 MiB): step 1's checkpoint fits, step 2's does not. One line
    names the folder, the bytes needed and free; the partial checkpoint is removed; the metrics of both steps and
    step 1's checkpoint are kept, and the run resumes from it on a larger disk."""
    disk = small_disk("7m")
    result = run(
        tmp_path, "trainer.total_training_steps=3", "trainer.save_freq=1", f"trainer.default_local_dir={disk}", expect=1
    )
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error on rank 0:")]
    assert (
        line.startswith(
            f"error on rank 0: No space left on device: the checkpoint of step 2 in {disk}/global_step_2 "
            "needs about 4.7 MiB, "
        )
        and "set trainer.default_local_dir to a larger disk" in line
    )
    assert "Traceback" not in result.stderr and "unexpected pos" not in result.stderr
    assert re.search(r"needs about 4\.7 MiB, [0-9.]+ MiB is free there;", line), line
    assert sorted(p.name for p in disk.iterdir() if p.name.startswith("global_step")) == ["global_step_1"]
    assert steps(tmp_path) == [1, 2]
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    (bigger / "global_step_1").mkdir()
    subprocess.run(["cp", "-a", f"{disk}/global_step_1/.", str(bigger / "global_step_1")], check=True)
    resumed = run(
        tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1", f"trainer.default_local_dir={bigger}"
    )
    assert "global_step_1 (next step 2)" in resumed.stderr


def test_a_nan_reward_stops_at_once_naming_the_data_source_and_a_sample(tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
    )
    result = run(tmp_path, f"custom_reward_function.path={reward}", "trainer.total_training_steps=3", expect=1)
    assert "returned nan (not finite)" in result.stderr and "data_source='rlprof/arithmetic'" in result.stderr
    assert "Traceback" in result.stderr  # an error during training keeps its traceback


def test_a_diverging_learning_rate_is_stopped_by_the_guard_not_a_sampling_crash(tmp_path):
    # at lr 1e9 the policy is destroyed after one step; whether its values go on as NaN every step or (now, at this
    # seed) stay finite but degenerate with an infinite gradient norm now and then depends on float rounding: the
    # first non-finite step stops it (trainer.nonfinite_patience=1 by default; counting consecutive steps when it
    # is raised: tests/rlprof_train/test_trainer_units.py)
    result = run(
        tmp_path,
        "actor_rollout_ref.actor.optim.lr=1e9",
        "trainer.total_training_steps=20",
        "trainer.save_freq=1",
        expect=1,
    )
    assert "training diverged: non-finite values at step" in result.stderr
    assert "actor_rollout_ref.actor.optim.lr (now 1e+09)" in result.stderr
    assert "multinomial" not in result.stderr
    bad = {
        r["step"]
        for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")
        if any(isinstance(v, float) and not math.isfinite(v) for v in r.values())
    }
    assert bad and not {s for s in checkpoint.saved_steps(tmp_path / "ckpt") if s in bad}  # none from a bad step


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_loss_under_bf16_stops_at_the_first_step_that_shows_it(tmp_path, device):
    """Issue 49.6: in bfloat16 (and float32) no loss scaler skips a step whose loss or gradients overflowed: its
    update reaches the weights, so the first such step stops the run, naming the step and the metric, as a NaN
    reward does. A finite reward of 1e30 squares past bf16's range in the critic's value loss at step 1."""
    reward = tmp_path / "huge_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1e30\n")
    result = run(
        tmp_path,
        f"custom_reward_function.path={reward}",
        f"trainer.device={device}",
        "actor_rollout_ref.model.dtype=bfloat16",
        "algorithm.adv_estimator=gae",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        expect=1,
    )
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error on rank 0: TrainingDiverged")]
    print(f"\n{line}")
    assert "non-finite values at step 1 (trainer.nonfinite_patience=1), last: " in line and "critic/vf_loss=" in line
    assert "Traceback" in result.stderr  # an error during training keeps its traceback
    assert checkpoint.saved_steps(tmp_path / "ckpt") == []  # none from the bad step


def test_an_error_on_one_of_two_ranks_ends_both_with_the_traceback_and_no_hang(tmp_path):
    reward = tmp_path / "rank1_fails.py"
    reward.write_text(
        textwrap.dedent("""
        import os
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if os.environ["RANK"] == "1":
                raise ValueError("the grader on rank 1 has no answer key")
            return 0.0
    """)
    )
    prefix = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m")
    start = time.monotonic()
    result = subprocess.run(
        command(
            tmp_path,
            f"custom_reward_function.path={reward}",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            prefix=prefix,
        ),
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        cwd=ROOT,
    )
    assert result.returncode not in (0, 2) and time.monotonic() - start < 300
    assert "ValueError: the grader on rank 1 has no answer key" in result.stderr and "Traceback" in result.stderr
    assert "error on rank 1" in result.stderr


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_stopped_rank_ends_the_job_after_the_collective_timeout_naming_it(tmp_path):
    """Rank 1 frozen (SIGSTOP) mid-run: rank 0's collective gives up after trainer.collective_timeout_s instead of
    torch's 30 minutes (DeepSpeed's groups included), and its last line names rank 1 and where both ranks were."""

    import psutil

    prefix = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m")
    overrides = ("trainer.total_training_steps=200", "trainer.collective_timeout_s=15")
    job = subprocess.Popen(
        command(tmp_path, *overrides, prefix=prefix),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        cwd=ROOT,
    )
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        assert job.poll() is None
        time.sleep(0.2)
    ranks = psutil.Process(job.pid).children(recursive=True)
    (frozen,) = [p for p in ranks if p.environ().get("RANK") == "1"]
    frozen.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        _, err = job.communicate(timeout=15 + 120)
        left = [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for process in ranks:
            if process.is_running():
                process.kill()
    assert job.returncode not in (0, None) and time.monotonic() - stopped_at < 15 + 120
    (line,) = [line for line in err.splitlines() if line.startswith("error on rank 0:")]
    assert "a collective did not complete within trainer.collective_timeout_s=15 s while rank 0 was in " in line
    assert "stopped answering: rank 1 (rank 1 in " in line
    assert left == []  # the launcher took the frozen rank down with the job: nothing left running


def test_a_dashboard_keyed_on_the_seeds_metric_names_finds_every_key(tmp_path, monkeypatch):
    seed_keys = [
        "train/loss",
        "train/value_loss",
        "train/entropy",
        "train/kl_divergence",
        "reward/mean",
        "reward/std",
        "reward/max",
        "reward/min",
        "throughput/samples_per_sec",
        "throughput/tokens_per_sec",
        "memory/allocated",
    ]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    run(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "trainer.total_training_steps=2",
        'trainer.logger=["file","tensorboard","wandb"]',
        "trainer.experiment_name=seed-dashboard",
    )
    jsonl = read_jsonl(tmp_path / "logs" / "metrics.jsonl")[-1]
    assert [k for k in seed_keys if k not in jsonl] == []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [k for k in seed_keys if k not in accumulator.Tags()["scalars"]] == []
    engine = ["rollout/engine/ttft_ms_p50", "rollout/engine/itl_ms_p99", "rollout/engine/batch_occupancy"]
    assert [k for k in engine if k not in jsonl or k not in accumulator.Tags()["scalars"]] == []  # the hf rollout's
    assert 0 < jsonl["rollout/engine/batch_occupancy"] <= 1
    from wandb_offline import read_run_history

    run_id = json.loads((tmp_path / "logs" / "wandb_run.json").read_text())["run_id"]
    history = read_run_history(tmp_path / "logs" / "wandb", run_id)
    assert [k for k in seed_keys if k not in history[-1]] == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_inside_a_step_writes_the_open_window_and_lists_only_complete_checkpoints(tmp_path, signum, device):
    """Issue 49.5: Ctrl-C (or a scheduler's SIGTERM) while step 2 runs, its torch window open and step 1 saved. The
    signal comes from inside the step (the reward of its first sample: on a GPU, the rollout's kernels are queued
    then), so it lands at the same point every run. The window's trace is written and readable, only step 1's
    checkpoint is listed and it resumes, the process is gone within seconds (and, on a GPU, holds no device memory,
    asked from a second process)."""
    reward = tmp_path / "interrupting_reward.py"
    reward.write_text(
        textwrap.dedent(f"""
        import os, time
        calls = 0
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            global calls
            calls += 1
            if calls == 9:  # the first sample of step 2 (4 prompts x 2 responses a step)
                open({str(tmp_path / "signalled")!r}, "w").write(str(time.time()))
                os.kill(os.getpid(), {int(signum)})
            return 0.0
        """)
    )
    process = subprocess.Popen(
        command(
            tmp_path,
            f"custom_reward_function.path={reward}",
            f"trainer.device={device}",
            "trainer.total_training_steps=4",
            "trainer.save_freq=1",
            "global_profiler.tool=torch",
            "global_profiler.steps=[2]",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        cwd=ROOT,
        preexec_fn=foreground_sigint,  # noqa: PLW1509  (one call before exec)
    )
    _, stderr = process.communicate(timeout=600)
    gone_after = time.time() - float((tmp_path / "signalled").read_text())
    print(f"\n{signal.Signals(signum).name} on {device}: exit {process.returncode} {gone_after:.1f} s after the signal")
    assert process.returncode == (130 if signum == signal.SIGINT else -signum), stderr[-3000:]
    assert gone_after < 30, gone_after  # seconds on this 2-core machine (a hang would be the 600 s above)
    if device == "cuda":
        assert not held_by(process.pid)

    (window,) = read_manifest(tmp_path / "profile")
    assert window["steps"] == [2], window
    with gzip.open(tmp_path / "profile" / window["path"], "rt") as handle:
        names = {e["name"] for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"}
    assert "rollout/gen" in names, sorted(names)[:20]  # what ran of step 2 before the signal

    root = tmp_path / "ckpt"
    assert [s for s in checkpoint.saved_steps(root) if checkpoint.problem(checkpoint.step_dir(root, s)) is None] == [1]
    assert steps(tmp_path) == [1]
    resumed = run(
        tmp_path,
        f"trainer.device={device}",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.resume_allow_changes=[custom_reward_function.path]",  # the interrupting reward is not wanted again
    )
    assert "global_step_1 (next step 2)" in resumed.stderr
    assert steps(tmp_path) == [1, 2]
