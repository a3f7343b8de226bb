"""The profiler's configuration: a typed schema, its loader and its validation.

The schema follows verl's layout so that verl YAML loads unchanged::

    global_profiler:                # one block: which tool, which steps, where to write
      tool: torch                   # null | nsys | torch | torch_memory
      steps: [2, 3]                 # or a window in the tool's block (step_start/step_end)
      save_path: ./outputs/profile
      global_tool_config:
        torch: {step_start: 100, step_end: 200, contents: [cpu, shapes]}
    actor_rollout_ref:
      actor:
        profiler: {enable: true, all_ranks: false, ranks: [0]}   # one block per role

Any mapping key named ``profiler`` (other than ``global_profiler``) anywhere in the config declares a role
named after its parent key (``reward_model`` is read as ``reward``). Loading fails with :class:`ConfigError`
before any work starts, naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

ToolName = Literal["nsys", "torch", "torch_memory"]
TOOL_NAMES: tuple[str, ...] = typing.get_args(ToolName)
TorchContent = Literal["cpu", "cuda", "shapes", "stack", "memory", "flops", "modules"]
ROLE_ALIASES = {"reward_model": "reward"}


class ConfigError(ValueError):
    """A profiler configuration that cannot be used; the message names the key, the value and what is allowed."""


@dataclass
class NsysToolConfig:
    """Nsight Systems: NVTX ranges (domain ``rlprof``, category = role) plus cudaProfilerApi capture on GPU."""

    discrete: bool = False
    """True: bracket each range with its own capture (one report per task); False: one capture per step window."""
    step_start: Optional[int] = None
    """First profiled step of a contiguous window (inclusive); an alternative to ``global_profiler.steps``."""
    step_end: Optional[int] = None
    """Last profiled step of the window (inclusive); null means open-ended."""


@dataclass
class TorchToolConfig:
    """torch.profiler over each step window, one gzipped Chrome trace per window per rank."""

    step_start: Optional[int] = None
    """First profiled step of a contiguous window (inclusive); an alternative to ``global_profiler.steps``."""
    step_end: Optional[int] = None
    """Last profiled step of the window (inclusive); null means open-ended."""
    contents: list[TorchContent] = field(default_factory=list)
    """Extra detail: cpu, cuda (activities; both default to on where available), shapes, stack, memory, flops, modules."""
    discrete: bool = False
    """Accepted for verl compatibility; the torch tool always writes one trace per window per process."""


@dataclass
class TorchMemoryToolConfig:
    """CUDA caching-allocator history over each step window, one snapshot pickle per window per rank."""

    trace_alloc_max_entries: int = 100_000
    """Most alloc/free events kept in the ring buffer (older ones are overwritten)."""
    stack_depth: int = 32
    """Frames kept per recorded allocation stack in the written snapshot."""
    step_start: Optional[int] = None
    """First recorded step of a contiguous window (inclusive); an alternative to ``global_profiler.steps``."""
    step_end: Optional[int] = None
    """Last recorded step of the window (inclusive); null means open-ended."""
    oom_snapshot: bool = True
    """Write ``oom_rank{R}_*.pickle`` when CUDA runs out of memory while recording (once per window)."""


@dataclass
class ToolConfigs:
    """Per-tool settings; only the block of the active tool is used."""

    nsys: NsysToolConfig = field(default_factory=NsysToolConfig)
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)


@dataclass
class GlobalProfilerConfig:
    """The run-wide choice of tool, steps and output folder."""

    tool: Optional[ToolName] = None
    """Which tool records: null (none), nsys, torch or torch_memory."""
    steps: Optional[list[int]] = None
    """Training steps to record; contiguous runs form one window each. null: use the tool's step window, or all steps."""
    save_path: str = "outputs/profile"
    """Folder for traces, snapshots and manifest.jsonl."""
    global_tool_config: ToolConfigs = field(default_factory=ToolConfigs)
    """Settings of each tool."""


@dataclass
class RoleProfilerConfig:
    """Which ranks profile one role (actor, critic, ref, rollout, reward or a user-named role)."""

    enable: bool = True
    """False turns every range of this role off."""
    all_ranks: bool = False
    """True: profile this role on every rank (``ranks`` is then ignored)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that profile this role when ``all_ranks`` is false."""
    discrete: Optional[bool] = None
    """nsys only: overrides ``global_tool_config.nsys.discrete`` for this role's ranges."""
    tool_config: Optional[dict[str, Any]] = None
    """Accepted for verl compatibility (its per-worker tool settings); rlprof takes tool settings from global_tool_config."""


@dataclass
class ProfilerConfig:
    """Everything the profiler session needs: the global block and the role blocks found in the config."""

    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    roles: dict[str, RoleProfilerConfig] = field(default_factory=dict)

    def role(self, name: str) -> RoleProfilerConfig:
        """The block of role ``name``; a role without a block gets the defaults (enabled on rank 0)."""
        return self.roles.get(name) or RoleProfilerConfig()

    def step_selection(self) -> "StepSelection":
        """The steps the active tool records, from ``steps`` or the tool's window."""
        return resolve_step_selection(self.global_profiler)


@dataclass(frozen=True)
class StepSelection:
    """A set of training steps: explicit ``steps``, an inclusive window, or every step."""

    steps: Optional[frozenset[int]] = None
    start: Optional[int] = None
    end: Optional[int] = None

    def __contains__(self, step: int) -> bool:
        if self.steps is not None:
            return step in self.steps
        if self.start is not None and step < self.start:
            return False
        return self.end is None or step <= self.end

    @property
    def selects_all(self) -> bool:
        return self.steps is None and self.start is None and self.end is None


# --------------------------------------------------------------------------------------------- loading


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
        config = ProfilerConfig(
            global_profiler=_build(GlobalProfilerConfig, tree.get("global_profiler") or {}, "global_profiler"),
            roles=_find_roles(tree),
        )
    validate(config, world_size)
    return config


def _to_container(cfg: Any) -> Any:
    if cfg is None:
        return {}
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, str):
        text = cfg
        if "\n" not in cfg and cfg.endswith((".yaml", ".yml")):
            with open(cfg, encoding="utf-8") as handle:
                text = handle.read()
        return OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    if isinstance(cfg, Mapping):
        return OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)
    raise ConfigError(f"profiler config: cannot read a {type(cfg).__name__}; pass a mapping, DictConfig or YAML path")


def _find_roles(tree: Mapping, path: str = "") -> dict[str, RoleProfilerConfig]:
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
            roles[role] = _build(RoleProfilerConfig, block, f"{key_path}.profiler")
            sources[role] = key_path
        for role, nested in _find_roles({k: v for k, v in value.items() if k != "profiler"}, key_path).items():
            if role in roles:
                raise ConfigError(f"{key_path}: role {role!r} has more than one profiler block")
            roles[role] = nested
    return roles


def _build(schema: type, data: Any, path: str) -> Any:
    """Instantiate dataclass ``schema`` from ``data``, checking keys and value types with path-naming errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with keys {_field_names(schema)}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}.{key}: unknown key{hint}; allowed keys: {_field_names(schema)}")
        kwargs[key] = _coerce(hints[key], value, f"{path}.{key}")
    return schema(**kwargs)


def _field_names(schema: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(schema))


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, path)
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(map(str, args))
            raise ConfigError(f"{path}: {value!r} is not allowed; choose one of: {allowed}")
        return value
    if origin is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict or hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: schema type {hint!r} is not supported by the loader")


# --------------------------------------------------------------------------------------------- validation


def resolve_step_selection(gp: GlobalProfilerConfig) -> StepSelection:
    """The active tool's steps: ``steps`` and the tool's window must agree when both are given."""
    window = getattr(gp.global_tool_config, gp.tool) if gp.tool else None
    start = window.step_start if window is not None else None
    end = window.step_end if window is not None else None
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
    return StepSelection(steps=steps)


def validate(config: ProfilerConfig, world_size: Optional[int] = None) -> None:
    """Check what the schema cannot: step values, windows and ranks. Raises :class:`ConfigError`."""
    gp = config.global_profiler
    for i, step in enumerate(gp.steps or []):
        if step < 0:
            raise ConfigError(f"global_profiler.steps[{i}]: step {step} is negative; steps are integers >= 0")
    for tool in TOOL_NAMES:
        window = getattr(gp.global_tool_config, tool)
        prefix = f"global_profiler.global_tool_config.{tool}"
        for key in ("step_start", "step_end"):
            value = getattr(window, key)
            if value is not None and value < 0:
                raise ConfigError(f"{prefix}.{key}: step {value} is negative; steps are integers >= 0")
        if window.step_start is not None and window.step_end is not None and window.step_end < window.step_start:
            raise ConfigError(
                f"{prefix}.step_end: {window.step_end} is before step_start={window.step_start}; "
                "the window is inclusive and needs step_end >= step_start"
            )
    memory = gp.global_tool_config.torch_memory
    if memory.trace_alloc_max_entries <= 0:
        raise ConfigError(
            f"global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries: "
            f"{memory.trace_alloc_max_entries} must be a positive integer"
        )
    if memory.stack_depth <= 0:
        raise ConfigError(
            f"global_profiler.global_tool_config.torch_memory.stack_depth: {memory.stack_depth} must be a positive integer"
        )
    if not gp.save_path:
        raise ConfigError("global_profiler.save_path: must be a non-empty folder path")
    resolve_step_selection(gp)
    for name, role in config.roles.items():
        for i, rank in enumerate(role.ranks):
            if rank < 0 or (world_size is not None and rank >= world_size):
                allowed = f"0..{world_size - 1}" if world_size is not None else "integers >= 0"
                raise ConfigError(
                    f"{name}.profiler.ranks[{i}]: rank {rank} is outside the world "
                    f"(world_size={world_size}); allowed: {allowed}"
                )
