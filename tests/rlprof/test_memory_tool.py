"""The torch_memory tool: its CPU fallback (host RSS per range) on every machine, the CUDA snapshot path where a
GPU exists, and the pure helpers."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch

import rlprof
from rlprof.manifest import read_manifest
from rlprof.tools.host_memory import read_rss, summarize_by_role
from rlprof.tools.torch_memory import trim_stacks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU path of torch_memory)")


def memory_config(save_path, **extra):
    gp = {"tool": "torch_memory", "save_path": str(save_path), **extra}
    return {"global_profiler": gp}


@rlprof.profiled(role="actor", name="grow")
def grow(megabytes: int) -> int:
    block = bytearray(megabytes * 1024 * 1024)
    for i in range(0, len(block), 4096):
        block[i] = 1  # touch every page so it counts in RSS
    return len(block)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_cpu_fallback_warns_once_and_records_rss_per_range(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rlprof.init(memory_config(tmp_path, steps=[1, 2], profile_continuous_steps=True))
        for n in range(4):
            with rlprof.step(n):
                with rlprof.profile_range("outer", role="rollout"):
                    grow(64)
        rlprof.shutdown()
    notes = [w for w in caught if "torch_memory" in str(w.message)]
    assert len(notes) == 1 and "CUDA is not available" in str(notes[0].message)
    entries = read_manifest(tmp_path)
    assert sorted(e["path"].split(".", 1)[1] for e in entries) == ["host_alloc.json.gz", "host_memory.jsonl"]
    (entry,) = [e for e in entries if e["path"].endswith(".host_memory.jsonl")]
    assert entry["path"].startswith("torch_memory/step1-2/rank0_pid")
    lines = [json.loads(line) for line in (tmp_path / entry["path"]).read_text().splitlines()]
    ranges = [r for r in lines if r["kind"] == "range"]
    assert [(r["role"], r["name"], r["step"]) for r in ranges] == [
        ("actor", "grow", 1),
        ("rollout", "outer", 1),
        ("step", "between_steps", 1),
        ("actor", "grow", 2),
        ("rollout", "outer", 2),
    ]
    for r in ranges:
        if r["role"] == "step":
            continue
        assert r["peak_rss"] - r["rss_before"] >= 60 * 1024 * 1024  # the 64 MiB block is inside every range
    summaries = {r["role"]: r for r in lines if r["kind"] == "role_summary"}
    assert summaries["actor"]["ranges"] == 2 and summaries["rollout"]["ranges"] == 2


def test_memory_gating_by_step_and_rank(tmp_path):
    roles = {"actor": {"profiler": {"ranks": [1]}}}
    rank0 = rlprof.init({**memory_config(tmp_path, steps=[3]), **roles}, rank=0, world_size=2)
    assert rank0.tool_name is None
    rank1 = rlprof.init({**memory_config(tmp_path, steps=[3]), **roles}, rank=1, world_size=2)
    assert rank1.tool_name == "torch_memory"
    for n in range(1, 5):
        with rlprof.step(n):
            assert (rank1.window is not None) == (n == 3)
            grow(1)
    rlprof.shutdown()
    entries = read_manifest(tmp_path)
    assert len(entries) == 2  # RSS per range and the allocation timeline
    assert all(e["rank"] == 1 and e["steps"] == [3] and "rank1_pid" in e["path"] for e in entries)


def test_summaries_and_rss_reader():
    rss, peak = read_rss()
    assert 0 < rss <= peak
    records = [
        {"role": "a", "rss_before": 10, "rss_after": 30, "peak_rss": 50},
        {"role": "a", "rss_before": 30, "rss_after": 25, "peak_rss": 40},
        {"role": "b", "rss_before": 5, "rss_after": 5, "peak_rss": 7},
    ]
    assert summarize_by_role(records) == [
        {"kind": "role_summary", "role": "a", "ranges": 2, "peak_rss": 50, "max_rss_growth": 20},
        {"kind": "role_summary", "role": "b", "ranges": 1, "peak_rss": 7, "max_rss_growth": 0},
    ]


def test_trim_stacks_cuts_frames_of_blocks_and_trace_entries():
    frames = [{"filename": f"f{i}.py", "line": i, "name": "fn"} for i in range(10)]
    snapshot = {
        "segments": [{"blocks": [{"frames": list(frames)}, {"size": 1}]}],
        "device_traces": [[{"action": "alloc", "frames": list(frames)}]],
    }
    trim_stacks(snapshot, 3)
    assert snapshot["segments"][0]["blocks"][0]["frames"] == frames[:3]
    assert snapshot["device_traces"][0][0]["frames"] == frames[:3]


@pytest.mark.gpu
@needs_cuda
def test_cuda_snapshot_per_window_with_role_metadata_and_oom_snapshot(tmp_path, capsys):
    @rlprof.profiled(role="actor", name="alloc")
    def alloc():
        return torch.empty(32 * 1024 * 1024, device="cuda")

    rlprof.init(
        memory_config(
            tmp_path,
            steps=[1, 2],
            profile_continuous_steps=True,  # one window of steps 1-2 (verl's default: a window per step)
            global_tool_config={"torch_memory": {"trace_alloc_max_entries": 1000, "stack_depth": 4}},
        )
    )
    kept = []
    for n in range(4):
        with rlprof.step(n):
            kept.append(alloc())
            if n == 2:
                with pytest.raises(torch.cuda.OutOfMemoryError):
                    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    rlprof.shutdown()
    paths = sorted(m["path"] for m in read_manifest(tmp_path))
    assert any(p.startswith("torch_memory/step1-2/rank0_pid") and p.endswith(".pickle") for p in paths)
    assert any(p.startswith("torch_memory/oom_rank0_pid") for p in paths)
    snapshot = pickle.loads((tmp_path / next(p for p in paths if "step1-2" in p)).read_bytes())
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    assert any(e.get("user_metadata") == "actor/alloc" for e in allocs)
    assert all(len(e.get("frames", [])) <= 4 for e in allocs)
    # rlprof memory reads both: the window's snapshot (the 128 MiB blocks tagged actor/alloc) and the OOM one
    from rlprof.cli import main

    window = tmp_path / next(p for p in paths if "step1-2" in p)
    assert main(["memory", str(window), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["by_tag"]["actor/alloc"] >= 128 * 2**20 and summary["peak_bytes"] >= 128 * 2**20
    oom = tmp_path / next(p for p in paths if p.startswith("torch_memory/oom_"))
    assert main(["memory", str(oom), "--format", "md", "--html", str(tmp_path / "oom.html")]) == 0
    text = capsys.readouterr().out
    assert "OOM snapshot" in text and "actor/alloc" in text and (tmp_path / "oom.html").stat().st_size > 0
