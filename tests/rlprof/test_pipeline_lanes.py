"""``rlprof timeline`` draws an asynchronous run's pipeline records (rlprof.analysis.pipeline_lanes): records
written by PipelineLog for a trainer and a rollout process on clocks of their own, placed on the wall clock by their
clock lines; each prompt's life from its sampling to its update; what is broken in the files is skipped and said, a
link is not followed; Perfetto's UI shows every lane. The real run's lanes, against its traces:
tests/rlprof_train/test_one_step_off.py."""

from __future__ import annotations

import json
import time

import pytest

from rlprof.cli import main
from rlprof.metrics.pipeline_records import PipelineLog
from rlprof.tracking import Tracker
from tests.rlprof.test_pipeline_metrics import Clock
from tests.rlprof_train.test_one_step_off import sample_lives

from conftest import ROOT, open_in_perfetto


def written(tmp_path):
    """A rollout process (launch rank 1) whose clock reads 100 s behind the trainer's (rank 0): it samples step 2's
    batch from 105 to 107 on its clock (5 to 7 on the trainer's); the trainer waits for it from 6 to 7 in step 2's
    window (4 to 10) and consumes both trajectories of prompt 7."""
    trainer_clock, rollout_clock = Clock(), Clock()
    rollout_clock.now = 100.0
    trainer = PipelineLog(tmp_path, 0, "trainer", clock=trainer_clock)
    rollout = PipelineLog(tmp_path, 1, "rollouter", clock=rollout_clock)
    rollout.write(
        {"event": "generate", "step": 2, "beside": 1, "version": 0, "rows": 2, "began": 105.0, "ended": 107.0}
    )
    trainer.write({"event": "window", "side": "trainer", "began": 0.0, "ended": 4.0, "step": 1})
    trainer.write({"event": "wait", "side": "trainer", "reason": "samples", "began": 6.0, "ended": 7.0})
    trainer.write({"event": "window", "side": "trainer", "began": 4.0, "ended": 10.0, "step": 2})
    sample = {"event": "sample", "step": 2, "uid": 7, "version": 0, "consumed_version": 1, "rollout_rank": 0}
    trainer.write_all([{**sample, "response_tokens": 3}, {**sample, "response_tokens": 5}])
    trainer.close()
    rollout.close()
    with Tracker("p", "pipeline", ["file"], log_dir=tmp_path) as tracker:  # what a run logs beside its records
        tracker.log({"timing_s/step": 4.0}, 1)
    return tmp_path / "pipeline"


@pytest.mark.slow  # Perfetto's UI in Chromium: kept out of the quick loop
def test_each_process_and_prompt_is_drawn_on_one_clock(tmp_path, capsys):
    folder = written(tmp_path / "logs")
    for path in folder.glob("rank*.jsonl"):  # both processes started within a second: a shared wall-clock start
        lines = path.read_text().splitlines()
        clock = json.loads(lines[0]) | {"wall": 1_800_000_000.0}
        path.write_text("\n".join([json.dumps(clock), *lines[1:]]) + "\n")
    output = tmp_path / "timeline.json"
    assert main(["timeline", str(tmp_path / "logs"), "-o", str(output)]) == 0
    assert "pipeline records of 2 processes, 1 prompts followed" in capsys.readouterr().out
    events = json.loads(output.read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(lanes.values()) == ["rank 0 trainer pipeline", "rank 1 rollout pipeline", "sample lives"]
    spans = {(lanes[e["pid"]], e["name"]): (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X"}
    rollout_start = spans[("rank 1 rollout pipeline", "sample step 2")][0]
    assert spans[("rank 0 trainer pipeline", "step 2")] == (rollout_start - 1e6, rollout_start + 5e6)
    assert spans[("rank 0 trainer pipeline", "wait: samples")] == (rollout_start + 1e6, rollout_start + 2e6)
    (life,) = sample_lives(events, next(pid for pid, name in lanes.items() if name == "sample lives"))
    assert life["uid"] == "7" and life["args"]["trajectories"] == 2 and life["args"]["response_tokens"] == 8
    s = rollout_start
    assert life["phases"] == [("generating", s, s + 2e6), ("queued", s + 2e6, s + 2e6), ("training", s + 2e6, s + 5e6)]
    png = ROOT / "outputs" / "screenshots" / "timeline_pipeline_perfetto.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    shown = open_in_perfetto(output, png, "rank 0 trainer pipeline", "rank 1 rollout pipeline", "sample lives")
    assert shown["missing"] == [] and shown["errors"] == "", shown


def test_a_streamed_groups_pause_for_a_sync_cuts_its_sampling(tmp_path, capsys):
    """A fully-async rollout process's group (uid 9) sampled from 105 to 109 on its clock, paused for new weights from
    106 to 107 (a partial rollout), then taken by the trainer's wait that ends at 9.5 (its clock) in step 1's window
    (4 to 10): generating, paused for a sync, generating, queued, training, one after the other."""
    trainer_clock, rollout_clock = Clock(), Clock()
    rollout_clock.now = 100.0
    trainer = PipelineLog(tmp_path / "logs", 0, "trainer", clock=trainer_clock)
    rollout = PipelineLog(tmp_path / "logs", 1, "rollouter", clock=rollout_clock)
    rollout.write({"event": "pause", "uid": 9, "version": 1, "began": 106.0, "ended": 107.0})
    generated = {"event": "generate", "uid": 9, "step": 2, "version": 1, "first_version": 0, "rows": 2}
    rollout.write({**generated, "began": 105.0, "ended": 109.0})
    trainer.write({"event": "wait", "side": "trainer", "reason": "samples", "began": 8.0, "ended": 9.5})
    trainer.write({"event": "window", "side": "trainer", "began": 4.0, "ended": 10.0, "step": 1})
    trainer.write({"event": "sample", "step": 1, "uid": 9, "version": 1, "consumed_version": 0, "rollout_rank": 0})
    trainer.close()
    rollout.close()
    with Tracker("p", "pipeline", ["file"], log_dir=tmp_path / "logs") as tracker:  # what a run logs beside them
        tracker.log({"timing_s/step": 6.0}, 1)
    for path in (tmp_path / "logs" / "pipeline").glob("rank*.jsonl"):  # one wall-clock start for both
        lines = path.read_text().splitlines()
        path.write_text("\n".join([json.dumps(json.loads(lines[0]) | {"wall": 1_800_000_000.0}), *lines[1:]]) + "\n")
    output = tmp_path / "timeline.json"
    assert main(["timeline", str(tmp_path / "logs"), "-o", str(output)]) == 0
    events = json.loads(output.read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    (life,) = sample_lives(events, next(pid for pid, name in lanes.items() if name == "sample lives"))
    names = [name for name, _, _ in life["phases"]]
    assert names == ["generating", "paused for a sync", "generating", "queued", "training"]
    ends = [time for _, began, ended in life["phases"] for time in (began, ended)]
    assert ends == sorted(ends)
    spans = [round((ended - began) / 1e6, 3) for _, began, ended in life["phases"]]
    assert spans == [1.0, 1.0, 2.0, 0.5, 0.5]


def test_broken_lines_and_links_are_skipped_and_said(tmp_path, capsys):
    folder = written(tmp_path / "logs")
    with (folder / "rank0.jsonl").open("a") as handle:
        handle.write('{"event": "wait", "began": "soon"}\nnot json\n[1, 2]\n' + "x" * 70_000 + "\n")
    (folder / "rank2.jsonl").write_text('{"event": "wait", "began": 1.0, "ended": 2.0}\n')  # no clock line
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps({"event": "clock", "side": "trainer", "monotonic": 0, "wall": time.time()}) + "\n")
    (folder / "rank3.jsonl").symlink_to(outside)
    output = tmp_path / "timeline.json"
    assert main(["timeline", str(tmp_path / "logs"), "-o", str(output)]) == 0
    out = capsys.readouterr().out
    assert "rank0.jsonl: 4 lines without a clock, times or JSON skipped" in out
    assert "rank2.jsonl: 1 lines without a clock, times or JSON skipped" in out
    assert "rank3.jsonl: not a plain file; not read" in out
    lanes = {
        e["args"]["name"] for e in json.loads(output.read_text())["traceEvents"] if e.get("name") == "process_name"
    }
    assert lanes == {"rank 0 trainer pipeline", "rank 1 rollout pipeline", "sample lives"}


def test_the_records_read_are_bounded_and_the_cut_is_said(tmp_path, monkeypatch):
    """At most MAX_LINES records over all files (memory stays bounded on a long run's records): here 7, of the
    trainer's 6 lines and the rollout process's 2; the rollout's file is not read to its end, and says so."""
    from rlprof.analysis import pipeline_lanes

    folder = written(tmp_path / "logs")
    monkeypatch.setattr(pipeline_lanes, "MAX_LINES", 7)
    pipeline = pipeline_lanes.read_pipeline(folder.parent)
    assert pipeline is not None
    assert [len(p.events) for p in pipeline.processes] == [5, 0]  # the clock lines are read, not kept as events
    assert pipeline.notes == ["rank1.jsonl: not read to its end (the pipeline lanes hold 7 records at most)"]
