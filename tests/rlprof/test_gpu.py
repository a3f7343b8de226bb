"""The CUDA-only paths, on a real device (``-m gpu``; skipped where there is no CUDA device, which is the only reason
they skip): cudaProfilerApi around windows and around ranges in discrete mode, and the DeepSpeed trainer on CUDA with
torch_memory (a snapshot per window with role tags, read back by ``rlprof memory``; ``perf/max_memory_*``; MFU against
the device's peak) and with torch (CUDA kernels in the trace, attributed to their ranges by ``rlprof report``).
``scripts/gpu_kit.sh run`` runs them on a machine with no network."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

import rlprof
from rlprof.cli import main
from rlprof.metrics.flops import peak_flops

from conftest import ROOT, subprocess_env, trainer_command

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def capture_calls(monkeypatch):
    """Each torch.cuda.profiler.start/stop call, in order (the real calls still run)."""
    calls: list[str] = []
    for name in ("start", "stop"):
        real = getattr(torch.cuda.profiler, name)

        def spy(real=real, name=name):
            calls.append(name)
            return real()

        monkeypatch.setattr(torch.cuda.profiler, name, spy)
    return calls


@pytest.mark.parametrize(
    "continuous, captures",
    [(False, ["start", "stop"] * 3), (True, ["start", "stop"] * 2)],  # steps 2, 3, 5 / windows 2-3 and 5
    ids=["a window per step", "profile_continuous_steps"],
)
def test_one_capture_per_step_window(tmp_path, capture_calls, continuous, captures):
    """verl's windows: each selected step is its own (``profile_continuous_steps: false``, verl's default), or runs
    of consecutive steps are one."""
    config = {"tool": "nsys", "steps": [2, 3, 5], "save_path": str(tmp_path), "profile_continuous_steps": continuous}
    rlprof.init({"global_profiler": config})
    for step in range(1, 7):
        with rlprof.step(step):
            with rlprof.profile_range("work", role="actor"):
                torch.ones(1024, device="cuda").sum().item()
    rlprof.shutdown()
    assert capture_calls == captures


def test_discrete_mode_captures_each_outermost_range(tmp_path, capture_calls):
    config = {
        "global_profiler": {
            "tool": "nsys",
            "steps": [1],
            "save_path": str(tmp_path),
            "global_tool_config": {"nsys": {"discrete": True}},
        }
    }
    rlprof.init(config)
    with rlprof.step(1):
        for _ in range(3):
            with rlprof.profile_range("outer", role="actor"), rlprof.profile_range("inner", role="actor"):
                torch.ones(8, device="cuda").sum().item()
    rlprof.shutdown()
    assert capture_calls == ["start", "stop"] * 3


def trainer(tmp_path, *overrides):
    command = trainer_command(
        tmp_path,
        "trainer.device=cuda",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        *overrides,
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_on_cuda_writes_snapshots_with_role_tags_memory_peaks_and_mfu(tmp_path, capsys):
    records = trainer(tmp_path, "global_profiler.tool=torch_memory", "global_profiler.steps=[2]")
    last = records[-1]
    assert (
        last["perf/max_memory_allocated_gb"] > 0
        and last["perf/max_memory_reserved_gb"] >= last["perf/max_memory_allocated_gb"]
    )
    peak = peak_flops(torch.cuda.get_device_name(0))
    assert peak is not None, f"no peak FLOP/s known for {torch.cuda.get_device_name(0)}"
    assert 0 < last["perf/mfu/actor"] < 1  # against that peak
    (snapshot,) = (tmp_path / "profile" / "torch_memory").rglob("step2/*.pickle")
    assert main(["memory", str(snapshot), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["devices"][0]["summary"]
    assert summary["device"] == "cuda:0" and summary["peak_bytes"] > 0
    assert any(tag.startswith("actor/") for tag in summary["by_tag"]), summary["by_tag"]


def test_the_trainer_on_cuda_traces_kernels_under_their_ranges(tmp_path, capsys):
    trainer(
        tmp_path,
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        "global_profiler.global_tool_config.torch.contents=[cpu,cuda]",
    )
    assert main(["report", str(tmp_path / "logs"), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ranges = {r["label"]: r for window in report["traces"] for r in window["ranges"]}
    assert ranges["actor/update_actor"]["cuda_ms"] > 0, ranges["actor/update_actor"]


def test_a_torch_window_on_cuda_sets_the_live_gpu_idle_share_the_report_gives(tmp_path):
    """A window whose host sleeps between bursts of kernels: the live gauge (rlprof.live_gpu_idle) reads its trace
    and gives the report's gpu-idle share for it."""
    import time

    from rlprof.analysis.report import build_report
    from rlprof.analysis.report_model import ReportOptions
    from rlprof.analysis.run import find_run
    from rlprof.live_gpu_idle import WindowGpuIdle
    from rlprof.tracking import Tracker

    save = tmp_path / "profile"
    config = {
        "global_profiler": {
            "tool": "torch",
            "steps": [2],
            "save_path": str(save),
            "global_tool_config": {"torch": {"contents": ["cpu", "cuda"]}},
        }
    }
    session = rlprof.init(config)
    x = torch.randn(2048, 2048, device="cuda")
    with Tracker("p", "gpu", ["file"], log_dir=tmp_path / "logs") as tracker:
        gauge = WindowGpuIdle.follow(session, tracker)
        for step in (1, 2, 3):
            with rlprof.step(step):
                for _ in range(5):
                    (x @ x).sum().item()
                    time.sleep(0.02)  # the host keeps the device waiting
        rlprof.shutdown()
        assert gauge.wait(120)
        measured = {s.key: s.value for s in gauge.live_samples()}
        gauge.close()
    (finding,) = [f for f in build_report(find_run([save]), ReportOptions()).findings if f.rule == "gpu-idle"]
    assert measured["gpu/idle_share"] == pytest.approx(finding.evidence["gpu_idle_share"], abs=1e-4)
    assert measured["gpu/idle_share"] > 0.5 and measured["gpu/idle_share_step"] == 2
