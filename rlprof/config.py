"""The profiler's configuration: a typed schema, its loader and its validation.

The schema follows verl's layout so that verl YAML loads unchanged::

    global_profiler:                # one block: which tool, which steps, where to write
      tool: torch                   # null or a registered tool: nsys | torch | torch_memory | your own
      steps: [2, 3]                 # or a window in the tool's block (step_start/step_end)
      save_path: ./outputs/profile
      global_tool_config:
        torch: {step_start: 100, step_end: 200, contents: [cpu, shapes]}
    actor_rollout_ref:
      actor:
        profiler: {enable: true, all_ranks: false, ranks: [0]}   # one block per role

Any mapping key named ``profiler`` (other than ``global_profiler``) anywhere in the config declares a role
named after its parent key (``reward_model`` is read as ``reward``). As in verl's colocated actor-rollout-ref
worker, ``rollout`` and ``ref`` follow the actor's block unless they declare their own. Each tool's block in
``global_tool_config`` is the settings dataclass it was registered with (:func:`rlprof.register_tool`).
Loading fails with :class:`ConfigError` before any work starts, naming the key, the bad value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlprof.roles import ROLE_ALIASES, RoleProfilerConfig, governing_block, records_on, role_enabled
from rlprof.typed_config import ConfigError, build, check_bounds, coerce, unknown_key_message

__all__ = [
    "ConfigError",
    "GlobalProfilerConfig",
    "ProfilerConfig",
    "RoleProfilerConfig",
    "StepSelection",
    "load_config",
]


class ToolConfigs(Mapping[str, Any]):
    """``global_tool_config``: each registered tool's settings, by tool name (``cfg.torch`` or ``cfg["torch"]``)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self._settings = dict(settings)

    def __getitem__(self, name: str) -> Any:
        return self._settings[name]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_settings"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._settings)

    def __len__(self) -> int:
        return len(self._settings)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolConfigs) and self._settings == other._settings

    __hash__ = None  # type: ignore[assignment]  # mutable settings: not hashable

    def __repr__(self) -> str:
        return f"ToolConfigs({self._settings!r})"


@dataclass
class GlobalProfilerConfig:
    """The run-wide choice of tool, steps and output folder."""

    tool: Optional[str] = None
    """Which tool records: null (none) or a registered tool (nsys, torch, torch_memory, range_times, or your own)."""
    steps: Optional[list[int]] = None
    """Training steps to record, each step its own window (see ``profile_continuous_steps``). null: the tool's step
    window (``step_start``..``step_end``, one window), or all steps."""
    profile_continuous_steps: bool = False
    """verl's: consecutive ``steps`` form one window (one capture, one trace), recording what runs between them;
    false: each step is a window of its own."""
    save_path: str = "outputs/profile"
    """Folder for traces, snapshots and manifest.jsonl."""
    finish_hook_cmd: Optional[str] = None
    """verl's: a shell command run once after the last profiled step (e.g. to upload ``save_path``), with
    ``VERL_PROFILE_SAVE_PATH``, ``_TOOL``, ``_RANK``, ``_PID``, ``_ROLE`` set (see :mod:`rlprof.finish_hook`); null:
    none."""
    finish_hook_all_ranks: bool = False
    """Run ``finish_hook_cmd`` on every rank."""
    finish_hook_ranks: list[int] = field(default_factory=list)
    """Ranks that run ``finish_hook_cmd`` (one per node, to upload each node's folder once); empty: the ranks that
    record."""
    global_tool_config: ToolConfigs = field(default_factory=lambda: ToolConfigs(_default_tool_settings()))
    """Settings of each registered tool."""


@dataclass
class ProfilerConfig:
    """Everything the profiler session needs: the global block and the role blocks found in the config."""

    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    roles: dict[str, RoleProfilerConfig] = field(default_factory=dict)
    """The role blocks the config declares, by role name."""

    def role(self, name: str) -> Optional[RoleProfilerConfig]:
        """The block that governs role ``name`` (see :mod:`rlprof.roles`), or None."""
        return governing_block(self.roles, name)

    def role_enabled(self, name: str, rank: int) -> bool:
        """Whether ``name``'s ranges record on ``rank`` (see :mod:`rlprof.roles`)."""
        return role_enabled(self.roles, name, rank)

    def records_on(self, rank: int) -> bool:
        """Whether any role records on ``rank`` (else that rank starts no tool and writes nothing)."""
        return records_on(self.roles, rank)

    def tool_settings(self) -> Any:
        """The active tool's settings block, or None without a tool."""
        tool = self.global_profiler.tool
        return self.global_profiler.global_tool_config[tool] if tool else None

    def step_selection(self) -> StepSelection:
        """The steps the active tool records, from ``steps`` or the tool's window."""
        return resolve_step_selection(self.global_profiler)


@dataclass(frozen=True)
class StepSelection:
    """A set of training steps: explicit ``steps``, an inclusive window, or every step."""

    steps: Optional[frozenset[int]] = None
    start: Optional[int] = None
    end: Optional[int] = None
    continuous: bool = False
    """Consecutive ``steps`` form one window (a step window always is one)."""

    def __contains__(self, step: int) -> bool:
        if self.steps is not None:
            return step in self.steps
        if self.start is not None and step < self.start:
            return False
        return self.end is None or step <= self.end

    @property
    def selects_all(self) -> bool:
        return self.steps is None and self.start is None and self.end is None

    def joins(self, step: int) -> bool:
        """Whether ``step`` continues the window of ``step - 1`` (both selected, in one window)."""
        return step in self and step - 1 in self and (self.steps is None or self.continuous)

    def last(self) -> Optional[int]:
        """The last selected step, or None when the selection is open-ended."""
        if self.steps is not None:
            return max(self.steps) if self.steps else None
        return self.end

    def windows(self) -> list[tuple[int, int]]:
        """The (first, last) step of each window of an explicit or closed selection (empty when open-ended)."""
        if self.steps is not None:
            runs: list[tuple[int, int]] = []
            for step in sorted(self.steps):
                if runs and self.joins(step) and step == runs[-1][1] + 1:
                    runs[-1] = (runs[-1][0], step)
                else:
                    runs.append((step, step))
            return runs
        if self.end is None:
            return []
        return [(self.start if self.start is not None else 0, self.end)]


# --------------------------------------------------------------------------------------------- loading


def _tool_registry() -> Any:
    from rlprof.tools import registry

    return registry


def _default_tool_settings() -> dict[str, Any]:
    return {spec.name: spec.config() for spec in _tool_registry().tool_specs()}


def load_config(cfg: Any = None, world_size: Optional[int] = None) -> ProfilerConfig:
    """Build a :class:`ProfilerConfig` from a mapping, DictConfig, YAML path/text or an existing ProfilerConfig.

    The whole input may be a trainer config: ``global_profiler`` is read from the top level and every nested
    ``profiler`` block declares a role. With ``world_size`` given, role ranks are checked against it.
    """
    if isinstance(cfg, ProfilerConfig):
        config = cfg
    else:
        tree = _to_container(cfg)
        if not isinstance(tree, Mapping):
            raise ConfigError(f"profiler config: expected a mapping, got {type(tree).__name__}")
        _check_top_level(tree)
        config = ProfilerConfig(
            global_profiler=_build_global(tree.get("global_profiler") or {}), roles=_find_roles(tree)
        )
    validate(config, world_size)
    return config


def _to_container(cfg: Any) -> Any:
    try:
        if cfg is None:
            return {}
        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
        if isinstance(cfg, os.PathLike):
            cfg = os.fspath(cfg)
        if isinstance(cfg, str):
            return OmegaConf.to_container(OmegaConf.create(_yaml_text(cfg)), resolve=True)
        if isinstance(cfg, Mapping):
            return OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"profiler config: cannot read it ({type(exc).__name__}: {_first_line(exc)})") from None
    raise ConfigError(f"profiler config: cannot read a {type(cfg).__name__}; pass a mapping, DictConfig or YAML path")


def _yaml_text(cfg: str) -> str:
    """The YAML text of ``cfg``: the file it names, or ``cfg`` itself when it is YAML text."""
    import yaml

    if "\n" not in cfg and os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as handle:
            text = handle.read()
        source = cfg
    elif "\n" not in cfg and (cfg.endswith((".yaml", ".yml")) or (os.sep in cfg and ":" not in cfg)):
        raise ConfigError(f"profiler config: {cfg!r} is not a file (give a YAML file path, YAML text or a mapping)")
    else:
        text, source = cfg, "the YAML text"
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"profiler config: {source} is not valid YAML ({_first_line(exc)})") from None
    if parsed is not None and not isinstance(parsed, Mapping):
        raise ConfigError(
            f"profiler config: {source} holds {type(parsed).__name__} {parsed!r}, not a mapping of settings"
        )
    return text


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _check_top_level(tree: Mapping[str, Any]) -> None:
    """A top-level key that is a near miss of ``global_profiler`` is a typo, not the user's own setting."""
    if "global_profiler" in tree:
        return
    for key in tree:
        if isinstance(key, str) and difflib.get_close_matches(key, ["global_profiler"], n=1, cutoff=0.8):
            raise ConfigError(f"{key}: unknown top-level key (did you mean 'global_profiler'?)")


def _build_global(data: Any) -> GlobalProfilerConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"global_profiler: expected a mapping, got {data!r}")
    tools = dict(data.get("global_tool_config") or {})
    names = _tool_registry().tool_names()
    settings = _default_tool_settings()
    for name, block in tools.items():
        if name not in names:
            raise ConfigError(
                unknown_key_message(f"global_profiler.global_tool_config.{name}", str(name), names)
                .replace("unknown key", "unknown tool")
                .replace("allowed keys", "registered tools")
            )
        settings[name] = build(type(settings[name]), block, f"global_profiler.global_tool_config.{name}")
    rest = {k: v for k, v in data.items() if k != "global_tool_config"}
    config = build(GlobalProfilerConfig, rest, "global_profiler")
    config.global_tool_config = ToolConfigs(settings)
    if config.tool is not None and config.tool not in names:
        raise ConfigError(
            f"global_profiler.tool: {config.tool!r} is not allowed; choose one of: null, {', '.join(names)}"
        )
    return config


def _find_roles(tree: Mapping[str, Any], path: str = "") -> dict[str, RoleProfilerConfig]:
    """Collect every ``<parent>.profiler`` block below ``tree`` as a role named after its parent key."""
    roles: dict[str, RoleProfilerConfig] = {}
    sources: dict[str, str] = {}
    for key, value in tree.items():
        key_path = f"{path}.{key}" if path else str(key)
        if not isinstance(value, Mapping) or key == "global_profiler":
            continue
        block = value.get("profiler")
        if block is not None:
            if not isinstance(block, Mapping):
                raise ConfigError(f"{key_path}.profiler: expected a mapping of role settings, got {block!r}")
            role = ROLE_ALIASES.get(str(key), str(key))
            if role in sources:
                raise ConfigError(
                    f"{key_path}.profiler: role {role!r} is already configured at {sources[role]}.profiler; "
                    "each role may have one profiler block"
                )
            roles[role] = build(RoleProfilerConfig, block, f"{key_path}.profiler")
            sources[role] = key_path
        for role, nested in _find_roles({k: v for k, v in value.items() if k != "profiler"}, key_path).items():
            if role in roles:
                raise ConfigError(f"{key_path}: role {role!r} has more than one profiler block")
            roles[role] = nested
    for role, source in sources.items():
        roles[role] = _apply_role_tool_config(roles[role], f"{source}.profiler", tree)
    return roles


def _apply_role_tool_config(block: RoleProfilerConfig, path: str, tree: Mapping[str, Any]) -> RoleProfilerConfig:
    """Honour verl's ``<role>.profiler.tool_config``: a setting the active tool lets a role set on its own (its spec's
    ``per_role``: ``nsys.discrete``, torch's ``discrete``, ``schedule`` and token window) sets the role's field of that
    name (another tool's is checked, not applied: verl's blocks list every tool's); settings equal to the global ones
    are accepted; anything else is refused, naming where the setting belongs."""
    if not block.tool_config:
        return block
    global_block = _build_global(tree.get("global_profiler") or {})
    registry = _tool_registry()
    names = registry.tool_names()
    own = ", ".join(f"{spec.name}.{key}" for spec in registry.tool_specs() for key in spec.per_role)
    role_fields = typing.get_type_hints(RoleProfilerConfig)
    role_field_specs = {f.name: f for f in dataclasses.fields(RoleProfilerConfig)}
    per_role: dict[str, Any] = {}
    for tool, settings in block.tool_config.items():
        if tool not in names:
            raise ConfigError(
                unknown_key_message(f"{path}.tool_config.{tool}", str(tool), names)
                .replace("unknown key", "unknown tool")
                .replace("allowed keys", "registered tools")
            )
        if settings is None:
            continue
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{path}.tool_config.{tool}: expected a mapping of {tool} settings, got {settings!r}")
        reference = global_block.global_tool_config[tool]
        known = {f.name for f in dataclasses.fields(reference)}
        for key, value in settings.items():
            key_path = f"{path}.tool_config.{tool}.{key}"
            if key not in known:
                raise ConfigError(unknown_key_message(key_path, str(key), sorted(known)))
            if key in registry.tool_spec(tool).per_role and key in role_fields:
                checked = check_bounds(role_field_specs[key], coerce(role_fields[key], value, key_path), key_path)
                if global_block.tool in (None, tool):  # another tool's (verl's blocks list each tool's) is not run
                    per_role[key] = checked
            elif value is not None and value != getattr(reference, key):
                raise ConfigError(
                    f"{key_path}: {value!r} differs from global_profiler.global_tool_config.{tool}.{key}="
                    f"{getattr(reference, key)!r}; rlprof runs one {tool} profiler per process, so set it there "
                    f"(per role, only {own or 'nothing'} can differ)"
                )
    return dataclasses.replace(block, **per_role)


# --------------------------------------------------------------------------------------------- validation


def resolve_step_selection(gp: GlobalProfilerConfig) -> StepSelection:
    """The active tool's steps: ``steps`` and the tool's window must agree when both are given."""
    window = gp.global_tool_config[gp.tool] if gp.tool else None
    start = getattr(window, "step_start", None)
    end = getattr(window, "step_end", None)
    if gp.steps is None:
        return StepSelection(start=start, end=end)
    steps = frozenset(gp.steps)
    if start is not None or end is not None:
        in_window = StepSelection(start=start, end=end)
        outside = sorted(s for s in steps if s not in in_window)
        if outside or end is None or steps != frozenset(range(start if start is not None else min(steps), end + 1)):
            raise ConfigError(
                f"global_profiler.steps={sorted(steps)} conflicts with global_profiler.global_tool_config."
                f"{gp.tool}.step_start={start}, step_end={end}; give either the list of steps or the window"
            )
        return StepSelection(steps=steps, continuous=True)  # the steps spell out the window: one window
    return StepSelection(steps=steps, continuous=gp.profile_continuous_steps)


def validate(config: ProfilerConfig, world_size: Optional[int] = None) -> None:
    """Check what the schema cannot: step values, windows and ranks. Raises :class:`ConfigError`."""
    gp = config.global_profiler
    if gp.tool is not None and gp.steps == []:
        warnings.warn(
            f"global_profiler.steps=[] selects no step: {gp.tool} records nothing (list the steps, or null for the "
            "tool's own step_start/step_end window)",
            RuntimeWarning,
            stacklevel=2,
        )
    for i, step in enumerate(gp.steps or []):
        if step < 0:
            raise ConfigError(f"global_profiler.steps[{i}]: step {step} is negative; steps are integers >= 0")
    for tool, settings in gp.global_tool_config.items():
        prefix = f"global_profiler.global_tool_config.{tool}"
        start, end = getattr(settings, "step_start", None), getattr(settings, "step_end", None)
        for key, value in (("step_start", start), ("step_end", end)):
            if value is not None and value < 0:
                raise ConfigError(f"{prefix}.{key}: step {value} is negative; steps are integers >= 0")
        if start is not None and end is not None and end < start:
            raise ConfigError(
                f"{prefix}.step_end: {end} is before step_start={start}; "
                "the window is inclusive and needs step_end >= step_start"
            )
    if not gp.save_path:
        raise ConfigError("global_profiler.save_path: must be a non-empty folder path")
    if gp.finish_hook_cmd is not None and not gp.finish_hook_cmd.strip():
        raise ConfigError("global_profiler.finish_hook_cmd: '' is an empty command; give a shell command, or null")
    for i, rank in enumerate(gp.finish_hook_ranks):
        if rank < 0:
            raise ConfigError(
                f"global_profiler.finish_hook_ranks[{i}]: rank {rank} is negative; ranks are integers >= 0"
            )
    resolve_step_selection(gp)
    for name, role in config.roles.items():
        for i, rank in enumerate(role.ranks):
            if rank < 0:
                raise ConfigError(f"{name}.profiler.ranks[{i}]: rank {rank} is negative; ranks are integers >= 0")
            if world_size is not None and rank >= world_size:  # a script moved to fewer GPUs: verl records nothing
                warnings.warn(
                    f"{name}.profiler.ranks[{i}]: rank {rank} is outside the world (world_size={world_size}, ranks "
                    f"0..{world_size - 1}): nothing is recorded for it",
                    RuntimeWarning,
                    stacklevel=2,
                )
    spec = _tool_registry().tool_spec(gp.tool) if gp.tool else None
    problems = spec.check(config.tool_settings(), config.roles) if spec is not None and spec.check else []
    if problems:
        raise ConfigError("; ".join(problems))
