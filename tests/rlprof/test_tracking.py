"""Trackers: every backend's records read back with that backend's own reader, the seed's console format,
resume without duplicated steps, and a failing backend that does not stop the others."""

from __future__ import annotations

import io
import sys
import time
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from rlprof.tracking import Tracker, parse_backends
from rlprof.tracking.base import mlflow_safe_key
from rlprof.tracking.jsonl import read_jsonl


@pytest.fixture(scope="module", autouse=True)
def _wandb_service_stopped():
    """The wandb service that this module's trackers start (``wandb-core``, one per process, shared by its tests) is
    stopped with the module, not left to the interpreter's exit."""
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def metrics_for(step: int, run: int = 1) -> dict[str, float]:
    return {
        "actor/pg_loss": 1.0 / step + run,
        "critic/rewards/mean": 0.1 * step,
        "actor/kl_loss": 0.01 * step,
        "perf/mfu/actor": 0.4,
        "odd:key@v1": float(step),
    }


def same_series(actual, expected) -> bool:
    """(step, value) pairs: the same steps, in order, and values equal to float precision."""
    return [s for s, _ in actual] == [s for s, _ in expected] and [v for _, v in actual] == pytest.approx(
        [v for _, v in expected]
    )


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def wandb_history(log_dir: Path) -> list[dict]:
    import json

    from wandb_offline import read_run_history

    run_id = json.loads((log_dir / "wandb_run.json").read_text())["run_id"]
    return read_run_history(log_dir / "wandb", run_id)


def mlflow_history(log_dir: Path, key: str) -> list[tuple[int, float]]:
    import json

    from mlflow.tracking import MlflowClient

    from rlprof.tracking.mlflow import tracking_uri

    run_id = json.loads((log_dir / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=tracking_uri(log_dir))
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.slow  # over 7 s: kept out of the quick loop
def test_each_backend_holds_the_logged_values(dirs):
    log_dir = dirs / "run"
    with Tracker(
        "proj",
        "exp",
        ["tensorboard", "file", "wandb", "mlflow"],
        log_dir=log_dir,
        config={"actor": {"lr": 1e-6}, "trainer": {"total_epochs": 2}},
    ) as tracker:
        for step in (1, 2, 3):
            tracker.log(metrics_for(step), step)
    expected = [(s, 1.0 / s + 1) for s in (1, 2, 3)]
    tb = tensorboard_scalars(dirs / "tb", "actor/pg_loss")
    assert [s for s, _ in tb] == [1, 2, 3] and [v for _, v in tb] == pytest.approx([v for _, v in expected])
    assert [(r["step"], r["actor/pg_loss"]) for r in read_jsonl(log_dir / "metrics.jsonl")] == expected
    wb = wandb_history(log_dir)
    assert same_series([(r["_step"], r["actor/pg_loss"]) for r in wb], expected)
    assert wb[0]["odd:key@v1"] == 1.0
    assert same_series(mlflow_history(log_dir, "actor/pg_loss"), expected)
    assert mlflow_history(log_dir, mlflow_safe_key("odd:key@v1")) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert mlflow_safe_key("odd:key@v1") == "odd_key_v1"


def test_tensorboard_default_dir_is_tensorboard_log_project_experiment(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with Tracker("proj", "exp", ["tensorboard"]) as tracker:
        tracker.log({"a": 1.0}, 1)
    assert tensorboard_scalars(tmp_path / "tensorboard_log" / "proj" / "exp", "a") == [(1, 1.0)]


def test_console_prints_the_seed_lines_the_table_and_progress():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False, color_system=None)
    with Tracker("p", "e", ["console"], console=console, total_steps=4, total_epochs=2, table_every=2) as tracker:
        for step in (1, 2, 3, 4):
            tracker.log(
                {
                    **metrics_for(step),
                    "training/epoch": 1 + (step - 1) // 2,
                    "perf/rollout_samples_per_s": 1250.0,
                    "perf/throughput": 800.0,
                    "perf/cpu_memory_used_gb": 12.4,
                    "perf/cpu_memory_total_gb": 16.0,
                    "timing_share/rollout": 0.38,
                    "timing_share/training": 0.52,
                    "timing_share/other": 0.06,
                    "timing_share/unaccounted": 0.04,
                },
                step,
            )
    text = out.getvalue()
    assert "[INFO] Step time: rollout 38% | training 52% | other 6% | unaccounted 4%" in text
    assert "[INFO] Epoch 1/2 - Step 1 - Loss: 2.000, Reward: 0.100, KL: 0.010" in text
    assert "[INFO] Epoch 2/2 - Step 4 - Loss: 1.250, Reward: 0.400, KL: 0.040" in text
    assert "[DEBUG] Rollout throughput: 1250 samples/sec" in text
    assert "[DEBUG] Memory usage: 12.4GB/16.0GB (77.5%) host" in text
    assert text.count("metrics at step") == 2 and "perf/mfu/actor" in text  # the periodic table, steps 2 and 4
    assert "4/4" in text and "ETA" in text  # the progress bar


@pytest.mark.parametrize(
    "value",
    [
        '["console","wandb"]',
        "['console', 'wandb']",
        "console,wandb",
        ["console", "wandb"],
        OmegaConf.create({"l": ["console", "wandb"]}).l,
    ],
)
def test_logger_setting_forms(value):
    assert parse_backends(value) == ["console", "wandb"]


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match="unknown backend 'neptune'; registered backends: console, file, mlflow, prometheus, rl_insight, "
        "tensorboard, wandb",
    ):
        parse_backends('["console","neptune"]')


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_resume_ends_with_one_record_per_step_in_every_backend(dirs):
    log_dir = dirs / "run"
    backends = ["tensorboard", "file", "wandb", "mlflow"]
    with Tracker("proj", "exp", backends, log_dir=log_dir) as tracker:
        for step in range(1, 6):
            tracker.log(metrics_for(step, run=1), step)
    time.sleep(1.1)  # wandb names an offline session's folder by the second: a resume in the same second shares it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("proj", "exp", backends, log_dir=log_dir, resume_step=4) as tracker:
            for step in range(4, 8):
                tracker.log(metrics_for(step, run=2), step)
    steps = list(range(1, 8))
    # TensorBoard (purge_step) and JSONL (rewritten) hold the resumed run's values for 4 and 5
    new = [(s, 1.0 / s + (1 if s < 4 else 2)) for s in steps]
    assert same_series(tensorboard_scalars(dirs / "tb", "actor/pg_loss"), new)
    assert same_series([(r["step"], r["actor/pg_loss"]) for r in read_jsonl(log_dir / "metrics.jsonl")], new)
    # wandb and mlflow cannot drop records: steps 4 and 5 keep the first values, once each, with a warning
    kept = [(s, 1.0 / s + (1 if s <= 5 else 2)) for s in steps]
    assert same_series([(r["_step"], r["actor/pg_loss"]) for r in wandb_history(log_dir)], kept)
    assert same_series(mlflow_history(log_dir, "actor/pg_loss"), kept)
    skipped = [str(w.message) for w in caught if "cannot drop" in str(w.message)]
    assert len(skipped) == 2 and any(m.startswith("wandb keeps steps <= 5") for m in skipped)


class BrokenDisk:
    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


def test_a_failing_backend_warns_once_and_the_others_go_on(dirs):
    log_dir = dirs / "run"
    tracker = Tracker("proj", "exp", ["file", "tensorboard"], log_dir=log_dir)
    tracker.log({"a": 1.0}, 1)
    file_backend = tracker.backends[0]
    file_backend._handle.close()
    file_backend._handle = BrokenDisk()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (2, 3, 4):
            tracker.log({"a": float(step)}, step)
        tracker.close()
    failures = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(failures) == 1 and "file backend failed while logging" in failures[0] and "No space left" in failures[0]
    assert tensorboard_scalars(dirs / "tb", "a") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert [r["step"] for r in read_jsonl(log_dir / "metrics.jsonl")] == [1]


def test_steps_must_increase_and_values_be_numbers(dirs):
    with Tracker("p", "e", ["file"], log_dir=dirs / "r") as tracker:
        tracker.log({"a": 1}, 3)
        with pytest.raises(ValueError, match="step=3 is not after the last logged step 3"):
            tracker.log({"a": 1}, 3)
        with pytest.raises(TypeError, match="metric 'a': 'high' is not a number"):
            tracker.log({"a": "high"}, 4)


def test_a_new_run_never_mixes_with_the_records_an_earlier_run_left(dirs):
    log_dir = dirs / "run"
    with Tracker("proj", "exp", ["file", "tensorboard"], log_dir=log_dir) as tracker:
        for step in (1, 2):
            tracker.log({"a": 1.0}, step)
    with pytest.warns(RuntimeWarning, match="held the records of an earlier run"):
        with Tracker("proj", "exp", ["file", "tensorboard"], log_dir=log_dir) as tracker:
            for step in (1, 2, 3, 4):
                tracker.log({"a": 2.0}, step)
    assert [(r["step"], r["a"]) for r in read_jsonl(log_dir / "metrics.jsonl")] == [(s, 2.0) for s in (1, 2, 3, 4)]
    (archived,) = (log_dir / "previous").iterdir()
    assert [(r["step"], r["a"]) for r in read_jsonl(archived)] == [(1, 1.0), (2, 1.0)]
    assert tensorboard_scalars(dirs / "tb", "a") == [(s, 2.0) for s in (1, 2, 3, 4)]
    (previous,) = [p for p in (dirs / "tb").iterdir() if p.name.startswith("previous-")]
    assert tensorboard_scalars(previous, "a") == [(1, 1.0), (2, 1.0)]


def test_a_cut_short_last_line_is_dropped_and_appends_start_on_a_new_line(dirs):
    log_dir = dirs / "run"
    log_dir.mkdir()
    (log_dir / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    with pytest.warns(RuntimeWarning, match="was cut short"):
        with Tracker("proj", "exp", ["file"], log_dir=log_dir, resume_step=3) as tracker:
            tracker.log({"a": 3.5}, 3)
    assert [(r["step"], r["a"]) for r in read_jsonl(log_dir / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 3.5)]
    (log_dir / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}')  # complete, but no newline
    with Tracker("proj", "exp", ["file"], log_dir=log_dir, resume_step=2) as tracker:
        tracker.log({"a": 2.5}, 2)
    assert (log_dir / "metrics.jsonl").read_text().count("\n") == 2
    # a record longer than the 1 MiB looked at first (a large reward_extra dict), cut short: dropped whole
    long = '{"step": 2, "text": "' + "x" * (3 << 20)
    (log_dir / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n' + long)
    with pytest.warns(RuntimeWarning, match=f"was cut short \\({len(long)} bytes"):
        with Tracker("proj", "exp", ["file"], log_dir=log_dir, resume_step=2) as tracker:
            tracker.log({"a": 2.5}, 2)
    assert [(r["step"], r.get("a")) for r in read_jsonl(log_dir / "metrics.jsonl")] == [(1, 1.0), (2, 2.5)]
    assert (log_dir / "metrics.jsonl").stat().st_size < 100  # nothing of the long line is left


@pytest.mark.slow  # 4-9 s: kept out of the quick loop
def test_a_backend_that_cannot_reach_its_server_is_turned_off_within_the_timeout(dirs, monkeypatch):
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="the mlflow backend could not start"):
        tracker = Tracker("proj", "exp", ["file", "mlflow"], log_dir=dirs / "run", start_timeout_s=5)
    assert time.monotonic() - start < 20
    assert [b.name for b in tracker.backends] == ["file"]
    tracker.log({"a": 1.0}, 1)
    tracker.close()
    assert [r["step"] for r in read_jsonl(dirs / "run" / "metrics.jsonl")] == [1]


def test_a_backend_that_fails_to_start_is_turned_off(dirs):
    from rlprof.tracking import Backend, register_backend

    @register_backend("needs_a_token")
    class NeedsAToken(Backend):
        def __init__(self, context):
            raise PermissionError("no API token in $TRACKER_TOKEN")

        def log(self, metrics, step):
            raise AssertionError("never started")

    with pytest.warns(RuntimeWarning, match="needs_a_token backend could not start .PermissionError: no API token"):
        tracker = Tracker("proj", "exp", ["file", "needs_a_token"], log_dir=dirs / "run")
    assert [b.name for b in tracker.backends] == ["file"]
    tracker.close()


def test_wandbs_own_wandb_dir_is_honoured(dirs, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(dirs / "elsewhere"))
    log_dir = dirs / "run"
    with Tracker("proj", "exp", ["wandb"], log_dir=log_dir) as tracker:
        tracker.log({"a": 1.0}, 1)
    import json
    import time

    from wandb_offline import read_run_history

    run_id = json.loads((log_dir / "wandb_run.json").read_text())["run_id"]
    deadline = time.monotonic() + 30  # a wandb service shared with earlier tests writes the file after finish()
    while not (history := read_run_history(dirs / "elsewhere" / "wandb", run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [row["a"] for row in history] == [1.0]
    assert not (log_dir / "wandb").exists()


@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_a_tensorboard_folder_that_cannot_be_written_is_one_warning_not_a_thread_traceback(tmp_path, small_disk, disk):
    """Issue 27: a read-only TensorBoard folder printed TensorBoard's 40-line writer-thread traceback (and a disk
    that fills mid-run did too). Now: one warning naming the error and the folder; the other backends go on. In a
    child process, as a user's run, on a real read-only / full tmpfs."""
    import subprocess
    import sys

    from conftest import subprocess_env

    board = small_disk("8k", read_only=disk == "read-only")
    program = (
        "from rlprof.tracking import Tracker\n"
        f"tracker = Tracker('p', 'e', ['tensorboard', 'file'], log_dir={str(tmp_path / 'logs')!r})\n"
        "for step in range(300):\n"
        "    tracker.log({f'metric{i}': 1.0 for i in range(20)}, step)\n"
        "print('backends left:', [b.name for b in tracker.backends])\n"
        "tracker.close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(TENSORBOARD_DIR=str(board)),
    )
    print(result.stderr)
    assert result.returncode == 0 and "backends left: ['file']" in result.stdout
    assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr
    (warning,) = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
    cause = (
        "Read-only file system" if disk == "read-only" else f"No space left on device writing the event file in {board}"
    )
    assert "the tensorboard backend" in warning and cause in warning and str(board) in warning
    assert len(read_jsonl(tmp_path / "logs" / "metrics.jsonl")) == 300
