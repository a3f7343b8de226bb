"""The interface every recording tool implements, and what the session hands it."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rlprof.config import ProfilerConfig
from rlprof.manifest import Manifest


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows about the run it records."""

    config: ProfilerConfig
    rank: int
    world_size: int
    manifest: Manifest

    @property
    def save_path(self) -> Path:
        return self.manifest.save_path

    def window_name(self, first_step: int, last_step: int) -> str:
        """``step{S}`` or ``step{S}-{E}``: the folder of one step window's files."""
        return f"step{first_step}" if first_step == last_step else f"step{first_step}-{last_step}"


class RangeSite:
    """One annotated place in the code (a decorated function or a ``profile_range`` name).

    Tools cache what they pre-build for a site (NVTX attributes, a label) in ``tool_data``, tagged with the tool
    that built it, so the hot path does no lookups.
    """

    __slots__ = ("role", "name", "color", "label", "tool_owner", "tool_data")

    def __init__(self, role: str, name: str, color: Optional[str | int] = None) -> None:
        self.role = role
        self.name = name
        self.color = color
        self.label = f"{role}/{name}"
        self.tool_owner: Any = None
        self.tool_data: Any = None

    def cached(self, tool: Any, build: Callable[["RangeSite"], Any]) -> Any:
        """``tool``'s data for this site, built once by ``build(site)``."""
        if self.tool_owner is not tool:
            self.tool_data = build(self)
            self.tool_owner = tool
        return self.tool_data

    def __repr__(self) -> str:
        return f"RangeSite({self.label!r})"


class Tool(ABC):
    """A recorder driven by the session.

    The session calls ``start_window(step)`` when a selected step begins a window, ``advance(step)`` for each
    further step inside it, and ``stop_window()`` when the window ends (or at shutdown). Ranges of enabled roles
    call ``enter_range(site)`` only while a window is open; it opens the range and returns the no-argument callable
    that closes it (a bound C method where possible: this is the hot path). Any exception a tool raises makes the
    session warn once and turn the tool off: a tool never breaks the user's program.
    """

    name = "none"

    def __init__(self, context: ToolContext) -> None:
        self.context = context
        self.window_first: Optional[int] = None
        self.window_last: Optional[int] = None

    def start_window(self, step: int) -> None:
        self.window_first = self.window_last = step

    def advance(self, step: int) -> None:
        self.window_last = step

    def stop_window(self) -> None:
        self.window_first = self.window_last = None

    @abstractmethod
    def enter_range(self, site: RangeSite) -> Callable[[], Any]:
        """Open a range for ``site`` and return the callable that closes it."""

    def close(self) -> None:
        """Release what the tool holds; the session stops an open window first."""

    # helpers for tools that write files

    def window_dir(self) -> Path:
        assert self.window_first is not None and self.window_last is not None, "no open window"
        return self.context.save_path / self.name / self.context.window_name(self.window_first, self.window_last)

    def window_steps(self) -> list[int]:
        assert self.window_first is not None and self.window_last is not None, "no open window"
        return list(range(self.window_first, self.window_last + 1))

    def publish(self, tmp_path: Path, final_path: Path, role: Optional[str] = None) -> Path:
        """Move a finished file into place (never over another process's file) and list it in the manifest."""
        if final_path.exists():
            final_path = final_path.with_name(f"{final_path.name.split('.')[0]}.pid{os.getpid()}.{final_path.name.split('.', 1)[1]}")
        os.replace(tmp_path, final_path)
        self.context.manifest.record(
            self.name, final_path, steps=self.window_steps(), rank=self.context.rank, role=role
        )
        return final_path
