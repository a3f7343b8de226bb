"""verl's ``global_profiler.finish_hook_cmd``: a shell command of the user's, run once after the last profiled step,
typically to ship the traces off the node (``mlx asset upload "$VERL_PROFILE_SAVE_PATH"``).

It runs on the ranks ``finish_hook_all_ranks`` / ``finish_hook_ranks`` select (default: the ranks that record),
whether or not they recorded, once the step that ends the selection is over and its window's files are written (with
an open-ended selection: when the session shuts down; a run that stops before that step does not run it, as verl).
Its environment holds the run's context, as verl gives it: ``VERL_PROFILE_SAVE_PATH`` (absolute),
``VERL_PROFILE_TOOL``, ``VERL_PROFILE_RANK``, ``VERL_PROFILE_PID`` and, when the config declares role blocks,
``VERL_PROFILE_ROLE`` (the roles this rank records, comma-separated: one process runs every role here; verl's
Ray-only ``VERL_PROFILE_RAY_NSIGHT_DIR`` is not set). Its output is printed line by line with the rank in front; a
failure is a warning and training goes on; a Ctrl-C while it runs stops it too. The manifest lists it as a
``finish_hook`` line with its exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

PREFIX = "[rlprof][finish_hook]"


def hook_environment(save_path: str, tool: Optional[str], rank: int, roles: Optional[list[str]]) -> dict[str, str]:
    """The ``VERL_PROFILE_*`` variables the command sees."""
    env = {
        "VERL_PROFILE_SAVE_PATH": str(Path(save_path).resolve()),
        "VERL_PROFILE_TOOL": tool or "",
        "VERL_PROFILE_RANK": str(rank),
        "VERL_PROFILE_PID": str(os.getpid()),
    }
    if roles is not None:
        env["VERL_PROFILE_ROLE"] = ",".join(roles)
    return env


def run_finish_hook(command: str, rank: int, variables: Mapping[str, str]) -> int:
    """Run ``command`` in ``/bin/sh`` with ``variables`` added to this process's environment, its merged output
    printed to stderr prefixed with the rank; its exit code (127: it could not start)."""
    say = f"{PREFIX} rank {rank}:"
    print(f"{say} running: {command}", file=sys.stderr, flush=True)
    try:
        process = subprocess.Popen(
            ["/bin/sh", "-c", command],
            env={**os.environ, **variables},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        print(f"{say} could not start: {exc}", file=sys.stderr, flush=True)
        return 127
    try:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"{say} {line.rstrip()}", file=sys.stderr, flush=True)
        code = process.wait()
    except BaseException:  # Ctrl-C or a hang-up while it runs: it stops with us
        process.kill()
        process.wait()
        raise
    print(f"{say} exited with {code}", file=sys.stderr, flush=True)
    return code
