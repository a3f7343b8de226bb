"""The model-based reward (verl's ``reward_model``): a sequence classifier built here scores decoded prompt and
response; its scores equal transformers' own one-sample forwards, micro-batching changes nothing, and in a trainer run
they replace the rule reward, computed inside the ``reward`` role's range."""

from __future__ import annotations

import gzip
import json
import subprocess

import pytest
import torch

from rlprof_train.config.load import load_trainer_config

from conftest import ROOT, build_reward_model, subprocess_env, trainer_command

TEXTS = [("3+4=", "7"), ("1+1=", "2"), ("0+2=", "11"), ("4+4=", "8"), ("2+3=", ""), ("1+0=", "1234")]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm") / "model", [p + r for p, r in TEXTS] + ["9+9=18"])


def one_by_one(folder, texts: list[str]) -> list[float]:
    """Transformers' own forward on each text alone (no padding at all): the independent computation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt")).logits[0, -1].item() for t in texts]


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_scores_equal_transformers_forward_on_each_sample_alone(reward_model_dir, micro_batch):
    from rlprof_train.workers.reward_model import RewardModel

    cfg = load_trainer_config(
        [
            "reward_model.enable=true",
            f"reward_model.model.path={reward_model_dir}",
            f"reward_model.micro_batch_size_per_gpu={micro_batch or 'null'}",
        ]
    ).reward_model
    scores = RewardModel(cfg, torch.device("cpu")).score([p for p, _ in TEXTS], [r for _, r in TEXTS])
    expected = one_by_one(reward_model_dir, [p + r for p, r in TEXTS])
    assert scores.shape == (len(TEXTS),)
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5), (scores.tolist(), expected)
    assert len(set(expected)) == len(expected)  # the samples score differently: a mix-up would show


def test_reward_model_settings_are_checked_with_the_rest(tmp_path):
    from rlprof.typed_config import ConfigError
    from rlprof_train.preflight import validate

    cfg = load_trainer_config(["reward_model.enable=true", f"reward_model.model.path={tmp_path}"])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert f"reward_model.model.path='{tmp_path}': no model directory (config.json) there" in str(error.value)
    global_size = load_trainer_config(["reward_model.micro_batch_size=8"], world_size=2).reward_model
    assert global_size.micro_batch_size_per_gpu == 4  # verl's global spelling, divided by the world size


@pytest.mark.slow
def test_a_run_scores_with_the_reward_model_inside_the_reward_range(tmp_path, reward_model_dir):
    from rlprof.manifest import read_manifest
    from rlprof.tracking.jsonl import read_jsonl

    command = trainer_command(
        tmp_path,
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model_dir}",
        "reward_model.micro_batch_size_per_gpu=64",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "global_profiler.tool=torch",
        "global_profiler.steps=[1]",
        f"global_profiler.save_path={tmp_path / 'profile'}",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"reward: the reward model at {reward_model_dir} scores responses" in result.stderr
    rows = [r for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl") if r["step"] > 0]
    means = [r["critic/score/mean"] for r in rows]
    assert len(means) == 2 and all(m not in (0.0, 1.0) for m in means)  # logits, not the 0/1 rule reward
    (entry,) = read_manifest(tmp_path / "profile")
    with gzip.open(tmp_path / "profile" / entry["path"], "rt") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    (reward,) = [e for e in events if e["name"] == "reward/reward"]
    inside = [
        e["name"]
        for e in events
        if e["name"].startswith("aten::") and reward["ts"] <= e["ts"] <= reward["ts"] + reward["dur"]
    ]
    assert "aten::embedding" in inside and any(n in inside for n in ("aten::mm", "aten::addmm", "aten::linear"))
