"""The one interface every input format implements, and the files a run is made of.

A :class:`Source` reads one format (a torch/kineto Chrome trace, an nsys report, a CUDA memory snapshot, ...) into
its category's model: *trace* sources return a :class:`~rlprof.analysis.trace_model.TraceScan`, *memory* sources an
:class:`~rlprof.analysis.allocations.AllocationHistory` or :class:`~rlprof.analysis.allocations.HostRss`, the *metrics*
source the records of a ``metrics.jsonl``. Each output's format is written into the manifest when a tool publishes
it; a file found without a manifest line (a trace someone sent, a folder of HTA rank files) is recognised by its
content: every registered source looks at its first bytes (:meth:`Source.claims`), never at its name alone.
Files are untrusted: a source reads in bounded time and memory, runs no code and fails with one line
(:class:`SourceError`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

Category = Literal["trace", "memory", "metrics"]
HEAD_BYTES = 1 << 16
"""How much of a file (decompressed) the sources see to recognise it."""


WHOLE_TRACE = "whole trace"
"""The window name of a recording that marks no step (no ``ProfilerStep#N``, no manifest line with steps): it is
judged and named as the whole recording."""


def window_name(steps: tuple[int, ...] | list[int]) -> str:
    """``step3``, ``step2-4`` (the first and last of sorted ``steps``), or :data:`WHOLE_TRACE` without steps."""
    if not steps:
        return WHOLE_TRACE
    return f"step{steps[0]}" if len(steps) == 1 else f"step{steps[0]}-{steps[-1]}"


class SourceError(ValueError):
    """A file a source cannot read; the message says why in one line."""


@dataclass(frozen=True)
class InputFile:
    """One file of a run: listed in a manifest (with its window, rank, role) or found on its own."""

    format: str
    path: Path
    steps: tuple[int, ...] = ()
    rank: Optional[int] = None
    window: Optional[int] = None
    role: Optional[str] = None
    host: Optional[str] = None
    bytes: int = 0
    oom: bool = False
    tool: Optional[str] = None
    """The rlprof tool that wrote it, when a manifest lists it."""
    engine: Optional[str] = None
    """The inference engine that wrote it beside the trainer (``vLLM``), when a manifest says so; None: the
    process's own tool (or a file found on its own)."""
    pool: Optional[str] = None
    """The writing process's pool where an asynchronous trainer split its launch (``trainer``, ``rollout``), when a
    manifest says so."""

    @property
    def window_name(self) -> str:
        return window_name(self.steps)


@dataclass(frozen=True)
class ReadOptions:
    """What a reading may use from the user's command line."""

    nsys: Optional[str] = None
    """The nsys binary that exports ``.nsys-rep`` reports (default: ``nsys`` on PATH)."""


class Source(ABC):
    """Reads one format. Register a subclass with :func:`rlprof.analysis.sources.register_source`."""

    format: ClassVar[str]
    """The name written in manifest lines (``"format": ...``) and shown in notes."""
    category: ClassVar[Category]
    description: ClassVar[str]
    """What the format is, for messages (``a torch/kineto Chrome trace``)."""
    histories: ClassVar[bool] = False
    """A memory source that reads allocation histories (:class:`~rlprof.analysis.allocations.AllocationHistory`, what
    ``rlprof memory`` summarises); False for one that reads a process's RSS per range."""
    timeline: ClassVar[bool] = False
    """Its files are Chrome trace events that ``rlprof view`` merges onto one clock."""
    windows_compose: ClassVar[bool] = False
    """A history source whose captures of one rank's successive windows each start empty, so that what each window
    leaves alive at its end compares across them (``memory-growth``); False where a capture holds what came before
    it (a CUDA snapshot holds every live block)."""

    @abstractmethod
    def claims(self, path: Path, head: bytes) -> bool:
        """Whether ``path`` is in this format, from ``head``: its first :data:`HEAD_BYTES` bytes, decompressed
        when the file is gzipped."""

    @abstractmethod
    def read(self, file: InputFile, options: ReadOptions) -> Any:
        """The file's model (see the module doc); raises :class:`SourceError` when it cannot be read."""
