"""The interface every recording tool implements, and what the session hands it."""

from __future__ import annotations

import os
import re
import socket
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from rlprof.manifest import Manifest, place
from rlprof.roles import RoleBlocks
from rlprof.window import StepWindow

_HOST = socket.gethostname().replace(".", "_")
_TEMP = re.compile(r"^\..+\.(?P<host>[^.]+)-(?P<pid>\d+)\.tmp(\.tmp)?$")  # kineto adds its own .tmp while writing


def remove_abandoned(save_path: Path) -> tuple[int, int]:
    """Delete the temporary files under ``save_path`` that processes of this host which no longer run left (a kill
    during an export); returns (files, bytes). Other hosts' files are theirs to judge."""
    import psutil

    files = size = 0
    if not save_path.is_dir():
        return 0, 0
    for path in save_path.rglob(".*.tmp"):
        match = _TEMP.match(path.name)
        if match is None or match["host"] != _HOST or psutil.pid_exists(int(match["pid"])) or path.is_symlink():
            continue
        try:
            bytes_ = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        files, size = files + 1, size + bytes_
    return files, size


RangeOps = tuple[Callable[[], Any], Callable[[], Any]]
"""``(enter, exit)``: zero-argument callables that open and close one range of a site."""


@dataclass
class StepWindowSettings:
    """Settings shared by tools that record step windows (a base for a tool's settings dataclass)."""

    step_start: Optional[int] = None
    """First recorded step of a contiguous window (inclusive); an alternative to ``global_profiler.steps``."""
    step_end: Optional[int] = None
    """Last recorded step of the window (inclusive); null means open-ended."""


@dataclass
class NoSettings:
    """A tool without settings of its own."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows about the run it records, and how it publishes its files."""

    roles: RoleBlocks
    """The config's role blocks (:mod:`rlprof.roles`): per-role settings such as nsys's ``discrete``."""
    settings: Any
    """This tool's block of ``global_profiler.global_tool_config``."""
    rank: int
    world_size: int
    manifest: Manifest
    warn: Callable[[str, str], None] = field(default=lambda key, message: None)
    """``warn(key, message)``: one warning per key for this session."""
    published: Callable[[Path, Optional[str], StepWindow, Optional[str]], None] = field(
        default=lambda path, format, window, role: None
    )
    """``published(path, format, window, role)``: called by :meth:`publish` for each file once it is in place (the
    session tells its window listeners, :meth:`rlprof.window.WindowListener.output_written`)."""

    @property
    def save_path(self) -> Path:
        return self.manifest.save_path

    def window_dir(self, tool: str, window: StepWindow) -> Path:
        """``{save_path}/{tool}/{window.name}``, created."""
        folder = self.save_path / tool / window.name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def temp_path(self, final: Path) -> Path:
        """A hidden temporary name beside ``final`` for this process (moved into place by :meth:`publish`); the
        host and pid in it let a later session remove what a killed process left (:func:`remove_abandoned`)."""
        return final.with_name(f".{final.name}.{_HOST}-{os.getpid()}.tmp")

    def publish(
        self,
        tool: str,
        tmp: Path,
        final: Path,
        window: StepWindow,
        role: Optional[str] = None,
        *,
        format: Optional[str] = None,
        **extra: Any,
    ) -> Path:
        """Move a finished file into place (never over an existing file: see :mod:`rlprof.manifest`) and list it
        in the manifest with its ``format`` (the name of the source that reads it, see
        :mod:`rlprof.analysis.sources`: ``chrome_trace``, ``cuda_snapshot``, ...); returns its final path."""
        placed = place(tmp, final)
        self.manifest.record(
            tool, placed, steps=window.steps, rank=self.rank, role=role, window=window.index, format=format, **extra
        )
        self.published(placed, format, window, role)
        return placed


class RangeSite:
    """One annotated place in the code (a decorated function or a ``profile_range`` name).

    ``ops`` holds the active tool's ``(enter, exit)`` for this site while its role's gate is open: the session binds
    it (:meth:`Tool.range_ops`, built once per tool) before opening the gate, so the hot path does no lookups.
    """

    __slots__ = ("bound_to", "color", "label", "name", "ops", "role")

    def __init__(self, role: str, name: str, color: Optional[str | int] = None) -> None:
        self.role = role
        self.name = name
        self.color = color
        self.label = f"{role}/{name}"
        self.ops: Optional[RangeOps] = None
        self.bound_to: Any = None

    def bind(self, tool: Tool) -> None:
        """Make ``ops`` the ranges of ``tool`` (built once per tool)."""
        if self.bound_to is not tool:
            self.ops = tool.range_ops(self)
            self.bound_to = tool

    def __repr__(self) -> str:
        return f"RangeSite({self.label!r})"


_DECORATED: weakref.WeakKeyDictionary[Callable[..., Any], RangeSite] = weakref.WeakKeyDictionary()


def remember_decorated(function: Callable[..., Any], site: RangeSite) -> None:
    """Record that ``function`` is decorated with ``site`` (``@rlprof.profiled``), for tools that name memory by
    the role of the object holding it."""
    _DECORATED[function] = site


def decorated_sites() -> list[tuple[Callable[..., Any], RangeSite]]:
    """``(function, site)`` of every live function decorated by ``@rlprof.profiled``."""
    return list(_DECORATED.items())


class Tool(ABC):
    """A recorder driven by the session.

    The session calls ``start_window(window)`` when a selected step begins a window, ``advance(window)`` when a
    further step joins it (``window.last`` is that step) and ``stop_window(window)`` when it ends (or at shutdown).
    While a window is open, ranges of enabled roles call the ``(enter, exit)`` pair that :meth:`range_ops` built for
    their site: zero-argument callables, C functions where possible (this is the hot path). Any exception a tool
    raises makes the session warn once and turn the tool off: a tool never breaks the user's program.

    Register a tool with :func:`rlprof.register_tool`; its ``name`` is set from the registration.
    """

    name: ClassVar[str] = "tool"

    def __init__(self, context: ToolContext) -> None:
        self.context = context

    def start_window(self, window: StepWindow) -> None:
        """A window opens at ``window.first``."""

    def advance(self, window: StepWindow) -> None:
        """Step ``window.last`` joins the open window."""

    def stop_window(self, window: StepWindow) -> None:
        """The window ends: write its files (``context.publish``)."""

    def mini_batch_done(self, role: str) -> None:
        """A mini-batch of ``role``'s update ended (:func:`rlprof.mini_batch`) inside the open window."""

    @abstractmethod
    def range_ops(self, site: RangeSite) -> RangeOps:
        """``(enter, exit)`` for ranges of ``site``; called once per site per tool."""

    def close(self) -> None:
        """Release what the tool holds; the session stops an open window first."""
