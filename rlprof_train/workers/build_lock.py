"""Locks of torch's JIT-built extensions that no process holds: a start killed while building leaves one, and every
later start then waits on it forever, silently.

torch builds an extension (DeepSpeed's shared-memory op on CPU, its fused optimizers on GPU) under a lock file,
``<extensions root>/[pyXY_cpu/]<name>/lock``, created with ``O_EXCL`` and held open until the build ends; every
start takes it, if only for the second ninja needs to see nothing changed. A process killed in that second (SIGKILL,
SIGTERM, a trial tune stopped, a launcher ending its ranks) never removes it, and torch's ``FileBaton.wait`` then
polls for it with no end and no word. Here, before DeepSpeed starts, such a lock is named in one warning with what to
do. It is not removed: the extensions folder is often in a home directory shared by several machines, where a build
running on another machine holds the lock without any process here having it open.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path


def extensions_root() -> Path:
    """Where torch builds JIT extensions: ``$TORCH_EXTENSIONS_DIR``, else its default under the user's cache."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def unheld_locks(root: Path) -> list[Path]:
    """The build locks under ``root`` that no process on this machine has open (none where ``/proc`` cannot tell:
    not Linux). Another user's processes, whose descriptors are hidden, are taken not to hold one: a lock is made by
    a build run by the user whose cache holds it."""
    locks = sorted([*root.glob("*/lock"), *root.glob("*/*/lock")])
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    identities = {identity: lock for lock in locks if (identity := _identity(lock)) is not None}
    for process in Path("/proc").iterdir():
        if not identities:
            break
        if not process.name.isdigit():
            continue
        try:
            descriptors = list((process / "fd").iterdir())
        except OSError:  # ended meanwhile, or another user's
            continue
        for descriptor in descriptors:
            held = _identity(descriptor)
            if held is not None:
                identities.pop(held, None)
    return sorted(lock for identity, lock in identities.items() if _identity(lock) == identity)  # not released since


def _identity(path: Path) -> tuple[int, int] | None:
    """The file ``path`` is (device, inode), following a link; None when it is gone."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def warn_about_unheld_locks(root: Path | None = None) -> list[Path]:
    """Warn about each build lock nobody here holds, before a start waits on it; returns them."""
    stale = unheld_locks(extensions_root() if root is None else root)
    for lock in stale:
        with contextlib.suppress(OSError):  # removed meanwhile: nothing to say
            minutes = (time.time() - lock.stat().st_mtime) / 60
            warnings.warn(
                f"{lock} (made {minutes:.0f} min ago) is a build lock of torch's JIT extensions that no process on "
                "this machine holds: a start killed while building leaves it, and this start will wait on it "
                "forever. Remove it, unless a run on another machine sharing this folder is building that extension",
                RuntimeWarning,
                stacklevel=2,
            )
    return stale
