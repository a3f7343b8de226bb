"""The prometheus backend: each step's scalars served over HTTP in Prometheus' text format (read back with
prometheus_client's own parser), the file_sd targets file, a port in use, and a real Prometheus server (Debian's)
scraping both ranks of a two-rank torchrun training run through the run's targets files."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rlprof
from rlprof.cli import main
from rlprof.tracking import Tracker
from rlprof.tracking.jsonl import read_jsonl
from tests.conftest import ROOT, PrometheusServer, free_port, subprocess_env, torchrun, trainer_command
from tests.rlprof_train.test_watchdog import CALLS_PER_STEP, SMALL_RUN


def scrape(port: int) -> dict[str, list]:
    """Every sample of ``http://127.0.0.1:{port}/metrics`` by metric family name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it on."""
    for _ in range(100):
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no run of free ports")


def test_each_steps_scalars_are_gauges_of_the_last_value_with_the_runs_labels(tmp_path):
    port = free_ports(1)
    tracker = Tracker(
        "proj",
        "exp",
        ["prometheus", "file"],
        log_dir=tmp_path,
        rank=0,
        local_rank=0,
        options={"prometheus": {"port": port}},
    )
    for step, seconds in ((1, 0.3), (2, 1.7), (3, 4.0)):
        tracker.log(
            {"actor/pg_loss": -step / 10, "timing_s/step": seconds, "val-core/gsm8k/reward/mean@4": math.nan}, step
        )
    families = scrape(port)
    labels = {"project": "proj", "experiment": "exp", "rank": "0", "role": "trainer"}
    (loss,) = families["rlprof_actor_pg_loss"]
    assert loss.labels == labels and loss.value == pytest.approx(-0.3)
    (validation,) = families["rlprof_val_core_gsm8k_reward_mean_4"]
    assert math.isnan(validation.value)
    (nonfinite,) = families["rlprof_nonfinite"]  # one series per key whose last value is NaN or infinite
    assert nonfinite.labels == {**labels, "key": "val-core/gsm8k/reward/mean@4"} and nonfinite.value == 1
    assert [s.value for s in families["rlprof_step"]] == [3.0]
    assert abs(families["rlprof_step_logged_timestamp_seconds"][0].value - time.time()) < 60
    histogram = {(s.name, s.labels.get("le")): s.value for s in families["rlprof_step_seconds"]}
    assert histogram[("rlprof_step_seconds_count", None)] == 3
    assert histogram[("rlprof_step_seconds_sum", None)] == pytest.approx(6.0)
    assert (
        histogram[("rlprof_step_seconds_bucket", "0.5")] == 1 and histogram[("rlprof_step_seconds_bucket", "2.5")] == 2
    )
    assert "process_resident_memory_bytes" in families
    targets = json.loads((tmp_path / "prometheus_targets" / "rank0.json").read_text())
    assert targets == [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {
                "rlprof_project": "proj",
                "rlprof_experiment": "exp",
                "rlprof_rank": "0",
                "rlprof_role": "trainer",
            },
        }
    ]
    tracker.close()
    assert not (tmp_path / "prometheus_targets" / "rank0.json").exists()
    with Tracker("proj", "exp", ["prometheus"], log_dir=tmp_path, options={"prometheus": {"port": port}}) as again:
        assert again.names == ["prometheus"] and len(again.backends) == 1  # the port was released
    assert [r["actor/pg_loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [-0.1, -0.2, -0.3]


def test_verls_rl_insight_spelling_serves_rl_insights_names_on_the_local_ranks_port(tmp_path):
    base = free_ports(3)
    with Tracker(
        "proj", "exp", ["rl_insight"], log_dir=tmp_path, rank=5, local_rank=2, options={"prometheus": {"port": base}}
    ) as tracker:
        tracker.log({"critic/vf_loss": 0.25, "response_length/mean": 12.0}, 1)
        families = scrape(base + 2)
    assert families["rl_insight_monitor_critic_vf_loss"][0].value == 0.25
    assert families["rl_insight_monitor_response_length_mean"][0].labels["rank"] == "5"
    assert not any(name.startswith("rlprof_") for name in families)


def test_two_keys_of_one_name_and_rlprofs_own_series_are_one_warning_each(tmp_path):
    port = free_ports(1)
    with Tracker("p", "e", ["prometheus"], log_dir=tmp_path, options={"prometheus": {"port": port}}) as tracker:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2):
                tracker.log({"a-b": 1.0, "a/b": 2.0, "step": 7.0}, step)
        families = scrape(port)
    messages = sorted(str(w.message) for w in caught)
    assert messages == [
        "prometheus: the metric 'a/b' makes the name rlprof_a_b, taken by the metric 'a-b'; 'a/b' is left out",
        "prometheus: the metric 'step' makes the name rlprof_step, taken by rlprof's own series; 'step' is left out",
    ]
    assert families["rlprof_a_b"][0].value == 1.0 and families["rlprof_step"][0].value == 2.0


def test_a_port_in_use_is_one_warning_naming_the_port_and_the_setting_and_the_run_goes_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Tracker(
                "p", "e", ["prometheus", "file"], log_dir=tmp_path, options={"prometheus": {"port": port}}
            ) as tracker:
                tracker.log({"x": 1.0}, 1)
    (warning,) = [str(w.message) for w in caught]
    assert f"port {port} on 127.0.0.1 is not free" in warning and "trainer.prometheus.port" in warning
    assert "turned off, the other backends go on" in warning
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0]
    assert not (tmp_path / "prometheus_targets" / "rank0.json").exists()


def test_a_prometheus_backend_that_fails_is_closed_its_port_and_targets_file_released(tmp_path):
    port = free_ports(1)
    with Tracker("p", "e", ["prometheus", "file"], log_dir=tmp_path, options={"prometheus": {"port": port}}) as tracker:
        backend = tracker.backends[0]

        def broken(metrics, step):
            raise RuntimeError("the collector broke")

        backend.log = broken  # type: ignore[method-assign]
        with pytest.warns(RuntimeWarning, match="prometheus backend failed while logging"):
            tracker.log({"x": 1.0}, 1)
        assert not (tmp_path / "prometheus_targets" / "rank0.json").exists()
        with Tracker("p", "e", ["prometheus"], log_dir=tmp_path / "b", options={"prometheus": {"port": port}}) as b:
            assert len(b.backends) == 1  # the port is free again
        tracker.log({"x": 2.0}, 2)
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0]


def test_the_watchdogs_phase_is_read_at_each_scrape_with_its_limit_once_known(tmp_path):
    port = free_ports(1)
    with (
        Tracker("p", "e", ["prometheus"], log_dir=tmp_path, options={"prometheus": {"port": port}}) as tracker,
        rlprof.watchdog(tmp_path, min_s=5, factor=10) as dog,
    ):
        tracker.add_live(dog.live_samples)
        assert "rlprof_watchdog_phase_seconds" not in scrape(port)  # between steps: no phase
        for step in (1, 2, 3):
            with dog.phase(step, "gen"):
                time.sleep(0.05)
                families = scrape(port)
                (seconds,) = families["rlprof_watchdog_phase_seconds"]
                assert seconds.labels["phase"] == "gen" and seconds.labels["step"] == str(step)
                assert 0.05 <= seconds.value < 60
                limits = families.get("rlprof_watchdog_phase_limit_seconds", [])
                assert [s.value for s in limits] == ([] if step == 1 else [5.0])  # the median of earlier steps, min_s
        assert "rlprof_watchdog_phase_seconds" not in scrape(port)


def slow_rewards_and_rank_1_hanging(folder: Path) -> Path:
    """A reward function taking about a second a step on every rank (so that the server scrapes several steps) whose
    first call of step 3 hangs 20 s on rank 1."""
    reward = folder / "slow_reward.py"
    reward.write_text(
        "import os, time\n"
        "CALLS = [0]\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    CALLS[0] += 1\n"
        f"    if CALLS[0] % {CALLS_PER_STEP} == 1:\n"
        "        time.sleep(1.0)\n"
        f"    if os.environ['RANK'] == '1' and CALLS[0] == {2 * CALLS_PER_STEP + 1}:\n"
        "        time.sleep(20)\n"
        "    return 0.0\n"
    )
    return reward


def firing(server: PrometheusServer) -> list[dict]:
    with urllib.request.urlopen(f"{server.url}/api/v1/alerts", timeout=30) as answer:
        return [a for a in json.load(answer)["data"]["alerts"] if a["state"] == "firing"]


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_server_scrapes_both_ranks_through_the_targets_files_and_fires_the_stall_alert(tmp_path, capsys):
    """A real Prometheus server given only the run's targets files and rlprof's rules, during a two-rank run whose
    rank 1 hangs 20 s in its reward at step 3 (as the watchdog's tests make one): both ranks up, RLProfRankStalled
    firing for rank 1 in reward of step 3; after the run, every rank's phase times at every scraped step equal to
    metrics.jsonl's, and every value it scraped from rank 0 one the run logged."""
    assert main(["prometheus", "rules"]) == 0
    rules = tmp_path / "rlprof.yml"
    rules.write_text(capsys.readouterr().out)
    logs = tmp_path / "logs"
    command = trainer_command(
        tmp_path,
        *SMALL_RUN,
        "trainer.watchdog.min_s=3",
        f"custom_reward_function.path={slow_rewards_and_rank_1_hanging(tmp_path)}",
        "trainer.total_training_steps=8",
        'trainer.logger=["file","prometheus"]',
        f"trainer.prometheus.port={free_ports(2)}",
        prefix=(*torchrun(2), "-m"),
    )
    targets = str(logs / "prometheus_targets" / "*.json")
    with PrometheusServer(tmp_path / "prometheus", targets, rule_files=(str(rules),)) as server:
        start = time.time()
        run = subprocess.Popen(
            command, cwd=ROOT, env=subprocess_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            up = server.wait_for('count(up{job="rlprof"} == 1) == 2', timeout_s=300)  # found through the files alone
            assert up[0]["value"][1] == "2"
            deadline, stalled = time.monotonic() + 600, []
            while not stalled and run.poll() is None and time.monotonic() < deadline:
                alerts = [a for a in firing(server) if a["labels"]["alertname"] == "RLProfRankStalled"]
                stalled = [a for a in alerts if a["labels"]["rank"] == "1"]  # rank 0 may fire first, waiting for it
                time.sleep(0.5)
            output, _ = run.communicate(timeout=600)
        finally:
            run.kill()
        assert run.returncode == 0, output.decode()[-4000:]
        end = time.time()
        assert stalled, "the stall alert did not fire for rank 1"
        (alert,) = stalled
        assert (alert["labels"]["phase"], alert["labels"]["step"]) == ("reward", "3")
        assert alert["annotations"]["summary"].startswith("rank 1 of ppo-demo has been in reward of step 3 for ")
        rows = read_jsonl(logs / "metrics.jsonl")
        assert not list((logs / "prometheus_targets").glob("*.json"))  # both ranks removed theirs at the end

        ranks = {r["metric"]["rank"]: r for r in server.query("last_over_time(rlprof_timing_s_step[10m])")}
        assert sorted(ranks) == ["0", "1"]
        for series in ranks.values():
            metric = series["metric"]
            assert metric["project"] == "rlprof" and metric["role"] == "trainer" and metric["job"] == "rlprof"
            assert metric["rlprof_rank"] == metric["rank"]  # the target's label, beside the series' own
        # Every value the server scraped from rank 0 is one the run logged (the JSONL backend's record).
        logged = {r["actor/pg_loss"] for r in rows if "actor/pg_loss" in r}
        (loss,) = server.query_range('rlprof_actor_pg_loss{rank="0"}', start, end)
        assert loss["values"] and {float(v) for _, v in loss["values"]} <= logged
        # Every rank's phase times at every scraped step equal metrics.jsonl's: rank 0's are its timing_s/*; with two
        # ranks, rank 1's is the other end of the spread (timing_ranks/{phase}/min + max - rank 0's).
        by_step = {r["step"]: r for r in rows if r["step"] > 0}
        phases = sorted({k.removeprefix("timing_s/") for r in by_step.values() for k in r if k.startswith("timing_s/")})
        compared, scraped = 0, {}
        for rank in ("0", "1"):
            (steps,) = server.query_range(f'rlprof_step{{rank="{rank}"}}', start, end)
            step_at = {t: int(float(v)) for t, v in steps["values"]}
            for phase in phases:
                for series in server.query_range(f'rlprof_timing_s_{phase}{{rank="{rank}"}}', start, end):
                    for t, value in series["values"]:
                        row = by_step.get(step_at.get(t, 0))
                        if row is None or f"timing_s/{phase}" not in row:
                            continue
                        expected = row[f"timing_s/{phase}"]
                        if rank == "1":
                            spread = (row[f"timing_ranks/{phase}/min"], row[f"timing_ranks/{phase}/max"])
                            expected = sum(spread) - expected
                        assert float(value) == pytest.approx(expected, rel=1e-9, abs=1e-12), (rank, phase, row["step"])
                        compared += 1
            scraped[rank] = {step for step in step_at.values() if step in by_step}
        assert all(len(steps) >= 2 for steps in scraped.values()) and compared >= 4 * len(phases), (scraped, compared)
        count = server.query('max_over_time(rlprof_step_seconds_count{rank="0"}[10m])')
        assert 2 <= float(count[0]["value"][1]) <= 8
