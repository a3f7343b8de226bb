"""Load the trainer's configuration: ``ppo_trainer.yaml``, a verl-style ``--config-path/--config-name`` YAML over it,
then dotted ``key=value`` overrides, into the typed schema.

verl's keys that are spelt differently here, have no effect here, or are not supported are sorted by
:mod:`rlprof_train.config.verl_compat`. Types and ranges come from :mod:`rlprof_train.config.schema`;
:func:`rlprof_train.preflight.validate` then checks what spans several keys or needs the file system (batch
arithmetic, files, the model directory, the reward function) or a registry. Every problem found is named in one
:class:`~rlprof.typed_config.ConfigError` line (the key, the value and what is allowed), before any work starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlprof.typed_config import ConfigError, build, collecting, one_message
from rlprof_train.config import verl_compat
from rlprof_train.config.schema import TrainerConfig, TrainerMode

DEFAULTS = Path(__file__).parent / "ppo_trainer.yaml"


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


def load(
    argv: Sequence[str] = (), world_size: int = 1, defaults: Path = DEFAULTS, mode: TrainerMode = "sync"
) -> LoadedConfig:
    """The typed configuration from a command line: the defaults, a ``--config-path/--config-name`` YAML over them,
    then the ``key=value`` overrides; verl's keys translated (:mod:`.verl_compat`), interpolations resolved, every
    key's type and range checked. Every problem found is in one :class:`ConfigError`. The rollout pool's keys
    (:data:`~.verl_compat.POOL_KEYS`) are the asynchronous trainers', the pipeline's
    (:data:`~.verl_compat.FULLY_ASYNC_KEYS`) the fully-async one's: refused by name for the others (``mode``)."""
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
    free = [k for k in known if OmegaConf.select(base, k) == {}]  # mappings of any keys: kw_args, override_config
    known |= {key for key, _ in pairs if any(key.startswith(f"{mapping}.") for mapping in free)}
    if mode != "fully_async":
        known -= verl_compat.FULLY_ASYNC_KEYS
    if mode == "sync":
        known -= verl_compat.POOL_KEYS
    notes = []
    if mode == "fully_async":  # a local update's prompts are the pipeline's (verl's scripts give 0)
        given = [value for key, value in pairs if key == "data.train_batch_size"]
        pairs = [(key, value) for key, value in pairs if key != "data.train_batch_size"]
        if given:
            notes.append(
                f"data.train_batch_size={given[-1]}: the fully-async trainer's local update takes "
                "actor_rollout_ref.actor.ppo_mini_batch_size x async_training.require_batches prompt groups"
            )
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
    if mode == "fully_async":
        cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.async_training.require_batches
    return LoadedConfig(cfg, notes + translation.notes)


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


def training_device(cfg: TrainerConfig) -> str:
    """``trainer.device`` with ``auto`` resolved: ``cuda`` where torch sees a GPU, else ``cpu``."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if torch.cuda.is_available() else "cpu"
