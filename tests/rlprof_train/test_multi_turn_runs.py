"""The multi-turn rollout in real trainer runs: GRPO on the built-in calculator task learns to call the tool (reward
and correct calls rise), each turn and tool call is a range in the torch trace and the nsys report, the new metrics
reach JSONL and TensorBoard, and ``rlprof report`` lists the tool calls and names a run that waits on a slow tool."""

from __future__ import annotations

import gzip
import json
import subprocess
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from rlprof.analysis.sources.nsys_report import count_by_role, read_nvtx_ranges
from rlprof.cli import main
from rlprof.manifest import read_manifest
from rlprof.tracking.jsonl import read_jsonl

from conftest import LAUNCHER_VARIABLES, ROOT, subprocess_env, trainer_command

pytestmark = pytest.mark.slow

TOOL_RUN = ("--config-name=tool_demo", "trainer.val_before_train=false", "trainer.test_freq=-1")


def run(folder: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = trainer_command(folder, *overrides)
    command[3:4] = []  # trainer_command's --config-name=demo: the tool demo's is in the overrides
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env or subprocess_env(OMP_NUM_THREADS="1")
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def test_grpo_learns_to_call_the_calculator_and_every_turn_and_call_is_recorded(tmp_path, capsys):
    steps = 20
    run(
        tmp_path,
        *TOOL_RUN,
        f"trainer.total_training_steps={steps}",
        'trainer.logger=["file","tensorboard"]',
        "global_profiler.tool=torch",
        "global_profiler.steps=[2]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
        env=subprocess_env(OMP_NUM_THREADS="1", TENSORBOARD_DIR=str(tmp_path / "tb")),
    )
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    start, end = rows[:3], rows[-5:]
    reward, calls = (
        (mean("critic/score/mean", start), mean("critic/score/mean", end)),
        (
            mean("reward_extra/correct_call", start),
            mean("reward_extra/correct_call", end),
        ),
    )
    print(
        f"\ncalculator task: reward {reward[0]:.3f} (steps 1-3) -> {reward[1]:.3f} (steps {steps - 4}-{steps}); "
        f"correct calls {calls[0]:.3f} -> {calls[1]:.3f}; tool calls per trajectory "
        f"{mean('tool_call_counts/mean', start):.2f} -> {mean('tool_call_counts/mean', end):.2f}"
    )
    assert reward[0] <= 0.4 and reward[1] >= 0.8, reward
    assert calls[0] <= 0.4 and calls[1] >= 0.8, calls

    # every generation turn a range under the rollout phase, every tool call one of role tool
    (entry,) = read_manifest(tmp_path / "profile")
    with gzip.open(tmp_path / "profile" / entry["path"], "rt") as handle:
        names = Counter(e["name"] for e in json.load(handle)["traceEvents"] if e.get("ph") == "X")
    step2 = rows[1]
    assert names["rollout/gen"] == 1 and names["rollout/gen_turn"] >= 2 and names["rollout/tool_calls"] >= 1
    assert names["tool/calculator"] == step2["tools/calculator/calls"], names

    # the metrics in JSONL and TensorBoard
    keys = [
        "num_turns/mean",
        "tool_call_counts/max",
        "tools/calculator/calls",
        "tools/calculator/failures",
        "tools/calculator/latency_ms_p99",
        "rollout/tool_wait_share",
        "rollout/generation_share",
        "rollout/slowest_trajectory/turns",
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [k for k in keys if k not in step2 or k not in accumulator.Tags()["scalars"]] == []
    assert 2 <= step2["num_turns/mean"] <= 5 and 0 < step2["rollout/tool_wait_share"] < 1

    # rlprof report lists them
    capsys.readouterr()
    assert main(["report", str(tmp_path / "logs"), "--format", "json"]) == 0
    tools = {t["metric"]: t["median"] for t in json.loads(capsys.readouterr().out)["tools"]}
    assert tools["tools/calculator/calls"] > 0 and "rollout/slowest_trajectory/length" in tools


SLOW_TOOL = textwrap.dedent(
    """
    import time

    from rlprof_train.agent.builtin import CalculatorTool


    class SlowCalculator(CalculatorTool):
        '''The calculator behind a slow service: most calls take 0.6 s, one in eight hangs.'''

        calls = 0

        def execute(self, instance_id, parameters, **kwargs):
            SlowCalculator.calls += 1
            time.sleep(600 if SlowCalculator.calls % 8 == 0 else 0.6)
            return super().execute(instance_id, parameters, **kwargs)
    """
)
SLOW_TOOL_CONFIG = """tools:
  - class_name: slow_tool.SlowCalculator
    config: {}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


@pytest.mark.long  # CI time: in the test command's long runs
def test_a_rollout_waiting_on_a_slow_tool_is_named_by_the_report_with_the_timeout_to_set(tmp_path, capsys):
    """A tool that takes 0.6 s and hangs on one call in eight: the hanging calls are given up after the 3 s timeout
    and counted as failures, the run goes on and ends; the report names the wait and a timeout of twice the median
    call."""
    (tmp_path / "slow_tool.py").write_text(SLOW_TOOL)
    (tmp_path / "tools.yaml").write_text(SLOW_TOOL_CONFIG)
    env = subprocess_env(OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = f"{ROOT}:{tmp_path}"  # the user's tool module
    run(
        tmp_path,
        *TOOL_RUN,
        "trainer.total_training_steps=4",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=3",
        env=env,
    )
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 4 and all(r["tools/calculator/failures"] >= 1 for r in rows)  # the hanging calls
    assert all(r["tools/calculator/latency_ms_p99"] == pytest.approx(3000) for r in rows)
    assert main(["report", str(tmp_path / "logs"), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in report["findings"] if f["rule"] == "tool-bound"]
    print(f"\n{finding['message']}\n{finding['evidence']}")
    assert finding["evidence"]["tool_wait_share"] >= 0.5 and "the slowest tool, calculator" in finding["message"]
    assert finding["overrides"] == ["actor_rollout_ref.rollout.multi_turn.tool_timeout_s=2"]
    assert main(["report", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "Tool calls" in out and "tools/calculator/latency_ms_p99" in out


def test_the_nsys_report_holds_each_turn_and_tool_call(tmp_path, nsys, capfd, monkeypatch):
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    command = trainer_command(tmp_path, *TOOL_RUN, "trainer.total_training_steps=2")
    command[3:4] = []
    command += ["global_profiler.tool=nsys", "global_profiler.steps=[2]", f"global_profiler.save_path={tmp_path}/p"]
    assert main(["nsys", "profile", "--nsys", nsys, "--timeout", "900", "--", *command]) == 0
    capfd.readouterr()
    by_role = count_by_role(read_nvtx_ranges(tmp_path / "p" / "nsys" / "report.sqlite"))
    print(f"\nnsys ranges by role: {dict(by_role)}")
    assert by_role[("rollout", "gen")] == 1 and by_role[("rollout", "gen_turn")] >= 2
    assert by_role[("tool", "calculator")] >= 1


@pytest.mark.long  # CI time: in the test command's long runs
def test_the_vllm_rollout_calls_the_tool_and_its_log_probs_match_the_actors_over_the_conversation(tmp_path):
    """vLLM continues each conversation from its tokens: the policy's tokens of every turn get the engine's
    log-probs, which the actor's recomputation over the whole conversation (tool replies included) must match."""
    pytest.importorskip("vllm")
    run(tmp_path, *TOOL_RUN, "trainer.total_training_steps=2", "actor_rollout_ref.rollout.name=vllm")
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    print(f"\nvLLM multi-turn: {[(r['tools/calculator/calls'], r['rollout/log_prob_abs_diff']) for r in rows]}")
    assert all(r["tools/calculator/calls"] > 0 and r["num_turns/max"] >= 4 for r in rows)
    assert all(r["rollout/log_prob_abs_diff"] < 1e-4 for r in rows)  # on-policy, position by position
