"""``marked_timer``: time a block into a dict and record it as an rlprof range, in one ``with``."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Optional

from rlprof.annotate import DEFAULT_ROLE, profile_range


def _cuda_in_use() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    import torch

    torch.cuda.synchronize()


@contextmanager
def marked_timer(
    name: str,
    timing_raw: MutableMapping[str, float],
    role: Optional[str] = None,
    color: Optional[str | int] = None,
    sync: Optional[bool] = None,
) -> Iterator[None]:
    """Add the block's wall time (seconds) to ``timing_raw[name]`` and record it as the range ``role/name``.

    Times add up when the same name is timed twice in a step. ``sync`` waits for queued GPU work before the clock
    starts and stops, so device time is counted; it defaults to on when CUDA is in use. The time is recorded
    even when the block raises; the exception then passes through unchanged. Nesting works (each level records
    its own name). ``role`` defaults to rlprof's default role, ``"default"``.
    """
    if sync is None:
        sync = _cuda_in_use()
    with profile_range(name, role=role or DEFAULT_ROLE, color=color):
        if sync:
            _synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                _synchronize()
            timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start
