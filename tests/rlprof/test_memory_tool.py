"""The torch_memory tool: its CPU fallback (host RSS per range) on every machine, the CUDA snapshot path where a
GPU exists, and the pure helpers."""

from __future__ import annotations

import functools
import json
import pickle
import warnings

import pytest
import torch

import rlprof
from rlprof.manifest import read_manifest
from rlprof.tools.host_memory import read_rss, summarize_by_role

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


@pytest.mark.gpu
@needs_cuda
def test_cuda_snapshot_per_window_with_role_metadata_and_oom_snapshot(tmp_path, capsys):
    """On the device: a snapshot per window, the range's own allocations tagged; its backward's (autograd's thread:
    no tag, no stack) owned by the range by time; an OOM inside a range written and read back leading with it."""
    from rlprof.analysis.sources.cuda_snapshot import NO_PYTHON_STACK
    from rlprof.cli import main

    layer = torch.nn.Linear(4096, 4096, device="cuda")

    @rlprof.profiled(role="actor", name="update")
    def update():
        inputs = torch.randn(8192, 4096, device="cuda")
        layer(inputs).square().mean().backward()  # the backward runs on autograd's device thread
        return inputs

    @rlprof.profiled(role="actor", name="huge")
    def huge():
        return torch.empty(1 << 50, dtype=torch.uint8, device="cuda")

    rlprof.init(
        memory_config(
            tmp_path,
            steps=[1, 2],
            profile_continuous_steps=True,  # one window of steps 1-2 (verl's default: a window per step)
            global_tool_config={"torch_memory": {"trace_alloc_max_entries": 10_000}},
        )
    )
    kept = []
    for n in range(4):
        with rlprof.step(n):
            kept.append(update())
            if n == 2:
                with pytest.raises(torch.cuda.OutOfMemoryError):
                    huge()
    rlprof.shutdown()
    paths = sorted(m["path"] for m in read_manifest(tmp_path))
    window = tmp_path / next(p for p in paths if p.startswith("torch_memory/step1-2/rank0_pid"))
    oom = tmp_path / next(p for p in paths if p.startswith("torch_memory/oom_rank0_pid"))
    snapshot = pickle.loads(window.read_bytes())
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    assert any(e.get("user_metadata") == "actor/update" for e in allocs)
    assert any(not e.get("user_metadata") and not e.get("frames") for e in allocs)  # the backward's
    assert {m["name"] for m in snapshot["external_annotations"]} >= {"actor/update"}
    assert snapshot["rlprof"]["devices"][0]["total_memory"] == torch.cuda.get_device_properties(0).total_memory

    assert main(["memory", str(window), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["devices"][0]["summary"]
    backward = [s for s in summary["top_sites"] if s["site"] == NO_PYTHON_STACK]
    assert backward and all(s["tag"] == "actor/update" for s in backward)  # owned by the range that ran it
    assert summary["by_tag"]["actor/update"] >= 8192 * 4096 * 4 and summary["by_role"]["actor"] > 0

    assert main(["memory", str(oom), "--format", "md", "--html", str(tmp_path / "oom.html")]) == 0
    text = capsys.readouterr().out
    head = text[: text.index("Live at the failure per role")]
    assert "cuda:0 ran out of memory" in head and "1.000 PiB requested in actor/huge" in head, head
    assert "free of" in head and "What to try" in text and (tmp_path / "oom.html").stat().st_size > 0


def test_verls_history_settings_reach_torch_and_unknown_ones_are_named(tmp_path, monkeypatch):
    """``context``, ``stacks`` and ``kw_args`` (verl's keys) are what ``_record_memory_history`` is called with; a
    keyword rlprof sets itself, or one this torch lacks, is one config error naming it. CUDA's memory API is replaced at
    the hardware boundary (this machine has no GPU): the call is recorded, the snapshot is empty."""
    calls = []
    memory = torch.cuda.memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real = memory._record_memory_history

    @functools.wraps(real)  # its signature, which the settings are checked against
    def record(*args, **kwargs):
        calls.append((args, kwargs))

    monkeypatch.setattr(memory, "_record_memory_history", record)
    monkeypatch.setattr(memory, "_snapshot", lambda *args, **kwargs: {"segments": [], "device_traces": [[]]})
    metadata = [""]
    monkeypatch.setattr(memory, "_set_memory_metadata", lambda value: metadata.__setitem__(0, value))
    monkeypatch.setattr(memory, "_get_memory_metadata", lambda: metadata[0])
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", lambda observer: None, raising=False)
    settings = {"context": "alloc", "stacks": "all", "kw_args": {"clear_history": True}, "oom_snapshot": False}
    config = memory_config(tmp_path, steps=[1], global_tool_config={"torch_memory": settings})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tool must not turn itself off
        rlprof.init(config, rank=0, world_size=1)
        try:
            with rlprof.step(1):
                grow(1)
        finally:
            rlprof.shutdown()
    assert [r["tool"] for r in read_manifest(tmp_path)] == ["torch_memory"]  # the window's snapshot
    assert calls[0] == (("all",), {"context": "alloc", "stacks": "all", "max_entries": 100_000, "clear_history": True})
    assert calls[-1] == ((None,), {})  # stopped at the window's end
    for kw_args, named in (
        ({"max_entries": 5}, "kw_args.max_entries: set by rlprof; use torch_memory.trace_alloc_max_entries"),
        ({"colour": 1}, "kw_args.colour: not an argument of this torch's _record_memory_history; allowed: "),
    ):
        with pytest.raises(rlprof.ConfigError, match=named):
            rlprof.init(memory_config(tmp_path, global_tool_config={"torch_memory": {"kw_args": kw_args}}))
