"""rlprof under faults a real run meets: a kill while a window is open, a forked child, a disk that fills up, and
bad configuration given to the library. Each runs in a child process where the fault cannot hurt the test run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlprof
from rlprof.manifest import read_manifest

from conftest import ROOT, subprocess_env

LOOP = """
import os, signal, sys, time
import rlprof

@rlprof.profiled(role="actor", name="update")
def update():
    time.sleep(0.01)

{setup}
rlprof.init({{"global_profiler": {{"tool": "torch", "steps": [1, 2, 3], "profile_continuous_steps": True,
              "save_path": sys.argv[1]}}}})
for n in range(1, 4):
    with rlprof.step(n):
        update()
        {inside}
print("finished", flush=True)
"""


def run_child(save_path: Path, setup: str = "", inside: str = "pass", **kwargs) -> subprocess.CompletedProcess:
    code = LOOP.format(setup=textwrap.dedent(setup), inside=inside)
    return subprocess.run(
        [sys.executable, "-c", code, str(save_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=ROOT,
        **kwargs,
    )


def test_sigterm_writes_the_open_window_then_dies_of_the_signal(tmp_path):
    result = run_child(tmp_path, inside="os.kill(os.getpid(), signal.SIGTERM) if n == 2 else None")
    assert result.returncode == -signal.SIGTERM and "finished" not in result.stdout
    (record,) = read_manifest(tmp_path)
    assert record["path"] == "torch/step1-2/rank0.pt.trace.json.gz" and record["steps"] == [1, 2]


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_sigterm_also_runs_the_handler_that_was_installed_before(tmp_path):
    setup = """
    def mine(signum, frame):
        print("user handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, mine)
    """
    result = run_child(tmp_path, setup=setup, inside="os.kill(os.getpid(), signal.SIGTERM) if n == 2 else None")
    assert result.returncode == 7 and "user handler ran" in result.stdout
    assert [r["steps"] for r in read_manifest(tmp_path)] == [[1, 2]]


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_a_forked_child_writes_nothing(tmp_path):
    inside = """pid = os.fork()
        if pid == 0:
            update(); rlprof.shutdown(); os._exit(0)
        os.waitpid(pid, 0)"""
    result = run_child(tmp_path, inside=inside)
    assert result.returncode == 0, result.stderr
    records = read_manifest(tmp_path)
    assert [(r["path"], r["pid"]) for r in records] == [("torch/step1-3/rank0.pt.trace.json.gz", records[0]["pid"])]
    assert len(list((tmp_path / "torch").rglob("*"))) == 2  # the window folder and its one trace


@pytest.mark.parametrize("limit", [4096, 65536])  # the trace stops part-way: kineto's own NAME.tmp must go too
@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_a_full_disk_publishes_no_truncated_trace_and_leaves_no_temporary_file(tmp_path, limit):
    setup = f"""
    import resource, torch
    update = lambda: [torch.ones(1) + 1 for _ in range(2000)]  # a trace of about 1 MB
    import rlprof.tools.torch_profiler as tp
    export = tp.TorchProfilerTool.stop_window
    def limited(self, window):  # from here on every write stops at the limit, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        export(self, window)
    tp.TorchProfilerTool.stop_window = limited
    """
    result = run_child(tmp_path, setup=setup)
    assert result.returncode == 0, result.stderr
    assert "was not written" in result.stderr and "left out of the manifest" in result.stderr
    assert read_manifest(tmp_path) == []
    assert [p.name for p in (tmp_path / "torch").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("global_profilr:\n  tool: torch\n", ["global_profilr", "did you mean 'global_profiler'"]),
        ("global_profiler:\n  tool: [torch\n", ["not valid YAML"]),
        ("global_profiler: torch\n", ["global_profiler", "expected a mapping"]),
    ],
)
def test_bad_yaml_is_named(tmp_path, text, fragments):
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    with pytest.raises(rlprof.ConfigError) as info:
        rlprof.init(str(path))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_config_file_not_ending_in_yaml_is_read_and_a_missing_one_is_named(tmp_path):
    path = tmp_path / "profile.cfg"
    path.write_text("global_profiler:\n  tool: torch\n  steps: [4]\n")
    assert rlprof.init(str(path)).tool_name == "torch"
    with pytest.raises(rlprof.ConfigError, match="is not a file"):
        rlprof.init(str(tmp_path / "missing.yaml"))
    with pytest.raises(rlprof.ConfigError, match="is not a file"):
        rlprof.init(str(tmp_path / "conf" / "profile"))


def test_a_bad_rank_variable_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(rlprof.ConfigError, match="RANK='abc' is not an integer"):
        rlprof.init({})


def test_role_tool_config_is_honoured_or_refused():
    session = rlprof.init(
        {"global_profiler": {"tool": None}, "actor": {"profiler": {"tool_config": {"nsys": {"discrete": True}}}}}
    )
    assert session.config.role("actor").discrete is True
    same = {
        "global_profiler": {"global_tool_config": {"torch": {"step_start": 3}}},
        "actor": {"profiler": {"tool_config": {"torch": {"step_start": 3}}}},
    }
    rlprof.init(same)
    with pytest.raises(rlprof.ConfigError, match="actor.profiler.tool_config.torch.step_start: 5 differs"):
        rlprof.init({"actor": {"profiler": {"tool_config": {"torch": {"step_start": 5}}}}})
    with pytest.raises(rlprof.ConfigError, match="unknown tool"):
        rlprof.init({"actor": {"profiler": {"tool_config": {"npu": {"level": 1}}}}})


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_the_process_exits_quickly_after_sigint_with_keyboard_interrupt(tmp_path):
    # Python raises KeyboardInterrupt on SIGINT unless it started with SIGINT ignored, as a shell's background job
    # does (a test run started with `&`): set the foreground's handler
    code = LOOP.format(
        setup="signal.signal(signal.SIGINT, signal.default_int_handler)",
        inside="os.kill(os.getpid(), signal.SIGINT) if n == 2 else None",
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=ROOT,
    )
    assert "KeyboardInterrupt" in result.stderr and time.monotonic() - start < 60
    assert [r["steps"] for r in read_manifest(tmp_path)] == [[1, 2]]
    assert os.path.exists(tmp_path / "torch" / "step1-2" / "rank0.pt.trace.json.gz")
