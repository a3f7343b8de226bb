"""``rlprof memory``: a CUDA snapshot in torch's own format (checked with torch's ``_memory_viz``) read back with the
peak and the top stacks derived independently here, the offline HTML page opened in Chromium, host RSS per range
from a real run, and bad input named in one line."""

from __future__ import annotations

import json
import pickle
import random

import pytest
from torch.cuda import _memory_viz

from rlprof.analysis.render.units import human_bytes
from rlprof.cli import main

from conftest import external_references, plotly_pixels, run_example, screenshot

SEGMENT_BASE = 0x7F0000000000
SEGMENT_SIZE = 64 * 2**20
FUNCTIONS = {"attention": 11, "mlp": 22, "optimizer_step": 33, "sample": 44}
TAGS = {"attention": "actor/update_actor", "mlp": "actor/update_actor", "optimizer_step": "actor/update_actor"}
TAGS["sample"] = "rollout/gen"


def frames(function: str) -> list[dict]:
    return [
        {"filename": "/venv/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "/home/me/model.py", "line": FUNCTIONS[function], "name": function},
        {"filename": "/home/me/train.py", "line": 7, "name": "main"},
    ]


def random_snapshot(seed: int) -> tuple[dict, dict]:
    """A snapshot as ``torch.cuda.memory._snapshot()`` writes it: parameters alive before recording started, then
    400 random allocations and frees with frames and rlprof tags, and one segment whose blocks (alive ones active,
    gaps inactive) cover it exactly. Returns it with the expected peak and live bytes per function at the peak,
    computed here by replaying the events."""
    rng = random.Random(seed)
    cursor = SEGMENT_BASE
    live: dict[int, tuple[int, str]] = {}
    for _ in range(3):  # parameters: allocated before the trace starts, alive throughout
        size = rng.randrange(1, 4) * 2**20
        live[cursor] = (size, "params")
        cursor += size
    start = sum(size for size, _ in live.values())
    trace, peak, peak_live = [], start, dict(live)
    for t in range(400):
        if live and rng.random() < 0.45:
            address = rng.choice([a for a, (_, f) in live.items() if f != "params"] or [None])
            if address is None:
                continue
            size, function = live.pop(address)
            for action in ("free_requested", "free_completed"):
                trace.append(
                    {"action": action, "addr": address, "size": size, "frames": frames(function)} | {"time_us": 10 * t}
                )
        else:
            function = rng.choice(list(FUNCTIONS))
            size = rng.randrange(1, 64) * 4096
            live[cursor] = (size, function)
            trace.append(
                {
                    "action": "alloc",
                    "addr": cursor,
                    "size": size,
                    "frames": frames(function),
                    "user_metadata": TAGS[function],
                    "time_us": 10 * t,
                }
            )
            cursor += size
        total = sum(size for size, _ in live.values())
        if total > peak:
            peak, peak_live = total, dict(live)
    assert cursor - SEGMENT_BASE < SEGMENT_SIZE
    blocks, position = [], SEGMENT_BASE
    for address in sorted(live):
        if address > position:
            blocks.append({"address": position, "size": address - position, "state": "inactive", "frames": []})
        size, function = live[address]
        blocks.append(
            {
                "address": address,
                "size": size,
                "requested_size": size,
                "state": "active_allocated",
                "frames": frames(function) if function != "params" else [],
            }
        )
        position = address + size
    blocks.append(
        {"address": position, "size": SEGMENT_BASE + SEGMENT_SIZE - position, "state": "inactive", "frames": []}
    )
    allocated = sum(size for size, _ in live.values())
    segment = {
        "device": 0,
        "address": SEGMENT_BASE,
        "total_size": SEGMENT_SIZE,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }
    by_function: dict[str, int] = {}
    for size, function in peak_live.values():
        by_function[function] = by_function.get(function, 0) + size
    expected = {"peak": peak, "start": start, "end": allocated, "by_function": by_function}
    return {"segments": [segment], "device_traces": [trace]}, expected


@pytest.fixture
def snapshot_file(tmp_path):
    snapshot, expected = random_snapshot(seed=7)
    _memory_viz.segsum(snapshot)  # torch's own reader accepts it: its segment sizes add up
    assert _memory_viz.trace_plot(snapshot)
    path = tmp_path / "rank0_pid4242.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    return path, expected


def test_the_peak_and_top_stacks_of_a_snapshot_in_torchs_format(snapshot_file, capsys):
    path, expected = snapshot_file
    assert main(["memory", str(path), "--format", "json", "--top", "10"]) == 0
    (device,) = json.loads(capsys.readouterr().out)["devices"]
    summary = device["summary"]
    assert (summary["peak_bytes"], summary["start_bytes"], summary["end_bytes"]) == (
        expected["peak"],
        expected["start"],
        expected["end"],
    )
    # torch's _memory_viz.segsum: the inactive blocks are the free space between allocations
    assert summary["segments"] == {
        "reserved": SEGMENT_SIZE,
        "allocated": expected["end"],
        "free_internal": 0,
        "free_external": SEGMENT_SIZE - expected["end"],
    }
    sites = {s["site"].split(" < ")[0]: s["bytes"] for s in summary["top_sites"]}
    functions = {f"model.py:{line} {name}": name for name, line in FUNCTIONS.items()}
    alive = {functions[site]: size for site, size in sites.items() if site in functions}
    assert alive == {f: b for f, b in expected["by_function"].items() if f != "params"}
    tops = [s["site"] for s in summary["top_sites"] if s["site"] in {f"{k} < train.py:7 main" for k in functions}]
    assert tops == sorted(tops, key=lambda site: -sites[site.split(" < ")[0]])  # largest first, full stacks
    by_tag = {tag: size for tag, size in summary["by_tag"].items() if tag}
    update = sum(b for f, b in expected["by_function"].items() if TAGS.get(f) == "actor/update_actor")
    assert by_tag == {"actor/update_actor": update, "rollout/gen": expected["by_function"].get("sample", 0)}

    assert max(total for _, total in summary["timeline"]) == expected["peak"]
    for i, (_, total) in enumerate(summary["timeline"]):  # the stacked per-range timeline adds up to the total
        assert sum(sizes[i] for sizes in summary["timeline_by_tag"].values()) == total

    assert main(["memory", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"peak {human_bytes(expected['peak'])}" in text
    for fragment in (
        "Top allocation sites alive at the peak",
        "Around the peak",
        "actor/update_actor",
        "free between blocks",
    ):
        assert fragment in text


def test_the_html_timeline_renders_offline(snapshot_file, tmp_path, capsys):
    path, _ = snapshot_file
    page = tmp_path / "memory.html"
    assert main(["memory", str(path), "--html", str(page)]) == 0
    assert external_references(page.read_text()) == []
    assert plotly_pixels(screenshot(page, tmp_path / "memory.png")) > 2000, "the allocation timeline was not drawn"


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_host_rss_per_range_of_a_real_run(tmp_path, capsys):
    run_example(
        "global_profiler.tool=torch_memory",
        "global_profiler.steps=[1,2]",
        "global_profiler.profile_continuous_steps=true",
        save_path=tmp_path / "profile",
    )
    (rss,) = (tmp_path / "profile").rglob("*.host_memory.jsonl")
    page = tmp_path / "rss.html"
    assert main(["memory", str(rss), "--format", "md", "--html", str(page)]) == 0
    text = capsys.readouterr().out
    ranges = [json.loads(line) for line in rss.read_text().splitlines() if '"kind": "range"' in line]
    assert f"{len(ranges)} ranges" in text and "| actor/update_policy |" in text
    assert external_references(page.read_text()) == [] and "plotly" in page.read_text()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.pickle", None, "no such file"),
        ("notes.txt", b"hello", "not a memory file rlprof reads"),
        ("rank0_pid1.pickle", b"\x80\x04not a pickle", "rank0_pid1.pickle"),
        ("evil.pickle", pickle.dumps(print), "plain data only"),
    ],
)
def test_bad_memory_files_are_one_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert main(["memory", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlprof memory: ") and message in err and err.count("\n") == 1
