"""verl's ``global_profiler.finish_hook_cmd``: run once after the last profiled step on the selected ranks, with the
``VERL_PROFILE_*`` variables; a failure is a warning; Ctrl-C while it runs stops it too; refused when malformed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlprof
from rlprof.manifest import read_manifest

from conftest import ROOT, subprocess_env

DUMP = (
    'printf "%s|%s|%s|%s|%s\\n" "$VERL_PROFILE_SAVE_PATH" "$VERL_PROFILE_TOOL" "$VERL_PROFILE_RANK" '
    '"$VERL_PROFILE_PID" "$(printenv VERL_PROFILE_ROLE || echo unset)" >> "{out}"; echo shipped'
)
"""A command that writes the variables it was given to ``{out}``, ``|`` between them (ROLE: ``unset`` when not set;
the ``$VAR`` form, as verl's example: ``${...}`` is an interpolation of the config, escaped ``\\${...}``)."""


def config(tmp_path: Path, command: str, steps=(2, 3), roles: dict | None = None, **hook) -> dict:
    return {
        "global_profiler": {
            "tool": "range_times",
            "steps": list(steps),
            "save_path": str(tmp_path / "profile"),
            "finish_hook_cmd": command,
            **hook,
        },
        **(roles or {}),
    }


def train(steps: int, on_step=None) -> None:
    for step in range(1, steps + 1):
        with rlprof.step(step), rlprof.profile_range("generate", role="rollout"):
            if on_step:
                on_step(step)


def test_it_runs_once_after_the_last_profiled_step_with_verls_variables(tmp_path, capfd):
    out = tmp_path / "hook.txt"
    ran_at = []
    rlprof.init(config(tmp_path, DUMP.replace("{out}", str(out))), rank=0, world_size=1)
    try:
        train(5, on_step=lambda step: ran_at.append((step, out.exists())))
    finally:
        rlprof.shutdown()
    assert ran_at == [(1, False), (2, False), (3, False), (4, True), (5, True)]  # after step 3, before step 4
    (line,) = out.read_text().splitlines()
    assert line.split("|") == [str((tmp_path / "profile").resolve()), "range_times", "0", str(os.getpid()), "unset"]
    assert "[rlprof][finish_hook] rank 0: shipped" in capfd.readouterr().err
    (record,) = read_manifest(tmp_path / "profile", kind="finish_hook")
    assert record["returncode"] == 0 and record["rank"] == 0


def test_the_ranks_it_runs_on_recording_or_not(tmp_path):
    actor_on_0 = {"actor_rollout_ref": {"actor": {"profiler": {"enable": True, "ranks": [0]}}}}
    runs = {
        "default: the ranks that record": ({}, [True, False]),
        "finish_hook_ranks": ({"finish_hook_ranks": [1]}, [False, True]),
        "finish_hook_all_ranks": ({"finish_hook_all_ranks": True}, [True, True]),
    }
    for case, (name, (hook, expected)) in enumerate(runs.items()):
        ran = []
        for rank in (0, 1):
            out = tmp_path / f"{case}-{rank}.txt"
            cfg = config(tmp_path, DUMP.replace("{out}", str(out)), steps=(1,), roles=actor_on_0, **hook)
            rlprof.init(cfg, rank=rank, world_size=2)
            try:
                train(2)
            finally:
                rlprof.shutdown()
            ran.append(out.exists())
            if out.exists():
                assert out.read_text().strip().split("|")[-1] == ("actor" if rank == 0 else ""), name  # its roles
        assert ran == expected, name


def test_an_open_ended_selection_runs_it_when_the_session_ends(tmp_path):
    out = tmp_path / "hook.txt"
    cfg = config(tmp_path, DUMP.replace("{out}", str(out)))
    cfg["global_profiler"]["steps"] = None  # every step
    rlprof.init(cfg, rank=0, world_size=1)
    train(3)
    assert not out.exists()
    rlprof.shutdown()
    assert len(out.read_text().splitlines()) == 1


def test_a_failing_command_is_a_warning_and_the_loop_goes_on(tmp_path):
    rlprof.init(config(tmp_path, "echo cannot reach the store >&2; exit 3", steps=(1,)), rank=0, world_size=1)
    try:
        with pytest.warns(RuntimeWarning, match="finish_hook_cmd exited with 3 on rank 0 .training goes on."):
            train(3)
    finally:
        rlprof.shutdown()
    (record,) = read_manifest(tmp_path / "profile", kind="finish_hook")
    assert record["returncode"] == 3


CHILD = """
import json, sys
import rlprof

rlprof.init(json.loads(sys.argv[1]), rank=0, world_size=1)
for step in (1, 2):
    with rlprof.step(step), rlprof.profile_range("generate", role="rollout"):
        pass
print("finished", flush=True)
"""
"""A training loop whose step 1 is profiled, in a process of its own: the Ctrl-C goes to it, as a user's does."""


def test_ctrl_c_while_it_runs_stops_the_command_too(tmp_path):
    pid_file = tmp_path / "pid"
    cfg = config(tmp_path, f'echo $$ > "{pid_file}"; exec sleep 60', steps=(1,))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), "the hook never started"
        started = time.monotonic()
        os.kill(child.pid, signal.SIGINT)  # the training process only: rlprof must stop the command itself
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert time.monotonic() - started < 30
    assert child.returncode != 0 and "KeyboardInterrupt" in err and "finished" not in out, (child.returncode, err)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: nothing left running
        os.kill(pid, 0)


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ({"finish_hook_cmd": ""}, "global_profiler.finish_hook_cmd: '' is an empty command"),
        (
            {"finish_hook_cmd": "x", "finish_hook_ranks": [-1]},
            "global_profiler.finish_hook_ranks[0]: rank -1 is negative",
        ),
        ({"finish_hook_cmd": "x", "finish_hook_ranks": "0,1"}, "global_profiler.finish_hook_ranks"),
        ({"finish_hook_cmd": "x", "finish_hook_all_ranks": "yes"}, "global_profiler.finish_hook_all_ranks"),
    ],
)
def test_a_malformed_hook_is_refused_naming_the_key(tmp_path, hook, message):
    cfg = {"global_profiler": {"tool": "range_times", "steps": [1], "save_path": str(tmp_path), **hook}}
    with pytest.raises(rlprof.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rlprof.init(cfg, rank=0, world_size=1)
