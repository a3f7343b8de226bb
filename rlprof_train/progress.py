"""Where each rank is (step and phase), kept in the process group's key-value store, so that when a collective times
out the ranks still running can say which rank stopped answering and where every rank was.

Each rank writes its own key at the start of every phase (one small store write, a fraction of a millisecond), and a
daemon thread writes a heartbeat every ``HEARTBEAT_S``: a rank blocked in a collective keeps beating, a stopped,
frozen or dead one does not. The store lives in the launcher's agent (torchrun) or rank 0.

The heartbeat ends with :meth:`Progress.close` (or, where nobody called it, before the interpreter winds down): a
daemon thread still inside a store call when Python finalizes aborts the process ("terminate called without an active
exception", SIGABRT) as it returns into the interpreter.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from typing import Any, Optional

from rlprof.watchdog import Ordinal, Position

KEY = "rlprof/progress/{rank}"
ALIVE = "rlprof/alive/{rank}"
HEARTBEAT_S = 2.0
CLOSE_WAIT_S = 5.0
"""The longest :meth:`Progress.close` waits for a heartbeat under way (a store call takes milliseconds, or fails
when the store's host is gone)."""
TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded", "connection reset", "connection closed")


class Progress:
    """This rank's position, published; the others', read back after a failure."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.store = _default_store() if world_size > 1 else None
        self.here = Position(rank, 0, "start", time.time())
        self.role = ""
        """The role of the phase this rank is in (``""`` outside a step's phases)."""
        self._ordinal = Ordinal()
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        if self.store is not None:
            self._heartbeat = threading.Thread(target=self._beat, name="rlprof-heartbeat", daemon=True)
            self._heartbeat.start()
            atexit.register(self.close)

    def _beat(self) -> None:
        while self.store is not None and not self._stop.is_set():
            try:
                self.store.set(ALIVE.format(rank=self.rank), str(time.time()))
            except Exception:  # noqa: BLE001  (the store's host is gone: nothing to tell anyone)
                return
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        """Stop the heartbeat and wait for its thread (at most ``CLOSE_WAIT_S``)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=CLOSE_WAIT_S)
            self._heartbeat = None
            atexit.unregister(self.close)

    def at(self, step: int, phase: str, role: str = "") -> None:
        """This rank enters ``phase`` (of ``role``, for a step's phases) of ``step``."""
        self.here = Position(self.rank, step, phase, time.time(), self._ordinal.next(step))
        self.role = role
        if self.store is not None:
            try:
                self.store.set(
                    KEY.format(rank=self.rank), json.dumps([step, phase, self.here.since, self.here.ordinal])
                )
            except Exception:  # noqa: BLE001  (the beacon must never stop training)
                self.store = None

    def silent(self) -> list[int]:
        """Ranks whose heartbeat stopped (none for 3 beats): stopped, frozen or dead processes."""
        if self.store is None:
            return []
        now, found = time.time(), []
        for rank in range(self.world_size):
            key = ALIVE.format(rank=rank)
            try:
                beat = float(self.store.get(key)) if self.store.check([key]) else 0.0
            except Exception:  # noqa: BLE001
                continue
            if now - beat > 3 * HEARTBEAT_S:
                found.append(rank)
        return found

    def positions(self) -> list[Position]:
        """Every rank's last published position (ranks that never published are left out)."""
        if self.store is None:
            return [self.here]
        found = []
        for rank in range(self.world_size):
            key = KEY.format(rank=rank)
            try:
                if not self.store.check([key]):
                    continue
                step, phase, since, ordinal = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001  (the store's host may be gone too)
                continue
            found.append(Position(rank, int(step), str(phase), float(since), int(ordinal)))
        return found

    def stall_report(self, error: BaseException) -> Optional[str]:
        """One line when ``error`` is a collective that timed out (or lost its peer): this rank's position, the
        rank(s) that stopped answering (the ones behind, or whose position is oldest) and where they were."""
        text = f"{type(error).__name__}: {error}".lower()
        if self.world_size < 2 or not any(word in text for word in TIMEOUT_WORDS):
            return None
        now = time.time()
        others = [p for p in self.positions() if p.rank != self.rank]
        silent = set(self.silent())
        behind = [p for p in others if p.order() < self.here.order()]
        stuck = [p for p in others if p.rank in silent] or behind or sorted(others, key=lambda p: p.since)[:1]
        where = "; ".join(f"rank {p.rank} in {p.phase} of step {p.step} for {now - p.since:.0f} s" for p in stuck)
        named = ", ".join(str(p.rank) for p in stuck) or "unknown (no rank's position could be read)"
        return (
            f"a collective did not complete within trainer.collective_timeout_s={self.timeout_s:g} s while rank "
            f"{self.rank} was in {self.here.phase} of step {self.here.step}; stopped answering: rank {named}"
            + (f" ({where})" if where else "")
        )


def _default_store() -> Any:
    """The default process group's store (torch keeps it private), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None
