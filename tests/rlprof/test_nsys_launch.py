"""``rlprof nsys profile``: the capture settings computed from the command's own config (overrides, ``--config``
YAML, the trainer's defaults), refusals in one line, and a real nsys run of the example loop (its YAML config) with
the report listed, the captured steps checked and the role table printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from rlprof.cli import main
from rlprof.cli.nsys import plan

from conftest import EXAMPLE, LAUNCHER_VARIABLES

EXAMPLE_COMMAND = [sys.executable, str(EXAMPLE)]
TRAINER_COMMAND = [sys.executable, "-m", "rlprof_train.main_ppo"]


def option(options: list[str], prefix: str) -> list[str]:
    return [o for o in options if o.startswith(prefix)]


def test_with_cuda_one_capture_per_window_is_repeated_as_often_as_there_are_windows(tmp_path):
    command = [*EXAMPLE_COMMAND, "global_profiler.tool=nsys", "global_profiler.steps=[2,3,7]"]
    each_step = plan([*command, f"global_profiler.save_path={tmp_path}"], [], cuda=True)  # verl's default
    assert each_step.windows == [(2, 2), (3, 3), (7, 7)] and "--capture-range-end=repeat:3" in each_step.options
    command.append("global_profiler.profile_continuous_steps=true")
    capture = plan([*command, f"global_profiler.save_path={tmp_path}"], [], cuda=True)
    assert capture.windows == [(2, 3), (7, 7)]
    assert option(capture.options, "--capture-range") == [
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=repeat:2",
    ]
    assert capture.options[capture.options.index("-t") + 1] == "cuda,nvtx,osrt"
    assert capture.output == tmp_path / "nsys" / "report" and capture.warnings == []


def test_discrete_mode_repeats_without_a_count_and_cpu_runs_capture_everything_without_sampling(tmp_path):
    discrete = [*EXAMPLE_COMMAND, "global_profiler.tool=nsys", "global_profiler.global_tool_config.nsys.discrete=true"]
    assert option(plan(discrete, [], cuda=True).options, "--capture-range-end") == ["--capture-range-end=repeat"]
    cpu = plan([*EXAMPLE_COMMAND, "global_profiler.tool=nsys"], [], cuda=False).options
    assert option(cpu, "--capture-range") == [] and {"--sample=none", "--cpuctxsw=none"} <= set(cpu)
    assert cpu[cpu.index("-t") + 1] == "nvtx,osrt"


def test_the_users_nsys_options_are_kept(tmp_path):
    options = ["-o", str(tmp_path / "mine"), "--trace=nvtx"]
    capture = plan([*EXAMPLE_COMMAND, "global_profiler.tool=nsys"], options, cuda=False)
    assert capture.output == tmp_path / "mine" and capture.options[:3] == options and "-t" not in capture.options


def test_the_trainers_defaults_and_a_yaml_config_are_read_as_the_command_reads_them(tmp_path):
    command = [
        *TRAINER_COMMAND,
        "--config-name",
        "demo",
        "global_profiler.tool=nsys",
        "global_profiler.steps=[299,301]",
    ]
    trainer = plan(command, [], cuda=True)
    assert trainer.warnings == [
        "window(s) 301 start after trainer.total_training_steps=300: they will never be captured"
    ]  # 300 is the demo config's
    assert plan([*command[:3], *command[5:]], [], cuda=True).warnings == []  # verl's default: the epochs decide
    config = tmp_path / "profile.yaml"
    config.write_text("global_profiler:\n  tool: nsys\n  steps: [4, 5]\n  profile_continuous_steps: true\n")
    capture = plan([*EXAMPLE_COMMAND, "--config", str(config)], [], cuda=True)
    assert capture.windows == [(4, 5)] and "--capture-range-end=repeat:1" in capture.options


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--", *EXAMPLE_COMMAND, "global_profiler.tool=torch"],
            "global_profiler.tool is 'torch', which records without nsys; rlprof nsys runs nsys: add",
        ),
        (
            ["--", *EXAMPLE_COMMAND, "global_profiler.tool=nsys", "global_profiler.steps=[-1]"],
            "global_profiler.steps[0]: step -1",
        ),
        (["--", *EXAMPLE_COMMAND, "--config"], "--config in the command has no file after it"),
        (["--"], "give the command after --"),
        (["--", *EXAMPLE_COMMAND, "global_profiler.tool=nsys"], "--nsys /no/such/nsys: not an executable file"),
    ],
)
def test_commands_that_cannot_be_profiled_are_one_line_before_nsys_starts(capsys, argv, message):
    assert main(["nsys", "profile", "--nsys", "/no/such/nsys", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlprof nsys profile: ") and message in err and err.count("\n") == 1


def test_with_no_plan_errors_a_missing_nsys_binary_is_named(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["nsys", "profile", "--", *EXAMPLE_COMMAND, "global_profiler.tool=nsys"]) == 2
    assert "nsys not found: pass --nsys PATH" in capsys.readouterr().err


@pytest.mark.slow
def test_the_example_loop_under_the_launcher(tmp_path, nsys, capfd, monkeypatch):
    for variable in LAUNCHER_VARIABLES:  # left by tests that ran DeepSpeed in this process
        monkeypatch.delenv(variable, raising=False)
    config = tmp_path / "profile.yaml"
    config.write_text(f"global_profiler:\n  tool: nsys\n  steps: [2, 3]\n  save_path: {tmp_path / 'out'}\n")
    assert main(["nsys", "profile", "--nsys", nsys, "--", *EXAMPLE_COMMAND, "--config", str(config)]) == 0
    out = capfd.readouterr().out
    assert f"reports: {tmp_path / 'out' / 'nsys' / 'report.nsys-rep'}" in out
    assert sorted(p.name for p in (tmp_path / "out" / "nsys").glob("*.nsys-rep")) == ["report.nsys-rep"]
    assert "steps captured: 2, 3 (configured: 2, 3)" in out and "warning" not in out
    for role, name in (("rollout", "generate"), ("actor", "update_policy"), ("critic", "compute_values")):
        assert re.search(rf"│ {role} +│ {name} +│ +2 │", out), (role, name, out)


def test_the_report_goes_under_the_save_path_by_default():
    assert plan([*EXAMPLE_COMMAND, "global_profiler.tool=nsys"], [], cuda=False).output == Path(
        "outputs/profile/nsys/report"
    )
