"""Roles: which ranges record where. A role's block (``<role>.profiler`` in the config) and the rules that decide
which block governs a role.

With no role blocks, every role records on rank 0. With role blocks, exactly the roles they govern record, each on
its ``ranks`` (or every rank with ``all_ranks``). As in verl's colocated actor-rollout-ref worker, ``rollout`` and
``ref`` follow the ``actor`` block unless they declare their own; ``tool`` (the tool calls of a multi-turn rollout)
follows ``rollout``'s; ``reward_model.profiler`` is role ``reward``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from rlprof.mini_batches import MiniBatchSchedule
from rlprof.typed_config import bounds

ROLE_ALIASES = {"reward_model": "reward"}
"""Config keys whose ``profiler`` block names another role."""
ROLE_PARENTS = {"rollout": "actor", "ref": "actor", "tool": "rollout"}
"""Roles that follow another role's block unless they declare their own (verl's actor-rollout-ref worker; a
multi-turn rollout's tool calls)."""


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
    """Overrides the tool's ``discrete`` for this role's ranges (nsys: per role; torch: one value per process);
    null: the global one."""
    schedule: Optional[MiniBatchSchedule] = None
    """torch: which of this role's update mini-batches the window's trace keeps (:mod:`rlprof.mini_batches`);
    null: the global one."""
    profile_token_start: Optional[int] = field(default=None, metadata=bounds(ge=0))
    """An inference engine's own profiler (vLLM's, beside the torch tool): the first response token it records."""
    profile_token_end: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """... and the token it stops before (exclusive); null: to the end."""
    tool_config: Optional[dict[str, Any]] = None
    """verl's per-worker tool settings. Honoured: those the tool lets a role set on its own (its ``per_role``:
    ``nsys.discrete``; ``torch.discrete``, ``schedule``, ``profile_token_start``/``_end``), as the fields above; a
    setting equal to the global one is accepted; any other is refused (one tool per process, ``global_tool_config``)."""


RoleBlocks = Mapping[str, RoleProfilerConfig]
"""The role blocks a config declares, by role name."""


def governing_block(blocks: RoleBlocks, name: str) -> Optional[RoleProfilerConfig]:
    """The block that governs role ``name``: its own, else the nearest ancestor's (tool -> rollout -> actor,
    ref -> actor), else None."""
    block = blocks.get(name)
    while block is None and name in ROLE_PARENTS:
        name = ROLE_PARENTS[name]
        block = blocks.get(name)
    return block


def role_setting(blocks: RoleBlocks, name: str, key: str, settings: Any) -> Any:
    """A tool setting ``key`` for role ``name``: its governing block's where that sets it (not None), else the tool's
    global ``settings``' value."""
    block = governing_block(blocks, name)
    value = getattr(block, key) if block is not None else None
    return getattr(settings, key) if value is None else value


def role_enabled(blocks: RoleBlocks, name: str, rank: int) -> bool:
    """Whether ``name``'s ranges record on ``rank`` (see the module doc)."""
    if not blocks:
        return rank == 0
    block = governing_block(blocks, name)
    return block is not None and block.enable and (block.all_ranks or rank in block.ranks)


def records_on(blocks: RoleBlocks, rank: int) -> bool:
    """Whether any role records on ``rank`` (else that rank starts no tool and writes nothing)."""
    if not blocks:
        return rank == 0
    return any(role_enabled(blocks, name, rank) for name in blocks)
