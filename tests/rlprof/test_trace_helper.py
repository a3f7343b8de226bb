"""A large trace read by two processes (:func:`rlprof.analysis.sources.chrome_trace.scan_trace` with its helper
process) gives exactly what one process gives, on every published trace; a helper that dies midway costs nothing
but time, and none is left running after the reading, Ctrl-C included. The traces here are small: batches of 32 KiB
and a helper from the second batch on make them read as a large one is."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from rlprof.analysis.sources import chrome_trace
from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.analysis.trace_columns import ColumnsReplay
from rlprof.analysis.trace_model import TraceScan

from conftest import ROOT

TRACES = sorted(p for p in (ROOT / "tests" / "data" / "traces").rglob("*.json.gz") if "not_chrome" not in p.name)
LARGE = ROOT / "tests" / "data" / "traces" / "hta_trace_diff_v100_rank1.json.gz"


def facts(scan: Any) -> Any:
    """Everything a scan holds, as plain values (exact floats: the same sums in the same order)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return plain(dataclasses.asdict(value))
        if isinstance(value, dict):
            return {str(key): plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)

    return plain(scan)


@pytest.fixture
def small_batches(monkeypatch):
    """Batches of 32 KiB, the helper's share from batch 1; returns the list of batches the helper delivered."""
    monkeypatch.setattr(chrome_trace, "CHUNK", 1 << 15)
    monkeypatch.setattr(chrome_trace, "HELPER_FIRST_BATCH", 1)
    delivered: list[int] = []
    replay = ColumnsReplay.replay

    def counted(self, packed, builder):
        delivered.append(len(packed))
        replay(self, packed, builder)

    monkeypatch.setattr(ColumnsReplay, "replay", counted)
    return delivered


@pytest.fixture
def helpers(monkeypatch):
    """The helper processes started (their Popen objects)."""
    started = []
    start = chrome_trace.subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(chrome_trace.subprocess, "Popen", recorded)
    return started


def gone(process) -> bool:
    """The process has ended and been waited for (no zombie either)."""
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return process.returncode is not None
    return False


@pytest.mark.slow  # 6 s over the corpus: out of the quick loop (the killed helper's test compares a whole scan too)
@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_two_processes_read_each_published_trace_exactly_as_one(trace, small_batches, helpers):
    alone = facts(scan_trace(trace, helper=False))
    assert not helpers
    together = facts(scan_trace(trace, helper=True))
    assert together == alone
    assert len(helpers) == 1 and gone(helpers[0])
    batches = [not isinstance(batch, list) for batch in chrome_trace.iter_batches(trace, TraceScan(""))]
    expected = [i for i, raw in enumerate(batches) if raw and chrome_trace.helped(i, 1)]
    assert len(small_batches) == len(expected)  # every batch of its share came from the helper


def test_a_helper_killed_midway_leaves_the_same_scan(small_batches, helpers, monkeypatch):
    alone = facts(scan_trace(LARGE, helper=False))
    replay = chrome_trace._Helper.replay

    def kill_after_the_third(self, index, length, builder):
        if len(small_batches) == 3 and self.process is not None:
            self.process.kill()
        return replay(self, index, length, builder)

    monkeypatch.setattr(chrome_trace._Helper, "replay", kill_after_the_third)
    assert facts(scan_trace(LARGE, helper=True)) == alone
    share = [i for i, raw in enumerate(chrome_trace.iter_batches(LARGE, TraceScan(""))) if chrome_trace.helped(i, 1)]
    assert 3 <= len(small_batches) < len(share)  # killed: what its pipe still held, then the rest was read here
    assert gone(helpers[0])


def test_ctrl_c_while_reading_stops_the_helper(small_batches, helpers, monkeypatch):
    calls = []
    feed = chrome_trace.feed

    def interrupted(builder, events):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        feed(builder, events)

    monkeypatch.setattr(chrome_trace, "feed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scan_trace(LARGE, helper=True)
    assert len(helpers) == 1 and gone(helpers[0])


def test_only_a_large_trace_gets_a_helper(tmp_path, helpers):
    scan_trace(LARGE)  # 1.3 MB gzipped: one process
    assert not helpers
    assert not chrome_trace._worth_a_helper(LARGE)
    large = tmp_path / "large.json"
    with large.open("wb") as out:  # sparse: the size is what decides
        out.truncate(chrome_trace.HELPER_MIN_BYTES[1])
    assert chrome_trace._worth_a_helper(large) == (len(os.sched_getaffinity(0)) >= 2)
    assert Path(large).stat().st_size == 64 << 20


def test_a_helper_that_cannot_start_leaves_the_reading_to_this_process(monkeypatch, small_batches):
    alone = facts(scan_trace(LARGE, helper=False))

    def no_process(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(chrome_trace.subprocess, "Popen", no_process)
    assert facts(scan_trace(LARGE, helper=True)) == alone
    assert not small_batches
