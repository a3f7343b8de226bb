"""docs/extending.md's worked examples, run as written: a tool, a tracking backend, an advantage estimator, a
rollout backend, a diagnosis rule, an input source, a trace analysis, an output format and a report section, each
added from user code with one registration (the format and the section: one file) and then used through the public
config or command line."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

import rlprof
from rlprof.manifest import read_manifest

from conftest import ROOT, subprocess_env, trainer_command

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), re.S)


def run_blocks(*indices, **names):
    namespace = dict(names)
    for i in indices:
        exec(compile(BLOCKS[i], f"docs/extending.md block {i}", "exec"), namespace)
    return namespace


def test_the_documents_examples_are_all_here():
    assert len(BLOCKS) == 10


def test_a_tool_registered_from_user_code_records_through_the_public_config(tmp_path):
    run_blocks(0, 1, save_path=str(tmp_path))
    (record,) = read_manifest(tmp_path)
    assert record["tool"] == "wallclock" and record["steps"] == [2]
    rows = [json.loads(line) for line in (tmp_path / record["path"]).read_text().splitlines()]
    assert [row["range"] for row in rows] == ["rollout/generate"] and rows[0]["ms"] >= 10
    bad = {"global_profiler": {"tool": "wallclock", "global_tool_config": {"wallclock": {"min_mss": 1}}}}
    try:
        rlprof.init(bad)
    except rlprof.ConfigError as exc:  # its settings are checked like a built-in tool's
        assert "wallclock.min_mss: unknown key (did you mean 'min_ms'?)" in str(exc)
    else:
        raise AssertionError("an unknown setting of the user's tool was accepted")


def test_a_backend_registered_from_user_code_receives_the_metrics(tmp_path):
    run_blocks(2, log_dir=tmp_path)
    assert (tmp_path / "metrics.csv").read_text() == "1,reward/mean,0.5\n"
    from rlprof_train.config.load import load_trainer_config
    from rlprof_train.preflight import validate

    validate(
        load_trainer_config(["--config-name=demo", "trainer.logger=[console,csv]"])
    )  # and the trainer accepts its name


def test_an_estimator_registered_from_user_code_is_used_by_the_trainer_config(capsys):
    from rlprof_train import algos
    from rlprof_train.main_ppo import main

    run_blocks(3)
    try:
        rewards, mask = torch.tensor([[1.0], [0.0], [3.0], [3.0]]), torch.ones(4, 1)
        adv, _ = algos.compute_advantage("grpo_max_baseline", rewards, mask, index=[0, 0, 1, 1])
        assert adv.flatten().tolist() == [0.0, -1.0, 0.0, 0.0]
        assert main(["algorithm.adv_estimator=grpo_max_baseline", "actor_rollout_ref.rollout.n=1"]) == 2
        assert "grpo_max_baseline compares the n responses of a prompt; use n >= 2" in capsys.readouterr().err
    finally:
        del algos.ADV_ESTIMATORS["grpo_max_baseline"]


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_rollout_registered_in_the_reward_file_trains_by_name(tmp_path):
    code = tmp_path / "oracle.py"
    code.write_text(BLOCKS[4])
    command = trainer_command(
        tmp_path,
        f"custom_reward_function.path={code}",
        "actor_rollout_ref.rollout.name=oracle",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",  # a vLLM setting the oracle does not read
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "the oracle backend ignores the vLLM engine settings max_num_batched_tokens=4096" in out
    steps = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in steps if "critic/score/mean" in r]
    assert scores == [1.0, 1.0]  # every response is its prompt's answer
    record = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert record["rollout"] == {"name": "oracle", "reads": [], "returns_log_probs": False}


def test_a_rule_registered_from_user_code_fires_in_the_report(tmp_path):
    from rlprof.analysis import diagnose
    from rlprof.analysis.report import build_report
    from rlprof.analysis.report_model import ReportOptions
    from rlprof.analysis.run import find_run
    from rlprof.tracking import Tracker

    run_blocks(5)
    try:
        with Tracker("p", "long-tail", ["file"], log_dir=tmp_path) as tracker:
            for step in range(1, 21):
                seconds = 3.0 if step % 5 == 0 else 1.0  # every fifth step three times as long
                tracker.log({"timing_s/step": seconds, "timing_s/gen": seconds / 2}, step=step)
        report = build_report(find_run([tmp_path]), ReportOptions())
        (finding,) = [f for f in report.findings if f.rule == "long-tail"]
        assert finding.evidence["p90_over_median"] == pytest.approx(3.0)
    finally:
        diagnose.RULES[:] = [r for r in diagnose.RULES if r.name != "long-tail"]


def test_a_source_registered_from_user_code_is_read_by_rlprof_report(tmp_path, capsys):
    from rlprof.analysis import sources
    from rlprof.cli import main

    run_blocks(6)
    try:
        rows = ["thread,name,start_us,duration_us", "main,rollout/gen,0,500", "main,actor/update,600,300"]
        rows += ["main,rollout/gen,1000,700", "loader,prefetch,0,900"]
        (tmp_path / "ranges.csv").write_text("\n".join(rows) + "\n")
        assert main(["report", str(tmp_path), "--format", "json"]) == 0
        (trace,) = json.loads(capsys.readouterr().out)["traces"]
        totals = {r["label"]: (r["count"], r["total_ms"]) for r in trace["ranges"]}
        assert trace["source"] == "range_csv" and trace["range_kind"] == "range"
        assert totals == {"rollout/gen": (2, 1.2), "actor/update": (1, 0.3)}
        (tmp_path / "ranges.csv").write_text("thread,name,start_us,duration_us\nmain,rollout/gen,soon,5\n")
        assert main(["report", str(tmp_path / "ranges.csv"), "--format", "json"]) == 2
        assert "ranges.csv:2: start_us and duration_us must be numbers" in capsys.readouterr().err
    finally:
        del sources._SOURCES["range_csv"]


def test_a_trace_analysis_registered_from_user_code_adds_its_part_to_every_scan():
    """The longest device operation of a trace recorded on a GPU (HTA's test data), as the analysis finds it and as
    the trace's own events give it."""
    import gzip

    from rlprof.analysis import trace_model
    from rlprof.analysis.sources.chrome_trace import scan_trace

    trace = ROOT / "tests" / "data" / "traces" / "hta_trace_diff_v100_rank1.json.gz"
    run_blocks(7)
    try:
        found = scan_trace(trace).extra["longest_device_op"]
    finally:
        del trace_model._ANALYSES["longest_device_op"]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    longest = max(device, key=lambda e: float(e["dur"]))
    assert found == (longest["name"], float(longest["dur"]))
    assert "longest_device_op" not in scan_trace(trace).extra  # unregistered: gone


def test_an_output_format_in_a_file_of_yours_is_used_by_import_path(tmp_path, capsys, monkeypatch):
    import csv
    import io

    from rlprof.cli import main

    (tmp_path / "my_formats.py").write_text(BLOCKS[8])
    monkeypatch.syspath_prepend(str(tmp_path))
    trace = ROOT / "tests" / "data" / "traces" / "hta_cpu_only_rank-34.pt.trace.json.gz"
    assert main(["report", str(trace), "--format", "my_formats:csv_tables"]) == 0
    printed = capsys.readouterr().out
    assert main(["report", str(trace), "--format", "json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["traces"][0]["ranges"]  # gloo:all_reduce, 10 times
    rows = list(csv.reader(io.StringIO(printed)))
    header = rows.index(["range", "count", "total ms", "self ms"])
    assert rows[header - 1][0].startswith("# Inside the profiled windows (traces)")
    assert rows[header + 1][:2] == [listed["label"], str(listed["count"])]
    assert float(rows[header + 1][2].replace(",", "")) == pytest.approx(listed["total_ms"], abs=0.05)
    with pytest.raises(SystemExit) as stopped:  # argparse's usage error, before any reading
        main(["report", str(trace), "--format", "my_formats:nothing"])
    assert stopped.value.code == 2
    assert "argument --format: 'my_formats:nothing': AttributeError" in capsys.readouterr().err


def test_a_report_section_in_a_file_of_yours_takes_part_with_plugin(tmp_path, capsys, monkeypatch):
    from rlprof.analysis import report_sections
    from rlprof.cli import main
    from rlprof.tracking import Tracker

    seconds = {step: 1.0 + (step * 7 % 11) / 10 for step in range(1, 13)}
    with Tracker("p", "sections", ["file"], log_dir=tmp_path / "logs") as tracker:
        for step, took in seconds.items():
            tracker.log({"timing_s/step": took, "timing_s/gen": took / 2}, step=step)
    (tmp_path / "my_sections.py").write_text(BLOCKS[9])
    monkeypatch.syspath_prepend(str(tmp_path))
    before = report_sections.report_sections()
    try:
        assert main(["report", str(tmp_path / "logs"), "--plugin", "my_sections", "--format", "json"]) == 0
        part = json.loads(capsys.readouterr().out)["extra"]["slowest_steps"]
        slowest = sorted(seconds, key=lambda step: -seconds[step])[:3]  # independently: the three longest
        assert [row["step"] for row in part] == slowest
        assert [row["seconds"] for row in part] == pytest.approx([seconds[step] for step in slowest])
        assert main(["report", str(tmp_path / "logs"), "--format", "md"]) == 0
        titles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("## ")]
        assert titles.index("## Slowest steps") == titles.index("## Step breakdown (timing_s/*)") + 1, titles
    finally:
        report_sections._SECTIONS[:] = before
    assert main(["report", str(tmp_path / "logs"), "--plugin", "no_such_sections"]) == 2
    assert "--plugin no_such_sections: no module named 'no_such_sections' on the PYTHONPATH" in capsys.readouterr().err
