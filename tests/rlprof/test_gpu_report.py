"""The GPU part of ``rlprof report`` on traces recorded on GPUs by others (tests/data/traces, see SOURCES.tsv): the
diagnosis rules, the advice filter (an override this project measured slower on the run's kind of machine is not
offered), and the GPU sections in every format (the numbers themselves are checked against HTA in
test_field_traces.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from rlprof.analysis.diagnose import MEASURED_SLOWER, RULES, _offered, device_kind
from rlprof.analysis.render.units import short_name
from rlprof.analysis.report import build_report
from rlprof.analysis.report_model import Finding, ReportOptions
from rlprof.analysis.run import find_run
from rlprof.cli import main

from conftest import external_references, plotly_pixels, screenshot

TRACES = Path(__file__).parents[1] / "data" / "traces"
MODEL = "actor_rollout_ref.model"


def findings(*paths: Path) -> dict[str, Finding]:
    report = build_report(find_run(list(paths)), ReportOptions())
    return {f.rule: f for f in report.findings}


def a_run(folder: Path, trace: str, config: dict) -> Path:
    """A trainer log folder holding a corpus trace and the config it would have run with."""
    folder.mkdir()
    shutil.copy(TRACES / trace, folder / trace)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "run.json").write_text(json.dumps({"run_id": "corpus"}))
    return folder


def test_gpu_idle_fires_where_the_device_waits_most_of_the_span():
    nccl = findings(TRACES / "hta_nccl_data.json.gz")["gpu-idle"]
    assert nccl.evidence["gpu_idle_share"] == pytest.approx(0.762, abs=0.001)  # HTA's idle_time_pctg: 76.2
    assert "rank 0" in nccl.message and "idle 76%" in nccl.message
    alexnet = findings(TRACES / "hta_alexnet_trace.json.gz")["gpu-idle"]
    assert alexnet.evidence["gpu_idle_share"] > 0.99
    # busy traces, and idle ones too short to judge (< 10 ms of device span), do not fire
    assert "gpu-idle" not in findings(TRACES / "hta_ns_resolution_rank-0.pt.trace.json.gz")
    assert "gpu-idle" not in findings(TRACES / "hta_inference_rank_1.json.gz")  # 98% idle over 1.6 ms


def test_communication_exposed_fires_only_without_overlap():
    exposed = findings(TRACES / "hta_negative_queue_rank0.json.gz")["communication-exposed"]
    assert exposed.evidence["communication_overlap"] < 0.03
    assert exposed.evidence["communication_share_of_busy"] > 0.4
    # the V100 trace communicates as much (35% of busy) but computes beside it 71% of the time
    assert "communication-exposed" not in findings(TRACES / "hta_trace_diff_v100_rank1.json.gz")
    assert "communication-exposed" not in findings(TRACES / "hta_ns_resolution_rank-0.pt.trace.json.gz")
    both = findings(TRACES / "hta_sampled_ranks")["communication-exposed"]  # the worse of two ranks is named
    assert both.evidence["communication_overlap"] == pytest.approx(0.149, abs=0.002)


def test_the_gpu_rules_name_the_knobs_of_the_run(tmp_path):
    config = {
        "actor_rollout_ref": {
            "actor": {"zero_stage": 2, "ppo_micro_batch_size_per_gpu": 4, "ppo_mini_batch_size": 8},
            "rollout": {"name": "vllm", "enforce_eager": True, "n": 2},
        }
    }
    run = a_run(tmp_path / "run", "hta_negative_queue_rank0.json.gz", config)
    found = findings(run)
    assert found["gpu-idle"].overrides == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.enforce_eager=false",
    ]
    assert found["communication-exposed"].overrides[0] == "actor_rollout_ref.actor.overlap_comm=true"
    config["actor_rollout_ref"]["actor"].update(overlap_comm=True, zero_stage=3)
    config["actor_rollout_ref"]["rollout"]["enforce_eager"] = False
    again = findings(a_run(tmp_path / "again", "hta_negative_queue_rank0.json.gz", config))
    assert "actor_rollout_ref.actor.overlap_comm=true" not in again["communication-exposed"].overrides
    assert "actor_rollout_ref.rollout.enforce_eager=false" not in again["gpu-idle"].overrides


def test_the_compiled_decode_is_not_advised_where_the_trainer_refuses_it(tmp_path):
    """rlprof_train's hf rollout reads enforce_eager (its compiled decode) but refuses it under ZeRO 3."""
    config = {
        "actor_rollout_ref": {
            "actor": {"zero_stage": 3, "ppo_micro_batch_size_per_gpu": 8, "ppo_mini_batch_size": 8},
            "rollout": {"name": "hf", "enforce_eager": True, "n": 1},
        }
    }
    eager = "actor_rollout_ref.rollout.enforce_eager=false"
    record = {"run_id": "hf", "rollout": {"name": "hf", "reads": ["enforce_eager", "temperature"]}}
    zero3 = a_run(tmp_path / "zero3", "hta_negative_queue_rank0.json.gz", config)
    (zero3 / "run.json").write_text(json.dumps(record))
    assert eager not in findings(zero3)["gpu-idle"].overrides
    config["actor_rollout_ref"]["actor"]["zero_stage"] = 2
    zero2 = a_run(tmp_path / "zero2", "hta_negative_queue_rank0.json.gz", config)
    (zero2 / "run.json").write_text(json.dumps(record))
    assert eager in findings(zero2)["gpu-idle"].overrides


def test_an_override_measured_slower_on_this_kind_of_machine_is_not_offered():
    speed = next(r for r in RULES if r.name == "training-bound")
    memory = next(r for r in RULES if r.name == "memory-bound")
    pad = f"{MODEL}.use_remove_padding=true"
    checkpointing = f"{MODEL}.enable_gradient_checkpointing=true"
    finding = Finding("training-bound", "t", "m", {}, ["a.b=2", pad])
    on_cpu = _offered(finding, speed, "cpu")
    assert on_cpu.overrides == ["a.b=2"]
    assert on_cpu.not_offered == [f"{pad}: {MEASURED_SLOWER[(pad, 'cpu')]}"] and "1.51x slower" in on_cpu.not_offered[0]
    assert _offered(finding, speed, "cuda").overrides == ["a.b=2", pad]  # not measured on GPUs: offered there
    # a memory rule trades speed for memory: checkpointing stays
    assert _offered(Finding("memory-bound", "t", "m", {}, [checkpointing]), memory, "cpu").overrides == [checkpointing]


def test_the_kind_of_machine_comes_from_the_run():
    assert device_kind(build_report(find_run([TRACES / "hta_nccl_data.json.gz"]), ReportOptions())) == "cuda"
    assert (
        device_kind(build_report(find_run([TRACES / "hta_cpu_only_rank-34.pt.trace.json.gz"]), ReportOptions()))
        == "cpu"
    )


PLOTLY_GREEN = (0, 204, 150)
"""Plotly's third trace colour: the idle part of the GPU temporal breakdown (no other chart of this page has three)."""


def test_the_gpu_sections_in_markdown_json_and_the_html_page(tmp_path, capsys):
    folder = TRACES / "hta_sampled_ranks"
    assert main(["report", str(folder), "--format", "md"]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "[gpu-idle]",
        "[communication-exposed]",
        "## Inside the profiled windows",
        "GPU per step",
        "| idle |",
        "communication overlapped by compute",
        "Top kernels",
        "| ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t | communication |",
    ):
        assert fragment in out, fragment
    assert main(["report", str(folder), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {f["rule"] for f in data["findings"]} == {"gpu-idle", "communication-exposed"}
    assert [t["rank"] for t in data["traces"]] == [0, 1] and all(t["gpu"]["busy_us"] > 0 for t in data["traces"])
    page = tmp_path / "report.html"
    assert main(["report", str(folder), "--html", str(page), "--format", "md"]) == 0
    capsys.readouterr()
    assert external_references(page.read_text()) == []
    png = screenshot(page, tmp_path / "report.png", height=1600)
    assert plotly_pixels(png, PLOTLY_GREEN) > 5000, "the GPU temporal breakdown was not drawn"


def test_kernel_names_are_shortened_in_tables_and_kept_whole_in_json():
    name = (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
        "unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
        "unsigned int, float, 4>)"
    )
    assert short_name(name) == "at::native::reduce_kernel<512, 1, at::native::ReduceOp<…> >"
    assert short_name("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*, int, int)") == (
        "ncclKernel_AllReduce_RING_LL_Sum_float"
    )
    cut = short_name("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(cutlass_80::Params)")
    assert cut == "cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_n…" and len(cut) == 60
    assert short_name("aten::mm") == "aten::mm" and short_name("x" * 60) == "x" * 60


CAPTURE = TRACES / "tracelens_vllm_decode_graph_capture_rank0.pt.trace.json.gz"
"""TraceLens' vLLM decode trace: 55 of its 58 ms of device span are a CUDA-graph capture; no step markers."""


def test_a_span_that_is_mostly_graph_capture_is_judged_without_it(monkeypatch):
    """The device idles while a graph is captured (nothing to run yet): the rule judges the span left, 2.8 ms, too
    short to judge; made to judge it, its message quotes that span and the capture left out, not the raw 58 ms."""
    assert "gpu-idle" not in findings(CAPTURE)
    (rule,) = [r for r in RULES if r.name == "gpu-idle"]
    monkeypatch.setitem(rule.thresholds, "min_span_ms", 1.0)
    idle = findings(CAPTURE)["gpu-idle"]
    assert idle.evidence["gpu_span_ms"] == pytest.approx(2.8, abs=0.1)
    assert idle.evidence["capture_idle_ms_left_out"] == pytest.approx(55.0, abs=0.1)
    assert (
        "on rank 0 (whole trace) the device is idle 99% of the 2.81 ms it was traced outside its 55 ms of CUDA-graph "
        "capture" in idle.message
    ), idle.message


def test_a_trace_without_a_step_window_is_named_as_the_whole_trace(capsys):
    assert main(["report", str(CAPTURE), "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert "whole trace, rank 0 (chrome_trace): no step markers" in text
    assert "User annotations (the trace has no rlprof ranges), whole trace, rank 0" in text
    assert "?" not in "".join(line for line in text.splitlines() if "rank 0" in line), text
    assert main(["report", str(CAPTURE), "--format", "json"]) == 0
    assert [t["window"] for t in json.loads(capsys.readouterr().out)["traces"]] == ["whole trace"]
