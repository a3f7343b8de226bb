"""tests/process_leaks.py: a test session that leaves a process it started running fails, naming the process and the
test after which it was first seen; one whose tests stop what they start passes, and prints nothing after its
summary."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest

from conftest import ROOT

TESTS = textwrap.dedent(
    """
    import subprocess

    KEPT = []


    def test_stops_its_child():
        child = subprocess.Popen(["sleep", "30"])
        child.kill()
        child.wait()


    def test_leaves_one_running():
        KEPT.append(subprocess.Popen(["sleep", "{seconds}"]))  # never stopped by the test
    """
)


WORKERS = {"one process": (), "two xdist workers": ("-n", "2")}
"""The test command runs its tests in two pytest-xdist workers: each worker's leaks reach the session's end."""


def session(tmp_path, *, leave: bool, workers: tuple[str, ...] = (), seconds: int = 37) -> subprocess.CompletedProcess:
    source = TESTS.format(seconds=seconds) if leave else TESTS.split("\n\ndef test_leaves")[0] + "\n"
    (tmp_path / "test_children.py").write_text(source)
    plugins = ["-p", "process_leaks", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", "-q", *plugins, *workers, "test_children.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


@pytest.mark.slow  # set-up heavy: out of the quick loop
@pytest.mark.parametrize("workers", WORKERS)
def test_a_process_left_running_fails_the_session_naming_it_and_its_test(tmp_path, workers):
    seconds = 37 + list(WORKERS).index(workers)  # each case's own orphan
    result = session(tmp_path, leave=True, workers=WORKERS[workers], seconds=seconds)
    out = result.stdout
    assert result.returncode == 1, out
    assert "2 passed" in out and "processes left running" in out
    assert "1 processes started by the tests were still running at the end:" in out
    assert f"first seen after test_children.py::test_leaves_one_running: sleep {seconds}" in out
    assert "test_stops_its_child" not in out.split("processes left running")[1]
    left = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", str(seconds)]]
    for process in left:  # the inner session's orphan, now this test's to stop
        process.kill()


def test_a_session_whose_tests_stop_their_children_passes_and_ends_on_its_summary(tmp_path):
    result = session(tmp_path, leave=False)
    assert result.returncode == 0, result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("1 passed") and not result.stderr
