"""docs/extending.md's three worked examples, run as written: a tool, a backend and an advantage estimator added
from user code with one registration each, then used through the public config."""

from __future__ import annotations

import json
import re

import torch

import rlprof
from rlprof.manifest import read_manifest

from conftest import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), re.S)


def run_blocks(*indices, **names):
    namespace = dict(names)
    for i in indices:
        exec(compile(BLOCKS[i], f"docs/extending.md block {i}", "exec"), namespace)
    return namespace


def test_the_documents_examples_are_all_here():
    assert len(BLOCKS) == 4


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
    from rlprof_train.config import load_trainer_config, validate

    validate(load_trainer_config(["trainer.logger=[console,csv]"]))  # and the trainer accepts its name


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
