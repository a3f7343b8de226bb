"""The trainer's command line: verl-style overrides, the seed's knobs, and bad input rejected before any work."""

from __future__ import annotations

import json

import pytest

from rlprof.config import ConfigError
from rlprof_train.config import load_trainer_config, validate
from rlprof_train.main_ppo import main


def test_defaults_validate_and_declare_every_role():
    cfg = load_trainer_config([])
    validate(cfg)
    from rlprof.config import load_config

    assert set(load_config(cfg).roles) == {"actor", "ref", "rollout", "critic", "reward", "trainer"}


def test_dotted_overrides_and_new_keys():
    cfg = load_trainer_config(["algorithm.adv_estimator=gae", "trainer.logger=[console,wandb]", "+my.extra=3"])
    assert cfg.algorithm.adv_estimator == "gae" and list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.my.extra == 3


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match="unknown config key 'algorithm.adv_estimater'; did you mean 'algorithm.adv_estimator'"):
        load_trainer_config(["algorithm.adv_estimater=gae"])


@pytest.mark.parametrize("override, fragments", [
    ("actor_rollout_ref.actor.strategy=fsdp2", ["strategy='fsdp2'", "DeepSpeed", "zero_stage"]),
    ("actor_rollout_ref.actor.fsdp_config.forward_prefetch=true", ["forward_prefetch", "ZeRO 3 prefetches"]),
    ("actor_rollout_ref.actor.fsdp_config.offload_policy=true", ["offload_policy", "zero_stage=3"]),
    ("data.max_response_length=0", ["data.max_response_length=0", "positive integer"]),
    ("algorithm.adv_estimator=ppo", ["adv_estimator='ppo'", "gae, grpo, rloo"]),
    ("actor_rollout_ref.actor.zero_stage=4", ["zero_stage=4", "0, 1, 2, 3"]),
    ("trainer.logger=[console,neptune]", ["unknown backend 'neptune'"]),
    ("actor_rollout_ref.model.path=/no/such/model", ["model.path='/no/such/model'", "no such directory"]),
    ("custom_reward_function.path=/no/such/reward.py", ["custom_reward_function.path", "no such file"]),
    ("actor_rollout_ref.rollout.name=sglang", ["rollout.name='sglang'", "hf, vllm"]),
    ("global_profiler.tool=npu", ["global_profiler.tool", "'npu'", "nsys, torch, torch_memory"]),
])
def test_bad_settings_are_rejected_before_any_work(override, fragments, capsys):
    assert main([override]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_reward_function_that_does_not_import(tmp_path, capsys):
    broken = tmp_path / "reward.py"
    broken.write_text("import numpy_but_misspelled\n")
    assert main([f"custom_reward_function.path={broken}"]) == 2
    assert "does not import" in capsys.readouterr().err and "numpy_but_misspelled" in broken.read_text()


def test_dataset_without_prompt_column(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "data_source": "gsm8k"}) + "\n")
    assert main([f"data.train_files={data}"]) == 2
    err = capsys.readouterr().err
    assert "no 'prompt' column" in err and "question" in err


def test_missing_model_directory_without_config_json(tmp_path, capsys):
    assert main([f"actor_rollout_ref.model.path={tmp_path}"]) == 2
    assert "no config.json" in capsys.readouterr().err
