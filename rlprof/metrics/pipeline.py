"""An asynchronous RL pipeline's own metrics, under verl's names (``verl/experimental/fully_async_policy``,
``verl/trainer/ppo/v1/trainer_base.py``), computed from what each side recorded, every wait of a window counted.

Two sides, each in its own processes: the **rollouter** generates trajectories and puts them in a queue; the
**trainer** takes a batch of them, updates, and every so many updates publishes its weights to the rollouter (a
*sync*: the parameter version goes up by one). Each side keeps a :class:`PipelineSide` and wraps every wait in
``with side.waiting(reason):`` (the rollouter: ``weights`` while a sync holds it, ``queue_full``, ``staleness`` when
the staleness budget pauses it; the trainer: ``samples``). A trajectory carries a :class:`TrajectoryRecord`: the
first and last parameter versions its tokens were drawn under (a partial rollout resumed after a sync spans two or
more) and how long it took.

Definitions (``V``: the version of the weights the consuming update starts from; a trajectory drawn under versions
``[a, b]``):

- ``training/off_policy/trajectory_staleness/{mean,max,min}`` = ``V - b`` (verl v1's primary measure: the freshest
  weights it used), ``trajectory_staleness_worst/*`` = ``V - a``, ``trajectory_spans/*`` = ``b - a + 1``.
- ``fully_async/partial/total_partial_num`` = trajectories of the batch with ``b > a``, ``partial_ratio`` = that over
  the batch, ``max_partial_span`` = ``max(b - a)`` (verl's names and definitions).
- ``fully_async/count/stale_trajectory_processed`` = trajectories with ``V - b >= 1`` consumed so far (cumulative,
  as verl), ``stale_samples_processed`` = prompt groups with one or more of them, ``dropped_stale_samples`` =
  samples (prompt groups: verl's ``RolloutSample``) dropped for staleness so far, ``total_generated_samples`` =
  samples generated so far, ``current_param_version``.
- ``fully_async/processing_time/{avg,max,min,tp50,tp95,tp99}``: the batch's trajectories' generation times.
- ``fully_async/trainer/idle_ratio`` = the trainer's waits over the window's wall time; ``fully_async/total_wait_time``
  = its waits for samples in the window (seconds).
- ``fully_async/rollouter/idle_ratio`` = ``1 - active_time / version_time`` over the window since the previous sync:
  ``version_time`` its wall time, ``active_time`` = ``version_time`` less **every** wait in it. verl's rollouter keeps
  one ``idle_start_time`` and counts only the stretch from the last pause to the sync (verl #6693: both ratios near 0
  while the async run is slower than the sync one): same name, every wait counted here.
- ``fully_async/{rollouter,trainer}/wait_s/<reason>``: the window's waits by reason (rlprof's own keys, the evidence
  ``rlprof report`` names a bound with).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

PIPELINE_KEYS = (
    "fully_async/trainer/idle_ratio",
    "fully_async/total_wait_time",
    "fully_async/rollouter/idle_ratio",
    "fully_async/rollouter/active_time",
    "fully_async/rollouter/version_time",
    "training/off_policy/trajectory_staleness/mean",
    "training/off_policy/trajectory_staleness/max",
    "training/off_policy/trajectory_staleness_worst/max",
    "training/off_policy/trajectory_spans/max",
    "fully_async/partial/partial_ratio",
    "fully_async/count/dropped_stale_samples",
    "fully_async/count/total_generated_samples",
)
"""The pipeline's metrics that ``rlprof report`` and ``rlprof compare`` list first (before every other
``fully_async/*`` key in the report)."""


@dataclass(frozen=True)
class TrajectoryRecord:
    """What a trajectory carries from the rollouter to the update that consumes it."""

    group: Hashable
    """Its prompt (verl's *sample*: ``rollout.n`` trajectories share one)."""
    first_version: int
    """The parameter version its first token was drawn under."""
    last_version: int
    """The parameter version its last token was drawn under (larger after a partial rollout resumed on new
    weights)."""
    seconds: float
    """From its first token's request to its last token, pauses included (verl's ``processing_time``)."""


class PipelineSide:
    """One side's waits over the current window (thread-safe): ``with side.waiting(reason)`` around each wait,
    :meth:`window` at the window's end (a sync on the rollouter, a step on the trainer)."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        record: Optional[Callable[[dict[str, Any]], None]] = None,
    ) -> None:
        self.name = name
        self.clock = clock
        self.record = record
        """Where each wait and window goes as it ends (:class:`~rlprof.metrics.pipeline_records.PipelineLog`)."""
        self.lock = threading.Lock()
        self._started = clock()
        self._waits: dict[str, float] = defaultdict(float)
        self._open: dict[int, tuple[str, float]] = {}
        """Waits in progress, by id: their time so far counts in a window that ends during them."""

    @contextlib.contextmanager
    def waiting(self, reason: str) -> Iterator[None]:
        token = object()
        with self.lock:
            began = self.clock()
            self._open[id(token)] = (reason, began)
        try:
            yield
        finally:
            with self.lock:
                reason, since = self._open.pop(id(token))  # since: this window's start, if it began in an earlier
                ended = self.clock()
                self._waits[reason] += ended - since
            if self.record is not None:
                self.record({"event": "wait", "side": self.name, "reason": reason, "began": began, "ended": ended})

    def window(self, **labels: int) -> tuple[float, dict[str, float]]:
        """(the window's wall time, its waits by reason), and a new window starts now. A wait still in progress
        counts up to now here and from now in the next window. ``labels`` name the window in its record."""
        with self.lock:
            now = self.clock()
            waits = dict(self._waits)
            for key, (reason, since) in list(self._open.items()):
                waits[reason] = waits.get(reason, 0.0) + now - since
                self._open[key] = (reason, now)
            began, elapsed, self._started = self._started, now - self._started, now
            self._waits = defaultdict(float)
        if self.record is not None:
            self.record({"event": "window", "side": self.name, "began": began, "ended": now, **labels})
        return elapsed, waits


class _Meter:
    """One side's meter: its :class:`PipelineSide` and ``with meter.waiting(reason):`` around each wait."""

    def __init__(
        self, side: str, clock: Callable[[], float], record: Optional[Callable[[dict[str, Any]], None]]
    ) -> None:
        self.side = PipelineSide(side, clock, record)

    def waiting(self, reason: str) -> contextlib.AbstractContextManager[None]:
        return self.side.waiting(reason)


class RolloutMeter(_Meter):
    """The rollouter's accounting: its waits, what it generated and dropped; :meth:`synced` at each sync."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, record: Optional[Callable[[dict[str, Any]], None]] = None
    ) -> None:
        super().__init__("rollouter", clock, record)
        self.generated = 0
        self.dropped_stale = 0
        self.version = 0

    def finished(self, samples: int = 1, *, dropped_stale: bool = False) -> None:
        """``samples`` (prompt groups, verl's unit) came out of generation; ``dropped_stale``: dropped there for
        staleness, not queued."""
        with self.side.lock:
            self.generated += samples
            if dropped_stale:
                self.dropped_stale += samples

    def synced(self, version: int) -> dict[str, float]:
        """The window since the previous sync, as verl's rollouter reports it at ``reset_staleness``, every wait
        counted; ``version``: the parameter version it generates under from now."""
        elapsed, waits = self.side.window(version=version)
        self.version = version
        waited = sum(waits.values())
        active = max(elapsed - waited, 0.0)
        metrics = {
            "fully_async/rollouter/version_time": elapsed,
            "fully_async/rollouter/active_time": active,
            "fully_async/rollouter/idle_ratio": 1.0 - active / elapsed if elapsed > 0 else 0.0,
            "fully_async/count/total_generated_samples": float(self.generated),
            "fully_async/count/dropped_stale_samples": float(self.dropped_stale),
        }
        metrics.update({f"fully_async/rollouter/wait_s/{reason}": s for reason, s in sorted(waits.items())})
        return metrics


class TrainerMeter(_Meter):
    """The trainer's accounting: its waits, the staleness of what it consumed; :meth:`consumed` for each batch,
    :meth:`step_done` at each step's end."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, record: Optional[Callable[[dict[str, Any]], None]] = None
    ) -> None:
        super().__init__("trainer", clock, record)
        self.version = 0
        """The version of the weights the next update starts from (one more at each sync)."""
        self.stale_trajectories = 0
        self.stale_groups = 0

    def consumed(self, batch: Sequence[TrajectoryRecord]) -> dict[str, float]:
        """Staleness, partial rollouts and generation times of ``batch``, consumed by an update from
        :attr:`version`."""
        if not batch:
            return {}
        first = np.array([t.first_version for t in batch])
        last = np.array([t.last_version for t in batch])
        staleness, worst, spans = self.version - last, self.version - first, last - first + 1
        stale = staleness >= 1
        self.stale_trajectories += int(stale.sum())
        self.stale_groups += len({t.group for t, s in zip(batch, stale, strict=True) if s})
        seconds = np.array([t.seconds for t in batch])
        metrics = {
            **_spread("training/off_policy/trajectory_staleness", staleness),
            **_spread("training/off_policy/trajectory_staleness_worst", worst),
            **_spread("training/off_policy/trajectory_spans", spans),
            "fully_async/partial/total_partial_num": float((spans > 1).sum()),
            "fully_async/partial/partial_ratio": float((spans > 1).mean()),
            "fully_async/partial/max_partial_span": float((last - first).max()),
            "fully_async/count/stale_trajectory_processed": float(self.stale_trajectories),
            "fully_async/count/stale_samples_processed": float(self.stale_groups),
            "fully_async/count/current_param_version": float(self.version),
            "fully_async/processing_time/avg": float(seconds.mean()),
            "fully_async/processing_time/max": float(seconds.max()),
            "fully_async/processing_time/min": float(seconds.min()),
        }
        for q in (50, 95, 99):
            metrics[f"fully_async/processing_time/tp{q}"] = float(np.percentile(seconds, q))
        return metrics

    def synced(self) -> None:
        """The trainer published its weights: updates from now start from the next version."""
        self.version += 1

    def step_done(self, step: int) -> dict[str, float]:
        """The trainer's waits over step ``step``'s window: its idle ratio, its wait for samples, the rest by
        reason."""
        elapsed, waits = self.side.window(step=step)
        metrics = {
            "fully_async/trainer/idle_ratio": sum(waits.values()) / elapsed if elapsed > 0 else 0.0,
            "fully_async/total_wait_time": waits.get("samples", 0.0),
        }
        metrics.update({f"fully_async/trainer/wait_s/{reason}": s for reason, s in sorted(waits.items())})
        return metrics


def _spread(prefix: str, values: np.ndarray) -> dict[str, float]:
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }
