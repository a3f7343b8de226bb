"""``rlprof top``: a frame read from a run's folder (ranks, breakdown, trends, stalls and stragglers named; a rank
gone silent; a folder not made yet), its reading of files from outside, and the live view driven in tmux beside a
real two-rank training run: it shows the step and phase, changes as steps pass, and `q` exits 0 leaving nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from rlprof.cli import main
from rlprof.cli.top import MAX_LINE_BYTES, MetricsTail, RunView, frame, snapshot
from rlprof.live_state import LiveState, write_live
from tests.conftest import ROOT, subprocess_env, torchrun, trainer_command


def shown(view: RunView) -> str:
    console = Console(width=140, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(frame(view))
    return console.export_text()


def a_run(folder: Path, steps: int = 5) -> None:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(
        json.dumps({"project": "proj", "experiment": "exp", "world_size": 3, "total_steps": 10})
    )
    rows = [
        {
            "step": step,
            "timing_s/step": 2.0,
            "timing_s/gen": 1.5,
            "timing_s/update_actor": 0.4,
            "critic/score/mean": 0.1 * step,
            "actor/ppo_kl": 0.01,
            "perf/throughput": 1234.5,
            "timing_ranks/step/straggler": 1.6 if step == steps else 1.0,
            "timing_ranks/step/slowest_rank": 1.0,
        }
        for step in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_frame_names_each_ranks_phase_the_breakdown_trends_and_the_straggler(tmp_path):
    logs = tmp_path / "logs"
    a_run(logs)
    now = time.time()
    write_live(logs, LiveState(0, 3, "node-a", 11, 6, "gen", now - 3.0, now))
    write_live(logs, LiveState(1, 3, "node-b", 12, 6, "reward", now - 30.0, now - 20.0))  # no heartbeat for 20 s
    text = shown(snapshot(logs, MetricsTail(logs / "metrics.jsonl")))
    assert "rlprof top proj/exp" in text and "running" in text
    assert "step 5/10" in text and "remaining about 10.0 s" in text and "throughput 1,234 tokens/s per rank" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 5}
    assert "node-a:11" in rows["0"] and "gen" in rows["0"] and "running" in rows["0"]
    assert "reward" in rows["1"] and "silent 20.0 s" in rows["1"] and "(straggler)" in rows["1"]
    assert "not started (no live file)" in rows["2"]
    assert "step 5: where its 2 s went" in text and "gen" in text and " 75% " in text
    assert "reward" in text and "0.5" in text  # the trend's last value
    assert "straggler: rank 1 took 1.60x the ranks' mean step at step 5" in text


def test_a_folder_not_made_yet_an_empty_one_and_an_ended_run_are_frames_not_errors(tmp_path, capsys):
    logs = tmp_path / "logs"
    assert main(["top", str(logs), "--once"]) == 0
    assert "waiting: the folder does not exist yet" in " ".join(capsys.readouterr().out.split())
    logs.mkdir()
    assert main(["top", str(logs), "--once"]) == 0
    assert "waiting: no step logged yet" in " ".join(capsys.readouterr().out.split())
    a_run(tmp_path / "done")
    for rank in range(3):
        write_live(tmp_path / "done", LiveState(rank, 3, "h", rank, None, None, None, time.time() - 600, closed=True))
    assert main(["top", str(tmp_path / "done"), "--once"]) == 0
    out = capsys.readouterr().out
    assert "ended" in out and "Traceback" not in out


def test_the_metrics_tail_reads_whole_lines_once_and_skips_what_is_not_a_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    tail = MetricsTail(path)
    tail.read()
    assert [r["step"] for r in tail.rows] == [1]
    with path.open("a") as handle:  # the cut-short line completed, an overlong line, junk, a later step
        handle.write(': 2}\n{"step": 3, "pad": "' + "x" * MAX_LINE_BYTES + '"}\n[1, 2]\nnot json\n{"step": 4}\n')
    tail.read()
    assert [r["step"] for r in tail.rows] == [1, 2, 4]
    path.write_text('{"step": 1}\n')  # a new run's file, shorter: read from its start
    tail.read()
    assert [r["step"] for r in tail.rows] == [1]


def test_live_files_from_outside_are_bounded_and_links_not_followed(tmp_path):
    from rlprof.live_state import read_live

    live = tmp_path / "logs" / "live"
    live.mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"rank": 9, "world_size": 1, "host": "x", "pid": 1, "step": 1, "phase": "p",
                                   "since": 0, "updated": 0}))  # fmt: skip
    (live / "rank9.json").symlink_to(outside)
    (live / "rank1.json").write_text(" " * (64 * 1024 + 1))
    (live / "rank2.json").write_text('{"rank": "two"}')
    write_live(tmp_path / "logs", LiveState(0, 1, "h" * 500, 1, 3, "gen", 1.0, 2.0))
    (state,) = read_live(tmp_path / "logs")
    assert state.rank == 0 and len(state.host) == 200


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_for(session: str, predicate, what: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = screen(session)
        if predicate(text):
            return text
        assert time.monotonic() < deadline, f"{what} not on screen within {timeout_s:g} s:\n{text}"
        time.sleep(0.5)


def rank_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.count("│") > 5 and "running" in line]


def shown_step(text: str) -> int:
    import re

    found = re.search(r"^step (\d+)/", text, re.MULTILINE)
    return int(found.group(1)) if found else -1


@pytest.mark.slow
def test_top_in_a_terminal_follows_a_live_two_rank_run_and_q_leaves_nothing_running(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    logs = tmp_path / "run" / "logs"
    session = f"rlprof-top-{os.getpid()}"
    exit_file = tmp_path / "exit"
    top = f"{sys.executable} -m rlprof.cli top {logs}; echo $? > {exit_file}"
    tmux("new-session", "-d", "-s", session, "-x", "130", "-y", "60", f"cd {ROOT} && {top}")
    run = None
    try:
        wait_for(session, lambda t: "waiting: the folder does not exist yet" in t, "the waiting line")
        command = trainer_command(
            tmp_path / "run",
            "trainer.total_training_steps=400",
            prefix=(*torchrun(2), "-m"),
        )
        run = subprocess.Popen(
            command,
            cwd=ROOT,
            env=subprocess_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        first = wait_for(session, lambda t: shown_step(t) >= 2 and len(rank_rows(t)) == 2, "both ranks running")
        later = wait_for(session, lambda t: shown_step(t) > shown_step(first) + 2, "a later step")
        for text in (first, later):
            assert len(rank_rows(text)) == 2, text  # both ranks, each with its phase and how long it has been in it
            assert any(phase in text for phase in ("gen", "update_actor", "old_log_prob", "between steps"))
            assert "where its" in text and "trends" in text and "Traceback" not in text
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 30
        while not exit_file.exists():
            assert time.monotonic() < deadline, screen(session)
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0"
        left = subprocess.run(["pgrep", "-f", f"rlprof.cli top {logs}"], capture_output=True, text=True)
        assert left.stdout == "", left.stdout
    finally:
        if run is not None:
            run.kill()
            run.wait()
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


@pytest.mark.parametrize("how", ["SIGHUP", "SIGTERM", "Ctrl-C"])
def test_a_hang_up_a_terminate_or_ctrl_c_exits_0_and_gives_the_terminal_back(tmp_path, how):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    logs = tmp_path / "logs"
    a_run(logs)
    session = f"rlprof-top-{os.getpid()}-{how}"
    done = tmp_path / "done"
    top = f"{sys.executable} -m rlprof.cli top {logs} & echo $! > {tmp_path / 'pid'}; wait $!; echo $? > {done}"
    if how == "Ctrl-C":  # in the foreground, where the terminal's Ctrl-C reaches it
        top = f"{sys.executable} -m rlprof.cli top {logs}; echo $? > {done}"
    tmux(
        "new-session",
        "-d",
        "-s",
        session,
        "-x",
        "130",
        "-y",
        "50",
        f"cd {ROOT}; {top}; stty -a > {tmp_path / 'stty'}",
    )
    try:
        wait_for(session, lambda t: "step 5/10" in t, "the frame", timeout_s=60)
        if how == "Ctrl-C":
            tmux("send-keys", "-t", session, "C-c")
        else:
            pid = int((tmp_path / "pid").read_text())
            os.kill(pid, getattr(__import__("signal"), how))
        deadline = time.monotonic() + 30
        while not (tmp_path / "stty").exists():
            assert time.monotonic() < deadline, screen(session)
            time.sleep(0.2)
        assert done.read_text().strip() == "0"
        settings = (tmp_path / "stty").read_text().split()
        assert "icanon" in settings and "echo" in settings  # cbreak undone
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_the_watchdog_writes_its_ranks_phase_each_second_and_closed_at_the_end(tmp_path):
    import rlprof
    from rlprof.live_state import read_live

    with rlprof.watchdog(tmp_path, min_s=60) as dog:
        deadline = time.monotonic() + 0.9  # the first write comes as the thread starts, not a second later
        while not (states := read_live(tmp_path)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert (states[0].step, states[0].phase) == (None, None)
        with dog.phase(7, "gen"):
            deadline = time.monotonic() + 10
            while (states := read_live(tmp_path))[0].phase is None and time.monotonic() < deadline:
                time.sleep(0.1)
            (state,) = states
            assert (state.rank, state.step, state.phase, state.closed, state.pid) == (0, 7, "gen", False, os.getpid())
            assert state.since is not None and time.time() - 10 < state.since <= state.updated <= time.time()
    (state,) = read_live(tmp_path)
    assert state.closed and state.phase is None
