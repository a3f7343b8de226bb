"""The GPU's idle share as a live value (rlprof.live_gpu_idle): every trace the session's torch tool writes reaches
the gauge; a trace recorded on a GPU by others (HTA's test data: the hardware boundary, as this machine has no GPU)
gives HTA's idle share and the report's; a CPU trace measures no GPU; a damaged one is counted; a real Prometheus
server scrapes the share and fires RLProfGpuStarved, and answers the dashboard's GPU panel."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

import rlprof
from rlprof.analysis.diagnose import RULES
from rlprof.cli import main
from rlprof.cli.prometheus import DASHBOARD, shipped
from rlprof.live_gpu_idle import WindowGpuIdle
from rlprof.manifest import read_manifest
from rlprof.tracking import Tracker
from rlprof.window import StepWindow, WindowListener
from tests.conftest import PrometheusServer
from tests.rlprof.test_gpu_report import TRACES, findings
from tests.rlprof.test_prometheus import free_ports, scrape
from tests.rlprof.test_session import run_steps, torch_config

NCCL = TRACES / "hta_nccl_data.json.gz"
"""Rank 0 of an NCCL run, recorded on a GPU (HTA's test data): HTA's idle_time_pctg is 76.2."""


def idle_samples(gauge: WindowGpuIdle) -> dict[str, float]:
    return {sample.key: sample.value for sample in gauge.live_samples()}


def test_a_published_gpu_trace_gives_htas_idle_share_the_reports_and_the_windows_last_step(tmp_path):
    gauge = WindowGpuIdle()
    assert gauge.live_samples() == []  # nothing measured yet: no sample, not a zero
    gauge.output_written(NCCL, "chrome_trace", StepWindow(1, 3, 4), None)
    assert gauge.wait(120)
    measured = idle_samples(gauge)
    reported = findings(NCCL)["gpu-idle"].evidence
    assert measured["gpu/idle_share"] == pytest.approx(0.762, abs=0.001)  # HTA's idle_time_pctg: 76.2
    assert measured["gpu/idle_share"] == pytest.approx(reported["gpu_idle_share"], abs=1e-4)  # rounded there
    assert measured["gpu/traced_seconds"] == pytest.approx(reported["gpu_span_ms"] / 1000)
    assert measured["gpu/idle_share_step"] == 4
    gauge.output_written(tmp_path / "other.json", "host_alloc", StepWindow(2, 5, 5), None)  # not a trace: ignored
    assert gauge.wait(10) and idle_samples(gauge) == measured
    gauge.close()


def test_a_cpu_trace_from_the_session_measures_nothing_and_a_damaged_one_is_counted(tmp_path):
    heard: list[tuple[Path, str | None, int]] = []

    class Heard(WindowListener):
        def output_written(self, path, format, window, role):
            heard.append((path, format, window.first))

    session = rlprof.init(torch_config(tmp_path / "profile", steps=[2, 3]))
    session.add_window_listener(Heard())
    with Tracker("p", "e", ["file"], log_dir=tmp_path / "logs") as tracker:
        gauge = WindowGpuIdle.follow(session, tracker)
        run_steps(range(1, 5))
        rlprof.shutdown()
        assert [(p.name, f, s) for p, f, s in heard] == [
            ("rank0.pt.trace.json.gz", "chrome_trace", 2),
            ("rank0.pt.trace.json.gz", "chrome_trace", 3),
        ]
        listed = [tmp_path / "profile" / m["path"] for m in read_manifest(tmp_path / "profile")]
        assert listed == [path for path, _, _ in heard]
        assert gauge.wait(60) and gauge.live_samples() == [] and gauge.unreadable == 0  # a CPU trace: no GPU
        gauge.output_written(NCCL, "chrome_trace", StepWindow(3, 7, 7), None)
        damaged = tmp_path / "damaged.json.gz"
        damaged.write_bytes(NCCL.read_bytes()[: NCCL.stat().st_size // 2])
        gauge.output_written(damaged, "chrome_trace", StepWindow(4, 8, 8), None)
        garbage = tmp_path / "garbage.json.gz"
        garbage.write_bytes(b"not a trace")
        gauge.output_written(garbage, "chrome_trace", StepWindow(5, 9, 9), None)
        assert gauge.wait(120)
        assert gauge.unreadable == 2 and idle_samples(gauge)["gpu/idle_share_step"] == 7  # the last value kept
        gauge.close()
    assert all(not t.name.startswith("rlprof-gpu-idle") for t in threading.enumerate())


def test_the_starved_alerts_thresholds_are_the_reports_gpu_idle_rule(capsys):
    (rule,) = [r for r in RULES if r.name == "gpu-idle"]
    assert main(["prometheus", "rules"]) == 0
    rules = yaml.safe_load(capsys.readouterr().out)["groups"][0]["rules"]
    (starved,) = [r for r in rules if r["alert"] == "RLProfGpuStarved"]
    idle, span_s = rule.thresholds["idle"], rule.thresholds["min_span_ms"] / 1000
    assert starved["expr"] == f"rlprof_gpu_idle_share >= {idle:g} and rlprof_gpu_traced_seconds >= {span_s:g}"


@pytest.mark.slow
def test_a_server_scrapes_the_idle_share_fires_the_starved_alert_and_answers_the_dashboards_panel(tmp_path, capsys):
    assert main(["prometheus", "rules"]) == 0
    rules = tmp_path / "rlprof.yml"
    rules.write_text(capsys.readouterr().out)
    logs = tmp_path / "logs"
    port = free_ports(1)
    targets = str(logs / "prometheus_targets" / "*.json")
    with (
        PrometheusServer(tmp_path / "prometheus", targets, rule_files=(str(rules),)) as server,
        Tracker("p", "starved", ["prometheus"], log_dir=logs, options={"prometheus": {"port": port}}) as tracker,
    ):
        gauge = WindowGpuIdle()
        tracker.add_live(gauge.live_samples)
        start = time.time()
        tracker.log({"timing_s/step": 1.0}, 1)
        assert "rlprof_gpu_idle_share" not in scrape(port)
        shutil.copy(NCCL, tmp_path / "rank0.pt.trace.json.gz")
        gauge.output_written(tmp_path / "rank0.pt.trace.json.gz", "chrome_trace", StepWindow(1, 2, 2), None)
        assert gauge.wait(120)
        (share,) = server.wait_for('rlprof_gpu_idle_share{experiment="starved"}', timeout_s=120)
        assert share["metric"]["rank"] == "0" and float(share["value"][1]) == pytest.approx(0.762, abs=0.001)
        deadline, starved = time.monotonic() + 120, []
        while not starved and time.monotonic() < deadline:
            with urllib.request.urlopen(f"{server.url}/api/v1/alerts", timeout=30) as answer:
                alerts = json.load(answer)["data"]["alerts"]
            starved = [a for a in alerts if a["labels"]["alertname"] == "RLProfGpuStarved" and a["state"] == "firing"]
            time.sleep(0.5)
        assert starved, "RLProfGpuStarved did not fire"
        assert starved[0]["annotations"]["summary"] == (
            "the GPU of rank 0 of starved was idle 76.16% of its traced time in the newest torch window"
        )
        (panel,) = [p for p in json.loads(shipped(DASHBOARD))["panels"] if "rlprof_gpu_idle_share" in str(p)]
        (query,) = [t["expr"].replace("$experiment", ".*") for t in panel["targets"]]
        assert server.query_range(query, start, time.time())
        gauge.close()
