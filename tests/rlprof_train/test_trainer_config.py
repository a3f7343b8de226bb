"""The trainer's command line: verl-style overrides, the seed's knobs, and bad input rejected before any work."""

from __future__ import annotations

import json

import pytest
import torch

from rlprof.config import ConfigError
from rlprof_train.config import as_dict
from rlprof_train.config.load import load_trainer_config
from rlprof_train.launch import LOCAL_RANK_ALIASES, launch_world, settle_local_rank
from rlprof_train.main_ppo import main
from rlprof_train.preflight import validate


def test_the_demo_config_validates_and_declares_every_role_and_verls_defaults_ask_for_the_micro_batches():
    cfg = load_trainer_config(["--config-name", "demo"])
    validate(cfg)
    from rlprof.config import load_config

    assert set(load_config(as_dict(cfg)).roles) == {"actor", "ref", "rollout", "critic", "reward", "trainer"}
    with pytest.raises(ConfigError) as refused:  # as verl: the passes' micro-batch sizes must be given
        validate(load_trainer_config([]))
    assert str(refused.value).startswith(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null, "
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null, critic.ppo_micro_batch_size_per_gpu=null"
    )


def test_dotted_overrides_and_interpolated_defaults():
    cfg = load_trainer_config(
        [
            "algorithm.adv_estimator=gae",
            "trainer.logger=[console,wandb]",
            "+trainer.seed=3",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ]
    )
    assert cfg.algorithm.adv_estimator == "gae" and list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.trainer.seed == 3  # verl's "+key" spelling of an existing key is accepted
    # the log-prob passes and the critic follow the actor's knob unless set (verl's interpolations)
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz and cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    assert cfg.critic.use_dynamic_bsz


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(
        ConfigError, match="unknown config key 'algorithm.adv_estimater'; did you mean 'algorithm.adv_estimator'"
    ):
        load_trainer_config(["algorithm.adv_estimater=gae"])
    with pytest.raises(ConfigError, match="unknown config key 'my.extra'"):
        load_trainer_config(["+my.extra=3"])


def test_schema_and_yaml_agree_key_by_key():
    import dataclasses
    import typing

    from omegaconf import OmegaConf

    from rlprof_train.config import TrainerConfig
    from rlprof_train.config.load import DEFAULTS

    def yaml_keys(node, prefix=""):
        out = set()
        for key, value in node.items():
            out.add(prefix + key)
            if isinstance(value, dict) and key not in ("profiler", "global_profiler"):
                out |= yaml_keys(value, prefix + key + ".")
        return out

    def schema_keys(schema, prefix=""):
        out = set()
        for name, hint in typing.get_type_hints(schema).items():
            out.add(prefix + name)
            if dataclasses.is_dataclass(hint):
                out |= schema_keys(hint, prefix + name + ".")
        return out

    assert yaml_keys(OmegaConf.to_container(OmegaConf.load(DEFAULTS), resolve=True)) == schema_keys(TrainerConfig)
    defaults, resolved = as_dict(TrainerConfig()), as_dict(load_trainer_config([]))
    differing = {
        k
        for k in schema_keys(TrainerConfig)
        if not isinstance(_get(resolved, k), dict) and _get(defaults, k) != _get(resolved, k)
    }
    assert differing == set(), differing  # the dataclass defaults are the YAML's


def _get(tree, dotted):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("trainer.total_training_steps=abc", ["trainer.total_training_steps", "'abc'", "integer or null"]),
        ("actor_rollout_ref.actor.optim.lr=fast", ["actor_rollout_ref.actor.optim.lr", "'fast'", "a number"]),
        ("trainer.seed=abc", ["trainer.seed", "'abc'", "an integer"]),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
            ["log_prob_micro_batch_size_per_gpu", "0", ">= 1"],
        ),
        ("actor_rollout_ref.rollout.top_p=2", ["actor_rollout_ref.rollout.top_p", "2", "> 0 and <= 1"]),
        ("trainer.total_training_steps=0", ["trainer.total_training_steps", "0", ">= 1"]),
        ("reward_model.reward_manager=prime", ["reward_model.reward_manager", "'prime'", "naive"]),
        ("trainer.experiment_name=../elsewhere", ["trainer.experiment_name", "no path separators"]),
        ("trainer.project_name=a/b", ["trainer.project_name", "no path separators"]),
        ("trainer.resume_mode=/tmp", ["trainer.resume_mode", "inside trainer.default_local_dir"]),
    ],
)
def test_wrong_types_and_ranges_are_named_before_work_starts(override, fragments, capsys):
    assert main([override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("actor_rollout_ref.actor.strategy=fsdp2", ["strategy='fsdp2'", "DeepSpeed", "zero_stage"]),
        ("actor_rollout_ref.actor.fsdp_config.forward_prefetch=true", ["forward_prefetch", "ZeRO 3 prefetches"]),
        ("actor_rollout_ref.actor.fsdp_config.offload_policy=true", ["offload_policy", "zero_stage=3"]),
        ("data.max_response_length=0", ["data.max_response_length", "0 is out of range", ">= 1"]),
        ("algorithm.adv_estimator=ppo", ["adv_estimator='ppo'", "gae, grpo, rloo"]),
        ("actor_rollout_ref.actor.zero_stage=4", ["zero_stage: 4", "0, 1, 2, 3"]),
        ("trainer.logger=[console,neptune]", ["unknown backend 'neptune'"]),
        ("actor_rollout_ref.model.path=/no/such/model", ["model.path='/no/such/model'", "no such directory"]),
        ("custom_reward_function.path=/no/such/reward.py", ["custom_reward_function.path", "no such file"]),
        ("actor_rollout_ref.rollout.name=sglang", ["rollout.name='sglang'", "use vllm"]),
        ("global_profiler.tool=npu", ["global_profiler.tool", "'npu'", "nsys, range_times, torch, torch_memory"]),
        ("trainer.experiment_name=*", ["the value '*' does not read as YAML", "quote it"]),
        ("trainer.experiment_name=straße", ["experiment_name='straße'", "ASCII letters and digits"]),
        ("trainer.log_dir=pyproject.toml", ["trainer.log_dir='pyproject.toml': a file is there; give a folder"]),
    ],
)
def test_bad_settings_are_rejected_before_any_work(override, fragments, capsys):
    assert main([override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize(
    "variables, fragment",
    [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: a world needs at least 1 process"),
        ({"RANK": "0"}, "RANK=0 is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': not a whole number"),
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5: outside the world (0..1)"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "LOCAL_RANK is not set (RANK=1 of WORLD_SIZE=2), nor any of SLURM_LOCALID"),
    ],
)
def test_launcher_variables_that_cannot_form_a_world_are_one_line(variables, fragment, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *LOCAL_RANK_ALIASES):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["--config-name=demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "torchrun" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_gpu_is_one_line_naming_the_build(capsys):
    assert main(["--config-name=demo", "trainer.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"trainer.device='cuda': no CUDA device is visible here (torch {torch.__version__}" in err
    assert "use auto or cpu" in err


def test_more_processes_on_a_node_than_gpus_is_one_line(monkeypatch, capsys):
    """The device count is mocked: a machine with 2 GPUs cannot exist here (a hardware boundary)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    assert main(["--config-name=demo", "trainer.device=cuda", "data.train_batch_size=64"]) == 2
    err = capsys.readouterr().err
    assert "4 processes on this node and 2 GPUs visible: one GPU per process" in err, err
    assert "torchrun --nproc_per_node 2" in err and err.count("\n") == 1


def test_a_missing_local_rank_is_taken_from_other_launchers_or_is_0_in_a_world_of_one():
    assert launch_world({"RANK": "3", "WORLD_SIZE": "4", "SLURM_LOCALID": "1", "LOCAL_WORLD_SIZE": "2"}).local_rank == 1
    assert launch_world({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}).local_rank == 1
    assert launch_world({"RANK": "0", "WORLD_SIZE": "1"}).local_rank == 0
    assert launch_world({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).local_rank == 1
    environ = {"RANK": "0", "WORLD_SIZE": "1"}
    settle_local_rank(launch_world(environ), environ)
    assert environ["LOCAL_RANK"] == "0"  # where DeepSpeed reads it (missing, it looks for MPI)


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


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ([], None),
        (["actor_rollout_ref.actor.ppo_epochs=2"], "ppo_epochs=2"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], "ppo_mini_batch_size=16 < data.train_batch_size=32"),
        (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward needs the old log-probs"),
        (["actor_rollout_ref.rollout.name=vllm"], "rollout/log_prob_abs_diff"),
    ],
)
def test_reusing_on_policy_log_probs_applies_only_where_the_update_is_on_policy(overrides, reason):
    from rlprof_train.prepare import reuses_on_policy_log_probs

    lines: list[str] = []
    cfg = load_trainer_config(
        ["--config-name=demo", "actor_rollout_ref.actor.reuse_on_policy_log_probs=true", *overrides]
    )
    assert reuses_on_policy_log_probs(cfg, lines.append) is (reason is None)
    assert (reason is None and not lines) or (len(lines) == 1 and reason in lines[0]), lines
    assert not reuses_on_policy_log_probs(load_trainer_config(["--config-name=demo", *overrides]), lines.append)


def test_rollout_prometheus_needs_vllm_with_its_statistics_on():
    cfg = load_trainer_config(["--config-name", "demo", "actor_rollout_ref.rollout.prometheus.enable=true"])
    with pytest.raises(ConfigError) as raised:
        validate(cfg)
    message = str(raised.value)
    assert "set actor_rollout_ref.rollout.name to one (vllm; it is 'hf')" in message
    assert "set actor_rollout_ref.rollout.disable_log_stats=false (as verl asks)" in message
    fine = load_trainer_config(
        [
            "--config-name",
            "demo",
            "actor_rollout_ref.rollout.prometheus.enable=true",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.disable_log_stats=false",
        ],
    )
    validate(fine)
