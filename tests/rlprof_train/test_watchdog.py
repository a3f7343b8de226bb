"""The stall watchdog (``trainer.watchdog``): a phase that runs far longer than its median makes every rank write its
threads' stacks, rank 0 names the rank behind in one line, ``rlprof report`` lists the stall, and with
``abort_after_s`` the job ends instead of hanging. The two-rank runs are real: rank 1's reward function sleeps at
step 3."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import rlprof
from rlprof.analysis.stalls import listed_stalls, main_thread_frames, read_stalls
from rlprof.cli import main
from rlprof.manifest import read_manifest
from rlprof.watchdog import ABORT_EXIT, Watchdog, WatchdogConfig, py_spy, thread_stacks

from conftest import ROOT, SMALL_RUN, free_port, subprocess_env, trainer_command

CALLS_PER_STEP = 4
"""Reward calls per rank and step: 4 prompts x 2 responses over 2 ranks."""


def test_the_threshold_is_factor_times_the_median_of_earlier_steps_not_before_min_s_or_at_the_limit():
    watchdog = Watchdog(WatchdogConfig(enable=False, factor=10, min_s=2, limit_s=30), Path("."))
    assert watchdog.threshold(1, "gen") == (30, None)  # no earlier step: the absolute limit only
    watchdog.durations["gen"] = [(1, 9.0), (2, 0.5), (3, 0.7), (4, 0.6)]
    assert watchdog.threshold(2, "gen") == (30, 9.0)  # only the first step so far: its 90 s capped by the limit
    assert watchdog.threshold(5, "gen") == (6.0, 0.6)  # step 1 left out once others exist: 10 x median(.5, .7, .6)
    watchdog.durations["reward"] = [(1, 0.01), (2, 0.01)]
    assert watchdog.threshold(3, "reward") == (2, 0.01)  # 10 x 0.01 s, but not before min_s
    assert Watchdog(WatchdogConfig(enable=False), Path(".")).threshold(1, "gen") == (None, None)
    defaults = WatchdogConfig()  # as docs/reliability.md states them
    assert (defaults.enable, defaults.factor, defaults.min_s, defaults.limit_s, defaults.abort_after_s) == (
        True, 10, 60, None, None
    )  # fmt: skip


def test_a_stall_in_your_own_loop_writes_the_stacks_naming_the_line_and_the_event(tmp_path, capfd):
    """``rlprof.watchdog`` in a loop of one process: the stalled phase's stacks, the event and one line."""
    with rlprof.watchdog(tmp_path, min_s=1.0) as watchdog:
        for step in (1, 2, 3):
            with watchdog.phase(step, "reward"):
                time.sleep(0.05 if step < 3 else 3.5)  # the stalled line
    stacks = (tmp_path / "stalls" / "step3" / "rank0.txt").read_text()
    assert stacks.startswith("rank 0 of 1, pid ") and ": in reward of step 3 for " in stacks
    assert "time.sleep(0.05 if step < 3 else 3.5)  # the stalled line" in stacks
    assert py_spy() is not None, "py-spy is a test dependency (scripts/setup.sh installs it)"
    python, header, seen = re.split(r"^(py-spy dump(?: --native)?):$", stacks, maxsplit=1, flags=re.M)
    assert "rlprof-watchdog" not in python  # its own thread is left out of the Python stacks
    assert "test_a_stall_in_your_own_loop" in seen, stacks[-4000:]  # every thread as py-spy sees it
    assert header == "py-spy dump" or "(libc.so" in seen  # with C frames, unless native unwinding failed (named)
    assert header == "py-spy dump --native" or "(py-spy dump --native failed: " in python, stacks[-4000:]
    event = json.loads((tmp_path / "stalls" / "step3" / "stall.json").read_text())
    assert (event["step"], event["phase"], event["rank"], event["behind"]["rank"]) == (3, "reward", 0, 0)
    assert event["threshold_s"] == 1.0 and event["elapsed_s"] >= 1.0
    (line,) = [line for line in capfd.readouterr().err.splitlines() if "stall:" in line]
    assert (
        line.startswith("[WARN] stall: rank 0 has been in reward of step 3 for ") and str(tmp_path / "stalls") in line
    )
    assert watchdog.stalled_steps == {3}
    notes: list[str] = []
    (record,) = read_stalls(tmp_path, notes)
    assert notes == [] and record.behind_rank == 0
    assert (
        record.innermost[0][-1].startswith("test_watchdog.py:")
        and "time.sleep(0.05 if step < 3" in (record.innermost[0][-1])
    )


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_a_slow_py_spy_does_not_delay_the_stacks_and_close_waits_for_its_dump(tmp_path, monkeypatch):
    """The full suite once read no stacks file after a 3.5 s stall: py-spy (walking a busy process) had not returned
    and the file was written after it. A py-spy that takes 3 s (a script first on PATH): the Python stacks are on
    disk while the phase still hangs, and leaving the loop waits for the dump to be appended and the event."""
    slow = tmp_path / "bin" / "py-spy"
    slow.parent.mkdir()
    slow.write_text("#!/bin/sh\nsleep 3\necho 'Thread 1 (idle): \"MainThread\" as py-spy saw it'\n")
    slow.chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow.parent}:{os.environ['PATH']}")
    stacks = tmp_path / "logs" / "stalls" / "step3" / "rank0.txt"
    seen_while_stalled = []
    with rlprof.watchdog(tmp_path / "logs", min_s=1.0) as watchdog:
        for step in (1, 2, 3):
            with watchdog.phase(step, "reward"):
                if step == 3:
                    deadline = time.monotonic() + 3.0
                    while time.monotonic() < deadline and not stacks.exists():
                        time.sleep(0.05)
                    seen_while_stalled.append(stacks.exists() and "py-spy saw" not in stacks.read_text())
    assert seen_while_stalled == [True]
    assert stacks.read_text().endswith('py-spy dump --native:\nThread 1 (idle): "MainThread" as py-spy saw it\n')
    assert (stacks.parent / "stall.json").exists()


def test_a_bad_watchdog_setting_is_one_error_naming_it(tmp_path):
    with pytest.raises(rlprof.ConfigError, match=r"watchdog.factor: 0.5 is out of range; allowed: a number > 1"):
        rlprof.watchdog(tmp_path, factor=0.5)
    with pytest.raises(rlprof.ConfigError, match=r"watchdog.min: unknown key \(did you mean 'min_s'\?\)"):
        rlprof.watchdog(tmp_path, min=3)


def test_the_main_threads_innermost_frames_are_read_from_a_stacks_file():
    stacks = thread_stacks()
    frames = main_thread_frames(stacks)
    assert len(frames) == 3 and "test_the_main_threads_innermost_frames" in " ".join(frames)
    assert frames[-1].startswith("watchdog.py:") and "in thread_stacks" in frames[-1]
    worker = threading.Thread(target=time.sleep, args=(1,), name="worker")
    worker.start()
    assert "Thread worker (" in thread_stacks()
    worker.join()
    assert main_thread_frames('Thread other (1), innermost last:\n  File "x.py", line 3, in f\n    g()\n') == []


def test_stall_files_from_outside_are_bounded_and_not_followed_out(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"secret": 1}))
    step = tmp_path / "logs" / "stalls" / "step4"
    step.mkdir(parents=True)
    (step / "stall.json").symlink_to(outside)
    (tmp_path / "logs" / "stalls" / "step5").mkdir()
    (tmp_path / "logs" / "stalls" / "step5" / "stall.json").write_text("{not json")
    notes: list[str] = []
    assert read_stalls(tmp_path / "logs", notes) == []
    assert [n.split(": not read")[0].rsplit("/", 2)[-2] for n in notes] == ["step4", "step5"]
    assert "links out of" in notes[0]
    event = {"step": 1, "phase": "gen", "rank": 0, "elapsed_s": 9.0, "threshold_s": 6.0, "median_s": 0.6}
    event["behind"] = {"rank": 0, "phase": "gen", "step": 1, "for_s": 9.0}
    many = tmp_path / "many"
    for n in range(1, 53):
        (many / "stalls" / f"step{n}").mkdir(parents=True)
        (many / "stalls" / f"step{n}" / "stall.json").write_text(json.dumps({**event, "step": n}))
    (many / "stalls" / "step2" / "stall.json").write_text(" " * (4 * 2**20 + 1))  # over 4 MiB: not read
    notes = []
    found = read_stalls(many, notes)
    assert [r.step for r in found] == [1, *range(3, 51)]  # the first 50 folders, step 2's oversized file left out
    assert any("52 stalls; only the first 50 were read" in n for n in notes)
    assert any("step2" in n and "larger than 4 MiB" in n for n in notes)
    profile = tmp_path / "profile"  # stall lines of a manifest: printed on one line, shortened, at most 50
    profile.mkdir()
    hostile = {"kind": "stall", "step": "3\x1b[2J", "behind": {"rank": 1, "phase": "gen"}, "folder": "/x" * 400}
    (profile / "manifest.jsonl").write_text("\n".join([json.dumps(hostile)] * 53 + ["{damaged"]) + "\n")
    listed = listed_stalls([profile])
    assert len(listed) == 51 and listed[-1] == "3 more stalls are listed in the manifests"
    assert listed[0].startswith("the watchdog saw a stall at step 3?[2J (rank 1 in gen); its stacks are in /x/x")
    assert all(c.isprintable() for c in listed[0]) and len(listed[0]) < 450


def reward_sleeping_on_rank_1(folder: Path, seconds: float) -> Path:
    reward = folder / "slow_reward.py"
    reward.write_text(
        textwrap.dedent(f"""
        import os, time
        CALLS = [0]
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            CALLS[0] += 1
            if os.environ["RANK"] == "1" and CALLS[0] == {2 * CALLS_PER_STEP + 1}:  # the first call of step 3
                time.sleep({seconds})  # rank 1's grader hangs
            return 0.0
    """)
    )
    return reward


def two_ranks(folder: Path, *overrides: str) -> list[str]:
    prefix = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m")
    return trainer_command(folder, *SMALL_RUN, "trainer.watchdog.min_s=3", *overrides, prefix=prefix)


@pytest.mark.long  # CI time: in the test command's long runs
def test_rank_1_hanging_in_its_reward_is_named_with_its_line_and_listed_by_report(tmp_path, capsys):
    reward = reward_sleeping_on_rank_1(tmp_path, 12)
    profile = tmp_path / "profile"
    command = two_ranks(
        tmp_path,
        f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=4",
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={profile}",
    )
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1"), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    folder = tmp_path / "logs" / "stalls" / "step3"
    (listed,) = read_manifest(profile, kind="stall")  # the profile's manifest lists the stall, and report says so
    assert (listed["step"], listed["behind"]["rank"], listed["folder"]) == (3, 1, str(folder))
    assert main(["report", str(profile), "--format", "json"]) == 0
    assert any(
        note.startswith("the watchdog saw a stall at step 3 (rank 1 in reward); its stacks are in ")
        for note in json.loads(capsys.readouterr().out)["notes"]
    )
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.txt", "rank1.txt", "stall.json"]
    assert "time.sleep(12)  # rank 1's grader hangs" in (folder / "rank1.txt").read_text()
    (line,) = [line for line in result.stderr.splitlines() if "stall:" in line]
    assert line.startswith("[WARN] stall: rank 1 has been in reward of step 3 for "), line
    records = [json.loads(row) for row in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("watchdog/stalls") for r in records if "watchdog/stalls" in r] == [1.0]
    assert main(["report", str(tmp_path / "logs"), "--format", "json"]) == 0
    (stall,) = json.loads(capsys.readouterr().out)["stalls"]
    assert (stall["step"], stall["behind_rank"], stall["behind_phase"]) == (3, 1, "reward")
    assert "slow_reward.py:" in stall["innermost"]["1"][-1] and "time.sleep(12)" in stall["innermost"]["1"][-1]
    assert main(["report", str(tmp_path / "logs")]) == 0
    console = capsys.readouterr().out
    assert "Stalls" in console and "step 3: rank 1 in reward of step 3" in console


@pytest.mark.slow
def test_with_abort_after_s_a_hang_ends_the_job_non_zero_and_leaves_nothing_running(tmp_path):
    reward = reward_sleeping_on_rank_1(tmp_path, 600)
    command = two_ranks(tmp_path, f"custom_reward_function.path={reward}", "trainer.watchdog.abort_after_s=5")
    start = time.monotonic()
    job = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env(OMP_NUM_THREADS="1")
    )
    children: list[psutil.Process] = []
    try:
        while job.poll() is None and time.monotonic() - start < 300:
            children = psutil.Process(job.pid).children(recursive=True) or children
            time.sleep(0.5)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode not in (0, None), err[-3000:]
    assert f"ending the job (exit code {ABORT_EXIT})" in err and "trainer.watchdog.abort_after_s=5 s" in err
    assert time.monotonic() - start < 300
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert (tmp_path / "logs" / "stalls" / "step3" / "rank1.txt").exists()


USER_LOOP = """
import os, sys, time
import torch.distributed as dist
import rlprof

dist.init_process_group("gloo")
rank = dist.get_rank()
with rlprof.watchdog(sys.argv[1], min_s=2) as dog:
    for step in (1, 2, 3):
        with dog.phase(step, "generate"):
            if rank == 1 and step == 3:
                time.sleep(8)  # rank 1 hangs in its own code
        with dog.phase(step, "sync"):
            dist.barrier()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_your_own_two_rank_loop_meets_in_the_store_and_names_the_rank_behind(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(USER_LOOP)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    result = subprocess.run(
        [*command, str(script), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "logs" / "stalls" / "step3"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.txt", "rank1.txt", "stall.json"]
    assert "time.sleep(8)  # rank 1 hangs in its own code" in (folder / "rank1.txt").read_text()
    assert "dist.barrier()" in (folder / "rank0.txt").read_text()  # rank 0 waits for it in the sync
    (line,) = [line for line in result.stderr.splitlines() if "stall:" in line]
    assert line.startswith("[WARN] stall: rank 1 has been in generate of step 3 for "), line


THREAD_IN_STORE_AT_EXIT = """
import datetime, importlib, sys
import torch.distributed as dist
from torch.distributed import TCPStore

store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
if sys.argv[1] == "progress":
    import rlprof_train.progress as progress

    progress.HEARTBEAT_S = 0.0  # the heartbeat calls the store back to back: one is under way when Python finalizes
    beacon = progress.Progress(0, 2, 60.0)
    beacon.store = store
else:
    watchdog = importlib.import_module("rlprof.watchdog")

    watchdog.POLL_S = 0.0  # the same for the watchdog's poll
    watchdog.Watchdog(watchdog.WatchdogConfig(), sys.argv[2], rank=0, world_size=2, store=store)
print("returning without closing it", flush=True)
"""


@pytest.mark.slow  # 4 s each
@pytest.mark.parametrize("thread", ["progress", "watchdog"])
def test_a_thread_calling_the_store_does_not_abort_the_process_at_exit(tmp_path, thread):
    # A daemon thread inside a TCPStore call when the interpreter finalizes aborts the process as the call returns
    # ("terminate called without an active exception", SIGABRT: a two-rank CI run lost rank 1 that way at its end).
    # Here nobody closes the heartbeat or the watchdog: they are stopped before Python winds down.
    script = tmp_path / "exit.py"
    script.write_text(THREAD_IN_STORE_AT_EXIT)
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, str(script), thread, str(tmp_path / "logs")],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(OMP_NUM_THREADS="1"),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "terminate called" not in result.stderr and "returning without closing it" in result.stdout
