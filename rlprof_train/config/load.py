"""Load the trainer's configuration: ``ppo_trainer.yaml`` plus verl-style dotted overrides, into the typed schema.

Overrides are ``key=value`` (the key must exist; an unknown key suggests the nearest valid one). Types and ranges
come from :mod:`rlprof_train.config.schema`; :func:`validate` then checks what spans several keys or needs the
file system (batch arithmetic, files, the model directory, the reward function). Every error is one
:class:`~rlprof.schema.ConfigError` line naming the key, the value and what is allowed, before any work starts.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlprof.config import load_config as load_profiler_config
from rlprof.schema import ConfigError, build
from rlprof.tracking import parse_backends
from rlprof_train import algos
from rlprof_train.config.schema import TrainerConfig, as_dict
from rlprof_train.workers.rollout.registry import check_rollout

DEFAULTS = Path(__file__).parent / "ppo_trainer.yaml"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=@-]*$")


def _keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for key in node:
            path = f"{prefix}.{key!s}" if prefix else str(key)
            keys.append(path)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                keys.extend(_keys(child, path))
    return keys


def merged_yaml(overrides: Sequence[str] = (), defaults: Path = DEFAULTS) -> DictConfig:
    """The defaults with ``overrides`` applied, interpolations unresolved (``${...}`` follow later overrides)."""
    base = OmegaConf.load(defaults)
    known = set(_keys(base))
    dotlist = []
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r}: expected key=value")
        key, value = override.split("=", 1)
        if key.startswith("~"):
            raise ConfigError(f"override {override!r}: deleting keys is not supported; set the key to null instead")
        key = key.removeprefix("+")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint} (see rlprof_train/config/ppo_trainer.yaml)")
        dotlist.append(f"{key}={value}")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides: {' '.join(str(exc).split())}") from None
    assert isinstance(merged, DictConfig)
    return merged


def load_trainer_config(overrides: Sequence[str] = (), defaults: Path = DEFAULTS) -> TrainerConfig:
    """The typed configuration: defaults, overrides, interpolations resolved, every key's type and range checked."""
    merged = merged_yaml(overrides, defaults)
    try:
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config: {' '.join(str(exc).split())}") from None
    return build(TrainerConfig, tree, "")


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {allowed}")


def validate(cfg: TrainerConfig, world_size: int = 1) -> None:
    """Reject a config that cannot run, before any model is loaded or process group used."""
    _import_user_code(cfg)
    _check_strategy(cfg)
    _check_batches(cfg, world_size)
    _check_algorithm(cfg)
    _check_names_and_paths(cfg)
    _check_inputs(cfg)
    parse_backends(cfg.trainer.logger)
    load_profiler_config(as_dict(cfg), world_size=world_size)


def _import_user_code(cfg: TrainerConfig) -> None:
    """The custom reward file first: besides its reward function it may register what the other checks look up
    (an advantage estimator, a rollout backend, a tracking backend, a profiler tool)."""
    custom = cfg.custom_reward_function
    if custom.path is not None:
        from rlprof_train.reward_functions import load_custom_reward

        load_custom_reward(custom.path, custom.name)


def _check_strategy(cfg: TrainerConfig) -> None:
    actor = cfg.actor_rollout_ref.actor
    if actor.strategy != "deepspeed":
        raise _fail(
            "actor_rollout_ref.actor.strategy",
            actor.strategy,
            "this trainer runs the actor and critic on DeepSpeed; use strategy=deepspeed and choose the "
            "sharding with actor_rollout_ref.actor.zero_stage=0|1|2|3 (FSDP's full sharding = ZeRO 3), "
            "offload with actor.offload_param / actor.offload_optimizer",
        )
    if actor.fsdp_config.forward_prefetch:
        raise _fail(
            "actor_rollout_ref.actor.fsdp_config.forward_prefetch",
            True,
            "an FSDP setting; DeepSpeed ZeRO 3 prefetches parameters by itself, so leave it false",
        )
    if actor.fsdp_config.offload_policy and actor.zero_stage != 3:
        raise _fail(
            "actor_rollout_ref.actor.fsdp_config.offload_policy",
            True,
            "maps to DeepSpeed parameter + optimizer offload to the host, which needs "
            "actor_rollout_ref.actor.zero_stage=3 (DeepSpeedCPUAdam is built on first use)",
        )
    if actor.offload_param and actor.zero_stage != 3:
        raise _fail("actor_rollout_ref.actor.offload_param", True, "parameter offload needs zero_stage=3")
    if actor.offload_optimizer and actor.zero_stage == 0:
        raise _fail("actor_rollout_ref.actor.offload_optimizer", True, "optimizer offload needs zero_stage >= 1")
    check_rollout(cfg)


def _check_batches(cfg: TrainerConfig, world_size: int) -> None:
    data, actor, critic = cfg.data, cfg.actor_rollout_ref.actor, cfg.critic
    for key, mini in (
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size),
    ):
        if data.train_batch_size % mini:
            raise _fail(key, mini, f"must divide data.train_batch_size={data.train_batch_size}")
        if mini % world_size:
            raise _fail(key, mini, f"must be a multiple of the number of ranks ({world_size})")
    if data.train_batch_size % world_size:
        raise _fail(
            "data.train_batch_size", data.train_batch_size, f"must be a multiple of the number of ranks ({world_size})"
        )


def _check_algorithm(cfg: TrainerConfig) -> None:
    algorithm, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    estimator = algos.ADV_ESTIMATORS.get(algorithm.adv_estimator)
    if estimator is None:
        raise _fail(
            "algorithm.adv_estimator", algorithm.adv_estimator, f"choose one of: {', '.join(algos.ADV_ESTIMATORS)}"
        )
    if estimator.needs_groups and rollout.n < 2:
        raise _fail(
            "actor_rollout_ref.rollout.n",
            rollout.n,
            f"{algorithm.adv_estimator} compares the n responses of a prompt; use n >= 2",
        )
    if estimator.needs_critic and cfg.critic.enable is False:
        raise _fail("critic.enable", False, f"{algorithm.adv_estimator} needs the critic's values; leave it null")


def _check_names_and_paths(cfg: TrainerConfig) -> None:
    trainer = cfg.trainer
    for key, name in (
        ("trainer.project_name", trainer.project_name),
        ("trainer.experiment_name", trainer.experiment_name),
    ):
        if not _PLAIN_NAME.match(name) or ".." in name:
            raise _fail(
                key,
                name,
                "must be a plain name (letters, digits, . _ - + = @; no path separators, no '..'): "
                "it names folders and runs",
            )
    if trainer.resume_mode not in ("auto", "disable"):
        root = Path(trainer.default_local_dir).resolve()
        target = Path(trainer.resume_mode)
        target = (target if target.is_absolute() else Path.cwd() / target).resolve()
        if root not in target.parents or not re.match(r"^global_step_\d+$", target.name):
            raise _fail(
                "trainer.resume_mode",
                trainer.resume_mode,
                f"choose auto, disable, or a global_step_N directory inside trainer.default_local_dir ({root})",
            )
        if not target.is_dir():
            raise _fail("trainer.resume_mode", trainer.resume_mode, "no such checkpoint directory")


def _check_inputs(cfg: TrainerConfig) -> None:
    data, model, custom = cfg.data, cfg.actor_rollout_ref.model, cfg.custom_reward_function
    if model.path is not None:
        path = Path(model.path)
        if not path.is_dir():
            raise _fail("actor_rollout_ref.model.path", model.path, "no such directory (a local Hugging Face model)")
        if not (path / "config.json").exists():
            raise _fail(
                "actor_rollout_ref.model.path", model.path, "has no config.json: not a Hugging Face model directory"
            )
    from rlprof_train.data import BUILTIN_TASKS, check_data_files

    if data.train_files is None and data.task not in BUILTIN_TASKS:
        raise _fail("data.task", data.task, f"choose one of: {', '.join(BUILTIN_TASKS)} (or give data.train_files)")

    for setting, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if files is not None:
            check_data_files(files, data.prompt_key, setting, needs_ground_truth=custom.path is None)
