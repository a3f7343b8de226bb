"""Load the trainer's configuration: ``ppo_trainer.yaml``, a verl-style ``--config-path/--config-name`` YAML over it,
then dotted ``key=value`` overrides, into the typed schema.

verl's keys that are spelt differently here, have no effect here, or are not supported are sorted by
:mod:`rlprof_train.config.verl_compat`. Types and ranges come from :mod:`rlprof_train.config.schema`; :func:`validate`
then checks what spans several keys or needs the file system (batch arithmetic, files, the model directory, the
reward function). Every problem found is named in one :class:`~rlprof.schema.ConfigError` line (the key, the value
and what is allowed), before any work starts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlprof.config import load_config as load_profiler_config
from rlprof.schema import ConfigError, build, collecting, one_message
from rlprof.tracking import parse_backends
from rlprof_train import algos
from rlprof_train.config import verl_compat
from rlprof_train.config.schema import TrainerConfig, as_dict
from rlprof_train.launch import launch_world
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


@dataclass
class LoadedConfig:
    cfg: TrainerConfig
    notes: list[str]
    """What the loader did with verl's keys (aliases applied, settings with no effect here): one log line each."""


def split_config_args(argv: Sequence[str]) -> tuple[Optional[Path], list[str]]:
    """verl's Hydra options (``--config-path DIR --config-name NAME``, or ``=`` forms) -> (the YAML file, the
    ``key=value`` overrides). ``--config-name`` alone names a config shipped in ``rlprof_train/config/``."""
    path: Optional[str] = None
    name: Optional[str] = None
    overrides: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        option, has_value, value = arg.partition("=")
        if option in ("--config-path", "-cp", "--config-name", "-cn"):
            if not has_value:
                if not args:
                    raise ConfigError(f"{option}: expected a value")
                value = args.pop(0)
            if option in ("--config-path", "-cp"):
                path = value
            else:
                name = value
        elif arg.startswith("-"):
            raise ConfigError(
                f"{arg}: not an option of the trainer; overrides are key=value, a config file is --config-path DIR "
                "--config-name NAME"
            )
        else:
            overrides.append(arg)
    if name is None:
        if path is not None:
            raise ConfigError(f"--config-path={path}: also give --config-name (the YAML file's name in that folder)")
        return None, overrides
    folder = Path(path).expanduser() if path else DEFAULTS.parent
    file = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not file.is_file():
        shipped = ", ".join(sorted(p.stem for p in DEFAULTS.parent.glob("*.yaml") if p != DEFAULTS))
        raise ConfigError(f"--config-name={name}: no such file {file}" + (f" (shipped: {shipped})" if not path else ""))
    return file, overrides


def _config_file_pairs(file: Path, problems: list[str]) -> list[tuple[str, Any]]:
    """The (dotted key, value) settings of a user's YAML, as verl's Hydra reads them: ``hydra:`` and the
    ``defaults:`` list (verl's ``ppo_trainer`` and ``_self_``, or a config shipped here) are not settings."""
    try:
        tree = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config-name: {file} is not readable YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--config-name: {file} holds no mapping of settings")
    tree.pop("hydra", None)
    pairs: list[tuple[str, Any]] = []
    for entry in tree.pop("defaults", None) or []:
        if entry in ("_self_", "ppo_trainer"):
            continue
        shipped = DEFAULTS.parent / f"{entry}.yaml" if isinstance(entry, str) else None
        if shipped is not None and shipped.is_file() and shipped != DEFAULTS:
            pairs += _config_file_pairs(shipped, problems)
        else:
            problems.append(
                f"{file}: defaults entry {entry!r} is not supported (only ppo_trainer, _self_ and the configs "
                "shipped in rlprof_train/config)"
            )
    return pairs + verl_compat.flatten(tree)


def _parsed(override: str) -> tuple[str, Any]:
    """``key=value`` with the value read as OmegaConf reads a command line (``[1,2]``, ``True``, ``null``, ``${x}``)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value")
    key, raw = override.split("=", 1)
    if key.startswith("~"):
        raise ConfigError(f"override {override!r}: deleting keys is not supported; set the key to null instead")
    key = key.removeprefix("+").removeprefix("+")
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]), resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override {override!r}: {' '.join(str(exc).split())}") from None
    except yaml.YAMLError as exc:  # e.g. a value starting with '*' or '&' (YAML's alias and anchor marks)
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(
            f"override {override!r}: the value {raw!r} does not read as YAML ({problem}); quote it: {key}=\"'{raw}'\""
        ) from None
    assert isinstance(parsed, dict)
    return key, parsed["value"]


def load(argv: Sequence[str] = (), world_size: int = 1, defaults: Path = DEFAULTS) -> LoadedConfig:
    """The typed configuration from a command line: the defaults, a ``--config-path/--config-name`` YAML over them,
    then the ``key=value`` overrides; verl's keys translated (:mod:`.verl_compat`), interpolations resolved, every
    key's type and range checked. Every problem found is in one :class:`ConfigError`."""
    file, overrides = split_config_args(argv)
    base = OmegaConf.load(defaults)
    known = set(_keys(base))
    problems: list[str] = []
    pairs = _config_file_pairs(file, problems) if file else []
    for override in overrides:
        try:
            pairs.append(_parsed(override))
        except ConfigError as exc:
            problems.append(str(exc))
    free = [k for k in known if k.startswith("global_profiler.") and OmegaConf.select(base, k) == {}]
    known |= {key for key, _ in pairs if any(key.startswith(f"{mapping}.") for mapping in free)}  # e.g. kw_args.*
    translation = verl_compat.translate(pairs, known, world_size)
    problems += translation.problems
    for key, value in translation.pairs:
        try:
            OmegaConf.update(base, key, value, merge=True)
        except OmegaConfBaseException as exc:
            problems.append(f"{key}: {' '.join(str(exc).split())}")
    try:
        tree = OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as exc:
        problems.append(f"config: {' '.join(str(exc).split())}")
        raise ConfigError(one_message(problems)) from None
    with collecting() as typed:
        cfg = build(TrainerConfig, tree, "")
    problems += typed
    problems += verl_compat.mirror_problems(translation.mirrors, lambda key: _setting(tree, key))
    if problems:
        raise ConfigError(one_message(problems))
    return LoadedConfig(cfg, translation.notes)


def _setting(tree: Any, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_trainer_config(overrides: Sequence[str] = (), defaults: Path = DEFAULTS, world_size: int = 1) -> TrainerConfig:
    """:func:`load` without its notes."""
    return load(overrides, world_size, defaults).cfg


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {allowed}")


def validate(cfg: TrainerConfig, world_size: int = 1) -> None:
    """Reject a config that cannot run, before any model is loaded or process group used."""
    problems = []
    checks = (
        lambda: _import_user_code(cfg),
        lambda: _check_strategy(cfg),
        lambda: _check_device(cfg),
        lambda: check_rollout(cfg),
        lambda: _check_batches(cfg, world_size),
        lambda: _check_algorithm(cfg),
        lambda: _check_names_and_paths(cfg),
        lambda: _check_inputs(cfg),
        lambda: _check_reward_model(cfg),
        lambda: _check_multi_turn(cfg),
        lambda: parse_backends(cfg.trainer.logger),
        lambda: load_profiler_config(as_dict(cfg), world_size=world_size),
    )
    for check in checks:  # each group stops at its first problem; the groups are independent
        try:
            check()
        except ValueError as exc:  # ConfigError, and the data and reward loaders' ValueErrors
            problems.append(str(exc))
    if problems:
        raise ConfigError(one_message(problems))


def _import_user_code(cfg: TrainerConfig) -> None:
    """The custom reward file first: besides its reward function it may register what the other checks look up
    (an advantage estimator, a rollout backend, a tracking backend, a profiler tool)."""
    custom = cfg.custom_reward_function
    if custom.path is not None:
        from rlprof_train.reward_functions import load_custom_reward

        load_custom_reward(custom.path, custom.name)


def training_device(cfg: TrainerConfig) -> str:
    """``trainer.device`` with ``auto`` resolved: ``cuda`` where torch sees a GPU, else ``cpu``."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_device(cfg: TrainerConfig) -> None:
    """``trainer.device=cuda`` needs a CUDA build of torch that sees a GPU for each process of the node."""
    if training_device(cfg) != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise _fail("trainer.device", "cuda", f"no CUDA device is visible here ({build}); use auto or cpu")
    per_node, visible = launch_world().per_node, torch.cuda.device_count()
    if per_node > visible:
        raise _fail(
            "trainer.device",
            "cuda",
            f"{per_node} processes on this node and {visible} GPU{'s' if visible != 1 else ''} visible: one GPU per "
            f"process; launch at most {visible} (torchrun --nproc_per_node {visible})",
        )


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
    critic = cfg.critic
    if critic.offload_param and critic.zero_stage != 3:
        raise _fail("critic.offload_param", True, "parameter offload needs critic.zero_stage=3")
    if critic.offload_optimizer and critic.zero_stage == 0:
        raise _fail("critic.offload_optimizer", True, "optimizer offload needs critic.zero_stage >= 1")


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
    missing = [f"{key}=null" for key in _unsized_passes(cfg)]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: set each pass's micro-batch size (responses per forward on one rank) or its "
            "token budget (use_dynamic_bsz / log_prob_use_dynamic_bsz), as verl requires"
        )


def _unsized_passes(cfg: TrainerConfig) -> list[str]:
    """The micro-batch keys of the passes this run makes that have neither a size nor a token budget."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    passes = [
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            arr.actor.ppo_micro_batch_size_per_gpu,
            arr.actor.use_dynamic_bsz,
        ),
    ]
    if not arr.actor.reuse_on_policy_log_probs:
        passes.append(
            (
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                arr.rollout.log_prob_micro_batch_size_per_gpu,
                arr.rollout.log_prob_use_dynamic_bsz,
            )
        )
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        passes.append(
            (
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                arr.ref.log_prob_micro_batch_size_per_gpu,
                arr.ref.log_prob_use_dynamic_bsz,
            )
        )
    estimator = algos.ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    if critic.enable or (critic.enable is None and estimator is not None and estimator.needs_critic):
        passes += [
            ("critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz),
            (
                "critic.forward_micro_batch_size_per_gpu",
                critic.forward_micro_batch_size_per_gpu,
                critic.use_dynamic_bsz,
            ),
        ]
    return [key for key, size, dynamic in passes if size is None and not dynamic]


def _check_algorithm(cfg: TrainerConfig) -> None:
    algorithm, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    estimator = algos.ADV_ESTIMATORS.get(algorithm.adv_estimator)
    if estimator is None:
        raise _fail(
            "algorithm.adv_estimator", algorithm.adv_estimator, f"choose one of: {', '.join(algos.ADV_ESTIMATORS)}"
        )
    if estimator.needs_groups and not estimator.groups_of_one and rollout.n < 2:
        raise _fail(
            "actor_rollout_ref.rollout.n",
            rollout.n,
            f"{algorithm.adv_estimator} compares the n responses of a prompt; use n >= 2",
        )
    if estimator.needs_critic and cfg.critic.enable is False:
        raise _fail("critic.enable", False, f"{algorithm.adv_estimator} needs the critic's values; leave it null")


def _check_names_and_paths(cfg: TrainerConfig) -> None:
    trainer = cfg.trainer
    profile_path = (cfg.global_profiler or {}).get("save_path")
    for key, folder in (
        ("trainer.log_dir", trainer.log_dir),
        ("trainer.default_local_dir", trainer.default_local_dir),
        ("global_profiler.save_path", profile_path),
    ):
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise _fail(key, folder, "a file is there; give a folder (it is created if missing)")
    for key, name in (
        ("trainer.project_name", trainer.project_name),
        ("trainer.experiment_name", trainer.experiment_name),
    ):
        if not _PLAIN_NAME.match(name) or ".." in name:
            raise _fail(
                key,
                name,
                "must be a plain name (ASCII letters and digits, then also . _ - + = @; no path separators, no "
                "'..'): it names folders and runs",
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


def _check_reward_model(cfg: TrainerConfig) -> None:
    reward_model = cfg.reward_model
    if not reward_model.enable:
        return
    if reward_model.model.path is None:
        raise _fail("reward_model.model.path", None, "reward_model.enable=true needs a sequence-classification model")
    folder = Path(reward_model.model.path)
    if not (folder / "config.json").is_file():
        raise _fail("reward_model.model.path", reward_model.model.path, "no model directory (config.json) there")
    if reward_model.model.use_remove_padding:
        raise _fail("reward_model.model.use_remove_padding", True, "only false: responses are scored padded here")


def _check_multi_turn(cfg: TrainerConfig) -> None:
    """The tool config loads (every problem of it in one message); the backend can continue sequences."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return
    if multi_turn.tool_config_path is not None:
        from rlprof_train.agent.tool_config import load_tools

        load_tools(multi_turn.tool_config_path)


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
    from rlprof_train.data import BUILTIN_TASKS, RuleRewards, check_data_files
    from rlprof_train.reward_functions import BUILTIN_SOURCES, builtin_reward

    scored_by_rules = custom.path is None and not cfg.reward_model.enable  # else the user's function or a model
    rule_rewards = RuleRewards(builtin_reward, BUILTIN_SOURCES) if scored_by_rules else None

    if data.train_files is None and data.task not in BUILTIN_TASKS:
        raise _fail("data.task", data.task, f"choose one of: {', '.join(BUILTIN_TASKS)} (or give data.train_files)")

    for setting, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        if files is not None:
            check_data_files(files, data.prompt_key, setting, rule_rewards)
