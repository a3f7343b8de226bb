"""``rlprof memory`` on CUDA memory snapshots recorded on GPUs by others (``tests/data/snapshots``, Stanford CS336
repositories, MIT): Windows paths with Python stacks, ``stacks='all'`` snapshots whose stacks start with C++
unwinding frames, one with torch.compile's generated code. The peak is checked against a replay of the events by
hand, the segments against torch's own ``_memory_viz.segsum``, and the allocation sites against the rule: the first
frames of the user's code, relative to its folder."""

from __future__ import annotations

import copy
import json
import lzma
import pickle
from pathlib import Path

import pytest
from torch.cuda import _memory_viz

from rlprof.analysis.allocations import summarize
from rlprof.analysis.sources import read_histories
from rlprof.analysis.sources.cuda_snapshot import BEFORE_RECORDING, NO_USER_FRAME
from rlprof.cli import main

from conftest import ROOT

SNAPSHOTS = sorted((ROOT / "tests" / "data" / "snapshots").glob("*.pickle.xz"))


@pytest.fixture(scope="module", params=SNAPSHOTS, ids=lambda p: p.name.removesuffix(".pickle.xz"))
def snapshot(request, tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("snapshot") / request.param.name.removesuffix(".xz")
    data = lzma.decompress(request.param.read_bytes())
    path.write_bytes(data)
    return path, pickle.loads(data)


def replayed_peak(snapshot: dict) -> int:
    """Live bytes at their highest, by hand: the blocks alive at the end, the events undone back to the start, then
    replayed forward."""
    events = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    alive = {
        b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    }
    for e in reversed(events):
        if e["action"] == "alloc":
            alive.pop(e["addr"], None)
        else:
            alive[e["addr"]] = e["size"]
    live = peak = sum(alive.values())
    for e in events:
        live += e["size"] if e["action"] == "alloc" else -e["size"]
        peak = max(peak, live)
    return peak


def test_the_peak_equals_a_replay_and_the_segments_equal_torchs_segsum(snapshot):
    path, data = snapshot
    summary = summarize(read_histories(path)[0])
    assert summary.peak_bytes == replayed_peak(data)
    printed = _memory_viz.segsum(data)  # torch's own reading of the same segments
    segments = summary.segments
    assert segments is not None
    assert f"total_reserved: {_memory_viz._format_size(segments.reserved)}" in printed
    assert f"total_allocated: {_memory_viz._format_size(segments.allocated)}" in printed
    assert f"total_free: {_memory_viz._report_free(segments.free_external, segments.free_internal)}" in printed


def test_allocation_sites_are_the_users_frames_relative_to_its_folder(snapshot):
    path, _ = snapshot
    summary = summarize(read_histories(path)[0], top=20)
    sites = [s.site for s in summary.top_sites]
    for site in sites:
        assert "??" not in site and "torch::" not in site and "site-packages/torch" not in site, site
        assert "torchinductor" not in site and not site.startswith(("/", "D:", "C:")), site
        assert "\\" not in site, site  # Windows paths with forward slashes, relative
    users = [s for s in sites if s not in (BEFORE_RECORDING, NO_USER_FRAME)]
    assert users and all(site.split(":", 1)[0].endswith(".py") for site in users)
    assert any(
        site.startswith(("cs336_basics/", "cs336-basics/", "adapters.py", "benchmarking_script.py"))
        or "model.py" in site
        for site in users
    )


def test_a_snapshot_without_times_shows_the_order_of_its_events(snapshot, tmp_path, capsys):
    """Snapshots of torch before 2.1 have no ``time_us``: events are in order, and are shown so, never as µs."""
    data = copy.deepcopy(snapshot[1])
    for event in data["device_traces"][0]:
        event.pop("time_us", None)
    untimed = tmp_path / "untimed.pickle"
    untimed.write_bytes(pickle.dumps(data))
    assert main(["memory", str(untimed), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["devices"][0]["summary"]
    assert summary["timed"] is False and summary["peak_time_us"] is None and summary["peak_event"] >= 0
    assert main(["memory", str(untimed)]) == 0
    text = capsys.readouterr().out
    assert "the file has no times: events are in order" in text and "no times in the file" in text


@pytest.mark.timeout(120)
def test_a_snapshot_whose_stacks_are_shared_by_reference_is_read_once_per_stack(tmp_path):
    """A hostile pickle: 100,000 events sharing one 5,000-frame stack by pickle reference (a 1 MB file whose naive
    reading walks 500 million frames). Each stack is read once, so it takes the time of its size."""
    frames = [{"filename": "/site-packages/torch/nn/functional.py", "line": i, "name": "f"} for i in range(5000)]
    trace = [{"action": "alloc", "addr": i, "size": 8, "frames": frames, "time_us": i} for i in range(100_000)]
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    assert path.stat().st_size < 4 << 20
    summary = summarize(read_histories(path)[0])
    assert summary.peak_bytes == 800_000 and summary.top_sites[0].site == NO_USER_FRAME
