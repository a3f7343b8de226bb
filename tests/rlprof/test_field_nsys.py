"""``rlprof report`` on Nsight Systems reports: three ``.sqlite`` exports recorded on GPUs by others (nsys 2024.6,
2025.1 and 2026.2; A100, RTX 3070 Ti, RTX 5000 Ada; ``tests/data/SOURCES.tsv``), checked against nsys's own stats
reports run by Debian's nsys (``nvtxgpuproj``, ``nvtxsum``, ``gpukernsum``) and against SQL over the same tables;
a newer ``.nsys-rep`` that this nsys cannot export, refused in one line; and reports recorded here: the example loop
on two ranks under one nsys, found by ``rlprof report`` through the manifest ``rlprof nsys profile`` wrote."""

from __future__ import annotations

import csv
import json
import lzma
import sqlite3
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from rlprof.analysis.report import build_report
from rlprof.analysis.report_model import ReportOptions
from rlprof.analysis.run import find_run
from rlprof.analysis.sources.nsys_report import scan_report
from rlprof.cli import main

from conftest import EXAMPLE, LAUNCHER_VARIABLES, ROOT, free_port

NSYS_DATA = ROOT / "tests" / "data" / "nsys"
REPORTS = sorted(NSYS_DATA.glob("*.sqlite.xz"))


@pytest.fixture(scope="module", params=REPORTS, ids=lambda p: p.name.removesuffix(".sqlite.xz"))
def report(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nsys") / request.param.name.removesuffix(".xz")
    path.write_bytes(lzma.decompress(request.param.read_bytes()))
    return path


def sql_device_time(path: Path) -> dict[str, float]:
    """Per NVTX range of the default domain, the device time (µs: kernels, copies, sets) launched by runtime calls
    inside its instances on their thread, by SQL over the report's own tables (each operation once per name, as
    rlprof counts it)."""
    with sqlite3.connect(path) as db:
        db.text_factory = lambda raw: raw.decode("utf-8", "replace")
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        device = " UNION ALL ".join(
            f"SELECT correlationId, start, end FROM CUPTI_ACTIVITY_KIND_{kind}"
            for kind in ("KERNEL", "MEMCPY", "MEMSET")
            if f"CUPTI_ACTIVITY_KIND_{kind}" in tables
        )
        rows = db.execute(
            f"""
            WITH device AS ({device})
            SELECT DISTINCT COALESCE(n.text, s.value), d.correlationId, d.start, d.end - d.start
            FROM NVTX_EVENTS n
            LEFT JOIN StringIds s ON s.id = n.textId
            JOIN CUPTI_ACTIVITY_KIND_RUNTIME r
              ON r.globalTid = n.globalTid AND r.start >= n.start AND r.start < n.end
            JOIN device d ON d.correlationId = r.correlationId
            WHERE n.eventType IN (59, 60) AND n.end IS NOT NULL AND COALESCE(n.domainId, 0) = 0
            """
        ).fetchall()
    totals: dict[str, float] = defaultdict(float)
    for name, _, _, duration in rows:
        totals[name] += duration / 1e3
    return dict(totals)


def test_each_report_gives_every_range_the_kernel_time_it_launched(report):
    (scan,) = scan_report(report)
    expected = sql_device_time(report)
    assert expected, "the report has NVTX ranges with kernels"
    for name, device_us in expected.items():
        assert scan.ranges[name].cuda_us == pytest.approx(device_us, rel=1e-9), name
    assert scan.gpu is not None and scan.gpu.operations > 0 and scan.device


def nsys_stats(nsys: str, report: Path, name: str, folder: Path) -> list[dict[str, str]]:
    """One of nsys's own stats reports on ``report``, as CSV rows."""
    copy = folder / f"{report.stem}-{name}.sqlite"
    copy.write_bytes(report.read_bytes())  # nsys stats may write beside its input
    prefix = folder / f"{report.stem}-{name}"
    result = subprocess.run(
        [nsys, "stats", "--report", name, "--format", "csv", "--force-export", "false", "-o", str(prefix), str(copy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (out,) = folder.glob(f"{prefix.name}_{name}.csv")
    return list(csv.DictReader(out.open(encoding="utf-8")))


@pytest.mark.slow
def test_each_report_agrees_with_nsys_stats(report, nsys, tmp_path):
    """nsys's ``nvtxgpuproj`` (GPU projection per range), ``nvtxsum`` (CPU time per range) and ``gpukernsum``
    (time per kernel), summed per name, equal rlprof's within 1%."""
    (scan,) = scan_report(report)
    projected: dict[str, float] = defaultdict(float)
    for row in nsys_stats(nsys, report, "nvtxgpuproj", tmp_path):
        projected[row["Name"]] += float(row["Projected Duration (ns)"]) / 1e3
    for name, span in projected.items():
        assert scan.ranges[name].gpu_span_us == pytest.approx(span, rel=0.01), name
    for row in nsys_stats(nsys, report, "nvtxsum", tmp_path):
        name = row["Range"].removeprefix(":")
        got = scan.ranges[name]
        assert got.count == int(row["Instances"])
        assert got.total_us == pytest.approx(float(row["Total Time (ns)"]) / 1e3, rel=0.01)
    kernels: dict[str, float] = defaultdict(float)  # gpukernsum has a row per name, grid and block
    for row in nsys_stats(nsys, report, "gpukernsum", tmp_path):
        kernels[row["Name"]] += float(row["Total Time (ns)"]) / 1e3
    assert scan.gpu is not None
    for top in scan.gpu.top_kernels:
        if top.kind not in ("memcpy", "memset"):
            assert top.total_us == pytest.approx(kernels[top.name], rel=0.01), top.name


def test_a_report_this_nsys_cannot_export_is_refused_in_one_line(tmp_path, nsys, capsys):
    """An ``.nsys-rep`` of nsys 2026.1: Debian's 2022.4 cannot read it; the line says what to do instead."""
    report = tmp_path / "report1.nsys-rep"
    report.write_bytes((NSYS_DATA / "halfempty_report1.nsys-rep").read_bytes())
    assert main(["report", str(report), "--nsys", nsys]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot export it" in err and "export it with the nsys that recorded it" in err


@pytest.mark.slow
def test_two_ranks_under_one_nsys_are_one_run_with_a_window_per_rank(tmp_path, nsys, capfd, monkeypatch):
    """torchrun's two processes recorded by one nsys: one report, listed in the save path's manifest by ``rlprof nsys
    profile``; ``rlprof report`` reads it as two ranks (each process's ``rank R of W`` mark), every role's ranges with
    their CPU time."""
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    save = tmp_path / "profile"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(EXAMPLE),
        "global_profiler.tool=nsys",
        "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true",
        "role_profiler.all_ranks=true",
        f"global_profiler.save_path={save}",
    ]
    assert main(["nsys", "profile", "--nsys", nsys, "--timeout", "600", "--", *command]) == 0
    capfd.readouterr()
    lines = [json.loads(line) for line in (save / "manifest.jsonl").read_text().splitlines()]
    (entry,) = [line for line in lines if line.get("format") == "nsys_report"]
    assert entry["format"] == "nsys_report" and entry["steps"] == [2, 3]
    report = build_report(find_run([save], options=None), ReportOptions())
    windows = [w for w in report.traces if w.source == "nsys_report"]
    assert sorted(w.rank for w in windows) == [0, 1]
    for window in windows:
        labels = {r.label for r in window.ranges}
        assert {"rollout/generate", "actor/update_policy", "reward/score"} <= labels
        assert sorted(window.step_ms) == [2, 3]
    assert main(["report", str(save)]) == 0
    out = capfd.readouterr().out
    assert "nsys_report" in out and "rank 1" in out
