"""The world a launcher started this process in, from the variables torchrun and the deepspeed launcher set."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from rlprof.typed_config import ConfigError

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
START = (
    "start the trainer with torchrun or the deepspeed launcher (they set RANK, WORLD_SIZE, LOCAL_RANK, "
    "MASTER_ADDR, MASTER_PORT), or unset them all for one process"
)


LOCAL_RANK_ALIASES = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
"""Where launchers other than torchrun put a process's rank on its node (Slurm's srun, Open MPI, MPICH, PMI)."""


@dataclass(frozen=True)
class LaunchWorld:
    world_size: int
    """Processes in the job (1 without a launcher)."""
    per_node: int
    """Processes on this node (``LOCAL_WORLD_SIZE``, else the world)."""
    local_rank: int = 0
    """This process's rank on its node: ``LOCAL_RANK``, else what another launcher set (:data:`LOCAL_RANK_ALIASES`),
    else 0 in a world of one."""

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
    if "RANK" in values and not 0 <= values["RANK"] < world:
        raise ConfigError(f"RANK={values['RANK']}: outside the world (0..{world - 1}); {START}")
    local_rank = _local_rank(values, environ, world)
    if not 0 <= local_rank < per_node:
        raise ConfigError(f"LOCAL_RANK={local_rank}: outside the world (0..{per_node - 1}); {START}")
    return LaunchWorld(world, per_node, local_rank)


def _local_rank(values: dict[str, int], environ: Mapping[str, str], world: int) -> int:
    """``LOCAL_RANK``; launched without it (a hand-written launcher, some Slurm scripts), the rank on the node that
    the launcher set under another name, or 0 in a world of one; else a :class:`ConfigError` in one line."""
    if "LOCAL_RANK" in values or "RANK" not in values:
        return values.get("LOCAL_RANK", 0)
    for name in LOCAL_RANK_ALIASES:
        raw = environ.get(name, "")
        if raw.strip().isdigit():
            return int(raw)
    if world == 1:
        return 0
    raise ConfigError(
        f"LOCAL_RANK is not set (RANK={values['RANK']} of WORLD_SIZE={world}), nor any of "
        f"{', '.join(LOCAL_RANK_ALIASES)}: each process needs its rank on its node; launch with torchrun or the "
        "deepspeed launcher (they set it), or set LOCAL_RANK yourself"
    )


def settle_local_rank(world: LaunchWorld, environ: MutableMapping[str, str] = os.environ) -> None:
    """Put :attr:`LaunchWorld.local_rank` in ``LOCAL_RANK`` where the launcher left it out: DeepSpeed and torch read
    it there (DeepSpeed, missing it, looks for MPI)."""
    if "RANK" in environ and "LOCAL_RANK" not in environ:
        environ["LOCAL_RANK"] = str(world.local_rank)
