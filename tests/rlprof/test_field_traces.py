"""``rlprof report`` on Chrome traces recorded on real devices by others (``tests/data/traces``, listed with their
source and license in ``tests/data/SOURCES.tsv``): V100, A100, Quadro, MI250 (ROCm), MTIA; torch 1.8 to 2.x; 1 to
128-rank jobs with NCCL. Each is checked twice: against an independent full reading of the file (the whole JSON
loaded, frames nested and launches attributed by brute force), which the streaming model must equal exactly, and
against Holistic Trace Analysis 0.5.0 (``tests/hta_reference.py``), within 1%, where the differences HTA makes by
design are applied to both sides first and said: HTA drops device operations whose launch is missing and, with
several ProfilerSteps, those launched after the last step; it counts CUPTI synchronization records as device
operations (removed there); its launch statistics cover only the launch calls it names; and its call graph nests a
few launches under a zero-length operator that ended before them (those kernels are left out of the per-annotation
comparison, and counted). A step's device time counts the operations launched during it on every thread (the
autograd engine's backward thread too), where HTA's call graph counts its own thread's: steps are compared with the
full reading only."""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import lzma
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rlprof.analysis.gpu import DeviceOps, summarize_device
from rlprof.analysis.report import build_report
from rlprof.analysis.report_model import ReportOptions
from rlprof.analysis.run import find_run
from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.cli import main

from conftest import ROOT

CORPUS = ROOT / "tests" / "data"
TRACES = sorted(p for p in (CORPUS / "traces").rglob("*.json.gz") if "not_chrome" not in p.name)
DEVICE = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset", "mtia_ccp_events"}
LAUNCH = {"cuda_runtime", "cuda_driver", "Runtime", "mtia_runtime"}
FRAMES = {"cpu_op", "user_annotation", "Operator", "python_function"}
HTA_LAUNCH_NAMES = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "runFunction - job_prep_and_submit_for_execution",
}
"""The launch calls HTA's launch statistics cover (``get_cuda_kernel_launch_stats``)."""


def sources() -> list[list[str]]:
    lines = (CORPUS / "SOURCES.tsv").read_text(encoding="utf-8").splitlines()
    return [line.split("\t") for line in lines if line and not line.startswith("#")]


def published(stored: Path) -> bytes:
    """The file as published (the ``.xz`` copies decompressed)."""
    data = stored.read_bytes()
    return lzma.decompress(data) if stored.suffix == ".xz" else data


def test_every_corpus_file_is_the_published_one_with_its_source_and_license():
    rows = sources()
    listed = {row[0] for row in rows}
    stored = {
        str(p.relative_to(CORPUS))
        for p in CORPUS.rglob("*")
        if p.is_file() and p.name not in ("SOURCES.tsv", "LICENSES.md")
    }
    assert listed == stored
    licenses = (CORPUS / "LICENSES.md").read_text(encoding="utf-8")
    for path, repository, commit, _, license_name, digest, _ in rows:
        assert hashlib.sha256(published(CORPUS / path)).hexdigest() == digest, path
        assert len(commit) == 40 and "/" in repository
        assert license_name.split()[0] in ("MIT", "BSD-3-Clause", "Apache-2.0")
        assert repository.split("/")[0] in licenses or "Stanford" in license_name


# --------------------------------------------------------------------------------------------- the reading by hand


def correlation_of(event: dict[str, Any]) -> int:
    """A device operation's correlation id, -1 without one (as HTA writes it)."""
    correlation = (event.get("args") or {}).get("correlation")
    return correlation if isinstance(correlation, int) else -1


def kind_of(event: dict[str, Any]) -> str | None:
    name, category = event["name"], event["cat"]
    if category == "python_function":
        return None
    if name.startswith("ProfilerStep#"):
        return "step"
    if "/" in name and (category == "user_annotation" or "::" not in name):
        return "range"
    return "annotation" if category == "user_annotation" else "op"


class Reference:
    """The whole trace loaded; frames nested per thread with a stack; each launch's frame found by bisection."""

    def __init__(self, path: Path) -> None:
        with gzip.open(path, "rb") as handle:
            events = [e for e in json.loads(handle.read())["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
        threads: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        self.launches: dict[int, tuple[Any, float, float, str]] = {}
        self.device: list[dict[str, Any]] = []
        launch_threads: dict[Any, list[tuple[float, float]]] = defaultdict(list)
        for e in events:
            category = e.get("cat")
            if category in FRAMES:
                threads[(e["pid"], e["tid"])].append(e)
            elif category in LAUNCH:
                correlation = (e.get("args") or {}).get("correlation")
                thread = (e["pid"], e["tid"])
                launch_threads[thread].append((float(e["ts"]), float(e.get("dur", 0))))
                if isinstance(correlation, int) and correlation not in self.launches:
                    self.launches[correlation] = (thread, float(e["ts"]), float(e.get("dur", 0)), e["name"])
            elif category in DEVICE:
                self.device.append(e)
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.kinds: dict[str, str] = {}
        self.stacks: dict[Any, tuple[list[tuple[float, float, str, str | None]], list[int], list[float]]] = {}
        for thread, frames in threads.items():
            frames.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
            rows = [(float(e["ts"]), float(e.get("dur", 0)), e["name"], kind_of(e)) for e in frames]
            parents, children, stack = [], [0.0] * len(rows), []
            for i, (start, _, _, _) in enumerate(rows):
                while stack and rows[stack[-1]][0] + rows[stack[-1]][1] <= start:
                    stack.pop()
                parents.append(stack[-1] if stack else -1)
                if stack:
                    children[stack[-1]] += rows[i][1]
                stack.append(i)
            starts = [row[0] for row in rows]
            self.stacks[thread] = (rows, parents, starts)
            for start, duration in launch_threads.get(thread, []):
                inner = self.innermost(thread, start)
                if inner >= 0:
                    children[inner] += duration
            for i, (_, duration, name, kind) in enumerate(rows):
                if kind in (None, "op") and not (kind == "op" and self.operator_depth(thread, i) == 0):
                    continue
                label_kind = "operator" if kind == "op" else kind
                self.kinds[name] = label_kind
                row = self.totals[name]
                row[0] += 1
                row[1] += duration
                row[2] += max(0.0, duration - children[i])
        self.cuda: dict[str, float] = defaultdict(float)
        steps = [
            (row[0], row[0] + row[1], row[2]) for rows, _, _ in self.stacks.values() for row in rows if row[3] == "step"
        ]
        for e in self.device:
            for label in self.labels_of(e):
                self.cuda[label] += float(e.get("dur", 0))
            launch = self.launches.get(correlation_of(e))
            time = launch[1] if launch else float(e["ts"])  # a step: the launch's time on any thread
            for start, end, label in steps:
                if start <= time < end:
                    self.cuda[label] += float(e.get("dur", 0))

    def operator_depth(self, thread: Any, index: int) -> int:
        rows, parents, _ = self.stacks[thread]
        depth, node = 0, parents[index]
        while node >= 0:
            depth += rows[node][3] == "op"
            node = parents[node]
        return depth

    def innermost(self, thread: Any, time: float) -> int:
        if thread not in self.stacks:
            return -1
        rows, parents, starts = self.stacks[thread]
        node = bisect.bisect_right(starts, time) - 1
        while node >= 0 and not rows[node][0] <= time < rows[node][0] + rows[node][1]:
            node = parents[node] if rows[node][0] + rows[node][1] <= time else node - 1
        return node

    def labels_of(self, event: dict[str, Any]) -> list[str]:
        """The tracked frames around the launch of a device operation, each name once (none without a launch)."""
        launch = self.launches.get((event.get("args") or {}).get("correlation"))
        if launch is None:
            return []
        thread, time = launch[0], launch[1]
        node = self.innermost(thread, time)
        if node < 0:
            return []
        rows, parents, _ = self.stacks[thread]
        chain = []
        while node >= 0:
            chain.append(node)
            node = parents[node]
        labels = []
        for index in chain:
            name, kind = rows[index][2], rows[index][3]
            if kind in (None, "step") or (kind == "op" and self.operator_depth(thread, index) > 0):
                continue
            if name not in labels:
                labels.append(name)
        return labels

    def device_ops(self, keep: set[int] | None = None) -> tuple[DeviceOps, list[str]]:
        """The device operations (those whose correlation is in ``keep``) as the arrays gpu.py reads."""
        import numpy as np

        chosen = [e for e in self.device if keep is None or correlation_of(e) in keep]
        names = sorted({e["name"] for e in chosen})
        kinds = {"kernel": 0, "Kernel": 0, "mtia_ccp_events": 0, "gpu_memcpy": 1, "Memcpy": 1}
        starts = np.array([float(e["ts"]) for e in chosen])
        launch_end, launch_duration = [], []
        for e in chosen:
            launch = self.launches.get((e.get("args") or {}).get("correlation"))
            launch_end.append(launch[1] + launch[2] if launch else np.nan)
            launch_duration.append(launch[2] if launch else np.nan)
        sizes = [(e.get("args") or {}).get("bytes", 0) for e in chosen]
        durations = np.array([float(e.get("dur", 0)) for e in chosen])
        ops = DeviceOps(
            start=starts,
            end=starts + durations,
            name=np.array([names.index(e["name"]) for e in chosen], dtype=np.int64),
            kind=np.array([kinds.get(e["cat"], 2) for e in chosen], dtype=np.int8),
            stream=np.array([(e.get("args") or {}).get("stream", -1) for e in chosen], dtype=np.int64),
            bytes=np.array([s if isinstance(s, int) else 0 for s in sizes], dtype=np.int64),
            launch_end=np.array(launch_end),
            launch_duration=np.array(launch_duration),
            duration=durations,
        )
        return ops, names


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_the_streaming_model_equals_a_full_reading_of_each_published_trace(trace):
    """Per tracked frame its count, total and self time, and the device time launched inside it (launches found by
    time, wherever the file writes them); the device operations, and the ones without a launch."""
    scan, reference = scan_trace(trace), Reference(trace)
    assert scan.problems == [] or all("re-sorted" in p for p in scan.problems), scan.problems
    assert {label: r.kind for label, r in scan.ranges.items()} == reference.kinds
    for label, (count, total, own) in reference.totals.items():
        got = scan.ranges[label]
        assert (got.count, got.total_us, got.self_us) == pytest.approx((count, total, own), rel=1e-9, abs=1e-3), label
        assert got.cuda_us == pytest.approx(reference.cuda.get(label, 0.0), rel=1e-9, abs=1e-3), label
    assert (scan.gpu.operations if scan.gpu else 0) == len(reference.device)
    missing = [e for e in reference.device if (e.get("args") or {}).get("correlation") not in reference.launches]
    assert scan.unlaunched == len(missing)
    if scan.gpu is not None:
        ops, names = reference.device_ops()
        expected = summarize_device(ops, names)
        for field in ("span_us", "busy_us", "idle_us", "compute_us", "non_compute_us"):
            assert getattr(scan.gpu, field) == pytest.approx(getattr(expected, field), rel=1e-9), field
        assert scan.gpu.sum_by_kind == pytest.approx(expected.sum_by_kind, rel=1e-9)


def test_a_range_nested_in_a_range_of_the_same_name_counts_its_kernels_once(tmp_path):
    """``actor/update`` inside ``actor/update`` (a recursive call): its kernel's 7 µs count once for the name."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "actor/update", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "actor/update", "pid": 1, "tid": 1, "ts": 10, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 30, "dur": 7,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 20, "dur": 3,
         "args": {"correlation": 5}},
    ]  # fmt: skip
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    update = scan_trace(path).ranges["actor/update"]
    assert (update.count, update.total_us, update.cuda_us) == (2, 150, 7)
    assert update.self_us == pytest.approx(50 + 50 - 3)  # the outer's own 50, the inner's 50 less the launch call


# --------------------------------------------------------------------------------------------- against HTA


HTA = ROOT / ".venv" / "hta"
_hta_cache: dict[Path, dict[str, Any]] = {}


def hta(folder: Path) -> dict[str, Any]:
    if not (HTA / "hta").is_dir():
        pytest.skip("Holistic Trace Analysis is not installed in .venv/hta (scripts/setup.sh installs it)")
    if folder not in _hta_cache:
        env = {**os.environ, "PYTHONPATH": str(HTA), "HTA_DISABLE_NS_ROUNDING": "1"}
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "hta_reference.py"), str(folder)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        _hta_cache[folder] = json.loads(result.stdout)
    return _hta_cache[folder]


def within(ours: float, theirs: float, share: float = 0.01) -> bool:
    return abs(ours - theirs) <= share * max(abs(theirs), 1e-6) + 1e-6


def single_rank_folder(trace: Path, tmp_path_factory: Any) -> Path:
    """A folder holding only ``trace`` (HTA reads every file of a folder as a rank)."""
    if trace.parent.name == "hta_sampled_ranks":
        return trace.parent
    folder = tmp_path_factory.mktemp(trace.name.split(".")[0])
    (folder / trace.name).symlink_to(trace)
    return folder


AGREEMENT: dict[str, dict[str, Any]] = {}
"""Per trace, what was compared with HTA and the largest relative difference (written to outputs/ for the record)."""


@pytest.mark.slow
@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_each_published_trace_agrees_with_holistic_trace_analysis(trace, tmp_path_factory):
    """CPU time per annotation, device time per annotation (HTA's call graph: a kernel's parent is its launch),
    the temporal breakdown, kernel time by kind, communication/compute overlap and launch delays, each within 1%."""
    scan, reference = scan_trace(trace), Reference(trace)
    theirs = hta(single_rank_folder(trace, tmp_path_factory))
    rank = str(scan.rank) if str(scan.rank) in theirs else next(iter(theirs))
    peer = theirs[rank]
    worst: dict[str, float] = {}

    def check(what: str, ours: float, expected: float) -> None:
        worst[what] = max(worst.get(what, 0.0), abs(ours - expected) / max(abs(expected), 1e-6))
        assert within(ours, expected), f"{what}: rlprof {ours} vs HTA {expected}"

    for label, (count, total) in peer["annotations"].items():
        assert scan.ranges[label].count == count, label
        check("annotation cpu time", scan.ranges[label].total_us, total)
    kept = set(peer["device_correlations"])
    all_launched = {correlation_of(e) for e in reference.device} == kept
    counted = kept - set(peer["misnested_correlations"])
    for label, device_us in peer["annotation_device_us"].items():
        if label.startswith("ProfilerStep#"):
            continue  # a step's device time counts launches of every thread (HTA's call graph: the step's own)
        ours = scan.ranges[label].cuda_us
        if counted != {correlation_of(e) for e in reference.device}:  # HTA's filter, applied to the full reading
            chosen = [e for e in reference.device if correlation_of(e) in counted]
            ours = sum(float(e.get("dur", 0)) for e in chosen if label in reference.labels_of(e))
        check("annotation device time", ours, device_us)
    # HTA takes every event with a stream argument for device work; inductor writes one on its Triton launches, CPU
    # operators (TraceLens' vLLM decode trace): HTA's temporal breakdown then counts their host time as compute
    host_on_streams = set(peer["device_names"]) - {e["name"] for e in reference.device}
    if peer["temporal"] and kept and not host_on_streams:
        ops, names = reference.device_ops(kept)
        gpu = scan.gpu if all_launched and scan.gpu is not None else summarize_device(ops, names)
        temporal = peer["temporal"]
        check("span", gpu.span_us, temporal["kernel_time(us)"])
        check("idle", gpu.idle_us, temporal["idle_time(us)"])
        check("compute", gpu.compute_us, temporal["compute_time(us)"])
        check("non-compute", gpu.non_compute_us, temporal["non_compute_time(us)"])
        if peer["kernel_sums"]:
            mine = gpu.sum_by_kind
            check("compute kernels", mine.get("compute", 0.0), peer["kernel_sums"].get("COMPUTATION", 0.0))
            check(
                "communication kernels", mine.get("communication", 0.0), peer["kernel_sums"].get("COMMUNICATION", 0.0)
            )
            memory = mine.get("memcpy", 0.0) + mine.get("memset", 0.0)
            check("memory kernels", memory, peer["kernel_sums"].get("MEMORY", 0.0))
        if peer["overlap"] is not None and gpu.communication_overlap is not None:
            check("overlap", 100 * gpu.communication_overlap, peer["overlap"])
        if peer["launch_delay"]:
            named = {c for c, launch in reference.launches.items() if launch[3] in HTA_LAUNCH_NAMES} & kept
            ops, names = reference.device_ops(named)
            delays = summarize_device(ops, names).launch_delay_us
            assert delays is not None and delays.count == len(peer["launch_delay"])
            check("launch delay mean", delays.mean, statistics.mean(peer["launch_delay"]))
            check("launch delay p50", delays.p50, statistics.median(peer["launch_delay"]))
    AGREEMENT[trace.name] = {
        "device": scan.device,
        "rank": rank,
        "device operations": scan.gpu.operations if scan.gpu else 0,
        "kept by HTA": len(kept),
        "misnested in HTA's call graph": len(peer["misnested_correlations"]),
        "host operations HTA counts as device work (not compared)": sorted(host_on_streams),
        "worst": worst,
    }
    out = ROOT / "outputs" / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    (out / "traces_vs_hta.json").write_text(json.dumps(AGREEMENT, indent=1))


# --------------------------------------------------------------------------------------------- what users have


def test_a_folder_of_hta_rank_files_is_one_run_with_a_window_per_rank(capsys):
    """HTA's rank files (no rlprof manifest, names without ``.pt.trace``) are read from their folder, ranks from
    ``distributedInfo``; with no rlprof ranges, the report lists their user annotations."""
    run = find_run([CORPUS / "traces" / "hta_sampled_ranks"])
    report = build_report(run, ReportOptions())
    assert sorted(w.rank for w in report.traces) == [0, 1]
    assert {w.range_kind for w in report.traces} == {"annotation"}
    assert all(w.gpu is not None and w.gpu.time_by_kind["communication"] > 0 for w in report.traces)
    straggler = report.stragglers[0]
    assert set(straggler.per_rank_ms) == {0, 1} and straggler.absent_on == []
    assert main(["report", str(CORPUS / "traces" / "hta_sampled_ranks")]) == 0
    out = capsys.readouterr().out
    assert "User annotations (the trace has no rlprof ranges)" in out and "GPU per step" in out


def test_a_torch_18_trace_without_annotations_lists_its_steps(capsys):
    (window,) = build_report(find_run([CORPUS / "traces" / "kineto_resnet50_torch18_worker0.pt.trace.json.gz"])).traces
    assert window.range_kind == "step" and len(window.ranges) == 6
    assert any(p.startswith("733 device operations") for p in window.problems)
    assert sum(r.cuda_ms for r in window.ranges) > 0


def test_a_trace_without_ranges_annotations_or_steps_lists_its_top_level_operators():
    (window,) = build_report(find_run([CORPUS / "traces" / "hta_inference_rank_1.json.gz"])).traces
    assert window.range_kind == "operator" or window.ranges == []
    cpu_only = build_report(find_run([CORPUS / "traces" / "hta_cpu_only_rank-34.pt.trace.json.gz"])).traces[0]
    assert cpu_only.rank == 34 and cpu_only.gpu is None and cpu_only.range_kind == "annotation"


def test_a_file_that_is_not_a_trace_is_named_in_one_line(capsys):
    path = CORPUS / "traces" / "hta_execution_trace_not_chrome.json.gz"
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} is not a file rlprof reads" in err
