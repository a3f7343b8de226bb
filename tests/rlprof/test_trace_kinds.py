"""What a trace's frames are: rlprof's ``role/name`` ranges only in a trace rlprof wrote (its mark, or its manifest);
torch.compile's ``Torch-Compiled Region: 0/1`` operator (a "/" in its name) an operator; the program's own
annotations (``## Call CompiledFxGraph ... ##``, ``nccl:_all_gather_base``, a ``vllm/...`` name) listed with their
count, total and device time, beside rlprof's ranges when a trace has both. The expected numbers are summed by hand
from the events below."""

from __future__ import annotations

import gzip
import json

import pytest

from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.analysis.trace_model import ANNOTATION, OPERATOR, RANGE
from rlprof.cli import main


def frame(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def launch(ts: float, correlation: int) -> dict:
    event = frame("cuda_runtime", "cudaLaunchKernel", ts, 5)
    event["args"] = {"correlation": correlation}
    return event


def kernel(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": 7, "device": 0}}  # fmt: skip


def compiled_step(with_rlprof_range: bool) -> list[dict]:
    """One step: a compiled region (an operator) holding a compiled graph's annotation and two kernels, an NCCL
    annotation with one kernel, a ``vllm/...`` annotation; optionally an rlprof range around all of it."""
    events = [frame("user_annotation", "ProfilerStep#1", 0, 1000)]
    if with_rlprof_range:
        events.append(frame("user_annotation", "actor/update_actor", 50, 900))
    events += [
        frame("cpu_op", "Torch-Compiled Region: 0/1", 100, 500),
        frame("user_annotation", "## Call CompiledFxGraph abc123 ##", 110, 480),
        launch(120, 1),
        launch(140, 2),
        frame("user_annotation", "nccl:_all_gather_base", 650, 50),
        launch(660, 3),
        frame("user_annotation", "vllm/execute_model", 720, 100),
        kernel("triton_poi_fused_add_0", 200, 200, 1),
        kernel("triton_red_fused_sum_1", 400, 50, 2),
        kernel("ncclDevKernel_AllGather_RING_LL", 700, 100, 3),
    ]
    return events


def write(path, events: list[dict], marked: bool) -> None:
    trace = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]}
    if marked:  # as rlprof's torch tool marks its traces: the ranges it opened
        trace["rlprof"] = {"ranges": ["actor/update_actor"]}
    trace["traceEvents"] = events
    path.write_bytes(gzip.compress(json.dumps(trace, indent=1).encode()))


EXPECTED_ANNOTATIONS = {  # label: (count, total µs, device µs)
    "## Call CompiledFxGraph abc123 ##": (1, 480, 250),
    "nccl:_all_gather_base": (1, 50, 100),
    "vllm/execute_model": (1, 100, 0),
}


def test_a_torch_compile_trace_lists_its_annotations_not_a_range(tmp_path, capsys):
    path = tmp_path / "rank0.pt.trace.json.gz"
    write(path, compiled_step(with_rlprof_range=False), marked=False)
    scan = scan_trace(path)
    assert scan.ranges["Torch-Compiled Region: 0/1"].kind == OPERATOR
    assert not scan.ranges_of(RANGE)
    found = {r.label: (r.count, r.total_us, r.cuda_us) for r in scan.ranges_of(ANNOTATION)}
    assert found == EXPECTED_ANNOTATIONS

    assert main(["report", str(path), "--format", "json"]) == 0
    (window,) = json.loads(capsys.readouterr().out)["traces"]
    assert window["range_kind"] == "annotation" and window["annotations"] == []
    listed = {
        r["label"]: (r["count"], round(r["total_ms"] * 1000), round(r["cuda_ms"] * 1000)) for r in window["ranges"]
    }
    assert listed == EXPECTED_ANNOTATIONS


def test_rlprofs_ranges_and_the_programs_annotations_are_both_listed(tmp_path, capsys):
    path = tmp_path / "rank0.pt.trace.json.gz"
    write(path, compiled_step(with_rlprof_range=True), marked=True)
    assert main(["report", str(path), "--format", "json"]) == 0
    (window,) = json.loads(capsys.readouterr().out)["traces"]
    assert window["range_kind"] == "range"
    assert [(r["label"], r["count"], round(r["cuda_ms"] * 1000)) for r in window["ranges"]] == [
        ("actor/update_actor", 1, 350)
    ]
    listed = {
        r["label"]: (r["count"], round(r["total_ms"] * 1000), round(r["cuda_ms"] * 1000)) for r in window["annotations"]
    }
    assert listed == EXPECTED_ANNOTATIONS
    assert main(["report", str(path), "--format", "md"]) == 0
    assert "User annotations beside the ranges" in capsys.readouterr().out


def test_role_name_annotations_of_a_trace_rlprof_did_not_write_are_annotations(tmp_path):
    """The same events without rlprof's mark: ``actor/update_actor`` is the program's own annotation there, unless
    the trace's manifest says rlprof's torch tool wrote it (traces written before the mark)."""
    path = tmp_path / "rank0.pt.trace.json.gz"
    write(path, compiled_step(with_rlprof_range=True), marked=False)
    scan = scan_trace(path)
    assert scan.ranges["actor/update_actor"].kind == ANNOTATION and not scan.ranges_of(RANGE)
    assert scan_trace(path, by_rlprof=True).ranges["actor/update_actor"].kind == RANGE  # its manifest says so


def test_a_cuda_graph_capture_is_named_and_not_taken_for_a_starved_device(tmp_path, capsys):
    """Ten eager kernels, a 55 ms stream capture (300 launches queued into the graph, none run), then five replays
    of 60 kernels each: the device idles through the capture, which is no sign of a starved device."""
    events = [frame("user_annotation", "ProfilerStep#1", 0, 100_000)]
    for i in range(10):
        events += [launch(1000 + 100 * i, i + 1), kernel("eager_kernel", 1100 + 100 * i, 80, i + 1)]
    events.append(frame("cuda_runtime", "cudaStreamBeginCapture", 5000, 5))
    events += [launch(5010 + 180 * i, 101 + i) for i in range(300)]
    events += [
        frame("cuda_runtime", "cudaStreamEndCapture", 60_000, 5),
        frame("cuda_runtime", "cudaGraphInstantiate", 60_100, 50),
    ]
    for replay in range(5):
        at = 61_000 + 7000 * replay
        graph = frame("cuda_runtime", "cudaGraphLaunch", at, 20)
        graph["args"] = {"correlation": 500 + replay}
        events.append(graph)
        events += [kernel("replayed_kernel", at + 100 + 100 * k, 100, 500 + replay) for k in range(60)]
    path = tmp_path / "rank0.pt.trace.json.gz"
    write(path, events, marked=False)
    scan = scan_trace(path)
    assert scan.gpu is not None and scan.gpu.idle_us / scan.gpu.span_us > 0.6  # what gpu-idle fired on
    (capture,) = scan.captures
    assert capture.launches == 300 and scan.graph_launches == 5
    assert capture.device_idle_us == pytest.approx(60_005 - 5000 - 0)  # no device work inside it

    assert main(["report", str(path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert not any(f["rule"] == "gpu-idle" for f in report["findings"]), report["findings"]
    (window,) = report["traces"]
    assert window["graph_launches"] == 5 and window["captures"][0]["launches"] == 300
    assert main(["report", str(path), "--format", "md"]) == 0
    assert "CUDA-graph capture: 1 window(s)" in capsys.readouterr().out


def test_an_nsys_export_without_kernel_or_nvtx_tables_says_what_it_lacks(tmp_path, capsys):
    """An export of a capture that recorded neither GPU activity nor ranges (nsys writes no empty tables)."""
    import sqlite3

    path = tmp_path / "report.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT)")
        db.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA B200')")
    assert main(["report", str(path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    missing = "\n".join(report["missing"])
    assert "report.sqlite has no CUPTI_ACTIVITY_KIND_KERNEL table: the capture recorded no GPU activity" in missing
    assert "report.sqlite has no NVTX_EVENTS table: no ranges were recorded" in missing
    (window,) = report["traces"]
    assert window["device"] == "NVIDIA B200" and window["ranges"] == []


def test_a_worker_threads_allocations_count_for_the_range_waiting_for_them(tmp_path):
    """``[memory]`` events on autograd's backward thread (which opens no range) count for the range open on the main
    thread at their time; the main thread's own count for its own ranges only."""

    def memory(tid: int, ts: float, size: int, total: int) -> dict:
        event = {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": tid, "ts": ts}
        event["args"] = {"Bytes": size, "Total Allocated": total, "Device Id": 0}
        return event

    events = [
        frame("user_annotation", "actor/update_actor", 0, 1000),
        frame("user_annotation", "rollout/generate", 2000, 500),
        memory(1, 100, 400, 400),  # the forward, on the main thread
        memory(2, 600, 300, 700),  # the backward's, on its own thread
        memory(2, 700, -300, 400),
        memory(1, 2100, 50, 450),
    ]
    path = tmp_path / "rank0.pt.trace.json.gz"
    write(path, events, marked=False)
    scan = scan_trace(path, by_rlprof=True)
    update, generate = scan.ranges["actor/update_actor"], scan.ranges["rollout/generate"]
    assert (update.allocated_bytes, update.peak_allocated) == (700, 700)
    assert (generate.allocated_bytes, generate.peak_allocated) == (50, 450)
