"""``rlprof compare``: the statistics on data with a known answer, runs of different lengths, a resumed run and
missing metrics on written logs, the JSON against its schema; then real trainer runs that differ in one knob:
``use_remove_padding`` (that key alone in the diff, the same learning, phase speed with intervals) and
``kl_loss_coef`` (a learning difference), the HTML page with its overlaid curves opened offline in Chromium."""

from __future__ import annotations

import json
import random
import re
import subprocess

import jsonschema
import pytest
import yaml

from rlprof.analysis.compare import bootstrap_difference, bootstrap_ratio, compare, verdict
from rlprof.analysis.render.jsonout import schema
from rlprof.analysis.run import find_run
from rlprof.cli import main

from conftest import (
    PLOTLY_BLUE,
    PLOTLY_GREEN,
    PLOTLY_RED,
    ROOT,
    external_references,
    plotly_pixels,
    screenshot,
    subprocess_env,
    trainer_command,
)

# ------------------------------------------------------------------------------------------------- statistics


def test_a_ratio_of_medians_is_found_with_an_interval_that_excludes_no_change():
    rng = random.Random(1)
    a = [rng.gauss(1.0, 0.05) for _ in range(40)]
    b = [0.7 * rng.gauss(1.0, 0.05) for _ in range(40)]
    interval = bootstrap_ratio(a, b)
    assert interval.low < 0.7 < interval.high and interval.high < 0.75 and interval.significant_ratio
    assert re.fullmatch(r"0\.\d\dx \(0\.\d\d-0\.\d\d\)", verdict(interval))


def test_two_samples_of_one_distribution_are_no_significant_difference():
    rng = random.Random(2)
    a = [rng.gauss(1.0, 0.1) for _ in range(40)]
    b = [rng.gauss(1.0, 0.1) for _ in range(40)]
    assert verdict(bootstrap_ratio(a, b)).startswith("n.s. ")
    assert verdict(bootstrap_difference(a, b), ratio=False).startswith("n.s. ")
    shifted = bootstrap_difference(a, [x + 0.5 for x in b])
    assert shifted.significant_difference and 0.4 < shifted.value < 0.6


# ------------------------------------------------------------------------------------------------- written logs


def write_run(folder, steps, *, score, step_time, config=None, extra=None, resumed_from=None):
    """A trainer log folder: metrics.jsonl (a resumed run writes its steps from ``resumed_from`` again, as a crash
    before the log was cut back would leave them), and config.yaml when given."""
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "timing_s/step": step_time(step), "timing_s/gen": step_time(step) / 2}
        record["critic/score/mean"] = score(step)
        record.update((extra or {}).get(step, {}))
        lines.append(record)
    if resumed_from is not None:
        lines += [dict(r) for r in lines if r["step"] >= resumed_from]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def base_config(**actor):
    return {
        "actor_rollout_ref": {"actor": {"kl_loss_coef": 0.1, "ppo_epochs": 1, **actor}},
        "trainer": {"experiment_name": "x", "log_dir": "/somewhere"},
    }


def test_runs_of_different_lengths_a_resumed_run_and_missing_metrics(tmp_path, capsys):
    rng = random.Random(3)
    a = write_run(
        tmp_path / "a",
        30,
        score=lambda s: min(1.0, s / 20),
        step_time=lambda s: 1.0 + rng.random() * 0.05,
        config=base_config(),
        extra={s: {"actor/entropy": 1.0} for s in range(1, 31)},
    )
    b = write_run(
        tmp_path / "b",
        50,
        score=lambda s: min(1.0, s / 40),
        step_time=lambda s: 0.5 + rng.random() * 0.025,
        config=base_config(kl_loss_coef=0.01) | {"trainer": {"experiment_name": "y", "log_dir": "/elsewhere"}},
        resumed_from=41,
    )
    result = compare([find_run([a]), find_run([b])], targets={"critic/score/mean": 0.5}, smooth_window=1)
    assert result.step_counts == [30, 50]  # the resumed run's repeated steps 41-50 count once
    assert [(d.key, d.values) for d in result.config_diff] == [("actor_rollout_ref.actor.kl_loss_coef", [0.1, 0.01])]
    assert [d.key for d in result.identity_diff] == ["trainer.experiment_name", "trainer.log_dir"]
    (score,) = [c for c in result.curves if c.metric == "critic/score/mean"]
    assert score.steps == list(range(1, 51)) and score.points[0][30:] == [None] * 20
    assert score.reached == [10, 20] and score.final == [pytest.approx(1.0), pytest.approx(1.0)]
    (step,) = [v for v in result.speed if v.metric == "timing_s/step"]
    assert step.versus_first[1] is not None and 0.45 < step.versus_first[1].low < step.versus_first[1].high < 0.55
    assert f"actor/entropy: not logged by {b}" in result.missing

    assert main(["compare", str(a), str(b), "--target", "critic/score/mean=0.5", "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert "| actor_rollout_ref.actor.kl_loss_coef | 0.1 | 0.01 |" in text
    assert "also differ (names and folders): trainer.experiment_name, trainer.log_dir" in text
    assert re.search(r"\| timing_s/step \| [\d.]+ \| [\d.]+ \| 0\.\d\dx \(0\.\d\d-0\.\d\d\) \|", text)
    assert "missing: actor/entropy: not logged by" in text


def test_the_json_follows_its_schema(tmp_path, capsys):
    runs = [
        write_run(
            tmp_path / name, 12, score=lambda s: s / 12, step_time=lambda s: 1.0 + s % 3 / 10, config=base_config()
        )
        for name in ("a", "b", "c")
    ]
    assert main(["compare", *map(str, runs), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, schema("compare"))
    assert data["schema"] == "rlprof-compare/2" and data["config_diff"] == [] and len(data["runs"]) == 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(data, runs=["only one"]), schema("compare"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "{a}"], "give at least two runs to compare"),
        (["compare", "{a}", "{missing}"], "missing"),
        (["compare", "{a}", "{empty}"], "nothing to read in"),
        (["compare", "{a}", "{a}", "--target", "critic/score/mean"], "expected METRIC=NUMBER"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    a = write_run(tmp_path / "a", 5, score=lambda s: 0.0, step_time=lambda s: 1.0)
    (tmp_path / "empty").mkdir()
    paths = {"a": a, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    assert main([arg.format(**paths) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlprof compare: ") and message in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------- trainer runs

KNOB_RUNS = {
    "baseline": (),
    "packed": ("actor_rollout_ref.model.use_remove_padding=true",),
    "strong_kl": ("actor_rollout_ref.actor.kl_loss_coef=1.0",),
}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Three 40-step GRPO runs of the bundled trainer: the defaults, packed sequences, a 10x KL coefficient. They run
    at once, a thread each, on the machine's cores (what each learns is seeded, not timed; the speed test checks each
    ratio against its own interval, not a value)."""
    root = tmp_path_factory.mktemp("knobs")
    env = subprocess_env(OMP_NUM_THREADS="1")
    launched = {}
    try:
        for name, overrides in KNOB_RUNS.items():
            command = trainer_command(
                root / name,
                "trainer.total_training_steps=40",
                "trainer.test_freq=-1",
                "trainer.val_before_train=false",
                *overrides,
            )
            stderr = (root / f"{name}.err").open("w")
            launched[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, cwd=ROOT)
            stderr.close()
        for name, process in launched.items():
            assert process.wait(timeout=900) == 0, (name, (root / f"{name}.err").read_text()[-3000:])
    finally:
        for process in launched.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return root


@pytest.mark.slow
def test_one_knob_is_the_whole_config_diff_learning_is_unchanged_and_speed_has_intervals(trainer_runs, capsys):
    a, b = trainer_runs / "baseline", trainer_runs / "packed"
    assert main(["compare", str(a), str(b), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, schema("compare"))
    assert data["config_diff"] == [{"key": "actor_rollout_ref.model.use_remove_padding", "values": [False, True]}]
    for curve in data["curves"]:  # packing changes how tokens are laid out, not what is learned
        low, high = curve["versus_first"][1]["low"], curve["versus_first"][1]["high"]
        assert low <= 0 <= high, (curve["metric"], curve["versus_first"][1])
    phases = {v["metric"]: v for v in data["speed"]}
    for phase in ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor"):
        ratio = phases[phase]["versus_first"][1]
        medians = phases[phase]["medians"]
        assert (
            ratio["value"] == pytest.approx(medians[1] / medians[0]) and ratio["low"] <= ratio["value"] <= ratio["high"]
        )

    assert main(["compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "actor_rollout_ref.model.use_remove_padding" in text and "Speed (median over steps" in text
    for line in text.splitlines():
        if line.startswith("│ timing_s/update_actor"):
            assert re.search(r"\d\.\d\dx", line), line  # the ratio and its interval are printed
            break
    else:
        raise AssertionError(f"no update_actor row in:\n{text}")


@pytest.mark.slow
def test_a_stronger_kl_penalty_shows_as_a_learning_difference(trainer_runs, capsys):
    a, c = trainer_runs / "baseline", trainer_runs / "strong_kl"
    assert main(["compare", str(a), str(c), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["key"] for d in data["config_diff"]] == ["actor_rollout_ref.actor.kl_loss_coef"]
    curves = {curve["metric"]: curve for curve in data["curves"]}
    kl = curves["actor/kl_loss"]["versus_first"][1]
    assert kl["high"] < 0, kl  # 10x the penalty keeps the policy closer to the reference
    assert curves["actor/kl_loss"]["final"][1] < 0.5 * curves["actor/kl_loss"]["final"][0]


@pytest.mark.slow
def test_the_html_overlays_the_runs_curves_offline(trainer_runs, tmp_path):
    page = tmp_path / "compare.html"
    runs = [str(trainer_runs / name) for name in KNOB_RUNS]
    assert main(["compare", *runs, "--html", str(page), "--format", "md"]) == 0
    assert external_references(page.read_text()) == []
    png = screenshot(page, tmp_path / "compare.png", height=5000)
    for colour in (PLOTLY_BLUE, PLOTLY_RED, PLOTLY_GREEN):  # A, B and C: curves and the bars of median phase times
        assert plotly_pixels(png, colour) > 2000, f"run {colour} was not drawn"


def test_each_runs_processes_are_named_unequal_totals_are_a_note_and_a_pipeline_has_its_table(tmp_path, capsys):
    """A synchronous run recorded before run.json named its processes (its world size: all training) against a
    one-step-off run (one trainer, one rollout process): each run's layout, a note that they ran on 1 and 2
    processes, and the asynchronous run's pipeline metrics in a table of their own (none for the synchronous run)."""
    sync = write_run(tmp_path / "sync", 12, score=lambda s: 0.1, step_time=lambda s: 1.0 + s % 3 / 10)
    (sync / "run.json").write_text(json.dumps({"world_size": 1}))
    pipeline = {"fully_async/trainer/idle_ratio": 0.1, "training/off_policy/trajectory_staleness/mean": 1.0}
    pooled = write_run(
        tmp_path / "async",
        12,
        score=lambda s: 0.1,
        step_time=lambda s: 0.8 + s % 3 / 10,
        extra={s: pipeline for s in range(1, 13)},
    )
    (pooled / "run.json").write_text(
        json.dumps({"world_size": 1, "processes": {"trainer": 1, "rollout": 1, "per_node": 2}})
    )
    assert main(["compare", str(sync), str(pooled), "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert f"A: {sync} (12 steps; synchronous: 1 process)" in text
    assert f"B: {pooled} (12 steps; asynchronous: 1 trainer + 1 rollout process)" in text
    assert (
        f"note: the runs ran on different numbers of processes ({sync}: 1, {pooled}: 2): their speed compares "
        "unequal resources"
    ) in text
    assert "| fully_async/trainer/idle_ratio | - | 0.1 | - |" in text
    assert main(["compare", str(sync), str(pooled), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, schema("compare"))
    assert data["processes"] == [{"trainer": 1, "rollout": 0}, {"trainer": 1, "rollout": 1, "per_node": 2}]
    assert [row["metric"] for row in data["pipeline"]] == list(pipeline)
    assert [row["medians"] for row in data["pipeline"]] == [[None, 0.1], [None, 1.0]]
