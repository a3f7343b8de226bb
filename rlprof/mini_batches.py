"""A schedule over update mini-batches: which of a step window's mini-batches a trace keeps (verl's
``profiler.tool_config.torch.schedule``).

The training loop marks each mini-batch of an update (:func:`rlprof.mini_batch`); a tool with a schedule advances
it once per mini-batch of a role that has one. torch.profiler's own schedule runs it: ``skip_first`` mini-batches
are dropped, then each cycle idles ``wait``, warms up ``warmup`` (traced, discarded) and keeps ``active``, ``repeat``
times. Recording starts at the window's start, so with ``skip_first``, ``wait`` and ``warmup`` at 0 a trace holds
everything before the update in full plus the first ``active`` mini-batches; skipping ahead drops what ran before
the kept ones (torch keeps only a window that ends in a saved cycle), as in verl's continuous mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlprof.typed_config import bounds


@dataclass(frozen=True)
class MiniBatchSchedule:
    """verl's ``tool_config.torch.schedule``: off while ``active`` is 0 (the whole window is kept)."""

    skip_first: int = field(default=0, metadata=bounds(ge=0))
    """Mini-batches dropped at the start of the window, before the first cycle."""
    wait: int = field(default=0, metadata=bounds(ge=0))
    """Mini-batches idle (nothing traced) at the start of each cycle."""
    warmup: int = field(default=0, metadata=bounds(ge=0))
    """Mini-batches traced and discarded before the kept ones in each cycle."""
    active: int = field(default=0, metadata=bounds(ge=0))
    """Mini-batches kept per cycle; 0 turns the schedule off."""
    repeat: int = field(default=0, metadata=bounds(ge=0))
    """Cycles per window; 0 is one (verl's continuous mode: one window a step unless set)."""

    @property
    def enabled(self) -> bool:
        return self.active > 0

    @property
    def cycles(self) -> int:
        return self.repeat or 1

    def kept(self, completed: int) -> tuple[int, int]:
        """The mini-batches (first, last; counted from 0 in the window) of the cycle saved once ``completed``
        mini-batches have run: the last is the one that just ran. A cycle the window ended early holds fewer than
        ``active``, or none (``first > last``: only what ran after the last mini-batch)."""
        last = completed - 1
        cycle_length = self.wait + self.warmup + self.active
        cycle = max(last - self.skip_first, 0) // cycle_length
        return self.skip_first + cycle * cycle_length + self.wait + self.warmup, last
