"""The world a launcher started this process in, from the variables torchrun and the deepspeed launcher set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rlprof.schema import ConfigError

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
START = (
    "start the trainer with torchrun or the deepspeed launcher (they set RANK, WORLD_SIZE, LOCAL_RANK, "
    "MASTER_ADDR, MASTER_PORT), or unset them all for one process"
)


@dataclass(frozen=True)
class LaunchWorld:
    world_size: int
    """Processes in the job (1 without a launcher)."""
    per_node: int
    """Processes on this node (``LOCAL_WORLD_SIZE``, else the world)."""

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.per_node)


def launch_world(environ: Mapping[str, str] = os.environ) -> LaunchWorld:
    """The launcher's world, or a :class:`ConfigError` in one line naming the variable, its value and what is
    needed: a value that is not a whole number, ``WORLD_SIZE`` below 1, a rank outside the world, or ``RANK``
    without ``WORLD_SIZE`` (DeepSpeed would then look for MPI)."""
    values: dict[str, int] = {}
    for name in VARIABLES:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: not a whole number; {START}") from None
    if "RANK" in values and "WORLD_SIZE" not in values:
        raise ConfigError(f"RANK={values['RANK']} is set but WORLD_SIZE is not; {START}")
    world = values.get("WORLD_SIZE", 1)
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={world}: a world needs at least 1 process; {START}")
    per_node = values.get("LOCAL_WORLD_SIZE", world)
    if not 1 <= per_node <= world:
        raise ConfigError(f"LOCAL_WORLD_SIZE={per_node}: must be 1..WORLD_SIZE ({world}); {START}")
    for name, limit in (("RANK", world), ("LOCAL_RANK", per_node)):
        if name in values and not 0 <= values[name] < limit:
            raise ConfigError(f"{name}={values[name]}: outside the world (0..{limit - 1}); {START}")
    return LaunchWorld(world, per_node)
