"""rlprof's Prometheus alert rules: promtool checks the shipped file; promtool's rule tests show each alert firing
on crafted series, with its summary naming the rank, and silent on healthy ones; `rlprof prometheus scrape`. (A real
run firing the stall alert in a real server: test_prometheus.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from rlprof.cli import main
from rlprof.cli.prometheus import RULES, shipped
from tests.conftest import prometheus

RUN = {"project": "p", "role": "trainer"}


def promtool() -> str:
    prometheus()  # installs both where missing
    found = shutil.which("promtool")
    assert found is not None
    return found


def shipped_rules(tmp_path: Path, capsys) -> Path:
    """The rules as `rlprof prometheus rules` prints them."""
    assert main(["prometheus", "rules"]) == 0
    path = tmp_path / "rlprof.yml"
    path.write_text(capsys.readouterr().out)
    return path


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    text = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def test_promtool_checks_the_shipped_rules(tmp_path, capsys):
    rules = shipped_rules(tmp_path, capsys)
    assert rules.read_text() == shipped(RULES)
    result = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS: 7 rules found" in result.stdout, result.stdout + result.stderr


def crafted_cases() -> tuple[list[dict[str, str]], list[dict]]:
    """Series of two experiments, ``bad`` (each alert's trouble) and ``good`` (healthy), and what promtool must see."""
    inputs, expected = [], []
    for experiment, healthy in (("bad", False), ("good", True)):
        run = {**RUN, "experiment": experiment}
        inputs += [
            series(
                "rlprof_watchdog_phase_seconds",
                {**run, "rank": "1", "phase": "reward", "step": "3"},
                "10 20 30" if healthy else "10 70 130",
            ),
            series("rlprof_watchdog_phase_limit_seconds", {**run, "rank": "1", "phase": "reward", "step": "3"}, "60x2"),
            series("rlprof_watchdog_phase_seconds", {**run, "rank": "0", "phase": "gen", "step": "3"}, "1 2 3"),
            series(
                "up",
                {"job": "rlprof", "instance": f"{experiment}:9491"}
                | {f"rlprof_{key}": value for key, value in {**run, "rank": "1"}.items()},
                "1x5" if healthy else "0x5",
            ),
            series("rlprof_timing_share_rollout", {**run, "rank": "0"}, "0.5x30" if healthy else "0.8x30"),
            series("rlprof_timing_share_training", {**run, "rank": "0"}, "0.4x30" if healthy else "0.15x30"),
            series("rlprof_gpu_idle_share", {**run, "rank": "1"}, "0.3" if healthy else "0.7616"),
            series("rlprof_gpu_traced_seconds", {**run, "rank": "1"}, "0.5"),
            series("rlprof_gpu_idle_share", {**run, "rank": "3"}, "0.99"),  # idle, but over 2 ms: not judged
            series("rlprof_gpu_traced_seconds", {**run, "rank": "3"}, "0.002"),
            series(
                "rlprof_nonfinite",
                {**run, "rank": "0", "key": "val-core/gsm8k/reward/mean@4" if healthy else "actor/pg_loss"},
                "1",
            ),
            series("rlprof_perf_max_memory_reserved_gb", {**run, "rank": "2"}, "40" if healthy else "75"),
            series("rlprof_perf_device_memory_total_gb", {**run, "rank": "2"}, "80"),
            series("rlprof_perf_cpu_memory_used_gb", {**run, "rank": "0"}, "10" if healthy else "30"),
            series("rlprof_perf_cpu_memory_total_gb", {**run, "rank": "0"}, "32"),
        ]
    bad = {**RUN, "experiment": "bad"}
    expected = [
        {
            "eval_time": "1m",
            "alertname": "RLProfRankStalled",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "1", "phase": "reward", "step": "3", "severity": "critical"},
                    "exp_annotations": {
                        "summary": "rank 1 of bad has been in reward of step 3 for 1m 10s, past the watchdog's limit",
                        "description": "Every rank writes its threads' stacks to {trainer.log_dir}/stalls/step3/"
                        "rank{R}.txt (rank 1's innermost frames name the line it waits in); `rlprof report "
                        "{trainer.log_dir}` lists the stall and the rank furthest behind. "
                        "trainer.watchdog.abort_after_s ends a job stuck this way.",
                    },
                }
            ],
        },
        {"eval_time": "0m", "alertname": "RLProfRankStalled", "exp_alerts": []},  # under the limit
        {
            "eval_time": "2m",
            "alertname": "RLProfRankMissing",
            "exp_alerts": [
                {
                    "exp_labels": {
                        "job": "rlprof",
                        "instance": "bad:9491",
                        "rlprof_project": "p",
                        "rlprof_experiment": "bad",
                        "rlprof_rank": "1",
                        "rlprof_role": "trainer",
                        "severity": "critical",
                    },
                    "exp_annotations": {
                        "summary": "rank 1 of bad does not answer at bad:9491",
                        "description": "Its targets file is still in {trainer.log_dir}/prometheus_targets/ (a "
                        "finished rank removes its own), so the process ended without finishing or its node is "
                        "unreachable: read the job's log for rank 1's traceback; `rlprof report {trainer.log_dir}` "
                        "for the steps it finished.",
                    },
                }
            ],
        },
        {"eval_time": "0m", "alertname": "RLProfRankMissing", "exp_alerts": []},  # not for 1 minute yet
        {
            "eval_time": "25m",
            "alertname": "RLProfRolloutBound",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "0", "severity": "warning"},
                    "exp_annotations": {
                        "summary": "generation takes 80% of bad's step (10-minute mean)",
                        "description": "Make generation faster first: `rlprof report {trainer.log_dir}` names the "
                        "rollout settings to change (actor_rollout_ref.rollout.max_num_batched_tokens, "
                        "gpu_memory_utilization; rollout.name=vllm).",
                    },
                }
            ],
        },
        {"eval_time": "5m", "alertname": "RLProfRolloutBound", "exp_alerts": []},  # not for 10 minutes yet
        {
            "eval_time": "0m",
            "alertname": "RLProfGpuStarved",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "1", "severity": "warning"},
                    "exp_annotations": {
                        "summary": "the GPU of rank 1 of bad was idle 76.16% of its traced time in the newest torch "
                        "window",
                        "description": "The host does not keep the device fed: `rlprof report "
                        "{global_profiler.save_path}` (gpu-idle) names the trace, its top operators by self time and "
                        "what to try (a larger actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu; "
                        "actor_rollout_ref.rollout.enforce_eager=false).",
                    },
                }
            ],
        },
        {
            "eval_time": "0m",
            "alertname": "RLProfNonFinite",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "0", "key": "actor/pg_loss", "severity": "critical"},
                    "exp_annotations": {
                        "summary": "actor/pg_loss of bad is not finite at rank 0's last step",
                        "description": "trainer.nonfinite_patience stops the run after that many such steps; "
                        "`rlprof report {trainer.log_dir}` shows the step it began at. Lower the learning rate or "
                        "clip gradients (actor_rollout_ref.actor.grad_clip).",
                    },
                }
            ],
        },
        {
            "eval_time": "0m",
            "alertname": "RLProfDeviceMemoryNearLimit",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "2", "severity": "warning"},
                    "exp_annotations": {
                        "summary": "rank 2 of bad reserved 93.75% of its device's memory at its last step's peak",
                        "description": "`rlprof report {trainer.log_dir}` (memory-bound) names what to lower: "
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, rollout.gpu_memory_utilization, or "
                        "parameter and optimizer offload; global_profiler.tool=torch_memory records a snapshot for "
                        "`rlprof memory`.",
                    },
                }
            ],
        },
        {
            "eval_time": "0m",
            "alertname": "RLProfHostMemoryNearLimit",
            "exp_alerts": [
                {
                    "exp_labels": {**bad, "rank": "0", "severity": "warning"},
                    "exp_annotations": {
                        "summary": "the host of rank 0 of bad uses 93.75% of its memory",
                        "description": "global_profiler.tool=memray records the host allocations of the chosen steps; "
                        "`rlprof report` over its windows names a site that grows (memory-growth).",
                    },
                }
            ],
        },
    ]
    return inputs, expected


def test_each_alert_fires_on_its_trouble_naming_the_rank_and_is_silent_on_a_healthy_run(tmp_path, capsys):
    rules = shipped_rules(tmp_path, capsys)
    inputs, expected = crafted_cases()
    cases = tmp_path / "cases.yml"
    cases.write_text(
        json.dumps(
            {
                "rule_files": [str(rules)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": expected}],
            }
        )
    )
    result = subprocess.run([promtool(), "test", "rules", str(cases)], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    # The same cases fail without the alerts: promtool really compared them.
    (tmp_path / "empty.yml").write_text("groups: []\n")
    cases.write_text(cases.read_text().replace(str(rules), str(tmp_path / "empty.yml")))
    assert subprocess.run([promtool(), "test", "rules", str(cases)], capture_output=True).returncode != 0


def test_scrape_prints_a_configuration_that_prometheus_loads(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    rules = shipped_rules(tmp_path, capsys)
    assert main(["prometheus", "scrape", str(logs), "--interval", "5s", "--rules", str(rules)]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(logs / "prometheus_targets" / "*.json")]
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    result = subprocess.run(
        [promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert main(["prometheus", "scrape", str(tmp_path / "missing")]) == 2
    assert "scrape: not a folder: " in capsys.readouterr().err
