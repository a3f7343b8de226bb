"""``global_profiler.tool=memray`` (verl's newest tool): captures laid out as verl lays them out and read back with
memray's own reader: the peak equals ``memray stats``, allocations belong to the rlprof range open when they were
made (a profiled function, a ``profile_range`` block, a native thread working for the training thread), a site
that keeps what it makes window after window is named with its bytes a step, and a damaged capture is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rlprof
from rlprof.analysis.allocations import summarize
from rlprof.analysis.report import build_report
from rlprof.analysis.run import find_run
from rlprof.analysis.sources import read_histories
from rlprof.cli import main
from rlprof.manifest import read_manifest

from conftest import plotly_pixels, screenshot

pytest.importorskip("memray")

MiB = 1 << 20
KEPT = []


@rlprof.profiled(role="actor", name="update")
def update() -> float:
    arrays = [np.ones(MiB // 8) for _ in range(6)]  # 6 MiB alive at once, inside actor/update
    return float(sum(a[0] for a in arrays))


def score(step: int) -> None:
    with rlprof.profile_range("score", role="reward"):
        KEPT.append(bytearray(256 * 1024))  # what the loop keeps: 256 KiB a step (the planted leak)
        scratch = np.ones(MiB // 4)  # 2 MiB, freed at once
        del scratch


def loop(save_path: Path, steps: list[int], per_capture: int = 1) -> None:
    rlprof.init(
        {
            "global_profiler": {
                "tool": "memray",
                "steps": steps,
                "save_path": str(save_path),
                "global_tool_config": {"memray": {"memory_snapshot_num_steps": per_capture}},
            },
            "actor_rollout_ref": {"actor": {"profiler": {"enable": True}}},
            "reward_model": {"profiler": {"enable": True}},
        }
    )
    for step in range(1, max(steps) + 2):
        with rlprof.step(step):
            update()
            score(step)
    rlprof.shutdown()


def source_line(text: str) -> int:
    """The line of this file that holds ``text`` (its first)."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def memray_stats_peak(capture: Path) -> int:
    out = capture.with_suffix(".stats.json")
    command = [sys.executable, "-m", "memray", "stats", "--json", "-f", "-o", str(out), str(capture)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return int(json.loads(out.read_text())["metadata"]["peak_memory"])


def test_captures_as_verl_lays_them_out_with_memrays_peak_and_the_ranges_that_made_them(tmp_path):
    loop(tmp_path / "profile", [2, 3, 4])
    written = read_manifest(tmp_path / "profile")
    captures = [r for r in written if r.get("format") == "memray"]
    assert [(r["steps"], Path(r["path"]).parent.name) for r in captures] == [
        ([2], "step2"),
        ([3], "step3"),
        ([4], "step4"),
    ]
    assert all(Path(r["path"]).name.startswith("memray_rank0_pid") for r in captures)
    capture = tmp_path / "profile" / captures[0]["path"]
    (history,) = read_histories(capture)
    summary = summarize(history, top=50)
    assert summary.peak_bytes == memray_stats_peak(capture)  # the same records as memray's own count
    assert summary.by_tag["actor/update"] >= 6 * MiB  # the peak is inside update: its six arrays alive
    assert summary.by_role["actor"] >= 6 * MiB and summary.by_tag.get("reward/score", 0) < MiB
    line = source_line("arrays = [np.ones(")
    (arrays,) = [s for s in summary.top_sites if f"tests/rlprof/test_memray.py:{line} <listcomp>" in s.site]
    assert arrays.tag == "actor/update" and arrays.bytes == 6 * MiB and arrays.count == 6, arrays
    kept = [s for s in summary.alive_at_end if s.tag == "reward/score"]
    assert kept and kept[0].bytes == 256 * 1024 + 1 and "test_memray.py" in kept[0].site  # bytearray's buffer
    assert f"memray flamegraph {capture}" in summary.notes[0]


def test_a_site_that_keeps_what_each_step_makes_is_named_with_its_bytes_a_step(tmp_path, capsys):
    loop(tmp_path / "profile", [2, 3, 4])
    report = build_report(find_run([tmp_path / "profile"]))
    assert report.memory is not None
    (grown,) = report.memory.growth  # the arrays of update and the scratch are freed: only the kept list grows
    assert grown.tag == "reward/score" and "test_memray.py:" in grown.site and " score" in grown.site.split(" < ")[0]
    assert grown.bytes_per_step == pytest.approx(256 * 1024, rel=0.05)
    assert [name for name, _ in grown.windows] == ["step2", "step3", "step4"]
    (finding,) = [f for f in report.findings if f.rule == "memory-growth"]
    assert f"test_memray.py:{source_line('KEPT.append')} score" in finding.message, finding.message
    assert "0.25 MiB a step" in finding.message
    assert main(["report", str(tmp_path / "profile"), "--format", "md"]) == 0
    assert "Kept window after window (memray)" in capsys.readouterr().out


def test_several_steps_in_one_capture_as_verls_memory_snapshot_num_steps(tmp_path):
    loop(tmp_path / "profile", [2, 3], per_capture=2)
    captures = [r for r in read_manifest(tmp_path / "profile") if r.get("format") == "memray"]
    assert [(r["steps"], Path(r["path"]).parent.name) for r in captures] == [([2, 3], "steps2-3")]
    (history,) = read_histories(tmp_path / "profile" / captures[0]["path"])
    assert summarize(history).by_tag["actor/update"] >= 6 * MiB


def test_the_memory_page_of_a_capture_renders_offline(tmp_path, capsys):
    loop(tmp_path / "profile", [2])
    (capture,) = (tmp_path / "profile").rglob("memray_rank0_*.bin")
    page = tmp_path / "memory.html"
    assert main(["memory", str(capture), "--format", "md", "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "Live bytes at the peak per range" in text and "actor/update" in text
    assert "Made during the recording and still alive at its end" in text
    assert plotly_pixels(screenshot(page, tmp_path / "memory.png")) > 2000, "the allocation timeline was not drawn"


def test_a_damaged_capture_is_one_line(tmp_path, capsys):
    loop(tmp_path / "profile", [2])
    (capture,) = (tmp_path / "profile").rglob("memray_rank0_*.bin")
    cut = tmp_path / "cut" / capture.name
    cut.parent.mkdir()
    cut.write_bytes(capture.read_bytes()[: capture.stat().st_size // 3])
    assert main(["memory", str(cut)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cut}: memray cannot read it" in err, err
