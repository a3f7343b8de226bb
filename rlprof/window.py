"""A step window: the run of consecutive selected training steps that one recording covers.

The session owns the current window (:attr:`rlprof.Session.window`); tools receive it at ``start_window``,
``advance`` and ``stop_window`` and name their output folders after it. A window spans from the start of its first
step to the end of its last step: what runs between two of its steps (validation, checkpointing, logging) is
recorded too, inside a range ``step/between_steps``, so it is visible as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class StepWindow:
    """One window: its steps run from ``first`` to ``last`` (inclusive); ``index`` counts the session's windows
    from 1, so a step number seen twice (a restarted loop) still makes a window of its own."""

    index: int
    first: int
    last: int

    @property
    def steps(self) -> list[int]:
        return list(range(self.first, self.last + 1))

    @property
    def name(self) -> str:
        """``step{S}`` or ``step{S}-{E}``: the folder of the window's files."""
        return f"step{self.first}" if self.first == self.last else f"step{self.first}-{self.last}"


class WindowListener:
    """Code that follows the session's windows (e.g. an engine's own profiler). Override what you need."""

    def window_started(self, window: StepWindow) -> None:
        """A window opened at ``window.first`` (the tool has started)."""

    def window_stopped(self, window: StepWindow) -> None:
        """The window closed after ``window.last`` (the tool has written its files)."""

    def output_written(self, path: Path, format: Optional[str], window: StepWindow, role: Optional[str]) -> None:
        """The session's tool put a file of ``window`` in place and listed it in the manifest (``format``: the source
        that reads it, ``chrome_trace`` ...; ``role``: a discrete role's range, or None), on the thread that wrote it:
        a torch trace's end of a cycle or of a range, or the window's end."""
