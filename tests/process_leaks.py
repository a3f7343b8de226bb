"""pytest plugin (``-p process_leaks``, set in pyproject.toml for ``tests/`` and ``benchmarks/``): a test session ends
with no process that its tests started still running.

Every engine, server, pool and child process a test starts is stopped by that test or its fixture. What is left when
the session's last fixture is torn down would otherwise live until the interpreter's exit, where its finalizer runs
after pytest's summary and writes into streams already closed (vLLM's executor shutdown did, as a ``--- Logging
error ---`` after the summary line). After each test the plugin notes which of the process's descendants are new;
at the end it names each survivor with the first test after which it was seen and fails the session (it stops
none: a killed service makes its client's exit handler print a traceback, the very noise this check is against).
Under pytest-xdist each worker checks its own tests' processes and hands the lines to the controller, which reports
them and fails the session.

Processes that the interpreter itself owns for its whole life are not the tests' to stop: multiprocessing's
resource tracker, and torch's compile-worker pool (torch stops it at exit, before anything is finalized).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

GRACE_S = 5.0
"""How long a process that is already ending may take to be gone before it counts as left running."""

WORKER_KEY = "process_leaks"
"""The key of a pytest-xdist worker's output that carries its survivors' lines to the controller."""
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "torch._inductor.compile_worker")
"""Command-line fragments of the helper processes the interpreter owns for its lifetime."""


@dataclass(frozen=True)
class Started:
    """A descendant process first seen alive after a test."""

    pid: int
    create_time: float
    command: str
    test: str


def _descendants() -> dict[tuple[int, float], str]:
    """Live descendants of this process (zombies are reaped or ending, not running): (pid, start time) -> command."""
    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(process.cmdline()) or process.name()
            found[(process.pid, process.create_time())] = command
        except psutil.Error:  # ended while being looked at
            continue
    return found


class ProcessLeaks:
    def __init__(self) -> None:
        self.before = set(_descendants())
        self.started: dict[tuple[int, float], Started] = {}
        self.from_workers: list[str] = []
        """What pytest-xdist's workers found left running (the controller's list)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        yield
        for key, command in _descendants().items():
            if key not in self.before and key not in self.started:
                self.started[key] = Started(key[0], key[1], command, item.nodeid)

    def survivors(self) -> list[Started]:
        deadline = time.monotonic() + GRACE_S
        while True:
            alive = _descendants()
            left = [
                s
                for key, s in self.started.items()
                if key in alive and not any(helper in s.command for helper in INTERPRETER_HELPERS)
            ]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """pytest-xdist's controller: a worker ended, with the lines of what its tests left running."""
        self.from_workers += getattr(node, "workeroutput", {}).get(WORKER_KEY, [])

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        lines = [f"pid {s.pid}, first seen after {s.test}: {s.command[:300]}" for s in self.survivors()]
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # a pytest-xdist worker: its controller reports and fails the session
            workeroutput[WORKER_KEY] = lines
            return
        lines += self.from_workers
        if not lines:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"{len(lines)} processes started by the tests were still running at the end:"
        if reporter is not None:
            reporter.write_sep("=", "processes left running", red=True)
            for line in (message, *lines):
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ProcessLeaks(), "process_leaks_check")
